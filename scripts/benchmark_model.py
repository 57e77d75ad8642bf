"""Benchmarks a training step (loss and gradients, or with --update the whole step) of a small
Sparse Transformer.

  python scripts/benchmark_model.py --output=model_benchmark.json
  python scripts/benchmark_model.py --compile_cifar --output=compile.json
  python scripts/benchmark_model.py --update --seq_len=4096,16384,65536 --stride=sqrt \
      --num_layers=6 --d_model=128 --cases=strided:full:scan,fixed:full:scan,dense:full:scan

The last is how far the context goes: each case at each length in a fresh process, the
pattern's stride the largest power of two <= sqrt(n), a case that fails at one length skipped
at longer ones.

Default: a 4-layer d=256 model at n=8192, strided attention (stride 128, merged) against dense
attention, each with remat off and on, with layers unrolled and scanned (on XLA:CPU remat
only saves memory inside ``scan_layers``). A fourth field picks ``ModelConfig.attention``: on a
GPU, ``--dtype=bfloat16 --cases=strided:none:unrolled:pallas,dense:none:unrolled:pallas``
compares the Pallas kernel with dense cuDNN attention (dense's "pallas" is
``jax.nn.dot_product_attention``). ``--compile_cifar`` instead measures jit lower + compile
of the loss gradient of the paper's 128-layer CIFAR-10 model (batch 1) with and without
``scan_layers``. Every case runs in a fresh subprocess, so its peak RSS (``ru_maxrss``: the
process's whole peak, including the Python/JAX baseline and compilation) is its own. Prints a
markdown table and writes all numbers as JSON to ``--output``. "XLA temp" is the compiled
step's planned buffer memory; a case whose plan exceeds 80% of the available memory is compiled
but not run.
"""

import json

from absl import flags

from sparse_jax import cli, sharding
from sparse_jax.bench import model

_OUTPUT = flags.DEFINE_string("output", None, "Write the results here as JSON.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --output.")
_SEQ_LEN = flags.DEFINE_list("seq_len", ["8192"], "Sequence lengths (a list runs each case at "
                             "each length, shortest first).")
_LAYERS = flags.DEFINE_integer("num_layers", 4, "Layers.", lower_bound=1)
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Model width.", lower_bound=1)
_HEADS = flags.DEFINE_integer("num_heads", 4, "Attention heads.", lower_bound=1)
_STRIDE = flags.DEFINE_string("stride", "128", "Stride of the sparse patterns (fixed: c = "
                               "stride / 4), or sqrt: the largest power of two <= sqrt(n).")
_UPDATE = flags.DEFINE_bool("update", False, "Time the whole training step: loss, gradients "
                            "and the AdamW update (default: loss and gradients).")
_BATCH = flags.DEFINE_integer("batch_size", 1, "Sequences per step.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per case (after one warm-up step; at "
                              "most 10,000).", lower_bound=1, upper_bound=10_000)
_SEQ = flags.DEFINE_integer("seq", 1, "Split each sequence over this many simulated CPU "
                            "devices (context parallelism, the mesh's seq axis); XLA's memory "
                            "figures are then per device.", lower_bound=1,
                            upper_bound=sharding.MAX_CPU_DEVICES)
_CASES = flags.DEFINE_list(
    "cases", [f"{p}:{r}:{layout}" for p in ("strided", "dense") for layout in ("unrolled", "scan")
              for r in ("none", "full")],
    "pattern:remat:layout[:attention] (layout: unrolled or scan, i.e. scan_layers; attention: "
    "xla (default), pallas or auto, ModelConfig.attention).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype.")
_COMPILE_CIFAR = flags.DEFINE_bool("compile_cifar", False,
                                   "Measure compile time of the 128-layer CIFAR-10 model.")


def check(argv):
    """Every flag and case, before any case's process starts: each model valid at each length,
    and with --seq > 1 each sequence split over --seq devices as a run would split it."""
    cli.no_arguments(argv)
    cli.output_file("output", _OUTPUT.value, _OVERWRITE.value)
    if not _COMPILE_CIFAR.value:
        model.check_cases(_CASES.value, seq_lens=cli.integers("seq_len", _SEQ_LEN.value),
                          num_layers=_LAYERS.value, d_model=_D_MODEL.value,
                          num_heads=_HEADS.value, stride=_STRIDE.value, dtype=_DTYPE.value,
                          seq=_SEQ.value, batch_size=_BATCH.value)


def main(argv):
    del argv
    if _COMPILE_CIFAR.value:
        results = model.benchmark_compile()
    else:
        seq_lens = cli.integers("seq_len", _SEQ_LEN.value)
        results = model.benchmark_model(
            _CASES.value, seq_lens=seq_lens, num_layers=_LAYERS.value,
            d_model=_D_MODEL.value, num_heads=_HEADS.value, stride=_STRIDE.value,
            batch_size=_BATCH.value, steps=_STEPS.value, dtype=_DTYPE.value,
            update=_UPDATE.value, seq=_SEQ.value)
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    cli.run(main, huge_pages=True, check=check)
