"""Stage counters: Nsight Compute's hardware counters of the default and the fastest kernels at
16k (forward + backward, bfloat16, B = 1, H = 8, d = 64): per Pallas kernel its duration,
achieved occupancy, compute (SM) and memory (DRAM, L2) throughput against the chip's peak, and
the warp stall reasons that take the most issue slots. Where the time of a kernel goes is what
the compile report and the cost model can only estimate.

Each kernel variant runs in its own process under ``ncu --clock-control none`` (the lent GPUs
run under a hypervisor that does not let ncu lock the clocks), which profiles the Pallas
kernels (named ``sparse_*``) of two forward + backward calls; the second call's launch of each
kernel is kept, the first having run right after compilation. Where ncu is
absent (a CPU, or a GPU image without Nsight Compute) the children still run, the stage says
ncu is missing and its verdict is "partial" on a GPU; its dry run on a CPU parses
``tests/data/ncu_format_sample.csv`` instead (ncu's ``--csv --page raw`` layout with made-up
figures), so the parser is exercised by CI."""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
import time

from sparse_jax.bench.accelerator.common import REPO, emit, fmt, one_line

# A child is ~10 s of start-up and compilation; ncu replays each of a call's ~10 kernels once
# per pass of the sections below (~0.5-2 s a kernel at 16k): about a minute for four variants.
CAP, DRY_CAP = 80, 40
SECTIONS = ("SpeedOfLight", "Occupancy", "WarpStateStats", "LaunchStats")
METRICS = {  # what a row shows: its ncu metric name
    "duration_us": "gpu__time_duration.sum",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "registers": "launch__registers_per_thread",
}
STALL = "issue_stalled_"  # in WarpStateStats' metrics: smsp__average_warps_issue_stalled_
# REASON_per_issue_active.ratio (warps stalled for REASON per issued instruction)
KERNEL_PREFIX = "sparse_"  # the Pallas kernels' names (attention.pallas: sparse_forward, ...)


def plan(dry_run: bool) -> dict:
    if dry_run:  # the child's code at toy sizes (Pallas in interpret mode on a CPU)
        return {"n": 256, "heads": 2, "head_dim": 16, "variants": ["strided:16@pallas:terms"],
                "sample_csv": "tests/data/ncu_format_sample.csv"}
    variants = ["strided:128@pallas:terms", "strided:128@pallas:chained",
                "fixed:128:32@pallas:terms", "fixed:128:32@pallas:chained"]
    return {"n": 16_384, "heads": 8, "head_dim": 64, "variants": variants, "sample_csv": None}


def child(variant: str, n: int, heads: int, head_dim: int) -> None:
    """Runs ``variant``'s forward + backward twice at ``n`` positions (bfloat16 on a GPU,
    float32 elsewhere): the process ncu profiles."""
    import jax
    import jax.numpy as jnp

    from sparse_jax.attention import sparse_attention
    from sparse_jax.bench.attention import parse_pattern

    spec, implementation, sizes = parse_pattern(variant, n)
    keys = jax.random.split(jax.random.key(0), 4)
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    q, k, v, d_out = (jax.random.normal(key, (1, n, heads, head_dim), dtype) for key in keys)

    @jax.jit
    def step(q, k, v, d_out):
        out, pull = jax.vjp(lambda q, k, v: sparse_attention(q, k, v, spec, implementation,
                                                             sizes), q, k, v)
        return out, pull(d_out)

    jax.block_until_ready(step(q, k, v, d_out))  # compiles and runs once
    jax.block_until_ready(step(q, k, v, d_out))


def _ncu_command(ncu: str, variant: str, p: dict) -> list[str]:
    return [ncu, "--clock-control", "none", "--csv", "--page", "raw",
            *(a for s in SECTIONS for a in ("--section", s)),
            "--kernel-name", f"regex:^{KERNEL_PREFIX}",
            sys.executable, "-m", "sparse_jax.bench.accelerator.counters", variant,
            str(p["n"]), str(p["heads"]), str(p["head_dim"])]


def parse(text: str) -> list[dict]:
    """ncu's ``--csv --page raw`` output: a row per profiled kernel launch with the metrics of
    ``METRICS`` and the three largest stall reasons. Only the second call's launches of each
    kernel name are kept (the first is the warm-up's): the last launch of every name."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    if not lines:
        return []
    table = list(csv.DictReader(io.StringIO("\n".join(lines))))
    rows = {}
    for record in table:
        name = record.get("Kernel Name", "")
        if not name or name == "Kernel Name" or not name.startswith(KERNEL_PREFIX):
            continue  # the units row, and kernels that are not ours
        row = {"kernel": name}
        for key, metric in METRICS.items():
            row[key] = _number(record.get(metric))
        if row["duration_us"] is not None and _is_ns(table, METRICS["duration_us"]):
            row["duration_us"] /= 1e3
        stalls = {m.split(STALL, 1)[1].split("_per_", 1)[0]: _number(v)
                  for m, v in record.items()
                  if m and STALL in m and m.endswith("_per_issue_active.ratio")}
        top = sorted(((v, k) for k, v in stalls.items() if v), reverse=True)[:3]
        row["stalls"] = [[k, v] for v, k in top]
        rows[name] = row  # a later launch of the same kernel replaces the warm-up's
    return list(rows.values())


def _is_ns(table: list[dict], metric: str) -> bool:
    """Whether ncu's units row gives ``metric`` in nanoseconds (its default for durations)."""
    units = table[0] if table else {}
    return units.get(metric, "").strip() in ("ns", "nsecond")


def _number(value) -> float | None:
    try:
        return float(str(value).replace(",", ""))
    except (TypeError, ValueError):
        return None


def run(plan: dict) -> dict:
    p = plan["counters"]
    ncu = shutil.which("ncu")
    out = {"n": p["n"], "ncu": ncu, "variants": []}
    if p.get("sample_csv"):  # the dry run: the parser on a file in ncu's format
        with open(os.path.join(REPO, p["sample_csv"])) as f:
            out["sample_rows"] = parse(f.read())
    for variant in p["variants"]:
        entry = {"variant": variant}
        out["variants"].append(entry)
        command = ([sys.executable, "-m", "sparse_jax.bench.accelerator.counters", variant,
                    str(p["n"]), str(p["heads"]), str(p["head_dim"])] if ncu is None
                   else _ncu_command(ncu, variant, p))
        try:
            proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                                  timeout=max(5.0, plan["deadline"] - time.time() - 2))
        except subprocess.TimeoutExpired:
            entry["error"] = "not run: stage time up"
            emit(out)
            break
        print(proc.stderr[-4000:], file=sys.stderr, flush=True)  # the stage's log
        if proc.returncode != 0:
            entry["error"] = one_line(RuntimeError(
                f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}"))
        elif ncu is None:
            entry["error"] = "ncu not found: the kernels ran, no counters read"
        else:
            entry["kernels"] = parse(proc.stdout)
            if not entry["kernels"]:
                seen = sorted({r.split('","')[4] for r in proc.stdout.splitlines()
                               if r.count('","') > 4})[:5]
                entry["error"] = (f"no kernel named {KERNEL_PREFIX}* profiled"
                                  + (f"; names seen: {seen}" if seen else ""))
        emit(out)
    return out


def check(result: dict, plan: dict) -> tuple[str, str] | None:
    variants = result.get("variants", [])
    if plan.get("dry_run"):
        if not result.get("sample_rows"):
            return "failed", "the recorded ncu profile parsed to no row"
        bad = [v for v in variants if "error" in v and "ncu not found" not in v["error"]]
        return ("failed", f"{bad[0]['variant']}: {bad[0]['error']}") if bad else None
    bad = [v for v in variants if "error" in v]
    if not variants or len(bad) == len(variants):
        return "failed", (bad[0]["error"] if bad else "no variant profiled")
    if bad:
        return "partial", f"{len(bad)} of {len(variants)} variants: {bad[0]['error']}"
    return None


def summary(report: dict) -> list[str]:
    r = report["stages"].get("counters", {})
    rows = [(v["variant"], k) for v in r.get("variants", []) for k in v.get("kernels", [])]
    if not rows:
        errors = sorted({v["error"] for v in r.get("variants", []) if "error" in v})
        return [f"Hardware counters (counters): {'; '.join(errors)}.", ""] if errors else []
    lines = [f"## Hardware counters at {r['n']:,} (counters: Nsight Compute, clocks not locked)",
             "", "| variant | kernel | µs | occupancy | SM | DRAM | L2 | registers | top stalls "
             "(warps per issue) |", "|---|---|---|---|---|---|---|---|---|"]
    for variant, k in rows:
        stalls = ", ".join(f"{name} {value:.2f}" for name, value in k.get("stalls", []))
        lines.append(f"| {variant} | {k['kernel']} | {fmt(k.get('duration_us'))} | "
                     f"{fmt(k.get('occupancy_pct'))}% | {fmt(k.get('sm_pct'))}% | "
                     f"{fmt(k.get('dram_pct'))}% | {fmt(k.get('l2_pct'))}% | "
                     f"{fmt(k.get('registers'))} | {stalls or '—'} |")
    return lines


if __name__ == "__main__":  # a child: python -m sparse_jax.bench.accelerator.counters VARIANT N H D
    child(sys.argv[1], *map(int, sys.argv[2:5]))
