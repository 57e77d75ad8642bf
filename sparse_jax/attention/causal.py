"""Dense causal attention (the pattern "dense") without an n×n score array: query chunks with a
flash-style custom backward in XLA, or one fused CPU kernel forward and one backward
(``attention.native``). ``api.sparse_attention`` chooses; on a GPU it runs cuDNN instead.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.attention import native as _native
from sparse_jax.attention.reference import NEG as _NEG
from sparse_jax.attention.reference import dot

# Dense causal attention (pattern "dense"): query rows in static chunks, chunk [q0, q1) against
# keys [0, q1), so the keys after a chunk are never scored (about half of n² with 16 chunks
# instead of all of it), each chunk's softmax is whole (it holds every key of its queries), and
# the backward recomputes a chunk's probabilities from the saved log-sum-exp instead of keeping
# [B, H, n, n] of them. On a CPU the small score tiles also stay in cache: 1.3-1.7x faster than
# the full masked square (docs/design.md §3).

_DENSE_CHUNKS = 16  # most query chunks of dense attention (unrolled: each is a few ops)
_DENSE_MIN_CHUNK = 64  # fewest query rows in a chunk


def _causal_chunks(n: int) -> list[tuple[int, int]]:
    size = max(_DENSE_MIN_CHUNK, -(-n // _DENSE_CHUNKS))
    return [(q0, min(q0 + size, n)) for q0 in range(0, n, size)]


def _causal_scores(q, k, q0, q1):
    """Scores of queries [q0, q1) over keys [0, q1), the later keys masked: [B, H, q1 - q0, q1]."""
    keep = np.arange(q0, q1)[:, None] >= np.arange(q1)[None, :]
    return jnp.where(keep, dot("bhqd,bhkd->bhqk", q[:, :, q0:q1], k[:, :, :q1]), _NEG), keep


def _causal_forward(q, k, v):
    """q pre-scaled by 1/√d; q, k, v: [B, H, n, d]. Returns the output [B, H, n, dv] and the
    log-sum-exp [B, H, n], float32."""
    outs, lses = [], []
    for q0, q1 in _causal_chunks(q.shape[2]):
        scores, _ = _causal_scores(q, k, q0, q1)
        m = scores.max(-1, keepdims=True)
        probs = jnp.exp(scores - m)
        total = probs.sum(-1, keepdims=True)
        outs.append(dot("bhqk,bhkd->bhqd", probs.astype(v.dtype), v[:, :, :q1]) / total)
        lses.append((m + jnp.log(total))[..., 0])
    return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2)


@jax.custom_vjp
def causal_attention(q, k, v):
    return _causal_forward(q, k, v)[0]


def _causal_attention_fwd(q, k, v):
    out, lse = _causal_forward(q, k, v)
    return out, (q, k, v, out, lse)


def _causal_attention_bwd(residuals, d_out):
    q, k, v, out, lse = residuals
    d_out = d_out.astype(jnp.float32)
    delta = (d_out * out).sum(-1)  # D_i = sum_j P_ij dP_ij = dO_i · O_i
    d_q = []
    d_k = jnp.zeros(k.shape, jnp.float32)
    d_v = jnp.zeros(v.shape, jnp.float32)
    for q0, q1 in _causal_chunks(q.shape[2]):
        scores, keep = _causal_scores(q, k, q0, q1)
        probs = jnp.where(keep, jnp.exp(scores - lse[:, :, q0:q1, None]), 0.0)
        d_chunk = d_out[:, :, q0:q1]
        d_v = d_v.at[:, :, :q1].add(dot("bhqk,bhqd->bhkd", probs.astype(v.dtype), d_chunk))
        d_probs = dot("bhqd,bhkd->bhqk", d_chunk, v[:, :, :q1])
        d_scores = probs * (d_probs - delta[:, :, q0:q1, None])
        d_q.append(dot("bhqk,bhkd->bhqd", d_scores, k[:, :, :q1]))
        d_k = d_k.at[:, :, :q1].add(dot("bhqk,bhqd->bhkd", d_scores, q[:, :, q0:q1]))
    d_q = jnp.concatenate(d_q, axis=2)
    return tuple(g.astype(x.dtype) for g, x in zip((d_q, d_k, d_v), (q, k, v)))


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


# Dense causal attention through the fused CPU kernels ("native", and "auto" on a CPU): the
# band whose window is the whole sequence, one call forward (output and log-sum-exp) and one
# backward (D = dO · O inside), on the inputs' layout [B, n, H, d] with no transpose, no chunk
# and no accumulator in XLA. CPU time of forward + backward against the chunks below and
# PyTorch's fused SDPA (B=6, H=4, d=32, one core): 6.7 / 9.7 / 12.7 ms at n=256, 89 / 218 /
# 141 ms at 1,024, 1.35 / — / 1.61 s at 4,096.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def native_causal_attention(scale, q, k, v):
    """q, k, v: [B, n, H, d] float32 (q not scaled): causal attention, [B, n, H, dv]."""
    return _native.dense_forward(q, k, v, scale)[0]


def _native_causal_attention_fwd(scale, q, k, v):
    out, lse = _native.dense_forward(q, k, v, scale)
    return out, (q, k, v, out, lse)


def _native_causal_attention_bwd(scale, residuals, d_out):
    return _native.dense_backward(*residuals[:4], d_out, residuals[4], scale)


native_causal_attention.defvjp(_native_causal_attention_fwd, _native_causal_attention_bwd)
