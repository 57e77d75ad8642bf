"""The deviceless TPU compile's report (moved from ``sparse_jax.bench.compiled_tpu``, which
re-exports every name): our kernels beside splash attention's on the same masks, the results.md
tables and what fails the check.

  mask_of(row)                    the mask a row computes
  beside_splash(rows)             per length, mask and pass: our fewest cycles against splash's
  markdown(rows, target, header)  results.md
  problems(rows)                  a program that did not compile, has no kernel, does not fit
"""

from __future__ import annotations

import re

from sparse_jax.bench.compiled_tpu_output import TARGETS


def mask_of(row: dict) -> str:
    """The mask a row computes ("strided:128", "fixed:128:32", "dense"): its pattern less the
    implementation and kernel options."""
    return row["name"].split(" ")[2].partition("@")[0]


def _length(row: dict) -> str:
    return row["name"].split(" ")[1]


def _forward(row: dict) -> bool:
    return " fwd" in row["name"]


def _heads(row: dict) -> int:
    """The heads a row's name gives (" h1": 1), else the usual 8."""
    found = re.search(r" h(\d+)$", row["name"])
    return int(found.group(1)) if found else 8  # compiled_tpu.ATTENTION_SHAPE's heads


def beside_splash(rows: list[dict]) -> list[dict]:
    """Per (length, mask, forward only or not) that has our kernels and splash attention's with
    static cycles: our fewest cycles, splash's fewest (its best block size) and their ratio,
    per head (the kernels' grids step over heads, so their cycles grow with the heads: at 64k
    the profiler and splash's compile fit this machine with different heads)."""
    out = []
    ours = [r for r in rows if r["name"].startswith("attention ") and r.get("cycles")]
    splash = [r for r in rows if r["name"].startswith("splash ") and r.get("cycles")]
    kind = lambda r: (_length(r), mask_of(r), _forward(r))  # noqa: E731

    def per_head(r, field):
        return r[field] / _heads(r)

    def fewest(group, field):
        best = min(group, key=lambda r: per_head(r, field))
        return best, per_head(best, field)

    for key in dict.fromkeys(map(kind, ours)):
        mine, theirs = ([r for r in group if kind(r) == key] for group in (ours, splash))
        if mine and theirs:
            (best, cycles), (rival, rival_cycles) = (fewest(g, "cycles") for g in (mine, theirs))
            out.append({"length": key[0], "mask": key[1], "forward": key[2], "ours": best["name"],
                        "ours_cycles": best["cycles"], "splash": rival["name"],
                        "splash_cycles": rival["cycles"], "ratio": rival_cycles / cycles,
                        "all_op_ratio": per_head(rival, "all_op_cycles")
                        / per_head(best, "all_op_cycles")})
            if all(r.get("bounded_cycles") for r in mine + theirs):
                (best, cycles), (rival, rival_cycles) = (fewest(g, "bounded_cycles")
                                                         for g in (mine, theirs))
                out[-1].update(bounded_ours=best["name"], bounded_splash=rival["name"],
                               bounded_ratio=rival_cycles / cycles)
    return out


def markdown(rows: list[dict], target: str, header: list[str]) -> str:
    """One row per program, then one per Mosaic kernel; with static cycles, ours beside splash
    attention's on the same masks."""
    t = TARGETS[target]
    f = lambda v, spec=".3g": "—" if v is None else format(v, spec)  # noqa: E731
    cycles = "static cycles: libtpu's static profile (estimates; the sum over the Mosaic " \
        f"kernels, and over every op of the program), time at {t.clock_ghz:g} GHz; MXU floor: " \
        f"the visited tiles' matrix products at the chip's {t.peak_tflops:g} bf16 TFLOP/s " \
        "(the profile's estimate falls below it for large tiles; bounded: the larger of the " \
        "two)" if t.cycles else "no static cycles: libtpu's static profiler aborts for this chip"
    lines = [*header, "", f"Target: {t.name}, topology {t.topology}, {t.hbm_gib:g} GiB HBM; "
             f"{cycles}.", "",
             "| program | compile s | planned GiB | fits | Mosaic kernels | max VMEM KiB | "
             "XLA flops | kernel Mcycles | est. µs | all-op Mcycles | MXU floor Mcycles | "
             "result |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kernels = r.get("kernels")
        mega = lambda v: f(None if v is None else v / 1e6, ".3f")  # noqa: E731
        lines.append(
            f"| {r['name']} | {f(r.get('compile_s'), '.1f')} | {f(r.get('planned_gib'), '.3f')} "
            f"| {'—' if 'fits' not in r else ('yes' if r['fits'] else '**no**')} "
            f"| {'—' if kernels is None else len(kernels)} "
            f"| {f(r['max_vmem_bytes'] / 1024 if 'max_vmem_bytes' in r else None, '.0f')} "
            f"| {f(r.get('flops'), '.3g')} | {mega(r.get('cycles'))} "
            f"| {f(r.get('estimated_us'), '.0f')} | {mega(r.get('all_op_cycles'))} "
            f"| {mega(r.get('mxu_floor_cycles'))} | {r.get('error', 'ok')} |")
    pairs = beside_splash(rows)
    if pairs:
        lines += ["", "Beside splash attention on the same mask (fewest kernel cycles of each; "
                  "ratio: splash's kernel cycles over ours, per head where the heads differ "
                  "(a name's hN: N heads, else 8); all ops: the same for every op of "
                  "the two programs, XLA's layout transposes and merges too):", "",
                  "| length | mask | pass | ours | Mcycles | splash | Mcycles | ratio | "
                  "all-op ratio | bounded: ours, splash, ratio |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for p in pairs:
            bounded = "—" if "bounded_ratio" not in p else (
                f"{p['bounded_ours']}, {p['bounded_splash']}, {p['bounded_ratio']:.2f}")
            lines.append(f"| {p['length']} | {p['mask']} | "
                         f"{'forward' if p['forward'] else 'fwd+bwd'} | {p['ours']} | "
                         f"{p['ours_cycles'] / 1e6:.3f} | {p['splash']} | "
                         f"{p['splash_cycles'] / 1e6:.3f} | {p['ratio']:.2f} | "
                         f"{p['all_op_ratio']:.2f} | {bounded} |")
    lines += ["", "Per Mosaic kernel (VMEM: its scoped allocation, scratch and pipeline windows; "
              "output in VMEM: XLA keeps one there whole, with no window; static cycles over "
              "its calls):", "",
              "| program | kernel | calls | VMEM KiB | output in VMEM | static cycles |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        for k in r.get("kernels", []):
            lines.append(f"| {r['name']} | {k['name']} | {k['calls']} | "
                         f"{k['vmem_bytes'] / 1024:.0f} | {'yes' if k['output_in_vmem'] else 'no'}"
                         f" | {f(k.get('cycles'), ',')} |")
    return "\n".join(lines) + "\n"


def problems(rows: list[dict]) -> list[str]:
    """What fails the check: a program that did not compile, a Pallas program with no Mosaic
    kernel (traced for another platform), one that does not fit the chip's HBM."""
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"{r['name']}: {r['error']}")
        elif "@pallas" in r["name"] and not r["kernels"]:
            out.append(f"{r['name']}: no Mosaic kernel in the compiled program")
        elif not r["fits"]:
            out.append(f"{r['name']}: plans {r['planned_gib']:.2f} GiB, more than the chip's "
                       f"{TARGETS[r['target']].hbm_gib:g} GiB")
    return out
