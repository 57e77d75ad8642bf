"""Factorized attention patterns of the Sparse Transformer as pure NumPy index arrays.

Positions are 0-based; query ``i`` may attend key ``j`` only if ``j <= i`` (every set below is
intersected with causality). With stride ``l`` and summary width ``c``:

=====================  ====================================================================
strided, local part    ``j in [i - w + 1, i]`` with window ``w = local_width`` (default l + 1,
                       the paper's ``[max(0, i - l), i]``; ``w = l`` is openai/DeepSpeed)
strided, strided part  ``(i - j) mod l == 0``
fixed, block part      ``j // l == i // l``
fixed, summary part    ``j mod l in [l - (b+1)c, l - bc)`` for summary block ``b`` (default 0: the
                       last c residues); ``summary="lra"`` adds residue 0 (long-range-arena's c + 1)
=====================  ====================================================================

Every ``*_indices`` function returns ``int32[seq_len, K]``: row ``i`` lists the keys of query
``i`` in ascending order, without duplicates, padded with ``-1`` at the end, ``K`` the smallest
width that fits every row. They never build a ``seq_len x seq_len`` array (only
``indices_to_mask`` does): cost is O(seq_len * K log K).

The block-level view of a pattern (its disjoint terms, for the fast paths) is ``attention.terms``;
``PatternSpec`` (``attention.spec``) names a pattern. ``check_int`` and ``check_choice`` are the
argument checks used throughout.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

PARTS = {
    "strided": ("both", "local", "strided"),
    "fixed": ("both", "block", "summary"),
}
SUMMARY_CONVENTIONS = ("paper", "lra")
KINDS = ("dense", "local", "strided", "fixed")
MODES = ("merged", "interleaved", "multihead")  # ways of combining the parts in a layer


# --------------------------------------------------------------------------------------------
# Argument checking: every public function validates before allocating anything.


def check_int(name: str, value, low: int = 1, high: int | None = None) -> int:
    """Returns ``value`` as int if it is an integer in [low, high]; raises ValueError otherwise."""
    allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    value = int(value)
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def check_choice(name: str, value, allowed: Sequence[str]) -> str:
    """Returns ``value`` if it is one of ``allowed``; raises ValueError naming ``name``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value


def summary_residues(stride: int, c: int, summary_block: int = 0,
                     summary: str = "paper") -> tuple[int, ...]:
    """The residues ``j mod stride`` of the fixed pattern's summary keys, ascending.

    ``paper``: ``[stride - (b+1)*c, stride - b*c)`` for ``b = summary_block``; ``lra`` adds
    residue 0.
    """
    stride = check_int("stride", stride)
    c = check_int("c", c, 1, stride)
    b = check_int("summary_block", summary_block, 0, stride // c - 1)
    check_choice("summary", summary, SUMMARY_CONVENTIONS)
    residues = set(range(stride - (b + 1) * c, stride - b * c))
    if summary == "lra":
        residues.add(0)
    return tuple(sorted(residues))


# --------------------------------------------------------------------------------------------
# Row sets -> padded index arrays.


def compact(candidates: np.ndarray, seq_len: int) -> np.ndarray:
    """Sorts each row, drops invalid (<0 or >query) entries and duplicates, pads with -1.

    ``candidates`` is ``int[seq_len, C]`` of key positions, any entry outside ``[0, i]`` for
    row ``i`` is treated as absent.
    """
    rows = np.arange(seq_len)[:, None]
    sentinel = seq_len  # sorts after every valid key
    keys = np.where((candidates >= 0) & (candidates <= rows), candidates, sentinel)
    keys = np.sort(keys, axis=1)
    duplicate = np.zeros_like(keys, dtype=bool)
    duplicate[:, 1:] = keys[:, 1:] == keys[:, :-1]
    keys = np.sort(np.where(duplicate, sentinel, keys), axis=1)
    width = int((keys < sentinel).sum(axis=1).max()) if seq_len else 0
    keys = keys[:, :width]
    return np.where(keys < sentinel, keys, -1).astype(np.int32)


def _window_candidates(seq_len: int, width: int) -> np.ndarray:
    """Keys ``i - width + 1 .. i`` for every query (negative ones are dropped by ``compact``)."""
    width = min(width, seq_len)
    return np.arange(seq_len)[:, None] - np.arange(width)[None, :]


def dense_indices(seq_len: int) -> np.ndarray:
    """Causal dense attention: query ``i`` attends ``0..i``. ``K = seq_len``."""
    seq_len = check_int("seq_len", seq_len)
    return compact(_window_candidates(seq_len, seq_len), seq_len)


def local_indices(seq_len: int, width: int) -> np.ndarray:
    """Sliding window of ``width`` keys ending at the query: ``j in [i - width + 1, i]``.

    Bound: ``K = min(width, seq_len)`` (row ``i`` has ``min(i + 1, width)`` keys).
    """
    seq_len = check_int("seq_len", seq_len)
    width = check_int("width", width)
    return compact(_window_candidates(seq_len, width), seq_len)


def strided_indices(seq_len: int, stride: int, *, part: str = "both",
                    local_width: int | None = None) -> np.ndarray:
    """The strided pattern (paper §4.2, Fig. 3b) or one of its parts.

    ``part="local"``: ``j in [i - w + 1, i]``, ``w = local_width`` (default ``stride + 1``, the
    paper's ``[max(0, i - l), i]``; ``local_width=stride`` reproduces openai/DeepSpeed).
    ``part="strided"``: ``(i - j) mod stride == 0``. ``part="both"``: the union.

    Exact row sizes and the bound on K (``l = stride``, ``w = local_width``):

    * local: ``min(i + 1, w)``, so ``K = min(w, seq_len)``;
    * strided: ``i // l + 1``, so ``K = ceil(seq_len / l)``;
    * both: ``min(i + 1, w) + max(0, i // l - (w - 1) // l)`` (the strided keys
      ``i - m l`` with ``m l <= w - 1`` lie inside the window), so
      ``K <= min(seq_len, w + ceil(seq_len / l) - 1)``.
    """
    seq_len = check_int("seq_len", seq_len)
    stride = check_int("stride", stride)
    check_choice("part", part, PARTS["strided"])
    width = stride + 1 if local_width is None else check_int("local_width", local_width)
    candidates = []
    if part in ("both", "local"):
        candidates.append(_window_candidates(seq_len, width))
    if part in ("both", "strided"):
        steps = np.arange(-(-seq_len // stride)) * stride
        candidates.append(np.arange(seq_len)[:, None] - steps[None, :])
    return compact(np.concatenate(candidates, axis=1), seq_len)


def fixed_indices(seq_len: int, stride: int, c: int, *, part: str = "both",
                  summary_block: int = 0, summary: str = "paper") -> np.ndarray:
    """The fixed pattern (paper §4.2, Fig. 3c) or one of its parts.

    ``part="block"``: ``j // l == i // l``. ``part="summary"``: ``j mod l`` in
    ``summary_residues(stride, c, summary_block, summary)`` (``c`` residues, ``c + 1`` for
    ``lra``). ``summary_block=b`` selects the b-th distinct summary sub-block of each block of
    ``l`` positions, counted from its end, which needs ``(b + 1) * c <= stride``.

    Exact row sizes and the bound on K (``l = stride``, ``s`` summary residues):

    * block: ``i mod l + 1``, so ``K = min(l, seq_len)``;
    * summary: ``(i // l) * s + #{residues <= i mod l}``, so ``K <= s * ceil(seq_len / l)``;
    * both: ``i mod l + 1 + (i // l) * s`` (earlier blocks contribute their summary keys, the
      current block all its keys up to ``i``), so ``K <= l + s * (ceil(seq_len / l) - 1)``.
    """
    seq_len = check_int("seq_len", seq_len)
    stride = check_int("stride", stride)
    residues = summary_residues(stride, c, summary_block, summary)
    check_choice("part", part, PARTS["fixed"])
    positions = np.arange(seq_len, dtype=np.int32)
    num_blocks = -(-seq_len // stride)
    summary_keys = (np.arange(num_blocks)[:, None] * stride + np.array(residues)[None, :]).ravel()
    summary_keys = summary_keys[summary_keys < seq_len].astype(np.int32)
    # Rows are built directly (no sort): a prefix of the ascending summary keys, then the keys
    # of the query's own block up to the query. K can be large (s * seq_len / l), so no
    # intermediate is wider than the result.
    if part == "block":
        num_summary = np.zeros(seq_len, dtype=np.int32)
    elif part == "both":  # earlier blocks' summary keys; the own block comes whole below
        num_summary = (positions // stride) * np.int32(len(residues))
    else:  # summary keys <= i
        num_summary = np.searchsorted(summary_keys, positions, side="right").astype(np.int32)
    num_block = positions % stride + 1 if part != "summary" else np.zeros(seq_len, np.int32)
    count = num_summary + num_block
    width = int(count.max())
    cols = np.arange(width, dtype=np.int32)[None, :]
    from_summary = cols < num_summary[:, None]
    summary_part = summary_keys[np.minimum(cols, max(len(summary_keys) - 1, 0))] \
        if len(summary_keys) else np.zeros_like(cols)
    block_part = (positions // stride * stride)[:, None] + cols - num_summary[:, None]
    out = np.where(from_summary, summary_part, block_part)
    return np.where(cols < count[:, None], out, -1).astype(np.int32)


def indices_to_mask(indices: np.ndarray, seq_len: int) -> np.ndarray:
    """``bool[seq_len, seq_len]`` mask with ``mask[i, j]`` true iff row ``i`` lists key ``j``."""
    seq_len = check_int("seq_len", seq_len)
    indices = np.asarray(indices)
    if indices.ndim != 2 or indices.shape[0] != seq_len:
        raise ValueError(f"indices must have shape [seq_len={seq_len}, K], got {indices.shape}")
    if not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(f"indices must be integers, got dtype {indices.dtype}")
    if indices.size and (indices.min() < -1 or indices.max() >= seq_len):
        raise ValueError(f"indices must lie in [-1, {seq_len - 1}] (-1 = padding)")
    mask = np.zeros((seq_len, seq_len + 1), dtype=bool)  # last column absorbs the -1 padding
    np.put_along_axis(mask, np.where(indices < 0, seq_len, indices), True, axis=1)
    return mask[:, :seq_len]


def pattern_indices(kind: str, seq_len: int, *, stride: int | None = None, c: int | None = None,
                    part: str = "both", local_width: int | None = None, summary: str = "paper",
                    summary_block: int = 0) -> np.ndarray:
    """Dispatches to the index builder of ``kind`` (one of ``KINDS``).

    For ``kind="local"`` the window is ``local_width`` (default ``stride + 1``).
    """
    check_choice("kind", kind, KINDS)
    if kind == "dense":
        return dense_indices(seq_len)
    if stride is None:
        raise ValueError(f"stride is required for kind={kind!r}")
    if kind == "local":
        width = local_width if local_width is not None else check_int("stride", stride) + 1
        return local_indices(seq_len, width)
    if kind == "strided":
        return strided_indices(seq_len, stride, part=part, local_width=local_width)
    if c is None:
        raise ValueError("c (summary width) is required for kind='fixed'")
    return fixed_indices(seq_len, stride, c, part=part, summary_block=summary_block,
                         summary=summary)


def mean_keys_per_query(indices: np.ndarray) -> float:
    """Mean number of attended keys per query, |S| in the FLOP counts."""
    return float((np.asarray(indices) >= 0).sum() / max(len(indices), 1))


