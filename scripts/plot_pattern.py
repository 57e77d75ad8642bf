"""Draws an attention pattern's mask, one colour per part, to a PNG.

  python scripts/plot_pattern.py --kind=strided --seq_len=64 --stride=8 --output=strided.png
  python scripts/plot_pattern.py --kind=fixed --seq_len=64 --stride=8 --c=2 --output=fixed.png
"""

from absl import app, flags

from sparse_jax import patterns

_KIND = flags.DEFINE_enum("kind", "strided", ["dense", "local", "strided", "fixed"], "Pattern.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Sequence length.")
_STRIDE = flags.DEFINE_integer("stride", 8, "Stride l (block size of fixed; window-1 of local).")
_C = flags.DEFINE_integer("c", 2, "Summary width c of the fixed pattern.")
_LOCAL_WIDTH = flags.DEFINE_integer("local_width", None, "Local window (default stride + 1).")
_SUMMARY = flags.DEFINE_enum("summary", "paper", list(patterns.SUMMARY_CONVENTIONS),
                             "Fixed summary convention.")
_HEAD = flags.DEFINE_integer("head", 0, "Summary sub-block of the fixed pattern.")
_QUERY = flags.DEFINE_integer("query", None, "Outline this query's row.")
_OUTPUT = flags.DEFINE_string("output", "pattern.png", "PNG to write.")


def main(argv):
    del argv
    spec = dict(stride=_STRIDE.value, local_width=_LOCAL_WIDTH.value)
    if _KIND.value == "fixed":
        spec.update(c=_C.value, summary=_SUMMARY.value, head=_HEAD.value)
    parts = patterns.pattern_parts(_KIND.value, _SEQ_LEN.value, **spec)
    keys = patterns.mean_keys_per_query(patterns.pattern_indices(_KIND.value, _SEQ_LEN.value, **spec))
    args = ", ".join(f"{k}={v}" for k, v in spec.items() if v is not None)
    title = f"{_KIND.value} ({args}), n={_SEQ_LEN.value}: {keys:.1f} keys/query"
    patterns.draw_pattern(parts, _OUTPUT.value, title=title, query=_QUERY.value)
    print(f"wrote {_OUTPUT.value}: {title}")


if __name__ == "__main__":
    app.run(main)
