"""Benchmarks block-sparse attention against dense causal attention.

  python scripts/benchmark_attention.py --seq_lens=4096,8192,12288,16384 \
      --patterns=dense,strided:128,fixed:128:32,strided:sqrt --repeats=3 --rounds=2 \
      --mem_limit_gb=14 --output_dir=docs/benchmarks/attention

On a GPU (needs JAX with CUDA, flax, absl-py, tqdm and matplotlib; not ml-collections), the
Pallas kernel against the XLA path and cuDNN's dense causal attention:

  python scripts/benchmark_attention.py --dtype=bfloat16 \
      --seq_lens=4096,8192,16384,32768,65536 --patterns=dense@cudnn,strided:128,\
strided:128@pallas,fixed:128:32,fixed:128:32@pallas --output_dir=docs/benchmarks/h100/attention

"× vs fastest dense" is a ratio only to a dense row that was measured at the same length and
pass; where the dense rows asked for all failed (out of memory) it reads "not measured", and the
script exits 1 after writing its results unless --baseline_optional is given.

Patterns: ``dense`` (``jax.nn.dot_product_attention(..., is_causal=True)``), ``strided:L``,
``fixed:L:C``, ``local:W`` and ``strided:sqrt`` (stride round(√n)), each optionally followed by
``@IMPL``: ``dense@xla`` / ``dense@cudnn`` pick ``dot_product_attention``'s implementation, and
a sparse pattern's ``@xla`` (default), ``@pallas`` or ``@auto`` is ``sparse_attention``'s (the
fused kernel runs in interpret mode on a CPU: correct, not fast); ``@pallas:OPTIONS`` sets the
kernel's options (``kernel.BlockSizes.parse``: tiles ``QxK``, ``terms`` or ``chained``, ``hG``
heads per program, ``wN`` warps, ``sN`` stages, ``one_loop``), e.g.
``strided:128@pallas:64x64,strided:128@pallas:chained:h2`` to compare them.
Every (pattern, seq_len, pass) runs in a fresh process: median time over ``--repeats`` runs
after compile, the peak RSS of that process and the temporary memory XLA planned for the
compiled step (all devices together).
Useful GFLOP/s counts 4·B·H·n·|S|·d for the forward pass (|S| the mean number of attended keys)
and 2.5× that for forward+backward, also given as a fraction of a 4096×4096 ``jnp.dot``
measured in the same run (in ``--dtype``; 8192² on an accelerator). On a shared machine,
``--rounds=R`` runs the whole sweep R times and reports for each case the round with the lowest
median (all rounds' medians are in results.json), with the best ``jnp.dot`` of the rounds as
the ceiling; each row records the 1-minute load average when its round started. "× vs fastest
dense" divides the fastest dense row's time (any implementation) by the row's.

``--devices=N`` splits the heads over N devices with ``shard_map`` (the layout a GPU/TPU mesh
would use); every pattern, dense included, runs with the same N. The default is one device per
CPU core on a CPU (N host-platform devices) and all local devices otherwise: XLA:CPU runs the
many small matmuls of a batched dot one after another on one core, so one device leaves the
other cores mostly idle, while the ``jnp.dot`` ceiling uses them all. ``--devices=1`` measures
one device. Writes results.json, results.md and time_vs_seq_len.png to ``--output_dir``.
"""

from absl import app, flags

from sparse_jax import cli, sharding
from sparse_jax.bench import attention, tools

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["4096", "8192", "16384"], "Sequence lengths.")
_PATTERNS = flags.DEFINE_list("patterns", ["dense", "strided:128", "fixed:128:32"], "Patterns.")
_PASSES = flags.DEFINE_list("passes", ["fwd", "fwdbwd"], "fwd and/or fwdbwd.")
_HEADS = flags.DEFINE_integer("heads", 8, "Attention heads.", lower_bound=1)
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dimension.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size.", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Input dtype.")
_DEVICES = flags.DEFINE_integer(
    "devices", None, "Split heads over this many devices (default: one per core on a CPU, else "
    "all local devices).", lower_bound=1, upper_bound=sharding.MAX_CPU_DEVICES)
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per case (median reported; at most "
                                "1,000).", lower_bound=1, upper_bound=1000)
_ROUNDS = flags.DEFINE_integer(
    "rounds", 1, "Times every case runs (a fresh process each, interleaved with the other "
    "cases); the round with the lowest median is reported (at most 100).", lower_bound=1,
    upper_bound=100)
_MEM_LIMIT = flags.DEFINE_float("mem_limit_gb", 20.0, "Kill a case whose RSS passes this.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "docs/benchmarks/attention", "Where results go.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the results already in "
                               "--output_dir.")
_BASELINE_OPTIONAL = flags.DEFINE_bool("baseline_optional", False, "Exit 0 even when a "
                                       "dense row asked for was not measured (out of memory): "
                                       "its ratios then read 'not measured'.")


def check(argv):
    """Every flag, before any case's process starts or anything is written."""
    cli.no_arguments(argv)
    seq_lens = cli.integers("seq_lens", _SEQ_LENS.value)
    unknown = [p for p in _PASSES.value if p not in ("fwd", "fwdbwd")]
    if unknown:
        raise app.UsageError(f"--passes: unknown pass {unknown[0]!r}; choose from fwd, fwdbwd")
    cli.memory_fits(  # what every case holds at least: q, k, v and the output
        f"--batch={_BATCH.value:,} x --heads={_HEADS.value:,} x --head_dim={_HEAD_DIM.value:,} "
        f"at n={max(seq_lens):,}: q, k, v and the output",
        4 * _BATCH.value * _HEADS.value * _HEAD_DIM.value * max(seq_lens)
        * (2 if _DTYPE.value == "bfloat16" else 4), "--batch, --heads, --head_dim or --seq_lens")
    for pattern in _PATTERNS.value:  # every name parses, at every length
        for seq_len in seq_lens:
            try:
                attention.parse_pattern(pattern, seq_len)
            except ValueError as e:
                raise app.UsageError(f"--patterns: {e}") from None
    if not _MEM_LIMIT.value > 0:
        raise app.UsageError(f"--mem_limit_gb={_MEM_LIMIT.value:g}: give a positive number of "
                             "GB")
    devices = _DEVICES.value or attention.default_devices()
    if _HEADS.value % devices:
        raise app.UsageError(f"--heads={_HEADS.value} cannot be split over {devices} devices")
    cli.output_dir("output_dir", _OUTPUT_DIR.value, overwrite=_OVERWRITE.value,
                   holds=("results.json", "results.md", "time_vs_seq_len.png"))


def main(argv):
    del argv
    devices = _DEVICES.value or attention.default_devices()
    summary = attention.benchmark_attention(
        [int(n) for n in _SEQ_LENS.value], _PATTERNS.value, passes=_PASSES.value,
        heads=_HEADS.value, head_dim=_HEAD_DIM.value, batch=_BATCH.value, dtype=_DTYPE.value,
        devices=devices, repeats=_REPEATS.value, rounds=_ROUNDS.value,
        mem_limit_gb=_MEM_LIMIT.value, output_dir=_OUTPUT_DIR.value)
    tools.require_baselines(summary["baselines_not_measured"], _BASELINE_OPTIONAL.value)


if __name__ == "__main__":
    cli.run(main, huge_pages=True, check=check)
