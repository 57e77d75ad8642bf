r"""Predictions of kernels built but not yet measured, committed before a GPU times them: the
calibrated cost model (``cost_model.predict`` with the fitted parameters,
docs/benchmarks/cost_model/results.json) on each kernel's compile-report rows (static figures
for an H100, compiled on a CPU), beside cuDNN's dense causal attention measured on an H200
(docs/benchmarks/h200_2026-11-28): forward + backward, bf16, B = 1, H = 8, d = 64, at 8k, 16k,
32k and 64k. Predictions, not measurements. Three tables:

  python -m sparse_jax.bench.kernel_predictions strided \
      docs/benchmarks/cost_model/kernels_strided.json
  python -m sparse_jax.bench.kernel_predictions fixed docs/benchmarks/cost_model/kernels_fixed.json
  python -m sparse_jax.bench.kernel_predictions residency

* ``strided``: the one-pass kernels (``attention.pallas_onepass``; compiled_h100/onepass), with
  and without option atomic, each row also with ``per_item``'s bound (a persistent program's
  fixed cost paid per work item); the atomic rows with the room left for the atomic adds.
* ``residency``: the one-pass backward at more blocks an SM (``RESIDENCY``: split in a dq and
  a dk/dv kernel as compiled, or at residencies no variant reached), from onepass:s1's rows.
* ``fixed``: the gathered kernels (``attention.pallas_gathered``; compiled_h100/gathered) beside
  today's (compiled_h100 and its lengths folder). The model's per-tile latency is one fitted
  constant for every kernel; what a contiguous, list-free walk with a deeper pipeline does to
  it the compile output cannot say. Each gathered row is therefore given twice: at the fitted
  latency and at half of it (an assumption, the one ``cost_model.DESIGNS`` prices as "summary
  tiles at half today's latency"). TFLOP/s count the kept pairs as the accelerator report does
  (``common.attention_flops``); "of cuDNN" is that rate over cuDNN's measured one. The rows
  with option atomic also give the room left for what the model cannot price there (the
  atomic adds, every tile of the gathered keys masked): the largest factor on their dk/dv
  kernels' per-tile latency at which they still reach 80%, and still beat the same kernels
  without the option.

The table of every row the accelerator report times, printed beside its measurements, is
``bench.predictions``'s (predictions.json); these two say more of two kernels.
"""

from __future__ import annotations

import json
import os
import sys

from sparse_jax.bench import cost_model

DEVICE = "NVIDIA H200"
GATHERED = "docs/benchmarks/compiled_h100/gathered/results.json"
CUDNN = "docs/benchmarks/h200_2026-11-28/report_results.json"
FIT = "docs/benchmarks/cost_model/results.json"  # the calibrated parameters
TODAY = {8192: "fixed:128:32@pallas", 16384: "fixed:128:32@pallas:chained",
         32768: "fixed:128:32@pallas", 65536: "fixed:128:32@pallas"}  # what each length runs
HALF = 0.5  # the assumed per-tile latency of the gathered kernels, of the fitted one
TARGET = 0.8  # issue 69: fixed at 80% of cuDNN's TFLOP/s on the kept pairs


def _read(root, path):
    with open(os.path.join(root, path)) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# Strided: the one-pass kernels.

ONEPASS = "docs/benchmarks/compiled_h100/onepass/results.json"
STRIDED_TARGET = {16384: 10, 65536: 35}  # issue 69: strided at these multiples of cuDNN
LATENCY_TOP = 10.0  # the largest latency factor searched


def per_item(f: dict) -> dict:
    """Features ``f`` with a persistent kernel's fixed cost paid per work item instead of per
    program (``items``, from the compile report; ``_persistent``'s inverse): the bound if an
    item's own tiles in and outputs out cost what a program's prologue and epilogue do."""
    out = {**f, "kernels": []}
    for k in f["kernels"]:
        items = k.get("items", k["programs"])
        out["kernels"].append({**k, "programs": items,
                               "tiles": k["tiles"] * k["programs"] / items})
    return out


def strided(params: dict, root: str = cost_model.REPO, static: str = ONEPASS) -> list[dict]:
    """The model's time for every program of a compile report (``static``) beside cuDNN's
    dense causal attention measured at the same length: pattern, n, predicted ms, the shares
    of where they go, predicted ms if each work item paid a program's fixed cost
    (``per_item``), cuDNN's ms and the predicted ratio; for option atomic also the largest
    factor on its backward kernels' per-tile latency (the atomic adds' cost, which the compile
    output cannot say) at which it still meets onepass:s1's time and the issue's ratio."""
    cudnn = {r["seq_len"]: r["median_ms"] for r in _read(root, CUDNN)["stages"]["attention"][
        "rows"] if r["pattern"] == "dense@cudnn" and "median_ms" in r}
    out = []
    for (pattern, n), row in sorted(cost_model.static_rows(root, (static,)).items(),
                                    key=lambda item: item[0][1]):
        f = cost_model.features(row, pattern)
        p = cost_model.parts(params, f, DEVICE)
        ms, bound = p["total"] * 1e3, cost_model.predict(params, per_item(f), DEVICE)
        out.append({"pattern": pattern, "n": n, "device": DEVICE, "predicted_ms": ms,
                    "shares": {key: p[key] / p["total"] for key in (
                        "launch", "programs", "tiles", "products", "xla_bytes")},
                    "per_item_ms": bound, "cudnn_ms": cudnn.get(n),
                    "ratio": cudnn[n] / ms if n in cudnn else None,
                    "per_item_ratio": cudnn[n] / bound if n in cudnn else None,
                    "params": FIT, "measured": CUDNN, "static": static,
                    "prediction": True})
    plain = {(r["pattern"], r["n"]): r["predicted_ms"] for r in out}
    for r, f in ((r, cost_model.features(cost_model.static_rows(root, (static,))[(
            r["pattern"], r["n"])], r["pattern"])) for r in out
            if r["pattern"].endswith(":atomic")):
        same = plain.get((r["pattern"][:-len(":atomic")], r["n"]))
        target = STRIDED_TARGET.get(r["n"])
        r["backward_latency_for"] = {
            "onepass_s1": None if same is None else _latency_for(
                params, f, same, "backward", LATENCY_TOP),
            "target": None if target is None else _latency_for(
                params, f, cudnn[r["n"]] / target, "backward", LATENCY_TOP)}
    return out


def _backward_at(f: dict, blocks: int) -> dict:
    """The one-pass kernels' features ``f`` with each backward kernel at ``blocks`` an SM (its
    persistent grid resized, its items' tiles shared among the slots)."""
    out = {**f, "kernels": []}
    for k in f["kernels"]:
        if "backward" in k["name"]:
            programs = min(k["items"], cost_model.SMS * blocks)
            k = {**k, "programs": programs, "tiles": k["tiles"] * k["programs"] / programs,
                 "blocks_per_sm": blocks}
        out["kernels"].append(k)
    return out


def _split_backward(f: dict, dq_blocks: int, dkv_blocks: int) -> dict:
    """The one-pass kernels' features ``f`` with each backward kernel split in two persistent
    kernels, a dq kernel (3 products a tile) and a dk/dv kernel (4), each with half the items
    and half the tiles (both passes visit the same tile pairs) on its own grid."""
    out = {**f, "kernels": []}
    for k in f["kernels"]:
        if "backward" not in k["name"]:
            out["kernels"].append(k)
            continue
        tiles, items = k["tiles"] * k["programs"] / 2, k["items"] // 2
        for name, blocks, products in (("dq", dq_blocks, 3), ("dkv", dkv_blocks, 4)):
            programs = min(items, cost_model.SMS * blocks)
            out["kernels"].append({
                **k, "name": k["name"].replace("backward", name), "programs": programs,
                "items": items, "tiles": tiles / programs, "blocks_per_sm": blocks,
                "flops": 2.0 * k["pairs"] * cost_model.HEAD_DIM * products})
    return out


# Residency for the one-pass backward, as changes to the compiled onepass:s1 rows: the split
# as the deviceless compile for sm_90a gave it (64 x 64 tiles, 4 warps, one stage: the dq
# kernel 180-183 registers, the dk/dv kernel 240-241, 2 blocks an SM each; not kept), and
# residencies no variant reached (3 blocks: <= 168 registers).
RESIDENCY = (("split: dq and dk/dv kernels at 2 and 2 blocks (as compiled)",
              lambda f: _split_backward(f, 2, 2)),
             ("split at 3 and 3 blocks", lambda f: _split_backward(f, 3, 3)),
             ("one backward kernel at 3 blocks", lambda f: _backward_at(f, 3)))


def residency(params: dict, root: str = cost_model.REPO, static: str = ONEPASS) -> list[dict]:
    """The model's time for each of ``RESIDENCY`` on the onepass:s1 rows of ``static``, beside
    the row's own prediction and cuDNN's measured time: pattern, n, design, ms, ratios."""
    cudnn = {r["seq_len"]: r["median_ms"] for r in _read(root, CUDNN)["stages"]["attention"][
        "rows"] if r["pattern"] == "dense@cudnn" and "median_ms" in r}
    out = []
    for (pattern, n), row in sorted(cost_model.static_rows(root, (static,)).items(),
                                    key=lambda item: item[0][1]):
        if not pattern.endswith("onepass:s1"):
            continue
        f = cost_model.features(row, pattern)
        base = cost_model.predict(params, f, DEVICE)
        for design, change in RESIDENCY:
            ms = cost_model.predict(params, change(f), DEVICE)
            out.append({"pattern": pattern, "n": n, "design": design, "ms": ms,
                        "base_ms": base, "ratio": cudnn[n] / ms, "base_ratio": cudnn[n] / base,
                        "prediction": True})
    return out


# ---------------------------------------------------------------------------------------------
# Fixed: the gathered kernels.

def _at_latency(params, f, factor, match="gathered"):
    """Predicted ms with the per-tile latency of the kernels named with ``match`` (the
    gathered ones) ``factor`` × the fitted one."""
    changed = cost_model._changed(f, lambda name: match in name, latency=factor)
    return cost_model.predict(params, changed, DEVICE)


def _latency_for(params, f, target_ms, match="gathered", top=1.0):
    """The largest latency factor (of the fitted one; at most ``top``) of ``match``'s kernels
    at which the prediction meets ``target_ms`` (bisection; 0 if even no latency misses it)."""
    if _at_latency(params, f, top, match) <= target_ms:
        return top
    if _at_latency(params, f, 0.0, match) > target_ms:
        return 0.0
    lo, hi = 0.0, top
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _at_latency(params, f, mid, match) <= target_ms else (lo, mid)
    return lo


def fixed(root: str = cost_model.REPO) -> dict:
    """Every row: pattern, n, kernels, predicted ms (fitted latency; for the gathered kernels
    also at ``HALF`` of it), kept-pair TFLOP/s and the share of cuDNN's measured rate."""
    from sparse_jax.attention.spec import PatternSpec
    from sparse_jax.bench.accelerator.common import attention_flops

    params = _read(root, FIT)["params"]
    cudnn = {r["seq_len"]: r for r in _read(root, CUDNN)["stages"]["attention"]["rows"]
             if r["pattern"] == "dense@cudnn"}
    static = cost_model.static_rows(root)
    rows = [(TODAY[n], n, static[(TODAY[n], n)]) for n in sorted(TODAY)]
    for row in _read(root, GATHERED)["rows"]:
        _, length, pattern = row["name"].split(" ", 2)
        rows.append((pattern, int(length[:-1]) * 1024, row))
    spec = PatternSpec("fixed", stride=128, c=32)
    fitted = {(pattern, n): cost_model.predict(params, cost_model.features(row, pattern), DEVICE)
              for pattern, n, row in rows}
    out = []
    for pattern, n, row in rows:
        f = cost_model.features(row, pattern)
        flops = attention_flops(1, 8, n, spec.mean_keys(n), 64)
        ms = {"fitted": fitted[(pattern, n)]}
        reference = cudnn[n]["tflops"]
        needed = backward = None
        if "gathered" in pattern:
            ms["half_latency"] = _at_latency(params, f, HALF)
            target_ms = flops / (TARGET * reference * 1e12) * 1e3
            needed = _latency_for(params, f, target_ms, top=LATENCY_TOP)
        if pattern.endswith(":atomic"):  # the atomic adds' room: its dk/dv kernels' latency
            plain = fitted.get((pattern[:-len(":atomic")], n))
            backward = {"target": _latency_for(params, f, target_ms, "dkv_gathered", LATENCY_TOP),
                        "plain": None if plain is None else _latency_for(
                            params, f, plain, "dkv_gathered", LATENCY_TOP)}
        out.append({"pattern": pattern, "n": n, "kernels": len(f["kernels"]),
                    "xla_kernels": f["xla_kernels"], "predicted_ms": ms,
                    "tflops": {k: flops / (v * 1e-3) / 1e12 for k, v in ms.items()},
                    "of_cudnn": {k: flops / (v * 1e-3) / 1e12 / reference
                                 for k, v in ms.items()},
                    "cudnn_ms": cudnn[n]["median_ms"], "cudnn_tflops": reference,
                    "latency_for_target": needed, "backward_latency_for": backward,
                    "parts": {k: v for k, v in cost_model.parts(params, f, DEVICE).items()
                              if k != "kernels"},
                    "per_kernel_ms": {k: v * 1e3 for k, v in cost_model.parts(
                        params, f, DEVICE)["kernels"].items()}})
    return {"device": DEVICE, "params": params, "assumed_latency": HALF, "target": TARGET,
            "sources": {"gathered": GATHERED, "cudnn": CUDNN, "params": FIT,
                        "today": cost_model.STATIC}, "rows": out}


def fixed_markdown(result: dict) -> str:
    """The table of docs/cost_model.md's section on the gathered kernels."""
    lines = ["| kernel | n | Triton + XLA kernels | predicted ms | of cuDNN | at half the "
             "latency: ms | of cuDNN | 80% needs latency × | atomic: dk/dv latency × for 80%, "
             "to beat no atomic |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["rows"], key=lambda r: (r["n"], "gathered" in r["pattern"],
                                                    r["pattern"].endswith(":atomic"),
                                                    r["pattern"])):
        half, room = r["predicted_ms"].get("half_latency"), r.get("backward_latency_for")
        lines.append(f"| `{r['pattern'].split('@')[1]}` | {r['n']} | {r['kernels']} + "
                     f"{r['xla_kernels']} | {r['predicted_ms']['fitted']:#.3g} | "
                     f"{r['of_cudnn']['fitted']:.0%} | "
                     + (f"{half:#.3g} | {r['of_cudnn']['half_latency']:.0%} | "
                        f"{r['latency_for_target']:.2f} |" if half else "— | — | — |")
                     + (f" {room['target']:.2f}, {room['plain']:.2f} |" if room else " — |"))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# A pattern of one's own: the generic tile term.

TILES = "docs/benchmarks/custom_tiles/compiled_h100/results.json"


def tiles(root: str = cost_model.REPO) -> dict:
    """The tile term (``examples/my_patterns.py``'s ``random_tiles``, a rule no built-in term
    covers beyond the own block) at 16k and block densities 1/32 to 1/2: the model's time on
    its compile rows, beside what FlexAttention is known to approach, every kept pair at a
    dense kernel's rate (here cuDNN's measured TFLOP/s on the kept pairs, an upper bound of
    FlexAttention's speed, not a measurement of it) and cuDNN's dense causal time."""
    from sparse_jax.bench.accelerator.common import attention_flops
    from sparse_jax.bench.attention import parse_pattern

    examples = os.path.join(root, "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)  # the rule's module
    params = _read(root, FIT)["params"]
    cudnn = {r["seq_len"]: r for r in _read(root, CUDNN)["stages"]["attention"]["rows"]
             if r["pattern"] == "dense@cudnn"}
    out = []
    for (pattern, n), row in sorted(cost_model.static_rows(root, (TILES,)).items(),
                                    key=lambda item: item[0][0]):
        spec = parse_pattern(pattern, n)[0]
        kept = spec.mean_keys(n)
        flops = attention_flops(1, 8, n, kept, 64)
        f = cost_model.features(row, pattern)
        p = cost_model.parts(params, f, DEVICE)
        ms, reference = p["total"] * 1e3, cudnn[n]
        ideal = flops / (reference["tflops"] * 1e12) * 1e3
        out.append({"pattern": pattern, "n": n, "pair_density": kept / ((n + 1) / 2),
                    "kernels": len(f["kernels"]), "xla_kernels": f["xla_kernels"],
                    "predicted_ms": ms, "shares": {key: p[key] / p["total"] for key in (
                        "launch", "programs", "tiles", "products", "xla_bytes")},
                    "dense_rate_ms": ideal, "of_dense_rate": ideal / ms,
                    "cudnn_ms": reference["median_ms"], "vs_cudnn": reference["median_ms"] / ms,
                    "prediction": True})
    return {"device": DEVICE, "sources": {"static": TILES, "cudnn": CUDNN, "params": FIT},
            "rows": out}


def tiles_markdown(result: dict) -> str:
    """The table of docs/custom_patterns.md's section on the tile term's speed on a GPU."""
    lines = ["| pair density | variant | kernels (Triton + XLA) | predicted ms | × cuDNN dense | "
             "every kept pair at cuDNN's rate: ms | predicted of that rate | launches, programs, "
             "tiles, products, XLA bytes |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        shares = ", ".join(f"{v:.0%}" for v in r["shares"].values())
        variant = "chained" if r["pattern"].endswith(":chained") else "terms (the default)"
        lines.append(f"| {r['pair_density']:.3f} | {variant} | {r['kernels']} + "
                     f"{r['xla_kernels']} | "
                     f"{r['predicted_ms']:#.3g} | {r['vs_cudnn']:.1f}× | "
                     f"{r['dense_rate_ms']:#.3g} | {r['of_dense_rate']:.0%} | {shares} |")
    return "\n".join(lines) + "\n"


TABLES = {"strided": lambda root: {"rows": strided(_read(root, FIT)[
    "params"], root)}, "fixed": fixed, "tiles": tiles,
    "residency": lambda root: {"rows": residency(_read(root, FIT)["params"], root)}}

if __name__ == "__main__":  # python -m sparse_jax.bench.kernel_predictions KIND [JSON]
    if len(sys.argv) < 2 or sys.argv[1] not in TABLES:
        sys.exit("usage: python -m sparse_jax.bench.kernel_predictions strided|fixed|tiles|"
                 "residency "
                 "[OUTPUT_JSON]")
    result = TABLES[sys.argv[1]](cost_model.REPO)
    if sys.argv[1] == "fixed":
        print(fixed_markdown(result))
    elif sys.argv[1] == "tiles":
        print(tiles_markdown(result))
    elif sys.argv[1] == "residency":
        for r in result["rows"]:
            print(f"{r['n']} {r['design']}: {r['ms']:.3f} ms, {r['ratio']:.1f}x cuDNN "
                  f"(onepass:s1 {r['base_ms']:.3f} ms, {r['base_ratio']:.1f}x)")
    else:
        for r in result["rows"]:
            latency = r.get("backward_latency_for") or {}
            print(f"{r['pattern']} {r['n']}: {r['predicted_ms']:.3f} ms, "
                  f"{r['ratio']:.1f}x cuDNN (per item: {r['per_item_ratio']:.1f}x)"
                  + "".join(f"; backward latency for {k}: up to {v:.2f}x"
                            for k, v in latency.items() if v is not None))
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump({"command": f"python -m sparse_jax.bench.kernel_predictions {sys.argv[1]} "
                       + sys.argv[2], "date": "2026-11-29", **result}, f, indent=1)
