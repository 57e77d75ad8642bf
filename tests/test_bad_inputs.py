"""A few cases of the command-line bad-input harness (`tests/bad_inputs.py`), so CI exercises it:
each bad input ends in one `error: ` line, no traceback, and nothing in the case's folder lost.
The full run (every script, 200+ cases, ~10 minutes on 2 cores) is manual:

  python tests/bad_inputs.py [--only=SUBSTR] [--output=results.json]
"""

import pytest

import bad_inputs

# One or two per kind of failure: flags, config fields and checks, data, workdir, a refused
# rerun of a trained run (config.json left byte-identical), evaluate, sample, describe, plot.
SUBSET = [
    "train/unknown flag",
    "config/unknown field",
    "check/warmup >= total_steps",
    "data/truncated .gz",
    "workdir/foreign files",
    "rerun/forbidden change: seed",
    "evaluate/workdir does not exist",
    "sample/workdir empty",
    "describe/bad pattern",
]


@pytest.mark.slow
def test_bad_inputs_subset():
    cases = [c for c in bad_inputs.build_cases() if c.name in SUBSET]
    assert sorted(c.name for c in cases) == sorted(SUBSET)
    results = bad_inputs.run_cases(cases)
    failed = [f"{r['name']}: {'; '.join(r['problems'])} (got: {r['got']})"
              for r in results if r["verdict"] != "ok"]
    assert not failed, "\n".join(failed)
