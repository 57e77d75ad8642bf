"""Draws an attention pattern's mask, one colour per part, to a PNG.

  python scripts/plot_pattern.py --kind=strided --seq_len=64 --stride=8 --output=strided.png
  python scripts/plot_pattern.py --kind=fixed --seq_len=64 --stride=8 --c=2 --output=fixed.png
  PYTHONPATH=examples python scripts/plot_pattern.py --seq_len=256 \
      --pattern='my_patterns:bigbird(window=32, globals=8, block=16)' --output=bigbird.png

A pattern of one's own (``--pattern=module:name(k=v, ...)``, docs/custom_patterns.md) is drawn
with its block terms in one colour and its tiles (what no block term covers) in another; a
pattern of two head groups, one colour per group.
"""

import numpy as np
from absl import app, flags

from sparse_jax import cli
from sparse_jax.attention import custom, patterns
from sparse_jax.attention.spec import PatternSpec, pattern_parts
from sparse_jax.attention.terms import TileTerm, terms_to_indices
from sparse_jax.run import workdir

_KIND = flags.DEFINE_enum("kind", "strided", list(patterns.KINDS), "Pattern.")
_PATTERN = flags.DEFINE_string("pattern", None, "A pattern of one's own, module:name(k=v, ...) "
                               "(a module on the path); replaces --kind and its fields.")
MAX_SEQ_LEN = 4096  # the picture has seq_len x seq_len cells
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "Sequence length (the picture has n x n cells: "
                                "at most 4,096).", lower_bound=1, upper_bound=MAX_SEQ_LEN)
_STRIDE = flags.DEFINE_integer("stride", 8, "Stride l (block size of fixed; window-1 of local).",
                               lower_bound=1)
_C = flags.DEFINE_integer("c", 2, "Summary width c of the fixed pattern.", lower_bound=1)
_LOCAL_WIDTH = flags.DEFINE_integer("local_width", None, "Local window (default stride + 1).",
                                    lower_bound=1)
_SUMMARY = flags.DEFINE_enum("summary", "paper", list(patterns.SUMMARY_CONVENTIONS),
                             "Fixed summary convention.")
_SUMMARY_BLOCK = flags.DEFINE_integer("summary_block", 0, "Summary sub-block of the fixed pattern.",
                                      lower_bound=0)
_QUERY = flags.DEFINE_integer("query", None, "Outline this query's row.", lower_bound=0)
_OUTPUT = flags.DEFINE_string("output", "pattern.png", "PNG to write.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an existing --output.")


def draw(parts: dict[str, np.ndarray], path: str, title: str, query: int | None) -> None:
    """The seq_len x seq_len mask of each part in its own colour (overlap in a third) as a PNG;
    ``query``'s row outlined if given."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    names, seq_len = list(parts), len(next(iter(parts.values())))
    code = np.zeros((seq_len, seq_len), dtype=np.int8)
    for bit, name in enumerate(names):
        code |= patterns.indices_to_mask(parts[name], seq_len).astype(np.int8) << bit
    colours = ["#ffffff", "#1f77b4", "#ff7f0e", "#2ca02c"][: 2 ** len(names)]
    labels = {1: names[0]} if len(names) == 1 else {1: names[0], 2: names[1], 3: "both parts"}
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.imshow(code, cmap=ListedColormap(colours), vmin=0, vmax=len(colours) - 1,
              interpolation="nearest")
    if query is not None:
        ax.add_patch(plt.Rectangle((-0.5, query - 0.5), seq_len, 1, fill=False, lw=1.2, ec="k"))
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[v]) for v in labels]
    ax.legend(handles, list(labels.values()), loc="upper right", fontsize=8)
    ax.set(xlabel="key position j", ylabel="query position i")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _spec() -> dict:
    spec = dict(stride=_STRIDE.value, local_width=_LOCAL_WIDTH.value)
    if _KIND.value == "fixed":
        spec.update(c=_C.value, summary=_SUMMARY.value, summary_block=_SUMMARY_BLOCK.value)
    return spec


def check(argv):
    """Every flag, before anything is drawn or written."""
    cli.no_arguments(argv)
    if _QUERY.value is not None and not 0 <= _QUERY.value < _SEQ_LEN.value:
        raise ValueError(f"--query={_QUERY.value} is outside the sequence [0, {_SEQ_LEN.value})")
    cli.output_file("output", _OUTPUT.value, _OVERWRITE.value)
    if _PATTERN.value:
        try:
            custom.load(_PATTERN.value)
        except ValueError as e:
            raise app.UsageError(f"--pattern: {e}") from None
        return
    given = " ".join(f"--{k}={v}" for k, v in _spec().items() if v is not None)
    try:
        PatternSpec(_KIND.value, **_spec())
    except ValueError as e:
        raise app.UsageError(f"--kind={_KIND.value} {given}: {e}") from None


def custom_parts(pattern: custom.Pattern, seq_len: int) -> dict[str, np.ndarray]:
    """A named pattern's index arrays to draw: two head groups each its own; one group its
    block terms and its tiles (either left out where it keeps nothing); else all groups as one."""
    if len(pattern.groups) == 2:
        return {g.name: g.indices(seq_len) for g in pattern.groups}
    if len(pattern.groups) > 2:
        union = np.concatenate([g.indices(seq_len) for g in pattern.groups], axis=1)
        return {pattern.name: patterns.compact(union, seq_len)}
    terms = pattern.groups[0].terms()
    split = {"block terms": [t for t in terms if not isinstance(t, TileTerm)],
             "tiles": [t for t in terms if isinstance(t, TileTerm)]}
    parts = {name: terms_to_indices(ts, seq_len) for name, ts in split.items() if ts}
    return {name: x for name, x in parts.items() if (x >= 0).any()}


def main(argv):
    workdir.check_output(_OUTPUT.value, _OVERWRITE.value)
    if _PATTERN.value:
        pattern = custom.load(_PATTERN.value)
        parts = custom_parts(pattern, _SEQ_LEN.value)
        keys = sum(g.mean_keys(_SEQ_LEN.value) for g in pattern.groups) / len(pattern.groups)
        title = f"{pattern.name}, n={_SEQ_LEN.value}: {keys:.1f} keys/query"
        draw(parts, _OUTPUT.value, title, _QUERY.value)
        print(f"wrote {_OUTPUT.value}: {title}")
        return
    spec = _spec()
    parts = pattern_parts(_KIND.value, _SEQ_LEN.value, **spec)
    keys = patterns.mean_keys_per_query(patterns.pattern_indices(_KIND.value, _SEQ_LEN.value,
                                                                 **spec))
    args = ", ".join(f"{k}={v}" for k, v in spec.items() if v is not None)
    title = f"{_KIND.value} ({args}), n={_SEQ_LEN.value}: {keys:.1f} keys/query"
    draw(parts, _OUTPUT.value, title, _QUERY.value)
    print(f"wrote {_OUTPUT.value}: {title}")


if __name__ == "__main__":
    cli.run(main, check=check)
