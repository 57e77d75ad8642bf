"""The GPUs compiled for and what their compiler printed, read (moved from
``sparse_jax.bench.compiled``, which re-exports every name): each target as the occupancy
calculator needs it, ptxas's registers and spills per kernel, the thunk sequence's grids,
threads and shared memory, the bytes XLA's own kernels read and write, and the occupancy rules
that give blocks per SM from a kernel's registers, threads and shared memory.

  Target, TARGETS         the H100 and the A100: SMs, registers, shared memory, HBM
  parse_ptxas(log)        per entry function: registers, stack, spilled bytes
  parse_thunks(text)      each kernel launch: grid, threads, dynamic shared memory
  xla_kernel_bytes(hlo)   XLA's own kernels (Pallas calls apart): how many, their bytes
  occupancy(...)          blocks per SM, occupancy and the bounding resource of one kernel
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU as the occupancy calculator needs it (NVIDIA's compute capability tables)."""
    name: str
    spec_file: str
    arch: str
    sms: int
    regs_per_sm: int = 65536
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    smem_per_sm: int = 233472  # bytes usable by blocks
    smem_reserved_per_block: int = 1024  # the runtime's per-block reservation (sm_80 and up)
    hbm_gb: float = 80.0
    hbm_gbps: float = 3352.0  # memory bandwidth, GB/s

    def config_text(self) -> str:
        with open(os.path.join(TARGETS_DIR, self.spec_file)) as f:
            return f.read()


TARGETS = {
    "h100": Target("NVIDIA H100 80GB HBM3 (SXM)", "h100_sxm.txtpb", "sm_90a", sms=132,
                   hbm_gb=84.94, hbm_gbps=3352.3),
    "a100": Target("NVIDIA A100-SXM4-80GB", "a100_sxm_80.txtpb", "sm_80", sms=108,
                   max_blocks_per_sm=32, smem_per_sm=167936, hbm_gb=85.90, hbm_gbps=2039.0),
}


_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\w+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                          r"loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_THUNK = re.compile(r"\b(\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+"
                    r"shared_memory: (\d+) bytes")


def parse_ptxas(log: str) -> dict[str, dict]:
    """Per entry function in ``ptxas -v`` output: arch, registers, stack frame and spilled
    bytes (stores + loads)."""
    out, current = {}, None
    for line in log.splitlines():
        if m := _PTXAS_ENTRY.search(line):
            current = out.setdefault(m.group(1), {"arch": m.group(2)})
        elif current is None:
            continue
        elif m := _PTXAS_SPILL.search(line):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        elif m := _PTXAS_USED.search(line):
            current["registers"] = int(m.group(1))
    return out


def parse_thunks(text: str) -> list[dict]:
    """Each kernel launch of an XLA thunk sequence: name, grid, threads and dynamic shared
    memory (a kernel inside a loop appears once)."""
    return [{"name": m.group(1), "grid": [int(m.group(i)) for i in (2, 3, 4)],
             "threads": int(m.group(5)) * int(m.group(6)) * int(m.group(7)),
             "shared_memory": int(m.group(8))} for m in _THUNK.finditer(text)]


_HLO_LINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_NOT_KERNELS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while",
                "conditional", "call", "after-all", "partition-id", "replica-id"}


def _shape_bytes(text: str) -> int:
    return sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims in _SHAPE.findall(text))


def xla_kernel_bytes(hlo: str) -> dict:
    """XLA's own kernels in the entry computation of compiled HLO text, Pallas calls apart:
    how many, and the bytes they read and write (each one's operands and outputs: an upper
    bound for fusions that read a slice)."""
    shapes, entry, in_entry = {}, [], False
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            in_entry = True
            continue
        if in_entry and line.startswith("}"):
            in_entry = False
        m = _HLO_LINE.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        shapes[name] = _shape_bytes(shape)
        if in_entry:
            entry.append((name, op, rest))
    count = total = 0
    for name, op, rest in entry:
        if op in _NOT_KERNELS or (op == "custom-call" and "triton" in rest):
            continue
        args = rest.split("), ")[0]
        count += 1
        total += shapes[name] + sum(shapes.get(a, 0) for a in re.findall(r"%([\w.\-]+)", args))
    return {"kernels": count, "bytes": total}


def occupancy(target: Target, registers: int, threads: int, shared_memory: int) -> dict:
    """Blocks of ``threads`` per SM with ``registers`` per thread and ``shared_memory`` bytes
    each (the CUDA occupancy calculator's rules: registers allocated per warp in units of 256,
    a per-block shared-memory reservation), the resident share of the SM's warps and the
    resource that bounds it."""
    warps = -(-threads // 32)
    per_warp = -(-registers * 32 // 256) * 256
    limits = {"registers": (target.regs_per_sm // per_warp) // warps if per_warp else 10**9,
              "shared memory": target.smem_per_sm // (shared_memory
                                                      + target.smem_reserved_per_block),
              "threads": target.max_warps_per_sm // warps,
              "blocks": target.max_blocks_per_sm}
    bound = min(limits, key=limits.get)
    blocks = limits[bound]
    return {"blocks_per_sm": blocks, "bound": bound,
            "occupancy": blocks * warps / target.max_warps_per_sm}
