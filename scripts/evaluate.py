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
name; scripts/plot_positions.py draws several results on one figure. Bytes also get their bits
by copy class: the bytes an exact copier finds <= 512 back, 513-4,096 back, and the rest
(--copy_classes sets the bounds; sparse_jax.evaluate explains). --data=FILE scores a byte model
on another file (its --split part) instead of the data it trained on.
"""

from absl import flags

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
_COPY_CLASSES = flags.DEFINE_list("copy_classes", ["512", "4096"], "Bytes: bounds of the classes "
                                  "of scored bytes by how far back an exact copy of them lies "
                                  "(empty: none).")
cli.list_rules(_COPY_CLASSES, empty="no classes by copy distance")
_DATA = flags.DEFINE_string("data", None, "Bytes: score the run on this file instead of its own "
                            "data (plain or .gz; its --split part, cut as training cuts its own). "
                            "The result goes to DIR/eval/<file name>/.")
_JOIN_DISTRIBUTED = define_distributed_flags()  # many hosts: each runs the same command
flags.mark_flags_as_required(["workdir"])


def _arguments() -> dict:
    return dict(workdir=_WORKDIR.value, split=_SPLIT.value, checkpoint=_CHECKPOINT.value,
                min_context=_MIN_CONTEXT.value, batch_size=_BATCH_SIZE.value,
                copy_edges=tuple(cli.integers("copy_classes", _COPY_CLASSES.value)),
                attention=_ATTENTION.value, overwrite=_OVERWRITE.value, data_path=_DATA.value)


def check(argv):
    """Every flag, the run and its checkpoint, before any parameter or data is read
    (`evaluate.check_arguments`); a multi-process run's devices are known once it has
    joined, and evaluate() checks again then."""
    cli.no_arguments(argv)
    _JOIN_DISTRIBUTED.check()
    arguments = _arguments()
    cli.input_dir("workdir", _WORKDIR.value, "the folder of a training run")
    if not _JOIN_DISTRIBUTED.joins():
        from sparse_jax import evaluate, sharding

        sharding.set_cpu_devices(flags.FLAGS.cpu_devices)
        evaluate.check_arguments(**arguments)


def main(argv):
    _JOIN_DISTRIBUTED()
    from sparse_jax import evaluate

    result = evaluate.evaluate(**_arguments())
    print(evaluate.format_table(result))
    print("\nBy position in the window (position j sees j + 1 bytes of context):\n"
          + evaluate.format_positions(result))
    if result.get("copy_classes"):
        k = result["copy_classes"]["k"]
        print(f"\nBy how far back an exact copy of the byte lies (its {k} bytes before it last "
              "occurred there, followed by the same byte):\n"
              + evaluate.format_classes(result))
    if "path" in result:
        print(f"Wrote {result['path']} and {result['path'][:-len('.json')]}.png")


if __name__ == "__main__":
    cli.run(main, huge_pages=True, check=check)
