"""Stage attention: forward + backward, bfloat16, B=1 H=8 d=64: strided and fixed through
Pallas against cuDNN's fused dense attention at 16k, then the Pallas kernel
variants side by side at 16k (``kernel.BlockSizes``: chained terms, heads per program, one loop,
warps and stages), then 64k with the variants most likely to win, then 8k and 32k. A length's
programs are compiled first, then timed interleaved (``tools.time_interleaved``): each variant
between two runs of its pattern's default kernel (rounds of A, B, A, C, A, ..., the variants'
order rotated each round), so that a ratio to the default is the median of per-round ratios,
with their spread, and one slow stretch of the machine moves a round, not a row (the 2026-11-28
H200 report crowned a variant on one such row). Its summary is the attention table (the flex
stage's rows included; "≈": the rounds disagree on which is faster) and the fastest kernel per
pattern and length, the figure ``attention="auto"``'s choice per device kind is to follow."""

from __future__ import annotations

import time

from sparse_jax.bench import predictions
from sparse_jax.bench.accelerator import mgpu
from sparse_jax.bench.accelerator.common import (
    TIME_UP,
    attention_flops,
    emit,
    fmt,
    one_line,
    peak_tflops,
    rows_verdict,
)

# The H100 report: 67 s for 24 rows (~2.8 s a row with its compilation), two left out at 70.
# 34 rows interleaved: 7 rounds of 3 runs each, after compiling; the three Mosaic GPU / forward
# rows at 16k ~10 s (cuDNN's forward compiles in ~1 s; jax's kernel compiles or refuses).
CAP, DRY_CAP = 135, 60
# A row compiled but not yet timed when the stage printed its results (a length's rows are timed
# together, once all are compiled): what the row says if the stage stops there.
NOT_TIMED = "compiled, not timed: the stage stopped first"

BASELINES = ["dense@cudnn", "strided:128@pallas", "fixed:128:32@pallas"]
# The baselines' Pallas rows name no option: they run the defaults chosen by measurement
# (attention.measured: chained up to 16,384, terms beyond); ":terms" and ":chained" rows time
# the other variant beside them, so each length checks the choice. The variants
# (docs/attention.md, "Kernel variants") come in the order the cost model ranks them
# (docs/cost_model.md), so that a cap cuts the least likely. Not timed: two heads per program
# (spills dk/dv on an H100), the 128 x 64 and 128 x 128 strided tiles (lost to 64 x 64 there:
# 1.18 and 1.52 ms against 0.912), and fixed 128x64:chained:w8:s3 at 64k, which the H200
# measured last (21.8 ms against the default's 16.0) and the cost model ranks last.
# fixed's summary term on 128 x 64 tiles (sumQxK), beside the band's 64 x 64: the cost model
# predicts 1.50 ms against the default's 1.60 at 16k and 16.5 against 18.1 ms at 64k (H200),
# compiled for an H100 with 248 bytes spilled in its dk/dv kernel; with 8 warps (no spill) or
# 128 x 32 tiles it predicts 1.98 and 2.05 ms: not timed (docs/benchmarks/compiled_h100/
# summary_tiles).
# strided's one-pass kernels (attention.pallas_onepass; with option atomic, each backward tile
# visited once) and fixed's gathered ones (attention.pallas_gathered), first: the cost model
# predicts onepass at 0.279 ms at 16k and 1.24 ms at 64k on an H200, onepass:atomic at 0.263
# and 0.926, gathered at 1.12 and 13.8 ms, gathered:atomic at 0.870 and 9.95
# (docs/cost_model.md). The atomic rows are the ones the figures rest on.
GATHERED = ["fixed:128:32@pallas:chained:gathered:dkv128x128w8:atomic",
            "fixed:128:32@pallas:chained:gathered:dkv128x128w8"]
ONEPASS = ["strided:128@pallas:onepass:s1", "strided:128@pallas:onepass:s1:atomic"]
VARIANTS_16K = [*ONEPASS, *GATHERED, "fixed:128:32@pallas:chained:sum128x64",
                "strided:128@pallas:terms", "strided:128@pallas:chained:64x32",
                "strided:128@pallas:chained:one_loop", "strided:128@pallas:chained:32x32",
                "fixed:128:32@pallas:terms", "fixed:128:32@pallas:128x64:chained:w8",
                "fixed:128:32@pallas:chained:64x32"]
VARIANTS_64K = [*ONEPASS, *GATHERED, "fixed:128:32@pallas:sum128x64",
                "strided:128@pallas:chained", "fixed:128:32@pallas:chained",
                "strided:128@pallas:chained:64x32:one_loop", "fixed:128:32@pallas:chained:64x32"]
VARIANTS_8K_32K = ["strided:128@pallas:terms", "fixed:128:32@pallas:terms",
                   "strided:128@pallas:chained", "fixed:128:32@pallas:chained"]


def plan(dry_run: bool) -> dict:
    """``groups``: (length, patterns) in the order they compile (a length's rows are timed
    together once compiled); ``rounds`` of interleaved timing, each sample the median of
    ``repeats`` runs."""
    if dry_run:
        return {"batch": 1, "heads": 2, "head_dim": 16, "rounds": 3, "repeats": 1, "groups": [
            {"seq_len": 256, "patterns": ["dense@xla", "dense@mgpu", "dense@mgpu:fwd",
                                          "dense@xla:fwd", "strided:16@xla",
                                          "strided:16@pallas:16x16", "fixed:16:4@xla",
                                          "strided:16@pallas:16x16:chained:h2:one_loop"]},
            {"seq_len": 128, "patterns": ["fixed:16:4@pallas:16x32"]}]}
    return {"batch": 1, "heads": 8, "head_dim": 64, "rounds": 7, "repeats": 3, "groups": [
        {"seq_len": 16384, "patterns": BASELINES + mgpu.ROWS},
        {"seq_len": 16384, "patterns": VARIANTS_16K},
        {"seq_len": 65536, "patterns": [*BASELINES, *VARIANTS_64K]},
        {"seq_len": 8192, "patterns": [*BASELINES, *VARIANTS_8K_32K[:2]]},
        {"seq_len": 32768, "patterns": [*BASELINES, *VARIANTS_8K_32K[2:]]}]}


def run(plan: dict) -> dict:
    import jax
    import jax.numpy as jnp

    from sparse_jax.attention import sparse_attention
    from sparse_jax.bench import tools

    p = plan["attention"]
    peak = peak_tflops(jax.devices()[0].device_kind)
    rows = [{"pattern": pattern, "seq_len": g["seq_len"]} for g in p["groups"]
            for pattern in g["patterns"]]
    done = []  # the rows of the lengths timed; what a stage stopped at its cap leaves
    for n in dict.fromkeys(r["seq_len"] for r in rows):  # a length's rows timed together
        of_n = [r for r in rows if r["seq_len"] == n]
        shape = (p["batch"], n, p["heads"], p["head_dim"])
        q, k, v = (jax.random.normal(key, shape, jnp.bfloat16)
                   for key in jax.random.split(jax.random.PRNGKey(0), 3))
        calls, specs = {}, {}
        for row in of_n:
            if time.time() > plan["deadline"] - 5:
                row["error"] = TIME_UP
                continue
            try:
                spec, implementation, sizes, forward_only = parse(row["pattern"], n)
                if forward_only:
                    row["pass"] = "fwd"
                if spec.kind == "dense":
                    def attend(q, k, v, implementation=implementation):
                        return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                            implementation=implementation)
                else:
                    def attend(q, k, v, spec=spec, implementation=implementation, sizes=sizes):
                        return sparse_attention(q, k, v, spec, implementation, sizes)
                def build(f, forward_only=forward_only):
                    return jax.jit(f) if forward_only else jax.jit(jax.grad(
                        lambda a, b, c: f(a, b, c).astype(jnp.float32).sum(),
                        argnums=(0, 1, 2)))
                start = time.perf_counter()
                if mgpu.is_mgpu(row["pattern"]):
                    compiled = mgpu.compile_row(row, build, q, k, v)
                    if compiled is None:  # refused, or no GPU here: said, never a base
                        emit({"rows": done + of_n[:of_n.index(row) + 1]})
                        continue
                else:
                    compiled = build(attend).lower(q, k, v).compile()
                row["compile_s"] = time.perf_counter() - start
                memory = compiled.memory_analysis()
                row["planned_gb"] = (memory.temp_size_in_bytes + memory.argument_size_in_bytes
                                     + memory.output_size_in_bytes) / 1e9
                def call(c=compiled, args=(q, k, v)):
                    return jax.block_until_ready(c(*args))
                call()  # the first run: buffers allocated, kernels loaded
                calls[row["pattern"]], specs[row["pattern"]] = call, spec
            except Exception as e:  # noqa: BLE001  one line, and the next case runs
                row["error"] = one_line(e)
            emit({"rows": done + [r if "error" in r or "not_measured" in r
                                  else {**r, "error": NOT_TIMED}
                                  for r in of_n[:of_n.index(row) + 1]]})
        anchor_of = anchors(list(calls))
        try:
            rounds = tools.time_interleaved(calls, anchor_of, p["rounds"], p["repeats"],
                                            deadline=plan["deadline"] - 5)
        except Exception as e:  # noqa: BLE001  the length's rows say why
            for row in of_n:
                row.setdefault("error", one_line(e))
            rounds = []
        stats = tools.interleaved_stats(rounds, anchor_of)
        for row in of_n:
            if row["pattern"] not in stats or "error" in row or "not_measured" in row:
                continue
            row.update(stats[row["pattern"]], anchor=anchor_of[row["pattern"]])
            keys = specs[row["pattern"]].mean_keys(n)
            tflops = attention_flops(p["batch"], p["heads"], n, keys, p["head_dim"]) / (
                row["median_ms"] / 1e3) / 1e12 * (0.4 if row.get("pass") == "fwd" else 1.0)
            row.update(keys_per_query=keys, tflops=tflops,
                       of_peak=tflops / peak if peak else None,
                       device_peak_gb=tools.device_peak_memory_gb())
        done += of_n
        emit({"rows": done})
    return {"rows": done}


def parse(pattern: str, n: int):
    """A row's pattern as (spec, implementation, kernel sizes, forward only): ``parse_pattern``'s,
    and the stage's own rows (``mgpu``: dense@mgpu, PATTERN:fwd)."""
    from sparse_jax.bench.attention import parse_pattern

    pattern, forward_only = mgpu.split(pattern)
    if mgpu.is_mgpu(pattern):
        return (*parse_pattern("dense", n)[:2], None, forward_only)
    return (*parse_pattern(pattern, n), forward_only)


def anchors(patterns: list[str]) -> dict[str, str | None]:
    """Each pattern's anchor in interleaved timing: the first Pallas kernel of the same pattern
    (the default kernel, in the plan's order), None for that kernel itself and for a pattern
    with no Pallas kernel (dense)."""
    first = {}
    for pattern in patterns:
        if "@pallas" in pattern:
            first.setdefault(pattern.partition("@")[0], pattern)
    return {pattern: None if first.get(pattern.partition("@")[0], pattern) == pattern
            else first[pattern.partition("@")[0]] for pattern in patterns}


def label(row: dict) -> str:
    return f"{row['pattern']} at {row['seq_len']}"


def check(result: dict, plan: dict) -> tuple[str, str] | None:
    return rows_verdict(result.get("rows", []), label)


def summary(report: dict) -> list[str]:
    stages = report["stages"]
    rows = stages.get("attention", {}).get("rows", []) + stages.get("flex", {}).get("rows", [])
    if not rows:
        return []
    dense = {(r["seq_len"], r.get("pass") == "fwd"): r["median_ms"] for r in rows
             if mgpu.split(r["pattern"])[0] == "dense@cudnn" and "median_ms" in r}
    a = report["plan"]["attention"]
    timing = (f"{a['rounds']} rounds after compilation, interleaved: each variant between two "
              "runs of its pattern's default kernel (a sample the median of "
              f"{a['repeats']} runs); ms: the median sample; / default: the median of the "
              "per-round ratios to the default (their range; the default's: its consecutive "
              "samples'), ≈ where the rounds disagree on which is faster"
              if "rounds" in a else f"median of {a['repeats']} runs after compilation")
    lines = [f"Attention, forward + backward, bfloat16, B={a['batch']} H={a['heads']} "
             f"d={a['head_dim']}, {timing}; useful "
             "FLOPs 10·B·H·n·|S|·d (|S| the mean keys per query; forward alone: "
             "4·B·H·n·|S|·d); memory: XLA's plan (arguments, outputs, temporaries) or "
             "torch's peak:", "",
             "| pattern | n | ms | predicted ms | / predicted | / default | TFLOP/s | "
             "of bf16 peak | × vs cuDNN dense | planned / peak GB | compile s | result |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    device = stages.get("env", {}).get("device_kind")
    for r in sorted(rows, key=lambda r: (r["seq_len"], r["pattern"])):
        base = dense.get((r["seq_len"], r.get("pass") == "fwd"))
        speedup = base / r["median_ms"] if base and "median_ms" in r else None
        memory = r.get("planned_gb", r.get("device_peak_gb"))
        name = r["pattern"] + (" (forward only)" if r.get("pass") == "fwd"
                               and not r["pattern"].endswith(":fwd") else "")
        predicted = predictions.cells(report.get("predictions"), "attention", r["pattern"],
                                      r["seq_len"], device, r.get("median_ms"))
        lines.append(f"| {name} | {r['seq_len']} | {fmt(r.get('median_ms'))} | "
                     f"{' | '.join(predicted)} | {ratio_cell(r)} | "
                     f"{fmt(r.get('tflops'))} | {fmt(r.get('of_peak'), '.1%')} | "
                     f"{fmt(speedup)} | {fmt(memory)} | {fmt(r.get('compile_s'))} | "
                     f"{result_cell(r)} |")
    return lines + [""] + mgpu.summary_lines(rows) + fastest(rows)


def result_cell(row: dict) -> str:
    """"ok", the row's error, or "not measured: why" (a kernel that refused, not a failure)."""
    if "not_measured" in row:
        return f"not measured: {row['not_measured']}"
    if "error" in row:
        return row["error"]
    return "ok" + (f" ({row['dtype']}; {row['note']})" if row.get("note") else "")


def ratio_cell(row: dict) -> str:
    """A row's time over its default kernel's, interleaved: "0.63 (0.60–0.67)", "≈" where the
    rounds disagree; the default's own "1 (0.97–1.04)"; "—" untimed so."""
    if "ratio" not in row:
        return "—"
    spread = f"{row['ratio']:.3g} ({row['ratio_min']:.3g}–{row['ratio_max']:.3g})"
    return spread + (" ≈" if row.get("within_noise") else "")


def fastest(rows: list[dict]) -> list[str]:
    """A line per pattern and length with more than one Pallas kernel timed: the fastest, by
    its ratio to the default kernel where the rows were timed interleaved (else by the median),
    and whether the rounds tell it from the default and from the runner-up."""
    from sparse_jax.bench import tools

    lines = []
    for kind in ("strided", "fixed"):
        for n in sorted({r["seq_len"] for r in rows}):
            timed = [r for r in rows if r["seq_len"] == n and r["pattern"].startswith(kind)
                     and "@pallas" in r["pattern"] and "median_ms" in r]
            if len(timed) < 2:
                continue
            paired = all("ratio" in r for r in timed)
            order = sorted(timed, key=lambda r: r["ratio"] if paired else r["median_ms"])
            best, runner_up = order[0], order[1]
            default = next((r for r in timed if r["pattern"].endswith("@pallas")), None)
            if paired and best is not default:
                gain = (f", {1 / best['ratio']:.2f}× the default kernel (per round "
                        f"{1 / best['ratio_max']:.2f}–{1 / best['ratio_min']:.2f} over "
                        f"{best['rounds']} rounds"
                        + ("; within noise of it" if best["within_noise"] else "") + ")")
            elif default is not None and best is not default:
                gain = f", {default['median_ms'] / best['median_ms']:.2f}× the default kernel"
            else:
                gain = ", the default kernel" if best is default else ""
            close = ""
            if paired and "round_ratios" in best and "round_ratios" in runner_up and \
                    tools.within_noise(best["round_ratios"], runner_up["round_ratios"]):
                close = f" `{runner_up['pattern']}` is within noise of it."
            elif paired and best is default and runner_up.get("within_noise"):
                close = f" `{runner_up['pattern']}` is within noise of it."
            lines.append(f"Fastest {kind} kernel at {n}: `{best['pattern']}`, "
                         f"{best['median_ms']:.3g} ms{gain}.{close}")
    return lines + [""] if lines else []
