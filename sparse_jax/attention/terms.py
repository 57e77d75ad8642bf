"""The block-level view of a pattern, for the fast paths. ``pattern_terms`` splits a pattern into
*disjoint* terms whose union is the pattern, each of a shape that a few dense matmuls serve with
static shapes (the sequence viewed as a grid of rows of ``block`` positions, ``block = stride``):

* ``BandTerm``: query row ``r`` attends the contiguous keys of rows ``r - prev .. r``, kept by an
  element mask that depends only on the offsets inside that window (local window, fixed block,
  current-block summary). One ``[rows, block, (prev+1) * block]`` score tile per row.
* ``ColumnTerm``: query ``(r, col)`` attends ``(r', col)`` for ``r - r' >= min_rows`` (the strided
  part as column attention of the grid, openai's "strided transpose"). ``min_rows`` drops the keys
  that a band term already covers, so a shared key is scored once.
* ``SummaryTerm``: every query of row ``r`` attends the keys at ``residues`` of all earlier rows
  (the fixed summary part). The summary keys are a strided slice of K/V, taken once and shared by
  all queries.

A user's pattern (``attention.custom``) adds ``TileTerm`` (``attention.tileterm``): the tiles
a rule keeps beyond such terms, each with its exact mask. ``window``, ``own_block``, ``columns``
and ``summaries`` make the terms, for the built-in patterns and a user's alike.

``terms_to_indices`` rebuilds the index array from the terms; the tests check it equals the
pattern (``patterns``), so the fast path and the index arrays cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from sparse_jax.attention.patterns import (
    KINDS,
    PARTS,
    check_choice,
    check_int,
    compact,
    summary_residues,
)
from sparse_jax.attention.tileterm import TileTerm, tile_key_count, tile_rows

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


Term = BandTerm | ColumnTerm | SummaryTerm | TileTerm  # TileTerm: a user rule's remainder


# The terms as a pattern's author writes them (``attention.custom``); the built-in patterns below
# are made of these, so a user's pattern and a built-in one are the same objects.


def window(width: int, block: int) -> BandTerm:
    """A sliding window of ``width`` keys ending at the query (``j in [i - width + 1, i]``) on a
    grid of ``block`` positions per row."""
    width, block = check_int("width", width), check_int("block", block)
    return BandTerm(block, prev=-(-(width - 1) // block), max_distance=width - 1)


def own_block(block: int, residues: Sequence[int] | None = None) -> BandTerm:
    """The keys ``j <= i`` in the query's own row of ``block`` (only those at ``residues``
    ``j mod block`` if given)."""
    block = check_int("block", block)
    return BandTerm(block, prev=0, same_row=True,
                    residues=None if residues is None else tuple(residues))


def columns(stride: int, beyond: int = 0) -> ColumnTerm:
    """Every ``stride``-th key back, ``i - m * stride``, leaving out those of a window of
    ``beyond`` keys (0: none) that a ``window`` term gives already."""
    stride = check_int("stride", stride)
    beyond = check_int("beyond", beyond, 0)
    return ColumnTerm(stride, min_rows=(beyond - 1) // stride + 1 if beyond else 0)


def summaries(block: int, residues: Sequence[int]) -> SummaryTerm:
    """The keys at ``residues`` (``j mod block``) of every row before the query's."""
    return SummaryTerm(check_int("block", block), tuple(residues))


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
        return (window(width, max(1, width - 1)),)
    if kind == "strided":
        check_choice("part", part, PARTS["strided"])
        width = stride + 1 if local_width is None else check_int("local_width", local_width)
        terms = []
        if part in ("both", "local"):
            terms.append(window(width, stride))
        if part == "strided":
            terms.append(columns(stride))
        if part == "both":  # keys i - m*l with m*l <= w - 1 are in the local window already
            terms.append(columns(stride, beyond=width))
        return tuple(terms)
    residues = summary_residues(stride, c, summary_block, summary)
    check_choice("part", part, PARTS["fixed"])
    if part == "block":
        return (own_block(stride),)
    if part == "summary":
        return (own_block(stride, residues), summaries(stride, residues))
    return (own_block(stride), summaries(stride, residues))


def term_rows(term: Term, i, seq_len: int, xp=np):
    """Key positions of one term for the queries ``i`` (an int array, or with ``xp=jax.numpy`` a
    traced position: a step of the cached decoder), ``[..., C]``, -1 where absent. ``C`` depends
    only on the term and ``seq_len`` (not on ``i``), so a decoder gets static shapes and builds
    no ``[seq_len, K]`` table; a sliding window lists just its ``max_distance + 1`` keys."""
    if isinstance(term, TileTerm):
        return tile_rows(term, i, seq_len, xp)
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
    if isinstance(term, TileTerm):
        return tile_key_count(term, seq_len)
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
    return compact(np.concatenate([term_candidates(t, seq_len) for t in terms], axis=1), seq_len)
