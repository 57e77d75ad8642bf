"""The fixed pattern through *gathered* attention (``BlockSizes.gathered``, GPU, Triton): the
summary keys and values gathered once a call into one contiguous array of ``rows × r`` entries
(``r`` summary residues a row of ``l`` positions), in which every query of grid row ``b``
attends the same prefix, entries ``[0, b·r)``: a block-causal pass at full tiles, with no block
list, no position attributes and no mask but on the tile where a prefix ends. Both terms of the
pattern run here, on arrays in sequence order ([B, H, n, d], or [B, n, H, d] ``seq_major``):

* forward and dq: a program per query tile walks its prefix's gathered key tiles (whole, then
  the masked end), then its row's own keys up to the diagonal (the band term: same row, causal,
  and a summary residue for ``part="summary"``), and writes its output, or dq, once, in the
  inputs' dtype;
* dk/dv, two programs: one per gathered key tile walks the contiguous query tiles of the rows
  after its own (float32, gathered order); one per key tile in sequence order walks its row's
  queries from the diagonal and adds the summary gradient of its summary keys, read back from
  the gathered array with a shifted load per run of residues, before writing once;
* or, with option ``atomic`` (``BlockSizes.atomic_dq``), no dq program: both dk/dv programs add
  each visit's share of dq atomically to a float32 dq (XLA's zeros before, its cast after, and
  delta XLA's), so each backward tile is visited once.

The loop bounds are arithmetic on the program's index, the loads contiguous tiles that Triton
pipelines (``num_stages``), and the programs that walk most tiles start first. Tiles: ``sumQxK``
(else ``QxK``) for the gathered walks, ``dkvQxK[wN]`` for the gathered keys' dk/dv (else the
same), ``QxK`` for the band's.

  forward, backward       the passes (``fused`` calls them inside its custom VJP)
  gather                  the summary keys and values gathered

Their plan, options and index arithmetic: ``attention.gathered_plan``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from sparse_jax.attention import tiles
from sparse_jax.attention.gathered_plan import (
    Plan,
    band_k,
    band_q,
    div,
    read_windows,
    summary_k,
    summary_q,
    tables,
)

# ---------------------------------------------------------------------------------------------
# The programs' pieces.


def _access(seq_major, interpret):
    """``get(ref, g, rows, cols)`` and ``put(ref, g, rows, x, add=False)`` for head ``g`` of a
    [heads, length, d] ref ([length, heads, d] if ``seq_major``), as ``pallas_gpu._heads``;
    ``cols`` a slice of the last axis; ``add``: x added atomically (as ``pallas_onepass``'s)."""
    def index(g, rows, cols):
        head = pl.ds(g, 1) if interpret else g
        return (rows, head, cols) if seq_major else (head, rows, cols)

    def get(ref, g, rows, cols=slice(None)):
        x = ref[index(g, rows, cols)]
        return x.reshape(x.shape[:1] + x.shape[2:] if seq_major else x.shape[1:]) \
            if interpret else x

    def put(ref, g, rows, x, add=False):
        if interpret:
            x = x.reshape((x.shape[0], 1, *x.shape[1:]) if seq_major else (1, *x.shape))
        at = index(g, rows, slice(None))
        if add and not interpret:  # the programs run side by side
            from jax.experimental.pallas import triton as pl_triton

            pl_triton.atomic_add(ref, at, x)
        elif add:  # interpret mode runs them one by one (and its atomic ignores a stride)
            ref[at] += x
        else:
            ref[at] = x

    return get, put


def _tile(start, size):
    return pl.ds(pl.multiple_of(start * size, size), size)


def _in_residues(offset, p: Plan):
    flag = offset < 0
    for first, count, _ in p.runs():
        flag = flag | ((offset >= first) & (offset < first + count))
    return flag


def _summary_mask(q0, bq, k0, bk, p: Plan):
    """[bq, bk]: the query's row is after the gathered key's."""
    q_row = div(q0 + jnp.arange(bq, dtype=jnp.int32), p.block)
    k_row = div(k0 + jnp.arange(bk, dtype=jnp.int32), p.per_row)
    return q_row[:, None] > k_row[None, :]


def _band_mask(q0, bq, k0, bk, p: Plan):
    """[bq, bk]: same row, key at or before the query (and a residue, ``band_residues``)."""
    q = (q0 + jnp.arange(bq, dtype=jnp.int32))[:, None]
    k = (k0 + jnp.arange(bk, dtype=jnp.int32))[None, :]
    keep = (div(q, p.block) == div(k, p.block)) & (k <= q)
    if p.band_residues:
        keep = keep & _in_residues(k - div(k, p.block) * p.block, p)
    return keep


def _walks(p: Plan, i, step, carry):
    """``step(kind, masked, j, carry)`` over query tile ``i``'s gathered key tiles, then its
    band key tiles (kind "summary" or "band")."""
    whole, end = summary_q(i, p)
    start, stop = band_q(i, p)
    carry = jax.lax.fori_loop(0, whole, functools.partial(step, "summary", False), carry)
    carry = jax.lax.fori_loop(whole, end, functools.partial(step, "summary", True), carry)
    return jax.lax.fori_loop(start, stop, functools.partial(step, "band", True), carry)


def _keys(kind, j, p: Plan, d, dv):
    """(rows, k columns, v columns, mask) of key tile ``j`` of a walk: the gathered array holds
    k and v side by side; the sequence's k and v are apart."""
    if kind == "summary":
        rows = pl.ds(pl.multiple_of(p.front + j * p.bk, p.bk), p.bk)
        return rows, pl.ds(0, d), pl.ds(d, dv), functools.partial(_summary_mask, k0=j * p.bk,
                                                                  bk=p.bk, p=p)
    return _tile(j, p.band_k), slice(None), slice(None), functools.partial(
        _band_mask, k0=j * p.band_k, bk=p.band_k, p=p)


def _lse(x):
    """The log-sum-exp for the gradients: +1e30 for a row with no key (NEG), so p = 0."""
    return jnp.where(x > tiles.NEG / 2, x, -tiles.NEG)


def _queries(q_ref, k_ref, v_ref, kv_ref, *refs, p, seq_major, interpret):
    """The program's query tile over its gathered key tiles and its band: output and
    log-sum-exp (refs: the outputs o, lse), or with refs (dO, o, lse, and the outputs dq,
    delta) dq and its rows' ``delta = dO·O`` for the key passes."""
    get, put = _access(seq_major, interpret)
    i = p.length // p.bq - 1 - pl.program_id(1)  # the last first: it walks the most tiles
    rows = _tile(i, p.bq)
    heads = range(q_ref.shape[1 if seq_major else 0])
    qs = [get(q_ref, g, rows) for g in heads]
    d, dv, grads = q_ref.shape[-1], v_ref.shape[-1], len(refs) == 5
    if grads:
        do_ref, o_ref, lse_ref, dq_ref, delta_ref = refs
        dos = [get(do_ref, g, rows) for g in heads]
        lses = [_lse(get(lse_ref, g, rows)) for g in heads]
        deltas = [(dos[g].astype(jnp.float32) * get(o_ref, g, rows).astype(jnp.float32)).sum(
            -1, keepdims=True) for g in heads]
        start = tuple(jnp.zeros(qs[g].shape, jnp.float32) for g in heads)
    else:
        start = tuple(tiles.start(p.bq, dv) for _ in heads)

    def step(kind, masked, j, carry):
        at, kc, vc, mask = _keys(kind, j, p, d, dv)
        k_src, v_src = (kv_ref, kv_ref) if kind == "summary" else (k_ref, v_ref)
        keep = mask(i * p.bq, p.bq) if masked else None
        out = []
        for g in heads:
            k = get(k_src, g, at, kc)
            s = tiles.dot(qs[g], k, trans_b=True)
            s = jnp.where(keep, s, tiles.NEG) if masked else s
            if grads:
                ds = tiles.grads(s, lses[g], deltas[g], dos[g], get(v_src, g, at, vc))[1]
                out.append(carry[g] + tiles.dot(ds.astype(k.dtype), k))
            else:
                out.append(tiles.online(s, *carry[g], get(v_src, g, at, vc)))
        return tuple(out)

    for g, state in enumerate(_walks(p, i, step, start)):
        if grads:
            put(dq_ref, g, rows, state.astype(dq_ref.dtype))
            put(delta_ref, g, rows, deltas[g])
        else:
            o, lse = tiles.finish(*state)
            put(refs[0], g, rows, o.astype(refs[0].dtype))
            put(refs[1], g, rows, lse)


def _key_grads(get, put, heads, ks, vs, refs, bq, mask, dq_ref=None):
    """``step(masked, i, carry)`` of a key tile's walk over query tiles of ``bq`` (``refs``: q,
    dO, lse, delta); with ``dq_ref`` (option atomic) each visit adds its share of dq there,
    atomically, dv's product taken before dp's (the probabilities die sooner: fewer live
    registers)."""
    q_ref, do_ref, lse_ref, delta_ref = refs

    def step(masked, i, carry):
        rows = _tile(i, bq)
        keep = mask(i * bq, bq) if masked else None
        out = []
        for g in heads:
            q, do = get(q_ref, g, rows), get(do_ref, g, rows)
            s = tiles.dot(q, ks[g], trans_b=True)
            s = jnp.where(keep, s, tiles.NEG) if masked else s
            lse, delta = _lse(get(lse_ref, g, rows)), get(delta_ref, g, rows)
            if dq_ref is None:
                prob, ds = tiles.grads(s, lse, delta, do, vs[g])
                out.append((carry[g][0] + tiles.dot(ds.astype(q.dtype), q, trans_a=True),
                            carry[g][1] + tiles.dot(prob.astype(do.dtype), do, trans_a=True)))
                continue
            prob = jnp.exp(s - lse)
            dv = carry[g][1] + tiles.dot(prob.astype(do.dtype), do, trans_a=True)
            ds = (prob * (tiles.dot(do, vs[g], trans_b=True) - delta)).astype(q.dtype)
            out.append((carry[g][0] + tiles.dot(ds, q, trans_a=True), dv))
            put(dq_ref, g, rows, tiles.dot(ds, ks[g]), add=True)
        return tuple(out)
    return step


def _dkv(kv_ref, q_ref, do_ref, lse_ref, delta_ref, *refs, p, seq_major, interpret):
    """The gathered keys' dk, dv (float32, gathered order, ``front`` rows ahead); refs: (dq,)
    dk, dv (, dq): with dq (option atomic) it adds the summary term's dq there, in one loop
    over its query tiles, each masked (the program runs one stage: ``backward``)."""
    dk_ref, dv_ref, *dq_ref = refs[-3:] if len(refs) == 4 else refs
    get, put = _access(seq_major, interpret)
    j = pl.program_id(1)  # the first gathered keys are attended by the most query tiles
    own = pl.ds(pl.multiple_of(p.front + j * p.bk, p.bk), p.bk)
    heads = range(q_ref.shape[1 if seq_major else 0])
    d, dv = q_ref.shape[-1], do_ref.shape[-1]
    ks = [get(kv_ref, g, own, pl.ds(0, d)) for g in heads]
    vs = [get(kv_ref, g, own, pl.ds(d, dv)) for g in heads]
    step = _key_grads(get, put, heads, ks, vs, (q_ref, do_ref, lse_ref, delta_ref), p.bq,
                      lambda q0, bq: _summary_mask(q0, bq, j * p.bk, p.bk, p), *dq_ref)
    start, whole, end = summary_k(j, p)
    carry = tuple((jnp.zeros(ks[g].shape, jnp.float32), jnp.zeros(vs[g].shape, jnp.float32))
                  for g in heads)
    if dq_ref:  # one loop, every tile masked: with two loops the program spills (sm_90a)
        carry = jax.lax.fori_loop(start, end, functools.partial(step, True), carry)
    else:
        carry = jax.lax.fori_loop(start, whole, functools.partial(step, True), carry)
        carry = jax.lax.fori_loop(whole, end, functools.partial(step, False), carry)
    for g, (dk, dv_) in enumerate(carry):
        put(dk_ref, g, own, dk.astype(dk_ref.dtype))
        put(dv_ref, g, own, dv_.astype(dv_ref.dtype))



def _read_back(get, ref, g, j, p: Plan, width):
    """[band_k, width]: the gathered rows of key tile ``j``'s summary keys, zeros elsewhere: for
    each row the tile touches and each run of residues, one shifted load."""
    pos = j * p.band_k + jnp.arange(p.band_k, dtype=jnp.int32)
    row, offset = div(pos, p.block), pos - div(pos, p.block) * p.block
    out = jnp.zeros((p.band_k, width), jnp.float32)
    for start, r, residue, count in read_windows(j, p):
        keep = (row == r) & (offset >= residue) & (offset < residue + count)
        out = out + jnp.where(keep[:, None], get(ref, g, pl.ds(start, p.band_k)), 0.0)
    return out


def _dkv_band(k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, gk_ref, gv_ref, *refs, p,
              seq_major, interpret):
    """dk, dv of key tile ``j`` in sequence order: its row's band queries, plus its summary
    keys' gathered dk, dv (``_dkv``'s), written once in the output dtype; refs as ``_dkv``'s
    (with dq: the band term's dq added there)."""
    dk_ref, dv_ref, *dq_ref = refs[-3:] if len(refs) == 4 else refs
    get, put = _access(seq_major, interpret)
    j = pl.program_id(1)
    own = _tile(j, p.band_k)
    heads = range(k_ref.shape[1 if seq_major else 0])
    ks, vs = ([get(ref, g, own) for g in heads] for ref in (k_ref, v_ref))
    step = _key_grads(get, put, heads, ks, vs, (q_ref, do_ref, lse_ref, delta_ref), p.band_q,
                      lambda q0, bq: _band_mask(q0, bq, j * p.band_k, p.band_k, p), *dq_ref)
    start = tuple((_read_back(get, gk_ref, g, j, p, ks[g].shape[-1]),
                   _read_back(get, gv_ref, g, j, p, vs[g].shape[-1])) for g in heads)
    carry = jax.lax.fori_loop(*band_k(j, p), functools.partial(step, True), start)
    for g, (dk, dv) in enumerate(carry):
        put(dk_ref, g, own, dk.astype(dk_ref.dtype))
        put(dv_ref, g, own, dv.astype(dv_ref.dtype))


# ---------------------------------------------------------------------------------------------
# The calls.


def _call(compiler, kernel, programs, inputs, out, name, seq_major, cost, aliases=None):
    """pallas_call over (head group, tile, batch), heads fastest (a tile's heads run together,
    the longest tiles first); every array whole along its length, the program's heads;
    ``out``: (shape, dtype) pairs; ``aliases``: input index to output index."""
    heads = compiler.heads_per_program
    shape = out[0][0]
    grid = (shape[2 if seq_major else 1] // heads, programs, shape[0])

    def spec(shape):
        if seq_major:
            return pl.BlockSpec((None, shape[1], heads, shape[3]), lambda h, i, b: (b, 0, h, 0))
        return pl.BlockSpec((None, heads, shape[2], shape[3]), lambda h, i, b: (b, h, 0, 0))

    params = {}
    if not compiler.interpret:
        from jax.experimental.pallas import triton as pl_triton

        params["compiler_params"] = pl_triton.CompilerParams(
            num_warps=compiler.num_warps, num_stages=compiler.num_stages)
    return pl.pallas_call(
        kernel, grid=grid, interpret=compiler.interpret, name=name, cost_estimate=cost,
        input_output_aliases=aliases or {},
        in_specs=[spec(x.shape) for x in inputs], out_specs=[spec(s) for s, _ in out],
        out_shape=[jax.ShapeDtypeStruct(s, dtype) for s, dtype in out], **params,
    )(*inputs)


def gather(p: Plan, k, v, seq_major=False):
    """The summary keys and values side by side, [B, H, gathered, w] ([B, gathered, H, w]):
    k's columns, v's, zeros to a power of two; ``p.front`` zero rows before the entries."""
    axis = 1 if seq_major else 2
    width = pl.next_power_of_2(k.shape[-1] + v.shape[-1])
    kv = jnp.concatenate([k, v, jnp.zeros((*k.shape[:-1], width - k.shape[-1] - v.shape[-1]),
                                          k.dtype)], -1)
    grid = kv.reshape(*kv.shape[:axis], p.length // p.block, p.block, *kv.shape[axis + 1:])
    picked = jnp.take(grid, np.array(p.residues), axis=axis + 1)
    flat = picked.reshape(*kv.shape[:axis], -1, *kv.shape[axis + 1:])
    widths = [(0, 0)] * kv.ndim
    widths[axis] = (p.front, p.gathered - p.front - flat.shape[axis])
    return jnp.pad(flat, widths)


def _setup(p: Plan, q, v, seq_major):
    batch, heads = q.shape[0], q.shape[2 if seq_major else 1]
    like = (lambda n, d: (batch, n, heads, d)) if seq_major else (
        lambda n, d: (batch, heads, n, d))
    sizes = (batch * heads, q.shape[-1], v.shape[-1], q.dtype.itemsize)
    return like, dict(p=p, seq_major=seq_major), sizes, tables(p)


def forward(compiler, p: Plan, q, k, v, seq_major=False):
    """Output (q's dtype) and log-sum-exp [B, H, length, 1] (float32) of the pattern: q (scaled),
    k, v in sequence order, ``p.length`` long."""
    like, statics, sizes, table = _setup(p, q, v, seq_major)
    statics["interpret"] = compiler.interpret
    name = "sparse_forward_gathered"
    cost = tiles.cost("forward", table[name], p.bq, p.bk, *sizes, q.dtype.itemsize)
    return _call(compiler, functools.partial(_queries, **statics), p.length // p.bq,
                 [q, k, v, gather(p, k, v, seq_major)],
                 [(like(p.length, v.shape[-1]), q.dtype), (like(p.length, 1), jnp.float32)],
                 name, seq_major, cost)


def _with_dq(cost, table, bq, bk, heads, d):
    """A dk/dv pass's ``cost`` plus its atomic dq: ``ds k`` a visited tile, and the float32 dq
    rows read and written there."""
    visits = int(table[:, 0].sum() + table[:, 1].sum())
    return pl.CostEstimate(flops=cost.flops + 2 * visits * bq * bk * d * heads,
                           transcendentals=cost.transcendentals,
                           bytes_accessed=cost.bytes_accessed + 8 * visits * bq * d * heads)


def backward(compiler, p: Plan, q, k, v, o, do, lse, seq_major=False):
    """(dq, dk, dv) in q's dtype for the output ``o``'s gradient ``do`` (v's dtype) and the
    forward's log-sum-exp ([B, H, length, 1], float32); arrays as ``forward``'s. With
    ``p.atomic`` (option atomic) no dq program: delta is XLA's, and both dk/dv programs add dq
    atomically to float32 zeros (XLA's), which XLA casts to q's dtype; dq's sum then depends on
    the order the adds land (not bit-reproducible)."""
    like, statics, sizes, table = _setup(p, q, v, seq_major)
    statics["interpret"] = compiler.interpret
    kv = gather(p, k, v, seq_major)
    if p.atomic:
        delta = (do.astype(jnp.float32) * o.astype(jnp.float32)).sum(-1, keepdims=True)
        init = [jnp.zeros(like(p.length, q.shape[-1]), jnp.float32)]
    else:
        init = []
        dq, delta = _call(compiler, functools.partial(_queries, **statics), p.length // p.bq,
                          [q, k, v, kv, do, o, lse], [(like(p.length, q.shape[-1]), q.dtype),
                                                      (like(p.length, 1), jnp.float32)],
                          "sparse_dq_gathered", seq_major,
                          tiles.cost("dq", table["sparse_dq_gathered"], p.bq, p.bk, *sizes,
                                     q.dtype.itemsize))
    out_dq = [(x.shape, jnp.float32) for x in init]
    dkv = p.for_dkv()
    cost = tiles.cost("dkv", table["sparse_dkv_gathered"], dkv.bq, dkv.bk, *sizes)
    gk, gv, *dq_ = _call(  # atomic: one stage (with two, 128 x 128 tiles at 8 warps spill)
        dataclasses.replace(compiler, num_warps=p.dkv_warps or compiler.num_warps,
                            num_stages=1 if p.atomic else compiler.num_stages),
        functools.partial(_dkv, **{**statics, "p": dkv}), (p.gathered - 2 * p.front) // dkv.bk,
        [kv, q, do, lse, delta, *init],
        [(like(p.gathered, k.shape[-1]), jnp.float32),
         (like(p.gathered, v.shape[-1]), jnp.float32), *out_dq], "sparse_dkv_gathered",
        seq_major, _with_dq(cost, table["sparse_dkv_gathered"], dkv.bq, dkv.bk, sizes[0],
                            sizes[1]) if p.atomic else cost, {5: 2} if p.atomic else None)
    cost = tiles.cost("dkv", table["sparse_dkv_gathered_band"], p.band_q, p.band_k, *sizes,
                      k.dtype.itemsize)
    dk, dv, *dq_ = _call(
        compiler, functools.partial(_dkv_band, **statics), p.length // p.band_k,
        [k, v, q, do, lse, delta, gk, gv, *dq_],
        [(like(p.length, k.shape[-1]), k.dtype), (like(p.length, v.shape[-1]), v.dtype),
         *out_dq], "sparse_dkv_gathered_band", seq_major,
        _with_dq(cost, table["sparse_dkv_gathered_band"], p.band_q, p.band_k, sizes[0],
                 sizes[1]) if p.atomic else cost, {8: 2} if p.atomic else None)
    return (dq_[0].astype(q.dtype) if p.atomic else dq), dk, dv
