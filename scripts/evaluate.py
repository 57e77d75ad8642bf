r"""Evaluates a checkpoint of a training run over a whole split; all logic lives in
`sparse_jax.evaluate`.

  python scripts/evaluate.py --workdir=workdirs/quickstart                    # test, latest
  python scripts/evaluate.py --workdir=workdirs/enwik8 --checkpoint=best --min_context=6144

Bytes: bits per byte over the split. Default: non-overlapping windows of the model's context;
--min_context=M: overlapping windows that score only bytes with at least M bytes of context
(paper Table 3); either way every byte after the first is scored exactly once. Images: bits per
dim over every sub-pixel of the split. Prints a table and writes the result as JSON to
DIR/eval/<split>_<step>.json (<split>_<step>_minctx<M>.json with --min_context), with the bits
by position in the window (buckets 0-63, 64-127, 128-255, ...), drawn in the .png of the same
name; scripts/plot_positions.py draws several results on one figure.
"""

from absl import app, flags

from sparse_jax import cli
from sparse_jax.sharding import define_distributed_flags

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by scripts/train.py.")
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "valid", "test"], "Split to score.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "latest", "latest | best | a step number.")
_ATTENTION = flags.DEFINE_enum("attention", None, ["xla", "native", "pallas", "auto"],
                               "Attention implementation to read the run with (default: the "
                               "run's, or XLA where its CPU kernels cannot be built here).")
_MIN_CONTEXT = flags.DEFINE_integer("min_context", None, "Bytes: score only positions with at "
                                    "least this much context (overlapping windows).")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Sequences per forward pass over all "
                                   "devices (default: the training batch size).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing result of the same "
                                "split, checkpoint and min_context.")
_JOIN_DISTRIBUTED = define_distributed_flags()  # many hosts: each runs the same command
flags.mark_flags_as_required(["workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    _JOIN_DISTRIBUTED()
    from sparse_jax import evaluate

    result = evaluate.evaluate(_WORKDIR.value, _SPLIT.value, _CHECKPOINT.value,
                               _MIN_CONTEXT.value, _BATCH_SIZE.value, attention=_ATTENTION.value,
                               overwrite=_OVERWRITE.value)
    print(evaluate.format_table(result))
    print("\nBy position in the window (position j sees j + 1 bytes of context):\n"
          + evaluate.format_positions(result))
    if "path" in result:
        print(f"Wrote {result['path']} and {result['path'][:-len('.json')]}.png")


if __name__ == "__main__":
    cli.run(main, huge_pages=True)
