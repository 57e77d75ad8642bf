r"""Measures on a GPU (or TPU) everything this project can show there, in about 8 minutes.

  python scripts/accelerator_report.py --output_dir=reports/h100 --wheels=wheels
  python scripts/accelerator_report.py --dry_run --output_dir=/tmp/dry   # CPU, toy sizes, ~1 min

Stages, in order, each in its own process with its own time cap (seconds), so that a failure or
a hang in one costs one line and the rest still run: env 15 (device, driver, CUDA and package
versions, a bf16 matmul), tests 90 (the kernel tests of tests/test_kernel.py, compiled for the
device), attention 70 (strided and fixed, XLA and Pallas, against cuDNN's dense attention; bf16
forward + backward at 16k, 8k, 32k, 64k, then other kernel tiles at 16k), flex 70 (PyTorch
FlexAttention with the same block masks, and PyTorch's dense SDPA), train_step 85 (the one-GPU
preset's step, and the paper's enwik8 model at 16,384 bytes: fixed through XLA and Pallas
against dense), preset 150 (configs/bytes.py:size=gpu trained for 90 s of steps on the code
corpus with the faster implementation, its test bits by copy distance, a 1,000-byte sample).
--stages runs a subset (e.g. to rerun one that failed), --caps=STAGE=SECONDS,... changes caps,
--budget_s caps the whole run. Writes results.md (the summary tables), results.json (every
figure), log.txt (every stage's output) and sample.txt to --output_dir.

The machine needs JAX for its accelerator, flax, optax, orbax-checkpoint, absl-py, tqdm,
matplotlib and pillow (torch and triton for the flex stage). What it lacks travels as wheels:
--wheels=FOLDER installs every wheel there into a temporary folder put first on the path, with
no network and no dependency resolution, leaving the machine's own jax and CUDA untouched. Fill
the folder on a machine with network (README, "Accelerators"), with what is missing only:
a carried package wins over the machine's, and flax 0.12.8 carried beside jax 0.11.2 failed to
import (jax.experimental.hijax), where the machine's own flax 0.12.10 worked.
"""

import os
import sys

# On a borrowed machine nothing is installed: the repository itself is the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from sparse_jax import cli  # noqa: E402

_OUTPUT_DIR = flags.DEFINE_string("output_dir", "reports/accelerator", "Where the report goes.")
_WHEELS = flags.DEFINE_string("wheels", None, "A folder of wheels to install first (no network).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Every stage at toy size on the CPU (Pallas in "
                             "interpret mode), in about a minute: checks the command end to end.")
_STAGES = flags.DEFINE_list("stages", None, "Stages to run (default: all, in order): env, tests, "
                            "attention, flex, train_step, preset.")
_BUDGET = flags.DEFINE_float("budget_s", None, "Seconds for the whole run (default: the sum of "
                             "the stages' caps, 480; 260 for --dry_run).")
_CAPS = flags.DEFINE_list("caps", None, "Stage caps to change, as STAGE=SECONDS (e.g. "
                          "tests=150,flex=110).")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from sparse_jax.bench import accelerator

    try:
        caps = accelerator.parse_caps(_CAPS.value)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    report = accelerator.run_report(_OUTPUT_DIR.value, wheels=_WHEELS.value,
                                    dry_run=_DRY_RUN.value,
                                    stages=tuple(_STAGES.value or accelerator.STAGES),
                                    budget_s=_BUDGET.value, caps=caps)
    failed = [name for name, r in report["stages"].items() if r["status"] not in ("ok",
                                                                                 "skipped")]
    print(f"Wrote {_OUTPUT_DIR.value}/results.md, results.json, log.txt"
          + (f"; stages not ok: {', '.join(failed)}" if failed else "; every stage ok"))


if __name__ == "__main__":
    cli.run(main)
