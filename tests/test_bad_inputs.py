"""A few cases of the command-line bad-input harness (`tests/bad_inputs.py`), so CI exercises it:
each bad input ends in one `error: ` line, no traceback, and nothing in the case's folder lost.
The full run (every script, 200+ cases, ~10 minutes on 2 cores) is manual:

  python tests/bad_inputs.py [--only=SUBSTR] [--output=results.json]
"""

import pytest

import bad_inputs

# A config field, damaged data, a foreign workdir, a refused rerun of a trained run (config.json
# left byte-identical), a script other than train.py, a folder of pictures of two sizes, a
# context the seq devices cannot split and a run split over 2 (scripts/train.py end to end);
# the library tests cover the rest.
SUBSET = [
    "config/unknown field",
    "data/truncated .gz",
    "workdir/foreign files",
    "rerun/forbidden change: seed",
    "sample/workdir empty",
    "images/mixed sizes",
    "check/seq that does not split the context",
    "train/each sequence split over 2 devices",
]


@pytest.mark.slow
def test_bad_inputs_subset():
    cases = [c for c in bad_inputs.build_cases() if c.name in SUBSET]
    assert sorted(c.name for c in cases) == sorted(SUBSET)
    results = bad_inputs.run_cases(cases)
    failed = [f"{r['name']}: {'; '.join(r['problems'])} (got: {r['got']})"
              for r in results if r["verdict"] != "ok"]
    assert not failed, "\n".join(failed)
