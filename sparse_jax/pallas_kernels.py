"""The Pallas kernels behind ``sparse_jax.kernel``: block-sparse flash attention over block lists,
for GPUs (Triton lowering) and TPUs (Mosaic lowering), and either in interpret mode on a CPU.

They know nothing of patterns. A term arrives as

* ``keep(q_pos, q_seg, k_pos, k_seg, k_flag)``: its mask on broadcastable int32 arrays;
* ``Lists``: per query block the key blocks to visit, per key block the query blocks (rows
  ``[n_partial, n_full, partial blocks..., full blocks..., 0...]``: partial blocks apply
  ``keep``, full ones need no mask), and the position attributes, queries ``[Nq, 1]`` and keys
  ``[1, Nk]``;
* arrays ``[B, H, length, d]`` padded to the tiles; log-sum-exp and ``delta = dO·O`` as
  ``[B, H, Nq, 1]`` float32.

``forward`` returns each query's output (float32) and log-sum-exp over the kept keys (-1e30 for
a query with none); ``backward`` the float32 gradients for a joint log-sum-exp, in two passes:
dq per query block, dk and dv per key block (FlashAttention-2's split). Both backends share the
tile math (``_scores``, ``_online``, ``_finish``, ``_grads``). On a GPU a program owns a tile of
one head or of ``heads_per_program`` heads and walks its list in a loop, loading key tiles from
the whole K/V (``_gpu_*``); there the arrays may also stay in sequence order, a term's tiles
addressed by ``Rows`` (a grid column's tile: one strided load), and a pass may resume from the
earlier terms' float32 partial results and write its outputs in any dtype (``kernel``'s chained
variant). On a TPU the list
is a grid axis: the lists are prefetched into scalar memory, the index maps pick each step's
block (so the pipeline fetches only listed tiles) and the running softmax lives in VMEM scratch
(``_tpu_*``), as in splash attention.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

NEG = -1e30  # masked score (finite: no NaN in values or gradients)
FLOOR = -1e20  # start of a row maximum: exp(NEG - FLOOR) == 0 for a row with no key yet
BACKENDS = ("triton", "mosaic")  # GPU, TPU
PLATFORMS = ("cpu", "gpu", "tpu")
_TARGET = contextvars.ContextVar("sparse_jax_target_platform", default=None)


def target_platform() -> str:
    """The platform the programs traced now are built for: "cpu", "gpu" or "tpu". JAX's default
    backend, unless ``compiling_for`` names another. It picks the attention implementation
    ("auto"), the kernels' backend and whether they compile or run in interpret mode."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str):
    """Trace for ``platform`` ("gpu", "tpu" or "cpu") whatever this process's devices are: a
    deviceless compile for an H100 or a TPU from a CPU host (``scripts/compile_report.py``)
    builds the Triton or Mosaic kernels as the device would, not interpret mode."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} is not one of {', '.join(PLATFORMS)}")
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


@dataclasses.dataclass(frozen=True)
class Lists:
    """A term's block lists and padded position attributes (see the module docstring)."""
    forward: np.ndarray  # [query blocks, width]
    backward: np.ndarray  # [key blocks, width]
    q_attrs: tuple[np.ndarray, ...]  # q_pos, q_seg: int32 [Nq, 1]
    k_attrs: tuple[np.ndarray, ...]  # k_pos, k_seg, k_flag: int32 [1, Nk]


@dataclasses.dataclass(frozen=True)
class Compiler:
    """How the kernels are built: ``backend`` "triton" or "mosaic", Pallas interpret mode or
    not, tiles of ``block_q`` queries by ``block_k`` keys, and Triton's warps and stages."""
    backend: str
    interpret: bool
    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    heads_per_program: int = 1
    one_loop: bool = False
    band: int = 0  # band kernels' block rows (kernel.BlockSizes.band; 0: none)
    band_group: int = 16  # band kernels' blocks a grid step


# ---------------------------------------------------------------------------------------------
# Tile math, shared by the backends. Row statistics are [block, 1].


def _dot(a, b, trans_a=False, trans_b=False):
    a = a.T if trans_a else a
    dims = ((1,), (1,) if trans_b else (0,))
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _scores(keep, q, k, q_attrs, k_attrs, masked):
    """Scores of a query tile against a key tile; masked ones NEG if ``masked`` (a bool, or a
    traced flag: the mask applied to every block, kept whole where the flag is False)."""
    s = _dot(q, k, trans_b=True)
    if masked is False:
        return s
    kept = keep(*q_attrs, *k_attrs)
    return jnp.where(kept if masked is True else kept | ~masked, s, NEG)


def _online(s, o, m, total, v):
    """One key tile of the online softmax: the running output, row maximum and sum updated."""
    m_new = jnp.maximum(m, s.max(-1, keepdims=True))
    correction = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    return (o * correction + _dot(p.astype(v.dtype), v), m_new,
            total * correction + p.sum(-1, keepdims=True))


def _start(block, width):
    return (jnp.zeros((block, width), jnp.float32), jnp.full((block, 1), FLOOR, jnp.float32),
            jnp.zeros((block, 1), jnp.float32))


def _finish(o, m, total):
    """Output and log-sum-exp (NEG for a row with no key, whose output is 0)."""
    safe = jnp.maximum(total, 1e-30)
    return o / safe, jnp.where(total > 0, m + jnp.log(safe), NEG)


def _grads(s, lse, delta, do, v):
    """Probabilities and score gradients of a tile, given the joint log-sum-exp."""
    p = jnp.exp(s - lse)
    return p, p * (_dot(do, v, trans_b=True) - delta)


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
    """The running state of a partial result (output normalised, log-sum-exp NEG: no key)."""
    seen = lse > NEG / 2
    return o, jnp.where(seen, lse, FLOOR), seen.astype(jnp.float32)


def _gpu_forward(list_ref, qp_ref, qs_ref, kp_ref, ks_ref, kf_ref, q_ref, k_ref, v_ref, *refs,
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
        return tuple(_online(_scores(keep, qs[g], get(k_ref, g, t), q_attrs, k_attrs, masked),
                             *carry[g], get(v_ref, g, t)) for g in heads)

    start = tuple(_resume(get(refs[0], g, rows), get(refs[1], g, rows)) if resume else
                  _start(qs[g].shape[0], o_ref.shape[-1]) for g in heads)
    for g, carry in enumerate(_gpu_over_list(list_ref, step, start, one_loop)):
        o, lse = _finish(*carry)
        put(o_ref, g, rows, o.astype(o_ref.dtype))
        put(lse_ref, g, rows, lse)


def _gpu_dq(list_ref, qp_ref, qs_ref, kp_ref, ks_ref, kf_ref, q_ref, do_ref, lse_ref, delta_ref,
            k_ref, v_ref, *refs, keep, own, listed, resume, one_loop, seq_major, interpret):
    """dq of the program's query tile (``_gpu_forward``'s conventions; resume: dq so far)."""
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
            s = _scores(keep, qs[g], k, q_attrs, k_attrs, masked)
            ds = _grads(s, lses[g], deltas[g], dos[g], get(v_ref, g, t))[1]
            out.append(carry[g] + _dot(ds.astype(k.dtype), k))
        return tuple(out)

    start = tuple(get(refs[0], g, rows) if resume else jnp.zeros(qs[g].shape, jnp.float32)
                  for g in heads)
    for g, dq in enumerate(_gpu_over_list(list_ref, step, start, one_loop)):
        put(dq_ref, g, rows, dq.astype(dq_ref.dtype))


def _gpu_dkv(list_ref, qp_ref, qs_ref, kp_ref, ks_ref, kf_ref, k_ref, v_ref, q_ref, do_ref,
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
            s = _scores(keep, q, ks[g], q_attrs, k_attrs, masked)
            p, ds = _grads(s, get(lse_ref, g, t), get(delta_ref, g, t), do, vs[g])
            out.append((carry[g][0] + _dot(ds.astype(q.dtype), q, trans_a=True),
                        carry[g][1] + _dot(p.astype(do.dtype), do, trans_a=True)))
        return tuple(out)

    start = tuple((get(refs[0], g, rows), get(refs[1], g, rows)) if resume else
                  (jnp.zeros(ks[g].shape, jnp.float32), jnp.zeros(vs[g].shape, jnp.float32))
                  for g in heads)
    for g, (dk, dv) in enumerate(_gpu_over_list(list_ref, step, start, one_loop)):
        put(dk_ref, g, rows, dk.astype(dk_ref.dtype))
        put(dv_ref, g, rows, dv.astype(dv_ref.dtype))


def _gpu_call(compiler, kernel, lists, block, inputs, out, name, seq_major=False,
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
    s = _dot(q, k, trans_b=True)
    return s if kept is None else jnp.where(kept, s, NEG)


# Refs of data arrays carry the step's heads first ([heads, tile, d]): a step serves
# ``Compiler.heads_per_program`` heads, one block list, one mask, so that the per-step cost of
# the grid is paid once for them all.


def _tpu_forward(lists_ref, q_ref, qp_ref, qs_ref, k_ref, v_ref, kp_ref, ks_ref, kf_ref, o_ref,
                 lse_ref, o_scr, m_scr, t_scr, *, keep, width):
    scratch = (o_scr, m_scr, t_scr)
    heads = range(q_ref.shape[0])

    def start():
        for ref, x in zip(scratch, _start(*o_scr.shape[1:])):
            ref[...] = jnp.broadcast_to(x, ref.shape)

    def step(masked):
        kept = _tpu_keep(keep, (qp_ref, qs_ref), (kp_ref, ks_ref, kf_ref), masked)
        for g in heads:
            s = _tpu_scores(q_ref[g], k_ref[g], kept)
            for ref, x in zip(scratch, _online(s, *(r[g] for r in scratch), v_ref[g])):
                ref[g] = x

    def end():
        for g in heads:
            o_ref[g], lse_ref[g] = _finish(*(r[g] for r in scratch))

    _tpu_steps(lists_ref, width, start, step, end)


def _tpu_dq(lists_ref, q_ref, qp_ref, qs_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, kp_ref,
            ks_ref, kf_ref, dq_ref, dq_scr, *, keep, width):
    heads = range(q_ref.shape[0])

    def step(masked):
        kept = _tpu_keep(keep, (qp_ref, qs_ref), (kp_ref, ks_ref, kf_ref), masked)
        for g in heads:
            k = k_ref[g]
            s = _tpu_scores(q_ref[g], k, kept)
            ds = _grads(s, lse_ref[g], delta_ref[g], do_ref[g], v_ref[g])[1]
            dq_scr[g] += _dot(ds.astype(k.dtype), k)

    def start():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    def end():
        dq_ref[...] = dq_scr[...]

    _tpu_steps(lists_ref, width, start, step, end)


def _tpu_dkv(lists_ref, k_ref, v_ref, kp_ref, ks_ref, kf_ref, q_ref, do_ref, lse_ref, delta_ref,
             qp_ref, qs_ref, dk_ref, dv_ref, dk_scr, dv_scr, *, keep, width):
    heads = range(k_ref.shape[0])

    def step(masked):
        kept = _tpu_keep(keep, (qp_ref, qs_ref), (kp_ref, ks_ref, kf_ref), masked)
        for g in heads:
            q, do = q_ref[g], do_ref[g]
            s = _tpu_scores(q, k_ref[g], kept)
            p, ds = _grads(s, lse_ref[g], delta_ref[g], do, v_ref[g])
            dk_scr[g] += _dot(ds.astype(q.dtype), q, trans_a=True)
            dv_scr[g] += _dot(p.astype(do.dtype), do, trans_a=True)

    def start():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    def end():
        dk_ref[...], dv_ref[...] = dk_scr[...], dv_scr[...]

    _tpu_steps(lists_ref, width, start, step, end)


def _tpu_call(compiler, kernel, lists, own, listed, listed_block, out, scratch, name,
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
# The passes.


def cost(pass_: str, table: np.ndarray, block_q: int, block_k: int, heads: int, d: int,
         dv: int, itemsize: int, out_itemsize: int = 4, extra_bytes: int = 0) -> pl.CostEstimate:
    """The work of one pass ("forward", "dq" or "dkv") over a term's block list ``table``
    (``Lists.forward``, or ``Lists.backward`` for dkv), for ``heads`` (batch × heads) of
    query/key dim ``d`` and value dim ``dv``, as XLA's cost analysis should see it: per visited
    tile of ``block_q`` × ``block_k`` its matrix products (2 flops a multiply-add) and
    exponentials; bytes: the program's own tiles read and its outputs written once, the listed
    tiles read at every visit (inputs ``itemsize`` bytes, outputs ``out_itemsize``, float32
    statistics, int32 position attributes), plus ``extra_bytes`` (partial results resumed)."""
    visits = int(table[:, 0].sum() + table[:, 1].sum())
    programs = table.shape[0]
    pairs = visits * block_q * block_k
    if pass_ == "forward":  # s = q k^T, o += p v
        flops = 2 * pairs * (d + dv)
        own = block_q * (d * itemsize + 2 * 4) + block_q * (dv * out_itemsize + 4)
        listed = block_k * ((d + dv) * itemsize + 3 * 4)
    elif pass_ == "dq":  # s, dp = do v^T, dq += ds k
        flops = 2 * pairs * (2 * d + dv)
        own = block_q * ((d + dv) * itemsize + 4 * 4) + block_q * d * out_itemsize
        listed = block_k * ((d + dv) * itemsize + 3 * 4)
    elif pass_ == "dkv":  # s, dp, dk += ds^T q, dv += p^T do
        flops = 4 * pairs * (d + dv)
        own = block_k * ((d + dv) * itemsize + 3 * 4) + block_k * (d + dv) * out_itemsize
        listed = block_q * ((d + dv) * itemsize + 4 * 4)
    else:
        raise ValueError(f"pass {pass_!r} is not forward, dq or dkv")
    return pl.CostEstimate(flops=heads * flops, transcendentals=heads * pairs,
                           bytes_accessed=heads * (programs * own + visits * listed)
                           + int(extra_bytes))


def _nbytes(arrays) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in arrays)


def _name(kernel, tag):
    return f"{kernel}_{tag}" if tag else kernel


def _gpu_inputs(q_attrs, k_attrs, tiled_attrs, data, rows, init):
    """``_gpu_call``'s inputs: the attributes (q's and k's tiled as ``tiled_attrs`` says: the
    program's own side), the (array, own side) data, own ones tiled unless ``rows`` addresses
    them in whole arrays, then ``init`` (whole)."""
    attrs = [(x, tiled) for tiled, xs in zip(tiled_attrs, (q_attrs, k_attrs)) for x in xs]
    return [*attrs, *((x, rows is None and own) for x, own in data), *((x, False) for x in init)]


def _only_triton(compiler, rows, init, dtype, seq_major):
    if compiler.backend != "triton" and (rows is not None or init or dtype != jnp.float32
                                         or seq_major):
        raise ValueError(f"chained terms and sequence-major arrays need the Triton backend, "
                         f"not {compiler.backend}")


def _dims(x, seq_major):
    """(batch, heads, length) of a data array, and the shape of one like it."""
    batch, heads, length = (x.shape[0], x.shape[2], x.shape[1]) if seq_major else x.shape[:3]
    return (batch, heads, length), lambda n, d: ((batch, n, heads, d) if seq_major
                                                 else (batch, heads, n, d))


def forward(compiler: Compiler, keep, lists: Lists, q, k, v, *, rows=None, init=(),
            dtype=jnp.float32, seq_major=False, tag=""):
    """Output [B, H, Nq, dv] (``dtype``) and log-sum-exp [B, H, Nq, 1] (float32) of one term.
    By default q, k, v are in the term's layout; with ``rows`` = (query ``Rows``, key ``Rows``)
    the tiles are read (and the outputs written) where those say, e.g. strided in sequence
    order. ``init``: (o, lse) of the earlier terms, float32 where the outputs go, to resume the
    online softmax from; ``seq_major``: every array [B, N, H, ...] instead (Triton only).
    ``tag`` names the kernel after its term (``sparse_forward_columns``), as profilers and
    compilers' logs show it."""
    _only_triton(compiler, rows, init, dtype, seq_major)
    (batch, heads, nq), like = _dims(q, seq_major)
    bq, bk = compiler.block_q, compiler.block_k
    work = cost("forward", lists.forward, bq, bk, batch * heads, q.shape[-1], v.shape[-1],
                q.dtype.itemsize, jnp.dtype(dtype).itemsize, _nbytes(init))
    if compiler.backend == "triton":
        own, listed = rows or (None, Rows(bk))
        out = [(like(nq, v.shape[3]), dtype, rows is None),
               (like(nq, 1), jnp.float32, rows is None)]
        inputs = _gpu_inputs(lists.q_attrs, lists.k_attrs, (True, False),
                             [(q, True), (k, False), (v, False)], rows, init)
        kernel = functools.partial(_gpu_forward, keep=keep, own=own, listed=listed,
                                   resume=bool(init), one_loop=compiler.one_loop,
                                   seq_major=seq_major, interpret=compiler.interpret)
        return _gpu_call(compiler, kernel, lists.forward, bq, inputs, out,
                         _name("sparse_forward", tag), seq_major, work)
    out = [((batch, heads, nq, v.shape[3]), bq), ((batch, heads, nq, 1), bq)]
    own, listed = [q, *lists.q_attrs], [k, v, *lists.k_attrs]
    kernel = functools.partial(_tpu_forward, keep=keep, width=lists.forward.shape[1])
    return _tpu_call(compiler, kernel, lists.forward, own, listed, bk, out,
                     [(bq, v.shape[3]), (bq, 1), (bq, 1)], _name("sparse_forward", tag), work)


def backward(compiler: Compiler, keep, lists: Lists, q, k, v, do, lse, delta, *, rows=None,
             init=((), ()), dtype=jnp.float32, seq_major=False, tag=""):
    """Gradients (``dtype``) of one term's share of the output for the joint ``lse``; ``rows``
    and ``seq_major`` as ``forward``'s, ``init``: (dq,) and (dk, dv) so far (float32, where the
    outputs go) to add to, or empty tuples (Triton only); ``tag`` as ``forward``'s."""
    _only_triton(compiler, rows, init[0] + init[1], dtype, seq_major)
    (batch, heads, nq), like = _dims(q, seq_major)
    nk = k.shape[1 if seq_major else 2]
    bq, bk = compiler.block_q, compiler.block_k
    sizes = (batch * heads, q.shape[-1], v.shape[-1], q.dtype.itemsize, jnp.dtype(dtype).itemsize)
    dq_work = cost("dq", lists.forward, bq, bk, *sizes, _nbytes(init[0]))
    dkv_work = cost("dkv", lists.backward, bq, bk, *sizes, _nbytes(init[1]))
    if compiler.backend == "triton":
        q_rows, k_rows = rows or (None, None)
        tiled = rows is None
        common = dict(keep=keep, one_loop=compiler.one_loop, seq_major=seq_major,
                      interpret=compiler.interpret)
        dq_inputs = _gpu_inputs(lists.q_attrs, lists.k_attrs, (True, False), [
            (q, True), (do, True), (lse, True), (delta, True), (k, False), (v, False)],
            rows, init[0])
        dq = _gpu_call(compiler, functools.partial(
            _gpu_dq, own=q_rows, listed=k_rows or Rows(bk), resume=bool(init[0]), **common),
            lists.forward, bq, dq_inputs, [(like(nq, q.shape[3]), dtype, tiled)],
            _name("sparse_dq", tag), seq_major, dq_work)[0]
        dkv_inputs = _gpu_inputs(lists.q_attrs, lists.k_attrs, (False, True), [
            (k, True), (v, True), (q, False), (do, False), (lse, False), (delta, False)],
            rows, init[1])
        dk, dv = _gpu_call(compiler, functools.partial(
            _gpu_dkv, own=k_rows, listed=q_rows or Rows(bq), resume=bool(init[1]), **common),
            lists.backward, bk, dkv_inputs, [(like(nk, k.shape[3]), dtype, tiled),
                                            (like(nk, v.shape[3]), dtype, tiled)],
            _name("sparse_dkv", tag), seq_major, dkv_work)
        return dq, dk, dv
    dq_out = [((batch, heads, nq, q.shape[3]), bq)]
    dkv_out = [((batch, heads, nk, k.shape[3]), bk), ((batch, heads, nk, v.shape[3]), bk)]
    dq_own = [q, *lists.q_attrs, do, lse, delta]
    dkv_listed = [q, do, lse, delta, *lists.q_attrs]
    key_side = [k, v, *lists.k_attrs]
    dq = _tpu_call(compiler, functools.partial(_tpu_dq, keep=keep, width=lists.forward.shape[1]),
                   lists.forward, dq_own, key_side, bk, dq_out, [(bq, q.shape[3])],
                   _name("sparse_dq", tag), dq_work)[0]
    dk, dv = _tpu_call(
        compiler, functools.partial(_tpu_dkv, keep=keep, width=lists.backward.shape[1]),
        lists.backward, key_side, dkv_listed, bq, dkv_out,
        [(bk, k.shape[3]), (bk, v.shape[3])], _name("sparse_dkv", tag), dkv_work)
    return dq, dk, dv


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
    """One pass's band plan (``kernel._band``): own blocks of ``tile`` rows, windows of
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
    return rows, k, v, jnp.where(mask_ref[index] != 0, _dot(q_ref[rows, :], k, trans_b=True),
                                 NEG)


def _tpu_band_forward(meta_ref, q_ref, k_ref, v_ref, mask_ref, o_ref, lse_ref, *, band):
    for g in range(band.group):
        rows, _, v, s = _band_scores(meta_ref, band, g, q_ref, k_ref, v_ref, mask_ref)
        m = jnp.maximum(s.max(-1, keepdims=True), FLOOR)
        p = jnp.exp(s - m)
        o, lse = _finish(_dot(p.astype(v.dtype), v), m, p.sum(-1, keepdims=True))
        o_ref[rows, :] = o.astype(o_ref.dtype)
        lse_ref[:, rows] = jnp.broadcast_to(lse, (band.tile, 128)).T[:1]  # lane-dense


def _tpu_band_dq(meta_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, mask_ref, dq_ref, *,
                 band):
    for g in range(band.group):
        rows, k, v, s = _band_scores(meta_ref, band, g, q_ref, k_ref, v_ref, mask_ref)
        ds = _grads(s, _column(lse_ref, rows), _column(delta_ref, rows), do_ref[rows, :], v)[1]
        dq_ref[rows, :] = _dot(ds.astype(k.dtype), k).astype(dq_ref.dtype)


def _tpu_band_dkv(meta_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, mask_ref, dk_ref,
                  dv_ref, *, band):
    """Scores transposed ([own keys, window queries]): the window's log-sum-exp and delta stay
    lane-dense rows, and dk, dv are plain products."""
    size, window = band.tile, band.width * band.tile
    for g in range(band.group):
        offset, index = _band_own(meta_ref, band, g)
        rows, near = pl.ds(g * size, size), pl.ds(offset, window)
        q, do, k, v = q_ref[near, :], do_ref[near, :], k_ref[rows, :], v_ref[rows, :]
        s = jnp.where(mask_ref[index] != 0, _dot(k, q, trans_b=True), NEG)
        p = jnp.exp(s - lse_ref[:, near])
        ds = p * (_dot(v, do, trans_b=True) - delta_ref[:, near])
        dk_ref[rows, :] = _dot(ds.astype(q.dtype), q).astype(dk_ref.dtype)
        dv_ref[rows, :] = _dot(p.astype(do.dtype), do).astype(dv_ref.dtype)


def _band_call(compiler, kernel, band, own, windowed, out, name, cost_estimate=None):
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


def _band_cost(pass_, band, heads, d, dv, itemsize):
    """``cost`` of a band pass: every own block scores its whole window."""
    blocks = band.steps * band.group
    table = np.zeros((blocks, 2 + band.width), np.int64)
    table[:, 0] = band.width  # as if each own block listed its window's blocks
    return cost(pass_, table, band.tile, band.tile, heads, d, dv, itemsize)


def band_forward(compiler: Compiler, band: Band, q, k, v, *, tag=""):
    """``forward`` of a band term (``Band``; arrays [B, H, N, d] in the term's layout, N the
    own blocks' rows): output [B, H, N, dv] in v's dtype and log-sum-exp [B, H, 1, N] (float32,
    lane-dense)."""
    batch, heads, n = q.shape[:3]
    work = _band_cost("forward", band, batch * heads, q.shape[3], v.shape[3], q.dtype.itemsize)
    return _band_call(compiler, _tpu_band_forward, band, [q], [k, v],
                      [((batch, heads, n, v.shape[3]), v.dtype),
                       ((batch, heads, 1, n), jnp.float32)],
                      _name("sparse_band_forward", tag), work)


def band_backward(compiler: Compiler, bands: tuple[Band, Band], q, k, v, do, lse, delta, *,
                  tag=""):
    """``backward`` of a band term, gradients in the inputs' dtypes: ``bands`` the query-side
    plan (dq) and the key-side one (dk, dv, its masks [keys, window queries]); ``lse`` and
    ``delta`` lane-dense, [B, H, 1, N]."""
    batch, heads, n = q.shape[:3]
    sizes = (batch * heads, q.shape[3], v.shape[3], q.dtype.itemsize)
    dq = _band_call(compiler, _tpu_band_dq, bands[0], [q, do, lse, delta], [k, v],
                    [((batch, heads, n, q.shape[3]), q.dtype)], _name("sparse_band_dq", tag),
                    _band_cost("dq", bands[0], *sizes))[0]
    dk, dv = _band_call(compiler, _tpu_band_dkv, bands[1], [k, v], [q, do, lse, delta],
                        [((batch, heads, n, k.shape[3]), k.dtype),
                         ((batch, heads, n, v.shape[3]), v.dtype)],
                        _name("sparse_band_dkv", tag), _band_cost("dkv", bands[1], *sizes))
    return dq, dk, dv
