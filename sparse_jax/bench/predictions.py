r"""Predictions on record: the cost model's time for every Pallas attention row and training step
the accelerator report measures, written before a loan and printed beside the measurement after
it (docs/cost_model.md, "Predictions on record").

  python scripts/cost_model.py --predictions=docs/benchmarks/cost_model/predictions.json --overwrite

A predictions file (``docs/benchmarks/cost_model/predictions*.json``; every such file is read):

  {"date": "2026-11-29", "command": "...", "basis": "what the figures rest on",
   "rows": [{"stage": "attention", "row": "fixed:128:32@pallas", "n": 16384,
             "device": "NVIDIA H200", "ms": 1.60, "how": "..."},
            {"stage": "train_step", "row": "paper 16k fixed@pallas",
             "device": "NVIDIA H200", "ms": 170.1, "how": "..."}]}

A row is keyed by the report's own names: an attention row by its pattern string and length
(``attention.plan``'s), a training step by its case name (``train_step.plan``'s). ``device`` is
a device kind's start ("NVIDIA H200"; absent: any device); ``ms`` is forward + backward for
attention (B=1 H=8 d=64, bfloat16), a whole step for train_step. Also taken: ``pattern`` or
``case`` for ``row`` (the stage follows), ``seq_len`` for ``n``, ``predicted_ms`` for ``ms``.
Two files that predict the same row for the same device are refused.

  load(root)                     every file's rows, checked: {"rows", "sources"}
  lookup(predictions, ...)       the prediction of one report row, or None
  judge(measured_ms, predicted)  measured / predicted, and whether it is off by > 25%
  attention_rows(params, ...)    the model's rows for the report's Pallas attention plan
  step_ms(...)                   a training step with another attention kernel
  table(params)                  the committed file's content
"""

from __future__ import annotations

import glob
import json
import os

from sparse_jax.bench import cost_model

PATTERN = "docs/benchmarks/cost_model/predictions*.json"
OFF = 0.25  # a measurement more than 25% from its prediction is flagged
DEVICES = ("NVIDIA H100", "NVIDIA H200")
STAGES = ("attention", "train_step")
# The step the training-step predictions start from: the paper's enwik8 model at 2 × 16,384,
# 30 layers, remat "full", measured on an H200 (2026-11-28, docs/benchmarks/h200_2026-11-28):
# 0.1739 s a step with the kernel then the default (the terms variant), whose attention row
# measured 1.96 ms at 16k.
STEP_BASE = {"case": "paper 16k fixed@pallas", "report": "h200_2026-11-28", "ms": 173.92,
             "kernel": "fixed:128:32@pallas:terms", "n": 16384, "layers": 30, "batch": 2,
             "device": "NVIDIA H200"}
# The report's training steps: the attention row each runs at 16k (a row without a variant runs
# the measured default there, chained: ``static_for``) and whether its remat recomputes the
# kernels' forward pass (remat "full" does; "attention", the report's paper steps', does not)
STEP_KERNELS = {"paper 16k fixed@pallas": ("fixed:128:32@pallas", False),
                "paper 16k fixed@pallas remat=full": ("fixed:128:32@pallas", True)}
# The one-GPU preset's step (configs/bytes.py:size=gpu as train_step times it: 8 layers, B=16 at
# 4,096 bytes, no remat, no dropout), measured on the H200 on 2026-11-28 with the chained
# kernel (then the default at 4,096, as now): 41.61 ms, 24.9% MFU. Its attention runs once a
# layer at B=16, compiled as such (compile_report.py --programs=preset).
PRESET_BASE = {"case": "preset strided@pallas:chained", "report": "h200_2026-11-28",
               "ms": 41.61, "kernel": "strided:64@pallas:chained", "n": 4096, "layers": 8,
               "device": "NVIDIA H200", "mfu": 0.2491,
               "static": "docs/benchmarks/compiled_h100/preset/results.json"}
# The preset steps predicted (train_step's case names; a case runs "strided:64@pallas" with the
# options after its "@pallas", the measured default at 4,096 where it names no variant)
PRESET_CASES = ("preset strided@pallas", "preset strided@pallas:terms",
                "preset strided@pallas:onepass:s1", "preset strided@pallas:onepass:s1:atomic")


def _row(entry: dict, where: str) -> dict:
    """One row of a file, its aliases resolved and its fields checked (ValueError naming it)."""
    stage = entry.get("stage") or ("attention" if "pattern" in entry else
                                   "train_step" if "case" in entry else None)
    row = entry.get("row", entry.get("pattern", entry.get("case")))
    n = entry.get("n", entry.get("seq_len"))
    ms = entry.get("ms", entry.get("predicted_ms"))
    if stage not in STAGES or not isinstance(row, str) or not row:
        raise ValueError(f"{where}: a row needs a stage ({' or '.join(STAGES)}) and its row "
                         f"name (row, pattern or case); got {entry}")
    if stage == "attention" and not (isinstance(n, int) and n > 0):
        raise ValueError(f"{where}: attention row {row!r} needs its length n (a positive int)")
    if not (isinstance(ms, (int, float)) and ms > 0):
        raise ValueError(f"{where}: row {row!r} needs a positive ms, got {ms!r}")
    device = entry.get("device")
    if device is not None and not isinstance(device, str):
        raise ValueError(f"{where}: row {row!r}: device must be a device kind, got {device!r}")
    return {"stage": stage, "row": row, "n": n if stage == "attention" else None,
            "device": device, "ms": float(ms), "how": entry.get("how", "")}


def _file_rows(path: str, rel: str, seen: dict) -> list[dict]:
    """A file's rows, checked (a ValueError of one line naming it and the row)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{rel}: not a predictions file ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{rel}: a predictions file is an object with a list of rows")
    rows, keys = [], {}
    for i, entry in enumerate(data["rows"]):
        if not isinstance(entry, dict):
            raise ValueError(f"{rel}: row {i} is not an object")
        row = _row({"device": data.get("device"), **entry}, f"{rel} row {i}")
        key = (row["stage"], row["row"], row["n"], row["device"])
        if key in seen or key in keys:
            raise ValueError(f"{rel} row {i}: {row['row']} (n={row['n']}, "
                             f"{row['device'] or 'any device'}) is predicted in "
                             f"{seen.get(key, rel)} too; keep one")
        keys[key] = rel
        rows.append({**row, "source": rel})
    seen.update(keys)
    return rows


def load(root: str = cost_model.REPO, pattern: str = PATTERN, strict: bool = True) -> dict:
    """Every predictions file under `root` matching `pattern`, checked: {"rows": [each with
    its "source"], "sources": [paths], "errors": [one line per file left out]}. A file that is
    not JSON, a row without its key or time, or a row predicted twice: a ValueError of one line
    (`strict`), else that file is left out and its line kept in "errors" (the report: one bad
    file costs its own rows, not every prediction)."""
    rows, sources, errors, seen = [], [], [], {}
    for path in sorted(glob.glob(os.path.join(root, pattern))):
        rel = os.path.relpath(path, root)
        try:
            rows += _file_rows(path, rel, seen)
        except ValueError as e:
            if strict:
                raise
            errors.append(str(e))
            continue
        sources.append(rel)
    return {"rows": rows, "sources": sources, "errors": errors}


def lookup(predictions: dict | None, stage: str, row: str, n: int | None,
           device_kind: str | None) -> dict | None:
    """The prediction of a report row on `device_kind`: the row for its device, else the row
    for any device; None if there is none."""
    found = [p for p in (predictions or {}).get("rows", ())
             if (p["stage"], p["row"]) == (stage, row) and p["n"] == (
                 n if stage == "attention" else None)]
    for p in found:
        if p["device"] and device_kind and device_kind.startswith(p["device"]):
            return p
    return next((p for p in found if not p["device"]), None)


def judge(measured_ms: float, predicted_ms: float) -> tuple[float, bool]:
    """(measured / predicted, whether that is more than `OFF` from 1)."""
    ratio = measured_ms / predicted_ms
    return ratio, abs(ratio - 1) > OFF


def cells(predictions, stage, row, n, device_kind, measured_ms) -> tuple[str, str]:
    """The report's two cells: "predicted ms" and "measured / predicted" (✗: off by > 25%)."""
    p = lookup(predictions, stage, row, n, device_kind)
    if p is None:
        return "—", "—"
    if measured_ms is None:
        return f"{p['ms']:.3g}", "—"
    ratio, off = judge(measured_ms, p["ms"])
    return f"{p['ms']:.3g}", f"{ratio:.2f}" + (" ✗" if off else "")


def verdict(predictions, measured: list[tuple[str, str, int | None, float]],
            device_kind: str | None) -> list[str]:
    """A line on how the predictions held: how many measured rows had one, how many within
    25%, and each that was not; `measured`: (stage, row, n, ms) of every measured row."""
    judged = []
    for stage, row, n, ms in measured:
        p = lookup(predictions, stage, row, n, device_kind)
        if p is not None:
            judged.append((stage, row, n, ms, p["ms"], *judge(ms, p["ms"])))
    if not judged:
        return []
    off = [j for j in judged if j[6]]
    line = (f"Predictions ({', '.join(predictions['sources'])}): {len(judged) - len(off)} of "
            f"{len(judged)} predicted rows within {OFF:.0%} of the measurement")
    if off:
        line += "; off by more: " + "; ".join(
            f"{row}{f' at {n}' if n else ''} measured {ms:.3g} ms, predicted {p:.3g} "
            f"({ratio:.2f})" for _, row, n, ms, p, ratio, _ in off)
        line += " (say why in the report's note, and refit: docs/cost_model.md)"
    return [line + ".", ""]


def report_source(item: str, flag: str = "--measured") -> tuple[str, str]:
    """``LABEL=PATH`` (a report folder, or its results.json) as a ``cost_model.MEASURED``
    entry; a ValueError naming `flag` for anything else."""
    label, sep, path = item.partition("=")
    if not sep or not label or not path:
        raise ValueError(f"{flag}: {item!r} is not LABEL=PATH (e.g. h100_2026-12-01=reports/"
                         "h100, a report folder or its results.json)")
    path = os.path.abspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "results.json")
    try:
        with open(path) as f:
            data = json.load(f)
        data["stages"]["env"]["device_kind"]
        data["stages"]["attention"]["rows"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{flag}: {path} is not an accelerator report's results.json with an "
                         f"attention stage ({type(e).__name__}: {e})") from None
    return label, path


# The compile reports the predictions read, and what a row there that names no variant ran:
# "terms" (compiled before the measured defaults, 2026-11-28: cost_model.STATIC) or "measured"
# (the measured default at its length, attention.measured: chained up to 16,384).
STATIC = (*((path, "terms") for path in cost_model.STATIC),
          ("docs/benchmarks/compiled_h100/summary_tiles/results.json", "measured"),
          ("docs/benchmarks/compiled_h100/defaults/results.json", "measured"))


def static_index(root: str = cost_model.REPO, paths=STATIC, prefix: str = "attention ") -> dict:
    """{(pattern as it ran, n): compiled row} of the compile reports `paths` ((path, what an
    unnamed row ran) pairs; rows named with `prefix`, as ``cost_model.static_rows``): each
    Pallas row named with its variant (``BlockSizes``'s: "terms", "chained", ...) made
    explicit, so that a row compiled before the measured defaults and one after are told
    apart. The first report to hold a program wins."""
    out = {}
    for path, convention in paths:
        if not os.path.exists(os.path.join(root, path)):
            continue
        for (pattern, n), row in cost_model.static_rows(root, (path,), prefix).items():
            if "@pallas" in pattern:
                head, opts = _variant_options(pattern, n if convention == "measured" else None)
                pattern = f"{head}@pallas:" + ":".join(sorted(opts))
            out.setdefault((pattern, n), row)
    return out


def _variant_options(pattern: str, n: int | None) -> tuple[str, frozenset]:
    """(pattern head, option set) of a Pallas row, its variant made explicit: the options it
    names, or, where it names no variant, the one it runs at `n` (the measured default,
    ``attention.measured``; `n` None: "terms", the default when the compile reports were
    made)."""
    from sparse_jax.attention import measured
    from sparse_jax.attention.blocks import VARIANTS

    head, _, options = pattern.partition("@pallas")
    opts = {o for o in options.split(":") if o}
    if not opts & set(VARIANTS):
        kind = head.split(":")[0]
        chosen = next((c.options for c in measured.CHOICES
                       if n is not None and c.pattern == kind and n <= c.up_to), "terms")
        opts |= set(chosen.split(":"))
    return head, frozenset(opts)


def static_for(pattern: str, n: int, static: dict) -> tuple[str, dict] | None:
    """The compiled program a report row runs, from ``static_index``'s: (the pattern whose
    options the cost model reads, its compiled row), or None. A report row without a variant
    runs the measured default at its length (chained up to 16,384)."""
    if "@pallas" not in pattern:
        return (pattern, static[(pattern, n)]) if (pattern, n) in static else None
    head, opts = _variant_options(pattern, n)
    name = f"{head}@pallas:" + ":".join(sorted(opts))
    return (name, static[(name, n)]) if (name, n) in static else None


def attention_rows(params: dict, patterns, static: dict,
                   devices=DEVICES) -> tuple[list[dict], list[tuple[str, int]]]:
    """The model's forward + backward time of every Pallas (pattern, n) in `patterns` whose
    program `static` (``cost_model.static_rows``) holds (``static_for``), per device; and the
    pairs it lacks."""
    rows, missing = [], []
    for pattern, n in dict.fromkeys(patterns):
        if "@pallas" not in pattern or pattern.endswith(":fwd"):
            continue
        found = static_for(pattern, n, static)
        if found is None:
            missing.append((pattern, n))
            continue
        name, row = found
        f = cost_model.features(row, name)
        how = "cost model on the compiled program's static figures" + (
            f" ({name}: what the row runs at this length)" if name != pattern else "")
        for device in devices:
            rows.append({"stage": "attention", "row": pattern, "n": n, "device": device,
                         "ms": round(cost_model.predict(params, f, device), 4), "how": how})
    return rows, missing


def forward_ms(params: dict, static_row: dict, pattern: str, device: str) -> tuple[float, float]:
    """(forward + backward ms, forward ms) of a compiled row by the model; the forward's share
    of the XLA kernels around the Triton ones is taken as its share of the Triton kernels'."""
    parts = cost_model.parts(params, cost_model.features(static_row, pattern), device)
    kernels = parts["kernels"]
    share = sum(t for name, t in kernels.items() if "_forward_" in name) / sum(kernels.values())
    return parts["total"] * 1e3, parts["total"] * 1e3 * share


def step_ms(fwdbwd_ms: float, fwd_ms: float, base_fwdbwd_ms: float, base_fwd_ms: float,
            base: dict = STEP_BASE, recompute: bool = True) -> float:
    """The paper's 16k step (``STEP_BASE``, measured) with its attention's time changed: every
    layer and sequence runs the kernel's forward + backward, and its forward once more where
    remat recomputes the block (``recompute``; remat "full" does: the compiled step launches
    each forward kernel twice); the rest of the step as measured. The times are the attention
    rows' (B=1 H=8): a sequence each."""
    calls = base["layers"] * base["batch"]
    new = fwdbwd_ms + (fwd_ms if recompute else 0.0)
    old = base_fwdbwd_ms + base_fwd_ms
    return base["ms"] + calls * (new - old)


def preset_rows(params: dict, root: str = cost_model.REPO, cases=None,
                base: dict = PRESET_BASE) -> list[dict]:
    """The preset's steps (``PRESET_CASES``; `cases`: only those of these names) from the
    measured one (``PRESET_BASE``): each layer's attention (forward + backward once: no remat)
    moved by the modelled difference of its kernel's and the measured kernel's, the rest of
    the step as measured (the model's changes since, which move bytes outside attention, not
    counted: ``docs/cost_model.md``)."""
    n = base["n"]
    static = static_index(root, ((base["static"], "measured"),), "preset attention ")
    found = static_for(base["kernel"], n, static)
    if found is None:
        return []
    old = cost_model.predict(params, cost_model.features(found[1], found[0]), base["device"])
    rows = []
    for case in PRESET_CASES:
        kernel = "strided:64@pallas" + case.partition("@pallas")[2]
        found = static_for(kernel, n, static)
        if found is None or (cases is not None and case not in cases):
            continue
        new = cost_model.predict(params, cost_model.features(found[1], found[0]),
                                 base["device"])
        ms = base["ms"] + base["layers"] * (new - old)
        rows.append({"stage": "train_step", "row": case, "device": base["device"],
                     "ms": round(ms, 2), "mfu": round(base["mfu"] * base["ms"] / ms, 4),
                     "how": f"the measured preset step ({base['report']}, {base['ms']} ms with "
                            f"{base['kernel']}) with {found[0]}'s modelled forward + backward at "
                            f"B=16 in place of that kernel's, in each of {base['layers']} layers"})
    return rows


# The report's paper steps whose code this model does not change: predicted at what the H200
# measured (2026-11-28; remat "attention" is "full" on their attention), a check of the machine.
STEPS_AS_MEASURED = {"paper 16k dense (cuDNN)": 246.54, "paper 16k fixed@xla": 1530.29}


def step_cases(patterns) -> dict[str, tuple[str, bool]]:
    """The report's paper steps to predict, by case name, with the attention row each runs and
    whether its forward is recomputed: ``STEP_KERNELS``, and for another fixed:128:32 Pallas
    kernel at 16k "paper 16k fixed@pallas:OPTIONS" (the name a train_step case of it takes,
    with the paper steps' remat "attention")."""
    out = dict(STEP_KERNELS)
    for pattern, n in patterns:
        head, _, options = pattern.partition("@pallas")
        name = f"paper 16k fixed@pallas{options}"
        if head == "fixed:128:32" and n == STEP_BASE["n"] and name not in out:
            out[name] = (pattern, False)
    return out


def table(params: dict, patterns, root: str = cost_model.REPO, static_paths=STATIC,
          cases=None) -> dict:
    """The predictions file's content for `patterns` ((pattern, n) pairs: the report's Pallas
    attention plan by default in scripts/cost_model.py) and the paper steps they run
    (``step_cases``; `cases`: only those of these names, e.g. the report's train_step plan)."""
    patterns = list(patterns)
    static = static_index(root, static_paths)
    rows, missing = attention_rows(params, patterns, static)
    device, n = STEP_BASE["device"], STEP_BASE["n"]
    base = forward_ms(params, *reversed(static_for(STEP_BASE["kernel"], n, static)), device)
    for case, (kernel, recompute) in step_cases(patterns).items():
        found = static_for(kernel, n, static)
        if found is None or (cases is not None and case not in cases):
            continue
        new = forward_ms(params, *reversed(found), device)
        rows.append({"stage": "train_step", "row": case, "device": device,
                     "ms": round(step_ms(*new, *base, recompute=recompute), 2),
                     "how": f"the measured step ({STEP_BASE['report']}, {STEP_BASE['ms']} ms "
                            f"with {STEP_BASE['kernel']}, remat full) with {kernel}'s modelled "
                            "forward + backward in its place, and its forward once more"
                            + ("" if recompute else " no longer (remat attention keeps its "
                               "residuals; the q, k, v projections no longer recomputed are "
                               "not counted)")})
    rows += preset_rows(params, root, cases)
    for case, ms in STEPS_AS_MEASURED.items():  # with the report's plan only (`cases`)
        if cases is not None and case in cases:
            rows.append({"stage": "train_step", "row": case, "device": device, "ms": ms,
                         "how": f"as measured ({STEP_BASE['report']}): its attention and remat "
                                "unchanged"})
    return {"basis": "the cost model fitted on the measured rows (docs/benchmarks/cost_model/"
                     "results.json) over the compile reports' static figures", "rows": rows,
            "no_static_figures": [f"{p} at {n}" for p, n in missing]}
