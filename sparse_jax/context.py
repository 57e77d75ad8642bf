"""Context parallelism: one sequence split over the devices of a mesh axis, attention exact.

``context_attention(q, k, v, spec, axis="seq")`` runs inside ``jax.shard_map``: q, k, v
``[B, n/P, H, d]`` are this device's contiguous shard of the sequence along mesh axis ``axis``
(P devices, shard ``jax.lax.axis_index(axis)``), and the result is this shard's rows of
``sparse_attention(q, k, v, spec)`` over the whole sequence. ``context_parallel_attention`` takes
global arrays and a mesh and runs the ``shard_map``. This module is the one place that knows how
each pattern's keys cross shard boundaries:

* a **band** term (local window, fixed block) needs only a **halo**: the last ``prev`` grid rows
  of keys and values of the previous shard (one ``ppermute``; shard 0 gets none). The fixed
  block (``prev = 0``) needs nothing.
* a **column** term (the strided part) runs **residue-sharded**: an ``all_to_all`` gives each
  device ``l/P`` whole columns of the ``[n/l, l]`` grid (every position of its residues, which
  needs ``P | l``), the column attention runs there locally, and a second ``all_to_all`` brings
  the output and its log-sum-exp back.
* a **summary** term (fixed): the summary keys within the shard are the grid's summary term on
  the shard; those of earlier shards (``n·c/l`` keys in all) come by an ``all_gather``.
* **dense**: a ring, P - 1 ``ppermute`` steps passing K/V blocks on; a block from a later shard
  is skipped (``lax.cond``), the one from this shard is causal.

Each part gives an output and its log-sum-exp, merged as ``attention`` merges its terms (one
joint softmax). The parts run the XLA path's (or the fused CPU kernels') term computations of
``attention`` on local data, or with ``implementation="pallas"`` the Pallas kernels of
``kernel`` (its "terms" variant) for the band, own-shard summary and column terms
(``_pallas_forward``, ``_pallas_backward``: the grid layout in and out, as ``attention``'s grid
functions). Forward and backward are a ``custom_vjp``: the backward recomputes each part's
probabilities from the merged log-sum-exp (``attention``'s flash-style backward on
the same local data) and sends the key gradients back the way the keys came (the transposes of
the collectives: halo gradients to the previous shard, ``all_to_all`` back, a ``psum_scatter``
of the summary keys' gradients, the ring's key gradients travelling with their keys).

Heads go a group at a time (``_over_heads``), so one group's column layout and gradients are
alive at once. ``communication_bytes`` counts what each device sends per layer (forward, and
what the backward adds), ``planned_memory`` reads XLA's per-device plan of a compiled forward +
backward, ``cost_rows`` tabulates both (``scripts/context_parallel.py``). The term computations
are ``attention``'s own (``grid_forward``, ``grid_backward``): a change there changes
both paths, and the tests compare them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as jax_config

from sparse_jax import attention, kernel, pallas_kernels, patterns
from sparse_jax.patterns import BandTerm, ColumnTerm, PatternSpec, SummaryTerm

_NEG = attention._NEG  # a masked score
_EMPTY = -attention._NEG  # attention's log-sum-exp of a query with no key (its backward's 0)
_HEAD_STEP_BYTES = 1 << 20  # one shard of q (float32) in a step over head groups (1 MiB)
_DENSE_SCORES = 1 << 20  # scores in a step of a dense block, all batch rows and heads (4 MiB)
IMPLEMENTATIONS = ("xla", "native", "pallas", "auto")


@dataclasses.dataclass(frozen=True)
class _Terms:
    """Some terms of a pattern, where ``attention``'s grid functions take a spec (they call only
    ``terms()``) and the Pallas kernel's ``terms()`` and ``block`` (the grid's width)."""
    items: tuple
    block: int = 0

    def terms(self):
        return self.items


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How a sparse pattern's terms are split over ``devices`` shards of ``rows`` grid rows of
    ``block`` positions each: the terms on the shard's own grid (with ``halo`` rows of the
    previous shard before it), the column terms (residue-sharded: ``block / devices`` columns
    per device) and the summary residues whose keys of earlier shards are gathered."""
    block: int
    devices: int
    local: tuple = ()
    halo: int = 0
    columns: tuple = ()
    summary: tuple[int, ...] | None = None


def _plan(spec: PatternSpec, n: int, devices: int) -> _Plan:
    """The split of ``spec`` over ``devices`` shards of a sequence of ``n``; a ValueError in one
    line if the split does not fit the pattern."""
    block = spec.block
    if n % devices or (n // devices) % block:
        raise ValueError(f"context parallelism over {devices} devices needs n/P a multiple of "
                         f"{spec}'s block {block}; got n={n}")
    rows = n // devices // block
    terms = spec.terms()
    local = tuple(t for t in terms if not isinstance(t, ColumnTerm))
    halo = max((t.prev for t in local if isinstance(t, BandTerm)), default=0)
    if halo > rows:
        raise ValueError(f"{spec}'s window reaches {halo} rows of {block} back, more than one "
                         f"shard's {rows} rows (n={n}, P={devices}): use fewer devices")
    columns = tuple(ColumnTerm(block // devices, t.min_rows) for t in terms
                    if isinstance(t, ColumnTerm))
    if columns and block % devices:
        raise ValueError(f"{spec}'s column term splits its {block} residues over the devices: "
                         f"P={devices} must divide the stride {block}")
    summaries = [t.residues for t in terms if isinstance(t, SummaryTerm)]
    assert len(summaries) <= 1 and not (summaries and halo), terms
    return _Plan(block, devices, local, halo if devices > 1 else 0,
                 columns, summaries[0] if summaries and devices > 1 else None)


def check_split(spec: PatternSpec, n: int, devices: int) -> None:
    """ValueError (one line) unless a sequence of ``n`` splits over ``devices`` for ``spec``:
    P | n, and for a sparse pattern n/P a multiple of its block, P | l for a column term, a
    window no longer than a shard."""
    n = patterns.check_int("n", n)
    devices = patterns.check_int("devices", devices)
    if n % devices:
        raise ValueError(f"context parallelism over {devices} devices needs P | n; got n={n}")
    if spec.kind != "dense":
        _plan(spec, n, devices)


def check_model_split(specs, seq_len: int, devices: int) -> None:
    """ValueError (one line, ``check_split``'s) unless a model whose layers attend with
    ``specs`` (one entry a layer: a tuple of PatternSpecs, one per head group, or a PatternSpec)
    can split a sequence of ``seq_len`` over ``devices``: every distinct pattern must."""
    distinct = {}
    for layer in specs:
        for spec in (tuple(layer) if isinstance(layer, (tuple, list)) else (layer,)):
            if not isinstance(spec, PatternSpec):
                raise ValueError(f"specs must hold tuples of PatternSpecs (one a layer), got "
                                 f"{spec!r}")
            distinct.setdefault(spec, None)
    for spec in distinct:
        check_split(spec, seq_len, devices)


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
        top = jnp.maximum(scores.max(-1), attention._FLOOR)
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
# kernels (``how`` False or True), or the Pallas kernels (``how`` a ``pallas_kernels.Compiler``;
# the "terms" variant: each term in its own layout, merged by log-sum-exp).


def _heads_first(x):  # a grid [B, R, w, H, ...] -> [B, H, R * w, ...], the kernel's layout
    return jnp.moveaxis(_flat(x), 2, 1)


def _from_heads_first(x, width):  # the inverse of _heads_first
    return _grid(jnp.moveaxis(x, 1, 2), width)


def _kernel_inputs(compiler, scale, q_g, k_g, v_g):
    """q (scaled by 1/sqrt(d), as ``sparse_attention`` scales it for the kernel), k, v in the
    kernel's layout, head dims padded as ``kernel.sequence_attention`` pads them."""
    q = q_g * jnp.asarray(scale, q_g.dtype)
    return tuple(kernel._pad_head(_heads_first(x), compiler.backend) for x in (q, k_g, v_g))


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
    """``attention.grid_forward`` through the Pallas kernels: (out, lse) float32 on the grid,
    the lse of a query with no key ``_EMPTY`` (the kernel's is about ``_NEG``)."""
    width = q_g.shape[2]
    q, k, v = _kernel_inputs(compiler, scale, q_g, k_g, v_g)
    out, lse = _unchecked(lambda: kernel._forward(_Terms(tuple(spec.terms()), width), compiler,
                                                  q, k, v), q_g)
    lse = jnp.where(lse > _NEG / 2, lse, _EMPTY)
    return (_from_heads_first(out[..., :v_g.shape[-1]], width),
            _from_heads_first(lse, width))


def _pallas_backward(spec, compiler, scale, residuals, d_out):
    """``attention.grid_backward`` through the Pallas kernels (the "terms" variant's backward,
    ``kernel._attention_bwd``, given the merged output and log-sum-exp; its lse of a query with
    no key is ``_EMPTY``, as the kernel's backward takes it): dq, dk, dv in the inputs' dtypes."""
    q_g, k_g, v_g, out, lse = residuals
    width = q_g.shape[2]
    q, k, v = _kernel_inputs(compiler, scale, q_g, k_g, v_g)
    out, d_out = (kernel._pad_to(_heads_first(x), v.shape[-1], axis=3) for x in (out, d_out))
    lse = _heads_first(lse)
    grads = _unchecked(lambda: kernel._attention_bwd(
        _Terms(tuple(spec.terms()), width), compiler, "terms", False, (q, k, v, out, lse), d_out),
        q_g)
    d_q, d_k, d_v = (_from_heads_first(g[..., :x.shape[-1]].astype(jnp.float32), width)
                     for g, x in zip(grads, (q_g, k_g, v_g)))
    d_q = d_q * scale  # the kernel's dq is of the scaled q
    return tuple(g.astype(x.dtype) for g, x in zip((d_q, d_k, d_v), (q_g, k_g, v_g)))


def _pallas(how) -> bool:
    return isinstance(how, pallas_kernels.Compiler)


def _grid_forward(how, spec, scale, q_g, k_g, v_g):
    if _pallas(how):
        return _pallas_forward(spec, how, scale, q_g, k_g, v_g)
    return attention.grid_forward(spec, scale, q_g, k_g, v_g, how)


def _grid_backward(how, spec, scale, residuals, d_out):
    if _pallas(how):
        return _pallas_backward(spec, how, scale, residuals, d_out)
    return attention.grid_backward(spec, scale, how, residuals, d_out)


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
        local = _Terms(plan.local)

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
        out, lse = _grid_forward(how, _Terms(plan.columns), scale, q_c, k_c, v_c)
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
        local = _Terms(plan.local)

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
            how, _Terms(plan.columns), scale, tuple(to_c(x) for x in (q, k, v, out, lse)),
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
def _sparse(plan, axis, how, q, k, v):
    return _sparse_fwd(plan, axis, how, q, k, v)[0]


def _sparse_fwd(plan, axis, how, q, k, v):
    out, lse = _over_heads(functools.partial(_sparse_forward, plan, axis, how), (q, k, v),
                           _stats_like(q, v), _program_heads(how))
    return out.astype(q.dtype), (q, k, v, out, lse)


def _sparse_bwd(plan, axis, how, residuals, d_out):
    return _over_heads(functools.partial(_sparse_backward, plan, axis, how),
                       (*residuals, d_out), residuals[:3], _program_heads(how))


def _program_heads(how) -> int:  # the heads a Pallas program serves (1 elsewhere)
    return how.heads_per_program if _pallas(how) else 1


_sparse.defvjp(_sparse_fwd, _sparse_bwd)


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
def _ring(axis, devices, q, k, v):
    return _ring_fwd(axis, devices, q, k, v)[0]


def _ring_fwd(axis, devices, q, k, v):
    out, lse = _over_heads(functools.partial(_ring_forward, axis, devices), (q, k, v),
                           _stats_like(q, v))
    return out.astype(q.dtype), (q, k, v, out, lse)


def _ring_bwd(axis, devices, residuals, d_out):
    return _over_heads(functools.partial(_ring_backward, axis, devices), (*residuals, d_out),
                       residuals[:3])


_ring.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------------------------------------
# Entry points.


def _how(implementation: str, block_sizes=None):
    """How the sparse parts run, for ``implementation`` ("auto" as
    ``attention.resolve_implementation``: the Pallas kernels on a GPU or TPU, the fused CPU
    kernels on a CPU where they build, else XLA): False (XLA), True (the fused CPU kernels) or
    the Pallas kernels' ``pallas_kernels.Compiler`` for ``block_sizes`` (their "terms" variant
    whatever ``block_sizes.variant`` says); a ValueError for what cannot run here."""
    patterns.check_choice("implementation", implementation, IMPLEMENTATIONS)
    if block_sizes is not None and not isinstance(block_sizes, kernel.BlockSizes):
        raise ValueError(f"block_sizes must be a kernel.BlockSizes or None, got "
                         f"{type(block_sizes).__name__}")
    resolved = attention.resolve_implementation(implementation)
    if resolved == "pallas":
        return kernel.compiler_for(block_sizes)
    return resolved == "native"


def _specs(spec, heads: int) -> tuple[PatternSpec, ...]:
    """``spec`` as a tuple of head groups' patterns (one PatternSpec: one group); a ValueError
    unless each is a PatternSpec and they split the heads evenly."""
    specs = tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)
    if not specs or not all(isinstance(s, PatternSpec) for s in specs):
        raise ValueError(f"spec must be a PatternSpec or a sequence of them (head groups), got "
                         f"{spec!r}")
    if heads % len(specs):
        raise ValueError(f"{heads} heads cannot be split evenly into {len(specs)} groups "
                         f"({', '.join(map(str, specs))})")
    return specs


def context_attention(q, k, v, spec: PatternSpec | tuple[PatternSpec, ...], *,
                      axis: str = "seq", implementation: str = "xla",
                      block_sizes: kernel.BlockSizes | None = None):
    """This shard's rows of ``sparse_attention`` over the whole sequence; call inside
    ``jax.shard_map`` (``check_vma`` either way) with q, k, v ``[B, n/P, H, d]`` the shard
    ``jax.lax.axis_index(axis)`` of the sequence along mesh axis ``axis`` (the batch may be
    split over other axes: each device's rows are its own). ``spec``: a pattern, or one per
    head group (heads split evenly, as ``multi_spec_attention``). ``implementation``: "xla",
    "native" (the fused CPU kernels for the sparse terms), "pallas" (the Pallas kernels for
    the sparse terms: compiled on a GPU or TPU, interpret mode on a CPU) or "auto" (as
    ``attention.resolve_implementation``: Pallas on a GPU or TPU, the CPU kernels on a CPU
    where they build). ``block_sizes``: the Pallas kernels' tiles (``kernel.BlockSizes``;
    ignored by "xla" and "native"); inside the split they run the "terms" variant, also for
    ``variant="chained"``. The dense ring and the summary keys of earlier shards run XLA's
    dense blocks whatever the implementation. Differentiable (a custom backward, exact)."""
    attention.check_qkv(q, k, v)
    specs = _specs(spec, q.shape[2])
    if len(specs) > 1:
        g = q.shape[2] // len(specs)
        return jnp.concatenate([context_attention(
            q[:, :, i * g:(i + 1) * g], k[:, :, i * g:(i + 1) * g], v[:, :, i * g:(i + 1) * g],
            s, axis=axis, implementation=implementation, block_sizes=block_sizes)
            for i, s in enumerate(specs)], axis=2)
    spec = specs[0]
    how = _how(implementation, block_sizes)
    if _pallas(how) and spec.kind != "dense" and q.shape[2] % how.heads_per_program:
        raise ValueError(f"BlockSizes.heads_per_program={how.heads_per_program} must divide "
                         f"the {q.shape[2]} heads")
    try:
        devices = jax.lax.axis_size(axis)
    except NameError:
        raise ValueError(f"context_attention runs inside jax.shard_map over a mesh axis "
                         f"{axis!r}; no such axis is bound here") from None
    n = q.shape[1] * devices
    check_split(spec, n, devices)
    if devices == 1:  # nothing to exchange: today's path
        return attention.sparse_attention(q, k, v, spec, implementation, block_sizes)
    if spec.kind == "dense":
        return _ring(axis, devices, q, k, v)
    return _sparse(_plan(spec, n, devices), axis, how, q, k, v)


def seq_mesh(devices: int, axis: str = "seq") -> jax.sharding.Mesh:
    """A one-axis mesh of the first ``devices`` devices (axis type Auto, as ``sharding``'s)."""
    devices = patterns.check_int("devices", devices)
    if devices > jax.device_count():
        raise ValueError(f"a {axis} axis of {devices} devices needs {devices} devices; "
                         f"{jax.device_count()} are visible")
    return jax.make_mesh((devices,), (axis,), devices=jax.devices()[:devices],
                         axis_types=(jax.sharding.AxisType.Auto,))


def context_parallel_attention(q, k, v, spec: PatternSpec | tuple[PatternSpec, ...],
                               mesh: jax.sharding.Mesh, *, axis: str = "seq",
                               implementation: str = "xla",
                               block_sizes: kernel.BlockSizes | None = None):
    """``sparse_attention(q, k, v, spec)`` (or ``multi_spec_attention`` for a tuple of specs)
    with the sequence split over mesh axis ``axis``: q, k, v ``[B, n, H, d]`` (global arrays),
    each device attending its contiguous ``n/P`` positions with ``context_attention``
    (``implementation``, ``block_sizes``: its). Refuses (ValueError, one line) a split that
    does not fit the pattern before any work."""
    attention.check_qkv(q, k, v)
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r} (axes: {', '.join(mesh.axis_names)})")
    for one in _specs(spec, q.shape[2]):
        check_split(one, q.shape[1], mesh.shape[axis])
    _how(implementation, block_sizes)
    split = jax.sharding.PartitionSpec(None, axis)
    attend = functools.partial(context_attention, spec=spec, axis=axis,
                               implementation=implementation, block_sizes=block_sizes)
    return jax.shard_map(attend, mesh=mesh, in_specs=(split,) * 3, out_specs=split,
                         check_vma=False)(q, k, v)


# ---------------------------------------------------------------------------------------------
# What it costs.


def communication_bytes(spec: PatternSpec, n: int, devices: int, heads: int, head_dim: int,
                        dtype_bytes: int = 4, batch: int = 1, *,
                        backward: bool = False) -> dict[str, int]:
    """Bytes one device sends per layer with the sequence of ``n`` split over ``devices``, in
    the forward pass (or with ``backward`` what the backward adds), by collective (and
    ``"total"``), as this module runs them: a ``ppermute`` sends its block, an ``all_to_all``
    the ``(P - 1)/P`` of its shard that leaves, an ``all_gather`` its shard to each of the
    ``P - 1`` others and a ``psum_scatter`` ``P - 1`` shards of its sums (as a ring does). The
    column part's output and log-sum-exp, the halo's and the summary keys' gradients and the
    ring's key gradients travel in float32. The most any device sends (the halo: all but the
    last shard; the ring: every shard passes every block on).

    The backward sends again what the forward sent (the ring's K/V, the halo, q, k, v to the
    columns, the summary keys), but where both passes are one program (a jitted training step)
    XLA sends each once (common subexpressions); ``backward`` counts only the rest: the
    gradients, and d_out, out and lse to the columns. The tests hold both counts to the
    compiled programs' collectives."""
    check_split(spec, n, devices)
    unit = batch * heads * head_dim  # one position of one of q, k, v
    m, b = n // devices, dtype_bytes
    sent = {}
    if devices > 1 and spec.kind == "dense":
        if backward:
            sent["ring ppermute (dk, dv)"] = devices * 2 * m * unit * 4
        else:
            sent["ring ppermute (k, v)"] = (devices - 1) * 2 * m * unit * b
    elif devices > 1:
        plan = _plan(spec, n, devices)
        if plan.halo:
            size = plan.halo * plan.block
            if backward:
                sent["halo ppermute back (dk, dv)"] = 2 * size * unit * 4
            else:
                sent["halo ppermute (k, v)"] = 2 * size * unit * b
        if plan.columns:
            leaving = m * (devices - 1) // devices
            lse = leaving * batch * heads * 4
            if backward:
                sent["columns all_to_all (d_out)"] = leaving * unit * b
                sent["columns all_to_all (out, lse)"] = leaving * unit * 4 + lse
                sent["columns all_to_all back (dq, dk, dv)"] = 3 * leaving * unit * b
            else:
                sent["columns all_to_all (q, k, v)"] = 3 * leaving * unit * b
                sent["columns all_to_all back (out, lse)"] = leaving * unit * 4 + lse
        if plan.summary is not None:
            keys = m // plan.block * len(plan.summary)
            if backward:
                sent["summary psum_scatter (dk, dv)"] = (devices - 1) * 2 * keys * unit * 4
            else:
                sent["summary all_gather (k, v)"] = (devices - 1) * 2 * keys * unit * b
    sent["total"] = sum(sent.values())
    return sent


def _step(spec, n, devices, heads, head_dim, batch, dtype, implementation):
    """A jitted forward + backward of the attention of ``n`` positions split over ``devices``
    (``context_parallel_attention``; one device: ``sparse_attention``): (program, the abstract
    arguments q, k, v, d_out)."""
    check_split(spec, n, devices)
    mesh = seq_mesh(devices)
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "seq"))
    arg = jax.ShapeDtypeStruct((batch, n, heads, head_dim), dtype, sharding=split)

    def attend(q, k, v):
        if devices == 1:
            return attention.sparse_attention(q, k, v, spec, implementation)
        return context_parallel_attention(q, k, v, spec, mesh, implementation=implementation)

    def grads(q, k, v, d_out):
        return jax.vjp(attend, q, k, v)[1](d_out)

    return jax.jit(grads, out_shardings=(split,) * 3), (arg,) * 4


def planned_memory(spec: PatternSpec, n: int, devices: int, heads: int, head_dim: int,
                   batch: int = 1, dtype=jnp.float32, implementation: str = "xla") -> dict:
    """XLA's plan for one device of a jitted forward + backward of the attention of ``n``
    positions split over ``devices`` (``context_parallel_attention``; one device:
    ``sparse_attention``), from ``compiled.memory_analysis()``: compiled only, nothing runs.
    Bytes of the arguments (q, k, v and the output's cotangent), the outputs (dq, dk, dv), the
    temporaries, and their sum ("total"), per device."""
    program, args = _step(spec, n, devices, heads, head_dim, batch, dtype, implementation)
    memory = program.lower(*args).compile().memory_analysis()
    sizes = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
             "temporaries": memory.temp_size_in_bytes}
    return {**sizes, "total": sum(sizes.values()) - memory.alias_size_in_bytes}


def step_seconds(spec: PatternSpec, n: int, devices: int, heads: int, head_dim: int,
                 batch: int = 1, dtype=jnp.float32, implementation: str = "xla",
                 repeats: int = 3) -> float:
    """Wall seconds of that forward + backward, run (random inputs), the least of ``repeats``
    after one warm-up. Simulated CPU devices share the host's cores: this is the split's
    total CPU cost beside one device's, not a speed-up."""
    program, args = _step(spec, n, devices, heads, head_dim, batch, dtype, implementation)
    keys = jax.random.split(jax.random.key(0), len(args))
    values = [jax.device_put(jax.random.normal(key, a.shape, a.dtype), a.sharding)
              for key, a in zip(keys, args)]
    jax.block_until_ready(program(*values))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(*values))
        times.append(time.perf_counter() - start)
    return min(times)


def cost_rows(specs, lengths, device_counts, heads: int, head_dim: int, *, batch: int = 1,
              dtype=jnp.float32, implementation: str = "xla", compile_memory: bool = True,
              measure_time: bool = False):
    """One row per (pattern, n, P) that splits: bytes one device sends per layer forward and
    what the backward adds (``communication_bytes``) and, with ``compile_memory`` and P devices
    visible, XLA's planned per-device memory of a forward + backward (``planned_memory``;
    compiled, never run), and with ``measure_time`` its wall time (``step_seconds``)."""
    rows = []
    for spec in specs:
        for n in lengths:
            for devices in device_counts:
                try:
                    check_split(spec, n, devices)
                except ValueError as error:
                    rows.append({"pattern": str(spec), "n": n, "devices": devices,
                                 "skipped": str(error)})
                    continue
                sent = {name: communication_bytes(spec, n, devices, heads, head_dim,
                                                  jnp.dtype(dtype).itemsize, batch,
                                                  backward=name == "backward")
                        for name in ("forward", "backward")}
                row = {"pattern": str(spec), "n": n, "devices": devices, "sent": sent}
                if compile_memory and devices <= jax.device_count():
                    row["memory"] = planned_memory(spec, n, devices, heads, head_dim, batch,
                                                   dtype, implementation)
                if measure_time and devices <= jax.device_count():
                    row["seconds"] = step_seconds(spec, n, devices, heads, head_dim, batch,
                                                  dtype, implementation)
                rows.append(row)
    return rows
