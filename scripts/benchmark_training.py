r"""Trains the same small model with this project's trainer and with a PyTorch eager twin.

  pip install -r requirements-bench.txt   # torch, for the twin only
  python scripts/benchmark_training.py --seq_lens=64,256,1024 --steps=2000,300,60 \
      --output_dir=docs/benchmarks/training

The model is nanoGPT's CPU recipe (4 layers, d=128, 4 heads, batch 12, AdamW with warmup and
cosine decay, gradient clipping) on the shipped corpus. The twin
(`sparse_jax/bench/torch_twin.py`) has the same architecture (dense causal attention), starts
from the same parameters and reads the same batches. `scripts/train.py`'s trainer runs with
dense attention and with the strided pattern (stride ~ sqrt(n)), each in a fresh process;
`--baselines=eager,compile` adds the twin under `torch.compile` (needs a C++ compiler).
Prints steps/s, tokens/s and validation bits of every run and writes results.md and
results.json to --output_dir. "× PyTorch" is a ratio only to a twin run that was measured: one
that failed (torch not installed) reads "not measured", and the script then exits 1 after
writing its results, unless --baseline_optional is given.
"""

import sys

from absl import app, flags

from sparse_jax import cli, sharding
from sparse_jax.bench import tools, training

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["64", "256", "1024"], "Context lengths.")
_STEPS = flags.DEFINE_list("steps", ["2000"], "Training steps of every run: one number, or one "
                           "per context length.")
cli.list_rules(_STEPS, repeats="one number per context length: two may train as long")
_PATTERNS = flags.DEFINE_list("patterns", ["dense", "strided"], "Attention of this project's "
                              "runs (the twin is always dense): dense, strided or fixed, each "
                              "optionally @native (the CPU kernels) or @xla.")
_BASELINES = flags.DEFINE_list("baselines", ["eager"], "The PyTorch twin's modes: eager and/or "
                               "compile (torch.compile); x PyTorch is against the first.")
_DATA = flags.DEFINE_string("data", "data/kjv.html.gz", "Byte file to train on.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", -1, "CPU devices of this project's runs "
                                    "(-1: one per core).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Write results.md and results.json here.")
_BASELINE_OPTIONAL = flags.DEFINE_bool("baseline_optional", False, "Exit 0 even when the "
                                       "PyTorch twin was not measured (torch missing, a run "
                                       "failed); its ratios then read 'not measured'.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the results already in "
                               "--output_dir.")


def _lengths_and_steps():
    seq_lens = cli.integers("seq_lens", _SEQ_LENS.value)
    steps = cli.integers("steps", _STEPS.value)
    if len(steps) not in (1, len(seq_lens)):
        raise app.UsageError(f"--steps={','.join(_STEPS.value)}: give one number or one per "
                             f"--seq_lens ({len(seq_lens)})")
    return seq_lens, steps


def check(argv):
    """Every flag, before any run starts."""
    cli.no_arguments(argv)
    _lengths_and_steps()
    if _CPU_DEVICES.value != -1 and not 1 <= _CPU_DEVICES.value <= sharding.MAX_CPU_DEVICES:
        raise app.UsageError(f"--cpu_devices={_CPU_DEVICES.value}: give -1 (one per core) or 1 "
                             f"to {sharding.MAX_CPU_DEVICES:,}")
    training.check_arguments(_PATTERNS.value, _BASELINES.value, _DATA.value)
    cli.output_dir("output_dir", _OUTPUT_DIR.value, holds=("results.json", "results.md"),
                   overwrite=_OVERWRITE.value)


def main(argv):
    seq_lens, steps = _lengths_and_steps()
    info = training.benchmark_training(seq_lens, steps=steps * (len(seq_lens) // len(steps)),
                                data_path=_DATA.value, patterns=_PATTERNS.value,
                                baselines=_BASELINES.value,
                                cpu_devices=_CPU_DEVICES.value, output_dir=_OUTPUT_DIR.value,
                                command=" ".join(["python", *sys.argv]))
    tools.require_baselines(info["baselines_not_measured"], _BASELINE_OPTIONAL.value)


if __name__ == "__main__":
    cli.run(main, huge_pages=True, check=check)
