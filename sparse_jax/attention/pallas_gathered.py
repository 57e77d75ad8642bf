"""The fixed pattern's summary term as *gathered* attention (``BlockSizes.gathered``, GPU,
Triton): its keys and values gathered once a call into a contiguous array of ``rows × r``
entries (``r`` summary residues a row, ``blocks._Layout.keys``), in which every query of grid
row ``b`` attends the same prefix, entries ``[0, b·r)``. That is a block-causal pass at full
tiles: a query tile walks the prefix's key tiles with no block list, no position attributes and
no mask but on the one tile where the prefix ends (a tile of several rows: the tiles between
its rows' ends); a gathered key tile's dk/dv program walks the contiguous query tiles of the
rows after its own, masked only on those of its own rows. The loop bounds are arithmetic on the
program's index, the loads contiguous tiles Triton can pipeline (``num_stages``), and the
programs that walk most tiles run first.

The three programs (forward, dq, dk/dv) start the chained variant (``fused._chained_*``): they
write float32 partial results in sequence order (the gathered dk and dv in the gathered order,
put back by ``fused``), from which the band term's kernels resume. They take every option of
the chained variant: the summary tiles (``sumQxK``, else the tiles), ``hG``, ``wN``, ``sN``,
sequence-major arrays.

  forward, backward   the passes: (o, lse) and (dq, dk, dv), float32
  tables              per program its masked and full tiles ([programs, 2], as ``Lists``' first
                      two columns): the cost estimate and the compile report read them
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from sparse_jax.attention import tiles
from sparse_jax.attention.pallas_gpu import _heads

# ---------------------------------------------------------------------------------------------
# Which tiles each program walks: arithmetic on its index (the kernels' and the host's).


def _div(x, y):
    """``x // y`` for non-negative x (a traced int32 or a Python int) and a Python int y."""
    return jax.lax.div(x, y) if isinstance(x, jax.Array) else x // y


def _query_range(i, bq, bk, block, per_row):
    """(full, total): query tile ``i`` attends gathered key tiles ``[0, full)`` whole and
    ``[full, total)`` masked (the end of its rows' prefixes)."""
    first, last = _div(i * bq, block), _div(i * bq + bq - 1, block)
    return _div(first * per_row, bk), _div(last * per_row + bk - 1, bk)


def _key_range(j, bq, bk, block, per_row, nq_tiles):
    """(start, full, end): gathered key tile ``j`` is attended by query tiles ``[start, full)``
    masked (its own rows' next rows) and ``[full, end)`` whole."""
    first, last = _div(j * bk, per_row), _div(j * bk + bk - 1, per_row)
    start = _div((first + 1) * block, bq)
    full = _div((last + 1) * block + bq - 1, bq)
    minimum = jnp.minimum if isinstance(full, jax.Array) else np.minimum
    return minimum(start, nq_tiles), minimum(full, nq_tiles), nq_tiles


class Tables(NamedTuple):
    """``tables``' result, named as ``tiles.Lists``' tables are."""
    forward: np.ndarray
    backward: np.ndarray


def tables(nq: int, nk: int, bq: int, bk: int, block: int, per_row: int):
    """(forward, backward): per query tile of ``nq`` queries and per gathered key tile of ``nk``
    keys, its masked and full tiles ``[programs, 2]`` (int64)."""
    nq_tiles = nq // bq
    full, total = _query_range(np.arange(nq_tiles), bq, bk, block, per_row)
    start, middle, end = _key_range(np.arange(nk // bk), bq, bk, block, per_row, nq_tiles)
    return Tables(np.stack([total - full, full], 1), np.stack([middle - start, end - middle], 1))


# ---------------------------------------------------------------------------------------------
# The programs.


def _walk(lo, mid, hi, step, carry):
    """``step(masked, j, carry)`` over tiles ``[lo, mid)`` masked, then ``[mid, hi)`` whole."""
    carry = jax.lax.fori_loop(lo, mid, functools.partial(step, True), carry)
    return jax.lax.fori_loop(mid, hi, functools.partial(step, False), carry)


def _rows_mask(q_start, bq, k_start, bk, block, per_row):
    """[bq, bk]: query (sequence position) in a later row than the gathered key's row."""
    q_row = _div(q_start + jnp.arange(bq, dtype=jnp.int32), block)
    k_row = _div(k_start + jnp.arange(bk, dtype=jnp.int32), per_row)
    return q_row[:, None] > k_row[None, :]


def _own(nq_tiles):
    """The program's query tile: the last first (it walks the most key tiles)."""
    return nq_tiles - 1 - pl.program_id(1)


def _forward(q_ref, k_ref, v_ref, o_ref, lse_ref, *, bq, bk, block, per_row, nq_tiles,
             seq_major, interpret):
    get, put = _heads(seq_major, interpret)
    i = _own(nq_tiles)
    rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
    heads = range(q_ref.shape[1 if seq_major else 0])
    qs = [get(q_ref, g, rows) for g in heads]
    full, total = _query_range(i, bq, bk, block, per_row)

    def step(masked, j, carry):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        keep = _rows_mask(i * bq, bq, j * bk, bk, block, per_row) if masked else None
        out = []
        for g in heads:
            s = tiles.dot(qs[g], get(k_ref, g, keys), trans_b=True)
            s = jnp.where(keep, s, tiles.NEG) if masked else s
            out.append(tiles.online(s, *carry[g], get(v_ref, g, keys)))
        return tuple(out)

    start = tuple(tiles.start(bq, o_ref.shape[-1]) for _ in heads)
    carry = jax.lax.fori_loop(0, full, functools.partial(step, False), start)
    carry = jax.lax.fori_loop(full, total, functools.partial(step, True), carry)
    for g, state in enumerate(carry):
        o, lse = tiles.finish(*state)
        put(o_ref, g, rows, o.astype(o_ref.dtype))
        put(lse_ref, g, rows, lse)


def _dq(q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, dq_ref, *, bq, bk, block, per_row,
        nq_tiles, seq_major, interpret):
    get, put = _heads(seq_major, interpret)
    i = _own(nq_tiles)
    rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
    heads = range(q_ref.shape[1 if seq_major else 0])
    qs, dos, lses, deltas = ([get(ref, g, rows) for g in heads]
                             for ref in (q_ref, do_ref, lse_ref, delta_ref))
    full, total = _query_range(i, bq, bk, block, per_row)

    def step(masked, j, carry):
        keys = pl.ds(pl.multiple_of(j * bk, bk), bk)
        keep = _rows_mask(i * bq, bq, j * bk, bk, block, per_row) if masked else None
        out = []
        for g in heads:
            k = get(k_ref, g, keys)
            s = tiles.dot(qs[g], k, trans_b=True)
            s = jnp.where(keep, s, tiles.NEG) if masked else s
            ds = tiles.grads(s, lses[g], deltas[g], dos[g], get(v_ref, g, keys))[1]
            out.append(carry[g] + tiles.dot(ds.astype(k.dtype), k))
        return tuple(out)

    start = tuple(jnp.zeros(qs[g].shape, jnp.float32) for g in heads)
    carry = jax.lax.fori_loop(0, full, functools.partial(step, False), start)
    carry = jax.lax.fori_loop(full, total, functools.partial(step, True), carry)
    for g, dq in enumerate(carry):
        put(dq_ref, g, rows, dq.astype(dq_ref.dtype))


def _dkv(k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, bq, bk, block,
         per_row, nq_tiles, seq_major, interpret):
    get, put = _heads(seq_major, interpret)
    j = pl.program_id(1)  # the first gathered keys are attended by the most query tiles
    own = pl.ds(pl.multiple_of(j * bk, bk), bk)
    heads = range(k_ref.shape[1 if seq_major else 0])
    ks, vs = ([get(ref, g, own) for g in heads] for ref in (k_ref, v_ref))
    start, full, end = _key_range(j, bq, bk, block, per_row, nq_tiles)

    def step(masked, i, carry):
        rows = pl.ds(pl.multiple_of(i * bq, bq), bq)
        keep = _rows_mask(i * bq, bq, j * bk, bk, block, per_row) if masked else None
        out = []
        for g in heads:
            q, do = get(q_ref, g, rows), get(do_ref, g, rows)
            s = tiles.dot(q, ks[g], trans_b=True)
            s = jnp.where(keep, s, tiles.NEG) if masked else s
            p, ds = tiles.grads(s, get(lse_ref, g, rows), get(delta_ref, g, rows), do, vs[g])
            out.append((carry[g][0] + tiles.dot(ds.astype(q.dtype), q, trans_a=True),
                        carry[g][1] + tiles.dot(p.astype(do.dtype), do, trans_a=True)))
        return tuple(out)

    zeros = tuple((jnp.zeros(ks[g].shape, jnp.float32), jnp.zeros(vs[g].shape, jnp.float32))
                  for g in heads)
    carry = _walk(start, full, end, step, zeros)
    for g, (dk, dv) in enumerate(carry):
        put(dk_ref, g, own, dk.astype(dk_ref.dtype))
        put(dv_ref, g, own, dv.astype(dv_ref.dtype))


# ---------------------------------------------------------------------------------------------
# The calls.


def _call(compiler, kernel, programs, inputs, out, name, seq_major, cost):
    """pallas_call over (head group, tile, batch): the heads fastest, so a tile's heads run
    together and the longest tiles first; every array whole along its length ([B, H, N, d], or
    [B, N, H, d] if ``seq_major``), the program's heads; ``out``: (shape, dtype) pairs."""
    heads = compiler.heads_per_program
    shape = out[0][0]
    grid = (shape[2 if seq_major else 1] // heads, programs, shape[0])

    def spec(shape):
        if seq_major:
            return pl.BlockSpec((None, shape[1], heads, shape[3]),
                                lambda h, i, b: (b, 0, h, 0))
        return pl.BlockSpec((None, heads, shape[2], shape[3]), lambda h, i, b: (b, h, 0, 0))

    params = {}
    if not compiler.interpret:
        from jax.experimental.pallas import triton as pl_triton

        params["compiler_params"] = pl_triton.CompilerParams(
            num_warps=compiler.num_warps, num_stages=compiler.num_stages)
    return pl.pallas_call(
        kernel, grid=grid, interpret=compiler.interpret, name=name, cost_estimate=cost,
        in_specs=[spec(x.shape) for x in inputs], out_specs=[spec(s) for s, _ in out],
        out_shape=[jax.ShapeDtypeStruct(s, dtype) for s, dtype in out], **params,
    )(*inputs)


def _setup(compiler, q, k, v, block, per_row, seq_major):
    axis = 1 if seq_major else 2
    bq, bk = compiler.block_q, compiler.block_k
    nq, nk = q.shape[axis], k.shape[axis]
    if nq % bq or nk % bk:
        raise ValueError(f"gathered summary: {nq} queries and {nk} gathered keys must be "
                         f"multiples of the tiles {bq}x{bk}")
    batch, heads = q.shape[0], q.shape[2 if seq_major else 1]
    like = (lambda n, d: (batch, n, heads, d)) if seq_major else (
        lambda n, d: (batch, heads, n, d))
    statics = dict(bq=bq, bk=bk, block=block, per_row=per_row, nq_tiles=nq // bq,
                   seq_major=seq_major, interpret=compiler.interpret)
    sizes = (batch * heads, q.shape[-1], v.shape[-1], q.dtype.itemsize)
    return bq, bk, nq, nk, like, statics, sizes, tables(nq, nk, bq, bk, block, per_row)


def forward(compiler, q, k, v, *, block: int, per_row: int, seq_major=False,
            tag="gathered_summary"):
    """Output [B, H, Nq, dv] and log-sum-exp [B, H, Nq, 1], float32, of the summary term: q in
    sequence order (scaled, Nq a multiple of ``block`` and the tiles), k and v gathered
    (``per_row`` entries a row of ``block`` positions, padded to the key tile)."""
    bq, bk, nq, nk, like, statics, sizes, (fwd, _) = _setup(compiler, q, k, v, block, per_row,
                                                            seq_major)
    cost = tiles.cost("forward", fwd, bq, bk, *sizes)
    return _call(compiler, functools.partial(_forward, **statics), nq // bq, [q, k, v],
                 [(like(nq, v.shape[-1]), jnp.float32), (like(nq, 1), jnp.float32)],
                 f"sparse_forward_{tag}", seq_major, cost)


def backward(compiler, q, k, v, do, lse, delta, *, block: int, per_row: int, seq_major=False,
             tag="gathered_summary"):
    """(dq, dk, dv), float32, of the summary term's share of the output for the joint ``lse``
    ([B, H, Nq, 1]); dk and dv in the gathered order. Arrays as ``forward``'s."""
    bq, bk, nq, nk, like, statics, sizes, (fwd, bwd) = _setup(compiler, q, k, v, block,
                                                               per_row, seq_major)
    dq = _call(compiler, functools.partial(_dq, **statics), nq // bq,
               [q, do, lse, delta, k, v], [(like(nq, q.shape[-1]), jnp.float32)],
               f"sparse_dq_{tag}", seq_major, tiles.cost("dq", fwd, bq, bk, *sizes))[0]
    dk, dv = _call(compiler, functools.partial(_dkv, **statics), nk // bk,
                   [k, v, q, do, lse, delta],
                   [(like(nk, k.shape[-1]), jnp.float32), (like(nk, v.shape[-1]), jnp.float32)],
                   f"sparse_dkv_{tag}", seq_major, tiles.cost("dkv", bwd, bq, bk, *sizes))
    return dq, dk, dv
