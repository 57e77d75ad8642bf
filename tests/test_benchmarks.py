"""The model benchmark's training step: with the update it trains (the parameters move, the
loss is the gradient step's), and its stride for a context length; a ratio only against a
baseline that was measured."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_jax.bench import model as model_bench
from sparse_jax.bench import tools, training
from sparse_jax.model.config import ModelConfig
from sparse_jax.model.transformer import SparseTransformer


def test_the_timed_step_with_update_is_loss_gradients_and_adamw():
    cfg = ModelConfig(seq_len=64, num_layers=1, d_model=16, num_heads=2, stride=8)
    tokens = jax.random.randint(jax.random.key(1), (2, 65), 0, 256, dtype=jnp.int32)
    grad_step, _, _ = model_bench.step_function(cfg)
    loss, grads = grad_step(nnx.state(SparseTransformer(cfg, rngs=nnx.Rngs(0))), None, tokens)
    update_step, _, tx = model_bench.step_function(cfg, update=True)
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


def test_a_ratio_is_only_against_a_baseline_that_was_measured():
    assert tools.ratio(3.0, 1.5) == 2.0
    for value, baseline in [(3.0, None), (None, 1.5), (3.0, 0.0), (3.0, math.nan),
                            (math.inf, 1.0), (3.0, "exit 1")]:
        assert tools.ratio(value, baseline) is None
    tools.require_baselines([], optional=False)
    tools.require_baselines(["torch dense at n=64"], optional=True)
    with pytest.raises(ValueError, match="torch dense at n=64 was not measured.*"
                                         "--baseline_optional"):
        tools.require_baselines(["torch dense at n=64"], optional=False)


@pytest.mark.parametrize("torch_ok", [False, True])
def test_the_training_benchmark_shows_a_failed_twin_as_not_measured(monkeypatch, tmp_path,
                                                                    torch_ok):
    """Without torch the twin's run fails: the project's row says "not measured" (it once said
    1.00x torch, a ratio to itself), the JSON names the baseline; with it, the ratio is the
    two measured speeds'."""
    def run_isolated(argv, **kwargs):
        case = json.loads(argv[-1])
        if case["impl"] == "torch":
            return {"train_bits": {"2": 8.0}, "valid_bits": 8.0, "steps_per_s": 2.0} \
                if torch_ok else {"error": "exit 1: ModuleNotFoundError: No module named 'torch'"}
        return {"train_bits": {"2": 7.0}, "valid_bits": 7.0, "steps_per_s": 3.0}

    monkeypatch.setattr(tools, "run_isolated", run_isolated)
    lines = []
    info = training.benchmark_training(
        [64], steps=[2], data_path=os.path.join(os.path.dirname(__file__), "..", "data",
                                               "kjv.html.gz"),
        patterns=["dense"], output_dir=str(tmp_path), log=lines.append)
    torch_row, jax_row = info["rows"]
    if torch_ok:
        assert jax_row["vs_torch"] == 1.5 and torch_row["vs_torch"] == 1.0
        assert info["baselines_not_measured"] == [] and "1.50x torch" in lines[-1]
    else:
        assert jax_row["vs_torch"] == tools.NOT_MEASURED and torch_row["vs_torch"] is None
        assert info["baselines_not_measured"] == ["torch dense at n=64"]
        assert "torch not measured" in lines[-1] and "x torch" not in lines[-1]
        assert "| not measured |" in (tmp_path / "results.md").read_text()
