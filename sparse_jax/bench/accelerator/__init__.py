"""The accelerator report (scripts/accelerator_report.py): everything a borrowed GPU (or TPU) can
show about this project, measured by one command in about 9 minutes, and judged: a stage is
"ok" only if it measured everything it planned, and a stage skipped (flex without torch) is
named in the verdict.

  driver      run_report: arguments and the report folder checked before anything runs (a
              folder that holds a report is refused unless overwrite is given, and then its
              old report's files go first); each stage in its own process (its own session)
              with its own time cap, so a stage that fails or hangs costs one line and the rest
              go on; a SIGINT/SIGTERM stops the running stage's processes; the temporary folder
              goes in every case; writes the report folder
  plan        the stages (MODULES, in order; STAGES, the default set), their caps, plan_for
  summary     results.md: the verdict (every stage ok; the stages that are not, and why; the
              stages skipped, and "no stage measured anything" when all were), the stages'
              statuses, then each stage's section
  common      the chips' bf16 peaks, result lines, the repo's scripts as children
  env, tests, attention, flex, train_step, preset: one module per stage (what `plan` says
              each has), in the order they run:

  env         device, driver, CUDA, jax/jaxlib/flax/torch/triton versions, the chip's bf16
              peak and a measured bf16 matmul
  tests       tests/test_kernel.py with the kernels compiled (not interpreted): the dense
              reference checks at float32 and bfloat16; no test run is a failure
  attention   forward + backward, bfloat16, B=1 H=8 d=64: strided and fixed through
              Pallas against cuDNN's fused dense attention at 16k, jax's FlashAttention-3 on
              Mosaic GPU beside cuDNN (``mgpu``), the kernel variants side by side at 16k,
              then 64k, 8k and 32k; each Pallas row beside its committed prediction
              (``bench.predictions``)
  flex        the same patterns in PyTorch FlexAttention compiled with the same block mask
              (built compiled, without an n × n tensor), and PyTorch's fused dense attention
  train_step  a training step (loss, gradients, AdamW) of the paper's enwik8 model at 16,384
              bytes, batch 2: fixed through XLA and Pallas, and dense (cuDNN); also the one-GPU
              preset's step, whose measured time sets the next stage's steps; a kernel profile
              of the paper's fixed and dense steps and a dense check of one step through cuDNN,
              XLA and the reference (``dense_check``); with --profile, jax.profiler traces of
              a few steps
  preset      configs/bytes.py:size=gpu trained on the shipped code corpus with the faster
              implementation of the last stage, for as many steps as fit before the cap by the
              measured step with a margin (scripts/train.py), test bits with the byte classes
              (scripts/evaluate.py), and a 1,000-byte sample (scripts/sample.py)

A stage's process is `python -m sparse_jax.bench.accelerator STAGE PLAN_JSON`; it prints its
results as JSON lines (the last one wins; partial results survive a cap). Nothing here imports
JAX or torch before a stage has started in its own process.
"""

from sparse_jax.bench.accelerator.common import CODE_CORPUS, REPO, peak_tflops
from sparse_jax.bench.accelerator.driver import (
    REPORT_FILES,
    TEMP_PREFIX,
    check_arguments,
    check_output_dir,
    check_wheels,
    install_wheels,
    parse_caps,
    run_report,
)
from sparse_jax.bench.accelerator.flex import flex_mask_mod
from sparse_jax.bench.accelerator.plan import CAPS, DRY_CAPS, MODULES, STAGES, plan_for
from sparse_jax.bench.accelerator.summary import (
    measured_nothing,
    not_ok,
    skipped,
    summary_markdown,
    verdict,
)


def run_stage(name: str, plan: dict) -> dict:
    """One stage in this process (see `plan`'s docstring)."""
    import os

    if plan.get("dry_run"):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return MODULES[name].run(plan)


__all__ = ["CAPS", "CODE_CORPUS", "DRY_CAPS", "MODULES", "REPO", "REPORT_FILES", "STAGES",
           "TEMP_PREFIX", "check_arguments", "check_output_dir", "check_wheels", "flex_mask_mod",
           "install_wheels", "measured_nothing", "not_ok", "parse_caps", "peak_tflops",
           "plan_for", "run_report", "run_stage", "skipped", "summary_markdown", "verdict"]
