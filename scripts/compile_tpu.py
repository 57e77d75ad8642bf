r"""Compiles the attention kernels for a TPU (v5e, v5p or v6e) on this CPU, with no TPU, and
tabulates per program the compile time, XLA's planned memory against the chip's HBM and its
flops, and per Mosaic kernel its VMEM.

  pip install --no-deps --target .tpu_tools -r requirements-tpu-compile.txt
  python scripts/compile_tpu.py --target=v5e --check          # the test suite's TPU check
  python scripts/compile_tpu.py --target=v5p --programs=attention16k

--programs takes groups (ci, attention16k, attention64k, all) or program names (--list prints
them); the default, ci, is the default strided and fixed kernels, fwd+bwd in bfloat16, at 8k.
--check exits 1 when a program does not compile (Mosaic refuses a kernel), has no Mosaic kernel
or does not fit the chip's HBM, naming each. Each program compiles in its own process with the
tools folder (--tools, default $SPARSE_JAX_TPU_TOOLS or .tpu_tools) on its path. Writes
results.md and results.json to --output_dir (a folder that holds results is refused without
--overwrite). These are the compiler's figures; no time is measured
(sparse_jax/bench/compiled_tpu.py says how they are read).
"""

import datetime
import json
import os
import sys

from absl import app, flags

from sparse_jax import cli
from sparse_jax.bench import compiled_tpu

_TARGET = flags.DEFINE_enum("target", "v5e", sorted(compiled_tpu.TARGETS), "The TPU compiled "
                            "for (one chip).")
_PROGRAMS = flags.DEFINE_list("programs", ["ci"], "Groups or program names (--list).")
_TOOLS = flags.DEFINE_string("tools", None, "Folder of requirements-tpu-compile.txt's packages "
                             "(default: $SPARSE_JAX_TPU_TOOLS, else .tpu_tools).")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.md and results.json go "
                                  "(default: print the table only).")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the results in --output_dir.")
_CHECK = flags.DEFINE_bool("check", False, "Exit 1 if a program fails to compile.")
_LIST = flags.DEFINE_bool("list", False, "Print the programs and their groups, then exit.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 600, "Seconds one program's compile may take.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _LIST.value:
        for p in compiled_tpu.programs():
            print(f"{p['group']:13} {p['name']}")
        return
    try:
        chosen = compiled_tpu.select(_PROGRAMS.value)
        tools = (_TOOLS.value or os.environ.get(compiled_tpu.TOOLS_ENV)
                 or compiled_tpu.DEFAULT_TOOLS)
        compiled_tpu.check_tools(tools)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    out = _OUTPUT_DIR.value
    if out and not _OVERWRITE.value and any(
            os.path.exists(os.path.join(out, f)) for f in ("results.md", "results.json")):
        raise app.UsageError(f"--output_dir={out} already holds results: give --overwrite to "
                             "replace them, or another folder")
    rows = []
    for i, program in enumerate(chosen, 1):
        row = compiled_tpu.compile_program(program, _TARGET.value, tools, _TIMEOUT.value)
        rows.append(row)
        print(f"[{i}/{len(chosen)}] {row['name']}: " + (row["error"] if "error" in row else (
            f"{row['compile_s']:.1f} s, {row['planned_gib']:.3f} GiB planned, "
            f"{len(row['kernels'])} Mosaic kernels, max VMEM "
            f"{row['max_vmem_bytes'] / 1024:.0f} KiB")), flush=True)
    date = datetime.date.today().isoformat()
    command = "python scripts/compile_tpu.py " + " ".join(sys.argv[1:])
    header = [f"# Deviceless compile for {compiled_tpu.TARGETS[_TARGET.value].name}", "",
              f"`{command.strip()}` on {date}, {compiled_tpu.versions(tools)}: compiler figures, "
              "not measurements on a TPU."]
    text = compiled_tpu.markdown(rows, _TARGET.value, header)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump({"target": _TARGET.value, "date": date, "command": command.strip(),
                       "rows": rows}, f, indent=1)
        with open(os.path.join(out, "results.md"), "w") as f:
            f.write(text)
        print(f"Wrote {out}/results.md and results.json")
    else:
        print(text)
    bad = compiled_tpu.problems(rows)
    if _CHECK.value and bad:
        print("TPU compile check failed: " + "; ".join(bad))
        sys.exit(1)


if __name__ == "__main__":
    cli.run(main)
