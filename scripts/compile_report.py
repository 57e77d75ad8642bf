r"""Compiles for an H100 (or an A100, or a TPU v5e, v5p or v6e) on this CPU, with no accelerator,
every program the accelerator report times, and tabulates what the compiler decided: per Triton
kernel its grid, threads, registers, spills, shared memory, blocks per SM, occupancy and its
bound, waves over the SMs, key tiles per program and estimated HBM bytes (per Mosaic kernel its
VMEM); per program XLA's planned memory against the device's and the compile time.

  pip install --no-deps --target .gpu_tools -r requirements-gpu-compile.txt
  python scripts/compile_report.py --output_dir=docs/benchmarks/compiled_h100
  python scripts/compile_report.py --target=a100 --programs=attention16k
  python scripts/compile_report.py --programs=ci --check     # the test suite's GPU check
  pip install --no-deps --target .tpu_tools -r requirements-tpu-compile.txt
  python scripts/compile_report.py --target=v5e --programs=ci --check   # its TPU check
  PYTHONPATH=examples python scripts/compile_report.py --seq_lens=16384 \
      --patterns='my_patterns:longformer(window=256;globals=64;block=128)@pallas'

--programs takes groups (GPU: attention16k, attention64k, attention8k, attention32k, onepass,
reference16k, gathered, preset, steps, study, million, ci, all; TPU: ci, attention16k, attention64k,
tiles8k, tiles16k, bands16k, splash8k, splash16k, splash64k, forward16k, steps, all) or program
names (--list prints them). --patterns names attention programs of one's own instead, as
benchmark_attention.py names them (built in or ``module:name(k=v;...)``, a pattern of one's own;
``@pallas`` for the kernels, options after it), fwd+bwd at each of --seq_lens (bf16, the report's
batch, heads and head size). On a v5p or v6e each TPU program also gets libtpu's static cycle
estimate per Mosaic kernel (--nocycles: not; a v5e's profiler aborts, so it has none), and the table
sets our kernels beside splash attention's on the same mask. The dense rows need cuDNN in the tools
folder too (`pip install --no-deps --target .gpu_tools nvidia-cudnn-cu12==9.28.0.42`, 1.1 GB);
without it they compile XLA's unfused attention and their row says it fell back (a dense@cudnn
program named alone in --programs is refused instead: it asks for cuDNN itself). --check exits 1
when a program does not compile or a Triton kernel spills registers (on a TPU: has no Mosaic kernel
or does not fit), naming each. Each program compiles in its own process with the tools folder
(--tools, default $SPARSE_JAX_GPU_TOOLS or .gpu_tools; for a TPU $SPARSE_JAX_TPU_TOOLS or
.tpu_tools) on its path. Writes results.md and results.json to --output_dir (a folder that holds
results is refused without --overwrite). These are the compiler's figures; no time is measured
(sparse_jax/bench/compiled.py and compiled_tpu.py say how they are read).
"""

import datetime
import json
import os
import sys

from absl import app, flags

from sparse_jax import cli
from sparse_jax.bench import compiled, compiled_tpu

_TARGET = flags.DEFINE_enum("target", "h100", [*compiled.TARGETS, *compiled_tpu.TARGETS],
                            "The GPU or TPU (one chip) compiled for.")
_PROGRAMS = flags.DEFINE_list("programs", None, "Groups or program names (--list; default: "
                               "all, or none with --patterns).")
_PATTERNS = flags.DEFINE_list("patterns", [], "Attention patterns to compile instead of (or "
                              "besides, with --programs) the report's programs, named as "
                              "benchmark_attention.py names them, e.g. strided:128@pallas:"
                              "onepass:s1 or my_patterns:longformer(window=256)@pallas.")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["16384"], "Lengths at which --patterns compile.")
_TOOLS = flags.DEFINE_string("tools", None, "Folder of requirements-gpu-compile.txt's packages, "
                             "or requirements-tpu-compile.txt's for a TPU (default: "
                             "$SPARSE_JAX_GPU_TOOLS or .gpu_tools; $SPARSE_JAX_TPU_TOOLS or "
                             ".tpu_tools).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.md and results.json go "
                                  "(default: print the table only).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the results in --output_dir.")
_CHECK = flags.DEFINE_bool("check", False, "Exit 1 if a program fails to compile or spills.")
_LIST = flags.DEFINE_bool("list", False, "Print the programs and their groups, then exit.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 600, "Seconds one program's compile may take (at "
                              "most a week).")
_CYCLES = flags.DEFINE_bool("cycles", None, "TPU: libtpu's static cycles per Mosaic kernel "
                            "(default: on for v5p and v6e; v5e's profiler aborts).")


def _compiler():
    """The module that knows the target's compiler, a GPU's (Triton, ptxas: ``compiled``) or a
    TPU's (Mosaic: ``compiled_tpu``), and the folder of its packages."""
    compiled_for = compiled if _TARGET.value in compiled.TARGETS else compiled_tpu
    return compiled_for, (_TOOLS.value or os.environ.get(compiled_for.TOOLS_ENV)
                          or compiled_for.DEFAULT_TOOLS)


def _chosen(compiled_for) -> list[dict]:
    """The programs of --programs (default all, or none beside --patterns), then one attention
    program per --patterns and --seq_lens; ValueError naming what is wrong."""
    names = _PROGRAMS.value if _PROGRAMS.value is not None else (
        [] if _PATTERNS.value else ["all"])
    chosen = compiled_for.select(names) if names else []
    lengths = cli.integers("seq_lens", _SEQ_LENS.value, high=1 << 20)
    chosen += compiled.pattern_programs(_PATTERNS.value, lengths, compiled_for.ATTENTION_SHAPE)
    if not chosen:
        raise ValueError("--programs and --patterns name nothing to compile")
    return chosen


def check(argv):
    """Every flag, before any program compiles or anything is written."""
    cli.no_arguments(argv)
    compiled_for, tools = _compiler()
    if _CYCLES.value is not None and compiled_for is compiled:
        raise app.UsageError("--cycles: static cycles come from a TPU's compiler (--target=v5p "
                             "or v6e)")
    cli.seconds("timeout_s", _TIMEOUT.value)  # a compile's time limit
    if _LIST.value:
        return
    try:
        chosen = _chosen(compiled_for)
        cli.input_dir("tools", tools, "the folder of the compilers' packages")
        compiled_for.check_tools(tools)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    named = [p["name"] for p in chosen if p["name"] in (_PROGRAMS.value or ())
             and str(p.get("pattern", "")).endswith("@cudnn")]
    if named and not os.path.isdir(os.path.join(tools, "nvidia", "cudnn")):
        raise app.UsageError(f"--programs: {named[0]} needs cuDNN in --tools={tools}: pip "
                             f"install --no-deps --target {tools} nvidia-cudnn-cu12==9.28.0.42 "
                             "(1.1 GB), or name another program (--list)")
    cli.output_dir("output_dir", _OUTPUT_DIR.value, ("results.md", "results.json"),
                   _OVERWRITE.value)


def main(argv):  # the flags checked by `check` first
    compiled_for, tools = _compiler()
    if _LIST.value:
        for p in compiled_for.programs():
            print(f"{p['group']:13} {p['name']}")
        return
    chosen = _chosen(compiled_for)
    options = {} if compiled_for is compiled else {"cycles": _CYCLES.value}
    rows = []
    for i, program in enumerate(chosen, 1):
        row = compiled_for.compile_program(program, _TARGET.value, tools, _TIMEOUT.value,
                                           **options)
        rows.append(row)
        print(f"[{i}/{len(chosen)}] {row['name']}: {compiled_for.progress(row)}", flush=True)
    date = datetime.date.today().isoformat()
    command = ("python scripts/compile_report.py " + " ".join(sys.argv[1:])).strip()
    header = [f"# Deviceless compile for {compiled_for.TARGETS[_TARGET.value].name}", "",
              f"`{command}` on {date}, {compiled_for.versions(tools)}: compiler figures, not "
              "measurements."]
    text = compiled_for.markdown(rows, _TARGET.value, header)
    out = _OUTPUT_DIR.value
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump({"target": _TARGET.value, "date": date, "command": command,
                       "rows": rows}, f, indent=1)
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write(text)
        print(f"Wrote {out}/results.md and results.json")
    else:
        print(text)
    bad = compiled_for.problems(rows)
    if _CHECK.value and bad:
        print("compile check failed: " + "; ".join(bad))
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main, check=check)
