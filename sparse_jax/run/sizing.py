"""The size and cost of a model config, without allocating it: parameters (counted by formula
and from abstract shapes), the attention schedule, mean keys per query, FLOPs and activation
memory (`describe`), and the same as text for `scripts/describe.py` (`describe_text`); what
each device stores of a run's training state (`per_device_memory`)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax import sharding as sharding_lib
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.cli import available_memory
from sparse_jax.model.config import DTYPES, ModelConfig
from sparse_jax.model.transformer import SparseTransformer, position_table_sizes
from sparse_jax.run.optim import abstract_train_state


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters, by formula (equals the allocated model's count)."""
    d, f, qk, v = cfg.d_model, cfg.ff_dim, cfg.qk_dim, cfg.vocab_size
    embeddings = v * d + d * sum(position_table_sizes(cfg))
    attention = 2 * (d * qk + qk) + 2 * (d * d + d)  # query, key; value, output
    feed_forward = d * f + f + f * d + d
    norms = 2 * 2 * d
    return embeddings + cfg.num_layers * (attention + feed_forward + norms) + 2 * d + d * v + v


STATE_COPIES = 3  # what training holds of each parameter at least: itself, AdamW's two moments


def machine_memory() -> int | None:
    """Bytes the training state could take here: on a CPU the host memory available now, on
    an accelerator every local device's limit together; None where that is not known."""
    if jax.default_backend() == "cpu":
        return available_memory()
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.local_devices()]
    return sum(limits) if limits and all(limits) else None


def least_bytes(cfg: ModelConfig, batch_size: int = 1, training: bool = True) -> int:
    """A lower bound on the memory a step of `cfg` on `batch_size` sequences takes, by formula
    (nothing built): training, the parameters and AdamW's two moments (`STATE_COPIES`) and each
    layer's float32 input of every token (what even whole-block remat keeps, `describe`);
    inference, the parameters and each layer's keys and values of every token (the decoder's
    cache)."""
    n, d, layers = cfg.seq_len, cfg.d_model, cfg.num_layers
    params = param_count(cfg) * jnp.dtype(cfg.param_dtype).itemsize
    if training:
        return params * STATE_COPIES + batch_size * n * layers * 4 * d
    c = jnp.dtype(DTYPES[cfg.dtype]).itemsize
    return params + batch_size * n * layers * (cfg.qk_dim + d) * c


def check_fits(cfg: ModelConfig, batch_size: int = 1, training: bool = True,
               fields: str = "model.vocab_size, model.d_model, model.num_layers, "
                             "model.ff_mult, model.seq_len or batch_size",
               memory: int | None = None) -> None:
    """ValueError (one line, before anything is allocated) when `least_bytes` exceeds `memory`
    (default: `machine_memory`): a size that passes every field's own check but could never run
    here (vocab_size = 2^31 - 1 once ran into an out-of-memory traceback at initialisation).
    `fields`: what to lower, as the caller's flags name them."""
    memory = machine_memory() if memory is None else memory
    need = least_bytes(cfg, batch_size, training)
    if memory is not None and need > memory:
        raise ValueError(f"the model ({param_count(cfg):,} parameters, {batch_size:,} "
                         f"sequence(s) of {cfg.seq_len:,}) needs at least {need / 2**30:,.1f} "
                         f"GiB to {'train' if training else 'run'}, and this machine has "
                         f"{memory / 2**30:,.1f} GiB; lower {fields} (scripts/describe.py "
                         "shows the sizes)")


@functools.lru_cache(maxsize=64)
def _mean_keys(spec: PatternSpec, seq_len: int) -> float:
    return spec.mean_keys(seq_len)


def _attention_workspace(specs, batch: int, heads: int, n: int, qk: int, d: int) -> float:
    """One layer's transient attention memory in bytes, per head group (``specs``): a dense group
    holds its float32 scores and probabilities (8·B·H·n·|S|); the block-sparse path holds only
    its float32 accumulators (dq, dk, dv and the forward's weighted values, 4·B·n·(2qk + 2d))
    and one scan step's score tiles (a few MB), never the pattern's [n, |S|] scores: counting
    those put fixed at 131,072 at 66 GiB for a step that peaks at 10 GiB."""
    groups = len(specs)
    return sum(8 * batch * heads / groups * n * _mean_keys(spec, n) if spec.kind == "dense"
               else 4 * batch * n * (2 * qk + 2 * d) / groups for spec in specs)


def describe(cfg: ModelConfig, batch_size: int = 1) -> dict:
    """Size, attention schedule and cost estimates of ``cfg``; allocates no parameters.

    flops_per_token: forward matmul FLOPs (2 per multiply-add) of one token: projections
    2(2d·qk + 2d²), feed-forward 4d·f, attention 2|S|(qk + d) with |S| the layer's mean keys per
    query, head 2d·vocab. The block-sparse kernels also score masked keys inside their tiles
    (up to ~2x |S|), which this does not count. flops_per_step = 3 x forward x n x batch
    (forward + backward); remat recomputes the forward once more (~4x).

    Activation memory (bytes; B batch, n seq_len, c compute-dtype bytes, H heads):
    per layer and token the backward keeps s = 4·2d (float32 residual stream at both norms)
    + c·(2d + 2qk + 2d + 2f) (norm outputs, q, k, v, attention output, GeLU in/out)
    + 4·(d + H) (float32 attention output and log-sum-exp saved by the custom backward)
    [+ 2d dropout masks] [+ 8·H·n for a dense layer: its probabilities and scores];
    the head keeps 4·(d + 2·vocab). A transient attention workspace of one layer comes on top
    (``_attention_workspace``): a dense head group's float32 scores and probabilities,
    8·B·H·n·|S|, or a block-sparse group's float32 accumulators, 4·B·n·(2qk + 2d).
    Without remat: B·n·(N·s + head) + w. With remat (whole blocks): B·n·(N·4d + s + head) + w
    (each block's float32 input, plus one block recomputed at a time; on XLA:CPU only reached
    with ``scan_layers``, see the module docstring). This counts what the backward must keep;
    XLA's buffer plan adds layout copies and backward temporaries on top (see
    scripts/benchmark_model.py), so read it as a lower bound.
    """
    model = nnx.eval_shape(lambda: SparseTransformer(cfg, rngs=nnx.Rngs(0)))
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    d, f, qk, n, heads = cfg.d_model, cfg.ff_dim, cfg.qk_dim, cfg.seq_len, cfg.num_heads
    layer_specs_ = cfg.specs()
    keys_per_layer = [np.mean([_mean_keys(s, n) for s in specs]) for specs in layer_specs_]
    flops = sum(2 * (2 * d * qk + 2 * d * d) + 4 * d * f + 2 * k * (qk + d)
                for k in keys_per_layer) + 2 * d * cfg.vocab_size
    c = jnp.dtype(DTYPES[cfg.dtype]).itemsize
    per_layer = []
    for specs in layer_specs_:
        s = 8 * d + c * (4 * d + 2 * qk + 2 * f) + 4 * (d + heads)
        s += 2 * d if cfg.dropout else 0
        s += sum(8 * heads // len(specs) * n for spec in specs if spec.kind == "dense")
        per_layer.append(s)
    head = 4 * (d + 2 * cfg.vocab_size)
    workspace = max(_attention_workspace(specs, batch_size, heads, n, qk, d)
                    for specs in layer_specs_)
    tokens = batch_size * n
    return {
        "params": params,
        "param_count_formula": param_count(cfg),
        "schedule": [" | ".join(map(str, specs)) for specs in layer_specs_],
        "mean_keys_per_query": float(np.mean(keys_per_layer)),
        "flops_per_token": int(flops),
        "flops_per_step": int(3 * flops * tokens),
        "batch_size": batch_size,
        "activation_bytes": int(tokens * (sum(per_layer) + head) + workspace),
        "activation_bytes_remat": int(tokens * (cfg.num_layers * 4 * d + max(per_layer) + head)
                                      + workspace),
    }


def _schedule_lines(schedule: list[str]) -> list[str]:
    """The repeating cycle of layer patterns, or runs of equal layers."""
    n = len(schedule)
    period = next(p for p in range(1, n + 1) if all(schedule[k] == schedule[k % p]
                                                     for k in range(n)))
    if period == 1:
        return [f"  all {n} layers: {schedule[0]}"]
    if period <= n // 2:
        return [f"  a cycle of {period} layers, {n / period:g} times:"] + [
            f"    layer k = {i} mod {period}: {spec}" for i, spec in enumerate(schedule[:period])]
    lines, layer = [], 0
    for spec, run in itertools.groupby(schedule):
        count = len(list(run))
        lines.append(f"  layers {layer if count == 1 else f'{layer}-{layer + count - 1}'}: {spec}")
        layer += count
    return lines


def describe_text(cfg: ModelConfig, info: dict) -> str:
    """`describe(cfg)` (plus `per_device` memory, if present) as lines a person reads."""
    gib, mib = 2 ** 30, 2 ** 20
    lines = [
        f"parameters           {info['params']:,} ({info['params'] / 1e6:.1f}M)",
        f"context              {cfg.seq_len:,}, {cfg.num_layers} layers, d={cfg.d_model}, "
        f"{cfg.num_heads} heads, qk={cfg.qk_dim}, ff={cfg.ff_dim}",
        "positions            "
        + ("no absolute tables" if cfg.pos_emb == "none" else f"{cfg.pos_emb} tables")
        + (", rotary queries and keys" if cfg.rotary else "")
        + (f", column heads' keys/values shifted 1..{cfg.stride} back" if cfg.shifted_heads
           else ""),
        f"keys per query       {info['mean_keys_per_query']:.1f} mean over layers "
        f"(dense: {(cfg.seq_len + 1) / 2:.1f})",
        f"forward FLOPs/token  {info['flops_per_token'] / 1e6:.1f}M",
        f"train FLOPs/step     {info['flops_per_step'] / 1e12:.2f}T (batch "
        f"{info['batch_size']}, 3x forward)",
        f"activation memory    {info['activation_bytes'] / gib:.2f} GiB without remat, "
        f"{info['activation_bytes_remat'] / gib:.2f} GiB with (estimate; config: "
        f"remat={cfg.remat})"]
    if "per_device" in info:
        mem = info["per_device"]
        lines.append(f"per device           {mem['params_bytes'] / mib:,.1f} MiB parameters + "
                     f"{mem['optimizer_bytes'] / mib:,.1f} MiB optimizer state on mesh "
                     f"data={mem['mesh']['data']} x fsdp={mem['mesh']['fsdp']} x "
                     f"seq={mem['mesh']['seq']}")
    return "\n".join(lines + ["attention schedule"] + _schedule_lines(info["schedule"]))


def per_device_memory(config, devices: int) -> dict:
    """What each device stores of the training state on config.mesh over `devices` devices:
    {"mesh", "params_bytes", "optimizer_bytes"}. From shapes and the sharding rules only (no
    device or allocation needed, so it can size a run for a machine you do not have)."""
    shape = sharding_lib.mesh_shape(devices, config.mesh.data, config.mesh.fsdp,
                                    config.mesh.get("seq", 1))
    state = abstract_train_state(config)
    return {"mesh": shape, "params_bytes": sharding_lib.per_device_bytes(state["params"], shape),
            "optimizer_bytes": sharding_lib.per_device_bytes(state["opt"], shape)}
