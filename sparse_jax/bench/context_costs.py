"""What context parallelism costs, for the benchmarks (``scripts/context_parallel.py``) and the
tests that hold the library to its figures: the bytes one device sends per layer by collective
(``communication_bytes``), XLA's planned memory of an attention forward + backward
(``planned_memory``), the time of one (``step_seconds``) and the table of all three
(``cost_rows``), for a sequence split over devices as ``attention.context`` runs it.
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
