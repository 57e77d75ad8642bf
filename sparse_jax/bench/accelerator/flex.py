"""Stage flex: the attention stage's sparse patterns in PyTorch FlexAttention (torch.compile)
with the same block masks, and PyTorch's fused dense attention (SDPA); its rows join the
attention table."""

from __future__ import annotations

import time

from sparse_jax.bench.accelerator.common import (
    TIME_UP,
    attention_flops,
    emit,
    one_line,
    peak_tflops,
    rows_verdict,
)

# The H100 report: 57 s with the two 64k rows out of memory at once; run, they add ~2 x 20 s
# (FlexAttention's compilation, the block mask's, 11 calls of ~0.12 s).
CAP, DRY_CAP = 70, 30  # a 64k row cut by it leaves the stage partial


def plan(dry_run: bool) -> dict:
    if dry_run:  # forward only (no CPU backward), uncompiled
        return {"seq_lens": [128], "compile": False, "compiled_mask_from": None}
    # compiled_mask_from: the length from which the block mask is built compiled (below it the
    # eager build is quicker, and fitted up to 32k on the H100)
    return {"seq_lens": [16384, 8192, 32768, 65536], "compile": True,
            "compiled_mask_from": 65536}


def flex_mask_mod(spec):
    """``spec``'s mask as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` (the same rule as
    the Pallas kernel's block lists: ``kernel.mask_rule``)."""
    from sparse_jax.attention import blocks as kernel

    rule = kernel.mask_rule(spec)
    return lambda b, h, q_idx, kv_idx: rule(q_idx, kv_idx)


def run(plan: dict) -> dict:
    """FlexAttention with each pattern's block mask, and SDPA's causal dense. With "compile"
    the attention goes through torch.compile, and from "compiled_mask_from" on so does
    `create_block_mask`: compiled, it never holds the dense n × n mask (eager it builds n²
    bools and n² int64 block sums: 32 GiB at 64k, out of memory on an 80 GB H100; at 16k on a
    CPU compiled peaks at 0.6 GB against 5.5 GB, with the same blocks)."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed (pip install -r requirements-bench.txt)"}
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from sparse_jax.bench.attention import parse_pattern

    p, a = plan["flex"], plan["attention"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    flex = torch.compile(flex_attention, dynamic=False) if p["compile"] else flex_attention
    compiled_mask = torch.compile(create_block_mask)
    peak = peak_tflops(torch.cuda.get_device_name()) if device == "cuda" else None
    patterns = [name.split("@")[0] for group in a["groups"] for name in group["patterns"]
                if not name.startswith("dense")]  # the attention stage's, each once
    cases = [("dense", "sdpa")] + [(name, "flex") for name in dict.fromkeys(patterns)]
    rows = []

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for n in p["seq_lens"]:
        for name, impl in cases:
            if time.time() > plan["deadline"] - 5:
                rows.append({"pattern": f"{name}@{impl}", "seq_len": n, "error": TIME_UP})
                continue
            row = {"pattern": f"{name}@{impl}", "seq_len": n}
            try:
                spec = parse_pattern(name, n)[0]
                shape = (a["batch"], a["heads"], n, a["head_dim"])
                generator = torch.Generator(device=device).manual_seed(0)
                backward = device != "cpu"  # FlexAttention has no backward on a CPU
                row["pass"] = "fwdbwd" if backward else "fwd"
                q, k, v = (torch.randn(shape, generator=generator, device=device,
                                       dtype=torch.bfloat16, requires_grad=backward)
                           for _ in range(3))
                if impl == "sdpa":
                    def step(q=q, k=k, v=v, backward=backward):
                        out = torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=True).float().sum()
                        if backward:
                            out.backward()
                else:
                    start = time.perf_counter()
                    compiled = n >= (p.get("compiled_mask_from") or float("inf"))
                    build = compiled_mask if compiled else create_block_mask
                    mask = build(flex_mask_mod(spec), None, None, n, n, device=device)
                    row["block_mask_s"] = time.perf_counter() - start
                    row["block_mask"] = "compiled" if compiled else "eager"

                    def step(q=q, k=k, v=v, backward=backward, mask=mask):
                        out = flex(q, k, v, block_mask=mask).float().sum()
                        if backward:
                            out.backward()
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                step()
                sync()
                row["compile_s"] = time.perf_counter() - start
                times = []
                for _ in range(a["repeats"]):
                    start = time.perf_counter()
                    step()
                    sync()
                    times.append((time.perf_counter() - start) * 1e3)
                times.sort()
                row["median_ms"] = times[len(times) // 2]
                keys = spec.mean_keys(n)
                tflops = attention_flops(a["batch"], a["heads"], n, keys, a["head_dim"]) / (
                    row["median_ms"] / 1e3) / 1e12 / (1 if backward else 2.5)
                row.update(keys_per_query=keys, tflops=tflops,
                           of_peak=tflops / peak if peak else None,
                           device_peak_gb=(torch.cuda.max_memory_allocated() / 1e9
                                           if device == "cuda" else None))
            except Exception as e:  # noqa: BLE001
                row["error"] = one_line(e)
            finally:  # what a failed case held (an out-of-memory one) is not the next's
                q = k = v = mask = step = None
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            emit({"rows": rows, "torch": torch.__version__})
    return {"rows": rows, "torch": torch.__version__}


def check(result: dict, plan: dict) -> tuple[str, str] | None:
    return rows_verdict(result.get("rows", []), lambda r: f"{r['pattern']} at {r['seq_len']}")


def summary(report: dict) -> list[str]:
    return []  # its rows are in the attention stage's table
