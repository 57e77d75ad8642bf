r"""The attention kernels compiled for a TPU (v5e, v5p, v6e) on a CPU host, with no TPU present:
the Mosaic kernels as the chip's compiler builds them, and what it decided for each.

  pip install --no-deps --target .tpu_tools -r requirements-tpu-compile.txt
  python scripts/compile_report.py --target=v5e --programs=ci --check

How: libtpu (at the version jax's ``tpu`` extra pins) installed into a folder of its own
(``--tools``) and put on the path of a child process only, so the project's environment stays a
CPU one; jax finds it by importing the ``libtpu`` package, and the child also names its
``libtpu.so`` in ``TPU_LIBRARY_PATH``. ``jax.experimental.topologies.get_topology_desc`` builds
the chip from its name ("v5e:1x1"), and ``jax.jit(f).lower(...).compile()`` performs a
deviceless compile, every program in its own process (``tiles.compiling_for("tpu")``
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
  static cycles     v5p and v6e (``Target.cycles``): libtpu's static profile, which the compile
                    writes with ``LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR`` (a
                    textproto per HLO op): each Mosaic kernel's estimated cycles, their sum per
                    program, its time at ``Target.clock_ghz``; beside it the MXU floor of the
                    visited tiles' matrix products (``tile_flops``), which the estimate falls
                    below for large tiles

"context" programs split one sequence over several chips of a slice (``context`` on a mesh axis
"seq" of the topology ``Target.slice`` names, e.g. "v5p:2x2x1"): XLA's plan and the static
profile are then one chip's, collectives included.

Splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) is compiled the same way
on our patterns' exact masks ("splash" programs), and the table sets the two side by side. No
time is measured: these are the compiler's figures and estimates, not measurements on a TPU. A
kernel that Mosaic refuses (tiles it cannot lay out, VMEM it does not have) fails the compile
and is reported with the compiler's line.

  programs()             the programs compiled, by name and group ("ci": the suite's check)
  parse_mosaic_kernels   each Mosaic kernel of compiled HLO text: name, calls, VMEM
  parse_static_profile   libtpu's static profile: each op's cycles
  compile_program(...)   one program compiled in a child process: its row
  markdown, problems     the report's table (ours beside splash: ``beside_splash``); what fails
                         the check

The reading of the compiler's output lives in ``compiled_tpu_output``, the report's tables in
``compiled_tpu_tables``, splash attention's programs in ``compiled_tpu_splash``; their names are
re-exported here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from sparse_jax.bench import compiled
from sparse_jax.bench.compiled_tpu_output import (  # noqa: F401  re-exported
    TARGETS,
    VMEM,
    Target,
    attach_cycles,
    loop_trips,
    parse_mosaic_kernels,
    parse_static_profile,
    read_static_profile,
)
from sparse_jax.bench.compiled_tpu_splash import (  # noqa: F401  re-exported
    NUMPY_MASK_MAX,
    nonzero_blocks,
    splash_mask,
    splash_program,
)
from sparse_jax.bench.compiled_tpu_tables import (  # noqa: F401  re-exported
    beside_splash,
    markdown,
    mask_of,
    problems,
)

TOOLS_ENV = "SPARSE_JAX_TPU_TOOLS"  # where libtpu is installed
DEFAULT_TOOLS = ".tpu_tools"
REQUIREMENTS = "requirements-tpu-compile.txt"


PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"  # libtpu: static cycles of every HLO op

# fwd+bwd in bfloat16, head dim 128 (a TPU's lanes). The suite's check: the default strided
# and fixed kernels at a length whose arrays stay in HBM, so the kernels pipeline their blocks
# as they would at 16k, and the compile stays short (about 10 s each on 2 cores).
ATTENTION_SHAPE = {"batch": 1, "heads": 8, "head_dim": 128}
CI_LENGTH = 8192
PATTERNS = ("strided:128@pallas", "fixed:128:32@pallas")


def _attention(pattern: str, n: int, group: str, forward: bool = False, heads: int = 8) -> dict:
    return {"name": f"attention {n // 1024}k {pattern}{' fwd' if forward else ''}"
                    f"{f' h{heads}' if heads != 8 else ''}",
            "group": group, "kind": "attention", "pattern": pattern, "seq_len": n,
            **ATTENTION_SHAPE, "heads": heads, **({"forward": True} if forward else {})}


# Splash attention (jax.experimental.pallas.ops.tpu.splash_attention) given our patterns' exact
# masks as NumPy masks (dense: its own causal mask), at its block sizes: what the same masks
# cost in the kernel a TPU user would reach for. A NumPy mask is n x n bytes on the host (64k:
# 4 GiB, and splash's mask processing holds more), so 8k and 16k only; at 16k the compile of
# 256-blocks was killed for memory at 21 GB (128-blocks need more still): not listed. 1024-blocks
# with a NumPy mask exceed the scoped VMEM Mosaic grants (its mask blocks): listed, refused.
SPLASH_MASKS = ("strided:128", "fixed:128:32", "dense")
LARGER_TILES = (256, 512)  # our kernels at tiles beyond the 128 x 128 default (tiles8k, 16k)
BANDS = ("band256x8", "band256x16", "band0")  # band kernels' other blocks, or none (bands16k)
SPLASH_BLOCKS = (256, 512, 1024)


def _splash(mask: str, n: int, block: int, group: str, forward: bool = False,
            heads: int = 8) -> dict:
    return {"name": f"splash {n // 1024}k {mask} b{block}{' fwd' if forward else ''}"
                    f"{f' h{heads}' if heads != 8 else ''}",
            "group": group, "kind": "splash", "pattern": mask, "block": block, "seq_len": n,
            **ATTENTION_SHAPE, "heads": heads, **({"forward": True} if forward else {})}


# Heads at 64k: what libtpu's profiler takes on this machine. With 8, its profile of strided
# and splash's compile need more than 24 GiB; with fewer than 8 it aborts on the listed kernels
# of fixed's summary (signal 6, a check in its critical-path printer), and with 8 it profiles
# fixed in 19 GB. Ours and splash's are set side by side per head (``beside_splash``).
HEADS_64K = {"strided:128@pallas": 1, "fixed:128:32@pallas": 8}


def programs() -> list[dict]:
    """The suite's check ("ci", the default kernels at ``CI_LENGTH``), then the same at 16k and
    64k (groups "attention16k", "attention64k"; 64k with ``HEADS_64K`` heads, splash's with
    one); the same at larger tiles ("tiles8k", "tiles16k") and with other band blocks
    ("bands16k"); splash attention with the same masks at 8k and 16k ("splash8k",
    "splash16k"); the forward passes alone at 16k ("forward16k": ours and splash's at
    512-blocks, for v6e, whose profiler takes too long over the backward); the paper's step
    ("steps"); one sequence over several chips ("context": ``CONTEXT``)."""
    out = [_attention(p, n, group) for n, group in ((CI_LENGTH, "ci"), (16384, "attention16k"))
           for p in PATTERNS]
    out += [_attention(p, 65536, "attention64k", heads=HEADS_64K[p]) for p in PATTERNS]
    out += [_attention(f"{p}:{t}x{t}", n, f"tiles{n // 1024}k") for n in (CI_LENGTH, 16384)
            for p in PATTERNS for t in LARGER_TILES]
    out += [_attention(f"{p}:{b}", 16384, "bands16k") for p in PATTERNS for b in BANDS]
    out += [_splash(m, n, b, f"splash{n // 1024}k") for n in (CI_LENGTH, 16384)
            for m in SPLASH_MASKS for b in SPLASH_BLOCKS if (n, b) != (16384, 256)]
    out += [_splash(m, 65536, 512, "splash64k", heads=1) for m in SPLASH_MASKS]
    out += [_attention(p, 16384, "forward16k", forward=True) for p in PATTERNS]
    out += [_splash(m, 16384, 512, "forward16k", forward=True) for m in SPLASH_MASKS]
    out += _steps()
    out += [_context(*case) for case in CONTEXT]
    return out


# Context parallelism (``sparse_jax.attention.context``): one sequence split over the chips of a v5p
# slice, the Pallas kernels on each chip's shard. 64k as the one-chip rows (one chip's share of
# the same work, and what the collectives add), and a million bytes at the million preset's
# stride (l = 1,024) over 8 chips.
CONTEXT = (("strided:128@pallas", 65536, 4, 1), ("fixed:128:32@pallas", 65536, 4, 8),
           ("strided:1024@pallas", 1 << 20, 8, 8))


def _context(pattern: str, n: int, chips: int, heads: int) -> dict:
    length = f"{n >> 20}m" if n >= 1 << 20 else f"{n // 1024}k"
    return {"name": f"context {length} {pattern} p{chips}{f' h{heads}' if heads != 8 else ''}",
            "group": "context", "kind": "context", "pattern": pattern, "seq_len": n,
            **ATTENTION_SHAPE, "heads": heads, "chips": chips}


def _steps() -> list[dict]:
    """The paper's enwik8 model's training step at 16k (the accelerator report's, with the
    Pallas kernels: Mosaic's here), group "steps"."""
    from sparse_jax.bench.accelerator import train_step

    return [{"name": f"step {case['name']}", "group": "steps", "kind": "step",
             "model": case["model"], "batch_size": case["batch_size"]}
            for case in train_step.plan(False)["cases"] if case["name"] == "paper 16k fixed@pallas"]


def select(names: list[str] | None) -> list[dict]:
    """The programs named, or of the groups named (``programs``' groups, or "all"); ValueError
    naming an unknown one."""
    every = programs()
    if not names or names == ["all"]:
        return every
    chosen = []
    for name in names:
        matches = [p for p in every if name in (p["group"], p["name"])]
        if not matches:
            groups = ", ".join(dict.fromkeys(p["group"] for p in every))
            raise ValueError(f"--programs: {name!r} is no program or group; give all, {groups} "
                             f"or a name (--list prints them)")
        chosen += [p for p in matches if p not in chosen]
    return chosen


def _context_program(program: dict, mesh):
    """(loss gradient, abstract q, k, v) of ``context.context_parallel_attention`` with the
    sequence split over ``mesh``'s axis "seq": [B, n, H, d] bfloat16, sharded by position."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sparse_jax.attention import context
    from sparse_jax.bench.attention import parse_pattern

    n = program["seq_len"]
    spec, implementation, sizes = parse_pattern(program["pattern"], n)
    x = jax.ShapeDtypeStruct((program["batch"], n, program["heads"], program["head_dim"]),
                             jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "seq")))

    def loss(q, k, v):
        return context.context_parallel_attention(
            q, k, v, spec, mesh, implementation=implementation,
            block_sizes=sizes).astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2)), (x, x, x)


def build(program: dict, mesh):
    """(function, abstract arguments) of ``program`` on ``mesh``: splash's, context
    parallelism's, or ``compiled.build_program``'s (its forward alone, the loss, where
    ``program["forward"]``)."""
    if program["kind"] == "splash":
        return splash_program(program, mesh)
    if program["kind"] == "context":
        return _context_program(program, mesh)
    fn, args, _ = compiled.build_program(program, mesh)  # the GPU's tile work does not apply
    return (_forward_of(program) if program.get("forward") else fn), args


def tile_flops(program: dict) -> float:
    """The matrix products' flops over every tile the kernels visit (masked pairs too): per
    scored (query, key) pair and head 2 d multiply-adds forward (q·k, p·v), 3 d for dq and 4 d
    for dk, dv (ours and splash's alike), 2 flops each. Ours: the block lists' scored pairs
    (``fused.sparsity``); splash: its nonzero mask blocks, whole."""
    from sparse_jax.attention import blocks as kernel
    from sparse_jax.attention import fused
    from sparse_jax.bench.attention import parse_pattern

    n, heads, d = program["seq_len"], program["batch"] * program["heads"], program["head_dim"]
    spec, _, sizes = parse_pattern(program["pattern"], n, backend="mosaic")
    if program["kind"] == "splash":
        b, blocks = program["block"], n // program["block"]
        nonzero = (blocks * (blocks + 1) // 2 if spec.kind == "dense" else
                   nonzero_blocks(spec, n, b))
        scored = nonzero * b * b
    else:
        scored = fused.sparsity(spec, n, sizes or kernel.BlockSizes.for_backend("mosaic"))[
            "scored"]
    return 2.0 * d * heads * scored * (2 if program.get("forward") else 9)


def _forward_of(program: dict):
    """The loss alone (no gradient) of a sparse attention program."""
    import jax.numpy as jnp

    from sparse_jax.attention import sparse_attention
    from sparse_jax.bench.attention import parse_pattern

    spec, implementation, sizes = parse_pattern(program["pattern"], program["seq_len"])
    return lambda q, k, v: sparse_attention(q, k, v, spec, implementation,
                                            sizes).astype(jnp.float32).sum()


# ---------------------------------------------------------------------------------------------
# The child: one deviceless compile.


def _own_pattern(pattern: str) -> bool:
    """Whether ``pattern`` names a pattern of one's own (``module:name``), not a built-in."""
    from sparse_jax.attention.patterns import KINDS

    return pattern.split(":")[0].partition("@")[0] not in KINDS


def _child(program: dict, target: str) -> None:
    """Compiles ``program`` for ``target`` with no device and prints one ``RESULT {json}``
    line. ``program["unchecked_tiles"]``: skip the project's own tile rule
    (``BlockSizes.check_backend``), so that Mosaic itself judges the tiles (tests)."""
    import jax
    from jax._src import cloud_tpu_init
    from jax.experimental import topologies

    from sparse_jax.attention import blocks as kernel
    from sparse_jax.attention import tiles

    if program.get("unchecked_tiles"):
        check = kernel.BlockSizes.check_backend
        kernel.BlockSizes.check_backend = (
            lambda self, backend, tiles=True: check(self, backend, tiles=False))
    library = cloud_tpu_init.get_tpu_library_path()
    t = TARGETS[target]
    chips = program.get("chips", 1)  # a context program's slice; one chip for the others
    name = t.slice(chips)
    shape = tuple(map(int, name.partition(":")[2].split("x")))
    topology = topologies.get_topology_desc(name, platform="tpu",
                                            chips_per_host_bounds=(shape + (1,))[:3])
    mesh = topologies.make_mesh(topology, (chips,), ("seq",))
    result = {"libtpu": library}
    with tiles.compiling_for("tpu"):
        fn, args = build(program, mesh)
        start = time.perf_counter()
        # splash's kernels may ask which chip they are for (a mask it computes), and so may a
        # pattern of one's own (Mosaic lowers its rule's integer division per chip): the mesh's
        asks = program["kind"] == "splash" or _own_pattern(program.get("pattern", ""))
        chip = jax.set_mesh(mesh) if asks else contextlib.nullcontext()
        with chip:
            lowered = jax.jit(fn).lower(*args)
        executable = lowered.compile()
        result["compile_s"] = time.perf_counter() - start
    memory = executable.memory_analysis()
    result["memory"] = {key: getattr(memory, f"{key}_size_in_bytes")
                        for key in ("argument", "output", "alias", "temp")}
    cost = executable.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    result["flops"] = float((cost or {}).get("flops", 0.0))
    text = executable.as_text()
    result["kernels"] = parse_mosaic_kernels(text)
    result["trips"] = loop_trips(text)
    result["collectives"] = sorted(set(re.findall(
        r" (all-to-all|collective-permute|all-gather|all-reduce|reduce-scatter)(?:-start)?\(",
        text)))
    if program["kind"] in ("attention", "splash"):  # a step's products are not the tiles'
        result["tile_flops"] = tile_flops(program)
    print("RESULT " + json.dumps(result), flush=True)


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


def compile_program(program: dict, target: str, tools: str, timeout: float = 600,
                    cycles: bool | None = None) -> dict:
    """``program`` compiled for ``target`` in a child process: its row (compile seconds, planned
    memory against the chip's HBM, per Mosaic kernel its VMEM, XLA's flops; with ``cycles``,
    by default where the target's profiler runs, libtpu's static cycles: ``attach_cycles``), or
    with "error" the compiler's line."""
    t = TARGETS[target]
    cycles = t.cycles if cycles is None else cycles
    row = {"name": program["name"], "group": program["group"], "target": target}
    env = tools_env(tools)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sparse_jax_tpu_") as scratch:
        profile_dir = os.path.join(scratch, "static_profile")
        if cycles:
            env["LIBTPU_INIT_ARGS"] = " ".join(filter(None, [
                env.get("LIBTPU_INIT_ARGS"), f"{PROFILE_FLAG}={profile_dir}"]))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "sparse_jax.bench.compiled_tpu", json.dumps(program),
                 target], env=env, cwd=scratch, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            row["error"] = f"not compiled in {timeout:.0f} s"
            return row
        profile = read_static_profile(profile_dir) if cycles else None
    row["wall_s"] = time.perf_counter() - start
    results = [line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode < 0:  # a signal: the kernel's OOM killer, or someone
        why = {9: " (out of memory?)", 6: " (an abort: libtpu's profiler aborts on some "
                                          "programs; --nocycles compiles them)"}
        row["error"] = f"compile killed by signal {-proc.returncode}" + why.get(
            -proc.returncode, "")
        return row
    if proc.returncode or not results:
        row["error"] = compiled.last_error(proc.stderr) or f"exit status {proc.returncode}"
        return row
    row.update(json.loads(results[-1]))
    trips = row.pop("trips")  # per op: too many to keep; the loops' counts are kept
    row["loop_trips"] = sorted(set(trips.values()), key=lambda n: (n is None, n))
    if os.path.realpath(row["libtpu"]) != os.path.realpath(env["TPU_LIBRARY_PATH"]):
        row["error"] = f"libtpu loaded from {row['libtpu']}, not --tools={tools}"
        return row
    memory = row["memory"]
    row["planned_gib"] = (memory["argument"] + memory["output"] - memory["alias"]
                          + memory["temp"]) / 2**30
    row["fits"] = row["planned_gib"] <= t.hbm_gib
    row["max_vmem_bytes"] = max((k["vmem_bytes"] for k in row["kernels"]), default=0)
    if profile is not None:
        attach_cycles(row, profile, t.clock_ghz, t.peak_tflops, trips)
    return row


def progress(row: dict) -> str:
    """The console line of a compiled program."""
    if "error" in row:
        return row["error"]
    cycles = "" if row.get("cycles") is None else (
        f", {row['cycles'] / 1e6:.3f} M static cycles ({row['estimated_us']:.0f} us)")
    return (f"{row['compile_s']:.1f} s, {row['planned_gib']:.3f} GiB planned, "
            f"{len(row['kernels'])} Mosaic kernels, max VMEM "
            f"{row['max_vmem_bytes'] / 1024:.0f} KiB{cycles}")


if __name__ == "__main__":  # the child: python -m sparse_jax.bench.compiled_tpu PROGRAM TARGET
    _child(json.loads(sys.argv[1]), sys.argv[2])
