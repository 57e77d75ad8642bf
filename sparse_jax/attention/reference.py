"""The references every fast path is held to, and the checks of their inputs: ``dense_attention``
(a mask), ``gather_attention`` (index arrays) and ``decode_attention`` (one query per head over
gathered keys, a step of the cached decoder). They share one masked softmax (``_masked_exp``),
whose masked score ``NEG`` and row-maximum floor ``FLOOR`` every implementation uses.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

NEG = -1e30  # finite "minus infinity" for masked scores: no NaN in values or gradients
FLOOR = -1e20  # floor of a row maximum: exp(NEG - FLOOR) == 0 even for a row with no key

_AXES = ("batch", "seq", "heads", "head_dim")


def dot(subscripts, a, b):
    """``jnp.einsum`` with float32 accumulation (products of bfloat16 inputs too)."""
    return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32)


def _check_array(name: str, x, axes: tuple[str, ...]) -> None:
    """ValueError naming `name` unless `x` is a floating-point array of rank len(axes) with no
    axis of size 0 (which would divide by zero or reduce nothing further on)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise ValueError(f"{name} must be an array [{', '.join(axes)}], got "
                         f"{type(x).__name__}")
    if x.ndim != len(axes):
        raise ValueError(f"{name} must be [{', '.join(axes)}] (rank {len(axes)}); got shape "
                         f"{tuple(x.shape)}")
    for i, (axis, size) in enumerate(zip(axes, x.shape)):
        if size == 0:
            raise ValueError(f"{name} has size 0 along axis {i} ({axis}): shape "
                             f"{tuple(x.shape)}; every axis needs at least 1")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be floating point, got {x.dtype}")


def check_qkv(q, k, v):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if hasattr(x, "ndim") and x.ndim != 4:
            raise ValueError("q, k, v must be [batch, seq, heads, head_dim]; got shapes "
                             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
                             if all(hasattr(y, "shape") for y in (q, k, v)) else
                             f"{name} must be [batch, seq, heads, head_dim]; got shape "
                             f"{tuple(x.shape)}")
        _check_array(name, x, _AXES)
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape, got {q.shape} and {k.shape}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must match q in [batch, seq, heads], got {v.shape} vs {q.shape}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


# ---------------------------------------------------------------------------------------------
# References.


def _masked_exp(scores, mask):
    """The masked softmax shared by the references and the decoding step, before its division:
    ``exp(score - row max)`` where ``mask`` holds, 0 elsewhere, and the row sums (float32). The
    caller divides by ``max(sum, 1e-30)``, so a row with no key gives zeros, not NaN."""
    scores = jnp.where(mask, scores, NEG)
    probs = jnp.where(mask, jnp.exp(scores - scores.max(-1, keepdims=True)), 0.0)
    return probs, probs.sum(-1, keepdims=True)


def dense_attention(q, k, v, mask):
    """The obviously-correct reference: ``softmax(q kᵀ / √d, masked) v`` in float32.

    q, k: [B, n, H, d]; v: [B, n, H, dv]; mask: bool, broadcastable to [B, H, n, n]
    (``mask[..., i, j]``: query i may attend key j). Rows with no key give zeros.
    """
    check_qkv(q, k, v)
    mask = jnp.asarray(mask, dtype=bool)
    batch, n, heads, _ = q.shape
    try:
        jnp.broadcast_shapes(mask.shape, (batch, heads, n, n))
    except ValueError:
        raise ValueError(f"mask of shape {mask.shape} does not broadcast to [batch, heads, n, n] "
                         f"= {(batch, heads, n, n)}") from None
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    probs, total = _masked_exp(scores / math.sqrt(q.shape[-1]), mask)
    probs = probs / jnp.maximum(total, 1e-30)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32))
    return out.astype(q.dtype)


def gather_attention(q, k, v, indices):
    """Second reference: gathers each query's keys (``k[idx]``, [B, n, K, H, d]). Slow, O(n·K·d)
    memory; never the default."""
    check_qkv(q, k, v)
    idx = jnp.asarray(indices)
    valid = idx >= 0
    safe = jnp.where(valid, idx, 0)
    k_g, v_g = k[:, safe], v[:, safe]  # [B, n, K, H, d]
    scores = jnp.einsum("bqhd,bqkhd->bhqk", q, k_g, preferred_element_type=jnp.float32)
    probs, total = _masked_exp(scores / math.sqrt(q.shape[-1]), valid[None, None])
    probs = probs / jnp.maximum(total, 1e-30)
    return jnp.einsum("bhqk,bqkhd->bqhd", probs, v_g.astype(jnp.float32)).astype(q.dtype)


def decode_attention(q_BHD, k_BKHD, v_BKHD, valid):
    """Attention of one query per (batch, head) over K keys: one position of a cached decoder.

    q: [B, H, d]; k: [B, K, H, d]; v: [B, K, H, dv]; valid: bool broadcastable to [B, H, K]
    (False: not a key of this query). As in ``sparse_attention``, q is scaled by 1/√d in its
    dtype, scores and softmax are float32 and the probabilities enter the value product in the
    input dtype, so a step rounds as its row of the full pass does. Returns [B, H, dv] in q's
    dtype; zeros for a query with no valid key.
    """
    _check_array("q", q_BHD, ("batch", "heads", "head_dim"))
    _check_array("k", k_BKHD, ("batch", "keys", "heads", "head_dim"))
    _check_array("v", v_BKHD, ("batch", "keys", "heads", "value_dim"))
    q_BHD = q_BHD * jnp.asarray(1.0 / math.sqrt(q_BHD.shape[-1]), q_BHD.dtype)
    scores = jnp.einsum("bhd,bkhd->bhk", q_BHD, k_BKHD, preferred_element_type=jnp.float32)
    probs, total = _masked_exp(scores, valid)
    out = jnp.einsum("bhk,bkhd->bhd", probs.astype(v_BKHD.dtype), v_BKHD,
                     preferred_element_type=jnp.float32)
    return (out / jnp.maximum(total, 1e-30)).astype(q_BHD.dtype)
