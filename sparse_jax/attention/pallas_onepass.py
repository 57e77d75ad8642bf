"""The one-pass variant of the GPU kernels (``BlockSizes.variant="onepass"``, Triton): the
chained variant's terms (``fused._chain``: the column term read with strided loads from the
sequence-order arrays, the band term resuming from its partial results) on a persistent grid,
with the backward's two passes in one kernel and nothing left to XLA between the kernels.

* **A persistent grid.** A kernel launches one program per resident slot (``programs``: the
  SMs times the blocks an SM holds, as the deviceless compile reports them), and each program
  walks its share of the work items (an item: one query or key tile of one batch row and one
  head), item ``pid``, ``pid + P``, ``pid + 2P``, ... A program's fixed cost is paid once a
  slot, not once an item, and one head is live at a time (a loop over items, not register-
  resident copies): no register grows with the heads.
* **Both passes of the backward in one kernel.** Per term, the items of the dq pass (query
  tiles walking their key tiles) and of the dk/dv pass (key tiles walking their query tiles)
  share one grid: they write different arrays, so no item waits for another. The column
  term's kernel writes float32 partial gradients; the band term's resumes from them and writes
  the inputs' dtype (the chained variant's order), so a column key's dk and dv need no
  separate sweep and no merge.
* **Or each backward tile visited once** (option ``atomic``, ``BlockSizes.atomic_dq``): the
  dk/dv items alone, each visit adding its share of dq atomically to a float32 dq (XLA's
  zeros, then the earlier term's dq; cast to the inputs' dtype by XLA after the last term).
  The dq items' second walk over the same tiles is gone, for two XLA kernels and an atomic
  add a tile; dq's sum then depends on the order the adds land (not bit-reproducible).
* **No XLA between the kernels.** ``delta = rowsum(dO · O)`` is computed where a tile of dO
  is read (own query tiles in the dq items, listed ones in the dk/dv items), a row with no
  key (log-sum-exp ``tiles.NEG``) is handled where the log-sum-exp is read, q is scaled by
  1/√d where it is loaded (and dq scaled back), and a term whose keys are all flagged takes
  no array of flags.

The forward stays two kernels: the band term's output needs the column term's partial
softmax for the same queries, whose tiles lie across the grid (strided) where the band's lie
along it, so one program cannot hold both. Four kernels for a two-term pattern (strided),
two for a one-term one (local, a single part); a pattern with a summary term (fixed) is
refused (``fused.check_onepass``): its packed keys are the chained variant's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sparse_jax.attention import tiles
from sparse_jax.attention.pallas_gpu import Rows

SMS = 132  # an H100's or H200's SMs: the grid of a deviceless compile (no device to ask)
# Programs an SM holds of each kernel (64 x 64 tiles, 4 warps, one stage: option s1): the
# forward's 3 (165 registers), the backward's 2 (243-248; 255 with option atomic), as the
# deviceless compile for sm_90a reports them (docs/benchmarks/compiled_h100/onepass;
# tests/test_compiled.py checks the grid against them). With two stages the forward holds 2
# and the backward spills.
BLOCKS_PER_SM = {"forward": 3, "backward": 2}
INTERPRET_PROGRAMS = 3  # interpret mode: a few programs, each walking several items


def option(option: str) -> tuple[tuple[str, ...], tuple] | None:
    """``BlockSizes.parse``'s option of these kernels: ``atomic`` (``BlockSizes.atomic_dq``:
    the backward's dk/dv items add dq atomically, its dq items gone; so do the gathered
    kernels' dk/dv programs, ``pallas_gathered``), or None for another."""
    return (("atomic_dq",), (True,)) if option == "atomic" else None


def check_options(sizes) -> None:
    """ValueError (one line) for ``BlockSizes.atomic_dq`` not a bool, or without the onepass
    variant or the gathered kernels (``pallas_gathered``; no other kernel reads it)."""
    if sizes.atomic_dq is not False and (sizes.atomic_dq is not True or (
            sizes.variant != "onepass" and sizes.gathered is not True)):
        raise ValueError(f"BlockSizes.atomic_dq={sizes.atomic_dq!r} (option atomic) needs the "
                         f"onepass variant, not {sizes.variant!r}, or option gathered: give "
                         "onepass:atomic or chained:gathered:atomic")


def sm_count() -> int:
    """The SMs of this process's GPU, or ``SMS`` where there is none (a deviceless compile)."""
    if jax.default_backend() == "gpu":
        count = getattr(jax.devices()[0], "core_count", None)
        if count:
            return int(count)
    return SMS


def programs(compiler: tiles.Compiler, pass_: str, items: int) -> int:
    """The persistent grid of a kernel: a program per resident slot, at most one per item."""
    if compiler.interpret:
        return max(1, min(items, INTERPRET_PROGRAMS))
    return max(1, min(items, sm_count() * BLOCKS_PER_SM[pass_]))


@dataclasses.dataclass(frozen=True)
class Term:
    """One term as the kernels read it: its mask rule, block lists (``tiles.Lists``) and the
    ``Rows`` of its query and key tiles in the sequence-order arrays."""
    keep: object
    lists: tiles.Lists
    own_q: Rows
    own_k: Rows

    @property
    def flagged(self) -> bool:
        """Whether some key is unflagged; if none is, the kernels take no flags (an array of
        ones would be an XLA kernel of its own)."""
        return not self.lists.k_attrs[2].all()

    def attrs(self):
        """The position attributes the kernels take: q's two, k's two or three."""
        return [*self.lists.q_attrs, *self.lists.k_attrs[:3 if self.flagged else 2]]


def _access(seq_major, interpret):
    """``get(ref, b, h, rows)`` and ``put(ref, b, h, rows, x)``: batch row b, head h, ``rows``
    of a [B, H, N, d] ref ([B, N, H, d] if ``seq_major``). Interpret mode takes no integer
    beside a strided slice, so there b and h are size-1 slices, reshaped away."""
    def index(b, h, rows):
        b, h = (pl.ds(b, 1), pl.ds(h, 1)) if interpret else (b, h)
        return (b, rows, h, slice(None)) if seq_major else (b, h, rows, slice(None))

    def get(ref, b, h, rows):
        x = ref[index(b, h, rows)]
        return x.reshape(x.shape[-3 if seq_major else -2], x.shape[-1]) if interpret else x

    def put(ref, b, h, rows, x, add=False):
        if interpret:
            x = x.reshape((1, x.shape[0], 1, x.shape[1]) if seq_major else (1, 1, *x.shape))
        if add and not interpret:  # added atomically: the programs run side by side
            from jax.experimental.pallas import triton as pl_triton

            pl_triton.atomic_add(ref, index(b, h, rows), x)
        elif add:  # interpret mode runs them one by one (and its atomic ignores a stride)
            ref[index(b, h, rows)] += x
        else:
            ref[index(b, h, rows)] = x

    return get, put


def _over_list(table_ref, t, step, carry, one_loop):
    """``step(masked, slot, carry)`` over row ``t`` of a block list: the partial blocks, then
    the full ones (``pallas_gpu._gpu_over_list``'s two loops, or one with ``one_loop``)."""
    n_partial, n_full = table_ref[t, 0], table_ref[t, 1]
    if one_loop:
        return jax.lax.fori_loop(0, n_partial + n_full,
                                 lambda j, c: step(j < n_partial, table_ref[t, 2 + j], c), carry)
    carry = jax.lax.fori_loop(0, n_partial,
                              lambda j, c: step(True, table_ref[t, 2 + j], c), carry)
    return jax.lax.fori_loop(n_partial, n_partial + n_full,
                             lambda j, c: step(False, table_ref[t, 2 + j], c), carry)


def _items(count, body):
    """Items ``pid, pid + P, ...`` below ``count`` of this program (P: the grid), each
    ``body(item)``."""
    pid, grid = pl.program_id(0), pl.num_programs(0)

    def run(j, carry):
        body(pid + j * grid)
        return carry

    jax.lax.fori_loop(0, (count - pid + grid - 1) // grid, run, jnp.int32(0))


def _split(item, batch, heads):
    """(tile, batch row, head) of an item: the heads of a tile are neighbours."""
    return item // (batch * heads), item // heads % batch, item % heads


def _safe_lse(lse):
    """The joint log-sum-exp as the gradients read it: a row with no key (``tiles.NEG``) gets
    +1e30, so its probabilities are 0 (``fused._attention_bwd``'s rule)."""
    return jnp.where(lse > tiles.NEG / 2, lse, -tiles.NEG)


def _attr_refs(refs, term):
    """(q's attribute refs, a function giving a key tile's attributes, the other refs)."""
    n = 5 if term.flagged else 4
    qp, qs, kp, ks, *kf = refs[:n]

    def key_attrs(a):
        return (kp[:, a], ks[:, a], kf[0][:, a] if kf else 1)

    return (qp, qs), key_attrs, refs[n:]


def _scaled(q, scale):
    """q scaled as XLA would have scaled it outside (rounded to q's dtype)."""
    return q if scale is None else (q * jnp.asarray(scale, q.dtype)).astype(q.dtype)


def _forward_kernel(table_ref, *refs, term, scale, resume, one_loop, seq_major, interpret,
                    batch, heads):
    get, put = _access(seq_major, interpret)
    (qp_ref, qs_ref), key_attrs, (q_ref, k_ref, v_ref, *refs) = _attr_refs(refs, term)
    o_ref, lse_ref = refs[-2:]
    block_k = term.own_k.block

    def item(i):
        t, b, h = _split(i, batch, heads)
        rows, attrs = term.own_q(t), Rows(term.own_q.block)(t)
        q_attrs = (qp_ref[attrs, :], qs_ref[attrs, :])
        q = _scaled(get(q_ref, b, h, rows), scale)

        def step(masked, kb, carry):
            at = term.own_k(kb)
            s = tiles.scores(term.keep, q, get(k_ref, b, h, at), q_attrs,
                             key_attrs(Rows(block_k)(kb)), masked)
            return tiles.online(s, *carry, get(v_ref, b, h, at))

        if resume:
            lse = get(refs[1], b, h, rows)
            seen = lse > tiles.NEG / 2
            start = (get(refs[0], b, h, rows), jnp.where(seen, lse, tiles.FLOOR),
                     seen.astype(jnp.float32))
        else:
            start = tiles.start(q.shape[0], o_ref.shape[-1])
        o, lse = tiles.finish(*_over_list(table_ref, t, step, start, one_loop))
        put(o_ref, b, h, rows, o.astype(o_ref.dtype))
        put(lse_ref, b, h, rows, lse)

    _items(table_ref.shape[0] * batch * heads, item)


def _backward_kernel(fwd_ref, bwd_ref, *refs, term, scale, resume, one_loop, seq_major,
                     interpret, batch, heads, atomic):
    """The dq items (query tiles over ``fwd_ref``'s rows) first, then the dk/dv items (key
    tiles over ``bwd_ref``'s); ``resume``: refs dq, dk, dv so far come first. With ``scale``
    the scores are of the scaled q, and dq is scaled back (dq of the unscaled q).

    ``atomic`` (``BlockSizes.atomic_dq``): the dk/dv items alone, each adding its tiles'
    shares of dq atomically to the float32 dq that comes first (the earlier terms' dq, or
    zeros; aliased to the output), so that each tile is visited once. There the item's k is
    scaled, not q (``ds k`` is then dq of the unscaled q, and no query tile is scaled on each
    visit: with it the column term's kernel spills), and dk is scaled once at the end."""
    get, put = _access(seq_major, interpret)
    (qp_ref, qs_ref), key_attrs, refs = _attr_refs(refs, term)
    q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref, *refs = refs
    ins, (dq_ref, dk_ref, dv_ref) = refs[:-3], refs[-3:]
    bq, bk = term.own_q.block, term.own_k.block
    n_dq = 0 if atomic else fwd_ref.shape[0] * batch * heads

    def query_side(b, h, t):  # q, do, lse, delta of a query tile, and its position attributes
        rows, a = term.own_q(t), Rows(bq)(t)
        do = get(do_ref, b, h, rows)
        delta = (do.astype(jnp.float32) * get(o_ref, b, h, rows).astype(jnp.float32)).sum(
            -1, keepdims=True)
        q = get(q_ref, b, h, rows)
        return (q if atomic else _scaled(q, scale), do, _safe_lse(get(lse_ref, b, h, rows)),
                delta, (qp_ref[a, :], qs_ref[a, :]))

    def dq_item(i):
        t, b, h = _split(i, batch, heads)
        q, do, lse, delta, q_attrs = query_side(b, h, t)
        rows = term.own_q(t)

        def step(masked, kb, acc):
            at = term.own_k(kb)
            k = get(k_ref, b, h, at)
            s = tiles.scores(term.keep, q, k, q_attrs, key_attrs(Rows(bk)(kb)), masked)
            ds = tiles.grads(s, lse, delta, do, get(v_ref, b, h, at))[1]
            return acc + tiles.dot(ds.astype(k.dtype), k)

        dq = _over_list(fwd_ref, t, step, jnp.zeros(q.shape, jnp.float32), one_loop)
        dq = dq if scale is None else dq * scale
        if resume:
            dq = dq + get(ins[0], b, h, rows)
        put(dq_ref, b, h, rows, dq.astype(dq_ref.dtype))

    def dkv_item(i):
        t, b, h = _split(i - n_dq, batch, heads)
        rows = term.own_k(t)
        k_attrs = key_attrs(Rows(bk)(t))
        k, v = get(k_ref, b, h, rows), get(v_ref, b, h, rows)
        k = _scaled(k, scale) if atomic else k

        def step(masked, qb, acc):
            q, do, lse, delta, q_attrs = query_side(b, h, qb)
            s = tiles.scores(term.keep, q, k, q_attrs, k_attrs, masked)
            if not atomic:
                p, ds = tiles.grads(s, lse, delta, do, v)
                return (acc[0] + tiles.dot(ds.astype(q.dtype), q, trans_a=True),
                        acc[1] + tiles.dot(p.astype(do.dtype), do, trans_a=True))
            p = jnp.exp(s - lse)  # tiles.grads, with dv taken first: fewer live registers
            dv = acc[1] + tiles.dot(p.astype(do.dtype), do, trans_a=True)
            ds = (p * (tiles.dot(do, v, trans_b=True) - delta)).astype(q.dtype)
            dk = acc[0] + tiles.dot(ds, q, trans_a=True)
            put(dq_ref, b, h, term.own_q(qb), tiles.dot(ds, k), add=True)
            return dk, dv

        zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
        start = (get(ins[1], b, h, rows), get(ins[2], b, h, rows)) if resume and not atomic \
            else zeros
        dk, dv = _over_list(bwd_ref, t, step, start, one_loop)
        if atomic:
            dk = dk if scale is None else dk * scale
            if resume:
                dk, dv = dk + get(ins[1], b, h, rows), dv + get(ins[2], b, h, rows)
        put(dk_ref, b, h, rows, dk.astype(dk_ref.dtype))
        put(dv_ref, b, h, rows, dv.astype(dv_ref.dtype))

    n_dkv = bwd_ref.shape[0] * batch * heads
    if atomic:
        return _items(n_dkv, dkv_item)

    def item(i):
        jax.lax.cond(i < n_dq, dq_item, dkv_item, i)

    _items(n_dq + n_dkv, item)


def _call(compiler, kernel, grid, inputs, out, name, cost, aliases=None):
    """pallas_call of a persistent kernel: every ref whole (the program finds its tiles);
    ``aliases``: input index to output index, as ``pallas_call``'s."""
    params = {}
    if not compiler.interpret:
        from jax.experimental.pallas import triton as pl_triton

        params["compiler_params"] = pl_triton.CompilerParams(
            num_warps=compiler.num_warps, num_stages=compiler.num_stages)

    def whole(shape):
        return pl.BlockSpec(shape, lambda i: (0,) * len(shape))

    return pl.pallas_call(
        kernel, grid=(grid,), interpret=compiler.interpret, name=name, cost_estimate=cost,
        input_output_aliases=aliases or {},
        in_specs=[whole(x.shape) for x in inputs],
        out_specs=[whole(shape) for shape, _ in out],
        out_shape=[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in out], **params,
    )(*inputs)


def _dims(x, seq_major):
    batch, heads = (x.shape[0], x.shape[2]) if seq_major else x.shape[:2]
    return batch, heads, (lambda d: (*x.shape[:3], d))


def forward(compiler, term: Term, q, k, v, *, init=(), scale=None, dtype=jnp.float32,
            seq_major=False, tag=""):
    """Output (``dtype``) and log-sum-exp ([..., 1], float32) of one term over sequence-order
    arrays, resuming from ``init`` = (o, lse) of the earlier terms where given; q scaled by
    ``scale`` in the kernel (None: already scaled)."""
    batch, heads, like = _dims(q, seq_major)
    lists = term.lists
    items = lists.forward.shape[0] * batch * heads
    kernel = functools.partial(_forward_kernel, term=term, scale=scale, resume=bool(init),
                               one_loop=compiler.one_loop, seq_major=seq_major,
                               interpret=compiler.interpret, batch=batch, heads=heads)
    cost = tiles.cost("forward", lists.forward, term.own_q.block, term.own_k.block,
                      batch * heads, q.shape[-1], v.shape[-1], q.dtype.itemsize,
                      jnp.dtype(dtype).itemsize)
    return _call(compiler, kernel, programs(compiler, "forward", items),
                 [lists.forward, *term.attrs(), q, k, v, *init],
                 [(like(v.shape[-1]), dtype), (like(1), jnp.float32)],
                 f"sparse_forward_onepass_{tag}", cost)


def backward(compiler, term: Term, q, k, v, out, do, lse, *, init=(), scale=None,
             dtype=jnp.float32, seq_major=False, tag=""):
    """dq, dk, dv (``dtype``) of one term's share of the output for the joint log-sum-exp
    ``lse`` ([..., 1]), ``out`` the final output (for delta), adding to ``init`` = (dq, dk, dv)
    of the earlier terms (float32) where given, ``scale`` as ``forward``'s: one kernel, the dq
    and dk/dv items on one persistent grid, or with ``compiler.atomic_dq`` the dk/dv items
    alone, adding dq atomically to a float32 array (zeros, or the earlier terms' dq) that
    XLA then casts to ``dtype``."""
    batch, heads, like = _dims(q, seq_major)
    lists = term.lists
    atomic = compiler.atomic_dq
    kernel = functools.partial(_backward_kernel, term=term, scale=scale, resume=bool(init),
                               one_loop=compiler.one_loop, seq_major=seq_major,
                               interpret=compiler.interpret, batch=batch, heads=heads,
                               atomic=atomic)
    sizes = (batch * heads, q.shape[-1], v.shape[-1], q.dtype.itemsize, jnp.dtype(dtype).itemsize)
    dq_cost = tiles.cost("dq", lists.forward, term.own_q.block, term.own_k.block, *sizes)
    dkv_cost = tiles.cost("dkv", lists.backward, term.own_q.block, term.own_k.block, *sizes)
    if atomic:  # dk/dv's work and ds k a tile, whose float32 sum is read and written there
        pairs = int(lists.backward[:, :2].sum()) * term.own_q.block * term.own_k.block
        dq_cost = pl.CostEstimate(flops=2 * pairs * q.shape[-1] * batch * heads,
                                  transcendentals=0,
                                  bytes_accessed=8 * pairs // term.own_k.block * q.shape[-1]
                                  * batch * heads)
    cost = pl.CostEstimate(flops=dq_cost.flops + dkv_cost.flops,
                           transcendentals=dq_cost.transcendentals + dkv_cost.transcendentals,
                           bytes_accessed=dq_cost.bytes_accessed + dkv_cost.bytes_accessed)
    inputs = [lists.forward, lists.backward, *term.attrs(), q, k, v, out, do, lse]
    items = ((0 if atomic else lists.forward.shape[0]) + lists.backward.shape[0]) * batch * heads
    out_dq = (like(q.shape[-1]), jnp.float32 if atomic else dtype)
    if atomic:
        init = (init[0] if init else jnp.zeros(out_dq[0], jnp.float32), *init[1:])
    dq, dk, dv = _call(compiler, kernel, programs(compiler, "backward", items),
                       [*inputs, *init], [out_dq, (like(k.shape[-1]), dtype),
                                          (like(v.shape[-1]), dtype)],
                       f"sparse_backward_onepass_{tag}", cost,
                       aliases={len(inputs): 0} if atomic else None)
    return dq.astype(dtype), dk, dv
