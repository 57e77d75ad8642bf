"""Stage tests: tests/test_kernel.py with the kernels compiled for the device (not interpreted),
the dense reference checks at float32 and bfloat16. A run of no test is a failure, whatever
pytest's exit status: the H100 report's pytest-xdist workers all died at start-up and it read
"0 passed, 0 failed, ok"."""

from __future__ import annotations

import subprocess
import sys

from sparse_jax.bench.accelerator.common import REPO, emit

# Set from the first report (docs/benchmarks/h200): all 49 kernel tests took 140 s compiled in
# one process, so the full plan runs the ones that compile kernels (the host-only block-list
# tests run in CI), on the suite's pytest-xdist workers (pyproject.toml), which share the GPU
# (tests/conftest.py turns off JAX's preallocation).
CAP, DRY_CAP = 75, 40
WORDS = ("passed", "failed", "skipped", "error")


def plan(dry_run: bool) -> list[str]:
    """pytest's arguments."""
    if dry_run:  # collecting the file imports every module the GPU run needs
        return ["tests/test_kernel.py", "-k", "test_block_lists_skip_the_strided_pattern"]
    return ["tests/test_kernel.py", "-k", "matches_dense or log_sum_exp or "
            "implementation_choice or model_attention or triton"]


def run(plan: dict) -> dict:
    """pytest over the plan's selection; counts read from its -v lines (a cap keeps them)."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                             "--tb=line", "-o", "console_output_style=classic", *plan["tests"]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO)
    counts = dict.fromkeys(WORDS, 0)
    failed = []
    for line in proc.stdout:
        print(line, end="", file=sys.stderr, flush=True)  # the log keeps pytest's own words
        for word in WORDS:
            if f" {word.upper()}" in line and "::" in line:
                counts[word] += 1
                if word in ("failed", "error"):  # xdist puts "[gw0] [ 50%]" first
                    failed += [w for w in line.split() if "::" in w][:1]
                emit({"counts": counts, "failed": failed, "done": False, "note": note(counts)})
    proc.wait()
    result = {"counts": counts, "failed": failed, "done": True, "exit": proc.returncode,
              "note": note(counts)}
    if proc.returncode != 0:  # a collection error counts no test: the stage fails
        emit(result)
        what = " (no tests collected)" if proc.returncode == 5 else ""
        raise SystemExit(f"pytest exited with status {proc.returncode}{what} (see the log)")
    return result


def note(counts: dict) -> str:
    return ", ".join(f"{counts[w]} {w if w != 'error' else 'errors'}" for w in WORDS)


def check(result: dict, plan: dict) -> tuple[str, str] | None:
    counts = result.get("counts", {})
    ran = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0)
    if counts.get("failed") or counts.get("error"):
        return "failed", f"{counts.get('failed', 0) + counts.get('error', 0)} tests failed"
    if ran == 0:
        skipped = counts.get("skipped", 0)
        return "failed", "no test ran" + (f" ({skipped} skipped)" if skipped else "")
    if not result.get("done"):
        return "partial", "pytest did not finish"
    return None


def summary(report: dict) -> list[str]:
    return []  # the counts are the stage's note in the stage table
