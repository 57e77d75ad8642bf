"""The attention math of the factorized patterns: plain ``jnp`` functions and custom VJPs, no Flax.

* ``sparse_attention(q, k, v, spec)``: the fast block-sparse path (below; or, with
  ``implementation="pallas"``, the same block terms as a fused kernel, ``sparse_jax.kernel``),
  and for ``PatternSpec("dense")`` causal attention in query chunks with a flash-style custom
  backward; ``multi_spec_attention`` splits the heads into groups.
* ``dense_attention`` (a mask) and ``gather_attention`` (index arrays): the references the tests
  hold the fast path to.
* ``decode_attention``: one query per head over gathered keys, a step of the cached decoder.
  It and the references share one masked softmax (``_masked_exp``).

``sparse_attention(q, k, v, spec)`` computes exactly ``softmax(q kᵀ / √d + mask) v`` for the
pattern's mask, without an n×n array and without a per-query copy of K/V. It follows the
block-level view of ``patterns.pattern_terms``: the sequence is viewed as a grid of rows of
``block`` positions and each term is a few batched matmuls with static shapes:

* ``BandTerm``: each query row against the keys of its own and ``prev`` previous rows
  (local window, fixed block): scores ``[B, H, rows, block, (prev + 1) * block]``. A sliding
  window is computed on a grid of shorter sub-rows, which scores fewer masked keys;
* ``ColumnTerm``: each grid column against itself, the strided part ("strided transpose"):
  scores ``[B, H, stride, rows, rows]``;
* ``SummaryTerm``: each query row against the summary keys of all earlier rows, sliced out of
  K/V once: scores ``[B, H, rows, block, rows * residues]``, computed in triangular chunks so
  the keys after a query row are (mostly) never scored.

The terms are disjoint (a key two parts share is scored once) and are combined with one joint
softmax: each term returns its row maximum, sum of exponentials and weighted values, and the
log-sum-exp merge rescales them. The band and column terms go through their rows (columns) in a
``lax.scan`` over chunks of a few of them, forward and backward, so the score tiles alive at any
time are one chunk's, about ``_CHUNK_SCORES`` per batch and head. Time is O(n·|S|) with |S| the
keys per query, O(n·√n) for strided and fixed with stride ≈ √n. Memory is O(n·d) and one chunk
of each term; the summary term's static chunks are O(n·|S|) / ``_SUMMARY_CHUNKS`` each.

Sequence lengths that are not a multiple of the block are padded at the end: a padded key sits
after every real query, so causality already hides it, and padded query rows are dropped.
A query with no key at all (possible only for the fixed summary part alone) outputs zeros.
Design: docs/design.md §3.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax import kernel, patterns
from sparse_jax.patterns import PatternSpec

IMPLEMENTATIONS = ("xla", "pallas", "auto")  # unfused XLA ops, or fused kernels (and "auto")

_NEG = -1e30  # finite "minus infinity" for masked scores: no NaN in values or gradients
_FLOOR = -1e20  # floor of a row maximum: exp(_NEG - _FLOOR) == 0 even for a row with no key
_SUMMARY_CHUNKS = 8  # query-row chunks of the summary term; fewer chunks score more masked keys


def _check_qkv(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be [batch, seq, heads, head_dim]; got shapes "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {q.shape} and {k.shape}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must match q in [batch, seq, heads], got {v.shape} vs {q.shape}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")


# ---------------------------------------------------------------------------------------------
# References.


def _masked_exp(scores, mask):
    """The masked softmax shared by the references and the decoding step, before its division:
    ``exp(score - row max)`` where ``mask`` holds, 0 elsewhere, and the row sums (float32). The
    caller divides by ``max(sum, 1e-30)``, so a row with no key gives zeros, not NaN."""
    scores = jnp.where(mask, scores, _NEG)
    probs = jnp.where(mask, jnp.exp(scores - scores.max(-1, keepdims=True)), 0.0)
    return probs, probs.sum(-1, keepdims=True)


def dense_attention(q, k, v, mask):
    """The obviously-correct reference: ``softmax(q kᵀ / √d, masked) v`` in float32.

    q, k: [B, n, H, d]; v: [B, n, H, dv]; mask: bool, broadcastable to [B, H, n, n]
    (``mask[..., i, j]``: query i may attend key j). Rows with no key give zeros.
    """
    _check_qkv(q, k, v)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    probs, total = _masked_exp(scores / math.sqrt(q.shape[-1]), jnp.asarray(mask, dtype=bool))
    probs = probs / jnp.maximum(total, 1e-30)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32))
    return out.astype(q.dtype)


def gather_attention(q, k, v, indices):
    """Second reference: gathers each query's keys (``k[idx]``, [B, n, K, H, d]). Slow, O(n·K·d)
    memory; never the default."""
    _check_qkv(q, k, v)
    idx = jnp.asarray(indices)
    valid = idx >= 0
    safe = jnp.where(valid, idx, 0)
    k_g, v_g = k[:, safe], v[:, safe]  # [B, n, K, H, d]
    scores = jnp.einsum("bqhd,bqkhd->bhqk", q, k_g, preferred_element_type=jnp.float32)
    probs, total = _masked_exp(scores / math.sqrt(q.shape[-1]), valid[None, None])
    probs = probs / jnp.maximum(total, 1e-30)
    return jnp.einsum("bhqk,bqkhd->bqhd", probs, v_g.astype(jnp.float32)).astype(q.dtype)


def decode_attention(q_BHD, k_BKHD, v_BKHD, valid):
    """Attention of one query per (batch, head) over K keys: one position of a cached decoder.

    q: [B, H, d]; k: [B, K, H, d]; v: [B, K, H, dv]; valid: bool broadcastable to [B, H, K]
    (False: not a key of this query). As in ``sparse_attention``, q is scaled by 1/√d in its
    dtype, scores and softmax are float32 and the probabilities enter the value product in the
    input dtype, so a step rounds as its row of the full pass does. Returns [B, H, dv] in q's
    dtype; zeros for a query with no valid key.
    """
    q_BHD = q_BHD * jnp.asarray(1.0 / math.sqrt(q_BHD.shape[-1]), q_BHD.dtype)
    scores = jnp.einsum("bhd,bkhd->bhk", q_BHD, k_BKHD, preferred_element_type=jnp.float32)
    probs, total = _masked_exp(scores, valid)
    out = jnp.einsum("bhk,bkhd->bhd", probs.astype(v_BKHD.dtype), v_BKHD,
                     preferred_element_type=jnp.float32)
    return (out / jnp.maximum(total, 1e-30)).astype(q_BHD.dtype)


# ---------------------------------------------------------------------------------------------
# The fast path. Each term becomes one or more "pieces". A piece sees the grid in its own
# layout, [B, H, tiles, queries per tile, ...]: the tiles are the grid rows (or sub-rows), or the
# grid columns for column attention (``transposed``). The keys of tile t lie in tiles
# t - halo .. t, so the queries of a chunk of consecutive tiles need one contiguous slab of K/V.
# A piece is computed chunk by chunk in a ``lax.scan``, so only one chunk's score tiles exist at
# a time (memory is bounded by the chunk, whatever the compiler's schedule), and the forward
# pass and the custom backward pass share one definition of each piece.

_CHUNK_SCORES = 1 << 16  # scores per (batch, head) in one scan step of a piece (256 KiB float32)
_MIN_SUB_ROW = 64  # shortest sub-row a sliding-window band is cut into (shorter: slower dots)


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Tiles ``[t0, t1)`` of one term, in the term's layout ``[B, H, tiles, Q, ...]``: the tiles
    are the grid rows (``[B, H, R, block, ...]``), each grid row cut into ``split`` sub-rows, or
    the grid columns if ``transposed`` (``[B, H, block, R, ...]``; the piece covers all of them).

    ``scores(q, k)``: queries of ``c`` consecutive tiles ``[B, H, c, Q, d]`` and their key slab,
    tiles ``t - halo .. t + c - 1`` (``[B, H, halo + c, ., d]``), to scores ``[B, H, c, Q, K]``;
    ``values(p, v)``: probabilities and the value slab to ``[B, H, c, Q, dv]``; both linear, with
    float32 results. ``keep(t, c)``: boolean mask of tiles ``t .. t + c - 1``, broadcastable to
    the scores (``t`` may be traced). ``chunk``: tiles per scan step. ``window``: the keys of
    a tile are it and the ``window`` tiles before it, laid side by side once (``key_layout``),
    so the key slab of tile t is tile t of that layout.
    """
    t0: int
    t1: int
    halo: int
    chunk: int
    scores: Callable
    values: Callable
    keep: Callable
    transposed: bool = False
    split: int = 1
    window: int = 0

    def layout(self, x):
        """A grid array ``[B, H, R, block, ...]`` in this piece's layout (all tiles)."""
        if self.transposed:
            return x.swapaxes(2, 3)
        return x.reshape(*x.shape[:2], -1, x.shape[3] // self.split, *x.shape[4:])

    def key_layout(self, x):
        """The keys (values) of a grid array in this piece's layout: with a ``window``, tile t
        holds tiles t - window .. t side by side (zeros before tile 0), built once for all tiles
        so that no scan step copies keys around."""
        x = self.layout(x)
        if not self.window:
            return x
        padded = jnp.pad(x, ((0, 0), (0, 0), (self.window, 0)) + ((0, 0),) * (x.ndim - 3))
        tiles = x.shape[2]
        return jnp.concatenate([padded[:, :, p:p + tiles] for p in range(self.window + 1)],
                               axis=3)

    def to_grid(self, x):
        """Inverse of ``layout`` (for arrays covering tiles ``[t0, t1)``)."""
        if self.transposed:
            return x.swapaxes(2, 3)
        return x.reshape(*x.shape[:2], -1, x.shape[3] * self.split, *x.shape[4:])

    def grid_rows(self) -> slice:
        """The grid rows this piece's results cover."""
        if self.transposed:
            return slice(None)
        return slice(self.t0 // self.split, self.t1 // self.split)


def _dot(subscripts, a, b):
    return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)


def _chunk(scores_per_tile: int) -> int:
    return max(1, _CHUNK_SCORES // scores_per_tile)


def _sub_rows(term: patterns.BandTerm) -> int:
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


def _band_pieces(term: patterns.BandTerm, rows: int):
    split = _sub_rows(term)
    if split > 1:  # the same window on a grid of sub-rows
        sub = term.block // split
        term = patterns.BandTerm(sub, prev=-(-term.max_distance // sub),
                                 max_distance=term.max_distance)
    prev, block = term.prev, term.block
    tile = term.tile_mask()

    def keep(t, c):  # the tile mask, and no key in the rows before row 0
        key_row = t + jnp.arange(c)[:, None] - prev + jnp.arange(tile.shape[1])[None] // block
        return jnp.asarray(tile)[None] & (key_row >= 0)[:, None, :]

    return [_Piece(
        0, rows * split, halo=0, chunk=_chunk(tile.size), split=split, window=prev,
        scores=lambda q, k: _dot("bhrqd,bhrkd->bhrqk", q, k),
        values=lambda p, v: _dot("bhrqk,bhrkd->bhrqd", p, v),
        keep=keep)]


def _column_pieces(term: patterns.ColumnTerm, rows: int):
    r = np.arange(rows)
    keep = (r[:, None] - r[None, :]) >= term.min_rows  # [R (query), R (key)]
    return [_Piece(
        0, term.stride, halo=0, chunk=_chunk(rows * rows), transposed=True,
        scores=lambda q, k: _dot("bhcqd,bhckd->bhcqk", q, k),
        values=lambda p, v: _dot("bhcqk,bhckd->bhcqd", p, v),
        keep=lambda t, c: jnp.asarray(keep))]


def _summary_pieces(term: patterns.SummaryTerm, rows: int):
    """The summary keys are a strided slice of K/V ([B, H, R * s, d]) shared by all queries.
    Query rows go in static chunks; chunk ``[r0, r1)`` scores only the summary keys of rows
    ``< r1 - 1``, so few keys after a query row are scored (half of all summary keys would be)."""
    residues = np.asarray(term.residues)
    s = len(residues)

    def summary(x, num_keys):  # slab of rows 0 .. r1 - 1 -> its first num_keys summary keys
        return x[:, :, :, residues].reshape(*x.shape[:2], -1, x.shape[-1])[:, :, :num_keys]

    bounds = np.unique(np.linspace(0, rows, min(_SUMMARY_CHUNKS, rows) + 1).round().astype(int))
    pieces = []
    for r0, r1 in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        n_keys = max(r1 - 1, 1) * s  # keys of rows < r1 - 1 (one masked row when r1 = 1)
        keep = (np.arange(n_keys)[None, :] // s < np.arange(r0, r1)[:, None])[:, None, :]
        pieces.append(_Piece(
            r0, r1, halo=r0, chunk=r1 - r0,
            scores=lambda q, k, n=n_keys: _dot("bhrqd,bhkd->bhrqk", q, summary(k, n)),
            values=lambda p, v, n=n_keys: _dot("bhrqk,bhkd->bhrqd", p, summary(v, n)),
            keep=lambda t, c, keep=keep: jnp.asarray(keep)))
    return pieces


_PIECES = {patterns.BandTerm: _band_pieces, patterns.ColumnTerm: _column_pieces,
           patterns.SummaryTerm: _summary_pieces}


def _pieces(spec: PatternSpec, rows: int) -> list[_Piece]:
    return [p for term in spec.terms() for p in _PIECES[type(term)](term, rows)]


def _over_chunks(step, carry, piece: _Piece):
    """``carry, y = step(carry, t, c)`` for the chunks ``[t, t + c)`` of the piece's tiles: a
    ``lax.scan`` over the full chunks, then one call for the rest. Returns the final carry and the
    ``y``s joined along the tile axis (2)."""
    full, rest = divmod(piece.t1 - piece.t0, piece.chunk)
    ys = []
    if full == 1:
        carry, y = step(carry, piece.t0, piece.chunk)
        ys.append(y)
    elif full > 1:
        starts = piece.t0 + piece.chunk * jnp.arange(full)
        carry, y = jax.lax.scan(lambda carry, t: step(carry, t, piece.chunk), carry, starts)
        ys.append(jax.tree.map(  # [steps, B, H, c, ...] -> [B, H, steps * c, ...]
            lambda a: jnp.moveaxis(a, 0, 2).reshape(*a.shape[1:3], -1, *a.shape[4:]), y))
    if rest:
        carry, y = step(carry, piece.t1 - rest, rest)
        ys.append(y)
    return carry, jax.tree.map(lambda *a: jnp.concatenate(a, axis=2), *ys)


def _slabs(piece: _Piece, q_g, k_g, v_g):
    """The piece's layout of q, and of k, v with zero tiles in front so every key slab exists.
    Returns q, k, v and ``slab(x, t, c)``, the keys of tiles ``t .. t + c - 1``."""
    pad = max(0, piece.halo - piece.t0)
    q, k, v = piece.layout(q_g), piece.key_layout(k_g), piece.key_layout(v_g)
    k, v = (jnp.pad(x, ((0, 0), (0, 0), (pad, 0), (0, 0), (0, 0))) if pad else x for x in (k, v))

    def slab(x, t, c):
        return jax.lax.dynamic_slice_in_dim(x, t - piece.halo + pad, piece.halo + c, axis=2)

    return q, k, v, slab, pad


def _tiles(x, t, c):
    return jax.lax.dynamic_slice_in_dim(x, t, c, axis=2)


def _piece_forward(piece: _Piece, q_g, k_g, v_g):
    """Row maximum, sum of exponentials and weighted values of one piece over its tiles, in its
    layout: ``[B, H, t1 - t0, Q]`` twice and ``[B, H, t1 - t0, Q, dv]``."""
    q, k, v, slab, _ = _slabs(piece, q_g, k_g, v_g)

    def step(carry, t, c):
        scores = jnp.where(piece.keep(t, c), piece.scores(_tiles(q, t, c), slab(k, t, c)), _NEG)
        m = jnp.maximum(scores.max(-1), _FLOOR)  # a row with no key keeps _FLOOR and sum 0
        probs = jnp.exp(scores - m[..., None])
        acc = piece.values(probs.astype(v.dtype), slab(v, t, c))
        return carry, (m, probs.sum(-1), acc)

    return _over_chunks(step, (), piece)[1]


def _piece_backward(piece: _Piece, q_g, k_g, v_g, d_out, lse, delta):
    """Gradients of one piece's share of the output, in the grid layout (float32): d_q for the
    piece's rows, d_k and d_v for all rows."""
    q, k, v, slab, pad = _slabs(piece, q_g, k_g, v_g)
    d_out, lse, delta = (piece.layout(x) for x in (d_out, lse, delta))

    def step(d_kv, t, c):
        scores, scores_vjp = jax.vjp(piece.scores, _tiles(q, t, c), slab(k, t, c))
        probs = jnp.exp(scores - _tiles(lse, t, c)[..., None])
        probs = jnp.where(piece.keep(t, c), probs, 0.0)
        _, values_vjp = jax.vjp(piece.values, probs.astype(v.dtype), slab(v, t, c))
        d_probs, d_v = values_vjp(_tiles(d_out, t, c))
        d_scores = probs * (d_probs.astype(jnp.float32) - _tiles(delta, t, c)[..., None])
        d_q, d_k = scores_vjp(d_scores)
        start = t - piece.halo + pad  # add the slab's gradients in place
        d_kv = [jax.lax.dynamic_update_slice_in_dim(
            acc, _tiles(acc, start, d.shape[2]) + d.astype(jnp.float32), start, axis=2)
            for acc, d in zip(d_kv, (d_k, d_v))]
        return d_kv, d_q.astype(jnp.float32)

    d_kv = [jnp.zeros_like(x, jnp.float32) for x in (k, v)]  # zeros_like: also under shard_map
    d_kv, d_q = _over_chunks(step, d_kv, piece)
    if piece.window:  # back from the windows: the transpose of key_layout (a sum of shifts)
        d_k, d_v = (jax.vjp(piece.key_layout, jnp.zeros_like(x, jnp.float32))[1](d)[0]
                    for x, d in zip((k_g, v_g), d_kv))
    else:
        d_k, d_v = (piece.to_grid(x[:, :, pad:]) for x in d_kv)
    return piece.to_grid(d_q), d_k, d_v


def _grid_forward(spec, q_g, k_g, v_g):
    """Joint softmax over all pieces by log-sum-exp merge. q_g is pre-scaled by 1/√d.
    Returns the output [B, H, R, block, dv] and the log-sum-exp [B, H, R, block], float32."""
    batch_shape = q_g.shape[:4]
    partials = []
    row_max = jnp.full(batch_shape, _FLOOR, jnp.float32)
    for piece in _pieces(spec, q_g.shape[2]):
        m, total, acc = (piece.to_grid(x) for x in _piece_forward(piece, q_g, k_g, v_g))
        rows = piece.grid_rows()
        row_max = row_max.at[:, :, rows].max(m)
        partials.append((rows, m, total, acc))
    total = jnp.zeros(batch_shape, jnp.float32)
    out = jnp.zeros((*batch_shape, v_g.shape[-1]), jnp.float32)
    for rows, m, piece_total, acc in partials:
        w = jnp.exp(m - row_max[:, :, rows])
        total = total.at[:, :, rows].add(w * piece_total)
        out = out.at[:, :, rows].add(w[..., None] * acc)
    out = out / jnp.maximum(total, 1e-30)[..., None]
    lse = jnp.where(total > 0, row_max + jnp.log(jnp.maximum(total, 1e-30)), -_NEG)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grid_attention(spec, q_g, k_g, v_g):
    return _grid_forward(spec, q_g, k_g, v_g)[0]


def _grid_attention_fwd(spec, q_g, k_g, v_g):
    out, lse = _grid_forward(spec, q_g, k_g, v_g)
    return out, (q_g, k_g, v_g, out, lse)


def _grid_attention_bwd(spec, residuals, d_out):
    """Flash-style backward: recompute each piece's probabilities from the saved log-sum-exp,
    chunk by chunk, so memory stays at one chunk's score tiles instead of all of them."""
    q_g, k_g, v_g, out, lse = residuals
    d_out = d_out.astype(jnp.float32)
    delta = (d_out * out).sum(-1)  # D_i = sum_j P_ij dP_ij = dO_i · O_i
    d_q = jnp.zeros(q_g.shape, jnp.float32)
    d_k = jnp.zeros(k_g.shape, jnp.float32)
    d_v = jnp.zeros(v_g.shape, jnp.float32)
    for piece in _pieces(spec, q_g.shape[2]):
        piece_d_q, piece_d_k, piece_d_v = _piece_backward(piece, q_g, k_g, v_g, d_out, lse, delta)
        d_q = d_q.at[:, :, piece.grid_rows()].add(piece_d_q)
        d_k, d_v = d_k + piece_d_k, d_v + piece_d_v
    return tuple(g.astype(x.dtype) for g, x in zip((d_q, d_k, d_v), (q_g, k_g, v_g)))


_grid_attention.defvjp(_grid_attention_fwd, _grid_attention_bwd)


# Dense causal attention (pattern "dense"): query rows in static chunks, chunk [q0, q1) against
# keys [0, q1), so the keys after a chunk are never scored (about half of n² with 16 chunks
# instead of all of it), each chunk's softmax is whole (it holds every key of its queries), and
# the backward recomputes a chunk's probabilities from the saved log-sum-exp instead of keeping
# [B, H, n, n] of them. On a CPU the small score tiles also stay in cache: 1.3-1.7x faster than
# the full masked square (docs/design.md §3).

_DENSE_CHUNKS = 16  # most query chunks of dense attention (unrolled: each is a few ops)
_DENSE_MIN_CHUNK = 64  # fewest query rows in a chunk


def _causal_chunks(n: int) -> list[tuple[int, int]]:
    size = max(_DENSE_MIN_CHUNK, -(-n // _DENSE_CHUNKS))
    return [(q0, min(q0 + size, n)) for q0 in range(0, n, size)]


def _causal_scores(q, k, q0, q1):
    """Scores of queries [q0, q1) over keys [0, q1), the later keys masked: [B, H, q1 - q0, q1]."""
    keep = np.arange(q0, q1)[:, None] >= np.arange(q1)[None, :]
    return jnp.where(keep, _dot("bhqd,bhkd->bhqk", q[:, :, q0:q1], k[:, :, :q1]), _NEG), keep


def _causal_forward(q, k, v):
    """q pre-scaled by 1/√d; q, k, v: [B, H, n, d]. Returns the output [B, H, n, dv] and the
    log-sum-exp [B, H, n], float32."""
    outs, lses = [], []
    for q0, q1 in _causal_chunks(q.shape[2]):
        scores, _ = _causal_scores(q, k, q0, q1)
        m = scores.max(-1, keepdims=True)
        probs = jnp.exp(scores - m)
        total = probs.sum(-1, keepdims=True)
        outs.append(_dot("bhqk,bhkd->bhqd", probs.astype(v.dtype), v[:, :, :q1]) / total)
        lses.append((m + jnp.log(total))[..., 0])
    return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2)


@jax.custom_vjp
def _causal_attention(q, k, v):
    return _causal_forward(q, k, v)[0]


def _causal_attention_fwd(q, k, v):
    out, lse = _causal_forward(q, k, v)
    return out, (q, k, v, out, lse)


def _causal_attention_bwd(residuals, d_out):
    q, k, v, out, lse = residuals
    d_out = d_out.astype(jnp.float32)
    delta = (d_out * out).sum(-1)  # D_i = sum_j P_ij dP_ij = dO_i · O_i
    d_q = []
    d_k = jnp.zeros(k.shape, jnp.float32)
    d_v = jnp.zeros(v.shape, jnp.float32)
    for q0, q1 in _causal_chunks(q.shape[2]):
        scores, keep = _causal_scores(q, k, q0, q1)
        probs = jnp.where(keep, jnp.exp(scores - lse[:, :, q0:q1, None]), 0.0)
        d_chunk = d_out[:, :, q0:q1]
        d_v = d_v.at[:, :, :q1].add(_dot("bhqk,bhqd->bhkd", probs.astype(v.dtype), d_chunk))
        d_probs = _dot("bhqd,bhkd->bhqk", d_chunk, v[:, :, :q1])
        d_scores = probs * (d_probs - delta[:, :, q0:q1, None])
        d_q.append(_dot("bhqk,bhkd->bhqd", d_scores, k[:, :, :q1]))
        d_k = d_k.at[:, :, :q1].add(_dot("bhqk,bhqd->bhkd", d_scores, q[:, :, q0:q1]))
    d_q = jnp.concatenate(d_q, axis=2)
    return tuple(g.astype(x.dtype) for g, x in zip((d_q, d_k, d_v), (q, k, v)))


_causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


def resolve_implementation(implementation: str) -> str:
    """"xla" or "pallas" for ``implementation``: "auto" is the Pallas kernel on a GPU or TPU and
    XLA elsewhere. "pallas" runs compiled on a GPU (Triton) or TPU (Mosaic) and in interpret mode
    on a CPU (slow: for tests)."""
    patterns.check_choice("implementation", implementation, IMPLEMENTATIONS)
    if implementation == "auto":
        return "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"
    return implementation


def sparse_attention(q, k, v, spec: PatternSpec, implementation: str = "xla",
                     block_sizes: kernel.BlockSizes | None = None):
    """Attention of q over k, v restricted to ``spec``'s pattern; equals
    ``dense_attention(q, k, v, spec.mask(n))``.

    q, k: [B, n, H, d]; v: [B, n, H, dv]; float32, bfloat16 or float16 (scores and softmax
    in float32, output in the input dtype). Any n >= 1 (padded internally to a multiple of
    the pattern's block). ``spec`` must be static under ``jax.jit``. Differentiable with a
    custom backward pass whose memory is O(n·|S|) like the forward. ``implementation``: "xla"
    (the block terms above), "pallas" (``sparse_jax.kernel``: the same terms, fused) or "auto"
    (``resolve_implementation``). For dense attention "pallas" means a fused kernel too: on a
    GPU ``jax.nn.dot_product_attention`` (cuDNN's flash attention where it supports the shapes
    and dtype); elsewhere the XLA path. ``block_sizes``: the kernel's tiles (default
    ``kernel.BlockSizes.for_backend``).
    """
    _check_qkv(q, k, v)
    if not isinstance(spec, PatternSpec):
        raise ValueError(f"spec must be a PatternSpec, got {type(spec).__name__}")
    implementation = resolve_implementation(implementation)
    batch, seq_len, heads, _ = q.shape
    scale = 1.0 / math.sqrt(q.shape[-1])
    if spec.kind == "dense":
        if implementation == "pallas" and jax.default_backend() == "gpu":
            return jax.nn.dot_product_attention(q, k, v, is_causal=True)
        heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  [B, n, H, d] <-> [B, H, n, d]
        out = _causal_attention(heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k),
                                heads_first(v))
        return heads_first(out).astype(q.dtype)
    block = spec.block
    rows = -(-seq_len // block)
    pad = rows * block - seq_len

    def to_grid(x):  # [B, n, H, d] -> [B, H, R, block, d]
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else x
        return x.transpose(0, 2, 1, 3).reshape(batch, heads, rows, block, x.shape[-1])

    q_g, k_g, v_g = to_grid(q * jnp.asarray(scale, q.dtype)), to_grid(k), to_grid(v)
    if implementation == "pallas":
        flat = lambda x: x.reshape(batch, heads, rows * block, x.shape[-1])  # noqa: E731
        out = kernel.sequence_attention(spec, flat(q_g), flat(k_g), flat(v_g),
                                        sizes=block_sizes)
    else:
        out = _grid_attention(spec, q_g, k_g, v_g)
    out = out.reshape(batch, heads, rows * block, -1)[:, :, :seq_len].transpose(0, 2, 1, 3)
    return out.astype(q.dtype)


def multi_spec_attention(q, k, v, specs: Sequence[PatternSpec], implementation: str = "xla"):
    """Heads split into ``len(specs)`` equal groups, group g attending with ``specs[g]``."""
    heads = q.shape[2]
    if heads % len(specs):
        raise ValueError(f"{heads} heads cannot be split evenly into {len(specs)} groups "
                         f"({', '.join(map(str, specs))})")
    if len(specs) == 1:
        return sparse_attention(q, k, v, specs[0], implementation)
    g = heads // len(specs)
    outs = [sparse_attention(q[:, :, i * g:(i + 1) * g], k[:, :, i * g:(i + 1) * g],
                             v[:, :, i * g:(i + 1) * g], s, implementation)
            for i, s in enumerate(specs)]
    return jnp.concatenate(outs, axis=2)
