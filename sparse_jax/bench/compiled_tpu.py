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
"""

from __future__ import annotations

import contextlib
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
    """A TPU chip as ``topologies.get_topology_desc`` names it, its HBM, its TensorCore clock
    (GHz: static cycles to seconds) and whether libtpu's static profiler runs for it
    (``cycles``: on v5e it aborts the compile)."""
    name: str
    topology: str
    hbm_gib: float
    clock_ghz: float
    cycles: bool
    peak_tflops: float  # bf16, the whole chip (the MXU floor of a kernel's matrix products)

    def slice(self, chips: int) -> str:
        """The topology of ``chips`` chips of this kind in one slice ("v5p:2x2x1" for 4; one
        chip: ``topology``)."""
        shapes = {1: "1x1x1", 4: "2x2x1", 8: "2x2x2"} if self.topology.count("x") == 2 else {
            1: "1x1", 4: "2x2", 8: "2x4"}
        if chips not in shapes:
            raise ValueError(f"{chips} chips: give one of {', '.join(map(str, shapes))}")
        return f"{self.topology.partition(':')[0]}:{shapes[chips]}"


# Clocks: no data sheet states one; each is the chip's peak bf16 rate over its MXUs' multiply-
# adds per cycle (128 x 128 MXUs, 2 flops a multiply-add). v5e: 197 TFLOP/s over 4 MXUs on one
# TensorCore = 1.50 GHz (also the 1.5 GHz that "How to Scale Your Model", ch. 2, quotes for a
# v5e MXU); v5p: 459 TFLOP/s over 2 TensorCores x 4 MXUs = 1.75 GHz; v6e: 918 TFLOP/s over one
# TensorCore's 4 MXUs of 256 x 256 (Cloud TPU's v6e page; an older version said 2) = 1.75 GHz.
TARGETS = {
    "v5e": Target("TPU v5e (one chip)", "v5e:1x1", 16.0, 1.50, cycles=False, peak_tflops=197),
    "v5p": Target("TPU v5p (one chip)", "v5p:1x1x1", 95.0, 1.75, cycles=True, peak_tflops=459),
    "v6e": Target("TPU v6e (one chip)", "v6e:1x1", 32.0, 1.75, cycles=True, peak_tflops=918),
}
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


# Context parallelism (``sparse_jax.context``): one sequence split over the chips of a v5p
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


NUMPY_MASK_MAX = 16384  # longer: the pattern's rule as a mask splash computes (n x n bytes)


def splash_mask(pattern: str, n: int):
    """Splash attention's mask for ``pattern`` at length ``n``, one head's: the pattern's exact
    boolean mask (``PatternSpec.mask``) as a ``NumpyMask`` up to ``NUMPY_MASK_MAX``, beyond it
    the pattern's rule (``kernel.mask_rule``) as a computable mask, which
    splash evaluates per block on the host and in its kernels (as its own causal and local
    masks); for "dense" splash's ``CausalMask``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    from sparse_jax import kernel
    from sparse_jax.bench.attention import parse_pattern

    spec = parse_pattern(pattern, n)[0]
    if spec.kind == "dense":
        return masks.CausalMask((n, n))
    if n <= NUMPY_MASK_MAX:
        return masks.NumpyMask(spec.mask(n))
    class PatternMask(masks._ComputableMask):  # hashable, as splash's own masks are
        def __eq__(self, other):
            return type(other) is type(self) and (other.shape, other.spec) == (self.shape,
                                                                              self.spec)

        def __hash__(self):
            return hash((type(self), self.shape, self.spec))

    mask = PatternMask((n, n), kernel.mask_rule(spec))
    mask.spec = spec
    return mask


def _splash_program(program: dict, mesh):
    """(loss gradient or forward, abstract q, k, v) of splash attention over ``program``'s mask
    and block size, [H, n, d] bfloat16 (one sequence: B = 1)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n, heads, d, b = program["seq_len"], program["heads"], program["head_dim"], program["block"]
    if program["batch"] != 1:
        raise ValueError("splash programs take one sequence (batch 1)")
    mask = masks.MultiHeadMask([splash_mask(program["pattern"], n)] * heads)
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                              block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b,
                              block_kv_dq=b)
    attend = splash.make_splash_mha_single_device(mask=mask, block_sizes=sizes)
    x = jax.ShapeDtypeStruct((heads, n, d), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def loss(q, k, v):
        return attend(q, k, v).astype(jnp.float32).sum()

    return (loss if program.get("forward") else jax.grad(loss, argnums=(0, 1, 2))), (x, x, x)


def _context_program(program: dict, mesh):
    """(loss gradient, abstract q, k, v) of ``context.context_parallel_attention`` with the
    sequence split over ``mesh``'s axis "seq": [B, n, H, d] bfloat16, sharded by position."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from sparse_jax import context
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
        return _splash_program(program, mesh)
    if program["kind"] == "context":
        return _context_program(program, mesh)
    fn, args, _ = compiled.build_program(program, mesh)  # the GPU's tile work does not apply
    return (_forward_of(program) if program.get("forward") else fn), args


def tile_flops(program: dict) -> float:
    """The matrix products' flops over every tile the kernels visit (masked pairs too): per
    scored (query, key) pair and head 2 d multiply-adds forward (q·k, p·v), 3 d for dq and 4 d
    for dk, dv (ours and splash's alike), 2 flops each. Ours: the block lists' scored pairs
    (``kernel.sparsity``); splash: its nonzero mask blocks, whole."""
    from sparse_jax import kernel
    from sparse_jax.bench.attention import parse_pattern

    n, heads, d = program["seq_len"], program["batch"] * program["heads"], program["head_dim"]
    spec, _, sizes = parse_pattern(program["pattern"], n, backend="mosaic")
    if program["kind"] == "splash":
        b, blocks = program["block"], n // program["block"]
        nonzero = (blocks * (blocks + 1) // 2 if spec.kind == "dense" else
                   _nonzero_blocks(spec, n, b))
        scored = nonzero * b * b
    else:
        scored = kernel.sparsity(spec, n, sizes or kernel.BlockSizes.for_backend("mosaic"))[
            "scored"]
    return 2.0 * d * heads * scored * (2 if program.get("forward") else 9)


def _nonzero_blocks(spec, n: int, b: int) -> int:
    """Blocks of ``b`` × ``b`` of the pattern's n × n mask holding a kept pair (a block row of
    the mask at a time, by the pattern's rule)."""
    import numpy as np

    from sparse_jax import kernel

    keep, keys = kernel.mask_rule(spec), np.arange(n)[None]
    return sum(int(keep(np.arange(i, i + b)[:, None], keys).reshape(b, -1, b).any(
        axis=(0, 2)).sum()) for i in range(0, n, b))


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
    chips = program.get("chips", 1)  # a context program's slice; one chip for the others
    name = t.slice(chips)
    shape = tuple(map(int, name.partition(":")[2].split("x")))
    topology = topologies.get_topology_desc(name, platform="tpu",
                                            chips_per_host_bounds=(shape + (1,))[:3])
    mesh = topologies.make_mesh(topology, (chips,), ("seq",))
    result = {"libtpu": library}
    with pallas_kernels.compiling_for("tpu"):
        fn, args = build(program, mesh)
        start = time.perf_counter()
        # splash's kernels may ask which chip they are for (a mask it computes): the mesh's
        chip = jax.set_mesh(mesh) if program["kind"] == "splash" else contextlib.nullcontext()
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


_STARTS = re.compile(r"^(\s+(ROOT )?%|%|ENTRY|HloModule|\}$|$)")


def _instructions(hlo: str) -> list[str]:
    """HLO text's lines, each instruction on one: an attribute that holds a newline (splash
    attention's ``kernel_metadata``) continues on lines of its own, joined back here."""
    out = []
    for line in hlo.splitlines():
        if out and not _STARTS.match(line):
            out[-1] += line
        else:
            out.append(line)
    return out


def parse_mosaic_kernels(hlo: str) -> list[dict]:
    """Each Mosaic kernel (``tpu_custom_call``) of compiled HLO text, in order of first
    appearance: name, VMEM bytes (its used scoped memory in VMEM), whether an output of it
    sits in VMEM whole (``S(1)`` in its shape: no pipeline window for it), and calls (the same
    kernel with the same VMEM in several computations, as a model's layers, is listed once)."""
    out, seen = [], {}
    for line in _instructions(hlo):
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
            seen[key]["instructions"].append(instruction)
            continue
        seen[key] = {"name": name, "vmem_bytes": vmem, "output_in_vmem": "S(1)" in shape,
                     "calls": 1, "instructions": [instruction]}
        out.append(seen[key])
    return out


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) ")
_ANY_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = ")
_WHILE = re.compile(r" while\(.*condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_CONSTANT = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = s32\[\]\S* constant\((\d+)\)")
_LESS_THAN = re.compile(r"^\s+ROOT %?[\w.\-]+ = pred\[\]\S* compare\(%?[\w.\-]+, "
                        r"%?([\w.\-]+)\), direction=LT")


def loop_trips(hlo: str) -> dict[str, int | None]:
    """How many times each instruction of compiled HLO text runs, where not once: those of a
    while loop's body and condition run its trip count, times that of the loops around it (a
    scan over layers: its count is the s32 constant its condition compares the counter with,
    ``i < N``, the counter starting at 0; None where a loop's count cannot be read so).
    libtpu's static profile gives an op's cycles for one run."""
    where, loops, constants, limit = {}, {}, {}, {}  # instruction -> computation; ...
    computation = None
    for line in _instructions(hlo):
        if not line.startswith(" "):
            found = _COMPUTATION.match(line)
            computation = found.group(1) if found and line.rstrip().endswith("{") else None
            continue
        found = _ANY_INSTRUCTION.match(line)
        if not found or computation is None:
            continue
        where[found.group(1)] = computation
        if (loop := _WHILE.search(line)):
            loops[found.group(1)] = loop.groups()
        if (constant := _CONSTANT.match(line)):
            constants[constant.group(1)] = int(constant.group(2))
        if (compare := _LESS_THAN.match(line)):
            limit[computation] = compare.group(1)
    inside = {}  # body or condition computation -> (the while instruction, its trips)
    for name, (condition, body) in loops.items():
        inside[body] = inside[condition] = (name, constants.get(limit.get(condition)))

    def runs(computation):
        if computation not in inside:
            return 1
        loop, trips = inside[computation]
        outer = runs(where[loop])
        return None if trips is None or outer is None else trips * outer

    return {name: n for name, c in where.items() if (n := runs(c)) != 1}


_ESTIMATE = re.compile(r"^hlo_op_estimate \{$", re.M)
_FIELD = re.compile(r"^  (hlo_op_name|estimated_cycles|num_equivalent_hlos): \"?([^\"\n]*)\"?$",
                    re.M)


def parse_static_profile(text: str) -> dict[str, dict]:
    """libtpu's static profile (``PROFILE_FLAG``: a ``NAME_static_llo_profile.textproto`` per
    HLO op, ``hlo_op_estimate`` messages in protobuf text) read into ``{op name: {"cycles",
    "equivalent"}}``: the compiler's estimate of the op's cycles, and how many equivalent ops of
    the program it stands for (one file is written for them all). Only each message's own
    fields count (the op's HLO, nested in it, is indented deeper); a field left out is 0, as
    protobuf omits zeros."""
    out = {}
    starts = [m.start() for m in _ESTIMATE.finditer(text)] + [len(text)]
    for start, end in zip(starts, starts[1:]):
        fields = dict(_FIELD.findall(text[start:end]))
        if "hlo_op_name" in fields:
            out[fields["hlo_op_name"]] = {
                "cycles": int(fields.get("estimated_cycles", 0)),
                "equivalent": int(fields.get("num_equivalent_hlos", 1))}
    return out


def read_static_profile(folder: str) -> dict[str, dict]:
    """``parse_static_profile`` of every file libtpu wrote into ``folder``."""
    text = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if name.endswith("_static_llo_profile.textproto"):
            with open(os.path.join(folder, name)) as f:
                text.append(f.read())
    return parse_static_profile("\n".join(text))


def attach_cycles(row: dict, profile: dict[str, dict], clock_ghz: float,
                  peak_tflops: float = 0.0, trips: dict[str, int | None] | None = None) -> None:
    """Each Mosaic kernel of ``row`` gets its static cycles (summed over its calls; None where
    the profile lacks one or gives it 0 cycles: no estimate, as for a kernel whose blocks span
    several heads, whose copies libtpu counts as remote DMA), the row the kernels' sum
    ("cycles"), its time at ``clock_ghz`` ("estimated_us") and the sum over every op of the
    program, XLA's too ("all_op_cycles", each op's cycles times the equivalent ops it stands
    for), each op's cycles times its runs (``trips``, ``loop_trips``: a scanned layer's
    ops run once a layer; an unknown count leaves the sums None). With the row's "tile_flops"
    and the chip's ``peak_tflops``: the cycles its MXUs need at the least for them
    ("mxu_floor_cycles"), and the kernels' cycles raised to that floor ("bounded_cycles"): for
    tiles of 512 and more the profile's estimate falls below that floor (it seems not to count
    a loop inside a kernel's body by its trips), so only the bounded figure compares large
    tiles with small."""
    trips = trips or {}

    def cycles(names):  # of ops and the equivalent ops each stands for, over their runs
        runs = [trips.get(n, 1) for n in names]
        return None if None in runs else sum(
            profile[n]["cycles"] * profile[n]["equivalent"] * r for n, r in zip(names, runs))

    total = 0
    for k in row["kernels"]:
        # a profile names one of several equivalent ops (a kernel's calls in two loops)
        found = [i for i in k["instructions"] if profile.get(i, {}).get("cycles")]
        whole = sum(profile[i]["equivalent"] for i in found) == len(k["instructions"])
        known = None not in (trips.get(i, 1) for i in k["instructions"])
        k["cycles"] = cycles(found) if whole and known else None
        total = None if total is None or k["cycles"] is None else total + k["cycles"]
    row["cycles"] = total
    row["estimated_us"] = None if total is None else total / (clock_ghz * 1e3)
    if "tile_flops" in row and peak_tflops:
        row["mxu_floor_cycles"] = row["tile_flops"] / (peak_tflops * 1e3 / clock_ghz)
        row["bounded_cycles"] = None if total is None else max(total, row["mxu_floor_cycles"])
    row["all_op_cycles"] = cycles(list(profile))


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
    return int(found.group(1)) if found else ATTENTION_SHAPE["heads"]


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


if __name__ == "__main__":  # the child: python -m sparse_jax.bench.compiled_tpu PROGRAM TARGET
    _child(json.loads(sys.argv[1]), sys.argv[2])
