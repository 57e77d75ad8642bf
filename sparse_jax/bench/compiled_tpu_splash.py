"""Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) on our patterns'
exact masks, as the TPU compile builds it beside our kernels (moved from
``sparse_jax.bench.compiled_tpu``, which re-exports ``splash_mask`` and ``NUMPY_MASK_MAX``).

  splash_mask(pattern, n)          one head's mask: the pattern's exact mask, or its rule
  splash_program(program, mesh)    (loss gradient or forward, abstract q, k, v) of splash
  nonzero_blocks(spec, n, b)       blocks of the mask that hold a kept pair (splash's tiles)
"""

from __future__ import annotations

NUMPY_MASK_MAX = 16384  # longer: the pattern's rule as a mask splash computes (n x n bytes)


def splash_mask(pattern: str, n: int):
    """Splash attention's mask for ``pattern`` at length ``n``, one head's: the pattern's exact
    boolean mask (``PatternSpec.mask``) as a ``NumpyMask`` up to ``NUMPY_MASK_MAX``, beyond it
    the pattern's rule (``kernel.mask_rule``) as a computable mask, which
    splash evaluates per block on the host and in its kernels (as its own causal and local
    masks); for "dense" splash's ``CausalMask``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    from sparse_jax.attention import blocks as kernel
    from sparse_jax.bench.attention import parse_pattern

    spec = parse_pattern(pattern, n)[0]
    if spec.kind == "dense":
        return masks.CausalMask((n, n))
    if n <= NUMPY_MASK_MAX:
        return masks.NumpyMask(spec.mask(n))
    class PatternMask(masks._ComputableMask):  # hashable, as splash's own masks are
        def __eq__(self, other):
            return type(other) is type(self) and (other.shape, other.spec) == (self.shape,
                                                                              self.spec)

        def __hash__(self):
            return hash((type(self), self.shape, self.spec))

    mask = PatternMask((n, n), kernel.mask_rule(spec))
    mask.spec = spec
    return mask


def splash_program(program: dict, mesh):
    """(loss gradient or forward, abstract q, k, v) of splash attention over ``program``'s mask
    and block size, [H, n, d] bfloat16 (one sequence: B = 1)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n, heads, d, b = program["seq_len"], program["heads"], program["head_dim"], program["block"]
    if program["batch"] != 1:
        raise ValueError("splash programs take one sequence (batch 1)")
    mask = masks.MultiHeadMask([splash_mask(program["pattern"], n)] * heads)
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                              block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b,
                              block_kv_dq=b)
    attend = splash.make_splash_mha_single_device(mask=mask, block_sizes=sizes)
    x = jax.ShapeDtypeStruct((heads, n, d), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def loss(q, k, v):
        return attend(q, k, v).astype(jnp.float32).sum()

    return (loss if program.get("forward") else jax.grad(loss, argnums=(0, 1, 2))), (x, x, x)


def nonzero_blocks(spec, n: int, b: int) -> int:
    """Blocks of ``b`` × ``b`` of the pattern's n × n mask holding a kept pair (a block row of
    the mask at a time, by the pattern's rule)."""
    import numpy as np

    from sparse_jax.attention import blocks as kernel

    keep, keys = kernel.mask_rule(spec), np.arange(n)[None]
    return sum(int(keep(np.arange(i, i + b)[:, None], keys).reshape(b, -1, b).any(
        axis=(0, 2)).sum()) for i in range(0, n, b))
