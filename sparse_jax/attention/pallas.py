"""The Pallas kernels behind ``attention.blocks``: block-sparse flash attention over block lists,
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

import functools

import jax.numpy as jnp

from sparse_jax.attention import pallas_gpu, pallas_tpu, tiles
from sparse_jax.attention.pallas_gpu import Rows
from sparse_jax.attention.pallas_tpu import Band
from sparse_jax.attention.tiles import Compiler, Lists

# ---------------------------------------------------------------------------------------------
# The passes.




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
    work = tiles.cost("forward", lists.forward, bq, bk, batch * heads, q.shape[-1], v.shape[-1],
                q.dtype.itemsize, jnp.dtype(dtype).itemsize, _nbytes(init))
    if compiler.backend == "triton":
        own, listed = rows or (None, Rows(bk))
        out = [(like(nq, v.shape[3]), dtype, rows is None),
               (like(nq, 1), jnp.float32, rows is None)]
        inputs = _gpu_inputs(lists.q_attrs, lists.k_attrs, (True, False),
                             [(q, True), (k, False), (v, False)], rows, init)
        kernel = functools.partial(pallas_gpu.forward, keep=keep, own=own, listed=listed,
                                   resume=bool(init), one_loop=compiler.one_loop,
                                   seq_major=seq_major, interpret=compiler.interpret)
        return pallas_gpu.call(compiler, kernel, lists.forward, bq, inputs, out,
                         _name("sparse_forward", tag), seq_major, work)
    out = [((batch, heads, nq, v.shape[3]), bq), ((batch, heads, nq, 1), bq)]
    own, listed = [q, *lists.q_attrs], [k, v, *lists.k_attrs]
    kernel = functools.partial(pallas_tpu.forward, keep=keep, width=lists.forward.shape[1])
    return pallas_tpu.call(compiler, kernel, lists.forward, own, listed, bk, out,
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
    dq_work = tiles.cost("dq", lists.forward, bq, bk, *sizes, _nbytes(init[0]))
    dkv_work = tiles.cost("dkv", lists.backward, bq, bk, *sizes, _nbytes(init[1]))
    if compiler.backend == "triton":
        q_rows, k_rows = rows or (None, None)
        tiled = rows is None
        common = dict(keep=keep, one_loop=compiler.one_loop, seq_major=seq_major,
                      interpret=compiler.interpret)
        dq_inputs = _gpu_inputs(lists.q_attrs, lists.k_attrs, (True, False), [
            (q, True), (do, True), (lse, True), (delta, True), (k, False), (v, False)],
            rows, init[0])
        dq = pallas_gpu.call(compiler, functools.partial(
            pallas_gpu.dq, own=q_rows, listed=k_rows or Rows(bk), resume=bool(init[0]),
            **common),
            lists.forward, bq, dq_inputs, [(like(nq, q.shape[3]), dtype, tiled)],
            _name("sparse_dq", tag), seq_major, dq_work)[0]
        dkv_inputs = _gpu_inputs(lists.q_attrs, lists.k_attrs, (False, True), [
            (k, True), (v, True), (q, False), (do, False), (lse, False), (delta, False)],
            rows, init[1])
        dk, dv = pallas_gpu.call(compiler, functools.partial(
            pallas_gpu.dkv, own=k_rows, listed=q_rows or Rows(bq), resume=bool(init[1]),
            **common),
            lists.backward, bk, dkv_inputs, [(like(nk, k.shape[3]), dtype, tiled),
                                            (like(nk, v.shape[3]), dtype, tiled)],
            _name("sparse_dkv", tag), seq_major, dkv_work)
        return dq, dk, dv
    dq_out = [((batch, heads, nq, q.shape[3]), bq)]
    dkv_out = [((batch, heads, nk, k.shape[3]), bk), ((batch, heads, nk, v.shape[3]), bk)]
    dq_own = [q, *lists.q_attrs, do, lse, delta]
    dkv_listed = [q, do, lse, delta, *lists.q_attrs]
    key_side = [k, v, *lists.k_attrs]
    dq = pallas_tpu.call(compiler,
                         functools.partial(pallas_tpu.dq, keep=keep, width=lists.forward.shape[1]),
                         lists.forward, dq_own, key_side, bk, dq_out, [(bq, q.shape[3])],
                   _name("sparse_dq", tag), dq_work)[0]
    dk, dv = pallas_tpu.call(
        compiler, functools.partial(pallas_tpu.dkv, keep=keep, width=lists.backward.shape[1]),
        lists.backward, key_side, dkv_listed, bq, dkv_out,
        [(bk, k.shape[3]), (bk, v.shape[3])], _name("sparse_dkv", tag), dkv_work)
    return dq, dk, dv


def band_forward(compiler: Compiler, band: Band, q, k, v, *, tag=""):
    """``forward`` of a band term (``Band``; arrays [B, H, N, d] in the term's layout, N the
    own blocks' rows): output [B, H, N, dv] in v's dtype and log-sum-exp [B, H, 1, N] (float32,
    lane-dense)."""
    batch, heads, n = q.shape[:3]
    work = pallas_tpu.band_cost("forward", band, batch * heads, q.shape[3], v.shape[3],
                                q.dtype.itemsize)
    return pallas_tpu.band_call(compiler, pallas_tpu.band_forward, band, [q], [k, v],
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
    dq = pallas_tpu.band_call(compiler, pallas_tpu.band_dq, bands[0], [q, do, lse, delta], [k, v],
                    [((batch, heads, n, q.shape[3]), q.dtype)], _name("sparse_band_dq", tag),
                    pallas_tpu.band_cost("dq", bands[0], *sizes))[0]
    dk, dv = pallas_tpu.band_call(compiler, pallas_tpu.band_dkv, bands[1], [k, v],
                                  [q, do, lse, delta],
                        [((batch, heads, n, k.shape[3]), k.dtype),
                         ((batch, heads, n, v.shape[3]), v.dtype)],
                        _name("sparse_band_dkv", tag),
                        pallas_tpu.band_cost("dkv", bands[1], *sizes))
    return dq, dk, dv
