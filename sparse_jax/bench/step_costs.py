r"""Where a compiled training step's work goes, read from its optimized HLO: every kernel XLA
launches (the entry computation's and, times their trip counts, its loops': the scanned layers'
forward and backward), grouped by what it does, with its bytes (operands and outputs: an upper
bound for a fusion that reads a slice) and its matrix products' FLOPs, and a floor time for each
group on a GPU (bytes at the HBM bandwidth, FLOPs at the bf16 peak, whichever is longer per
kernel). The step is compiled for an H100 on this CPU with no GPU, as ``compiled`` does.

  python -m sparse_jax.bench.step_costs --remat=full,dots,none     # the paper's 16k step
  python -m sparse_jax.bench.step_costs --case=preset --remat=none --pattern=strided \
      --kernel=chained                         # the one-GPU preset's step (B=16 at 4,096)

Groups: ``matmul`` (cuBLAS calls and XLA's own GEMM fusions), ``attention`` (Pallas/Triton
custom calls, cuDNN's fused attention), ``reduce`` (fusions with a reduction: the layer norms'
statistics, the loss's softmax, the gradients' sums), ``cast`` (fusions that only convert
dtypes), ``elementwise`` (every other fusion: residual adds, GeLU, dropout, the norms' scaling,
the optimizer's update), ``copy`` (copies and transposes), ``other``. The entry computation's
kernels (embedding, head, loss, gradient clipping and AdamW) are reported apart from the loops'
(the layers) as ``outside_layers``.

These are the compiler's figures, not a measurement: the floors say what the bytes and FLOPs
cost at full speed, the report's kernel profile what they take.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile

from sparse_jax.bench.compiled_output import _HLO_LINE, _NOT_KERNELS, _shape_bytes

HBM_GBPS = {"h100": 3352.0}
PEAK_TFLOPS = 989.0
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_ARRAY = re.compile(r"\b(?:pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([\d,]*)\]")
GROUPS = ("matmul", "attention", "reduce", "cast", "elementwise", "copy", "other")


def _dims(shape: str) -> list[int]:
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(1).split(",") if d] if found else []


def computations(hlo: str) -> tuple[dict, str]:
    """{name: [(name, shape, op, rest)]} of every computation, and the entry's name."""
    out, entry, current = {}, None, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("{")[0].split("(")[0]:
            current = header.group(2)
            out[current] = []
            if header.group(1):
                entry = current
            continue
        m = _HLO_LINE.match(line)
        if m and current is not None:
            out[current].append(m.groups())
    return out, entry


def _dot_flops(out_shape: str, lhs_shape: str, contracting: list[int]) -> float:
    lhs = _dims(lhs_shape)
    return 2.0 * math.prod(_dims(out_shape)) * math.prod(lhs[i] for i in contracting if i < len(
        lhs))


def _operands(rest: str) -> list[str]:
    return re.findall(r"%([\w.\-]+)", rest.split("), ")[0])


def _fusion_kind(body: list, comps: dict) -> tuple[str, float]:
    """(group, FLOPs) of a fused computation."""
    shapes = {name: shape for name, shape, _, _ in body}
    ops = {op for _, _, op, _ in body}
    flops = 0.0
    for _, shape, op, rest in body:
        if op == "dot":
            found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
            lhs = _operands(rest)[0]
            flops += _dot_flops(shape, shapes.get(lhs, ""), [int(d) for d in (
                found.group(1).split(",") if found and found.group(1) else [])])
        elif op == "fusion":  # a nested fusion (Triton GEMM's)
            called = re.search(r"calls=%([\w.\-]+)", rest)
            if called and called.group(1) in comps:
                kind, inner = _fusion_kind(comps[called.group(1)], comps)
                flops += inner
                ops.add("dot" if kind == "matmul" else "")
    if "dot" in ops or flops:
        return "matmul", flops
    if ops & {"reduce", "reduce-window", "scatter", "sort"}:
        return "reduce", 0.0
    if ops <= {"parameter", "convert", "bitcast", "copy", "constant", "broadcast", "tuple",
               "get-tuple-element"} and "convert" in ops:
        return "cast", 0.0
    if ops <= {"parameter", "bitcast", "copy", "transpose", "constant", "tuple",
               "get-tuple-element"}:
        return "copy", 0.0
    return "elementwise", 0.0


def _fusion_bytes(body: list, shape: str, operands: list[str], shapes: dict) -> float:
    """The bytes a fusion moves: each operand whole, except one the fusion only slices
    (``dynamic-slice``: a layer's row of the scan's stacked parameters or saved activations),
    counted as its slices; the output whole, except an in-place ``dynamic-update-slice`` into
    an operand (the scan writing one layer's row), counted as the update."""
    params = {}
    for name, _, op, rest in body:
        if op == "parameter":
            params[name] = int(re.match(r"(\d+)", rest).group(1))
    users: dict[str, list] = {name: [] for name in params}
    for _, out_shape, op, rest in body:
        for used in _operands(rest) if op != "parameter" else ():
            if used in users:
                users[used].append((op, out_shape, _operands(rest)))
    total = 0.0
    for name, index in params.items():
        whole = shapes.get(operands[index], 0) if index < len(operands) else 0
        uses = users[name]
        if uses and all(op == "dynamic-slice" for op, _, _ in uses):
            total += sum(_shape_bytes(out) for _, out, _ in uses)
        elif uses and all(op == "dynamic-update-slice" and args[0] == name
                          for op, _, args in uses):
            continue  # written in place: its update counts, below
        else:
            total += whole
    root = body[-1] if body else None
    by_name = {name: out for name, out, _, _ in body}
    if root is not None and root[2] == "dynamic-update-slice":
        total += _shape_bytes(by_name.get(_operands(root[3])[1], ""))
    else:
        total += _shape_bytes(shape)
    return total


def _kernel(inst, shapes: dict, comps: dict, texts: dict) -> tuple[str, float, float]:
    """(group, bytes, FLOPs) of one launched instruction (`shapes`: every instruction's bytes,
    `texts`: its shape as written)."""
    name, shape, op, rest = inst
    nbytes = _shape_bytes(shape) + sum(shapes.get(a, 0) for a in _operands(rest))
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', rest)
        target = target.group(1) if target else ""
        if "cublas" in target:
            found = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
            dims = [int(d.strip('"')) for d in found.group(1).split(",") if d] if found else []
            lhs = _operands(rest)[0]
            return "matmul", nbytes, _dot_flops(shape, texts.get(lhs, ""), dims)
        if "triton" in target or "cudnn" in target or "fmha" in target or "mosaic" in target:
            return "attention", nbytes, 0.0
        return "other", nbytes, 0.0
    if op == "fusion":
        called = re.search(r"calls=%([\w.\-]+)", rest)
        if called and called.group(1) in comps:
            body = comps[called.group(1)]
            kind, flops = _fusion_kind(body, comps)
            return kind, _fusion_bytes(body, shape, _operands(rest), shapes), flops
        return "elementwise", nbytes, 0.0
    if op in ("copy", "transpose", "copy-start", "dynamic-update-slice", "dynamic-slice",
              "slice", "concatenate", "pad"):
        return "copy", nbytes, 0.0
    if op == "convert":
        return "cast", nbytes, 0.0
    if op in ("reduce", "scatter", "sort"):
        return "reduce", nbytes, 0.0
    if op == "dot":
        found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
        dims = [int(d) for d in found.group(1).split(",") if d] if found else []
        return "matmul", nbytes, _dot_flops(shape, texts.get(_operands(rest)[0], ""), dims)
    return "other", nbytes, 0.0


def costs(hlo: str, hbm_gbps: float = HBM_GBPS["h100"]) -> dict:
    """The step's kernels by group, in the layers' loops and outside them: launches, GB, TFLOP
    and the floor milliseconds (per kernel max(bytes / HBM, FLOPs / peak))."""
    comps, entry = computations(hlo)
    shapes = {name: _shape_bytes(shape) for body in comps.values()
              for name, shape, _, _ in body}
    texts = {name: shape for body in comps.values() for name, shape, _, _ in body}
    out = {where: {g: {"launches": 0.0, "gb": 0.0, "tflop": 0.0, "floor_ms": 0.0}
                   for g in GROUPS} for where in ("layers", "outside_layers")}

    def walk(name: str, times: float, where: str) -> None:
        for inst in comps.get(name, ()):
            _, _, op, rest = inst
            if op == "while":
                body = re.search(r"body=%([\w.\-]+)", rest)
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                if body:
                    walk(body.group(1), times * (int(trips.group(1)) if trips else 1),
                         "layers")
                continue
            if op in ("call", "conditional"):
                for called in re.findall(r"(?:to_apply|calls|branch_computations)=\{?%"
                                         r"([\w.\-]+)", rest):
                    walk(called, times, where)
                continue
            if op in _NOT_KERNELS:
                continue
            group, nbytes, flops = _kernel(inst, shapes, comps, texts)
            entry_ = out[where][group]
            entry_["launches"] += times
            entry_["gb"] += times * nbytes / 1e9
            entry_["tflop"] += times * flops / 1e12
            entry_["floor_ms"] += times * max(nbytes / (hbm_gbps * 1e9),
                                              flops / (PEAK_TFLOPS * 1e12)) * 1e3

    walk(entry, 1.0, "outside_layers")
    return out


def compile_step(model: dict, batch_size: int, tools: str, target: str = "h100"
                 ) -> tuple[str, float]:
    """(the optimized HLO text, XLA's planned GB) of the training step
    (``bench.model.step_function``: loss, gradients, clipping, AdamW) of ``model`` at
    ``batch_size``, compiled for `target` with no GPU."""
    from sparse_jax.bench import compiled

    program = {"name": "step", "group": "steps", "kind": "step", "model": model,
               "batch_size": batch_size}
    with tempfile.TemporaryDirectory(prefix="sparse_jax_step_") as dump:
        env = compiled.tools_env(tools)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()
        proc = subprocess.run([sys.executable, "-m", "sparse_jax.bench.compiled",
                               json.dumps(program), target], env=env, cwd=compiled._repo(),
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(compiled.last_error(proc.stderr) or "the compile failed")
        names = [f for f in os.listdir(dump) if "train_step" in f
                 and f.endswith("after_optimizations.txt")]
        if not names:
            raise RuntimeError(f"no optimized HLO of the step in {sorted(os.listdir(dump))[:5]}")
        memory = json.loads([line[7:] for line in proc.stdout.splitlines()
                             if line.startswith("RESULT ")][-1])["memory"]
        planned = (memory["argument"] + memory["output"] - memory["alias"]
                   + memory["temp"]) / 1e9
        with open(os.path.join(dump, sorted(names, key=len)[0])) as f:
            return f.read(), planned


PAPER = dict(seq_len=16384, num_layers=30, d_model=512, num_heads=8, pattern="fixed",
             stride=128, c=32, remat="full", scan_layers=True, dtype="bfloat16",
             attention="pallas")
# configs/bytes.py:size=gpu as the report's train_step times it (no dropout), at batch 16
PRESET = dict(seq_len=4096, num_layers=8, d_model=512, num_heads=8, pattern="strided",
              stride=64, rotary=True, dtype="bfloat16", attention="pallas")
CASES = {"paper": (PAPER, 2), "preset": (PRESET, 16)}


def table(rows: dict[str, dict]) -> list[str]:
    """A markdown table: per variant and group, launches, GB, TFLOP, floor ms."""
    lines = ["| step | where | group | launches | GB | TFLOP | floor ms |",
             "|---|---|---|---|---|---|---|"]
    for label, result in rows.items():
        for where in ("layers", "outside_layers"):
            for group in GROUPS:
                g = result[where][group]
                if g["launches"]:
                    lines.append(f"| {label} | {where.replace('_', ' ')} | {group} | "
                                 f"{g['launches']:.0f} | {g['gb']:.3g} | {g['tflop']:.3g} | "
                                 f"{g['floor_ms']:.3g} |")
    return lines


def main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="paper", choices=sorted(CASES),
                        help="the paper's 16k step (batch 2) or the one-GPU preset's (batch 16)")
    parser.add_argument("--remat", default="full", help="remat policies, comma-separated")
    parser.add_argument("--attention", default="pallas")
    parser.add_argument("--pattern", default="fixed")
    parser.add_argument("--kernel", default="", help="Pallas kernel options (ModelConfig.kernel)")
    parser.add_argument("--tools", default=os.environ.get("SPARSE_JAX_GPU_TOOLS", ".gpu_tools"))
    parser.add_argument("--output_json", default=None)
    args = parser.parse_args(argv)
    from sparse_jax.bench import compiled
    from sparse_jax.model.config import ModelConfig

    base, batch = CASES[args.case]
    models = {}
    try:  # every model and the tools checked before the first compile
        for remat in args.remat.split(","):
            models[remat] = {**base, "remat": remat, "attention": args.attention,
                             "pattern": args.pattern, "kernel": args.kernel}
            ModelConfig(**models[remat])
        compiled.check_tools(args.tools)
    except ValueError as e:
        raise SystemExit(f"error: {' '.join(str(e).split())}") from None
    rows = {}
    for remat, model in models.items():
        hlo, planned = compile_step(model, batch, args.tools)
        label = f"{args.case} {args.pattern} remat={remat}" + (
            f" kernel={args.kernel}" if args.kernel else "")
        rows[label] = {**costs(hlo), "planned_gb": planned}
        print(f"{label}: XLA plans {planned:.3g} GB", flush=True)
        print("\n".join(table({label: rows[label]})), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"command": "python -m sparse_jax.bench.step_costs " + " ".join(argv),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
