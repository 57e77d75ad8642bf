"""Stage million: the model of ``configs/enwik8.py:size=million`` (the paper's width, 20 layers,
strided l = 1,024, a context of 1,048,576 bytes) trained for a few steps on one GPU: compile
time, XLA's plan, the device's peak memory, the step time and the loss of each step.

The window is the first 1,048,577 bytes of the shipped code corpus (enwik8 is not on a lent
machine), the same window every step: the loss falling from ~8 bits says the step learns, not
what the model would reach. The step is the benchmarks' (``bench.model.step_function``: the loss,
its gradients, AdamW with clipping), as in ``train_step``. JAX may take 95% of the GPU's memory
here (``XLA_PYTHON_CLIENT_MEM_FRACTION``; the driver's default 75% leaves an 80 GB H100 short of
the 75.6 GB plan)."""

from __future__ import annotations

import os
import time

from sparse_jax.bench.accelerator.common import CODE_CORPUS, REPO, emit, fmt

# Compiled for an H100 on a CPU the step plans 75.6 GB (docs/benchmarks/compiled_h100/million);
# its compile is scanned layers (one block compiled), a step ~2 s by the cost model's guess:
# a minute of compile and warm-up, three timed steps and a margin.
CAP, DRY_CAP = 100, 60
MEMORY_FRACTION = "0.95"


def plan(dry_run: bool) -> dict:
    if dry_run:  # the same code on a CPU: a 2-layer model at 1,024 bytes, XLA attention
        return {"config": "configs/enwik8.py:size=million",
                "overrides": {"model.seq_len": 1024, "model.num_layers": 2,
                              "model.d_model": 64, "model.num_heads": 2, "model.stride": 32,
                              "model.c": 8, "model.attention": "xla", "model.kernel": "",
                              "model.dtype": "float32"}, "steps": 2}
    return {"config": "configs/enwik8.py:size=million", "overrides": {}, "steps": 3}


def run(plan: dict) -> dict:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEMORY_FRACTION)  # before jax starts
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import configs
    from sparse_jax.bench import tools
    from sparse_jax.bench.model import step_function
    from sparse_jax.data import sources
    from sparse_jax.model import transformer as model_lib
    from sparse_jax.model.config import model_config
    from sparse_jax.run import sizing

    p = plan["million"]
    config = configs.load(p["config"], p["overrides"])
    cfg = model_config(config.model)
    out = {"config": p["config"], "overrides": p["overrides"], "seq_len": cfg.seq_len,
           "num_layers": cfg.num_layers, "kernel": cfg.kernel or "the default",
           "attention": cfg.attention, "losses": [], "step_s": []}
    emit(out)
    data = sources.load_bytes(os.path.join(REPO, CODE_CORPUS))
    if len(data) < cfg.seq_len + 1:
        raise SystemExit(f"{CODE_CORPUS} holds {len(data):,} bytes, fewer than a window")
    tokens = jnp.asarray(np.asarray(data[:cfg.seq_len + 1], np.int32)[None])
    step, _, tx = step_function(cfg, update=True)
    state = nnx.state(model_lib.SparseTransformer(cfg, rngs=nnx.Rngs(0)))
    opt_state = tx.init(state)
    start = time.perf_counter()
    compiled = step.lower(state, opt_state, tokens).compile()
    memory = compiled.memory_analysis()
    out.update(compile_s=time.perf_counter() - start,
               planned_gb=(memory.temp_size_in_bytes + memory.argument_size_in_bytes) / 1e9,
               params=sizing.describe(cfg, 1).get("params"))
    emit(out)
    for i in range(p["steps"] + 1):  # the first step warms up, and is not timed
        if time.time() > plan["deadline"] - 5:
            out["error"] = f"stopped after {i} steps: stage time up"
            break
        start = time.perf_counter()
        loss, state, opt_state = compiled(state, opt_state, tokens)
        loss = float(jax.block_until_ready(loss))
        out["losses"].append(loss)
        if i:
            out["step_s"].append(time.perf_counter() - start)
        out["device_peak_gb"] = tools.device_peak_memory_gb()
        emit(out)
    return out


def check(result: dict, plan: dict) -> tuple[str, str] | None:
    steps = plan["million"]["steps"]
    if len(result.get("step_s", [])) >= steps and "error" not in result:
        return None
    why = result.get("error", f"{len(result.get('step_s', []))} of {steps} steps timed")
    return ("partial" if result.get("losses") else "failed"), why


def summary(report: dict) -> list[str]:
    r = report["stages"].get("million", {})
    if "seq_len" not in r:
        return []
    steps = r.get("step_s", [])
    median = sorted(steps)[len(steps) // 2] if steps else None
    losses = ", ".join(f"{x:.3f}" for x in r.get("losses", [])) or "—"
    return ["## A million bytes of context on one GPU (million)", "",
            f"`{r['config']}`{' with ' + str(r['overrides']) if r.get('overrides') else ''}: "
            f"{r['num_layers']} layers at {r['seq_len']:,} bytes, kernel {r['kernel']}; one "
            f"window of the code corpus, the same every step.", "",
            "| compile s | planned GB | device peak GB | step s (median) | tokens/s | "
            "loss by step (bits) |", "|---|---|---|---|---|---|",
            f"| {fmt(r.get('compile_s'))} | {fmt(r.get('planned_gb'))} | "
            f"{fmt(r.get('device_peak_gb'))} | {fmt(median)} | "
            f"{fmt(r['seq_len'] / median if median else None, ',.0f')} | {losses} |"]
