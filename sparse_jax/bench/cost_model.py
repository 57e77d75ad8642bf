r"""A cost model of the Pallas attention kernels on a Hopper GPU (H100, H200), calibrated on the
accelerator reports' measured rows: forward + backward, bfloat16, B=1 H=8 d=64, one row per
(pattern, length, kernel variant), from the static figures of the deviceless compile
(``sparse_jax.bench.compiled``: per Triton kernel its programs, key tiles per program, blocks
per SM, threads, spilled bytes; per program the bytes of XLA's own kernels around them).

  python scripts/cost_model.py --output_json=docs/benchmarks/cost_model/results.json --overwrite

The model, per Triton kernel k of a program (S SMs; P_k programs, T_k key tiles per program on
average, b_k blocks resident per SM, tiles of q × k queries and keys, m_k matrix products per
tile: 2 forward, 3 dq, 4 dk/dv):

  time_k  = launch + (P_k / (S·b_k)) · (per_program + T_k · λ_k) + P_k·T_k·flops_k / (S·rate)
  λ_k     = per_tile + mask·q·k·[one_loop] + spill·spilled_bytes_k·threads_k
  flops_k = 2·q·k·d·m_k

and for XLA's kernels around them (the layout transposes, the merges of the terms' partial
results): launch each, and their operands' and outputs' bytes at ``xla_bandwidth`` times the
device's HBM bandwidth. The program's time is the sum. Read: the SM runs b_k programs at
once; each pays a fixed cost and, per key tile, a latency that its b_k neighbours hide between
them (the kernels are latency-bound at these sizes: 1.5-6 tiles a program at 16k), plus the
tile's matrix products at an effective rate per SM (at most the datasheet's 989 TFLOP/s over
132 SMs); ``one_loop`` masks every tile (elementwise work per query-key pair), and spilled
registers go to local memory on every tile. Seven parameters, each a positive physical
quantity, fitted by least squares on log(predicted / measured) (every row weighs the same,
whatever its length), from fixed starts: deterministic. The H200 has the H100's SMs, clocks and
compiled code (sm_90a); only its HBM (4.8 against 3.35 TB/s) differs, which enters through
XLA's bytes. No time of the H200 and the H100 here differs by more than their runs do.

Rows left out of the fit (``HELD_OUT``: every measured row of those programs) were chosen
before fitting: the static ranking's two first picks at 16k, the fixed 64 x 32 tiles at 64k,
the strided default at 32k and the strided 128 x 64 tiles (which spill) on the H100.

  measured_rows()      the reports' Pallas attention rows: report, device, pattern, n, ms
  static_rows()        the compile reports' attention programs by (pattern, n)
  features(row, ...)   what the model reads of one compiled program
  predict(...)         milliseconds, and where they go (``parts``)
  calibrate()          the fit, each row's prediction, the ranks per group: a dict
  markdown(result)     the table of docs/cost_model.md
  what_if(params)      the model's time for kernel designs not yet built
"""

from __future__ import annotations

import json
import math
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEASURED = (("h200_2026-11-28", "docs/benchmarks/h200_2026-11-28/report_results.json"),
            ("h200_2026-11-26", "docs/benchmarks/h200/results.json"),
            ("h100_2026-11-27", "docs/benchmarks/h100/report_full.md"))  # its table: no JSON
STATIC = ("docs/benchmarks/compiled_h100/results.json",  # 16k and 64k, the report's variants
          "docs/benchmarks/compiled_h100/lengths/results.json",  # 8k and 32k defaults
          "docs/benchmarks/compiled_h100/onepass/results.json",  # strided onepass, 8k-64k
          "docs/benchmarks/compiled_h100/gathered/results.json")  # fixed gathered, 8k-64k
HELD_OUT = (("strided:128@pallas:chained:32x32", 16384),
            ("fixed:128:32@pallas:128x64:chained:w8", 16384),
            ("fixed:128:32@pallas:chained:64x32", 65536),
            ("strided:128@pallas", 32768),
            ("strided:128@pallas:128x64", 16384))
SMS = 132
PEAK_TFLOPS = 989.0  # bf16, dense, both chips' datasheets
HBM_GBPS = {"NVIDIA H100": 3352.0, "NVIDIA H200": 4800.0}
HEAD_DIM = 64
PRODUCTS = {"forward": 2, "dq": 3, "dkv": 4}  # matrix products per tile
TARGET_WITHIN, TARGET_SHARE, TARGET_SPEARMAN = 0.25, 0.8, 0.8  # issue 63's figures
# (name, unit, start, upper bound in that unit): the parameters, each fitted in log space.
PARAMS = (("launch", "µs", 10.0, 1e3), ("per_program", "µs", 5.0, 1e3),
          ("per_tile", "µs", 1.0, 1e2), ("rate", "TFLOP/s per SM", 3.0, PEAK_TFLOPS / SMS),
          ("xla_bandwidth", "× HBM", 1.0, 1e2), ("mask", "ns per 1,000 pairs", 100.0, 1e4),
          ("spill", "ns per KB spilled", 30.0, 1e4))
UNIT = {"µs": 1e-6, "TFLOP/s per SM": 1e12, "× HBM": 1.0, "ns per 1,000 pairs": 1e-12,
        "ns per KB spilled": 1e-9}


def _read(root: str, path: str) -> str:
    with open(os.path.join(root, path)) as f:
        return f.read()


def _device(kind: str) -> str:
    """"NVIDIA H200" of a device kind ("NVIDIA H100 80GB HBM3" gives "NVIDIA H100")."""
    found = next((d for d in HBM_GBPS if kind.startswith(d)), None)
    if found is None:
        raise ValueError(f"no HBM bandwidth known for {kind!r}")
    return found


def measured_rows(root: str = REPO, paths=MEASURED) -> list[dict]:
    """Every Pallas attention row the reports (``(label, path)`` pairs) measured: report,
    device, pattern, n, ms (the median), min_ms and max_ms where kept."""
    out = []
    for report, path in paths:
        text = _read(root, path)
        if path.endswith(".json"):
            data = json.loads(text)
            device = _device(data["stages"]["env"]["device_kind"])
            rows = [{"pattern": r["pattern"], "n": r["seq_len"], "ms": r["median_ms"],
                     "min_ms": r.get("min_ms"), "max_ms": r.get("max_ms")}
                    for r in data["stages"]["attention"]["rows"]
                    if "median_ms" in r and r.get("pass", "fwdbwd") != "fwd"]
        else:  # the summary's attention table: | pattern | n | ms | ... | result |
            device = _device(re.search(r"^Device: (.+?) \(", text, re.M).group(1))
            rows = []
            for line in text.splitlines():
                cells = [c.strip() for c in line.strip().strip("|").split("|")]
                if len(cells) == 9 and cells[1].isdigit() and cells[8] == "ok":
                    rows.append({"pattern": cells[0], "n": int(cells[1]),
                                 "ms": float(cells[2]), "min_ms": None, "max_ms": None})
        out += [{"report": report, "device": device, **r} for r in rows
                if "@pallas" in r["pattern"]]
    return out


def static_rows(root: str = REPO, paths=STATIC, prefix: str = "attention "
                ) -> dict[tuple[str, int], dict]:
    """The compile reports' attention programs with Triton kernels, by (pattern, n): those
    named ``PREFIX LENGTH PATTERN`` (the B=1 H=8 rows; "preset attention ": the preset's, B=16)."""
    out = {}
    for path in paths:
        for row in json.loads(_read(root, path))["rows"]:
            if row["name"].startswith(prefix) and row.get("kernels"):
                length, pattern = row["name"][len(prefix):].split(" ", 1)
                n = int(length[:-1]) * 1024 if length.endswith("k") else int(length)
                out[(pattern, n)] = row
    return out


def _tiles(pattern: str) -> tuple[int, int]:
    """A pattern's tiles (its ``QxK`` option; the GPU's default 64 × 64)."""
    found = re.search(r":(\d+)x(\d+)", pattern)
    return (int(found.group(1)), int(found.group(2))) if found else (64, 64)


def features(row: dict, pattern: str) -> dict:
    """What the model reads of a compiled program: per Triton kernel its programs, tiles per
    program (mean), blocks per SM, threads, spilled bytes, tile shape and flops per tile;
    XLA's kernels (how many, their bytes); whether every tile is masked (``one_loop``). A kernel
    that is no forward, dq or dk/dv pass (``sparse_KIND_...`` with KIND not in ``PRODUCTS``: a
    gather's own pass, e.g. the summary keys gathered once per layer) has no matrix products,
    and one tile of work a program unless the compile's tile work says how many."""
    q, k = _tiles(pattern)
    kernels = []
    for kernel in row["kernels"]:
        bq, bk = kernel.get("block_q", q), kernel.get("block_k", k)
        # a kernel of both backward passes (onepass) says its products a tile (on average)
        products = kernel.get("products") or PRODUCTS.get(kernel["name"].split("_")[1], 0)
        kernels.append({"name": kernel["name"], "programs": kernel["programs"],
                        **({"items": kernel["items"]} if "items" in kernel else {}),
                        "tiles": kernel.get("tiles_mean", 1.0),
                        "blocks_per_sm": kernel["blocks_per_sm"],
                        "threads": kernel["threads"], "spill_bytes": kernel["spill_bytes"],
                        "pairs": bq * bk, "flops": 2.0 * bq * bk * HEAD_DIM * products})
    return {"kernels": kernels, "xla_kernels": row["xla_kernel_bytes"]["kernels"],
            "xla_bytes": row["xla_kernel_bytes"]["bytes"], "one_loop": "one_loop" in pattern}


def parts(params: dict, f: dict, device: str) -> dict:
    """Seconds by where they go: launches, per-program costs, per-tile latency (masking and
    spills included), the tiles' matrix products, XLA's bytes; and per Triton kernel."""
    p = {name: params[name] * UNIT[unit] for name, unit, _, _ in PARAMS}
    out = {"launch": 0.0, "programs": 0.0, "tiles": 0.0, "products": 0.0, "kernels": {}}
    for k in f["kernels"]:
        latency = (p["per_tile"] * k.get("latency", 1.0)
                   + (p["mask"] * k["pairs"] if f["one_loop"] else 0.0)
                   + p["spill"] * k["spill_bytes"] * k["threads"] / 1e3)
        waves = k["programs"] / (SMS * k["blocks_per_sm"])
        split = {"launch": p["launch"], "programs": waves * p["per_program"],
                 "tiles": waves * k["tiles"] * latency,
                 "products": k["programs"] * k["tiles"] * k["flops"] / (SMS * p["rate"])}
        for key, seconds in split.items():
            out[key] += seconds
        out["kernels"][k["name"]] = sum(split.values())
    out["launch"] += f["xla_kernels"] * p["launch"]
    out["xla_bytes"] = f["xla_bytes"] / (HBM_GBPS[device] * 1e9 * p["xla_bandwidth"])
    out["total"] = sum(out[key] for key in ("launch", "programs", "tiles", "products",
                                            "xla_bytes"))
    return out


def predict(params: dict, f: dict, device: str) -> float:
    """The model's milliseconds for features ``f`` on ``device``."""
    return parts(params, f, device)["total"] * 1e3


def fit(rows: list[dict], feats: dict, starts: int = 24) -> tuple[dict, float]:
    """The parameters that minimise the squared log ratios of predicted to measured times over
    ``rows`` (each with its features in ``feats`` by (pattern, n)), and that least cost: from
    the starts in ``PARAMS`` and ``starts - 1`` others drawn around them (a fixed seed)."""
    import numpy as np
    from scipy.optimize import least_squares

    names = [name for name, _, _, _ in PARAMS]
    start = np.log([s for _, _, s, _ in PARAMS])
    upper = np.log([u for _, _, _, u in PARAMS])
    lower = start - 12.0  # e^-12 of the start: no parameter reaches 0

    def residuals(x):
        params = dict(zip(names, np.exp(x)))
        return np.array([math.log(predict(params, feats[(r["pattern"], r["n"])], r["device"])
                                  / r["ms"]) for r in rows])

    rng, best = np.random.default_rng(0), None
    for i in range(starts):
        x0 = np.clip(start + (rng.normal(0.0, 1.0, len(start)) if i else 0.0), lower + 1e-6,
                     upper - 1e-6)
        found = least_squares(residuals, x0, bounds=(lower, upper), method="trf")
        if best is None or found.cost < best.cost:
            best = found
    return dict(zip(names, np.exp(best.x).tolist())), float(best.cost)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for m in range(i, j + 1):
                out[order[m]] = (i + j) / 2
            i = j + 1
        return out
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var else float("nan")


def groups(rows: list[dict]) -> list[dict]:
    """Per report, pattern and length with two or more kernels measured: the rows' Spearman
    correlation of predicted with measured times, and the measured and predicted fastest."""
    by = {}
    for r in rows:
        by.setdefault((r["report"], r["pattern"].split(":")[0], r["n"]), []).append(r)
    out = []
    for (report, pattern, n), members in by.items():
        if len(members) < 2:
            continue
        measured, predicted = [m["ms"] for m in members], [m["predicted_ms"] for m in members]
        out.append({"report": report, "pattern": pattern, "n": n, "rows": len(members),
                    "spearman": spearman(measured, predicted),
                    "fastest": min(members, key=lambda m: m["ms"])["pattern"],
                    "predicted_fastest": min(members, key=lambda m: m["predicted_ms"])[
                        "pattern"]})
    return out


def calibrate(root: str = REPO, held_out=HELD_OUT, starts: int = 24, measured=MEASURED,
              static_paths=STATIC) -> dict:
    """The model fitted on every measured row but the held-out programs', and what it says of
    each row: params, cost, rows (measured, predicted, ratio, held_out, within), groups, and the
    shares within ``TARGET_WITHIN`` (all rows, held-out rows). `measured`: the reports, as
    ``MEASURED`` (a new report's folder joins with scripts/cost_model.py --measured);
    `static_paths`: the compile reports, as ``STATIC``."""
    static = static_rows(root, static_paths)
    rows = measured_rows(root, measured)
    missing = sorted({(r["pattern"], r["n"]) for r in rows} - set(static))
    if missing:
        raise ValueError(f"no static figures for {missing}: compile them "
                         "(scripts/compile_report.py) into a folder of STATIC")
    feats = {key: features(static[key], key[0]) for key in {(r["pattern"], r["n"])
                                                            for r in rows}}
    held = {tuple(h) for h in held_out}
    params, cost = fit([r for r in rows if (r["pattern"], r["n"]) not in held], feats, starts)
    for r in rows:
        r["predicted_ms"] = predict(params, feats[(r["pattern"], r["n"])], r["device"])
        r["ratio"] = r["predicted_ms"] / r["ms"]
        r["held_out"] = (r["pattern"], r["n"]) in held
        r["within"] = abs(r["ratio"] - 1) <= TARGET_WITHIN
    held_rows = [r for r in rows if r["held_out"]]
    return {"params": params, "cost": cost, "rows": rows, "groups": groups(rows),
            "within": sum(r["within"] for r in rows) / len(rows),
            "held_out_within": (sum(r["within"] for r in held_rows) / len(held_rows)
                                if held_rows else None),
            "fitted_rows": len(rows) - len(held_rows), "held_out_rows": len(held_rows)}


def static_baseline(result: dict, root: str = REPO) -> dict:
    """What the compile report alone said, on the same rows: its time (the estimated bytes at
    the device's full HBM bandwidth) within ``TARGET_WITHIN``, and per group the Spearman
    correlation of its ranking (fewest spilled bytes, then GB moved over the lowest
    occupancy: ``compiled_tables.rank``) with the measured times."""
    static = static_rows(root)
    rows = result["rows"]
    floor = [static[(r["pattern"], r["n"])]["hbm_gb"] / HBM_GBPS[r["device"]] * 1e3 for r in rows]
    within = sum(abs(f / r["ms"] - 1) <= TARGET_WITHIN for f, r in zip(floor, rows)) / len(rows)
    out = []
    for g in result["groups"]:
        members = [r for r in rows if (r["report"], r["pattern"].split(":")[0], r["n"])
                   == (g["report"], g["pattern"], g["n"])]
        keys = []
        for r in members:
            s = static[(r["pattern"], r["n"])]
            occupancy = min(k["occupancy"] for k in s["kernels"])
            keys.append((s["max_spill_bytes"], s["hbm_gb"] / occupancy))
        order = sorted(keys)
        out.append({**{k: g[k] for k in ("report", "pattern", "n", "rows")},
                    "spearman": spearman([r["ms"] for r in members],
                                         [order.index(key) for key in keys])})
    return {"within": within, "groups": out}


def _changed(f: dict, match, **scale) -> dict:
    """A copy of features ``f`` with the kernels whose name ``match``es changed: ``programs``,
    ``tiles``, ``flops``, ``pairs``, ``latency`` (of a tile: a factor on ``per_tile``)
    multiplied, ``blocks_per_sm``, ``threads`` set."""
    out = {**f, "kernels": []}
    for k in f["kernels"]:
        k = dict(k)
        if match(k["name"]):
            for key in ("programs", "tiles", "flops", "pairs", "latency"):
                k[key] = k.get(key, 1.0) * scale.get(key, 1)
            for key in ("blocks_per_sm", "threads"):
                k[key] = scale.get(key, k[key])
        out["kernels"].append(k)
    return out


def _one_pass(f: dict) -> dict:
    """Each pass's terms in one kernel (the band and column terms of strided in one program):
    one launch and one program's fixed cost per pass, the terms' tiles added, the residency of
    the tighter of them."""
    passes = {}
    for k in f["kernels"]:
        passes.setdefault(k["name"].split("_")[1], []).append(k)
    kernels = [{**ks[0], "name": f"sparse_{kind}_one_pass", "tiles": sum(k["tiles"] for k in ks),
                "blocks_per_sm": min(k["blocks_per_sm"] for k in ks)}
               for kind, ks in passes.items()]
    return {**f, "kernels": kernels}


def _persistent(f: dict) -> dict:
    """One program per resident slot (``SMS`` × blocks per SM), each walking its share of the
    grid's work: the per-program cost paid once a slot."""
    out = {**f, "kernels": []}
    for k in f["kernels"]:
        slots = SMS * k["blocks_per_sm"]
        if k["programs"] > slots:
            k = {**k, "tiles": k["tiles"] * k["programs"] / slots, "programs": slots}
        out["kernels"].append(k)
    return out


def _summary(name: str) -> bool:
    return name.endswith("_summary")


# Kernel designs not yet built, as changes to a measured program's features (their residency an
# assumption: each needs its registers checked by the compile report, without spills).
DESIGNS = (
    ("strided", "two query blocks per program, residency kept",
     lambda f: _changed(f, lambda n: True, programs=0.5, tiles=2)),
    ("strided", "four query blocks (or heads) per program, residency kept",
     lambda f: _changed(f, lambda n: True, programs=0.25, tiles=4)),
    ("strided", "band and column terms in one pass", _one_pass),
    ("strided", "one pass and a persistent grid", lambda f: _persistent(_one_pass(f))),
    ("fixed", "summary tiles 128 × 64 at 2 blocks of 4 warps per SM",
     lambda f: _changed(f, _summary, programs=0.5, flops=2, pairs=2, blocks_per_sm=2)),
    ("fixed", "summary tiles 128 × 128 at 1 block of 8 warps per SM (FlashAttention-2's)",
     lambda f: _changed(f, _summary, programs=0.5, tiles=0.5, flops=4, pairs=4,
                        blocks_per_sm=1, threads=256)),
    ("fixed", "summary kernels at 4 blocks per SM (≤ 128 registers)",
     lambda f: _changed(f, _summary, blocks_per_sm=4)),
    ("fixed", "summary tiles 128 × 64 at 2 blocks per SM and a persistent grid",
     lambda f: _persistent(_changed(f, _summary, programs=0.5, flops=2, pairs=2,
                                    blocks_per_sm=2))),
    ("fixed", "summary tiles at half today's latency (contiguous keys: a gathered summary)",
     lambda f: _changed(f, _summary, latency=0.5)),
)
WHAT_IF_BASES = (("strided:128@pallas:chained", 16384), ("strided:128@pallas", 65536),
                 ("fixed:128:32@pallas:chained", 16384), ("fixed:128:32@pallas", 65536))


def what_if(params: dict, root: str = REPO, device: str = "NVIDIA H200") -> list[dict]:
    """The model's time for each of ``DESIGNS`` on its pattern's measured programs
    (``WHAT_IF_BASES``), beside the program's own predicted time."""
    static = static_rows(root)
    out = []
    for pattern, n in WHAT_IF_BASES:
        base = features(static[(pattern, n)], pattern)
        base_ms = predict(params, base, device)
        for kind, name, change in DESIGNS:
            if pattern.startswith(kind):
                ms = predict(params, change(base), device)
                out.append({"base": pattern, "n": n, "design": name, "base_ms": base_ms,
                            "ms": ms, "gain": base_ms / ms})
    return out


def breakdown(params: dict, pattern: str, n: int, root: str = REPO,
              device: str = "NVIDIA H200") -> dict:
    """Shares of a program's predicted time: launches, per-program costs, per-tile latency,
    matrix products, XLA's bytes."""
    p = parts(params, features(static_rows(root)[(pattern, n)], pattern), device)
    return {"ms": p["total"] * 1e3, **{key: p[key] / p["total"] for key in (
        "launch", "programs", "tiles", "products", "xla_bytes")}}


def _ms(value: float) -> str:
    return f"{value:.3g}"


def markdown(result: dict, baseline: dict | None = None, designs: list[dict] | None = None) -> str:
    """The fit's parameters, each row (measured, predicted, ratio, held out), the ranks per
    group, the compile report's own estimate beside it, and the designs' predicted times."""
    rows, held = result["rows"], [r for r in result["rows"] if r["held_out"]]
    units = {name: unit for name, unit, _, _ in PARAMS}
    lines = ["Parameters (fitted on "
             f"{result['fitted_rows']} rows; {result['held_out_rows']} held out): "
             + ", ".join(f"{name} {value:.3g} {units[name]}"
                         for name, value in result["params"].items()) + ".", "",
             f"Within {TARGET_WITHIN:.0%}: {sum(r['within'] for r in rows)} of {len(rows)} rows "
             f"({result['within']:.0%}); held out: {sum(r['within'] for r in held)} of "
             f"{len(held)}.", "",
             "| report | pattern | n | measured ms | predicted ms | ratio | held out |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["pattern"].split(":")[0], r["n"], r["report"],
                                         r["ms"])):
        lines.append(f"| {r['report']} | {r['pattern']} | {r['n']} | {_ms(r['ms'])} | "
                     f"{_ms(r['predicted_ms'])} | {r['ratio']:.2f}"
                     f"{'' if r['within'] else ' ✗'} | {'yes' if r['held_out'] else ''} |")
    static = {(g["report"], g["pattern"], g["n"]): g["spearman"]
              for g in (baseline or {}).get("groups", [])}
    lines += ["", "Ranks of the kernels of each report, pattern and length (Spearman correlation "
              "of predicted with measured times; the compile report's ranking beside it):", "",
              "| report | pattern | n | kernels | Spearman | static ranking's | fastest measured "
              "| fastest predicted |", "|---|---|---|---|---|---|---|---|"]
    for g in result["groups"]:
        key = (g["report"], g["pattern"], g["n"])
        lines.append(f"| {g['report']} | {g['pattern']} | {g['n']} | {g['rows']} | "
                     f"{g['spearman']:.2f} | "
                     + (f"{static[key]:.2f}" if key in static else "—")
                     + f" | `{g['fastest']}` | `{g['predicted_fastest']}` |")
    if baseline:
        lines += ["", f"The compile report's own time (estimated bytes at full HBM bandwidth) is "
                  f"within {TARGET_WITHIN:.0%} for {baseline['within']:.0%} of the rows."]
    if designs:
        lines += ["", "Designs not yet built (their residency an assumption), on an H200:", "",
                  "| program | n | design | program ms | design ms | gain |",
                  "|---|---|---|---|---|---|"]
        for d in designs:
            lines.append(f"| {d['base']} | {d['n']} | {d['design']} | {_ms(d['base_ms'])} | "
                         f"{_ms(d['ms'])} | {d['gain']:.2f}× |")
    return "\n".join(lines) + "\n"
