"""The attention math of the factorized patterns: plain ``jnp`` functions and custom VJPs, no Flax.

* ``sparse_attention(q, k, v, spec)``: the fast block-sparse path (below; or, with
  ``implementation="pallas"``, the same block terms as a fused kernel, ``attention.blocks``),
  and for ``PatternSpec("dense")`` causal attention: with "native" (and "auto" on a CPU) one
  fused CPU kernel forward and one backward (``attention.native``), else query chunks with a
  flash-style custom backward; ``multi_spec_attention`` splits the heads into groups.
* ``dense_attention`` (a mask) and ``gather_attention`` (index arrays): the references the tests
  hold the fast path to.
* ``decode_attention``: one query per head over gathered keys, a step of the cached decoder.
  It and the references share one masked softmax (``_masked_exp``).

``sparse_attention(q, k, v, spec)`` computes exactly ``softmax(q kᵀ / √d + mask) v`` for the
pattern's mask, without an n×n array and without a per-query copy of K/V. It follows the
block-level view of ``pattern_terms``: the sequence is viewed as a grid of rows of
``block`` positions, ``[B, R, block, H, d]`` (a reshape of the inputs, no copy), and each term is
batched matmuls on cache-sized tiles with static shapes:

* ``BandTerm``: each query row (or sub-row) against the keys of its own and ``prev`` previous
  rows (local window, fixed block), one score block per key row: ``[c, B, H, Q, Q]`` each. A
  sliding window is computed on a grid of shorter sub-rows, which scores fewer masked keys;
* ``ColumnTerm``: each grid column against itself, the strided part ("strided transpose"):
  scores ``[c, B, H, R, R]`` for a chunk of c columns;
* ``SummaryTerm``: one query row against one block of the summary keys, which are sliced out of
  K/V once: scores ``[B, H, block, K]``, only for the blocks that hold a key of an earlier row;
* ``TileTerm`` (a user rule's keys beyond such terms, ``attention.custom``): its listed tiles
  with their masks, ``attention.tilepath``, merged last into the same running softmax.

The terms are disjoint (a key two parts share is scored once) and are combined in one joint
softmax. Each term goes through its chunks in a ``lax.scan``, forward and backward; a step
slices its queries and keys out of the grid into tiles and merges its row maximum, sum of
exponentials and weighted values into running ones held in the grid layout (log-sum-exp),
updated in place; the backward adds each step's dq, dk and dv in place the same way. So the
score tiles alive at any time are one step's (about ``_STEP_SCORES`` over the batch and heads),
and no whole array is ever copied into another layout. Time is O(n·|S|) with |S| the keys per query,
O(n·√n) for strided and fixed with stride ≈ √n. Memory is O(n·d) and one step's tiles.

Sequence lengths that are not a multiple of the block are padded at the end: a padded key sits
after every real query, so causality already hides it, and padded query rows are dropped.
A query with no key at all (possible only for the fixed summary part alone) outputs zeros.
Design: docs/design.md §3.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.attention import native as _native
from sparse_jax.attention import tilepath
from sparse_jax.attention.reference import FLOOR as _FLOOR
from sparse_jax.attention.reference import NEG as _NEG
from sparse_jax.attention.reference import dot
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.attention.terms import BandTerm, ColumnTerm, SummaryTerm, TileTerm

# ---------------------------------------------------------------------------------------------
# The fast path. Every array stays in the layout of the inputs, the grid ``[B, R, block, H, ...]``
# (a free reshape of ``[B, n, H, ...]``), from the inputs to the output and the gradients. Each
# term is computed in a ``lax.scan`` over chunks of its *tiles*: the grid rows (or sub-rows of
# them) for a band or a summary term, the grid columns for the column term. A scan step slices
# its queries and keys out of the grid into cache-sized tiles ``[c, B, H, Q, ...]`` (a summary
# step: ``[B, H, c * Q, ...]`` against shared keys) and merges
# its results into running accumulators held in the grid layout, updated in place: the softmax's
# row maximum, sum of exponentials and weighted values forward, dq, dk and dv backward. A band's
# window is scored as one block per key tile (tile t against t, t - 1, ...), so no key is copied
# into a window. No whole-array copy is made in any other layout: on a CPU such copies, not the
# matmuls, took most of the time. Only one chunk's score tiles exist at a time, whatever the
# compiler's schedule, and the forward pass and the custom backward share one definition of
# each term's blocks and masks.

_STEP_SCORES = 1 << 18  # scores in one scan step, all batch rows and heads (1 MiB float32)
_MIN_SUB_ROW = 64  # shortest sub-row a sliding-window band is cut into (shorter: slower dots)


@dataclasses.dataclass(frozen=True)
class _Term:
    """One term of the pattern as tiles of the grid ``[B, R, block, H, ...]``: along axis 1 the
    grid rows, each cut into ``split`` sub-rows (a tile is ``block // split`` queries), or along
    axis 2 the grid columns (a tile is a column's ``R`` queries). ``tiles``: how many; ``chunk``:
    tiles per scan step.

    Keys: tile t's keys are ``window + 1`` blocks, the tiles ``t - window .. t``. A summary term
    (``residues``) instead goes through ``pairs`` of ``chunk`` query rows and a block of
    ``key_block`` summary keys (a step's ``t`` is such a pair), only the pairs where a row sees a
    key.
    ``keep(t, c, j)``: boolean mask of block j of tiles ``t .. t + c - 1``, broadcastable to its
    scores (``t`` may be traced), or None where it keeps every score.
    """
    axis: int
    tiles: int
    keep: Callable
    chunk: int = 1
    split: int = 1
    window: int = 0
    residues: tuple[int, ...] | None = None
    key_block: int = 0
    pairs: tuple[tuple[int, int], ...] = ()
    min_rows: int = 0  # a column term's: keys at least this many rows before the query
    band: BandTerm | None = None  # a band term's pattern term (before any sub-rows)

    def view(self, x):
        """A grid array ``[B, R, block, H, ...]`` with this term's tiles along ``axis``."""
        if self.axis == 2:
            return x
        return x.reshape(x.shape[0], -1, x.shape[2] // self.split, *x.shape[3:])

    def _perm(self, ndim):  # view [B, T or Q, Q or T, H, ...] -> tiles [c, B, H, Q, ...]
        return (self.axis, 0, 3, 3 - self.axis) + tuple(range(4, ndim))

    def take(self, x, t, c):
        """Tiles ``t .. t + c - 1`` of a grid array, as ``[c, B, H, Q, ...]`` (for a summary
        term, rows ``t[0] ..`` as one tile ``[B, H, c * Q, ...]``: its keys ``[B, H, K, d]`` are
        shared)."""
        if self.residues is not None:  # c rows as one: [B, H, c * Q, ...]
            s = jax.lax.dynamic_slice_in_dim(x, t[0], c, axis=1)
            s = s.transpose((0, 3, 1, 2) + tuple(range(4, s.ndim)))
            return s.reshape(*s.shape[:2], -1, *s.shape[4:])
        s = jax.lax.dynamic_slice_in_dim(self.view(x), t, c, axis=self.axis)
        return s.transpose(self._perm(s.ndim))

    def put(self, x, t, y):
        """``x`` with tiles ``t ..`` replaced by ``y`` (``[c, B, H, Q, ...]``, as ``take``)."""
        if self.residues is not None:
            y = y.reshape(*y.shape[:2], -1, x.shape[2], *y.shape[3:])
            y = y.transpose((0, 2, 3, 1) + tuple(range(4, y.ndim))).astype(x.dtype)
            return jax.lax.dynamic_update_slice_in_dim(x, y, t[0], axis=1)
        y = y.transpose(np.argsort(self._perm(y.ndim))).astype(x.dtype)
        return jax.lax.dynamic_update_slice_in_dim(self.view(x), y, t,
                                                   axis=self.axis).reshape(x.shape)

    def add(self, x, t, y):
        return self.put(x, t, self.take(x, t, self.chunk if self.residues else y.shape[0]) + y)

    def key_tiles(self, x, t, c):
        """Keys of chunk ``[t, t + c)``: tiles ``t - window .. t + c - 1`` of a grid array (zeros
        before tile 0, where ``t`` is static), or for a pair ``t`` its block of the summary
        positions ``[B, H, R * len(residues), ...]`` (``summary``)."""
        if self.residues is not None:
            return jax.lax.dynamic_slice_in_dim(x, t[1] * self.key_block, self.key_block, 2)
        if isinstance(t, int) and t < self.window:
            tiles = self.take(x, 0, t + c)
            return jnp.pad(tiles, ((self.window - t, 0),) + ((0, 0),) * (tiles.ndim - 1))
        return self.take(x, t - self.window, c + self.window)

    def add_key_tiles(self, x, t, c, y):
        """The transpose of ``key_tiles``: ``x`` plus ``y`` there."""
        if self.residues is not None:  # transposed summary keys [B, H, d, K] (``key_grad``)
            start = t[1] * self.key_block
            block = jax.lax.dynamic_slice_in_dim(x, start, self.key_block, 3)
            return jax.lax.dynamic_update_slice_in_dim(x, block + y, start, 3)
        if isinstance(t, int) and t < self.window:
            return self.add(x, 0, y[self.window - t:])
        return self.add(x, t - self.window, y)

    def blocks(self, tiles):
        """Key tiles -> the key blocks of a chunk's tiles: block j of tile t is tile
        ``t - window + j``; or the summary keys."""
        if self.residues is not None:
            return [tiles]
        c = tiles.shape[0] - self.window
        return [tiles[j:j + c] for j in range(self.window + 1)]

    def key_grad(self, x, d):
        """``dᵀ x`` for a key block's gradient: queries' ``x`` ``[..., Q, d]`` and ``d``
        ``[..., Q, K]`` to ``[..., K, d]``; for a summary term transposed, ``[..., d, K]``
        (with K wide, that orientation of the product runs 2x faster on XLA:CPU)."""
        if self.residues is not None:
            return dot("...qd,...qk->...dk", x, d)
        return dot("...qk,...qd->...kd", d, x)

    def summary(self, x):
        """The summary positions of a grid array, ``[B, H, R * len(residues), ...]``, padded
        with zeros to whole key blocks."""
        s = x[:, :, np.asarray(self.residues)]
        s = jnp.moveaxis(s.reshape(s.shape[0], -1, *s.shape[3:]), 2, 1)
        pad = -s.shape[2] % self.key_block
        return jnp.pad(s, ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (s.ndim - 3)) if pad else s

    def summary_back(self, x, d):
        """The transpose of ``summary``: ``x`` plus ``d`` (transposed, ``[B, H, d, K]``) at the
        summary positions."""
        s = len(self.residues)
        d = d[..., :x.shape[1] * s].transpose(0, 3, 1, 2).reshape(*x.shape[:2], s, *x.shape[3:])
        return x.at[:, :, np.asarray(self.residues)].add(d)

    def chunks(self):
        """``(t, c, static)`` for each chunk in order: ``static`` chunks are separate calls, the
        others one ``lax.scan``; static are the chunks whose window reaches before tile 0 and
        the last, shorter chunk. A summary term's chunks are its pairs, all scanned."""
        if self.residues is not None:
            return [(pair, self.chunk, False) for pair in self.pairs]
        heads = -(-self.window // self.chunk)
        full, rest = divmod(self.tiles, self.chunk)
        return ([(i * self.chunk, self.chunk, i < heads) for i in range(full)]
                + ([(self.tiles - rest, rest, True)] if rest else []))


def _for_chunks(step, carry, term: _Term):
    """``carry = step(carry, t, c)`` for each chunk of the term's tiles: first the ``lax.scan``
    over a traced ``t``, then the static chunks with a Python int ``t``. (In that order the
    static chunks update the scan's buffers in place; the other way round, XLA rewrites the
    first update of freshly zeroed accumulators into a slow padding of the whole array.)"""
    chunks = term.chunks()
    scanned = [(t, c) for t, c, static in chunks if not static]
    if len(scanned) == 1:
        carry = step(carry, *scanned[0])
    elif scanned:
        c = scanned[0][1]
        starts = jnp.asarray([t for t, _ in scanned])  # [steps] or [steps, 2] (pairs)
        step_at = (lambda carry, s: step(carry, tuple(s), c)) if starts.ndim == 2 else (
            lambda carry, s: step(carry, s, c))
        carry = jax.lax.scan(lambda carry, s: (step_at(carry, s), None), carry, starts)[0]
    for t, c, static in chunks:
        if static:
            carry = step(carry, t, c)
    return carry


def _masked(keep, x, value):
    return x if keep is None else jnp.where(keep, x, value)


def _scores(q, k):  # [..., Q, d] x [..., K, d] -> [..., Q, K]
    return dot("...qd,...kd->...qk", q, k)


def _values(p, v):  # [..., Q, K] x [..., K, dv] -> [..., Q, dv]
    return dot("...qk,...kd->...qd", p, v)


def _chunk(scores_per_tile: int, tiles: int) -> int:
    """Tiles per scan step: about ``_STEP_SCORES`` scores (a step's tiles stay in cache; at
    batch 12 × 2 heads, steps sized per batch row and head were 6 MB and 1.4x slower). A
    divisor of ``tiles`` where one is near, so no shorter last chunk runs as extra calls."""
    most = max(1, _STEP_SCORES // scores_per_tile)
    divisor = max(c for c in range(1, min(most, tiles) + 1) if tiles % c == 0)
    return divisor if 4 * divisor >= 3 * most else most


def _sub_rows(term: BandTerm) -> int:
    """Sub-rows per grid row for a band whose mask depends on distance alone (a sliding window):
    the window of sub-rows of b keys scores (⌈max_distance / b⌉ + 1)·b keys per query, fewer
    than (prev + 1)·block (strided, l = 128: 192 instead of 256 for 129 kept). Picks the split
    that scores fewest keys with sub-rows of at least ``_MIN_SUB_ROW``, the smaller on a tie."""
    if term.same_row or term.residues is not None or term.max_distance is None:
        return 1

    def keys(split):
        sub = term.block // split
        return (-(-term.max_distance // sub) + 1) * sub

    splits = [s for s in range(1, term.block // _MIN_SUB_ROW + 1)
              if term.block % s == 0 and term.block // s >= _MIN_SUB_ROW]
    return min(splits, key=keys, default=1)


def _band(term: BandTerm, rows: int, lanes: int) -> _Term:
    band = term
    split = _sub_rows(term)
    if split > 1:  # the same window on a grid of sub-rows
        sub = term.block // split
        term = BandTerm(sub, prev=-(-term.max_distance // sub),
                                 max_distance=term.max_distance)
    prev, block = term.prev, term.block
    tile = term.tile_mask().reshape(block, prev + 1, block)

    def keep(t, c, j):  # block j's part of the tile mask, and no key before row 0
        if not isinstance(t, int):  # a scanned chunk, t >= window: every key row exists
            return None if tile[:, j].all() else jnp.asarray(tile[:, j])
        key_row = t + np.arange(c) - prev + j
        return jnp.asarray(tile[:, j][None, None, None] & (key_row >= 0)[:, None, None, None,
                                                                          None])

    return _Term(1, rows * split, keep, chunk=_chunk(lanes * tile.size, rows * split),
                 split=split, window=prev, band=band)


def _column(term: ColumnTerm, rows: int, lanes: int) -> _Term:
    r = np.arange(rows)
    keep = (r[:, None] - r[None, :]) >= term.min_rows  # [R (query), R (key)]
    return _Term(2, term.stride, lambda t, c, j: jnp.asarray(keep),
                 chunk=_chunk(lanes * rows * rows, term.stride), min_rows=term.min_rows)


_SUMMARY_QUERIES = 512  # queries in a summary step (fewer: slow small matmuls; more: big tiles)
_SUMMARY_SCORES = 1 << 16  # per batch row and head in a summary step (less: slower at batch 12)


def _summary(term: SummaryTerm, rows: int, lanes: int) -> _Term:
    """The summary keys (``[B, H, R * s, d]``, sliced out of K/V once) are shared by all queries.
    A step is a chunk of query rows against one block of them; only the blocks holding a key of
    a row before the chunk's last are scored, so few keys after a query row are (half of all
    summary keys would be), and a step scores about ``_SUMMARY_SCORES`` per batch row and head
    (whatever ``lanes``: smaller steps made the matmuls slower at batch 12). A chunk is the most
    rows, at most ``_SUMMARY_QUERIES / block``, that divides the rows."""
    s = len(term.residues)
    most = max(1, _SUMMARY_QUERIES // term.block)
    chunk = max(c for c in range(1, min(most, rows) + 1) if rows % c == 0)
    key_block = min(rows * s, max(1, _SUMMARY_SCORES // (chunk * term.block)))
    pairs = tuple((r, g) for r in range(0, rows, chunk) for g in range(-(-rows * s // key_block))
                  if g * key_block < (r + chunk - 1) * s)  # the block starts before a row's keys

    def keep(t, c, j):  # keys of rows before the query's row ([B, H, c * Q, K] scores)
        row, g = t
        query_row = row + jnp.arange(chunk * term.block) // term.block
        key_row = (g * key_block + jnp.arange(key_block)) // s
        return key_row[None, :] < query_row[:, None]

    return _Term(1, rows, keep, chunk=chunk, residues=term.residues, key_block=key_block,
                 pairs=pairs)


_TERMS = {BandTerm: _band, ColumnTerm: _column,
          SummaryTerm: _summary}


def _terms(spec: PatternSpec, rows: int, lanes: int) -> list[_Term]:
    """The pattern's terms on a grid of ``rows`` rows and ``lanes`` = batch × heads, those whose
    keys are their own query tiles first (a column, a band within a row): the first term visits
    every query and key once, so it writes the accumulators (forward: maximum, sum, values;
    backward: dq, dk, dv) instead of reading them back to add; a sliding window's key tiles
    overlap from step to step and are added whatever its place."""
    terms = [_TERMS[type(term)](term, rows, lanes) for term in spec.terms()
             if not isinstance(term, TileTerm)]  # a user rule's tiles: ``tilepath``, last
    return sorted(terms, key=lambda term: term.window > 0 or term.residues is not None)


def _queries(term, q_g, t, c, scale):
    """A chunk's queries scaled by 1/√d (in their dtype, as the reference rounds them)."""
    q = term.take(q_g, t, c)
    return q * jnp.asarray(scale, q.dtype)


def _native_term(term, i, native, *arrays):
    """Which fused CPU kernel (``attention.native``) runs term ``i``, if any: "column" for the
    column term when it comes first (it writes the accumulators), "band" for a band term (not
    one over chosen residues), "summary" for the summary term; only for float32 inputs with a
    supported head dim."""
    if not (native and _native.supports(*arrays)):
        return None
    if term.axis == 2 and i == 0:
        return "column"
    if term.band is not None and _native.band_supported(term.band):
        return "band"
    if term.residues is not None:
        return "summary"
    return None


def _native_args(kind, term):
    """The pattern arguments of ``kind``'s kernel calls."""
    return {"column": term.min_rows, "band": term.band, "summary": term.residues}[kind]


def grid_forward(spec, scale, q_g, k_g, v_g, native=False):
    """Joint softmax over all terms: each chunk merges its row maximum, sum of exponentials and
    weighted values into the running ones (log-sum-exp). All ``[B, R, block, H, d]``; q is
    scaled by ``scale`` chunk by chunk. Returns the output ``[B, R, block, H, dv]`` and the
    log-sum-exp ``[B, R, block, H]``, float32. ``spec``: anything with ``.terms()`` (the
    context-parallel path, ``attention.context``, passes a shard's share of the terms)."""
    row_max = jnp.full_like(q_g[..., 0], _FLOOR, jnp.float32)  # *_like: also in shard_map
    total = jnp.zeros_like(q_g[..., 0], jnp.float32)
    acc = jnp.zeros_like(v_g, jnp.float32)
    for i, term in enumerate(_terms(spec, q_g.shape[1], q_g.shape[0] * q_g.shape[3])):
        fused = _native_term(term, i, native, q_g, k_g, v_g)
        if fused:  # the column writes the accumulators, the others merge into them
            so_far = () if fused == "column" else (row_max, total, acc)
            row_max, total, acc = getattr(_native, f"{fused}_forward")(
                q_g, k_g, v_g, *so_far, _native_args(fused, term), scale)
            continue
        k_src, v_src = (term.summary(x) if term.residues else x for x in (k_g, v_g))
        once = i == 0 and not term.residues  # visits each query once, first: nothing to merge

        def step(carry, t, c, term=term, k_src=k_src, v_src=v_src, once=once):
            row_max, total, acc = carry
            q = _queries(term, q_g, t, c, scale)
            k_blocks, v_blocks = (term.blocks(term.key_tiles(x, t, c)) for x in (k_src, v_src))
            scores = [_masked(term.keep(t, c, j), _scores(q, k), _NEG)
                      for j, k in enumerate(k_blocks)]
            old_max = jnp.float32(_FLOOR) if once else term.take(row_max, t, c)
            new_max = functools.reduce(jnp.maximum, [s.max(-1) for s in scores], old_max)
            probs = [jnp.exp(s - new_max[..., None]) for s in scores]  # a row with no key: 0
            new_total = sum(p.sum(-1) for p in probs)
            new_acc = sum(_values(p.astype(v_g.dtype), v) for p, v in zip(probs, v_blocks))
            if not once:
                rescale = jnp.exp(old_max - new_max)
                new_total = new_total + rescale * term.take(total, t, c)
                new_acc = new_acc + rescale[..., None] * term.take(acc, t, c)
            return (term.put(row_max, t, new_max), term.put(total, t, new_total),
                    term.put(acc, t, new_acc))

        row_max, total, acc = _for_chunks(step, (row_max, total, acc), term)
    for term in tilepath.tile_terms(spec):
        row_max, total, acc = tilepath.forward(term, scale, q_g, k_g, v_g, (row_max, total, acc))
    out = acc / jnp.maximum(total, 1e-30)[..., None]
    lse = jnp.where(total > 0, row_max + jnp.log(jnp.maximum(total, 1e-30)), -_NEG)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def grid_attention(spec, scale, native, q_g, k_g, v_g):
    return grid_forward(spec, scale, q_g, k_g, v_g, native)[0]


def _grid_attention_fwd(spec, scale, native, q_g, k_g, v_g):
    out, lse = grid_forward(spec, scale, q_g, k_g, v_g, native)
    return out, (q_g, k_g, v_g, out, lse)


def grid_backward(spec, scale, native, residuals, d_out):
    """Flash-style backward: recompute each chunk's probabilities from the saved log-sum-exp,
    so memory stays at one chunk's score tiles; dq, dk and dv accumulate in place in the grid
    layout (a summary term's dk and dv first over its summary keys). Also the backward of each
    shard's share of the terms in ``sparse_jax.attention.context``."""
    q_g, k_g, v_g, out, lse = residuals
    d_out = d_out.astype(jnp.float32)
    delta = dot("...d,...d->...", d_out, out)  # D_i = sum_j P_ij dP_ij = dO_i · O_i (as a
    # batched dot: XLA:CPU's reduction over the last axis is 20x slower)
    d_q, d_k, d_v = (jnp.zeros_like(x, jnp.float32) for x in (q_g, k_g, v_g))  # shard_map too
    for i, term in enumerate(_terms(spec, q_g.shape[1], q_g.shape[0] * q_g.shape[3])):
        fused = _native_term(term, i, native, q_g, k_g, v_g)
        if fused:  # the column writes dq, dk and dv, the others add to them
            so_far = () if fused == "column" else (d_q, d_k, d_v)
            d_q, d_k, d_v = getattr(_native, f"{fused}_backward")(
                q_g, k_g, v_g, d_out, lse, delta, *so_far, _native_args(fused, term), scale)
            continue
        k_src, v_src = (term.summary(x) if term.residues else x for x in (k_g, v_g))
        once = i == 0 and not term.residues  # its dq is the first and only one per query
        if term.residues:  # the summary keys' gradients, transposed (``key_grad``)
            d_src = tuple(jnp.zeros_like(x.swapaxes(2, 3), jnp.float32) for x in (k_src, v_src))
        else:
            d_src = (d_k, d_v)

        def step(carry, t, c, term=term, k_src=k_src, v_src=v_src, once=once):
            d_q, (d_k, d_v) = carry
            q = _queries(term, q_g, t, c, scale)
            k_tiles, v_tiles = (term.key_tiles(x, t, c) for x in (k_src, v_src))
            lse_c, delta_c, d_out_c = (term.take(x, t, c) for x in (lse, delta, d_out))
            do = d_out_c.astype(v_g.dtype)
            d_q_c = 0.0
            d_k_blocks, d_v_blocks = [], []
            for j, (k, v) in enumerate(zip(term.blocks(k_tiles), term.blocks(v_tiles))):
                probs = jnp.exp(_scores(q, k) - lse_c[..., None])
                probs = _masked(term.keep(t, c, j), probs, 0.0)
                d_scores = probs * (_scores(do, v) - delta_c[..., None])  # dS = P ∘ (dP - D)
                d_scores = d_scores.astype(q_g.dtype)
                d_q_c = d_q_c + _values(d_scores, k)
                d_k_blocks.append(term.key_grad(q, d_scores))
                d_v_blocks.append(term.key_grad(do, probs.astype(v_g.dtype)))
            if term.residues:
                d_k_tiles, d_v_tiles = d_k_blocks[0], d_v_blocks[0]
            else:  # the transpose of ``blocks``
                d_k_tiles, d_v_tiles = (
                    jax.vjp(term.blocks, jnp.zeros_like(x, jnp.float32))[1](d)[0]
                    for x, d in ((k_tiles, d_k_blocks), (v_tiles, d_v_blocks)))
            if once and not term.window:  # its keys are its queries: first and only visit
                d_k, d_v = term.put(d_k, t, d_k_tiles), term.put(d_v, t, d_v_tiles)
            else:
                d_k = term.add_key_tiles(d_k, t, c, d_k_tiles)
                d_v = term.add_key_tiles(d_v, t, c, d_v_tiles)
            d_q_c = d_q_c * scale
            return (term.put if once else term.add)(d_q, t, d_q_c), (d_k, d_v)

        d_q, d_src = _for_chunks(step, (d_q, d_src), term)
        if term.residues:
            d_k, d_v = (term.summary_back(g, d) for g, d in zip((d_k, d_v), d_src))
        else:
            d_k, d_v = d_src
    for term in tilepath.tile_terms(spec):
        d_q, d_k, d_v = tilepath.backward(term, scale, q_g, k_g, v_g, d_out, lse, delta,
                                          (d_q, d_k, d_v))
    return tuple(g.astype(x.dtype) for g, x in zip((d_q, d_k, d_v), (q_g, k_g, v_g)))


grid_attention.defvjp(_grid_attention_fwd, grid_backward)


