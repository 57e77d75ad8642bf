"""The TPU programs (Mosaic lowering) of ``attention.pallas``'s passes: flash passes whose block
list is the last grid axis (the lists prefetched into scalar memory, the index maps picking each
step's block, the running softmax in VMEM scratch, as in splash attention), and the band
kernels, which take a term's whole window of key blocks at once and need no list.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from sparse_jax.attention import tiles

# ---------------------------------------------------------------------------------------------
# TPU: the list is the last grid axis; scalar-prefetched lists choose each step's blocks.


def _tpu_steps(lists_ref, width, start, step, end):
    """At grid step j of the row's list: ``start()`` first if j is 0, ``step(masked)`` for the
    j-th block (partial blocks, then full ones; none past the list's end), then ``end()`` if j
    is the last step."""
    row, j = pl.program_id(2) * width, pl.program_id(3)
    n_partial, n_full = lists_ref[row], lists_ref[row + 1]
    pl.when(j == 0)(start)
    pl.when(j < n_partial)(lambda: step(True))
    pl.when((j >= n_partial) & (j < n_partial + n_full))(lambda: step(False))
    pl.when(j == pl.num_programs(3) - 1)(end)


def _tpu_keep(keep, q_attrs, k_attrs, masked):
    """A step's mask, shared by its heads: None for a full block."""
    return keep(*(r[...] for r in q_attrs), *(r[...] for r in k_attrs)) if masked else None


def _tpu_scores(q, k, kept):
    s = tiles.dot(q, k, trans_b=True)
    return s if kept is None else jnp.where(kept, s, tiles.NEG)


# Refs of data arrays carry the step's heads first ([heads, tile, d]): a step serves
# ``tiles.Compiler.heads_per_program`` heads, one block list, one mask, so that the per-step cost of
# the grid is paid once for them all.


def forward(lists_ref, q_ref, qp_ref, qs_ref, k_ref, v_ref, kp_ref, ks_ref, kf_ref, o_ref,
                 lse_ref, o_scr, m_scr, t_scr, *, keep, width):
    scratch = (o_scr, m_scr, t_scr)
    heads = range(q_ref.shape[0])

    def start():
        for ref, x in zip(scratch, tiles.start(*o_scr.shape[1:])):
            ref[...] = jnp.broadcast_to(x, ref.shape)

    def step(masked):
        kept = _tpu_keep(keep, (qp_ref, qs_ref), (kp_ref, ks_ref, kf_ref), masked)
        for g in heads:
            s = _tpu_scores(q_ref[g], k_ref[g], kept)
            for ref, x in zip(scratch, tiles.online(s, *(r[g] for r in scratch), v_ref[g])):
                ref[g] = x

    def end():
        for g in heads:
            o_ref[g], lse_ref[g] = tiles.finish(*(r[g] for r in scratch))

    _tpu_steps(lists_ref, width, start, step, end)


def dq(lists_ref, q_ref, qp_ref, qs_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kp_ref,
            ks_ref, kf_ref, dq_ref, dq_scr, *, keep, width):
    heads = range(q_ref.shape[0])

    def step(masked):
        kept = _tpu_keep(keep, (qp_ref, qs_ref), (kp_ref, ks_ref, kf_ref), masked)
        for g in heads:
            k = k_ref[g]
            s = _tpu_scores(q_ref[g], k, kept)
            ds = tiles.grads(s, lse_ref[g], delta_ref[g], do_ref[g], v_ref[g])[1]
            dq_scr[g] += tiles.dot(ds.astype(k.dtype), k)

    def start():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def end():
        dq_ref[...] = dq_scr[...]

    _tpu_steps(lists_ref, width, start, step, end)


def dkv(lists_ref, k_ref, v_ref, kp_ref, ks_ref, kf_ref, q_ref, do_ref, lse_ref, delta_ref,
             qp_ref, qs_ref, dk_ref, dv_ref, dk_scr, dv_scr, *, keep, width):
    heads = range(k_ref.shape[0])

    def step(masked):
        kept = _tpu_keep(keep, (qp_ref, qs_ref), (kp_ref, ks_ref, kf_ref), masked)
        for g in heads:
            q, do = q_ref[g], do_ref[g]
            s = _tpu_scores(q, k_ref[g], kept)
            p, ds = tiles.grads(s, lse_ref[g], delta_ref[g], do, v_ref[g])
            dk_scr[g] += tiles.dot(ds.astype(q.dtype), q, trans_a=True)
            dv_scr[g] += tiles.dot(p.astype(do.dtype), do, trans_a=True)

    def start():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def end():
        dk_ref[...], dv_ref[...] = dk_scr[...], dv_scr[...]

    _tpu_steps(lists_ref, width, start, step, end)


def call(compiler, kernel, lists, own, listed, listed_block, out, scratch, name,
              cost_estimate=None):
    """pallas_call over (batch, head group, own tile, list step) with the lists prefetched:
    ``own`` arrays are tiled by the grid, ``listed`` ones by the list entry (tiles of
    ``listed_block``), data arrays by ``compiler.heads_per_program`` heads; ``out``: (shape,
    tile) pairs; ``scratch``: float32 VMEM shapes of one head; ``cost_estimate``: as
    ``_gpu_call``'s."""
    from jax.experimental.pallas import tpu as pltpu

    blocks, width = lists.shape
    block = out[0][1]
    batch, heads = out[0][0][:2]
    group = compiler.heads_per_program

    def entry(i, j, lists_ref):  # the block of list entry j of row i (the last one past the end)
        count = lists_ref[i * width] + lists_ref[i * width + 1]
        return lists_ref[i * width + 2 + jnp.minimum(j, jnp.maximum(count - 1, 0))]

    def spec(x, tile, index):
        if x.ndim == 2:  # position attributes
            if x.shape[1] == 1:
                return pl.BlockSpec((tile, 1), lambda b, h, i, j, r: (index(i, j, r), 0))
            return pl.BlockSpec((1, tile), lambda b, h, i, j, r: (0, index(i, j, r)))
        return pl.BlockSpec((None, group, tile, x.shape[3]),
                            lambda b, h, i, j, r: (b, h, index(i, j, r), 0))

    def own_index(i, j, r):
        return i

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(batch, heads // group, blocks, max(1, width - 2)),
        in_specs=[*(spec(x, block, own_index) for x in own),
                  *(spec(x, listed_block, entry) for x in listed)],
        out_specs=[spec(jax.ShapeDtypeStruct(shape, jnp.float32), tile, own_index)
                   for shape, tile in out],
        scratch_shapes=[pltpu.VMEM((group, *shape), jnp.float32) for shape in scratch])
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, interpret=compiler.interpret, name=name,
        cost_estimate=cost_estimate,
        out_shape=[jax.ShapeDtypeStruct(shape, jnp.float32) for shape, _ in out],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
    )(jnp.asarray(lists.ravel()), *own, *listed)


# ---------------------------------------------------------------------------------------------
# TPU: band kernels. A term whose key blocks lie in a band around each query block (the strided
# pattern's row term: a block and the one before it; its column term at n ≤ l²: the block itself)
# needs no list: each own block of ``tile`` rows reads a window of ``width`` blocks, all at once
# (one softmax, no running state), and a grid step serves ``group`` own blocks, whose windows
# overlap in one window of ``group + width - 1`` blocks read with element offsets. The tiles
# stay small (little masked work) while a step does a large tile's work (its fixed cost paid
# once for the group). The mask of each own block against its window comes from a small table
# of distinct masks, evaluated on the host by the term's rule.


@dataclasses.dataclass(frozen=True, eq=False)
class Band:
    """One pass's band plan (``blocks.band_plan``): own blocks of ``tile`` rows, windows of
    ``width`` blocks, ``group`` own blocks a grid step; ``meta`` int32, prefetched: per step the
    first block of its window, then per own block the first block of its window relative to its
    step's and the index of its mask in ``masks`` ([M, tile, width * tile] int32, own rows by
    window columns; transposed, [M, width * tile, tile], for the key-side pass)."""
    tile: int
    width: int
    group: int
    meta: np.ndarray
    masks: np.ndarray

    @property
    def steps(self) -> int:
        return len(self.meta) // (1 + 2 * self.group)


def _band_own(meta_ref, band, g):
    """(first row of own block g's window inside the step's window, its mask's index)."""
    steps = pl.num_programs(2)
    t = pl.program_id(2) * band.group + g
    offset = meta_ref[steps + t] * band.tile
    return pl.multiple_of(offset, band.tile), meta_ref[steps + steps * band.group + t]


def _column(row_ref, rows):
    """Entries ``rows`` of a lane-dense [1, N] ref as a column [rows, 1]."""
    return jnp.expand_dims(row_ref[0, rows], -1)


def _band_scores(meta_ref, band, g, q_ref, k_ref, v_ref, mask_ref):
    """Own block g's rows, its window's keys and values, and its masked scores [tile, window]."""
    offset, index = _band_own(meta_ref, band, g)
    rows, near = pl.ds(g * band.tile, band.tile), pl.ds(offset, band.width * band.tile)
    k, v = k_ref[near, :], v_ref[near, :]
    return rows, k, v, jnp.where(mask_ref[index] != 0, tiles.dot(q_ref[rows, :], k, trans_b=True),
                                 tiles.NEG)


def band_forward(meta_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, *, band):
    for g in range(band.group):
        rows, _, v, s = _band_scores(meta_ref, band, g, q_ref, k_ref, v_ref, mask_ref)
        m = jnp.maximum(s.max(-1, keepdims=True), tiles.FLOOR)
        p = jnp.exp(s - m)
        o, lse = tiles.finish(tiles.dot(p.astype(v.dtype), v), m, p.sum(-1, keepdims=True))
        o_ref[rows, :] = o.astype(o_ref.dtype)
        lse_ref[:, rows] = jnp.broadcast_to(lse, (band.tile, 128)).T[:1]  # lane-dense


def band_dq(meta_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, mask_ref, dq_ref, *,
                 band):
    for g in range(band.group):
        rows, k, v, s = _band_scores(meta_ref, band, g, q_ref, k_ref, v_ref, mask_ref)
        ds = tiles.grads(s, _column(lse_ref, rows), _column(delta_ref, rows), do_ref[rows, :], v)[1]
        dq_ref[rows, :] = tiles.dot(ds.astype(k.dtype), k).astype(dq_ref.dtype)


def band_dkv(meta_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, mask_ref, dk_ref,
                  dv_ref, *, band):
    """Scores transposed ([own keys, window queries]): the window's log-sum-exp and delta stay
    lane-dense rows, and dk, dv are plain products."""
    size, window = band.tile, band.width * band.tile
    for g in range(band.group):
        offset, index = _band_own(meta_ref, band, g)
        rows, near = pl.ds(g * size, size), pl.ds(offset, window)
        q, do, k, v = q_ref[near, :], do_ref[near, :], k_ref[rows, :], v_ref[rows, :]
        s = jnp.where(mask_ref[index] != 0, tiles.dot(k, q, trans_b=True), tiles.NEG)
        p = jnp.exp(s - lse_ref[:, near])
        ds = p * (tiles.dot(v, do, trans_b=True) - delta_ref[:, near])
        dk_ref[rows, :] = tiles.dot(ds.astype(q.dtype), q).astype(dk_ref.dtype)
        dv_ref[rows, :] = tiles.dot(p.astype(do.dtype), do).astype(dv_ref.dtype)


def band_call(compiler, kernel, band, own, windowed, out, name, cost_estimate=None):
    """pallas_call over (batch, head, step) with ``band.meta`` prefetched: ``own`` arrays
    [B, H, N, w] tiled by the step's ``group * tile`` rows, ``windowed`` ones read as the step's
    window of ``group + width - 1`` blocks (element offsets), the mask table whole; lane-dense
    [B, H, 1, N] arrays (log-sum-exp, delta) likewise along N; ``out``: (shape, dtype) pairs
    tiled as the own arrays."""
    from jax.experimental.pallas import tpu as pltpu

    rows, span = band.group * band.tile, (band.group + band.width - 1) * band.tile
    batch, heads = out[0][0][:2]

    def own_spec(shape):
        if shape[2] == 1:
            return pl.BlockSpec((None, None, 1, rows), lambda b, h, i, meta: (b, h, 0, i))
        return pl.BlockSpec((None, None, rows, shape[3]), lambda b, h, i, meta: (b, h, i, 0))

    def window_spec(shape):
        start = lambda i, meta: meta[i] * band.tile  # noqa: E731
        if shape[2] == 1:
            return pl.BlockSpec((pl.squeezed, pl.squeezed, pl.Element(1), pl.Element(span)),
                                lambda b, h, i, meta: (b, h, 0, start(i, meta)))
        return pl.BlockSpec((pl.squeezed, pl.squeezed, pl.Element(span), pl.Element(shape[3])),
                            lambda b, h, i, meta: (b, h, start(i, meta), 0))

    masks = jnp.asarray(band.masks)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(batch, heads, band.steps),
        in_specs=[*(own_spec(x.shape) for x in own), *(window_spec(x.shape) for x in windowed),
                  pl.BlockSpec(masks.shape, lambda b, h, i, meta: (0, 0, 0))],
        out_specs=[own_spec(shape) for shape, _ in out])
    return pl.pallas_call(
        functools.partial(kernel, band=band), grid_spec=grid_spec, interpret=compiler.interpret,
        name=name, cost_estimate=cost_estimate,
        out_shape=[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in out],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
    )(jnp.asarray(band.meta), *own, *windowed, masks)


def band_cost(pass_, band, heads, d, dv, itemsize):
    """``cost`` of a band pass: every own block scores its whole window."""
    blocks = band.steps * band.group
    table = np.zeros((blocks, 2 + band.width), np.int64)
    table[:, 0] = band.width  # as if each own block listed its window's blocks
    return tiles.cost(pass_, table, band.tile, band.tile, heads, d, dv, itemsize)
