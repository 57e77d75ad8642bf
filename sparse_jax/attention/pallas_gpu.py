"""The GPU programs (Triton lowering) of ``attention.pallas``'s passes: a program per (query or key
tile, batch row, head group) walks its block list in a loop, loading key tiles from the whole
K/V; the arrays may stay in sequence order, a term's tiles addressed by ``Rows``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sparse_jax.attention import tiles

# ---------------------------------------------------------------------------------------------
# GPU: a program per (tile, batch, head group) loops over its list.


@dataclasses.dataclass(frozen=True)
class Rows:
    """Where layout tile ``t`` (``block`` entries) lies along an array's length: ``block``
    contiguous rows from ``t * block``, or, with ``column`` set (the column term read in sequence
    order), layout entry ``col * column + r`` is sequence position ``r * stride + col``, so a
    tile (``block`` divides ``column``) is ``block`` rows ``stride`` apart: one strided load."""
    block: int
    stride: int = 1
    column: int = 0

    def __call__(self, t):
        if not self.column:
            return pl.ds(pl.multiple_of(t * self.block, self.block), self.block)
        start = t * self.block
        return pl.ds(start % self.column * self.stride + start // self.column, self.block,
                     stride=self.stride)


def _heads(seq_major, interpret):
    """``get(ref, g, rows)`` and ``put(ref, g, rows, x)``: head ``g``'s ``rows`` of a
    [heads, length, d] ref ([length, heads, d] if ``seq_major``). Compiled, the head is an
    integer index (Triton loads [rows, d] directly); interpret mode takes no integer beside a
    strided slice, so there the head is a size-1 slice, reshaped away."""
    def index(g, rows):
        head = pl.ds(g, 1) if interpret else g
        return (rows, head, slice(None)) if seq_major else (head, rows, slice(None))

    def get(ref, g, rows):
        x = ref[index(g, rows)]
        if interpret:
            x = x.reshape(x.shape[:1] + x.shape[2:] if seq_major else x.shape[1:])
        return x

    def put(ref, g, rows, x):
        if interpret:
            x = x.reshape((x.shape[0], 1, *x.shape[1:]) if seq_major else (1, *x.shape))
        ref[index(g, rows)] = x

    return get, put


def _gpu_over_list(list_ref, step, carry, one_loop=False):
    """``step(masked, j, carry)`` over the partial blocks of a list row, then the full ones: two
    loops, or with ``one_loop`` one (``masked`` a traced flag), which Triton can pipeline over
    all of a row's blocks."""
    n_partial, n_full = list_ref[0], list_ref[1]
    if one_loop:
        return jax.lax.fori_loop(0, n_partial + n_full,
                                 lambda j, carry: step(j < n_partial, j, carry), carry)
    carry = jax.lax.fori_loop(0, n_partial, functools.partial(step, True), carry)
    return jax.lax.fori_loop(n_partial, n_full + n_partial, functools.partial(step, False), carry)


def _resume(o, lse):
    """The running state of a partial result (output normalised, log-sum-exp tiles.NEG: no key)."""
    seen = lse > tiles.NEG / 2
    return o, jnp.where(seen, lse, tiles.FLOOR), seen.astype(jnp.float32)


def forward(list_ref, qp_ref, qs_ref, kp_ref, ks_ref, kf_ref, q_ref, k_ref, v_ref, *refs,
                 keep, own, listed, resume, one_loop, seq_major, interpret):
    """Refs carry a leading head axis (the program's heads, one list); ``own`` and ``listed``:
    ``Rows`` of this program's query tile and of a listed key tile (own None: the tile is the
    whole block); ``resume``: refs (o, lse) of earlier terms to start from come first."""
    get, put = _heads(seq_major, interpret)
    o_ref, lse_ref = refs[-2:]
    rows = slice(None) if own is None else own(pl.program_id(0))
    heads = range(q_ref.shape[1 if seq_major else 0])
    q_attrs = (qp_ref[...], qs_ref[...])
    qs = [get(q_ref, g, rows) for g in heads]
    block_k = listed.block

    def step(masked, j, carry):
        t, a = listed(list_ref[2 + j]), Rows(block_k)(list_ref[2 + j])
        k_attrs = (kp_ref[:, a], ks_ref[:, a], kf_ref[:, a])
        return tuple(tiles.online(tiles.scores(keep, qs[g], get(k_ref, g, t), q_attrs, k_attrs,
                                               masked), *carry[g], get(v_ref, g, t))
                     for g in heads)

    start = tuple(_resume(get(refs[0], g, rows), get(refs[1], g, rows)) if resume else
                  tiles.start(qs[g].shape[0], o_ref.shape[-1]) for g in heads)
    for g, carry in enumerate(_gpu_over_list(list_ref, step, start, one_loop)):
        o, lse = tiles.finish(*carry)
        put(o_ref, g, rows, o.astype(o_ref.dtype))
        put(lse_ref, g, rows, lse)


def dq(list_ref, qp_ref, qs_ref, kp_ref, ks_ref, kf_ref, q_ref, do_ref, lse_ref, delta_ref,
            k_ref, v_ref, *refs, keep, own, listed, resume, one_loop, seq_major, interpret):
    """dq of the program's query tile (``forward``'s conventions; resume: dq so far)."""
    get, put = _heads(seq_major, interpret)
    dq_ref = refs[-1]
    rows = slice(None) if own is None else own(pl.program_id(0))
    heads = range(q_ref.shape[1 if seq_major else 0])
    q_attrs = (qp_ref[...], qs_ref[...])
    qs, dos, lses, deltas = ([get(ref, g, rows) for g in heads]
                             for ref in (q_ref, do_ref, lse_ref, delta_ref))
    block_k = listed.block

    def step(masked, j, carry):
        t, a = listed(list_ref[2 + j]), Rows(block_k)(list_ref[2 + j])
        k_attrs = (kp_ref[:, a], ks_ref[:, a], kf_ref[:, a])
        out = []
        for g in heads:
            k = get(k_ref, g, t)
            s = tiles.scores(keep, qs[g], k, q_attrs, k_attrs, masked)
            ds = tiles.grads(s, lses[g], deltas[g], dos[g], get(v_ref, g, t))[1]
            out.append(carry[g] + tiles.dot(ds.astype(k.dtype), k))
        return tuple(out)

    start = tuple(get(refs[0], g, rows) if resume else jnp.zeros(qs[g].shape, jnp.float32)
                  for g in heads)
    for g, dq in enumerate(_gpu_over_list(list_ref, step, start, one_loop)):
        put(dq_ref, g, rows, dq.astype(dq_ref.dtype))


def dkv(list_ref, qp_ref, qs_ref, kp_ref, ks_ref, kf_ref, k_ref, v_ref, q_ref, do_ref,
             lse_ref, delta_ref, *refs, keep, own, listed, resume, one_loop, seq_major, interpret):
    """dk and dv of the program's key tile, over its list of query tiles (resume: dk, dv so
    far)."""
    get, put = _heads(seq_major, interpret)
    dk_ref, dv_ref = refs[-2:]
    rows = slice(None) if own is None else own(pl.program_id(0))
    heads = range(k_ref.shape[1 if seq_major else 0])
    k_attrs = (kp_ref[...], ks_ref[...], kf_ref[...])
    ks, vs = ([get(ref, g, rows) for g in heads] for ref in (k_ref, v_ref))
    block_q = listed.block

    def step(masked, j, carry):
        t, a = listed(list_ref[2 + j]), Rows(block_q)(list_ref[2 + j])
        q_attrs = (qp_ref[a, :], qs_ref[a, :])
        out = []
        for g in heads:
            q, do = get(q_ref, g, t), get(do_ref, g, t)
            s = tiles.scores(keep, q, ks[g], q_attrs, k_attrs, masked)
            p, ds = tiles.grads(s, get(lse_ref, g, t), get(delta_ref, g, t), do, vs[g])
            out.append((carry[g][0] + tiles.dot(ds.astype(q.dtype), q, trans_a=True),
                        carry[g][1] + tiles.dot(p.astype(do.dtype), do, trans_a=True)))
        return tuple(out)

    start = tuple((get(refs[0], g, rows), get(refs[1], g, rows)) if resume else
                  (jnp.zeros(ks[g].shape, jnp.float32), jnp.zeros(vs[g].shape, jnp.float32))
                  for g in heads)
    for g, (dk, dv) in enumerate(_gpu_over_list(list_ref, step, start, one_loop)):
        put(dk_ref, g, rows, dk.astype(dk_ref.dtype))
        put(dv_ref, g, rows, dv.astype(dv_ref.dtype))


def call(compiler, kernel, lists, block, inputs, out, name, seq_major=False,
              cost_estimate=None):
    """pallas_call over (own tile, batch, head group): ``inputs`` are (array, tiled) pairs, a
    tiled one cut to the program's tile along its length (attributes [N, 1] / [1, N] too),
    others passed whole (along the length; data arrays [B, H, N, d], or [B, N, H, d] if
    ``seq_major``, always to the program's heads); ``out``: (shape, dtype, tiled) triples;
    ``cost_estimate``: the kernel's work (``cost``), for XLA's cost analysis."""
    heads = compiler.heads_per_program
    grid = (lists.shape[0], out[0][0][0], out[0][0][2 if seq_major else 1] // heads)

    def spec(shape, tiled):
        if len(shape) == 2:  # position attributes
            if not tiled:
                return pl.BlockSpec(shape, lambda i, b, h: (0, 0))
            return (pl.BlockSpec((block, 1), lambda i, b, h: (i, 0)) if shape[1] == 1 else
                    pl.BlockSpec((1, block), lambda i, b, h: (0, i)))
        if seq_major:
            return pl.BlockSpec((None, block if tiled else shape[1], heads, shape[3]),
                                lambda i, b, h: (b, i if tiled else 0, h, 0))
        return pl.BlockSpec((None, heads, block if tiled else shape[2], shape[3]),
                            lambda i, b, h: (b, h, i if tiled else 0, 0))

    params = {}
    if not compiler.interpret:
        from jax.experimental.pallas import triton as pl_triton

        params["compiler_params"] = pl_triton.CompilerParams(
            num_warps=compiler.num_warps, num_stages=compiler.num_stages)
    return pl.pallas_call(
        kernel, grid=grid, interpret=compiler.interpret, name=name, cost_estimate=cost_estimate,
        in_specs=[pl.BlockSpec((None, lists.shape[1]), lambda i, b, h: (i, 0)),
                  *(spec(x.shape, tiled) for x, tiled in inputs)],
        out_specs=[spec(shape, tiled) for shape, _, tiled in out],
        out_shape=[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype, _ in out], **params,
    )(lists, *(x for x, _ in inputs))
