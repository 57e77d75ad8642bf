"""The Flax NNX layers of a Sparse Transformer block: sparse self-attention and the residual block.

Each layer has a full-sequence ``__call__`` and a ``decode_step`` that computes one position on
a key/value cache (``SparseTransformer.decode_step`` calls them); the attention math itself is
``sparse_jax.attention``. Initialization follows docs/design.md §4: weights ~ N(0, std²),
biases 0, norm scales 1.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from sparse_jax.attention import decode_attention, multi_spec_attention, resolve_implementation
from sparse_jax.attention.blocks import BlockSizes
from sparse_jax.attention.context import context_attention
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.sharding import SEQ_AXIS

# GeLU of a product plus its bias, recomputed by the backward from the product (which the
# matrix multiply writes anyway): XLA's own derivative keeps the biased input and the tanh as
# two more [B, n, 4d] residuals, written by the forward and read by the backward.
_gelu_bias = jax.checkpoint(lambda y, bias: jax.nn.gelu(y + bias))


def _linear_gelu(layer: nnx.Linear, x):
    """``gelu(layer(x))`` (as ``nnx.Linear.__call__`` computes the product) with
    ``_gelu_bias``'s residuals."""
    x, kernel, bias = layer.promote_dtype((x, layer.kernel[...], layer.bias[...]),
                                          dtype=layer.dtype)
    y = layer.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=layer.precision)
    return _gelu_bias(y, bias)


def _dropout(x, rate: float, key):
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def rotate(x_BNHD, positions_N, base: float = 10_000.0, dims: int | None = None):
    """Rotary position embedding (Su et al. 2021; not in the Sparse Transformer paper): each
    pair of features (f, f + R/2) of position p turned by the angle ``p · base^(-2f/R)``, so a
    rotated query and key have a dot product that depends on their distance, not on where they
    sit. x: [B, n, H, D]; positions: int [n] (may be traced). ``dims``: R, the first R features
    of each head are rotated (even; None: all D), the rest pass unchanged, so that part of a
    score is the same at every distance (partial rotary, as GPT-NeoX). Computed in float32,
    returned in x's dtype."""
    dims = x_BNHD.shape[-1] if dims is None else dims
    half = dims // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.asarray(positions_N, jnp.float32)[:, None] * freqs  # [n, R/2]
    cos, sin = (f(angles)[None, :, None] for f in (jnp.cos, jnp.sin))
    x = x_BNHD.astype(jnp.float32)
    x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], -1
                           ).astype(x_BNHD.dtype)


def linear(d_in: int, d_out: int, std: float, *, dtype, param_dtype, rngs: nnx.Rngs):
    """``nnx.Linear`` with weights ~ N(0, std²) and zero bias."""
    return nnx.Linear(d_in, d_out, kernel_init=nnx.initializers.normal(std), dtype=dtype,
                      param_dtype=param_dtype, rngs=rngs)


def shift_kv(k_BNHD, v_BNHD, shifts: Sequence[int]):
    """Head h's keys moved s = ``shifts[h]`` positions later and its values s - 1 (zeros
    before position 0; s = 0 leaves the head alone): position j then holds the key of j - s
    and the value of j - s + 1, the byte that followed it. A query matching the key of j - s
    reads what came next there. Not in the paper."""
    n = k_BNHD.shape[1]

    def moved(x_BNHD, by):
        cols = []
        for h, s in enumerate(by):
            x_BN1D = x_BNHD[:, :, h:h + 1]
            if s:
                x_BN1D = jnp.pad(x_BN1D[:, :max(n - s, 0)],
                                 ((0, 0), (min(s, n), 0), (0, 0), (0, 0)))
            cols.append(x_BN1D)
        return jnp.concatenate(cols, axis=2)

    return moved(k_BNHD, shifts), moved(v_BNHD, [max(s - 1, 0) for s in shifts])


class SparseSelfAttention(nnx.Module):
    """Multi-head causal self-attention over a factorized pattern.

    ``specs`` is one pattern per head group (see ``patterns.layer_specs``): one spec for merged
    or interleaved layers, several for multi-head mode. ``qk_dim`` (default ``d_model``) sets the
    total query/key width; the paper's "half-size" query/key use ``d_model // 2``.
    Weights ~ N(0, init_std²) (default 0.125/√d_model), the output projection
    N(0, out_std²) (default init_std), biases 0. ``implementation``: of the sparse attention
    ("xla", "pallas" or "auto", ``attention.sparse_attention``); ``block_sizes``: the Pallas
    kernel's tiles and variant (``attention.BlockSizes``; None: the backend's default). ``rotary``:
    queries and keys
    rotated by their position (``rotate``; not in the paper), so scores can depend on distance;
    ``rotary_dims``: how many of each head's query/key features (None: all).
    ``shifts``: per head, 0 or a shift s >= 1 (``shift_kv``; not in the paper): the head's key
    at position j is the key of j - s and its value that of j - s + 1, so with the strided
    column (offsets m·l) heads shifted by 1..l together reach every earlier byte in one hop,
    and a key can match "the context that preceded this byte" (an induction step in one layer).
    """

    def __init__(self, d_model: int, num_heads: int, specs: Sequence[PatternSpec], *,
                 qk_dim: int | None = None, init_std: float | None = None,
                 out_std: float | None = None, implementation: str = "xla",
                 block_sizes: BlockSizes | None = None,
                 rotary: bool = False, rotary_dims: int | None = None,
                 shifts: Sequence[int] | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        qk_dim = d_model if qk_dim is None else qk_dim
        for name, dim in [("d_model", d_model), ("qk_dim", qk_dim)]:
            if dim % num_heads:
                raise ValueError(f"{name}={dim} must be divisible by num_heads={num_heads}")
        specs = tuple(specs)
        if rotary and (qk_dim // num_heads) % 2:
            raise ValueError(f"rotary needs an even query/key width per head, got "
                             f"{qk_dim // num_heads}")
        if rotary_dims is not None and not (0 < rotary_dims <= qk_dim // num_heads
                                            and rotary_dims % 2 == 0):
            raise ValueError(f"rotary_dims must be even and in [2, {qk_dim // num_heads}] (the "
                             f"query/key width per head), got {rotary_dims}")
        if not specs or num_heads % len(specs):
            raise ValueError(f"num_heads={num_heads} must be a multiple of the number of head "
                             f"groups ({len(specs)})")
        shifts = tuple(shifts) if shifts else None
        if shifts is not None and (len(shifts) != num_heads or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shifts)):
            raise ValueError(f"shifts must be {num_heads} integers >= 0 (one per head), got "
                             f"{shifts}")
        if shifts is not None and not any(shifts):
            shifts = None
        init_std = 0.125 / math.sqrt(d_model) if init_std is None else init_std
        out_std = init_std if out_std is None else out_std
        dense = functools.partial(linear, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.query = dense(d_model, qk_dim, init_std)
        self.key = dense(d_model, qk_dim, init_std)
        self.value = dense(d_model, d_model, init_std)
        self.out = dense(d_model, d_model, out_std)
        self.num_heads = num_heads
        self.specs = specs
        self.implementation = implementation
        self.block_sizes = block_sizes
        self.rotary = rotary
        self.rotary_dims = rotary_dims
        self.shifts = shifts

    def __call__(self, x, sharding=None):
        """x: [B, n, d_model] -> [B, n, d_model]. ``sharding``: the NamedSharding of x on a
        device mesh, if any (``sharding.batch_sharding``). XLA cannot split a fused kernel (a
        custom call) by itself, so with ``implementation`` "pallas" or "native" (or "auto") each
        device runs the kernel on its own sequences (``jax.shard_map``). Where the mesh splits
        the sequence (its ``seq`` axis), every implementation runs in a ``shard_map`` over it,
        each device attending its positions' rows and exchanging the keys the pattern needs
        (``context.context_attention``)."""
        batch, seq_len, _ = x.shape
        q, k, v = self.project(x)
        attend = functools.partial(multi_spec_attention, specs=self.specs,
                                   implementation=self.implementation,
                                   block_sizes=self.block_sizes)
        if sharding is not None:
            mesh = sharding.mesh
            axes = sharding.spec[0] if sharding.spec else None
            names = (axes,) if isinstance(axes, str) else tuple(axes or ())
            if batch % math.prod(mesh.shape[a] for a in names):
                axes = None  # a batch the mesh cannot split: whole on every device
            if mesh.shape.get(SEQ_AXIS, 1) > 1:
                spec = P(axes, SEQ_AXIS)
                attend = jax.shard_map(
                    functools.partial(context_attention, spec=self.specs, axis=SEQ_AXIS,
                                      implementation=self.implementation,
                                      block_sizes=self.block_sizes),
                    mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
            elif axes is not None and resolve_implementation(self.implementation) in (
                    "pallas", "native"):
                spec = P(axes)
                attend = jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 3,
                                       out_specs=spec, check_vma=False)
        return self.out(attend(q, k, v).reshape(batch, seq_len, -1))

    def project(self, x):
        """The queries, keys and values ``__call__`` attends with: x [B, n, d_model] -> q, k
        [B, n, H, qk_dim / H] and v [B, n, H, d_model / H], in the compute dtype, projected,
        rotated by position (``rotary``) and with each shifted head's keys and values moved
        (``shift_kv``). Query i and key j then score ``q[i] . k[j] / sqrt(qk_dim / H)`` for
        the keys j of i's pattern (``sparse_jax.attention_stats`` reads them)."""
        batch, seq_len, _ = x.shape
        split = lambda y: y.reshape(batch, seq_len, self.num_heads, -1)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        if self.rotary:
            q, k = (rotate(y, jnp.arange(seq_len), dims=self.rotary_dims) for y in (q, k))
        if self.shifts is not None:
            k, v = shift_kv(k, v, self.shifts)
        return q, k, v

    def decode_step(self, x_B1D, cache, layer, i):
        """The layer at position ``i`` alone, on a key/value cache: x [B, 1, d_model] ->
        ([B, 1, d_model], the cache with position i's key and value written).

        cache: (k [L, B, F, H, qk_dim / H], v [L, B, F, H, d_model / H]) of every layer, this
        layer's at index ``layer`` (an int, or traced inside a scan over layers), positions < i
        filled. A head group attends its pattern's keys of query i among the F cached positions,
        ``spec.row_keys(i, F)``: computed from i in the step (-1 where absent), so no
        ``[F, K]`` index table is built or held (fixed, l = 256, at 65,536: 4 GB).
        """
        batch = x_B1D.shape[0]
        q_BHD, k_BHD, v_BHD = (proj(x_B1D).reshape(batch, self.num_heads, -1)
                               for proj in (self.query, self.key, self.value))
        if self.rotary:  # as row i of the full pass: the cache holds rotated keys
            q_BHD, k_BHD = (rotate(x[:, None], jnp.asarray(i)[None], dims=self.rotary_dims)[:, 0]
                            for x in (q_BHD, k_BHD))
        k_cache, v_cache = cache
        k_cache = k_cache.at[layer, :, i].set(k_BHD.astype(k_cache.dtype))
        v_cache = v_cache.at[layer, :, i].set(v_BHD.astype(v_cache.dtype))
        k_BFHD, v_BFHD = k_cache[layer], v_cache[layer]
        group, outs = self.num_heads // len(self.specs), []
        for g, spec in enumerate(self.specs):  # head group g attends with pattern spec
            heads = slice(g * group, (g + 1) * group)
            if spec.kind == "dense":  # every cached position, those after i masked
                row_C = jnp.arange(k_BFHD.shape[1])
                valid = row_C <= i
            else:
                row_C = spec.row_keys(i, k_BFHD.shape[1], jnp)
                valid = row_C >= 0
            if self.shifts is None and spec.kind == "dense":
                keys, values = k_BFHD[:, :, heads], v_BFHD[:, :, heads]
            elif self.shifts is None:
                safe = jnp.maximum(row_C, 0)
                keys, values = k_BFHD[:, safe, heads], v_BFHD[:, safe, heads]
            else:  # head h reads the key of j - s and the value of j - s + 1 (zero before 0)
                def rows(cache_BFD, src_C):
                    got = cache_BFD[:, jnp.maximum(src_C, 0)]
                    return jnp.where((src_C >= 0)[None, :, None], got, 0)

                shifts = self.shifts[heads]
                keys = jnp.stack([rows(k_BFHD[:, :, h], row_C - s)
                                  for h, s in zip(range(heads.start, heads.stop), shifts)], 2)
                values = jnp.stack([rows(v_BFHD[:, :, h], row_C - max(s - 1, 0))
                                    for h, s in zip(range(heads.start, heads.stop), shifts)], 2)
            outs.append(decode_attention(q_BHD[:, heads], keys, values, valid))
        out = self.out(jnp.concatenate(outs, axis=1).reshape(batch, 1, -1))
        return out, (k_cache, v_cache)


class Block(nnx.Module):
    """Pre-activation residual block: H + a + b with a = dropout(attn(norm(H))),
    b = dropout(ff(norm(H + a))). The output projections of both branches are initialized
    with an extra factor 1/√(2 num_layers)."""

    def __init__(self, d_model: int, num_heads: int, specs: Sequence[PatternSpec], *,
                 qk_dim: int, ff_dim: int, num_layers: int, dropout: float = 0.0,
                 attention: str = "xla", block_sizes: BlockSizes | None = None,
                 rotary: bool = False, rotary_dims: int | None = None,
                 shifts: Sequence[int] | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        d, out_scale = d_model, 1.0 / math.sqrt(2 * num_layers)
        norm = functools.partial(nnx.LayerNorm, d, dtype=dtype, param_dtype=param_dtype)
        dense = functools.partial(linear, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.attn_norm = norm(rngs=rngs)
        self.attn = SparseSelfAttention(
            d, num_heads, specs, qk_dim=qk_dim, init_std=0.125 / math.sqrt(d),
            out_std=0.125 / math.sqrt(d) * out_scale, implementation=attention,
            block_sizes=block_sizes, rotary=rotary,
            rotary_dims=rotary_dims, shifts=shifts, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.ff_norm = norm(rngs=rngs)
        self.ff_in = dense(d, ff_dim, 0.125 / math.sqrt(d))
        self.ff_out = dense(ff_dim, d, 0.125 / math.sqrt(ff_dim) * out_scale)
        self.dropout = dropout

    def __call__(self, h_BND, dropout_key=None, sharding=None):
        """h [B, n, d] (float32) -> [B, n, d]; dropout iff ``dropout_key`` is given;
        ``sharding``: h's batch split on a mesh, if any (``SparseSelfAttention``)."""
        keys = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        a_BND = _dropout(self.attn(self.attn_norm(h_BND), sharding), self.dropout, keys[0])
        return self._finish(h_BND, a_BND, keys[1])

    def decode_step(self, h_B1D, cache, layer, i):
        """The block at position ``i`` alone, without dropout: h [B, 1, d] -> ([B, 1, d], cache);
        the other arguments as in ``SparseSelfAttention.decode_step``."""
        a_B1D, cache = self.attn.decode_step(self.attn_norm(h_B1D), cache, layer, i)
        return self._finish(h_B1D, a_B1D), cache

    def _finish(self, h_BND, a_BND, dropout_key=None):
        """H + a + b, given the attention branch a."""
        x_BND = self.ff_norm(h_BND + a_BND)
        b_BND = _dropout(self.ff_out(_linear_gelu(self.ff_in, x_BND)), self.dropout, dropout_key)
        return h_BND + a_BND + b_BND  # float32 stream + compute-dtype branches -> float32
