r"""Benchmarks the cached sampler against re-running the model, and evaluation throughput.

  python scripts/benchmark_sampling.py --output=sampling_benchmark.json

Sampling: a randomly initialized strided model (default 4 layers, d=256, 4 heads, context 4096,
stride 64), or with --workdir=DIR the latest checkpoint of a training run (say the long-context
preset: `--workdir=workdirs/kjv_long --length=4096 --noeval`), samples --length bytes after a
one-byte prompt, (a) with the pattern-aware cache
(`model.decode.generate`, one compiled scan) and (b) naively, one jitted full forward pass
over the whole [batch, n] buffer per new byte. The naive way is timed over --naive_steps steps
after a warm-up step and extrapolated linearly to --length steps (its cost per step does not
depend on the position). (c) An estimate of a smarter naive sampler that runs the forward pass
only on a prefix padded to the next power of two: the forward time at each such length, summed
over the steps that would use it.
Evaluation (--eval): a training run of configs/quickstart.py (1 step, embedded data of
20 x --eval_mib MiB, so the test split is --eval_mib MiB) is evaluated with
`sparse_jax.evaluate.evaluate` over the whole test split; its tokens/s is compared with the
forward-only tokens/s of the same jitted eval step on a batch already on the device, and with a
training step's (loss and gradients) tokens/s. Prints markdown tables; writes JSON.
The measurements are `sparse_jax.bench.sampling.benchmark_sampling`.
"""

from absl import app, flags

from sparse_jax import cli
from sparse_jax.bench import sampling

_OUTPUT = flags.DEFINE_string("output", None, "Write the results here as JSON.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --output.")
_LAYERS = flags.DEFINE_integer("num_layers", 4, "Layers.", lower_bound=1)
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Width.", lower_bound=1)
_HEADS = flags.DEFINE_integer("num_heads", 4, "Heads.", lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "Context n.", lower_bound=1)
_STRIDE = flags.DEFINE_integer("stride", 64, "Stride of the strided pattern.", lower_bound=1)
_LENGTH = flags.DEFINE_integer("length", 4096, "Bytes to sample (<= seq_len).", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_size", 1, "Samples drawn in parallel.", lower_bound=1)
_NAIVE_STEPS = flags.DEFINE_integer("naive_steps", 128, "Timed steps of the naive sampler.",
                                    lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", None, "Sample from this training run's latest "
                                "checkpoint instead (its model replaces the model flags).")
_EVAL = flags.DEFINE_bool("eval", True, "Also benchmark evaluation throughput.")
_EVAL_MIB = flags.DEFINE_integer("eval_mib", 1, "Size of the evaluated split in MiB.",
                                 lower_bound=1)


def check(argv):
    """Every flag, before any model is built: the model (or --workdir's run) and the length."""
    cli.no_arguments(argv)
    cli.output_file("output", _OUTPUT.value, _OVERWRITE.value)
    if _WORKDIR.value is not None:
        from sparse_jax.run import setup, workdir

        cli.input_dir("workdir", _WORKDIR.value, "the folder of a training run")
        workdir.check_workdir(_WORKDIR.value)
        cfg = setup.recorded(_WORKDIR.value)[1]
    else:
        from sparse_jax.model.config import ModelConfig

        cfg = ModelConfig(seq_len=_SEQ_LEN.value, num_layers=_LAYERS.value,
                          d_model=_D_MODEL.value, num_heads=_HEADS.value, pattern="strided",
                          stride=_STRIDE.value)
    seq_len = cfg.seq_len
    if _LENGTH.value > seq_len:
        raise app.UsageError(f"--length={_LENGTH.value} must be at most the context, "
                             f"seq_len={seq_len}")
    from sparse_jax.run import sizing

    sizing.check_fits(cfg, _BATCH.value, training=False,
                      fields="--batch_size, --seq_len, --d_model or --num_layers")
    if _EVAL.value:
        cli.memory_fits(f"--eval_mib={_EVAL_MIB.value:,}: the 20 x {_EVAL_MIB.value:,} MiB of "
                        "generated data", 20 * _EVAL_MIB.value * 2**20, "--eval_mib")


def main(argv):
    sampling.benchmark_sampling(
        seq_len=_SEQ_LEN.value, num_layers=_LAYERS.value, d_model=_D_MODEL.value,
        num_heads=_HEADS.value, stride=_STRIDE.value, length=_LENGTH.value,
        batch_size=_BATCH.value, naive_steps=_NAIVE_STEPS.value, workdir=_WORKDIR.value,
        evaluation=_EVAL.value,
        eval_mib=_EVAL_MIB.value, output=_OUTPUT.value)


if __name__ == "__main__":
    cli.run(main, huge_pages=True, check=check)
