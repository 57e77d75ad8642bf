"""What the stages share: the chips' peaks, result lines, the repository's scripts as children,
and the one rule that a stage with an unmeasured row is not "ok"."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))))
CODE_CORPUS = "data/cpython_lib.py.gz"

# Dense bfloat16 matmul peaks from the vendors' datasheets (TFLOP/s, no sparsity), by the start
# of jax's device_kind; the report also measures a large matmul, since a chip's clocks and
# power limit decide what is reachable.
BF16_PEAK_TFLOPS = (("NVIDIA H200", 989.0), ("NVIDIA H100", 989.0), ("NVIDIA GH200", 989.0),
                    ("NVIDIA B200", 2250.0), ("NVIDIA A100", 312.0), ("NVIDIA L4", 121.0),
                    ("NVIDIA A10", 125.0), ("TPU v6", 918.0), ("TPU v5p", 459.0),
                    ("TPU v5", 197.0), ("TPU v4", 275.0))

TIME_UP = "not run: stage time up"  # a planned row the stage's cap left out


def peak_tflops(device_kind: str) -> float | None:
    """The datasheet's dense bf16 peak of a chip, or None if it is not in the table."""
    for prefix, tflops in BF16_PEAK_TFLOPS:
        if device_kind.startswith(prefix):
            return tflops
    return None


def emit(result: dict) -> None:
    """A stage's results so far, as one JSON line on stdout (the driver keeps the last)."""
    print(json.dumps(result), flush=True)


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text}"[:300]


def attention_flops(batch, heads, n, keys_per_query, head_dim) -> float:
    """Useful FLOPs of forward + backward: 4·B·H·n·|S|·d forward, 2.5× that in all."""
    return 2.5 * 4 * batch * heads * n * keys_per_query * head_dim


def rows_verdict(rows: list, label) -> tuple[str, str] | None:
    """("partial" | "failed", why) when rows of a stage's table carry an "error" (a failure, or
    `TIME_UP`), None when every row was measured. `label(row)` names a row."""
    bad = [r for r in rows if "error" in r]
    if not rows:
        return "failed", "no row measured"
    if not bad:
        return None
    first = bad[0]
    return ("failed" if len(bad) == len(rows) else "partial",
            f"{len(bad)} of {len(rows)} rows not measured; first: {label(first)}: "
            f"{first['error'][:120]}")


def run_script(command: list[str], timeout: float, stop_gently: bool = False) -> int | str:
    """Runs a script of the repo, its output into this stage's log; exit status or how it was
    stopped. With `stop_gently` a run past `timeout` gets SIGTERM (training saves a checkpoint
    and stops), and SIGKILL 20 s later. It stays in the stage's process group, so the driver's
    kill of the stage reaches it."""
    proc = subprocess.Popen(command, cwd=REPO, stdout=sys.stderr, stderr=sys.stderr)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        if stop_gently:
            proc.terminate()
            try:
                proc.wait(timeout=20)
                return f"stopped by SIGTERM at its {timeout:.0f} s cap"
            except subprocess.TimeoutExpired:
                pass
        proc.kill()
        proc.wait()
        return f"killed at its {timeout:.0f} s cap"


def fmt(value, spec=".3g"):
    if value is None:
        return "—"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)
