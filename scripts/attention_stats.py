r"""Where a trained model looks: attention by distance for every layer and head of a checkpoint,
and the paper's Figure 2 for picture models; all logic lives in `sparse_jax.attention_stats`.

  python scripts/attention_stats.py --workdir=workdirs/code_long --split=test --windows=8
  python scripts/attention_stats.py --workdir=workdirs/cifar10 --layers=0,3 \
      --queries="16,16,0;8,24,2;30,4,1"

Over --windows held-out windows of the run's data (evenly spaced over --split), for each layer
and head: the attention mass by key distance in bands (0, 1-64, 65-512, 513-4,096,
4,097-16,384, the rest up to the context; --bands sets the edges) and beyond --far, the mass on
each term of the pattern (local window, strided column, fixed's block and summary keys), the
mean and 90th percentile of the distance, and the entropy. Prints a table and writes
WORKDIR/attention/<split>_<step>.{md,json,png} (--output_dir): the table, the JSON and a PNG of
the layers x heads coloured by far mass beside each layer's mass at distance >= d. With
--queries (picture models: row,column[,channel] of each query sub-pixel, ";" between them),
also <split>_<step>_figure2.png: each query's weights over the picture in each layer of
--layers (the mean of its heads, or each of --heads). Bad input is one line, before any
parameter is restored, and nothing is written.
"""

from absl import app, flags

from sparse_jax import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by scripts/train.py.")
_SPLIT = flags.DEFINE_enum("split", "test", ["train", "valid", "test"], "Split to read.")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "latest", "latest | best | a step number.")
_WINDOWS = flags.DEFINE_integer("windows", 4, "Held-out windows (or pictures), evenly spaced "
                                "over the split.")
_LAYERS = flags.DEFINE_list("layers", None, "Layers to report (default all).")
_HEADS = flags.DEFINE_list("heads", None, "Heads to report (default all).")
_BANDS = flags.DEFINE_list("bands", None, "Upper distances of the bands (default 64, 512, "
                           "4096, 16384: those below the context).")
_FAR = flags.DEFINE_integer("far", None, "Far mass: at distances beyond this (default the "
                            "largest band edge <= a quarter of the context).")
_QUERIES = flags.DEFINE_string("queries", None, "Picture models: Figure 2's query sub-pixels, "
                               "row,column[,channel] separated by ';'.")
_ATTENTION = flags.DEFINE_enum("attention", None, ["xla", "native", "pallas", "auto"],
                               "Attention implementation of the forward pass (default: the "
                               "run's, or XLA where its CPU kernels cannot be built here).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where to write (default "
                                  "WORKDIR/attention).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace existing results of the same "
                               "split and checkpoint.")
flags.mark_flags_as_required(["workdir"])


def _integers(flag, value):
    try:
        return None if value is None else [int(v) for v in value]
    except ValueError:
        raise app.UsageError(f"--{flag}: integers separated by commas, got {value}") from None


def _arguments() -> dict:
    queries = None
    if _QUERIES.value:
        queries = [_integers("queries", q.split(",")) for q in _QUERIES.value.split(";")]
        if any(len(q) not in (2, 3) for q in queries):
            raise app.UsageError(f"--queries: row,column[,channel] of each query, ';' between "
                                 f"them, got {_QUERIES.value!r}")
    return dict(workdir=_WORKDIR.value, split=_SPLIT.value, checkpoint=_CHECKPOINT.value,
                windows=_WINDOWS.value, layers=_integers("layers", _LAYERS.value),
                heads=_integers("heads", _HEADS.value), bands=_integers("bands", _BANDS.value),
                far=_FAR.value, queries=queries, attention=_ATTENTION.value,
                output_dir=_OUTPUT_DIR.value, overwrite=_OVERWRITE.value)


def check(argv):
    """Every flag against the run, before any data is read or parameter restored."""
    cli.no_arguments(argv)
    arguments = _arguments()
    cli.input_dir("workdir", _WORKDIR.value, "the folder of a training run")
    cli.output_dir("output_dir", _OUTPUT_DIR.value, overwrite=None)  # its files: checked next
    from sparse_jax import attention_stats

    attention_stats.check_arguments(**arguments)


def main(argv):
    from sparse_jax import attention_stats

    result = attention_stats.attention_stats(**_arguments())
    print(f"Attention of {result['split']} step {result['step']} over {result['windows']} "
          f"windows of {result['seq_len']:,} (mass by distance back; far: beyond "
          f"{result['far']:,}):\n" + attention_stats.format_table(result))
    print("Wrote " + ", ".join(result["paths"].values()))


if __name__ == "__main__":
    cli.run(main, check=check, huge_pages=True)
