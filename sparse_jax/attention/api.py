"""The entry points of sparse attention: ``sparse_attention`` (one pattern; dense attention through
cuDNN on a GPU, the CPU kernels or query chunks elsewhere), ``multi_spec_attention`` (head groups
with their own patterns) and ``resolve_implementation`` (which implementation "auto" means where
the code is traced). The implementations themselves: ``xla`` (the block terms in plain ``jnp``),
``blocks`` (the same terms as fused Pallas kernels), ``causal`` (dense causal attention).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from sparse_jax.attention import fused, patterns, tilepath, tiles
from sparse_jax.attention import native as _native
from sparse_jax.attention.blocks import BlockSizes
from sparse_jax.attention.causal import causal_attention, native_causal_attention
from sparse_jax.attention.reference import check_qkv
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.attention.terms import ColumnTerm
from sparse_jax.attention.xla import grid_attention

# unfused XLA ops, fused CPU kernels for some terms (attention.native), fused Pallas kernels
IMPLEMENTATIONS = ("xla", "native", "pallas", "auto")
def resolve_implementation(implementation: str) -> str:
    """"xla", "native" or "pallas" for ``implementation``: "auto" is the Pallas kernel on a GPU or
    TPU, and on a CPU the fused CPU kernels where they build (``attention.native``), else XLA.
    "pallas" runs compiled on a GPU (Triton) or TPU (Mosaic) and in interpret mode on a CPU
    (slow: for tests). "native" is CPU only; it raises if the kernels cannot be built. The
    platform is the one traced for (``tiles.target_platform``)."""
    patterns.check_choice("implementation", implementation, IMPLEMENTATIONS)
    platform = tiles.target_platform()
    if implementation == "auto":
        return "pallas" if platform in ("gpu", "tpu") else (
            "native" if platform == "cpu" and _native.available() else "xla")
    if implementation == "native":
        if platform != "cpu":
            raise ValueError(f"implementation='native' runs on a CPU, not on "
                             f"{platform}: use 'pallas' or 'auto' there")
        _native.require()
    return implementation


def _gpu_dense_attention(q, k, v):
    """Causal attention through cuDNN's fused kernel where it takes these shapes and dtype (it
    checks them while tracing: bfloat16/float16, head dim <= 128), else XLA's. jax's default
    (``implementation=None``) is XLA's unfused attention, which holds [B, H, n, n] scores: 54.7
    GB planned for the enwik8 model's 16k step, where the kernel keeps O(n)."""
    try:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    except (NotImplementedError, ValueError, RuntimeError):  # float32, no cuDNN, ...
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def sparse_attention(q, k, v, spec: PatternSpec, implementation: str = "xla",
                     block_sizes: BlockSizes | None = None):
    """Attention of q over k, v restricted to ``spec``'s pattern; equals
    ``dense_attention(q, k, v, spec.mask(n))``.

    q, k: [B, n, H, d]; v: [B, n, H, dv]; float32, bfloat16 or float16 (scores and softmax
    in float32, output in the input dtype). Any n >= 1 (padded internally to a multiple of
    the pattern's block). ``spec`` must be static under ``jax.jit``. Differentiable with a
    custom backward pass whose memory is O(n·|S|) like the forward. ``implementation``: "xla"
    (the block terms above), "pallas" (``attention.blocks``: the same terms, fused) or "auto"
    (``resolve_implementation``). For dense attention "pallas" means a fused kernel too: on a
    GPU ``jax.nn.dot_product_attention`` (cuDNN's flash attention where it supports the shapes
    and dtype); elsewhere the XLA path. "native" (so "auto" on a CPU) runs dense attention as
    one fused CPU kernel, forward and backward, for float32 with a head dim the kernels take
    (else the XLA path): 1.2-1.9x less CPU time than PyTorch's fused SDPA, 1.5-2.5x less than
    the XLA path (docs/attention.md). ``block_sizes``: the kernel's tiles (default
    ``BlockSizes.for_backend``).
    """
    check_qkv(q, k, v)
    if not isinstance(spec, PatternSpec):
        raise ValueError(f"spec must be a PatternSpec, got {type(spec).__name__}")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a sparse_jax.attention.BlockSizes or None, got "
                         f"{type(block_sizes).__name__}")
    implementation = resolve_implementation(implementation)
    batch, seq_len, heads, _ = q.shape
    scale = 1.0 / math.sqrt(q.shape[-1])
    if spec.kind == "dense":
        if implementation == "pallas" and tiles.target_platform() == "gpu":
            return _gpu_dense_attention(q, k, v)
        if implementation == "native" and _native.supports(q, k, v):
            return native_causal_attention(scale, q, k, v)
        heads_first = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  [B, n, H, d] <-> [B, H, n, d]
        out = causal_attention(heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k),
                                heads_first(v))
        return heads_first(out).astype(q.dtype)
    if (heads == 1 and batch > 1 and implementation in ("xla", "native")
            and any(isinstance(term, ColumnTerm) for term in spec.terms())):
        # One head: the batch rows as heads instead (exact, each row attends alone). With a
        # size-1 head axis in the grid, XLA:CPU's layouts copied whole accumulators in every
        # scan step of the column term: 2.4x slower (docs/design.md §9).
        swap = lambda x: x.transpose(2, 1, 0, 3)  # noqa: E731  [B, n, 1, d] <-> [1, n, B, d]
        return swap(sparse_attention(swap(q), swap(k), swap(v), spec, implementation))
    block = spec.block
    rows = -(-seq_len // block)
    pad = rows * block - seq_len

    def to_grid(x):  # [B, n, H, d] -> [B, R, block, H, d]: a reshape, no copy unless padded
        x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else x
        return x.reshape(batch, rows, block, heads, x.shape[-1])

    if implementation == "pallas" and not tilepath.pallas_ready(spec):
        _note_xla(str(spec))  # a keys(i) rule, or one of NumPy-only calls: the XLA path
        implementation = "xla"
    if implementation == "pallas":  # [B, n', H, d]: the chained variant reads it as it is
        flat = lambda x: to_grid(x).reshape(batch, rows * block, heads, -1)  # noqa: E731
        out = fused.sequence_attention(spec, flat(q), flat(k), flat(v), sizes=block_sizes,
                                        seq_major=True, scale=scale)
    else:  # q is scaled chunk by chunk: a pass over it saved
        out = grid_attention(spec, scale, implementation == "native", to_grid(q), to_grid(k),
                              to_grid(v))
    out = out.reshape(batch, rows * block, heads, -1)[:, :seq_len]
    return out.astype(q.dtype)


@functools.cache
def _note_xla(name: str) -> None:
    logging.warning("sparse_jax: pattern %s runs on the XLA path, not the Pallas kernels: its "
                    "rule is not allowed(q, k) of array operations, which a kernel could run",
                    name)


def multi_spec_attention(q, k, v, specs: Sequence[PatternSpec], implementation: str = "xla",
                         block_sizes: BlockSizes | None = None):
    """Heads split into ``len(specs)`` equal groups, group g attending with ``specs[g]``
    (``block_sizes``: the Pallas kernel's tiles and variant, ``sparse_attention``'s)."""
    check_qkv(q, k, v)
    if not specs:
        raise ValueError("specs must hold at least one PatternSpec, got none")
    heads = q.shape[2]
    if heads % len(specs):
        raise ValueError(f"{heads} heads cannot be split evenly into {len(specs)} groups "
                         f"({', '.join(map(str, specs))})")
    if len(specs) == 1:
        return sparse_attention(q, k, v, specs[0], implementation, block_sizes)
    g = heads // len(specs)
    outs = [sparse_attention(q[:, :, i * g:(i + 1) * g], k[:, :, i * g:(i + 1) * g],
                             v[:, :, i * g:(i + 1) * g], s, implementation, block_sizes)
            for i, s in enumerate(specs)]
    return jnp.concatenate(outs, axis=2)
