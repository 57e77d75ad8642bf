"""Four patterns of one's own, each a few lines (docs/custom_patterns.md). Name one from a config
or the command line with this directory on the path:

  PYTHONPATH=examples python scripts/train.py --config=configs/quickstart.py \\
      --config.model.pattern='my_patterns:longformer(window=64, globals=8)'

Every rule below is written with array operators only (``&``, ``|``, ``%``, ``//``,
comparisons), so it runs on NumPy arrays on the host and inside the Pallas kernels alike.
"""

from sparse_jax.attention import custom


def longformer(window: int = 128, globals: int = 16, block: int = 64) -> custom.Pattern:
    """Longformer's sliding window with global tokens (Beltagy et al. 2020), causal: the last
    ``window`` keys, and the first ``globals`` positions, which every later query reads."""
    return custom.from_rule(
        lambda q, k: (k <= q) & ((q - k < window) | (k < globals)),
        block=block, name=f"longformer(window={window}, globals={globals})")


def bigbird(window: int = 128, globals: int = 64, random: int = 2, block: int = 64,
            seed: int = 0) -> custom.Pattern:
    """BigBird's window + global + random blocks (Zaheer et al. 2020), causal: the last
    ``window`` keys, the first ``globals`` positions, and about ``random`` earlier key blocks
    per query block, drawn by a seeded integer hash of (query block, key block): the same
    blocks on every run, on the host and in a kernel."""
    def random_block(a, b):  # about `random` of the key blocks b < a, for query block a
        h = (a * a * 31 + b * b * 17 + a * b * 7 + seed * 101 + 13) % 1009
        return (b < a) & (h * a < random * 1009)

    return custom.from_rule(
        lambda q, k: (k <= q) & ((q - k < window) | (k < globals)
                                 | random_block(q // block, k // block)),
        block=block, name=f"bigbird(window={window}, globals={globals}, random={random}, "
                          f"seed={seed})")


def dilated(window: int = 64, dilation: int = 4, block: int = 64) -> custom.Pattern:
    """A dilated sliding window: ``window`` keys ``dilation`` apart, ``i, i - d, i - 2d, ...``
    (Longformer's dilated heads)."""
    return custom.from_rule(
        lambda q, k: (k <= q) & ((q - k) % dilation == 0) & (q - k < window * dilation),
        block=block, name=f"dilated(window={window}, dilation={dilation})")


def axial(width: int = 96, split: bool = False) -> custom.Pattern:
    """2-D attention for a picture of rows of ``width`` positions (32 x 32 RGB: 96): a query
    reads its row so far and its column above it. ``split``: the row and the column as two
    head groups (half the heads each) instead of one."""
    row = lambda q, k: (k <= q) & (q // width == k // width)  # noqa: E731
    column = lambda q, k: (k <= q) & ((q - k) % width == 0)  # noqa: E731
    if split:
        return custom.heads(custom.from_rule(row, block=width, name="axial-row"),
                            custom.from_rule(column, block=width, name="axial-column"),
                            name=f"axial(width={width}, split)")
    return custom.from_rule(lambda q, k: row(q, k) | column(q, k), block=width,
                            name=f"axial(width={width})")


def random_tiles(density: float = 0.125, block: int = 128, seed: int = 0) -> custom.Pattern:
    """A rule no built-in term covers beyond the own block: each query block keeps its own block
    (causal) and a seeded pseudo-random ``density`` of the earlier key blocks (the generic
    tiles' benchmark, docs/custom_patterns.md)."""
    threshold = round(density * 1009)

    def rule(q, k):
        a, b = q // block, k // block
        h = (a * a * 31 + b * b * 17 + a * b * 7 + seed * 101 + 13) % 1009
        return (k <= q) & ((a == b) | (h < threshold))

    return custom.from_rule(rule, block=block, name=f"random_tiles(density={density}, "
                                                   f"block={block}, seed={seed})")
