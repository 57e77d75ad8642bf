r"""Measures on a GPU (or TPU) everything this project can show there, in about 9 minutes.

  python scripts/accelerator_report.py --output_dir=reports/h100 --wheels=wheels
  python scripts/accelerator_report.py --dry_run --output_dir=/tmp/dry   # CPU, toy sizes

Stages, in order, each in its own process with its own time cap (seconds), so that a failure or
a hang in one costs one line and the rest still run. A plain call (caps summing to 535 s): env 15
(device, driver, CUDA and package versions, a bf16 matmul), tests 75 (the kernel tests of
tests/test_kernel.py, compiled for the device), attention 135 (strided and fixed through Pallas
against cuDNN's dense attention, bf16 forward + backward at 16k, jax's FlashAttention-3 on
Mosaic GPU beside cuDNN, then the kernel variants side by side at 16k, then 64k with the
likeliest winners, 8k and 32k; the fastest kernel per pattern and length; each Pallas row beside
its committed prediction, docs/cost_model.md), counters 80 (Nsight Compute), train_step 130 (the
one-GPU preset's step, and the paper's enwik8 model at 16,384 bytes: fixed through XLA and
Pallas against dense, a kernel profile of the fixed and dense steps, a dense check of one step
through cuDNN, XLA and the reference), million 100. Named with --stages: flex 70 (PyTorch
FlexAttention with the same block masks, and PyTorch's dense SDPA), preset 175
(configs/bytes.py:size=gpu trained on the code corpus with the
faster implementation, for at most 90 s of steps and as many as the measured step says fit
before the cap with a 1.2x margin; its test bits by copy distance, a 1,000-byte sample).
One stage runs only when named, as it needs a call of its own: study 450 (the long-context
study, sparse_jax/bench/long_study.py: size=gpu trained for equal wall time at context 16,384
strided and dense, and at 4,096 strided; test bits in plain windows, at a matched guaranteed
context, at Table 4's contexts and by copy distance):

  python scripts/accelerator_report.py --stages=env,study --output_dir=reports/h100_study

--stages runs a subset (e.g. to rerun one; each stage named once, and at least one),
--caps=STAGE=SECONDS,... changes caps, --budget_s caps the whole run, --profile adds
jax.profiler traces of a few training steps (the preset's and the paper's 16k step, Pallas) to
OUTPUT_DIR/profile and 40 s to train_step's cap.

Each stage ends "ok" only if it measured everything it planned; otherwise "partial" (a row
not measured, "not run: stage time up" included; training cut by the cap before its steps or
its validation; no test figure or sample) or "failed" (it ran no test, crashed, or measured
nothing), with the reason in one line; "skipped" when it has nothing to measure here (flex
without torch). The last line (and results.md's verdict) says "every stage ok", or lists the
stages that are not ok, and names every stage skipped ("every other stage ok; not every stage
measured: flex skipped: torch is not installed ..."). The exit status is 0 when every stage is
ok or skipped and something was measured; 1 when a stage is not ok, or when no stage measured
anything: every stage asked for was skipped, or all but env (which describes the machine and
measures nothing of the project: --stages=env,flex without torch measured nothing; --stages=env
alone measured what it was asked); 2 for a bad argument (caps, budget, stages empty, unknown or
repeated, a --wheels folder whose .whl files are not all readable zips, an --output_dir that is
a file, cannot be written or holds a report: refused in one line before anything runs, nothing
written); 130 or 143 when stopped by SIGINT or SIGTERM. Stopping it kills the running stage and
everything it started (each stage runs in its own session), and the temporary folder
(sparse_jax_accel_* in $TMPDIR: wheels, the preset's run, the stages' own temporary files) goes
in every case. Writes results.md (the verdict, the statuses and the summary tables),
results.json (every figure), log.txt (every stage's output), sample.txt and, with --profile,
profile/ to --output_dir, also when stopped. A folder that already holds any of these is refused
unless --overwrite is given; then the old report's files are removed before the first stage
starts, so the folder never mixes two runs (other files there stay).

The machine needs JAX for its accelerator, flax, optax, orbax-checkpoint, absl-py, tqdm,
matplotlib and pillow (torch and triton for the flex stage). What it lacks travels as wheels:
--wheels=FOLDER installs every wheel there into a temporary folder put first on the path, with
no network and no dependency resolution, leaving the machine's own jax and CUDA untouched. Fill
the folder on a machine with network (README, "Accelerators"), with what is missing only:
a carried package wins over the machine's, and flax 0.12.8 carried beside jax 0.11.2 failed to
import (jax.experimental.hijax), where the machine's own flax 0.12.10 worked.
"""

import os
import signal
import sys

# On a borrowed machine nothing is installed: the repository itself is the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from sparse_jax import cli  # noqa: E402

_OUTPUT_DIR = flags.DEFINE_string("output_dir", "reports/accelerator", "Where the report goes.")
_WHEELS = flags.DEFINE_string("wheels", None, "A folder of wheels to install first (no network).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Every stage at toy size on the CPU (Pallas in "
                             "interpret mode), in a few minutes: checks the command end to end.")
_STAGES = flags.DEFINE_list("stages", None, "Stages to run (default: env, tests, attention, "
                            "counters, train_step, million, in that order; flex, preset and "
                            "study only when named, e.g. env,study).")
_BUDGET = flags.DEFINE_float("budget_s", None, "Seconds for the whole run (default: the sum of "
                             "the stages' caps, 535 for the plain call).")
_CAPS = flags.DEFINE_list("caps", None, "Stage caps to change, as STAGE=SECONDS (e.g. "
                          "tests=150,flex=110).")
_PROFILE = flags.DEFINE_bool("profile", False, "Also write jax.profiler traces of a few steps "
                             "of the preset's and the paper's 16k training steps to "
                             "OUTPUT_DIR/profile (adds 40 s to the train_step cap).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the report already in --output_dir "
                               "(its files are removed before the first stage starts).")


def check(argv):
    """Every flag, before any stage starts or anything is written (run_report checks again)."""
    cli.no_arguments(argv)
    from sparse_jax.bench import accelerator

    cli.output_dir("output_dir", _OUTPUT_DIR.value, overwrite=None)  # empty: refused
    stages = accelerator.STAGES if _STAGES.value is None else tuple(_STAGES.value)
    try:  # a bad argument: exit status 2
        accelerator.check_arguments(stages, accelerator.parse_caps(_CAPS.value), _BUDGET.value,
                                    _WHEELS.value)
        accelerator.check_output_dir(_OUTPUT_DIR.value, _OVERWRITE.value)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from sparse_jax.bench import accelerator

    # --stages= (empty) is refused by the driver, not taken for the default list
    stages = accelerator.STAGES if _STAGES.value is None else tuple(_STAGES.value)
    try:  # every argument is checked before a stage starts; nothing is written if one is bad
        report = accelerator.run_report(
            _OUTPUT_DIR.value, wheels=_WHEELS.value, dry_run=_DRY_RUN.value, stages=stages,
            budget_s=_BUDGET.value, caps=accelerator.parse_caps(_CAPS.value),
            profile=_PROFILE.value, overwrite=_OVERWRITE.value)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    wrote = f"Wrote {_OUTPUT_DIR.value}/results.md, results.json, log.txt"
    ok, verdict = accelerator.verdict(report)
    if report.get("interrupted"):
        print(f"{wrote}; interrupted by {report['interrupted']}; {verdict}")
        sys.exit(128 + signal.Signals[report["interrupted"]])
    print(f"{wrote}; {verdict}")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main, check=check)
