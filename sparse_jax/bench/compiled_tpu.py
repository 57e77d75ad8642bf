r"""The attention kernels compiled for a TPU (v5e, v5p, v6e) on a CPU host, with no TPU present:
the Mosaic kernels as the chip's compiler builds them, and what it decided for each.

  pip install --no-deps --target .tpu_tools -r requirements-tpu-compile.txt
  python scripts/compile_report.py --target=v5e --programs=ci --check

How: libtpu (at the version jax's ``tpu`` extra pins) installed into a folder of its own
(``--tools``) and put on the path of a child process only, so the project's environment stays a
CPU one; jax finds it by importing the ``libtpu`` package, and the child also names its
``libtpu.so`` in ``TPU_LIBRARY_PATH``. ``jax.experimental.topologies.get_topology_desc`` builds
the chip from its name ("v5e:1x1"), and ``jax.jit(f).lower(...).compile()`` performs a
deviceless compile, every program in its own process (``pallas_kernels.compiling_for("tpu")``
makes the kernels Mosaic's, compiled, not interpret mode; "auto" picks them). As in
``sparse_jax.bench.compiled`` (the GPU's; its programs' builder is reused), from each compile:

  compile seconds   lowering and compiling, in the child
  memory            ``compiled.memory_analysis()``: XLA's planned arguments, outputs, temporaries
  VMEM per kernel   the compiled HLO's ``tpu_custom_call``s: each one's
                    ``used_scoped_memory_configs`` (memory space 1, VMEM): its scratch and, for
                    operands XLA leaves in HBM, the pipeline's double-buffered blocks; operands
                    small enough to sit in VMEM whole (``S(1)`` in their layout) need no window,
                    so small programs show the scratch alone
  flops             ``compiled.cost_analysis()`` (what XLA counts of the whole program)

No profiler runs and no time is measured: these are the compiler's figures, not measurements on
a TPU. A kernel that Mosaic refuses (tiles it cannot lay out, VMEM it does not have) fails the
compile and is reported with the compiler's line.

  programs()             the programs compiled, by name and group ("ci": the suite's check)
  parse_mosaic_kernels   each Mosaic kernel of compiled HLO text: name, calls, VMEM
  compile_program(...)   one program compiled in a child process: its row
  markdown, problems     the report's table; what fails the check
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from sparse_jax.bench import compiled

TOOLS_ENV = "SPARSE_JAX_TPU_TOOLS"  # where libtpu is installed
DEFAULT_TOOLS = ".tpu_tools"
REQUIREMENTS = "requirements-tpu-compile.txt"


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU chip as ``topologies.get_topology_desc`` names it, and its HBM."""
    name: str
    topology: str
    hbm_gib: float


TARGETS = {
    "v5e": Target("TPU v5e (one chip)", "v5e:1x1", 16.0),
    "v5p": Target("TPU v5p (one chip)", "v5p:1x1x1", 95.0),
    "v6e": Target("TPU v6e (one chip)", "v6e:1x1", 32.0),
}

# fwd+bwd in bfloat16, head dim 128 (a TPU's lanes). The suite's check: the default strided
# and fixed kernels at a length whose arrays stay in HBM, so the kernels pipeline their blocks
# as they would at 16k, and the compile stays short (about 10 s each on 2 cores).
ATTENTION_SHAPE = {"batch": 1, "heads": 8, "head_dim": 128}
CI_LENGTH = 8192
PATTERNS = ("strided:128@pallas", "fixed:128:32@pallas")


def _attention(pattern: str, n: int, group: str) -> dict:
    return {"name": f"attention {n // 1024}k {pattern}", "group": group, "kind": "attention",
            "pattern": pattern, "seq_len": n, **ATTENTION_SHAPE}


def programs() -> list[dict]:
    """The suite's check ("ci", the default kernels at ``CI_LENGTH``), then the same at 16k and
    64k (groups "attention16k", "attention64k")."""
    return [_attention(p, n, group) for n, group in
            ((CI_LENGTH, "ci"), (16384, "attention16k"), (65536, "attention64k"))
            for p in PATTERNS]


def select(names: list[str] | None) -> list[dict]:
    """The programs named, or of the groups named ("ci", "attention16k", "attention64k",
    "all"); ValueError naming an unknown one."""
    every = programs()
    if not names or names == ["all"]:
        return every
    chosen = []
    for name in names:
        matches = [p for p in every if name in (p["group"], p["name"])]
        if not matches:
            raise ValueError(f"--programs: {name!r} is no program or group; give all, ci, "
                             f"attention16k, attention64k or a name (--list prints them)")
        chosen += [p for p in matches if p not in chosen]
    return chosen


# ---------------------------------------------------------------------------------------------
# The child: one deviceless compile.


def _child(program: dict, target: str) -> None:
    """Compiles ``program`` for ``target`` with no device and prints one ``RESULT {json}``
    line. ``program["unchecked_tiles"]``: skip the project's own tile rule
    (``BlockSizes.check_backend``), so that Mosaic itself judges the tiles (tests)."""
    import jax
    from jax._src import cloud_tpu_init
    from jax.experimental import topologies

    from sparse_jax import kernel, pallas_kernels

    if program.get("unchecked_tiles"):
        check = kernel.BlockSizes.check_backend
        kernel.BlockSizes.check_backend = (
            lambda self, backend, tiles=True: check(self, backend, tiles=False))
    library = cloud_tpu_init.get_tpu_library_path()
    t = TARGETS[target]
    topology = topologies.get_topology_desc(t.topology, platform="tpu",
                                            chips_per_host_bounds=(1, 1, 1))
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    result = {"libtpu": library}
    with pallas_kernels.compiling_for("tpu"):
        fn, args, _ = compiled.build_program(program, mesh)  # the GPU's tile work does not apply
        start = time.perf_counter()
        lowered = jax.jit(fn).lower(*args)
        executable = lowered.compile()
        result["compile_s"] = time.perf_counter() - start
    memory = executable.memory_analysis()
    result["memory"] = {key: getattr(memory, f"{key}_size_in_bytes")
                        for key in ("argument", "output", "alias", "temp")}
    cost = executable.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    result["flops"] = float((cost or {}).get("flops", 0.0))
    result["kernels"] = parse_mosaic_kernels(executable.as_text())
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# What the compiler wrote.

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) custom-call\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SCOPED = re.compile(r'"used_scoped_memory_configs":\[(.*?)\]')
_SCOPED_ENTRY = re.compile(r'"memory_space":"(\d+)","offset":"\d+","size":"(\d+)"')
VMEM = "1"  # Mosaic's memory space number of VMEM


def _kernel_name(op_name: str, instruction: str) -> str:
    """The pallas_call's name: innermost of its op_name's transforms
    ("jit(loss)/transpose(jvp(sparse_dq_rows))/pallas_call" gives "sparse_dq_rows")."""
    path = op_name.removesuffix("/pallas_call").split("/")[-1]
    m = re.search(r"([\w.\-]+)\)*$", path)
    return m.group(1) if m and op_name.endswith("/pallas_call") else instruction


def parse_mosaic_kernels(hlo: str) -> list[dict]:
    """Each Mosaic kernel (``tpu_custom_call``) of compiled HLO text, in order of first
    appearance: name, VMEM bytes (its used scoped memory in VMEM), whether an output of it
    sits in VMEM whole (``S(1)`` in its shape: no pipeline window for it), and calls (the same
    kernel with the same VMEM in several computations, as a model's layers, is listed once)."""
    out, seen = [], {}
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        instruction, shape = m.groups()
        op = _OP_NAME.search(line)
        name = _kernel_name(op.group(1) if op else "", instruction)
        scoped = _SCOPED.search(line)
        vmem = sum(int(size) for space, size in _SCOPED_ENTRY.findall(scoped.group(1))
                   if space == VMEM) if scoped else 0
        key = (name, vmem)
        if key in seen:
            seen[key]["calls"] += 1
            continue
        seen[key] = {"name": name, "vmem_bytes": vmem, "output_in_vmem": "S(1)" in shape,
                     "calls": 1}
        out.append(seen[key])
    return out


# ---------------------------------------------------------------------------------------------
# The parent: a child per program.


def tools_env(tools: str) -> dict:
    """``compiled.child_env`` with the folder's libtpu named in TPU_LIBRARY_PATH and several
    libtpu processes allowed at once (no chip to guard: pytest's workers compile side by
    side)."""
    env = compiled.child_env(tools)
    env["TPU_LIBRARY_PATH"] = os.path.join(os.path.abspath(tools), "libtpu", "libtpu.so")
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return env


def check_tools(tools: str) -> None:
    """ValueError (one line) if ``tools`` lacks libtpu."""
    if not (os.path.isfile(os.path.join(tools, "libtpu", "libtpu.so"))
            and os.path.isfile(os.path.join(tools, "libtpu", "__init__.py"))):
        raise ValueError(f"--tools={tools} lacks libtpu: install it with `pip install --no-deps "
                         f"--target {tools} -r {REQUIREMENTS}`")


versions = compiled.versions
install_tools = compiled.install_tools


def compile_program(program: dict, target: str, tools: str, timeout: float = 600) -> dict:
    """``program`` compiled for ``target`` in a child process: its row (compile seconds, planned
    memory against the chip's HBM, per Mosaic kernel its VMEM, XLA's flops), or with "error" the
    compiler's line."""
    t = TARGETS[target]
    row = {"name": program["name"], "group": program["group"], "target": target}
    env = tools_env(tools)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sparse_jax_tpu_") as scratch:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "sparse_jax.bench.compiled_tpu", json.dumps(program),
                 target], env=env, cwd=scratch, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            row["error"] = f"not compiled in {timeout:.0f} s"
            return row
    row["wall_s"] = time.perf_counter() - start
    results = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not results:
        row["error"] = compiled.last_error(proc.stderr) or f"exit status {proc.returncode}"
        return row
    row.update(json.loads(results[-1]))
    if os.path.realpath(row["libtpu"]) != os.path.realpath(env["TPU_LIBRARY_PATH"]):
        row["error"] = f"libtpu loaded from {row['libtpu']}, not --tools={tools}"
        return row
    memory = row["memory"]
    row["planned_gib"] = (memory["argument"] + memory["output"] - memory["alias"]
                          + memory["temp"]) / 2**30
    row["fits"] = row["planned_gib"] <= t.hbm_gib
    row["max_vmem_bytes"] = max((k["vmem_bytes"] for k in row["kernels"]), default=0)
    return row


def progress(row: dict) -> str:
    """The console line of a compiled program."""
    if "error" in row:
        return row["error"]
    return (f"{row['compile_s']:.1f} s, {row['planned_gib']:.3f} GiB planned, "
            f"{len(row['kernels'])} Mosaic kernels, max VMEM "
            f"{row['max_vmem_bytes'] / 1024:.0f} KiB")


def markdown(rows: list[dict], target: str, header: list[str]) -> str:
    """One row per program, then one per Mosaic kernel."""
    t = TARGETS[target]
    f = lambda v, spec=".3g": "—" if v is None else format(v, spec)  # noqa: E731
    lines = [*header, "", f"Target: {t.name}, topology {t.topology}, {t.hbm_gib:g} GiB HBM.", "",
             "| program | compile s | planned GiB | fits | Mosaic kernels | max VMEM KiB | "
             "XLA flops | result |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kernels = r.get("kernels")
        lines.append(
            f"| {r['name']} | {f(r.get('compile_s'), '.1f')} | {f(r.get('planned_gib'), '.3f')} "
            f"| {'—' if 'fits' not in r else ('yes' if r['fits'] else '**no**')} "
            f"| {'—' if kernels is None else len(kernels)} "
            f"| {f(r['max_vmem_bytes'] / 1024 if 'max_vmem_bytes' in r else None, '.0f')} "
            f"| {f(r.get('flops'), '.3g')} | {r.get('error', 'ok')} |")
    lines += ["", "Per Mosaic kernel (VMEM: its scoped allocation, scratch and pipeline windows; "
              "output in VMEM: XLA keeps one there whole, with no window):", "",
              "| program | kernel | calls | VMEM KiB | output in VMEM |", "|---|---|---|---|---|"]
    for r in rows:
        for k in r.get("kernels", []):
            lines.append(f"| {r['name']} | {k['name']} | {k['calls']} | "
                         f"{k['vmem_bytes'] / 1024:.0f} | {'yes' if k['output_in_vmem'] else 'no'}"
                         " |")
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


if __name__ == "__main__":  # the child: python -m sparse_jax.bench.compiled_tpu PROGRAM TARGET
    _child(json.loads(sys.argv[1]), sys.argv[2])
