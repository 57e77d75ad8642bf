"""The train_step stage's dense check: one training step's loss and gradients of the paper's
enwik8 model, dense, at a size all three legs fit (the reference holds every layer's n × n
scores), computed three ways:

  cudnn      the model as it runs dense on a GPU (pattern dense, attention "pallas": cuDNN's
             fused attention); "not measured" unless the compiled step holds cuDNN's fused
             attention (a CPU has none; the model falls back to XLA where cuDNN refuses)
  xla        the model's XLA path (pattern dense, attention "xla": ``causal.causal_attention``)
  reference  the same model with every layer's attention the float32 reference
             (``attention.reference.dense_attention`` under the causal mask, output in the
             model's dtype): the obviously-correct one

Each leg's loss and gradients are compared with the reference's: the loss's relative difference
and the gradients' relative L2 error (over every parameter at once). Equal within bfloat16's
tolerance (``TOLERANCE``), or the check names the leg that differs. The long-context study's
dense 16k model learned slower per step than the sparse ones (2026-11-28): this says whether
cuDNN's step is the same step."""

from __future__ import annotations

import contextlib

from sparse_jax.bench.accelerator.common import fmt, one_line

LEGS = ("cudnn", "xla", "reference")
# bfloat16 keeps 8 bits of mantissa (a relative step of 2^-8 = 0.4%): the legs round their
# attention differently, and 8-30 layers of bf16 branches carry it to the loss and gradients.
TOLERANCE = {"loss": 0.01, "grads": 0.05}


def plan(dry_run: bool) -> dict:
    if dry_run:
        return {"batch_size": 2, "model": dict(
            seq_len=64, num_layers=2, d_model=32, num_heads=2, pattern="dense",
            dtype="bfloat16", remat="full", scan_layers=True)}
    # the paper's width and heads (configs/enwik8.py), 8 of its 30 layers, at 4,096 bytes: the
    # reference's float32 scores are 2 × 8 × 4,096² × 4 B = 1.1 GB a layer
    return {"batch_size": 2, "model": dict(
        seq_len=4096, num_layers=8, d_model=512, num_heads=8, pattern="dense",
        dtype="bfloat16", remat="full", scan_layers=True)}


@contextlib.contextmanager
def _reference_attention():
    """Every attention layer of a model traced inside this block runs the float32 reference."""
    import jax.numpy as jnp

    from sparse_jax.attention.reference import dense_attention
    from sparse_jax.model import layers

    def reference(q, k, v, specs, implementation=None, block_sizes=None):
        n = q.shape[1]
        return dense_attention(q, k, v, jnp.tril(jnp.ones((n, n), bool)))

    saved = layers.multi_spec_attention
    layers.multi_spec_attention = reference
    try:
        yield
    finally:
        layers.multi_spec_attention = saved


def _leg(name: str, p: dict):
    """(loss, flat gradients as float32 numpy arrays) of one leg, or a ValueError saying why
    the leg cannot be measured here."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from sparse_jax.bench.model import step_function
    from sparse_jax.model import transformer as model_lib
    from sparse_jax.model.config import ModelConfig

    cfg = ModelConfig(**p["model"], attention="pallas" if name == "cudnn" else "xla")
    step, _, _ = step_function(cfg)
    state = nnx.state(model_lib.SparseTransformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (p["batch_size"], cfg.seq_len + 1), 0, 256,
                                dtype=jnp.int32)
    with _reference_attention() if name == "reference" else contextlib.nullcontext():
        compiled = step.lower(state, None, tokens).compile()
    if name == "cudnn" and "cudnn" not in compiled.as_text().lower():
        raise ValueError(f"no cuDNN fused attention in the compiled step on "
                         f"{jax.devices()[0].platform}")
    loss, grads = compiled(state, None, tokens)
    leaves = [np.asarray(g, np.float32).ravel() for g in jax.tree.leaves(grads)]
    return float(loss), np.concatenate(leaves)


def run_check(p: dict) -> dict:
    """The three legs and their differences from the reference: {"legs": {leg: {"loss"} or
    {"not_measured": why}}, "diffs": {leg: {"loss", "grads", "within"}}, "verdict": one line}."""
    import numpy as np

    legs, values = {}, {}
    for name in LEGS:
        try:
            loss, grads = _leg(name, p)
            values[name] = (loss, grads)
            legs[name] = {"loss": loss, "grad_norm": float(np.linalg.norm(grads))}
        except Exception as e:  # noqa: BLE001  a leg this machine cannot run: said, not fatal
            legs[name] = {"not_measured": one_line(e)}
    diffs = {}
    if "reference" in values:
        ref_loss, ref_grads = values["reference"]
        for name in LEGS[:-1]:
            if name in values:
                loss, grads = values[name]
                d = {"loss": abs(loss - ref_loss) / abs(ref_loss),
                     "grads": float(np.linalg.norm(grads - ref_grads)
                                    / max(np.linalg.norm(ref_grads), 1e-30))}
                d["within"] = d["loss"] <= TOLERANCE["loss"] and d["grads"] <= TOLERANCE["grads"]
                diffs[name] = d
    return {"legs": legs, "diffs": diffs, "verdict": verdict(legs, diffs)}


def verdict(legs: dict, diffs: dict) -> str:
    """One line: which legs equal the reference within bfloat16's tolerance, which differ, which
    were not measured."""
    if "loss" not in legs.get("reference", {}):
        return "not measured: the reference did not run"
    same = [n for n, d in diffs.items() if d["within"]]
    differ = [n for n, d in diffs.items() if not d["within"]]
    missing = [n for n in LEGS if "not_measured" in legs.get(n, {})]
    parts = []
    if same:
        parts.append(f"{' and '.join(same)} {'equal' if len(same) > 1 else 'equals'} the "
                     "reference within bf16's tolerance")
    if differ:
        parts.append(f"{' and '.join(differ)} {'differ' if len(differ) > 1 else 'differs'} "
                     "from the reference")
    if missing:
        parts.append(f"{' and '.join(missing)} not measured")
    return "; ".join(parts)


def summary(check: dict, p: dict) -> list[str]:
    """The dense check's table and verdict (results.md)."""
    m = p["model"]
    lines = [f"Dense check: one training step (loss, gradients) of the paper's model, dense, at "
             f"{p['batch_size']} × {m['seq_len']}, {m['num_layers']} layers, d={m['d_model']}, "
             f"H={m['num_heads']}, {m['dtype']}; differences from the float32 reference "
             f"attention (loss: relative; gradients: relative L2 over every parameter); "
             f"tolerance {TOLERANCE['loss']:g} and {TOLERANCE['grads']:g}:", "",
             "| leg | loss (bits) | gradient norm | Δ loss | Δ gradients | result |",
             "|---|---|---|---|---|---|"]
    for name in LEGS:
        leg, d = check["legs"].get(name, {}), check["diffs"].get(name, {})
        result = leg.get("not_measured") and f"not measured: {leg['not_measured']}"
        if not result:
            result = ("the base" if name == "reference" else
                      "within tolerance" if d.get("within") else "**differs**")
        lines.append(f"| {name} | {fmt(leg.get('loss'), '.5g')} | "
                     f"{fmt(leg.get('grad_norm'), '.4g')} | {fmt(d.get('loss'), '.2e')} | "
                     f"{fmt(d.get('grads'), '.2e')} | {result} |")
    return lines + ["", f"Dense check: {check['verdict']}.", ""]
