"""The TPU chips compiled for and what their compiler wrote, read (moved from
``sparse_jax.bench.compiled_tpu``, which re-exports every name): each chip's topology, HBM,
clock and peak, the Mosaic kernels of compiled HLO text with their VMEM, the trip counts of its
loops, and libtpu's static profile, attached to a program's row as cycles.

  Target, TARGETS             v5e, v5p, v6e: topology, HBM, clock, bf16 peak, profiler or not

  parse_mosaic_kernels(hlo)   each Mosaic kernel: name, calls, VMEM
  loop_trips(hlo)             how many times each instruction inside a loop runs
  parse_static_profile(text)  libtpu's static profile: each op's cycles
  read_static_profile(dir)    the same, of every file libtpu wrote into a folder
  attach_cycles(row, ...)     a row's kernels' cycles, their sum, its time and MXU floor
"""

from __future__ import annotations

import dataclasses
import os
import re


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
