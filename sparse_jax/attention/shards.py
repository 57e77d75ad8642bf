"""What each shard of a split sequence computes and sends (``attention.context`` plans the split
and is the entry point): the parts on local data (dense blocks, and the band, column and summary
terms through the XLA path, the fused CPU kernels or the Pallas kernels), the sparse patterns'
collectives (the band's halo, the residue-sharded columns, the all-gathered summary keys) and
the dense ring, each with its custom VJP. The module docstring of ``attention.context`` tells
how each pattern's keys cross shard boundaries.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as jax_config

from sparse_jax.attention import fused, pallas, reference, xla

_NEG = reference.NEG  # a masked score
_EMPTY = -reference.NEG  # attention's log-sum-exp of a query with no key (its backward's 0)
_HEAD_STEP_BYTES = 1 << 20  # one shard of q (float32) in a step over head groups (1 MiB)
_DENSE_SCORES = 1 << 20  # scores in a step of a dense block, all batch rows and heads (4 MiB)


@dataclasses.dataclass(frozen=True)
class Terms:
    """Some terms of a pattern, where ``attention``'s grid functions take a spec (they call only
    ``terms()``) and the Pallas kernel's ``terms()`` and ``block`` (the grid's width)."""
    items: tuple
    block: int = 0

    def terms(self):
        return self.items


# ---------------------------------------------------------------------------------------------
# Parts: (output float32, log-sum-exp) of some of a query's keys, and their backward given the
# merged output and log-sum-exp. attention's log-sum-exp of a query with no key is _EMPTY.


def _grid(x, block):  # [B, m, H, ...] -> [B, m / block, block, H, ...]
    return x.reshape(x.shape[0], -1, block, *x.shape[2:])


def _flat(x):  # the inverse of _grid
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _merge(parts):
    """One joint softmax of parts [(out, lse)]: the merged (out, lse)."""
    lses = [jnp.where(lse >= _EMPTY, -jnp.inf, lse) for _, lse in parts]
    top = functools.reduce(jnp.maximum, lses)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = [jnp.exp(lse - top) for lse in lses]
    total = sum(weights)
    out = sum(w[..., None] * o for w, (o, _) in zip(weights, parts))
    out = out / jnp.maximum(total, 1e-30)[..., None]
    return out, jnp.where(total > 0, top + jnp.log(jnp.maximum(total, 1e-30)), _EMPTY)


def _dense_chunks(q, k) -> int:
    """Queries per step: the most that divides them with at most ``_DENSE_SCORES`` scores."""
    most = max(1, _DENSE_SCORES // (q.shape[0] * q.shape[2] * k.shape[1]))
    return max(c for c in range(1, min(most, q.shape[1]) + 1) if q.shape[1] % c == 0)


def _by_query_chunks(x, c):  # [B, m, ...] -> [m / c, B, c, ...]
    return jnp.moveaxis(x.reshape(x.shape[0], -1, c, *x.shape[2:]), 1, 0)


def _from_query_chunks(x):
    return _flat(jnp.moveaxis(x, 0, 1))


def _diagonal(m):  # keep(rows) of a causal block: key j <= query i
    return lambda rows: rows[:, None] >= jnp.arange(m)[None, :]


def _everything(rows):  # keep(rows) of a block of earlier keys
    return jnp.ones((1, 1), bool)


def _no_keys(q, v):
    """The (out, lse) of a part with no key for q, typed like q (under shard_map: varying)."""
    out = jnp.zeros_like(q[..., :1], jnp.float32) * jnp.zeros(v.shape[-1:], jnp.float32)
    return out, jnp.full_like(q[..., 0], _EMPTY, jnp.float32)


def _dense_forward(q, k, v, keep, scale):
    """q [B, m, H, d] against k, v [B, K, H, d]; ``keep(rows)``: bool [c or 1, K] for the
    queries ``rows`` (their index in q). Chunks of queries in a ``lax.map``."""
    c = _dense_chunks(q, k)

    def one(args):
        start, q_c = args
        q_c = q_c * jnp.asarray(scale, q.dtype)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q_c, k, preferred_element_type=jnp.float32)
        scores = jnp.where(keep(start + jnp.arange(c))[None, None], scores, _NEG)
        top = jnp.maximum(scores.max(-1), reference.FLOOR)
        probs = jnp.exp(scores - top[..., None])
        total = probs.sum(-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v,
                         preferred_element_type=jnp.float32)
        out = out / jnp.maximum(total, 1e-30).transpose(0, 2, 1)[..., None]
        lse = jnp.where(total > 0, top + jnp.log(jnp.maximum(total, 1e-30)), _EMPTY)
        return out, lse.transpose(0, 2, 1)

    starts = jnp.arange(0, q.shape[1], c)
    out, lse = jax.lax.map(one, (starts, _by_query_chunks(q, c)))
    return _from_query_chunks(out), _from_query_chunks(lse)


def _dense_backward(q, k, v, out, lse, d_out, keep, scale):
    """The backward of ``_dense_forward`` given the merged output and log-sum-exp: (dq, dk, dv)
    in q, k, v's dtypes."""
    c = _dense_chunks(q, k)
    delta = jnp.einsum("bqhd,bqhd->bqh", d_out, out)

    def step(carry, args):
        d_k, d_v = carry
        start, q_c, lse_c, delta_c, do_c = args
        q_c = q_c * jnp.asarray(scale, q.dtype)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q_c, k, preferred_element_type=jnp.float32)
        probs = jnp.exp(scores - lse_c.transpose(0, 2, 1)[..., None])
        probs = jnp.where(keep(start + jnp.arange(c))[None, None], probs, 0.0)
        do_c = do_c.astype(v.dtype)
        d_v = d_v + jnp.einsum("bhqk,bqhd->bkhd", probs.astype(v.dtype), do_c,
                               preferred_element_type=jnp.float32)
        d_probs = jnp.einsum("bqhd,bkhd->bhqk", do_c, v, preferred_element_type=jnp.float32)
        d_scores = (probs * (d_probs - delta_c.transpose(0, 2, 1)[..., None])).astype(q.dtype)
        d_q = jnp.einsum("bhqk,bkhd->bqhd", d_scores, k, preferred_element_type=jnp.float32)
        d_k = d_k + jnp.einsum("bhqk,bqhd->bkhd", d_scores, q_c,
                               preferred_element_type=jnp.float32)
        return (d_k, d_v), d_q * scale

    zeros = (jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32))
    starts = jnp.arange(0, q.shape[1], c)
    chunks = [_by_query_chunks(x, c) for x in (q, lse, delta, d_out.astype(jnp.float32))]
    (d_k, d_v), d_q = jax.lax.scan(step, zeros, (starts, *chunks))
    d_q = _from_query_chunks(d_q)
    return tuple(g.astype(x.dtype) for g, x in zip((d_q, d_k, d_v), (q, k, v)))


# ---------------------------------------------------------------------------------------------
# The term computations of a part on its grid [B, R, w, H, d]: attention's XLA path or fused CPU
# kernels (``how`` False or True), or the Pallas kernels (``how`` a ``pallas.Compiler``;
# the "terms" variant: each term in its own layout, merged by log-sum-exp).


def _heads_first(x):  # a grid [B, R, w, H, ...] -> [B, H, R * w, ...], the kernel's layout
    return jnp.moveaxis(_flat(x), 2, 1)


def _from_heads_first(x, width):  # the inverse of _heads_first
    return _grid(jnp.moveaxis(x, 1, 2), width)


def _kernel_inputs(compiler, scale, q_g, k_g, v_g):
    """q (scaled by 1/sqrt(d), as ``sparse_attention`` scales it for the kernel), k, v in the
    kernel's layout, head dims padded as ``fused.sequence_attention`` pads them."""
    q = q_g * jnp.asarray(scale, q_g.dtype)
    return tuple(fused._pad_head(_heads_first(x), compiler.backend) for x in (q, k_g, v_g))


def _unchecked(fn, like):
    """``fn()`` where a ``shard_map`` checks varying-axis types (``check_vma=True``), with that
    check off (the kernels' ``pallas_call`` gives its outputs none and refuses to run under it:
    ``layers`` runs them in ``check_vma=False``), each result then typed varying along ``like``'s
    axes. Elsewhere plain ``fn()``. Uses JAX's internal switch, as ``shard_map`` itself does."""
    varying = getattr(getattr(jax.typeof(like), "mat", None), "varying", frozenset())
    if not varying:
        return fn()
    switch = getattr(jax_config, "_check_vma", None)
    if switch is None:  # a JAX without it
        raise ValueError("implementation='pallas' runs in a shard_map with check_vma=False on "
                         "this JAX (the kernels' outputs carry no varying-axis types)")
    with switch(False):
        results = fn()

    def vary(x):
        missing = tuple(sorted(varying - jax.typeof(x).mat.varying))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(vary, results)


def _pallas_forward(spec, compiler, scale, q_g, k_g, v_g):
    """``xla.grid_forward`` through the Pallas kernels: (out, lse) float32 on the grid,
    the lse of a query with no key ``_EMPTY`` (the kernel's is about ``_NEG``)."""
    width = q_g.shape[2]
    q, k, v = _kernel_inputs(compiler, scale, q_g, k_g, v_g)
    out, lse = _unchecked(lambda: fused._forward(Terms(tuple(spec.terms()), width), compiler,
                                                  q, k, v), q_g)
    lse = jnp.where(lse > _NEG / 2, lse, _EMPTY)
    return (_from_heads_first(out[..., :v_g.shape[-1]], width),
            _from_heads_first(lse, width))


def _pallas_backward(spec, compiler, scale, residuals, d_out):
    """``xla.grid_backward`` through the Pallas kernels (the "terms" variant's backward,
    ``fused._attention_bwd``, given the merged output and log-sum-exp; its lse of a query with
    no key is ``_EMPTY``, as the kernel's backward takes it): dq, dk, dv in the inputs' dtypes."""
    q_g, k_g, v_g, out, lse = residuals
    width = q_g.shape[2]
    q, k, v = _kernel_inputs(compiler, scale, q_g, k_g, v_g)
    out, d_out = (fused._pad_to(_heads_first(x), v.shape[-1], axis=3) for x in (out, d_out))
    lse = _heads_first(lse)
    grads = _unchecked(lambda: fused._attention_bwd(
        Terms(tuple(spec.terms()), width), compiler, "terms", False, (q, k, v, out, lse), d_out),
        q_g)
    d_q, d_k, d_v = (_from_heads_first(g[..., :x.shape[-1]].astype(jnp.float32), width)
                     for g, x in zip(grads, (q_g, k_g, v_g)))
    d_q = d_q * scale  # the kernel's dq is of the scaled q
    return tuple(g.astype(x.dtype) for g, x in zip((d_q, d_k, d_v), (q_g, k_g, v_g)))


def is_pallas(how) -> bool:
    return isinstance(how, pallas.Compiler)


def _grid_forward(how, spec, scale, q_g, k_g, v_g):
    if is_pallas(how):
        return _pallas_forward(spec, how, scale, q_g, k_g, v_g)
    return xla.grid_forward(spec, scale, q_g, k_g, v_g, how)


def _grid_backward(how, spec, scale, residuals, d_out):
    if is_pallas(how):
        return _pallas_backward(spec, how, scale, residuals, d_out)
    return xla.grid_backward(spec, scale, how, residuals, d_out)


# ---------------------------------------------------------------------------------------------
# Sparse patterns: band (+ halo), columns (residue-sharded), summary keys (all-gathered).


def _to_columns(x_g, axis):
    """A shard's grid [B, rows, block, ...] -> this device's columns [B, P * rows, block/P, ...]
    of the whole sequence's grid."""
    return jax.lax.all_to_all(x_g, axis, 2, 1, tiled=True)


def _from_columns(x_c, axis):
    return jax.lax.all_to_all(x_c, axis, 1, 2, tiled=True)


def _to_next(x, axis, devices):  # shard s gets shard s - 1's x; shard 0 gets zeros
    return jax.lax.ppermute(x, axis, [(i, i + 1) for i in range(devices - 1)])


def _to_previous(x, axis, devices):  # the transpose of _to_next
    return jax.lax.ppermute(x, axis, [(i + 1, i) for i in range(devices - 1)])


def _summary_keys(x_g, residues, axis):
    """The summary positions of every shard's grid, [B, P * rows * c, H, ...] in order."""
    s = jax.lax.all_gather(x_g[:, :, np.asarray(residues)], axis, axis=1, tiled=True)
    return s.reshape(s.shape[0], -1, *s.shape[3:])


def _with_halo(x, halo):  # [B, m, ...] with `halo` positions before it
    return jnp.concatenate([halo, x], axis=1)


def _sparse_forward(plan, axis, how, q, k, v):
    """(out float32, lse) of this shard's queries: the parts of ``plan`` merged."""
    m = q.shape[1]
    block, devices = plan.block, plan.devices
    scale = 1.0 / math.sqrt(q.shape[-1])
    parts = []
    if plan.local:
        local = Terms(plan.local)

        def own(q, k, v):
            out, lse = _grid_forward(how, local, scale, *(_grid(x, block) for x in (q, k, v)))
            return _flat(out), _flat(lse)

        out, lse = own(q, k, v)
        if plan.halo:  # the first rows again, on a grid of the halo and them
            size = plan.halo * block
            k_h, v_h = (_to_next(x[:, m - size:], axis, devices) for x in (k, v))
            out_h, lse_h = own(_with_halo(q[:, :size], jnp.zeros_like(q[:, :size])),
                               _with_halo(k[:, :size], k_h), _with_halo(v[:, :size], v_h))
            first = jax.lax.axis_index(axis) == 0  # shard 0 has no halo
            out = out.at[:, :size].set(jnp.where(first, out[:, :size], out_h[:, size:]))
            lse = lse.at[:, :size].set(jnp.where(first, lse[:, :size], lse_h[:, size:]))
        parts.append((out, lse))
    if plan.columns:
        q_c, k_c, v_c = (_to_columns(_grid(x, block), axis) for x in (q, k, v))
        out, lse = _grid_forward(how, Terms(plan.columns), scale, q_c, k_c, v_c)
        parts.append((_flat(_from_columns(out, axis)), _flat(_from_columns(lse, axis))))
    if plan.summary is not None:  # shard j's summary keys, for each earlier shard j
        per_shard = m // block * len(plan.summary)
        k_s, v_s = (_summary_keys(_grid(x, block), plan.summary, axis) for x in (k, v))
        me = jax.lax.axis_index(axis)
        nothing = lambda q, k, v: _no_keys(q, v)  # noqa: E731
        earlier = lambda q, k, v: _dense_forward(q, k, v, _everything, scale)  # noqa: E731
        for j in range(devices - 1):  # the last shard's are no shard's earlier keys
            keys = (x[:, j * per_shard:(j + 1) * per_shard] for x in (k_s, v_s))
            parts.append(jax.lax.cond(j < me, earlier, nothing, q, *keys))
    return _merge(parts) if len(parts) > 1 else parts[0]


def _sparse_backward(plan, axis, how, q, k, v, out, lse, d_out):
    """(dq, dk, dv) of this shard given the merged out and lse: each part's backward on its
    local data, the key gradients sent back the way the keys came."""
    m = q.shape[1]
    block, devices = plan.block, plan.devices
    scale = 1.0 / math.sqrt(q.shape[-1])
    d_q, d_k, d_v = (jnp.zeros_like(x, jnp.float32) for x in (q, k, v))
    if plan.local:
        local = Terms(plan.local)

        def own(q, k, v, out, lse, d_out):
            grads = _grid_backward(
                how, local, scale, tuple(_grid(x, block) for x in (q, k, v, out, lse)),
                _grid(d_out, block))
            return tuple(_flat(g).astype(jnp.float32) for g in grads)

        if plan.halo:  # the first rows' pairs come from the grid of the halo and them
            size = plan.halo * block
            k_h, v_h = (_to_next(x[:, m - size:], axis, devices) for x in (k, v))
            later = jax.lax.axis_index(axis) > 0
            zeros = lambda x, value=0: jnp.full_like(x[:, :size], value)  # noqa: E731
            g_q, g_k, g_v = own(
                _with_halo(q[:, :size], zeros(q)), _with_halo(k[:, :size], k_h),
                _with_halo(v[:, :size], v_h), _with_halo(out[:, :size], zeros(out)),
                _with_halo(lse[:, :size], zeros(lse, _EMPTY)),
                _with_halo(jnp.where(later, d_out[:, :size], 0), zeros(d_out)))
            rest = d_out.at[:, :size].set(jnp.where(later, 0, d_out[:, :size]))
            d_q, d_k, d_v = own(q, k, v, out, lse, rest)
            d_q = d_q.at[:, :size].add(g_q[:, size:])
            d_k = d_k.at[:, :size].add(g_k[:, size:])
            d_v = d_v.at[:, :size].add(g_v[:, size:])
            d_k = d_k.at[:, m - size:].add(_to_previous(g_k[:, :size], axis, devices))
            d_v = d_v.at[:, m - size:].add(_to_previous(g_v[:, :size], axis, devices))
        else:
            d_q, d_k, d_v = own(q, k, v, out, lse, d_out)
    if plan.columns:
        to_c = lambda x: _to_columns(_grid(x, block), axis)  # noqa: E731
        grads = _grid_backward(
            how, Terms(plan.columns), scale, tuple(to_c(x) for x in (q, k, v, out, lse)),
            to_c(d_out))
        d_q, d_k, d_v = (a + _flat(_from_columns(g, axis)).astype(jnp.float32)
                         for a, g in zip((d_q, d_k, d_v), grads))
    if plan.summary is not None:  # as the forward: shard j's summary keys, j < this shard
        rows = m // block
        per_shard = rows * len(plan.summary)
        k_s, v_s = (_summary_keys(_grid(x, block), plan.summary, axis) for x in (k, v))
        me = jax.lax.axis_index(axis)
        nothing = lambda q, k, v: tuple(jnp.zeros_like(x, jnp.float32)  # noqa: E731
                                        for x in (q, k, v))
        earlier = lambda q, k, v: tuple(g.astype(jnp.float32) for g in  # noqa: E731
                                        _dense_backward(q, k, v, out, lse, d_out, _everything,
                                                        scale))
        g_k, g_v = [], []
        for j in range(devices - 1):
            keys = (x[:, j * per_shard:(j + 1) * per_shard] for x in (k_s, v_s))
            g = jax.lax.cond(j < me, earlier, nothing, q, *keys)
            d_q = d_q + g[0]
            g_k.append(g[1])
            g_v.append(g[2])
        g_k, g_v = (jnp.concatenate(g + [jnp.zeros_like(g[0])], axis=1) for g in (g_k, g_v))
        at = np.asarray(plan.summary)

        def scatter(g, d):  # the summary keys' gradients summed back to their shard's grid
            g = g.reshape(g.shape[0], devices * rows, len(at), *g.shape[2:])
            g = jax.lax.psum_scatter(g.astype(jnp.float32), axis, scatter_dimension=1,
                                     tiled=True)
            return _flat(_grid(d, block).at[:, :, at].add(g))

        d_k, d_v = scatter(g_k, d_k), scatter(g_v, d_v)
    return tuple(g.astype(x.dtype) for g, x in zip((d_q, d_k, d_v), (q, k, v)))


def _heads_per_step(x, multiple: int = 1) -> int:
    """Heads in a step: the most that divides them with at most ``_HEAD_STEP_BYTES`` of x (a
    multiple of ``multiple``, which divides them: a Pallas program's heads)."""
    most = max(multiple, _HEAD_STEP_BYTES // (x.shape[0] * x.shape[1] * x.shape[3] * 4))
    return max(h for h in range(multiple, min(most, x.shape[2]) + 1, multiple)
               if x.shape[2] % h == 0)


def _over_heads(fn, arrays, like, multiple: int = 1):
    """``fn(*arrays)`` a group of heads at a time (a ``fori_loop``), its results written into
    arrays of ``like``'s shapes and dtypes: one group's temporaries (the column layout's copies,
    the halo grid, the parts' outputs, the gradients) are alive at a time, not every head's.
    arrays: ``[B, m, H, ...]``; the heads are independent, so this is exact."""
    heads = arrays[0].shape[2]
    h = _heads_per_step(arrays[0], multiple)
    if h == heads:
        return tuple(r.astype(x.dtype) for r, x in zip(fn(*arrays), like))

    def body(i, results):
        group = (jax.lax.dynamic_slice_in_dim(x, i * h, h, axis=2) for x in arrays)
        return tuple(jax.lax.dynamic_update_slice_in_dim(z, r.astype(z.dtype), i * h, axis=2)
                     for z, r in zip(results, fn(*group)))

    return jax.lax.fori_loop(0, heads // h, body, tuple(jnp.zeros_like(x) for x in like))


def _stats_like(q, v):  # the merged output and log-sum-exp's shapes, float32 (*_like: under
    # shard_map typed as varying along the axis, as the results written into them)
    return jnp.zeros_like(v, jnp.float32), jnp.zeros_like(q[..., 0], jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def sparse(plan, axis, how, q, k, v):
    return _sparse_fwd(plan, axis, how, q, k, v)[0]


def _sparse_fwd(plan, axis, how, q, k, v):
    out, lse = _over_heads(functools.partial(_sparse_forward, plan, axis, how), (q, k, v),
                           _stats_like(q, v), _program_heads(how))
    return out.astype(q.dtype), (q, k, v, out, lse)


def _sparse_bwd(plan, axis, how, residuals, d_out):
    return _over_heads(functools.partial(_sparse_backward, plan, axis, how),
                       (*residuals, d_out), residuals[:3], _program_heads(how))


def _program_heads(how) -> int:  # the heads a Pallas program serves (1 elsewhere)
    return how.heads_per_program if is_pallas(how) else 1


sparse.defvjp(_sparse_fwd, _sparse_bwd)


# ---------------------------------------------------------------------------------------------
# Dense: a ring of K/V blocks.


def _ring_shift(x, axis, devices):  # shard s gets shard s - 1's x, shard 0 gets shard P - 1's
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % devices) for i in range(devices)])


def _ring_forward(axis, devices, q, k, v):
    scale = 1.0 / math.sqrt(q.shape[-1])
    me = jax.lax.axis_index(axis)
    merged = _dense_forward(q, k, v, _diagonal(q.shape[1]), scale)
    nothing = lambda q, k, v: _no_keys(q, v)  # noqa: E731
    earlier = lambda q, k, v: _dense_forward(q, k, v, _everything, scale)  # noqa: E731
    for step in range(1, devices):
        k, v = _ring_shift(k, axis, devices), _ring_shift(v, axis, devices)
        part = jax.lax.cond(step <= me, earlier, nothing, q, k, v)  # from shard me - step
        merged = _merge([merged, part])
    return merged


def _ring_backward(axis, devices, q, k, v, out, lse, d_out):
    scale = 1.0 / math.sqrt(q.shape[-1])
    me = jax.lax.axis_index(axis)
    d_q, d_k, d_v = _dense_backward(q, k, v, out, lse, d_out, _diagonal(q.shape[1]), scale)
    d_q, d_k, d_v = (g.astype(jnp.float32) for g in (d_q, d_k, d_v))
    nothing = lambda q, k, v: tuple(jnp.zeros_like(x, jnp.float32)  # noqa: E731
                                    for x in (q, k, v))
    earlier = lambda q, k, v: tuple(g.astype(jnp.float32) for g in _dense_backward(  # noqa: E731
        q, k, v, out, lse, d_out, _everything, scale))
    for step in range(1, devices):  # the key gradients travel with their keys
        k, v, d_k, d_v = (_ring_shift(x, axis, devices) for x in (k, v, d_k, d_v))
        g_q, g_k, g_v = jax.lax.cond(step <= me, earlier, nothing, q, k, v)
        d_q, d_k, d_v = d_q + g_q, d_k + g_k, d_v + g_v
    d_k, d_v = _ring_shift(d_k, axis, devices), _ring_shift(d_v, axis, devices)  # home
    return tuple(g.astype(x.dtype) for g, x in zip((d_q, d_k, d_v), (q, k, v)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def ring(axis, devices, q, k, v):
    return _ring_fwd(axis, devices, q, k, v)[0]


def _ring_fwd(axis, devices, q, k, v):
    out, lse = _over_heads(functools.partial(_ring_forward, axis, devices), (q, k, v),
                           _stats_like(q, v))
    return out.astype(q.dtype), (q, k, v, out, lse)


def _ring_bwd(axis, devices, residuals, d_out):
    return _over_heads(functools.partial(_ring_backward, axis, devices), (*residuals, d_out),
                       residuals[:3])


ring.defvjp(_ring_fwd, _ring_bwd)
