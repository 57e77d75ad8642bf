"""The deviceless GPU compile's report (moved from ``sparse_jax.bench.compiled``, which
re-exports every name): the Pallas attention programs ranked by their static figures, the
results.md tables, and what fails the check.

  rank(rows)                      the attention rows of each length and pattern, best first
  markdown(rows, target, header)  results.md
  problems(rows)                  a program that did not compile, a kernel that spills
"""

from __future__ import annotations

from sparse_jax.attention.patterns import KINDS
from sparse_jax.bench.compiled_output import TARGETS


def rank(rows: list[dict]) -> list[dict]:
    """The Pallas attention rows of each length and pattern ("16k strided") in the order the
    static figures promise: fewest spilled bytes, then the fewest estimated bytes per resident
    warp (GB moved over the worst kernel's occupancy: a kernel that waits on memory moves bytes
    at a rate its warps in flight set, Little's law). On the H100 the spills ordered the 64 x 64,
    128 x 64 and 128 x 128 tiles as their measured times did (0.912, 1.18, 1.52 ms), which the
    bytes alone ordered backwards (docs/gpu_compile.md)."""
    rows = [r for r in rows if r.get("hbm_gb") is not None]
    return sorted(rows, key=lambda r: (_family(r), r["max_spill_bytes"], _per_warp(r)))


def _per_warp(row: dict) -> float:
    return row["hbm_gb"] / max(1e-9, min(k.get("occupancy", 0) for k in row["kernels"]))


def _family(row: dict) -> str:
    """"16k strided" of "attention 16k strided:128@pallas:chained"; a pattern of one's own is
    its whole definition ("16k my_patterns:longformer(window=256)")."""
    _, length, pattern = row["name"].split(" ", 2)
    kind = pattern.split(":")[0].partition("@")[0]
    built_in = kind in KINDS
    return f"{length} {kind if built_in else pattern.partition('@')[0]}"


def markdown(rows: list[dict], target: str, header: list[str]) -> str:
    """results.md: one row per program, the attention programs ranked by their static figures,
    then one row per Triton kernel."""
    t = TARGETS[target]
    f = lambda v, spec=".3g": "—" if v is None else format(v, spec)  # noqa: E731
    lines = [*header, "", f"Target: {t.name} ({t.arch}, {t.sms} SMs, {t.hbm_gb:.1f} GB, "
             f"{t.hbm_gbps:,.0f} GB/s).", "",
             "| program | compile s | planned GB | fits | Triton kernels (launches) | "
             "max spill B | est. GB moved | at full bandwidth ms | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kernels = r.get("kernels")
        count = "—" if kernels is None else f"{len(kernels)} ({r['triton_launches']})"
        lines.append(
            f"| {r['name']} | {f(r.get('compile_s'), '.1f')} | {f(r.get('planned_gb'), '.2f')} "
            f"| {'—' if 'fits' not in r else ('yes' if r['fits'] else '**no**')} | {count} "
            f"| {f(r.get('max_spill_bytes'), 'd')} | {f(r.get('hbm_gb'), '.3f')} "
            f"| {f(r.get('hbm_floor_ms'), '.3f')} | {r.get('error', 'ok')}"
            + (f" ({r['note']})" if "note" in r else "") + " |")
    ranked = rank(rows)
    if ranked:
        lines += ["", "The Pallas attention programs of each length and pattern as their static "
                  "figures rank them (fewest spilled bytes, then the fewest bytes moved per "
                  "resident warp: GB over the worst kernel's occupancy):", "",
                  "| length, pattern | rank | program | max spill B | lowest occupancy | "
                  "est. GB moved | GB / occupancy |", "|---|---|---|---|---|---|---|"]
        place = {}
        for r in ranked:
            place[_family(r)] = place.get(_family(r), 0) + 1
            lines.append(f"| {_family(r)} | {place[_family(r)]} | {r['name']} | "
                         f"{r['max_spill_bytes']} | "
                         f"{min(k.get('occupancy', 0) for k in r['kernels']):.1%} | "
                         f"{r['hbm_gb']:.3f} | {_per_warp(r):.1f} |")
    lines += ["", "Per Triton kernel (a kernel repeated in other layers is listed once, with its "
              "launches; tiles: the key tiles a program visits, query tiles for dkv; est. GB: "
              "its tiles' loads and stores with no reuse through L2):", "",
              "| program | kernel | launches | grid | threads | regs | spill B | smem KB | "
              "blocks/SM | occupancy | bound | waves | tiles mean / max | est. GB |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for k in r.get("kernels", []):
            lines.append(
                f"| {r['name']} | {k['name']} | {k['launches']} | "
                f"{'×'.join(map(str, k['grid']))} | "
                f"{k['threads']} | {f(k.get('registers'), 'd')} | {k['spill_bytes']} | "
                f"{k['shared_memory'] / 1024:.1f} | {f(k.get('blocks_per_sm'), 'd')} | "
                f"{f(k.get('occupancy'), '.1%')} | {k.get('bound', '—')} | "
                f"{f(k.get('waves'), '.1f')} | "
                + (f"{k['tiles_mean']:.2f} / {k['tiles_max']}" if "tiles_mean" in k else "—")
                + f" | {f(k['hbm_bytes'] / 1e9 if 'hbm_bytes' in k else None, '.4f')} |")
    return "\n".join(lines) + "\n"


def problems(rows: list[dict]) -> list[str]:
    """What fails the check: a program that did not compile, a Triton kernel that spills."""
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"{r['name']}: {r['error']}")
        for k in r.get("kernels", []):
            if k["spill_bytes"]:
                out.append(f"{r['name']}: {k['name']} spills {k['spill_bytes']} bytes "
                           f"({k.get('registers')} registers)")
    return out
