"""What context parallelism costs, for the benchmarks (``scripts/context_parallel.py``) and the
tests that hold the library to its figures: the bytes one device sends per layer by collective
(``communication_bytes``), XLA's planned memory of an attention forward + backward
(``planned_memory``), the time of one (``step_seconds``) and the table of all three
(``cost_rows``, ``cost_table``), for a sequence split over devices as ``attention.context``
runs it; and the tiny model trained with each sequence split and unsplit (``model_rows``).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from sparse_jax.attention import api
from sparse_jax.attention.context import (
    check_split,
    context_parallel_attention,
    seq_mesh,
    split_plan,
)
from sparse_jax.attention.spec import PatternSpec


def communication_bytes(spec: PatternSpec, n: int, devices: int, heads: int, head_dim: int,
                        dtype_bytes: int = 4, batch: int = 1, *,
                        backward: bool = False) -> dict[str, int]:
    """Bytes one device sends per layer with the sequence of ``n`` split over ``devices``, in
    the forward pass (or with ``backward`` what the backward adds), by collective (and
    ``"total"``), as this module runs them: a ``ppermute`` sends its block, an ``all_to_all``
    the ``(P - 1)/P`` of its shard that leaves, an ``all_gather`` its shard to each of the
    ``P - 1`` others and a ``psum_scatter`` ``P - 1`` shards of its sums (as a ring does). The
    column part's output and log-sum-exp, the halo's and the summary keys' gradients and the
    ring's key gradients travel in float32. The most any device sends (the halo: all but the
    last shard; the ring: every shard passes every block on).

    The backward sends again what the forward sent (the ring's K/V, the halo, q, k, v to the
    columns, the summary keys), but where both passes are one program (a jitted training step)
    XLA sends each once (common subexpressions); ``backward`` counts only the rest: the
    gradients, and d_out, out and lse to the columns. The tests hold both counts to the
    compiled programs' collectives."""
    check_split(spec, n, devices)
    unit = batch * heads * head_dim  # one position of one of q, k, v
    m, b = n // devices, dtype_bytes
    sent = {}
    if devices > 1 and spec.kind == "dense":
        if backward:
            sent["ring ppermute (dk, dv)"] = devices * 2 * m * unit * 4
        else:
            sent["ring ppermute (k, v)"] = (devices - 1) * 2 * m * unit * b
    elif devices > 1:
        plan = split_plan(spec, n, devices)
        if plan.halo:
            size = plan.halo * plan.block
            if backward:
                sent["halo ppermute back (dk, dv)"] = 2 * size * unit * 4
            else:
                sent["halo ppermute (k, v)"] = 2 * size * unit * b
        if plan.columns:
            leaving = m * (devices - 1) // devices
            lse = leaving * batch * heads * 4
            if backward:
                sent["columns all_to_all (d_out)"] = leaving * unit * b
                sent["columns all_to_all (out, lse)"] = leaving * unit * 4 + lse
                sent["columns all_to_all back (dq, dk, dv)"] = 3 * leaving * unit * b
            else:
                sent["columns all_to_all (q, k, v)"] = 3 * leaving * unit * b
                sent["columns all_to_all back (out, lse)"] = leaving * unit * 4 + lse
        if plan.summary is not None:
            keys = m // plan.block * len(plan.summary)
            if backward:
                sent["summary psum_scatter (dk, dv)"] = (devices - 1) * 2 * keys * unit * 4
            else:
                sent["summary all_gather (k, v)"] = (devices - 1) * 2 * keys * unit * b
    sent["total"] = sum(sent.values())
    return sent


def _step(spec, n, devices, heads, head_dim, batch, dtype, implementation):
    """A jitted forward + backward of the attention of ``n`` positions split over ``devices``
    (``context_parallel_attention``; one device: ``sparse_attention``): (program, the abstract
    arguments q, k, v, d_out)."""
    check_split(spec, n, devices)
    mesh = seq_mesh(devices)
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "seq"))
    arg = jax.ShapeDtypeStruct((batch, n, heads, head_dim), dtype, sharding=split)

    def attend(q, k, v):
        if devices == 1:
            return api.sparse_attention(q, k, v, spec, implementation)
        return context_parallel_attention(q, k, v, spec, mesh, implementation=implementation)

    def grads(q, k, v, d_out):
        return jax.vjp(attend, q, k, v)[1](d_out)

    return jax.jit(grads, out_shardings=(split,) * 3), (arg,) * 4


def planned_memory(spec: PatternSpec, n: int, devices: int, heads: int, head_dim: int,
                   batch: int = 1, dtype=jnp.float32, implementation: str = "xla") -> dict:
    """XLA's plan for one device of a jitted forward + backward of the attention of ``n``
    positions split over ``devices`` (``context_parallel_attention``; one device:
    ``sparse_attention``), from ``compiled.memory_analysis()``: compiled only, nothing runs.
    Bytes of the arguments (q, k, v and the output's cotangent), the outputs (dq, dk, dv), the
    temporaries, and their sum ("total"), per device."""
    program, args = _step(spec, n, devices, heads, head_dim, batch, dtype, implementation)
    memory = program.lower(*args).compile().memory_analysis()
    sizes = {"arguments": memory.argument_size_in_bytes, "outputs": memory.output_size_in_bytes,
             "temporaries": memory.temp_size_in_bytes}
    return {**sizes, "total": sum(sizes.values()) - memory.alias_size_in_bytes}


def step_seconds(spec: PatternSpec, n: int, devices: int, heads: int, head_dim: int,
                 batch: int = 1, dtype=jnp.float32, implementation: str = "xla",
                 repeats: int = 3) -> float:
    """Wall seconds of that forward + backward, run (random inputs), the least of ``repeats``
    after one warm-up. Simulated CPU devices share the host's cores: this is the split's
    total CPU cost beside one device's, not a speed-up."""
    program, args = _step(spec, n, devices, heads, head_dim, batch, dtype, implementation)
    keys = jax.random.split(jax.random.key(0), len(args))
    values = [jax.device_put(jax.random.normal(key, a.shape, a.dtype), a.sharding)
              for key, a in zip(keys, args)]
    jax.block_until_ready(program(*values))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(*values))
        times.append(time.perf_counter() - start)
    return min(times)


def cost_rows(specs, lengths, device_counts, heads: int, head_dim: int, *, batch: int = 1,
              dtype=jnp.float32, implementation: str = "xla", compile_memory: bool = True,
              measure_time: bool = False):
    """One row per (pattern, n, P) that splits: bytes one device sends per layer forward and
    what the backward adds (``communication_bytes``) and, with ``compile_memory`` and P devices
    visible, XLA's planned per-device memory of a forward + backward (``planned_memory``;
    compiled, never run), and with ``measure_time`` its wall time (``step_seconds``)."""
    rows = []
    for spec in specs:
        for n in lengths:
            for devices in device_counts:
                try:
                    check_split(spec, n, devices)
                except ValueError as error:
                    rows.append({"pattern": str(spec), "n": n, "devices": devices,
                                 "skipped": str(error)})
                    continue
                sent = {name: communication_bytes(spec, n, devices, heads, head_dim,
                                                  jnp.dtype(dtype).itemsize, batch,
                                                  backward=name == "backward")
                        for name in ("forward", "backward")}
                row = {"pattern": str(spec), "n": n, "devices": devices, "sent": sent}
                if compile_memory and devices <= jax.device_count():
                    row["memory"] = planned_memory(spec, n, devices, heads, head_dim, batch,
                                                   dtype, implementation)
                if measure_time and devices <= jax.device_count():
                    row["seconds"] = step_seconds(spec, n, devices, heads, head_dim, batch,
                                                  dtype, implementation)
                rows.append(row)
    return rows


def cost_table(rows: list[dict]) -> list[str]:
    """``cost_rows``' rows as a markdown table, MiB per device; "total / P=1" against the
    pattern's P=1 row at its length, where that was compiled."""
    from sparse_jax.bench import tools

    mib = lambda x: f"{x / 2**20:,.1f}"  # noqa: E731
    lines = ["| pattern | n | P | sent: forward | + backward | arguments | outputs | "
             "temporaries | total | total / P=1 | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    first = {(r["pattern"], r["n"]): r["memory"]["total"] for r in rows
             if r.get("memory") and r["devices"] == 1}
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['pattern']} | {row['n']:,} | {row['devices']} | "
                         f"{row['skipped']} |||||||")
            continue
        memory = row.get("memory")
        cells = [""] * 5
        if memory:
            cells = [mib(memory[k]) for k in ("arguments", "outputs", "temporaries", "total")]
            ratio = tools.ratio(memory["total"], first.get((row["pattern"], row["n"])))
            cells.append(tools.NOT_MEASURED if ratio is None else f"{ratio:.3f}")
        cells.append(f"{row['seconds']:.3f}" if "seconds" in row else "")
        lines.append(f"| {row['pattern']} | {row['n']:,} | {row['devices']} | "
                     f"{mib(row['sent']['forward']['total'])} | "
                     f"{mib(row['sent']['backward']['total'])} | " + " | ".join(cells) + " |")
    return lines


# ---------------------------------------------------------------------------------------------
# The model trained with each sequence split and unsplit (scripts/context_parallel.py
# --model_steps).

MODEL_BATCH = 8  # the sequences of a step


def tiny_config(pattern: str, seq: int, steps: int):
    """configs/bytes.py:size=tiny (2 layers, d=64, context 256, l=16) as the comparison trains
    it: `pattern`, each sequence split over `seq` devices, ``MODEL_BATCH`` sequences a step."""
    import configs

    return configs.load("bytes:size=tiny", {
        "model.pattern": pattern, "mesh.seq": seq, "batch_size": MODEL_BATCH,
        "total_steps": steps + 1, "optimizer.warmup_steps": 1})


def train_steps(pattern: str, seq: int, devices: int, steps: int) -> list[tuple[float, float]]:
    """(loss, gradient norm) of `steps` training steps (``train.make_jitted``'s, as a run takes
    them) of ``tiny_config`` on `devices` devices, each sequence split over `seq` of them, on
    fixed random batches."""
    import numpy as np

    from sparse_jax import sharding, train
    from sparse_jax.model.config import model_config as to_model
    from sparse_jax.run import setup

    config = tiny_config(pattern, seq, steps)
    cfg = to_model(config.model)
    mesh = sharding.make_mesh(-1, 1, seq, devices=jax.devices()[:devices])
    if seq > 1:
        setup.make_mesh(config)  # the run's checks (the split fits the patterns)
    jitted = train.make_jitted(config, cfg, mesh)
    state = jitted.init()
    rng = jax.device_put(jax.random.key(0),
                         jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    tokens = np.random.default_rng(0).integers(0, 256, (steps, MODEL_BATCH, cfg.seq_len + 1),
                                               np.int32)
    out = []
    for batch in tokens:
        batch = jax.device_put({"inputs": batch[:, :-1], "targets": batch[:, 1:]},
                               jitted.batch_sharding)
        state, metrics = jitted.train_step(state, batch, rng)
        out.append((float(metrics["bits"]), float(metrics["grad_norm"])))
    return out


def model_rows(patterns, device_counts, steps: int) -> tuple[list[dict], list[str]]:
    """Per pattern and P, the largest relative difference of the losses and gradient norms over
    `steps` steps between each sequence unsplit (data over max(P) devices) and split over P:
    the rows and their markdown table (each line printed as it is made)."""
    lines = ["| pattern | P | steps | loss at the last step | largest relative difference: "
             "loss | gradient norm |", "|---|---:|---:|---:|---:|---:|"]
    rows = []
    for pattern in patterns:
        whole = train_steps(pattern, 1, max(device_counts), steps)
        for p in device_counts:
            split = train_steps(pattern, p, max(device_counts), steps)
            loss, norm = (max(abs(a[i] - b[i]) / abs(a[i]) for a, b in zip(whole, split))
                          for i in (0, 1))
            rows.append({"pattern": pattern, "devices": p, "steps": steps, "loss": split[-1][0],
                         "loss_unsplit": whole[-1][0], "loss_difference": loss,
                         "grad_norm_difference": norm})
            lines.append(f"| {pattern} | {p} | {steps} | {split[-1][0]:.6f} | {loss:.1e} | "
                         f"{norm:.1e} |")
            print(lines[-1], flush=True)
    return rows, lines
