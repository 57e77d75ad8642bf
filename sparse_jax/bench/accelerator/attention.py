"""Stage attention: forward + backward, bfloat16, B=1 H=8 d=64: strided and fixed through XLA
and Pallas against cuDNN's fused dense attention, at 16k, 8k, 32k then 64k, then other kernel
tiles at 16k. Its summary is the attention table, the flex stage's rows included."""

from __future__ import annotations

import time

from sparse_jax.bench.accelerator.common import (
    TIME_UP,
    attention_flops,
    emit,
    fmt,
    one_line,
    peak_tflops,
    rows_verdict,
)

# The H100 report: 67 s, with two of the tile rows left out at 70.
CAP, DRY_CAP = 80, 40


def plan(dry_run: bool) -> dict:
    if dry_run:
        return {"seq_lens": [256], "batch": 1, "heads": 2, "head_dim": 16, "repeats": 2,
                "patterns": ["dense@xla", "strided:16@xla", "strided:16@pallas:16x16",
                             "fixed:16:4@xla"],
                "tiles": {"seq_len": 128, "patterns": ["fixed:16:4@pallas:16x32"]}}
    return {"seq_lens": [16384, 8192, 32768, 65536], "batch": 1, "heads": 8, "head_dim": 64,
            "repeats": 10,
            "patterns": ["dense@cudnn", "strided:128@xla", "strided:128@pallas",
                         "fixed:128:32@xla", "fixed:128:32@pallas"],
            # after every length: other kernel tiles at 16k (the first report ran 64 x 64
            # only; strided reached 2.3% of the bf16 peak there)
            "tiles": {"seq_len": 16384, "patterns": [
                "strided:128@pallas:128x64", "strided:128@pallas:128x128",
                "fixed:128:32@pallas:128x64", "fixed:128:32@pallas:128x128"]}}


def run(plan: dict) -> dict:
    import jax
    import jax.numpy as jnp

    from sparse_jax.attention import sparse_attention
    from sparse_jax.bench import tools
    from sparse_jax.bench.attention import parse_pattern

    p = plan["attention"]
    peak = peak_tflops(jax.devices()[0].device_kind)
    rows = []
    tiles = p.get("tiles")
    cases = [(n, pattern) for n in p["seq_lens"] for pattern in p["patterns"]] + (
        [(tiles["seq_len"], pattern) for pattern in tiles["patterns"]] if tiles else [])
    for n, pattern in cases:
        if time.time() > plan["deadline"] - 5:
            rows.append({"pattern": pattern, "seq_len": n, "error": TIME_UP})
            continue
        row = {"pattern": pattern, "seq_len": n}
        try:
            spec, implementation, sizes = parse_pattern(pattern, n)
            shape = (p["batch"], n, p["heads"], p["head_dim"])
            q, k, v = (jax.random.normal(key, shape, jnp.bfloat16)
                       for key in jax.random.split(jax.random.PRNGKey(0), 3))
            if spec.kind == "dense":
                def attend(q, k, v, implementation=implementation):
                    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        implementation=implementation)
            else:
                def attend(q, k, v, spec=spec, implementation=implementation, sizes=sizes):
                    return sparse_attention(q, k, v, spec, implementation, sizes)
            fn = jax.jit(jax.grad(lambda q, k, v, f=attend: f(q, k, v).astype(
                jnp.float32).sum(), argnums=(0, 1, 2)))
            start = time.perf_counter()
            compiled = fn.lower(q, k, v).compile()
            row["compile_s"] = time.perf_counter() - start
            memory = compiled.memory_analysis()
            row["planned_gb"] = (memory.temp_size_in_bytes + memory.argument_size_in_bytes
                                 + memory.output_size_in_bytes) / 1e9
            row.update(tools.time_call(compiled, q, k, v, repeats=p["repeats"]))
            keys = spec.mean_keys(n)
            tflops = attention_flops(p["batch"], p["heads"], n, keys, p["head_dim"]) / (
                row["median_ms"] / 1e3) / 1e12
            row.update(keys_per_query=keys, tflops=tflops,
                       of_peak=tflops / peak if peak else None,
                       device_peak_gb=tools.device_peak_memory_gb())
        except Exception as e:  # noqa: BLE001  one line, and the next case runs
            row["error"] = one_line(e)
        rows.append(row)
        emit({"rows": rows})
    return {"rows": rows}


def label(row: dict) -> str:
    return f"{row['pattern']} at {row['seq_len']}"


def check(result: dict, plan: dict) -> tuple[str, str] | None:
    return rows_verdict(result.get("rows", []), label)


def summary(report: dict) -> list[str]:
    stages = report["stages"]
    rows = stages.get("attention", {}).get("rows", []) + stages.get("flex", {}).get("rows", [])
    if not rows:
        return []
    dense = {r["seq_len"]: r["median_ms"] for r in rows
             if r["pattern"].startswith("dense@cudnn") and "median_ms" in r}
    a = report["plan"]["attention"]
    lines = [f"Attention, forward + backward, bfloat16, B={a['batch']} H={a['heads']} "
             f"d={a['head_dim']}, median of {a['repeats']} runs after compilation; useful "
             "FLOPs 10·B·H·n·|S|·d (|S| the mean keys per query; forward alone: "
             "4·B·H·n·|S|·d); memory: XLA's plan (arguments, outputs, temporaries) or "
             "torch's peak:", "",
             "| pattern | n | ms | TFLOP/s | of bf16 peak | × vs cuDNN dense | "
             "planned / peak GB | compile s | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["seq_len"], r["pattern"])):
        speedup = (dense[r["seq_len"]] / r["median_ms"]
                   if r["seq_len"] in dense and "median_ms" in r else None)
        memory = r.get("planned_gb", r.get("device_peak_gb"))
        name = r["pattern"] + (" (forward only)" if r.get("pass") == "fwd" else "")
        lines.append(f"| {name} | {r['seq_len']} | {fmt(r.get('median_ms'))} | "
                     f"{fmt(r.get('tflops'))} | {fmt(r.get('of_peak'), '.1%')} | "
                     f"{fmt(speedup)} | {fmt(memory)} | {fmt(r.get('compile_s'))} | "
                     f"{r.get('error', 'ok')} |")
    return lines + [""]
