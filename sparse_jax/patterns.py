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

Block-level view (used by the fast attention path)
--------------------------------------------------
``pattern_terms`` splits a pattern into *disjoint* terms whose union is the pattern, each of a
shape that a few dense matmuls serve with static shapes (the sequence viewed as a grid of rows of
``block`` positions, ``block = stride``):

* ``BandTerm``: query row ``r`` attends the contiguous keys of rows ``r - prev .. r``, kept by an
  element mask that depends only on the offsets inside that window (local window, fixed block,
  current-block summary). One ``[rows, block, (prev+1) * block]`` score tile per row.
* ``ColumnTerm``: query ``(r, col)`` attends ``(r', col)`` for ``r - r' >= min_rows`` (the strided
  part as column attention of the grid, openai's "strided transpose"). ``min_rows`` drops the keys
  that a band term already covers, so a shared key is scored once.
* ``SummaryTerm``: every query of row ``r`` attends the keys at ``residues`` of all earlier rows
  (the fixed summary part). The summary keys are a strided slice of K/V, taken once and shared by
  all queries.

``terms_to_indices`` rebuilds the index array from the terms; the tests check it equals the
pattern, so the fast path and the index arrays cannot drift apart.

``PatternSpec`` names a pattern (what the attention functions and the model take), and
``layer_specs`` gives the patterns of a layer's head groups for each way of combining the parts
(``MODES``). ``check_int`` and ``check_choice`` are the argument checks used throughout.
"""

from __future__ import annotations

import dataclasses
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


def _compact(candidates: np.ndarray, seq_len: int) -> np.ndarray:
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
    """Keys ``i - width + 1 .. i`` for every query (negative ones are dropped by ``_compact``)."""
    width = min(width, seq_len)
    return np.arange(seq_len)[:, None] - np.arange(width)[None, :]


def dense_indices(seq_len: int) -> np.ndarray:
    """Causal dense attention: query ``i`` attends ``0..i``. ``K = seq_len``."""
    seq_len = check_int("seq_len", seq_len)
    return _compact(_window_candidates(seq_len, seq_len), seq_len)


def local_indices(seq_len: int, width: int) -> np.ndarray:
    """Sliding window of ``width`` keys ending at the query: ``j in [i - width + 1, i]``.

    Bound: ``K = min(width, seq_len)`` (row ``i`` has ``min(i + 1, width)`` keys).
    """
    seq_len = check_int("seq_len", seq_len)
    width = check_int("width", width)
    return _compact(_window_candidates(seq_len, width), seq_len)


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
    return _compact(np.concatenate(candidates, axis=1), seq_len)


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


# --------------------------------------------------------------------------------------------
# Block-level view for the fast path.


@dataclasses.dataclass(frozen=True)
class BandTerm:
    """Query row ``r`` (``block`` positions) attends keys of rows ``r - prev .. r``.

    Inside the window a query at offset ``a`` of its row and a key at offset ``t`` of the
    ``(prev + 1) * block`` window keys are at distance ``i - j = a + prev * block - t``. The key is
    kept iff ``0 <= i - j <= max_distance`` (None: no limit), and, if ``same_row``, it lies in the
    query's own row, and, if ``residues`` is given, ``j mod block`` is one of them.
    """
    block: int
    prev: int
    max_distance: int | None = None
    same_row: bool = False
    residues: tuple[int, ...] | None = None

    def tile_mask(self) -> np.ndarray:
        """``bool[block, (prev + 1) * block]``: the mask shared by every row of the grid."""
        a = np.arange(self.block)[:, None]
        t = np.arange((self.prev + 1) * self.block)[None, :]
        distance = a + self.prev * self.block - t
        keep = distance >= 0
        if self.max_distance is not None:
            keep &= distance <= self.max_distance
        if self.same_row:
            keep &= t >= self.prev * self.block
        if self.residues is not None:
            keep &= np.isin(t % self.block, self.residues)
        return keep


@dataclasses.dataclass(frozen=True)
class ColumnTerm:
    """Query ``(r, col)`` of the ``[rows, stride]`` grid attends ``(r', col)`` with
    ``r - r' >= min_rows``."""
    stride: int
    min_rows: int


@dataclasses.dataclass(frozen=True)
class SummaryTerm:
    """Every query of row ``r`` attends the keys at ``residues`` of rows ``0 .. r - 1``."""
    block: int
    residues: tuple[int, ...]


Term = BandTerm | ColumnTerm | SummaryTerm


def pattern_terms(kind: str, *, stride: int | None = None, c: int | None = None,
                  part: str = "both", local_width: int | None = None, summary: str = "paper",
                  summary_block: int = 0) -> tuple[Term, ...]:
    """Disjoint block-level terms whose union is the pattern (see the module docstring).

    The grid block is ``stride`` for strided and fixed patterns, and ``max(1, width - 1)`` for
    a local window of ``width`` keys (so a row needs only its previous row).
    ``kind="dense"`` has no sparse terms; callers use dense attention for it.
    """
    check_choice("kind", kind, KINDS)
    if kind == "dense":
        raise ValueError("kind='dense' has no block terms: use dense attention")
    stride = check_int("stride", stride)
    if kind == "local":
        width = stride + 1 if local_width is None else check_int("local_width", local_width)
        block = max(1, width - 1)
        return (BandTerm(block, prev=-(-(width - 1) // block), max_distance=width - 1),)
    if kind == "strided":
        check_choice("part", part, PARTS["strided"])
        width = stride + 1 if local_width is None else check_int("local_width", local_width)
        terms = []
        if part in ("both", "local"):
            prev = -(-(width - 1) // stride)
            terms.append(BandTerm(stride, prev=prev, max_distance=width - 1))
        if part == "strided":
            terms.append(ColumnTerm(stride, min_rows=0))
        if part == "both":  # keys i - m*l with m*l <= w - 1 are in the local window already
            terms.append(ColumnTerm(stride, min_rows=(width - 1) // stride + 1))
        return tuple(terms)
    residues = summary_residues(stride, c, summary_block, summary)
    check_choice("part", part, PARTS["fixed"])
    if part == "block":
        return (BandTerm(stride, prev=0, same_row=True),)
    if part == "summary":
        return (BandTerm(stride, prev=0, same_row=True, residues=residues),
                SummaryTerm(stride, residues))
    return (BandTerm(stride, prev=0, same_row=True), SummaryTerm(stride, residues))


def term_rows(term: Term, i, seq_len: int, xp=np):
    """Key positions of one term for the queries ``i`` (an int array, or with ``xp=jax.numpy`` a
    traced position: a step of the cached decoder), ``[..., C]``, -1 where absent. ``C`` depends
    only on the term and ``seq_len`` (not on ``i``), so a decoder gets static shapes and builds
    no ``[seq_len, K]`` table; a sliding window lists just its ``max_distance + 1`` keys."""
    i = xp.asarray(i)[..., None]
    if isinstance(term, BandTerm):
        if (term.max_distance is not None and term.max_distance <= term.prev * term.block
                and not term.same_row and term.residues is None):  # a sliding window
            keys = i - np.arange(term.max_distance + 1)
            return xp.where(keys >= 0, keys, -1)
        t = np.arange((term.prev + 1) * term.block)
        keys = (i // term.block - term.prev) * term.block + t
        keep = xp.asarray(term.tile_mask())[i[..., 0] % term.block]
        return xp.where(keep & (keys >= 0), keys, -1)
    if isinstance(term, ColumnTerm):
        rows = np.arange(-(-seq_len // term.stride))
        keys = i - rows * term.stride
        return xp.where((rows >= term.min_rows) & (keys >= 0), keys, -1)
    rows = np.arange(-(-seq_len // term.block))
    keys = (rows[:, None] * term.block + np.array(term.residues)[None, :]).ravel()
    keys = keys[keys < seq_len]
    return xp.where(keys // term.block < i // term.block, keys, -1)  # rows before the query's


def term_candidates(term: Term, seq_len: int) -> np.ndarray:
    """Key positions of one term per query, ``int[seq_len, C]``, -1 where absent (NumPy)."""
    return term_rows(term, np.arange(seq_len), seq_len)


def term_key_count(term: Term, seq_len: int) -> int:
    """Keys one term gives the queries ``0 .. seq_len - 1``, all together, in O(seq_len) time and
    memory: the count ``term_candidates`` lists, without its ``[seq_len, C]`` array (for fixed at
    65,536 that array is 4 GB)."""
    i = np.arange(seq_len)
    if isinstance(term, BandTerm):  # a key before position 0 is absent: only rows < prev lose
        rows_before = np.maximum(term.prev - i // term.block, 0) * term.block  # keys cut off
        kept = np.cumsum(term.tile_mask()[:, ::-1], axis=1)[:, ::-1]  # kept at offsets >= t
        kept = np.concatenate([kept, np.zeros((term.block, 1), kept.dtype)], axis=1)
        return int(kept[i % term.block, rows_before].sum())
    if isinstance(term, ColumnTerm):  # rows min_rows .. r back, where the query is in row r
        return int(np.maximum(i // term.stride - term.min_rows + 1, 0).sum())
    return int((i // term.block).sum()) * len(term.residues)  # every earlier row's residues


def terms_to_indices(terms: Sequence[Term], seq_len: int) -> np.ndarray:
    """Index array of the union of ``terms`` (the reference check of the block view)."""
    seq_len = check_int("seq_len", seq_len)
    return _compact(np.concatenate([term_candidates(t, seq_len) for t in terms], axis=1), seq_len)


# --------------------------------------------------------------------------------------------
# A pattern by name, and the patterns of a layer's head groups.


@dataclasses.dataclass(frozen=True)
class PatternSpec:
    """Names an attention pattern; hashable, so it can be a static argument of ``jax.jit``, and
    ordered by ``str``, so it can key a dict that ``jax.jit`` takes as an argument.

    kind: one of ``KINDS``.
    stride: l (strided/fixed); the window of "local" is ``local_width`` (default stride + 1).
    c: summary width of "fixed".
    part: "both", or one part ("local"/"strided" for strided, "block"/"summary" for fixed).
    local_width: local window of "strided"/"local" (default stride + 1, the paper's formula).
    summary: "paper" or "lra" (fixed summary convention).
    summary_block: which summary sub-block of "fixed" (residues [l-(b+1)c, l-bc)).
    """
    kind: str = "strided"
    stride: int | None = None
    c: int | None = None
    part: str = "both"
    local_width: int | None = None
    summary: str = "paper"
    summary_block: int = 0

    def __post_init__(self):
        check_choice("kind", self.kind, KINDS)
        if self.kind != "dense":
            self.terms()  # validates every field

    def _fields(self) -> dict:
        return dict(stride=self.stride, c=self.c, part=self.part, local_width=self.local_width,
                    summary=self.summary, summary_block=self.summary_block)

    def indices(self, seq_len: int) -> np.ndarray:
        """``int32[seq_len, K]`` key indices per query (``pattern_indices``)."""
        return pattern_indices(self.kind, seq_len, **self._fields())

    def terms(self) -> tuple[Term, ...]:
        """Disjoint block-level terms of the pattern (``pattern_terms``)."""
        return pattern_terms(self.kind, **self._fields())

    @property
    def block(self) -> int:
        """Row length of the grid the fast path works on (all terms share it)."""
        blocks = {t.stride if isinstance(t, ColumnTerm) else t.block for t in self.terms()}
        assert len(blocks) == 1, blocks
        return blocks.pop()

    def row_keys(self, i, seq_len: int, xp=np):
        """Keys of query ``i`` (or of each of an array of queries) among ``seq_len`` positions,
        ``[..., C]`` with -1 where absent, not sorted; the same set as row ``i`` of
        ``indices(seq_len)`` without building it. With ``xp=jax.numpy`` ``i`` may be traced
        (``C`` depends only on ``seq_len``): the cached decoder's keys at position ``i``."""
        if self.kind == "dense":
            keys = np.arange(seq_len)
            return xp.where(keys <= xp.asarray(i)[..., None], keys, -1)
        return xp.concatenate([term_rows(t, i, seq_len, xp) for t in self.terms()], axis=-1)

    def mask(self, seq_len: int) -> np.ndarray:
        """``bool[seq_len, seq_len]`` (for references and pictures; O(n²))."""
        return indices_to_mask(self.indices(seq_len), seq_len)

    def mean_keys(self, seq_len: int) -> float:
        """Mean number of keys per query (|S| in FLOP counts), from the disjoint terms in
        O(seq_len): the index array itself is O(seq_len · K) (fixed, l = 256, at 65,536: 4 GB)."""
        seq_len = check_int("seq_len", seq_len)
        if self.kind == "dense":
            return (seq_len + 1) / 2
        return sum(term_key_count(t, seq_len) for t in self.terms()) / seq_len

    def __str__(self) -> str:
        if self.kind == "dense":
            return "dense"
        extras = {k: v for k, v in self._fields().items()
                  if v is not None and v != PatternSpec.__dataclass_fields__[k].default}
        return self.kind + "(" + ", ".join(f"{k}={v}" for k, v in extras.items()) + ")"

    def __lt__(self, other: PatternSpec) -> bool:
        return str(self) < str(other)


def layer_specs(spec: PatternSpec, mode: str, layer: int = 0, *,
                distinct_summaries: bool = False) -> tuple[PatternSpec, ...]:
    """Pattern of each head group of layer ``layer`` (paper §4.3); heads are split evenly over
    the groups.

    merged: one group attending the union of the parts (``spec`` with part="both").
    interleaved: one group, the part ``layer mod 2`` (local/strided, block/summary).
    multihead: one group per part; for fixed with ``distinct_summaries``, group b instead takes
    the whole pattern with ``summary_block=b`` (``stride // c`` groups).
    Dense and local patterns have one part: every mode gives ``(spec,)``.
    """
    check_choice("mode", mode, MODES)
    parts = PARTS[spec.kind][1:] if spec.kind in PARTS else ()
    if not parts or mode == "merged":
        return (spec,)
    if mode == "interleaved":
        return (dataclasses.replace(spec, part=parts[layer % 2]),)
    if spec.kind == "fixed" and distinct_summaries:
        return tuple(dataclasses.replace(spec, part="both", summary_block=b)
                     for b in range(spec.stride // spec.c))
    return tuple(dataclasses.replace(spec, part=p) for p in parts)


def pattern_parts(kind: str, seq_len: int, **spec) -> dict[str, np.ndarray]:
    """The index arrays of a pattern's parts by name (one part for dense and local), as
    scripts/plot_pattern.py draws them."""
    if kind in ("dense", "local"):
        return {kind: pattern_indices(kind, seq_len, **spec)}
    names = PARTS[kind][1:]
    spec = {k: v for k, v in spec.items() if k != "part"}
    return {name: pattern_indices(kind, seq_len, part=name, **spec) for name in names}
