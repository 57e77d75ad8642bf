r"""Trains the same model once per attention pattern and compares them (paper Table 2); all
logic lives in `sparse_jax.bench.pattern_study`.

  python scripts/compare_patterns.py --config=configs/quickstart.py \
      --workdir=workdirs/patterns --patterns=dense,strided,fixed --steps=500

Each pattern is an ordinary training run in WORKDIR/<pattern>/, trained in its own process on the
same data, seed and steps, then evaluated on the whole valid split. Writes results.md,
results.json and valid_bits.png (validation bits against steps and wall time) to --output_dir
(default: --workdir, whose results a rerun updates; an --output_dir elsewhere that holds them
is refused unless --overwrite is given). --config.FIELD=VALUE overrides apply to every
pattern; the pattern itself comes from --patterns (the config file's `pattern=` variant).
Running the same command again reuses finished patterns and resumes interrupted ones.
--minutes=M instead trains every pattern for the same wall time (each its own number of steps,
from a timing of it first: Table 2's question at equal cost).
"""

import os
import sys

from absl import app, flags
from ml_collections import config_flags

from sparse_jax import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file (configs/*.py), "
                                          "optionally with arguments: FILE:key=value,...",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Folder for the runs, one subfolder per pattern.")
_PATTERNS = flags.DEFINE_list("patterns", ["dense", "strided", "fixed"], "Patterns to compare.")
_STEPS = flags.DEFINE_integer("steps", None, "Training steps of every pattern (default: the "
                              "config's total_steps).", lower_bound=1)
_MINUTES = flags.DEFINE_float("minutes", None, "Train every pattern for this many minutes of "
                              "wall time instead of a number of steps (each pattern's steps come "
                              "from timing it first; at most a day, 1,440).")
MAX_MINUTES = 24 * 60
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.md, results.json and "
                                  "valid_bits.png go (default: --workdir).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the results already in an explicit "
                               "--output_dir (those in --workdir are the study's own: a rerun "
                               "updates them).")
flags.mark_flags_as_required(["config", "workdir"])


def check(argv):
    """Every flag and every pattern's config (`run.setup.complete`, as train.py would), and the
    runs already in --workdir, before any run starts or anything is written."""
    cli.no_arguments(argv)
    from sparse_jax.bench import pattern_study as study

    if _MINUTES.value is not None and not 0 < _MINUTES.value <= MAX_MINUTES:
        raise app.UsageError(f"--minutes={_MINUTES.value:g}: give minutes in (0, {MAX_MINUTES:,}]"
                             " (a day) of training for every pattern")
    if _MINUTES.value is not None and _STEPS.value is not None:
        raise app.UsageError("give either --steps or --minutes, not both")
    cli.output_dir("workdir", _WORKDIR.value, overwrite=None)
    cli.output_dir("output_dir", _OUTPUT_DIR.value, holds=(
        "results.md", "results.json", "valid_bits.png"), overwrite=_OVERWRITE.value or (
        _OUTPUT_DIR.value is not None and _WORKDIR.value is not None
        and os.path.realpath(_OUTPUT_DIR.value) == os.path.realpath(_WORKDIR.value)))
    try:
        study.check_patterns(_PATTERNS.value)
    except ValueError as e:
        raise app.UsageError(f"--patterns: {e}") from None
    config_flag = flags.FLAGS["config"]
    by_pattern = study.pattern_configs(
        config_flags.get_config_filename(config_flag), _PATTERNS.value, steps=_STEPS.value,
        overrides=config_flags.get_override_values(config_flag))
    if _MINUTES.value is None:
        for pattern, config in by_pattern.items():  # refuses a run of another config there
            study.run_status(os.path.join(_WORKDIR.value, pattern), config)


def main(argv):
    from sparse_jax.bench import pattern_study as study

    config_flag = flags.FLAGS["config"]
    try:
        result = study.compare_patterns(
            config_flags.get_config_filename(config_flag), _WORKDIR.value, _PATTERNS.value,
            steps=_STEPS.value, minutes=_MINUTES.value,
            overrides=config_flags.get_override_values(config_flag),
            output_dir=_OUTPUT_DIR.value, command=" ".join(["python", *sys.argv]))
    except RuntimeError as e:  # a pattern's run failed (its log says why)
        cli.fail(str(e))
    except KeyboardInterrupt as e:  # the run in progress saves a checkpoint on the same Ctrl-C
        cli.fail("interrupted; run the same command to resume",
                 128 + getattr(e, "signal", 2))  # 130, or 143 for SIGTERM (cli.Stopped)
    print(study.markdown(result["patterns"]))
    print("Wrote " + ", ".join(result["outputs"].values()))


if __name__ == "__main__":
    cli.run(main, huge_pages=True, check=check)
