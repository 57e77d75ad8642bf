"""The generic block-list term of a user pattern (``attention.custom``): ``TileTerm``, the keys a
rule keeps beyond the pattern's band, column and summary terms, served tile by tile. NumPy only.

The sequence is a grid of rows of ``block`` positions, as for the other terms. At a length ``n``
the host evaluates the term's rule on every tile of the causal half (a query row against a key
row, ``block x block`` pairs), once per length (cached), and keeps the tiles that hold a kept
pair: a tile whose every pair is kept is *full* (no mask), the others are *partial*, each with
its exact boolean mask; equal masks are stored once (a window's diagonal tile is one mask for
every row). ``tile_plan`` gives the XLA path those lists per query row; ``tile_counts`` the kept
pairs of any tiling (the Pallas kernels' tiles are not the grid's); ``tile_keys`` the keys of
each query (the cached decoder and the attention statistics).

Cost on the host: the rule is evaluated on the ``n (n + block) / 2`` pairs of the causal tiles,
a query row at a time (about a second per 10^8 pairs for a rule of a few array operations).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

FULL, EMPTY = 0, 1  # mask ids of the all-kept tile and of list padding (no pair kept)


@dataclasses.dataclass(frozen=True, eq=False)
class TileTerm:
    """Query ``i`` attends key ``j <= i`` where ``keep(i, j)``: ``keep`` takes broadcastable
    integer arrays (NumPy, and for the Pallas kernels jax.numpy) and returns booleans; it must
    leave out the pairs the pattern's other terms give (terms are disjoint). ``name``
    identifies the term: equal names are equal terms (a static argument of ``jax.jit``).
    ``traceable``: whether ``keep`` runs on jax.numpy arrays too (inside a Pallas kernel)."""
    block: int
    keep: Callable
    name: str
    traceable: bool = False

    def __eq__(self, other):
        return isinstance(other, TileTerm) and (self.block, self.name) == (other.block,
                                                                          other.name)

    def __hash__(self):
        return hash(("TileTerm", self.block, self.name))

    def __repr__(self):
        return f"TileTerm(block={self.block}, name={self.name!r})"


def row_mask(term: TileTerm, row: int, block: int, length: int) -> np.ndarray:
    """``bool[block, length]``: which keys ``0 .. length - 1`` the queries ``row * block ..``
    keep (causal)."""
    q = np.arange(row * block, (row + 1) * block)[:, None]
    k = np.arange(length)[None, :]
    return np.asarray(term.keep(q, k), bool) & (k <= q)


@functools.lru_cache(maxsize=32)
def tile_counts(term: TileTerm, n: int, block_q: int, block_k: int) -> np.ndarray:
    """``int64[ceil(n / block_q), ceil(n / block_k)]``: kept pairs of each tile at length ``n``
    (positions past ``n`` hold no pair)."""
    nqb, nkb = -(-n // block_q), -(-n // block_k)
    counts = np.zeros((nqb, nkb), np.int64)
    for a in range(nqb):
        length = min(n, (a + 1) * block_q)
        mask = row_mask(term, a, block_q, nkb * block_k)
        mask[:, length:] = False
        mask[max(0, n - a * block_q):] = False
        counts[a] = mask.reshape(block_q, nkb, block_k).sum((0, 2))
    return counts


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """The tiles of a ``TileTerm`` on a grid of ``rows`` rows: per query row the key rows
    (``key_rows [rows, M]``, padded with 0) and their masks (``mask_ids [rows, M]`` into
    ``masks [P, block, block]``; ``FULL`` keeps all, ``EMPTY`` pads), ``pairs`` kept and
    ``tiles`` listed in all."""
    key_rows: np.ndarray
    mask_ids: np.ndarray
    masks: np.ndarray
    pairs: int
    tiles: int


@functools.lru_cache(maxsize=32)
def tile_plan(term: TileTerm, rows: int) -> TilePlan:
    """The term's tiles on a grid of ``rows`` rows of ``term.block`` (every position a real one:
    a rule is a function of positions, so the padding rows' tiles are the rule's too)."""
    b = term.block
    table = {b"full": FULL, b"empty": EMPTY}
    masks = [np.ones((b, b), bool), np.zeros((b, b), bool)]
    lists, pairs = [], 0
    for r in range(rows):
        tiles = row_mask(term, r, b, (r + 1) * b).reshape(b, r + 1, b).swapaxes(0, 1)
        counts = tiles.sum((1, 2))
        entries = []
        for kr in np.nonzero(counts)[0]:
            if counts[kr] == b * b:
                entries.append((kr, FULL))
                continue
            key = np.packbits(tiles[kr]).tobytes()
            if key not in table:
                table[key] = len(masks)
                masks.append(tiles[kr])
            entries.append((kr, table[key]))
        pairs += int(counts.sum())
        lists.append(entries)
    width = max(1, max(map(len, lists)))
    key_rows = np.zeros((rows, width), np.int32)
    mask_ids = np.full((rows, width), EMPTY, np.int32)
    for r, entries in enumerate(lists):
        for slot, (kr, m) in enumerate(entries):
            key_rows[r, slot], mask_ids[r, slot] = kr, m
    return TilePlan(key_rows, mask_ids, np.stack(masks), pairs, sum(map(len, lists)))


@functools.lru_cache(maxsize=8)
def tile_keys(term: TileTerm, n: int) -> np.ndarray:
    """``int32[n, C]``: the term's keys of each query, ascending, -1 padded (C: the most)."""
    b = term.block
    rows = []
    for r in range(-(-n // b)):
        mask = row_mask(term, r, b, min(n, (r + 1) * b))[:max(0, min(b, n - r * b))]
        rows.extend(np.nonzero(m)[0] for m in mask)
    width = max(1, max(map(len, rows)))
    out = np.full((n, width), -1, np.int32)
    for i, keys in enumerate(rows):
        out[i, :len(keys)] = keys
    return out


def tile_rows(term: TileTerm, i, seq_len: int, xp=np):
    """``term_rows`` of a tile term: row ``i`` of ``tile_keys`` (``i`` may be traced)."""
    return xp.asarray(tile_keys(term, seq_len))[xp.asarray(i)]


def tile_key_count(term: TileTerm, seq_len: int) -> int:
    """Keys the term gives the queries ``0 .. seq_len - 1``, all together."""
    return int(tile_counts(term, seq_len, term.block, term.block).sum())
