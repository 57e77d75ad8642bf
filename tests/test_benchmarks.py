"""The model benchmark's training step: with the update it trains (the parameters move, the
loss is the gradient step's), and its stride for a context length."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax.bench import model as model_bench
from sparse_jax.model.config import ModelConfig
from sparse_jax.model.transformer import SparseTransformer


def test_the_timed_step_with_update_is_loss_gradients_and_adamw():
    cfg = ModelConfig(seq_len=64, num_layers=1, d_model=16, num_heads=2, stride=8)
    tokens = jax.random.randint(jax.random.key(1), (2, 65), 0, 256, dtype=jnp.int32)
    grad_step, _, _ = model_bench._grad_fn(cfg)
    loss, grads = grad_step(nnx.state(SparseTransformer(cfg, rngs=nnx.Rngs(0))), None, tokens)
    update_step, _, tx = model_bench._grad_fn(cfg, update=True)
    state = nnx.state(SparseTransformer(cfg, rngs=nnx.Rngs(0)))
    before = jax.tree.map(np.asarray, state)
    same_loss, after, opt_state = update_step(state, tx.init(state), tokens)
    assert np.isfinite(loss) and same_loss == loss
    moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), after, before)
    assert all(jax.tree.leaves(moved))  # AdamW moves every parameter in its first step
    assert jax.tree.structure(grads) == jax.tree.structure(after)


def test_stride_sqrt_is_the_largest_power_of_two_at_most_sqrt_n():
    assert [model_bench._stride("sqrt", n) for n in (4096, 8192, 16384, 65536, 131072)] == \
        [64, 64, 128, 256, 256]
    assert model_bench._stride("96", 4096) == 96
