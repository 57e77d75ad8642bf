"""A Pallas block-sparse flash-attention kernel for the patterns' block terms.

``attention.sparse_attention(..., implementation="pallas")`` runs here; the XLA path in
``attention.py`` and this kernel compute the same thing, term by term, and merge the terms with
the same joint log-sum-exp. Each block term of ``patterns.pattern_terms`` becomes masked
attention between a query sequence and a key sequence in the term's own layout, so that its keys
are a few contiguous blocks per query block:

* ``BandTerm`` (local window, fixed block): the sequence in its own order;
* ``ColumnTerm`` (the strided part): the sequence read column by column of the ``[rows, stride]``
  grid ("strided transpose"), where a column is a contiguous run of ``rows`` positions and the
  strided part becomes causal attention inside each run;
* ``SummaryTerm``: queries in order, keys the summary positions alone, packed.

Every layout position carries two integers, its position ``pos`` and a segment ``seg`` (a grid
row, or a grid column), and a key carries a flag (a summary residue, for a band with residues).
A key is kept iff ``q.pos - k.pos`` and ``q.seg - k.seg`` lie in the term's two ranges and the key
is flagged (``_keep``). The host evaluates that rule on every block pair that can hold a kept
key (NumPy, once per shape) and lists, per query block, the key blocks that hold kept keys, split
into *partial* blocks (the kernel applies the rule in the block) and *full* ones (no mask); per
key block the same for the backward pass (``_block_lists``).

The kernels are flash attention over those lists (``_forward_kernel``: online softmax with float32
accumulators, output and log-sum-exp; ``_dq_kernel`` and ``_dkv_kernel``: the backward from the
saved joint log-sum-exp, a pass per query block for dq and a pass per key block for dk and dv,
FlashAttention-2's split). Inputs are float32, bfloat16 or float16; products accumulate in
float32. The GPU lowering is Triton (block shapes are powers of two: head dims are zero-padded to
one, lengths to the block); on a CPU the kernel runs in Pallas interpret mode, slowly, for
tests. TPU is not supported here (its Mosaic lowering needs scalar-prefetched block lists).
Design: docs/design.md §3.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from sparse_jax import patterns

_NEG = -1e30  # masked score (finite: no NaN in values or gradients)
_FLOOR = -1e20  # start of a row maximum: exp(_NEG - _FLOOR) == 0 for a row with no key yet
_LOG2E = math.log2(math.e)  # the kernels use exp2 on scores scaled by log2(e)
_FAR = 1 << 29  # segment of padding: queries get no key, keys reach no query (int32 safe)
_MASK_TILES = 1 << 24  # tile-mask elements the host evaluates at once when listing blocks


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Kernel tiles: ``block_q`` queries by ``block_k`` keys (powers of two, at least 16 on a
    GPU), and Triton's ``num_warps`` and ``num_stages``. Hashable: a static argument."""
    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"BlockSizes.{name}={value} must be a power of two")


# ---------------------------------------------------------------------------------------------
# A term in its layout.


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One term as masked attention of ``nq`` queries over ``nk`` keys, for a grid of ``n``
    positions (``rows`` rows of ``block``). ``kind``: "rows" (the sequence order), "columns"
    (column by column) or "summary" (queries in order, keys the residues of every row).
    ``distance`` and ``segments``: inclusive ranges (None: unbounded) of ``q.pos - k.pos`` and
    ``q.seg - k.seg``; ``residues``: the flagged keys' offsets in their row (None: all)."""
    kind: str
    rows: int
    block: int
    distance: tuple[int | None, int | None]
    segments: tuple[int, int | None]
    residues: tuple[int, ...] | None = None

    @property
    def n(self) -> int:
        return self.rows * self.block

    @property
    def nk(self) -> int:
        return self.rows * len(self.residues) if self.kind == "summary" else self.n

    def attributes(self):
        """NumPy ``(q_pos, q_seg), (k_pos, k_seg, k_flag)`` of the real positions (int64)."""
        i = np.arange(self.n)
        if self.kind == "columns":  # position r * block + col sits at col * rows + r
            pos, seg = i % self.rows, i // self.rows
            return (pos, seg), (pos, seg, np.ones(self.n, bool))
        q = (i, i // self.block)
        if self.kind == "summary":
            keys = (np.arange(self.rows)[:, None] * self.block + np.array(self.residues)).ravel()
            return q, (keys, keys // self.block, np.ones(len(keys), bool))
        flag = np.ones(self.n, bool) if self.residues is None else np.isin(
            i % self.block, self.residues)
        return q, (i, i // self.block, flag)

    def _grid(self, x):  # [B, H, n, ...] -> [B, H, rows, block, ...]
        return x.reshape(*x.shape[:2], self.rows, self.block, *x.shape[3:])

    def _flat(self, x):
        return x.reshape(*x.shape[:2], -1, *x.shape[4:])

    def queries(self, x):
        """[B, H, n, ...] in sequence order -> the query layout."""
        return self._flat(self._grid(x).swapaxes(2, 3)) if self.kind == "columns" else x

    def queries_back(self, x):
        """Inverse of ``queries``."""
        if self.kind != "columns":
            return x
        t = x.reshape(*x.shape[:2], self.block, self.rows, *x.shape[3:])
        return self._flat(t.swapaxes(2, 3))

    def keys(self, x):
        """[B, H, n, ...] in sequence order -> the key layout."""
        if self.kind == "summary":
            return self._flat(self._grid(x)[:, :, :, np.array(self.residues)])
        return self.queries(x)

    def keys_back(self, g):
        """Gradient in the key layout -> [B, H, n, ...] in sequence order (zeros elsewhere)."""
        if self.kind != "summary":
            return self.queries_back(g)
        s = len(self.residues)
        g = g.reshape(*g.shape[:2], self.rows, s, *g.shape[3:])
        full = jnp.zeros((*g.shape[:3], self.block, *g.shape[4:]), g.dtype)
        return self._flat(full.at[:, :, :, np.array(self.residues)].set(g))


def _layout(term: patterns.Term, rows: int) -> _Layout:
    if isinstance(term, patterns.ColumnTerm):
        return _Layout("columns", rows, term.stride, (term.min_rows, None), (0, 0))
    if isinstance(term, patterns.SummaryTerm):
        return _Layout("summary", rows, term.block, (None, None), (1, None), term.residues)
    return _Layout("rows", rows, term.block, (0, term.max_distance), (0, term.prev),
                   term.residues)


def _keep(layout: _Layout, q_pos, q_seg, k_pos, k_seg, k_flag):
    """The term's mask on broadcastable position arrays (NumPy on the host, jnp in a kernel)."""
    seg = q_seg - k_seg
    keep = (seg >= layout.segments[0]) & (k_flag != 0)
    if layout.segments[1] is not None:
        keep = keep & (seg <= layout.segments[1])
    lo, hi = layout.distance
    if lo is not None or hi is not None:
        distance = q_pos - k_pos
        keep = keep & (distance >= lo) if lo is not None else keep
        keep = keep & (distance <= hi) if hi is not None else keep
    return keep


# ---------------------------------------------------------------------------------------------
# Block lists (host, NumPy).


@dataclasses.dataclass(frozen=True)
class _Lists:
    """Per query block ``forward[qb] = [n_partial, n_full, partial kbs..., full kbs..., 0...]``
    and per key block ``backward[kb]``, the same with query blocks; rows padded to a power of
    two. Padded attributes (int32): ``q_pos, q_seg`` [nqb * bq], ``k_pos, k_seg, k_flag``
    [nkb * bk]. ``kept``: kept (query, key) pairs; ``scored``: pairs in the listed blocks."""
    forward: np.ndarray
    backward: np.ndarray
    q_pos: np.ndarray
    q_seg: np.ndarray
    k_pos: np.ndarray
    k_seg: np.ndarray
    k_flag: np.ndarray
    kept: int
    scored: int


def _pack(owner: np.ndarray, other: np.ndarray, full: np.ndarray, count: int) -> np.ndarray:
    """Rows ``[n_partial, n_full, partial..., full...]`` of each owner block (pairs sorted)."""
    order = np.lexsort((other, full, owner))  # by owner, partial before full, then block
    owner, other, full = owner[order], other[order], full[order]
    per = np.bincount(owner, minlength=count)
    width = 1 << int(1 + per.max(initial=0)).bit_length()  # a power of two >= 2 + max
    rows = np.zeros((count, width), np.int32)
    rows[:, 0] = np.bincount(owner, weights=~full, minlength=count)
    rows[:, 1] = np.bincount(owner, weights=full, minlength=count)
    slot = np.arange(len(owner)) - np.concatenate([[0], np.cumsum(per)[:-1]])[owner]
    rows[owner, 2 + slot] = other
    return rows


def _ranges_meet(a, b, lo, hi):
    """Whether ``x - y`` for x in [a_min, a_max], y in [b_min, b_max] can lie in [lo, hi]
    (a = (min, max) per query block [nqb, 1], b per key block [1, nkb])."""
    meet = np.ones(np.broadcast_shapes(a[0].shape, b[0].shape), bool)
    if lo is not None:
        meet &= a[1] - b[0] >= lo
    if hi is not None:
        meet &= a[0] - b[1] <= hi
    return meet


@functools.lru_cache(maxsize=64)
def _block_lists(layout: _Layout, block_q: int, block_k: int) -> _Lists:
    (q_pos, q_seg), (k_pos, k_seg, k_flag) = layout.attributes()
    nqb, nkb = -(-layout.n // block_q), -(-layout.nk // block_k)

    def padded(x, size, fill):
        return np.concatenate([x, np.full(size - len(x), fill, x.dtype)])

    qp, qs = padded(q_pos, nqb * block_q, 0), padded(q_seg, nqb * block_q, -_FAR)
    kp, ks = padded(k_pos, nkb * block_k, 0), padded(k_seg, nkb * block_k, _FAR)
    kf = padded(k_flag, nkb * block_k, False)

    def bounds(x, real, blocks, size):  # (min, max) of each block's real entries
        x, real = x.reshape(blocks, size), real.reshape(blocks, size)
        return np.where(real, x, 1 << 40).min(1), np.where(real, x, -1 << 40).max(1)

    q_real = np.arange(nqb * block_q) < layout.n
    k_real = kf  # unflagged keys are never kept
    q_b = [tuple(a[:, None] for a in bounds(x, q_real, nqb, block_q)) for x in (qp, qs)]
    k_b = [tuple(a[None, :] for a in bounds(x, k_real, nkb, block_k)) for x in (kp, ks)]
    candidates = (_ranges_meet(q_b[0], k_b[0], *layout.distance)
                  & _ranges_meet(q_b[1], k_b[1], *layout.segments)
                  & k_real.reshape(nkb, block_k).any(1)[None, :])
    qb, kb = np.nonzero(candidates)
    counts = np.zeros(len(qb), np.int64)
    step = max(1, _MASK_TILES // (block_q * block_k))
    tiles = lambda x, b, size: x.reshape(-1, size)[b]  # noqa: E731
    for s in range(0, len(qb), step):
        q, k = qb[s:s + step], kb[s:s + step]
        keep = _keep(layout, tiles(qp, q, block_q)[:, :, None], tiles(qs, q, block_q)[:, :, None],
                     tiles(kp, k, block_k)[:, None, :], tiles(ks, k, block_k)[:, None, :],
                     tiles(kf, k, block_k)[:, None, :])
        counts[s:s + step] = keep.sum((1, 2))
    nonempty = counts > 0
    qb, kb, counts = qb[nonempty], kb[nonempty], counts[nonempty]
    full = counts == block_q * block_k
    as_int32 = lambda x: x.astype(np.int32)  # noqa: E731
    return _Lists(_pack(qb, kb, full, nqb), _pack(kb, qb, full, nkb), as_int32(qp),
                  as_int32(qs), as_int32(kp), as_int32(ks), as_int32(kf),
                  kept=int(counts.sum()), scored=len(qb) * block_q * block_k)


# ---------------------------------------------------------------------------------------------
# The kernels. Refs without a leading batch/head are one (batch, head)'s; scores are scaled by
# log2(e) so that exp2 gives exp.


def _dot(a, b, trans_a=False, trans_b=False):
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _scores(layout, q, k, q_pos, q_seg, attrs, ks, masked):
    """Scores (log2 units) of a query tile against keys ``ks``; masked ones _NEG if ``masked``."""
    k_pos_ref, k_seg_ref, k_flag_ref = attrs
    s = _dot(q, k, trans_b=True) * _LOG2E
    if masked:
        keep = _keep(layout, q_pos[:, None], q_seg[:, None], k_pos_ref[ks][None, :],
                     k_seg_ref[ks][None, :], k_flag_ref[ks][None, :])
        s = jnp.where(keep, s, _NEG)
    return s


def _over_list(list_ref, body, carry):
    """``body(masked)(j, carry)`` over the partial blocks of a list row, then the full ones."""
    n_partial, n_full = list_ref[0], list_ref[1]
    carry = jax.lax.fori_loop(0, n_partial, body(True), carry)
    return jax.lax.fori_loop(n_partial, n_partial + n_full, body(False), carry)


def _forward_kernel(list_ref, q_ref, q_pos_ref, q_seg_ref, k_ref, v_ref, k_pos_ref, k_seg_ref,
                    k_flag_ref, o_ref, lse_ref, *, layout, block_k):
    q, q_pos, q_seg = q_ref[...], q_pos_ref[...], q_seg_ref[...]
    attrs = (k_pos_ref, k_seg_ref, k_flag_ref)

    def body(masked):
        def step(j, carry):
            o, m, total = carry
            ks = pl.ds(pl.multiple_of(list_ref[2 + j] * block_k, block_k), block_k)
            s = _scores(layout, q, k_ref[ks, :], q_pos, q_seg, attrs, ks, masked)
            m_new = jnp.maximum(m, s.max(-1))
            correction = jnp.exp2(m - m_new)
            p = jnp.exp2(s - m_new[:, None])
            v = v_ref[ks, :]
            o = o * correction[:, None] + _dot(p.astype(v.dtype), v)
            return o, m_new, total * correction + p.sum(-1)
        return step

    block_q = q.shape[0]
    o, m, total = _over_list(list_ref, body, (
        jnp.zeros((block_q, o_ref.shape[-1]), jnp.float32),
        jnp.full((block_q,), _FLOOR, jnp.float32), jnp.zeros((block_q,), jnp.float32)))
    o_ref[...] = o / jnp.maximum(total, 1e-30)[:, None]
    lse_ref[...] = jnp.where(total > 0, (m + jnp.log2(jnp.maximum(total, 1e-30))) / _LOG2E,
                             _NEG)


def _dq_kernel(list_ref, q_ref, q_pos_ref, q_seg_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref,
               k_pos_ref, k_seg_ref, k_flag_ref, dq_ref, *, layout, block_k):
    q, q_pos, q_seg, do = q_ref[...], q_pos_ref[...], q_seg_ref[...], do_ref[...]
    lse, delta = lse_ref[...] * _LOG2E, delta_ref[...]
    attrs = (k_pos_ref, k_seg_ref, k_flag_ref)

    def body(masked):
        def step(j, dq):
            ks = pl.ds(pl.multiple_of(list_ref[2 + j] * block_k, block_k), block_k)
            k = k_ref[ks, :]
            p = jnp.exp2(_scores(layout, q, k, q_pos, q_seg, attrs, ks, masked) - lse[:, None])
            ds = p * (_dot(do, v_ref[ks, :], trans_b=True) - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k)
        return step

    dq_ref[...] = _over_list(list_ref, body, jnp.zeros(dq_ref.shape, jnp.float32))


def _dkv_kernel(list_ref, k_ref, v_ref, k_pos_ref, k_seg_ref, k_flag_ref, q_ref, do_ref, lse_ref,
                delta_ref, q_pos_ref, q_seg_ref, dk_ref, dv_ref, *, layout, block_q):
    k, v = k_ref[...], v_ref[...]
    k_pos, k_seg, k_flag = k_pos_ref[...], k_seg_ref[...], k_flag_ref[...]

    def body(masked):
        def step(j, carry):
            dk, dv = carry
            qs = pl.ds(pl.multiple_of(list_ref[2 + j] * block_q, block_q), block_q)
            q, do = q_ref[qs, :], do_ref[qs, :]
            s = _dot(q, k, trans_b=True) * _LOG2E
            if masked:
                keep = _keep(layout, q_pos_ref[qs][:, None], q_seg_ref[qs][:, None],
                             k_pos[None, :], k_seg[None, :], k_flag[None, :])
                s = jnp.where(keep, s, _NEG)
            p = jnp.exp2(s - lse_ref[qs][:, None] * _LOG2E)
            dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
            ds = p * (_dot(do, v, trans_b=True) - delta_ref[qs][:, None])
            return dk + _dot(ds.astype(q.dtype), q, trans_a=True), dv
        return step

    dk, dv = _over_list(list_ref, body, (jnp.zeros(dk_ref.shape, jnp.float32),
                                         jnp.zeros(dv_ref.shape, jnp.float32)))
    dk_ref[...], dv_ref[...] = dk, dv


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers: arrays [B, H, length, d] in a term's layout, padded to the blocks.


@dataclasses.dataclass(frozen=True)
class _Call:
    """How the kernels are compiled: block sizes, and interpret mode (a CPU) or Triton."""
    sizes: BlockSizes
    interpret: bool

    def __call__(self, kernel, grid, in_specs, out_specs, out_shape, name):
        params = {}
        if not self.interpret:
            from jax.experimental.pallas import triton as pl_triton

            params["compiler_params"] = pl_triton.CompilerParams(
                num_warps=self.sizes.num_warps, num_stages=self.sizes.num_stages)
        return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                              out_shape=out_shape, interpret=self.interpret, name=name,
                              **params)


def _tile(block, width=None):
    """BlockSpec of one (batch, head)'s tile ``index`` of ``block`` rows (``width`` columns)."""
    if width is None:
        return pl.BlockSpec((None, None, block), lambda i, b, h: (b, h, i))
    return pl.BlockSpec((None, None, block, width), lambda i, b, h: (b, h, i, 0))


def _attr(block):
    """BlockSpec of tile ``index`` of a position-attribute vector."""
    return pl.BlockSpec((block,), lambda i, b, h: (i,))


def _whole(x):
    """BlockSpec of one (batch, head)'s whole array (or a whole attribute vector)."""
    if x.ndim == 1:
        return pl.BlockSpec(x.shape, lambda i, b, h: (0,))
    if x.ndim == 3:
        return pl.BlockSpec((None, None, x.shape[2]), lambda i, b, h: (b, h, 0))
    return pl.BlockSpec((None, None, *x.shape[2:]), lambda i, b, h: (b, h, 0, 0))


def _row(lists):
    return pl.BlockSpec((None, lists.shape[1]), lambda i, b, h: (i, 0))


def _pallas_forward(call, layout, lists, q, k, v):
    batch, heads, nq, _ = q.shape
    bq, bk = call.sizes.block_q, call.sizes.block_k
    attrs_q = (lists.q_pos, lists.q_seg)
    attrs_k = (lists.k_pos, lists.k_seg, lists.k_flag)
    return call(
        functools.partial(_forward_kernel, layout=layout, block_k=bk),
        grid=(nq // bq, batch, heads),
        in_specs=[_row(lists.forward), _tile(bq, q.shape[3]), _attr(bq), _attr(bq),
                  _whole(k), _whole(v), *(_whole(a) for a in attrs_k)],
        out_specs=[_tile(bq, v.shape[3]), _tile(bq)],
        out_shape=[jax.ShapeDtypeStruct((batch, heads, nq, v.shape[3]), jnp.float32),
                   jax.ShapeDtypeStruct((batch, heads, nq), jnp.float32)],
        name="block_sparse_forward",
    )(lists.forward, q, *attrs_q, k, v, *attrs_k)


def _pallas_backward(call, layout, lists, q, k, v, do, lse, delta):
    batch, heads, nq, _ = q.shape
    nk = k.shape[2]
    bq, bk = call.sizes.block_q, call.sizes.block_k
    attrs_q = (lists.q_pos, lists.q_seg)
    attrs_k = (lists.k_pos, lists.k_seg, lists.k_flag)
    dq = call(
        functools.partial(_dq_kernel, layout=layout, block_k=bk),
        grid=(nq // bq, batch, heads),
        in_specs=[_row(lists.forward), _tile(bq, q.shape[3]), _attr(bq), _attr(bq),
                  _tile(bq, do.shape[3]), _tile(bq), _tile(bq), _whole(k), _whole(v),
                  *(_whole(a) for a in attrs_k)],
        out_specs=_tile(bq, q.shape[3]),
        out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32),
        name="block_sparse_dq",
    )(lists.forward, q, *attrs_q, do, lse, delta, k, v, *attrs_k)
    dk, dv = call(
        functools.partial(_dkv_kernel, layout=layout, block_q=bq),
        grid=(nk // bk, batch, heads),
        in_specs=[_row(lists.backward), _tile(bk, k.shape[3]), _tile(bk, v.shape[3]),
                  _attr(bk), _attr(bk), _attr(bk), _whole(q), _whole(do), _whole(lse),
                  _whole(delta), *(_whole(a) for a in attrs_q)],
        out_specs=[_tile(bk, k.shape[3]), _tile(bk, v.shape[3])],
        out_shape=[jax.ShapeDtypeStruct(k.shape, jnp.float32),
                   jax.ShapeDtypeStruct(v.shape, jnp.float32)],
        name="block_sparse_dkv",
    )(lists.backward, k, v, *attrs_k, q, do, lse, delta, *attrs_q)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# The terms of a pattern, merged; the custom VJP.


def _pad_to(x, length, axis=2):
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)


def _terms(spec, rows, call):
    for term in spec.terms():
        layout = _layout(term, rows)
        yield layout, _block_lists(layout, call.sizes.block_q, call.sizes.block_k)


def _forward(spec, call, q, k, v):
    """Output [B, H, n, dv] and joint log-sum-exp [B, H, n] (float32); q pre-scaled by 1/√d."""
    rows = q.shape[2] // spec.block
    outs, lses = [], []
    for layout, lists in _terms(spec, rows, call):
        o, lse = _pallas_forward(
            call, layout, lists, _pad_to(layout.queries(q), len(lists.q_pos)),
            *(_pad_to(layout.keys(x), len(lists.k_pos)) for x in (k, v)))
        outs.append(layout.queries_back(o[:, :, :layout.n]))
        lses.append(layout.queries_back(lse[:, :, :layout.n]))
    lse_max = functools.reduce(jnp.maximum, lses)
    weights = [jnp.exp(lse - lse_max) for lse in lses]
    total = sum(weights)
    out = sum(w[..., None] * o for w, o in zip(weights, outs)) / total[..., None]
    return out, lse_max + jnp.log(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(spec, call, q, k, v):
    return _forward(spec, call, q, k, v)[0]


def _attention_fwd(spec, call, q, k, v):
    out, lse = _forward(spec, call, q, k, v)
    return out, (q, k, v, out, lse)


def _attention_bwd(spec, call, residuals, d_out):
    q, k, v, out, lse = residuals
    rows = q.shape[2] // spec.block
    d_out = d_out.astype(jnp.float32)
    delta = (d_out * out).sum(-1)
    lse = jnp.where(lse > _NEG / 2, lse, -_NEG)  # a row with no key: every probability 0
    do = d_out.astype(v.dtype)
    grads = [jnp.zeros(x.shape, jnp.float32) for x in (q, k, v)]
    for layout, lists in _terms(spec, rows, call):
        nq, nk = len(lists.q_pos), len(lists.k_pos)
        q_l, do_l, lse_l, delta_l = (_pad_to(layout.queries(x), nq) for x in (q, do, lse, delta))
        k_l, v_l = (_pad_to(layout.keys(x), nk) for x in (k, v))
        dq, dk, dv = _pallas_backward(call, layout, lists, q_l, k_l, v_l, do_l, lse_l, delta_l)
        grads[0] += layout.queries_back(dq[:, :, :layout.n])
        grads[1] += layout.keys_back(dk[:, :, :layout.nk])
        grads[2] += layout.keys_back(dv[:, :, :layout.nk])
    return tuple(g.astype(x.dtype) for g, x in zip(grads, (q, k, v)))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _pow2(x, minimum=16):
    """Zero-pad the head dimension to a power of two (Triton's tiles); exact for q·k and v."""
    return _pad_to(x, max(minimum, pl.next_power_of_2(x.shape[-1])), axis=3)


def sequence_attention(spec: patterns.PatternSpec, q, k, v, *, sizes: BlockSizes | None = None,
                       interpret: bool | None = None, return_lse: bool = False):
    """``softmax(q kᵀ + mask) v`` for the pattern on arrays [B, H, n, d] with n a multiple of
    ``spec.block`` and q already scaled by 1/√d; returns [B, H, n, dv] float32 (differentiable),
    or with ``return_lse`` also the log-sum-exp of each row's kept scores [B, H, n] (a row with
    no key: -1e30; not differentiable). ``interpret`` (default: not on a GPU) runs the kernels
    in Pallas interpret mode."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    call = _Call(sizes or BlockSizes(), interpret)
    dv = v.shape[-1]
    if return_lse:
        out, lse = _forward(spec, call, _pow2(q), _pow2(k), _pow2(v))
        return out[..., :dv], lse
    return _attention(spec, call, _pow2(q), _pow2(k), _pow2(v))[..., :dv]


def sparsity(spec: patterns.PatternSpec, seq_len: int, sizes: BlockSizes | None = None) -> dict:
    """Kept and scored (query, key) pairs of the kernel's block lists at ``seq_len`` (padded to
    the grid): ``kept / scored`` is the share of tile work that is useful."""
    sizes = sizes or BlockSizes()
    rows = -(-seq_len // spec.block)
    kept = scored = 0
    for term in spec.terms():
        lists = _block_lists(_layout(term, rows), sizes.block_q, sizes.block_k)
        kept, scored = kept + lists.kept, scored + lists.scored
    return {"kept": kept, "scored": scored}
