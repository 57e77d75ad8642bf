"""A few cases of the command-line bad-input harness (`tests/bad_inputs.py`), so CI exercises it:
each bad input ends in one `error: ` line, no traceback, and nothing in the case's folder lost.
The full run (every script, 200+ cases, ~10 minutes on 2 cores) is manual:

  python tests/bad_inputs.py [--only=SUBSTR] [--output=results.json]

And every flag of every script, and every config field, given the values users mistype
(`tests/bad_flags.py`, its table `tests/flag_table.py`): one process per script, each value
checked by the script's own check without the work behind it (all of them in under a minute on
2 cores). A script or flag that the table does not know fails here.
"""

import pytest

import bad_flags
import bad_inputs
import flag_table

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


@pytest.mark.slow  # one process per script
@pytest.mark.parametrize("script", bad_flags.scripts())
def test_every_flag_is_refused_in_one_line_before_any_work_or_accepted_for_a_reason(script):
    """Each value of the table's kind for each flag of `script` (0, -1, 10^12, nan, inf and text
    for a number; an empty list, an item twice, an unknown item; a missing path, a file for a
    folder, a folder for a file, a folder holding output; for train.py every config field and
    config argument too) ends in one `error:` line naming the flag, a non-zero exit, nothing
    written and no child process or compile, unless the table says why it is valid."""
    problems = bad_flags.failures(bad_flags.run_script(script))
    assert not problems, "\n".join(problems)


def test_the_table_knows_every_config_field():
    """A field added to configs/common.py needs its entry (the values it is tried with)."""
    fields = flag_table.config_fields()
    assert sorted(set(fields) - set(flag_table.CONFIG)) == []
    assert sorted(set(flag_table.CONFIG) - set(fields)) == []


@pytest.mark.slow  # starts the script's process
def test_a_flag_the_table_does_not_know_fails():
    """The table is checked against absl's registry, not against itself: a script with a flag
    it has no entry for is a failure, and so is a script it does not know at all."""
    report = bad_flags.run_script("cost_model", without=["cost_model.starts"])
    assert any("without an entry" in p and "starts" in p for p in report["problems"])
    report = bad_flags.run_script("cost_model", without=["cost_model"])
    assert any("has no entry for scripts/cost_model.py" in p for p in report["problems"])
