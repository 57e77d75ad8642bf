r"""The GPU programs compiled for an H100 (or an A100) on a CPU host, exactly as XLA builds them
on the device, with no GPU present; per Triton kernel what the compiler decided.

  pip install --no-deps --target .gpu_tools -r requirements-gpu-compile.txt
  python scripts/compile_report.py --output_dir=docs/benchmarks/compiled_h100

How: jaxlib's CUDA plugin (``jax-cuda12-plugin``/``-pjrt``) and NVIDIA's ``ptxas``
(``nvidia-cuda-nvcc-cu12``) installed into a folder of their own (``--tools``), put on the path of
a child process only, so the project's own environment stays a CPU one;
``jax.experimental.topologies`` builds the device from XLA's target description
(``targets/*.txtpb``) and ``jax.jit(f).lower(...).compile()`` performs a deviceless compile,
every program in its own process (``tiles.compiling_for("gpu")`` makes the kernels
Triton's, not interpret mode). From each compile:

  ptxas -v        (XLA's own call, in its log) registers per thread and spilled bytes per kernel
  thunk sequence  (``--xla_dump_to``) each kernel's grid, threads and dynamic shared memory
  block lists     (``sparse_jax.attention.blocks``) the key tiles each program visits
  memory          ``compiled.memory_analysis()``: XLA's planned arguments, outputs, temporaries

and from those: blocks per SM and what bounds them (registers, shared memory, threads), the
occupancy (resident warps of the SM's 64), waves of programs over the SMs, and an estimate of
the HBM bytes each kernel moves (its tiles' loads and stores, no L2 reuse) plus those of XLA's
own kernels around it (each fusion's operands and outputs), against the least a pass must move.
GEMM autotuning does not run without a device (XLA's default tiles), and no time is measured:
these are the compiler's figures, not measurements.

  programs(target)       the programs the accelerator report times, by name and group
  compile_program(...)   one program compiled in a child process: its figures as a dict
  occupancy(...)         blocks per SM, occupancy and the bounding resource of one kernel
  report(...)            every chosen program: rows, kernel tables, markdown

The targets (``Target``, ``TARGETS``) and the reading of the compiler's output (``parse_ptxas``,
``parse_thunks``, ``xla_kernel_bytes``, ``occupancy``) live in ``compiled_output``, the report's
tables (``rank``, ``markdown``, ``problems``) in ``compiled_tables``; both are re-exported here.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from sparse_jax.bench import compiled_work
from sparse_jax.bench.compiled_output import (  # noqa: F401  re-exported
    TARGETS,
    TARGETS_DIR,
    Target,
    occupancy,
    parse_ptxas,
    parse_thunks,
    xla_kernel_bytes,
)
from sparse_jax.bench.compiled_tables import markdown, problems, rank  # noqa: F401

TOOLS_ENV = "SPARSE_JAX_GPU_TOOLS"  # where the CUDA plugin and ptxas are installed
DEFAULT_TOOLS = ".gpu_tools"
REQUIREMENTS = "requirements-gpu-compile.txt"


# ---------------------------------------------------------------------------------------------
# The programs: what the accelerator report times (sparse_jax.bench.accelerator).

ATTENTION_SHAPE = {"batch": 1, "heads": 8, "head_dim": 64}
# Variants compiled for reference, not timed by the report: the tiles the H100 report timed at
# 16k (docs/benchmarks/h100: 1.18 and 1.52 ms against 0.912 for 64 x 64), which show which
# static figures follow the measured order, and two heads per program, which spills in dk/dv.
REFERENCE_16K = ("strided:128@pallas:128x64", "strided:128@pallas:128x128",
                 "strided:128@pallas:chained:h2:one_loop", "strided:128@pallas:chained:h2",
                 "strided:128@pallas:h2")
# The one-pass variant (attention.pallas_onepass), one stage: the forward's 3 blocks an SM,
# the backward's 2 without spills (two stages: 2 and spills), as its persistent grid assumes.
ONEPASS = "strided:128@pallas:onepass:s1"
ONEPASS_ATOMIC = ONEPASS + ":atomic"  # its backward adding dq atomically, each tile once
# The fixed pattern's gathered kernels (attention.pallas_gathered) at every length the cost
# model predicts (docs/cost_model.md), beside the gathered summary with its own dk/dv tiles,
# each also with option atomic (dq added by the dk/dv kernels, no dq kernel).
GATHERED = tuple((n, "fixed:128:32@pallas:chained:gathered" + tiles + atomic) for n in (
    8192, 16384, 32768, 65536) for atomic in ("", ":atomic") for tiles in ("", ":dkv128x128w8"))
# The one-GPU preset's attention as its training step runs it (train_step's preset cases: B=16,
# 4,096 bytes, strided l=64, 8 heads of 64), in the variants whose steps are measured or
# predicted: the measured default there (chained), terms, and onepass with either backward.
PRESET_SHAPE = {"batch": 16, "heads": 8, "head_dim": 64}
PRESET = tuple(f"strided:64@pallas:{kernel}" for kernel in (
    "chained", "terms", "onepass:s1", "onepass:s1:atomic"))
# The defaults (attention.measured: chained at 16k), the other variant, terms, onepass (both
# backwards) and the fixed pattern's gathered kernels.
CI_PROGRAMS = ("attention 16k strided:128@pallas", "attention 16k fixed:128:32@pallas",
               "attention 16k fixed:128:32@pallas:chained:gathered:dkv128x128w8:atomic",
               "attention 16k fixed:128:32@pallas:chained:gathered:dkv128x128w8",
               "attention 16k strided:128@pallas:terms", f"attention 16k {ONEPASS}",
               f"attention 16k {ONEPASS_ATOMIC}")


def programs() -> list[dict]:
    """Every program the report times, in its order: attention fwd+bwd (bf16, B=1 H=8 d=64) at
    16k (baselines, then the kernel variants), 64k, 8k and 32k (the baselines), strided's
    onepass kernels at 8k-64k, also with option atomic (group "onepass", the report's 16k and
    64k rows too), the preset step's attention (B=16 at 4,096: group "preset"), the training
    steps (train_step's cases) and the long-context study's runs.
    Each: name, group, kind and what to build."""
    from sparse_jax.bench.accelerator import attention, train_step
    from sparse_jax.bench.long_study import plan as study_plan

    out = []
    for group, n, names in (("attention16k", 16384, attention.BASELINES + attention.VARIANTS_16K),
                            ("attention64k", 65536,
                             attention.BASELINES + attention.VARIANTS_64K),
                            ("attention8k", 8192, attention.BASELINES),
                            ("attention32k", 32768, attention.BASELINES)):
        for pattern in names:
            if pattern in (ONEPASS, ONEPASS_ATOMIC):  # the onepass group's, at every length
                continue
            out.append({"name": f"attention {n // 1024}k {pattern}", "group": group,
                        "kind": "attention", "pattern": pattern, "seq_len": n,
                        **ATTENTION_SHAPE})
    for n in (8192, 16384, 32768, 65536):
        for pattern in (ONEPASS, ONEPASS_ATOMIC):
            out.append({"name": f"attention {n // 1024}k {pattern}", "group": "onepass",
                        "kind": "attention", "pattern": pattern, "seq_len": n,
                        **ATTENTION_SHAPE})
    for pattern in REFERENCE_16K:
        out.append({"name": f"attention 16k {pattern}", "group": "reference16k",
                    "kind": "attention",
                    "pattern": pattern, "seq_len": 16384, **ATTENTION_SHAPE})
    timed = {p["name"] for p in out}
    for n, pattern in GATHERED:  # those the report does not time already
        if f"attention {n // 1024}k {pattern}" not in timed:
            out.append({"name": f"attention {n // 1024}k {pattern}", "group": "gathered",
                        "kind": "attention", "pattern": pattern, "seq_len": n,
                        **ATTENTION_SHAPE})
    for pattern in PRESET:  # named apart from the B=1 rows: "preset attention 4k PATTERN"
        out.append({"name": f"preset attention 4k {pattern}", "group": "preset",
                    "kind": "attention", "pattern": pattern, "seq_len": 4096, **PRESET_SHAPE})
    for case in train_step.plan(False)["cases"]:
        out.append({"name": f"step {case['name']}", "group": "steps", "kind": "step",
                    "model": case["model"], "batch_size": case["batch_size"]})
    study = study_plan(False)
    for run in study["runs"]:
        out.append({"name": f"study {run['name']}", "group": "study", "kind": "config",
                    "config": study["config"], "overrides": run["overrides"]})
    out.append({"name": "step enwik8 million", "group": "million", "kind": "config",
                "config": "enwik8:size=million", "overrides": {}})
    return out


def select(names: list[str] | None) -> list[dict]:
    """The programs named, or of the groups named ("attention16k", "attention64k", "attention8k",
    "attention32k", "onepass", "reference16k", "gathered", "preset", "steps", "study",
    "million", "ci" for the CI check's, "all"); ValueError naming an unknown one."""
    every = programs()
    if not names or names == ["all"]:
        return every
    chosen = []
    for name in names:
        if name == "ci":
            matches = [p for p in every if p["name"] in CI_PROGRAMS]
        else:
            matches = [p for p in every if name in (p["group"], p["name"])]
        if not matches:
            raise ValueError(f"--programs: {name!r} is no program or group; give all, ci, "
                             f"attention16k, attention64k, attention8k, attention32k, "
                             f"onepass, reference16k, gathered, preset, steps, study, "
                             f"million or a name (--list prints them)")
        chosen += [p for p in matches if p not in chosen]
    return chosen


def pattern_programs(patterns, lengths, shape: dict) -> list[dict]:
    """An attention program (group "patterns", named as the report's) per pattern string
    (built in or ``module:name(k=v;...)``, as benchmark_attention.py names them) and length,
    each parsed at its length first (a pattern of one's own imported and checked): ValueError
    naming a bad one, before any compile."""
    from sparse_jax.bench.attention import parse_pattern

    out = []
    for pattern in patterns:
        for n in lengths:
            try:
                parse_pattern(pattern, n)
            except ValueError as e:
                raise ValueError(f"--patterns: {e}") from None
            length = f"{n // 1024}k" if n % 1024 == 0 else str(n)
            out.append({"name": f"attention {length} {pattern}", "group": "patterns",
                        "kind": "attention", "pattern": pattern, "seq_len": n, **shape})
    return out


# ---------------------------------------------------------------------------------------------
# The child: one deviceless compile.


def build_program(program: dict, mesh):
    """(function, abstract arguments, tile work or None) of one program on ``mesh``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    replicated = NamedSharding(mesh, P())
    if program["kind"] == "attention":
        from sparse_jax.attention import sparse_attention
        from sparse_jax.bench.attention import parse_pattern

        n, heads, d = program["seq_len"], program["heads"], program["head_dim"]
        spec, implementation, sizes = parse_pattern(program["pattern"], n)
        x = jax.ShapeDtypeStruct((program["batch"], n, heads, d), jnp.bfloat16,
                                 sharding=replicated)
        if spec.kind == "dense":
            def loss(q, k, v):
                out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                   implementation=implementation)
                return out.astype(jnp.float32).sum()
            work = None
        else:
            def loss(q, k, v):
                return sparse_attention(q, k, v, spec, implementation,
                                        sizes).astype(jnp.float32).sum()
            work = (compiled_work.tile_work(spec, n, sizes, heads, d, batch=program["batch"])
                    if implementation == "pallas" else None)
        return jax.grad(loss, argnums=(0, 1, 2)), (x, x, x), work
    from flax import nnx

    from sparse_jax.bench.model import step_function
    from sparse_jax.model.config import ModelConfig

    if program["kind"] == "config":
        import configs
        from sparse_jax.run import config as config_lib

        config = configs.load(program["config"], program["overrides"])
        cfg = config_lib.check_config(config)
        batch = config.batch_size
    else:
        cfg, batch = ModelConfig(**program["model"]), program["batch_size"]
    step, abstract, tx = step_function(cfg, update=True)
    state = nnx.state(abstract)
    opt_state = jax.eval_shape(tx.init, state)
    place = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), tree)
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len + 1), jnp.int32, sharding=replicated)
    return step, (place(state), place(opt_state), tokens), None


def _child(program: dict, target: str) -> None:
    """Compiles ``program`` for ``target`` with no device and prints one ``RESULT {json}``
    line (the ptxas figures and the thunk sequence go to stderr and to --xla_dump_to)."""
    import jax
    from jax.experimental import topologies

    from sparse_jax.attention import tiles

    t = TARGETS[target]
    topology = topologies.get_topology_desc(platform="cuda", target_config=t.config_text(),
                                            topology="1x1x1")
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    result = {}
    with tiles.compiling_for("gpu"):
        fn, args, work = build_program(program, mesh)
        start = time.perf_counter()
        lowered = jax.jit(fn).lower(*args)
        compiled = lowered.compile()
        result["compile_s"] = time.perf_counter() - start
    memory = compiled.memory_analysis()
    result["memory"] = {key: getattr(memory, f"{key}_size_in_bytes")
                        for key in ("argument", "output", "alias", "temp")}
    result["tile_work"] = work
    result["xla_kernel_bytes"] = xla_kernel_bytes(compiled.as_text())
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# The parent: a child per program, its figures gathered.


def child_env(tools: str) -> dict:
    """A compiling child's environment, for any target: the tools folder first on the path, no
    platform forced (the accelerator's plugin must load; it finds no device), no compilation
    cache (a cached program would not be compiled, so the compiler would report nothing). The
    caller's PYTHONPATH (a pattern's own module) is made absolute: a child may run elsewhere."""
    env = dict(os.environ)
    given = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tools), _repo(), *given])
    env.pop("JAX_PLATFORMS", None)
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return env


def tools_env(tools: str) -> dict:
    """``child_env``, the CUDA plugin's checks for a local driver off and XLA's ptxas log on."""
    env = child_env(tools)
    env.update(JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", TF_CPP_MIN_LOG_LEVEL="0",
               TF_CPP_VMODULE="subprocess_compilation=3")
    return env


def install_tools(folder: str, requirements: str) -> None:
    """Installs ``requirements`` (a file of the repository) into ``folder`` as its comment
    says (pip, no dependencies), unless the folder exists. The packages go to a temporary
    folder renamed into place, so processes doing the same side by side never see half an
    install; ValueError (one line) if pip fails (no network: install them elsewhere and copy
    the folder)."""
    if os.path.isdir(folder):
        return
    parent = os.path.dirname(os.path.abspath(folder))
    os.makedirs(parent, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=".partial_tools_", dir=parent)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                           partial, "-r", os.path.join(_repo(), requirements)],
                          capture_output=True, text=True)
    if proc.returncode:
        shutil.rmtree(partial, ignore_errors=True)
        raise ValueError(f"could not install {requirements} into {folder}: "
                         f"{last_error(proc.stderr) or f'pip exit status {proc.returncode}'}")
    try:
        os.rename(partial, folder)
    except OSError:  # another process put its install there first
        shutil.rmtree(partial, ignore_errors=True)


def _repo() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check_tools(tools: str) -> None:
    """ValueError (one line) if ``tools`` lacks the CUDA plugin or ptxas."""
    need = {"jax_plugins/xla_cuda12": "jax-cuda12-plugin",
            "nvidia/cuda_nvcc/bin/ptxas": "nvidia-cuda-nvcc-cu12"}
    missing = [pkg for path, pkg in need.items() if not os.path.exists(os.path.join(tools, path))]
    if missing:
        raise ValueError(f"--tools={tools} lacks {', '.join(missing)}: install them with `pip "
                         f"install --no-deps --target {tools} -r {REQUIREMENTS}`")


def versions(tools: str) -> str:
    """jax's version and the tools folder's packages' (from their .dist-info folders), as a
    report's header names them."""
    import jax

    found = sorted(" ".join(name[:-len(".dist-info")].rsplit("-", 1))
                   for name in os.listdir(tools) if name.endswith(".dist-info"))
    return f"jax {jax.__version__}, " + ", ".join(found)


def compile_program(program: dict, target: str, tools: str, timeout: float = 600) -> dict:
    """``program`` compiled for ``target`` in a child process: the row of the report (compile
    seconds, planned memory, per Triton kernel its grid, registers, spills, shared memory,
    occupancy, waves, tiles and bytes), or with "error" the compiler's last line."""
    t = TARGETS[target]
    row = {"name": program["name"], "group": program["group"], "target": target}
    no_cudnn = not os.path.isdir(os.path.join(tools, "nvidia", "cudnn"))
    if no_cudnn and str(program.get("pattern", "")).endswith("@cudnn"):  # the fallback promised:
        program = {**program, "pattern": program["pattern"][:-len("@cudnn")] + "@xla"}
        row["note"] = ("fell back: no cuDNN in --tools (nvidia-cudnn-cu12), so XLA's unfused "
                       "attention (dense@xla) was compiled, as a GPU without cuDNN runs it")
    with tempfile.TemporaryDirectory(prefix="sparse_jax_compile_") as dump:
        env = tools_env(tools)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "sparse_jax.bench.compiled", json.dumps(program), target],
                env=env, cwd=_repo(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            row["error"] = f"not compiled in {timeout:.0f} s"
            return row
        row["wall_s"] = time.perf_counter() - start
        results = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not results:
            row["error"] = last_error(proc.stderr) or f"exit status {proc.returncode}"
            return row
        row.update(json.loads(results[-1]))
        thunks = []
        for path in sorted(os.listdir(dump)):
            if path.endswith(".thunk_sequence.txt"):
                with open(os.path.join(dump, path)) as f:
                    thunks += parse_thunks(f.read())
    ptxas = parse_ptxas(proc.stderr)
    if _dense(program) and no_cudnn and "note" not in row:
        row["note"] = ("no cuDNN in --tools (nvidia-cudnn-cu12): XLA's unfused attention, as on "
                       "a GPU without cuDNN")
    memory = row["memory"]
    row["planned_gb"] = (memory["argument"] + memory["output"] - memory["alias"]
                         + memory["temp"]) / 1e9
    row["fits"] = row["planned_gb"] <= t.hbm_gb
    work = row.pop("tile_work") or {}
    kernels, seen = [], {}
    for thunk in thunks:
        if not thunk["name"].startswith("sparse_"):
            continue
        base = re.sub(r"__\d+$", "", thunk["name"])
        key = (base, tuple(thunk["grid"]), thunk["shared_memory"],
               ptxas.get(thunk["name"], {}).get("registers"))
        if key in seen:  # the same kernel in another layer: counted, listed once
            seen[key]["launches"] += 1
            continue
        figures = ptxas.get(thunk["name"], {})
        kernel = {**thunk, "registers": figures.get("registers"),
                  "spill_bytes": figures.get("spill_stores", 0) + figures.get("spill_loads", 0)}
        programs = math.prod(thunk["grid"])
        kernel.update(programs=programs, launches=1)
        seen[key] = kernel
        if kernel["registers"] is not None:
            kernel.update(occupancy(t, kernel["registers"], thunk["threads"],
                                    thunk["shared_memory"]))
            kernel["waves"] = programs / (kernel["blocks_per_sm"] * t.sms)
        if base in work:
            kernel.update({key: value for key, value in work[base].items()
                           if key != "programs"})
        kernels.append(kernel)
    row["kernels"] = kernels
    row["max_spill_bytes"] = max((k["spill_bytes"] for k in kernels), default=0)
    row["triton_launches"] = sum(k["launches"] for k in kernels)
    row["other_spills"] = sorted(name for name, f in ptxas.items()
                                 if not name.startswith("sparse_")
                                 and f.get("spill_stores", 0) + f.get("spill_loads", 0))
    if work:
        row["kernel_hbm_gb"] = sum(k.get("hbm_bytes", 0) for k in kernels) / 1e9
        row["xla_hbm_gb"] = row["xla_kernel_bytes"]["bytes"] / 1e9
        row["hbm_gb"] = row["kernel_hbm_gb"] + row["xla_hbm_gb"]
        row["hbm_floor_ms"] = row["hbm_gb"] / t.hbm_gbps * 1e3
    return row


def progress(row: dict) -> str:
    """The console line of a compiled program."""
    if "error" in row:
        return row["error"]
    return (f"{row['compile_s']:.1f} s, {row['planned_gb']:.2f} GB planned, "
            f"{len(row['kernels'])} Triton kernels, max spill {row['max_spill_bytes']} B")


def _dense(program: dict) -> bool:
    """Whether the program runs dense attention (cuDNN's where it is installed)."""
    pattern = (program.get("pattern") or program.get("model", {}).get("pattern")
               or program.get("overrides", {}).get("model.pattern") or "")
    return pattern.startswith("dense")


def last_error(stderr: str) -> str:
    """The line of a child's stderr that says why it failed."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"Error|error:|RESOURCE_EXHAUSTED|INTERNAL", line) and "W0000" not in line:
            return line[:300]
    return lines[-1][:300] if lines else ""


def least_bytes(n: int, batch: int = 1, heads: int = 8, head_dim: int = 64) -> float:
    """The least bytes any attention fwd+bwd in bfloat16 must move: q, k, v read by both passes,
    o written and read, do read, dq, dk, dv written (12 arrays)."""
    return 12 * batch * n * heads * head_dim * 2


if __name__ == "__main__":  # the child: python -m sparse_jax.bench.compiled PROGRAM_JSON TARGET
    _child(json.loads(sys.argv[1]), sys.argv[2])
