"""Helpers shared by the benchmark scripts: timing after compile, one fresh process per case
with its peak memory, the matmul ceiling of the machine, and tables.

Each case runs in its own process so that its peak resident memory (RSS high-water mark) is its
own, and a case that runs out of memory is reported instead of taking the benchmark down.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time


def time_call(fn, *args, repeats: int = 5, warmup: int = 1) -> dict:
    """Compiles (first call) and times ``fn(*args)``; returns compile seconds and the median,
    min and max of ``repeats`` timed runs in milliseconds."""
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return {"compile_s": compile_s, "median_ms": statistics.median(times), "min_ms": min(times),
            "max_ms": max(times)}


def peak_rss_gb() -> float:
    """This process's resident-memory high-water mark in GB (Linux reports KiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9


def matmul_gflops(size: int = 4096, repeats: int = 5) -> float:
    """GFLOP/s of one float32 ``size x size`` ``jnp.dot``: the practical compute ceiling."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (size, size), jnp.float32)
    timing = time_call(jax.jit(jnp.dot), a, b, repeats=repeats)
    return 2 * size**3 / (timing["median_ms"] / 1e3) / 1e9


def _rss_of(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 0.0


def run_isolated(argv: list[str], *, mem_limit_gb: float | None = None, env: dict | None = None,
                 timeout_s: float = 1800) -> dict:
    """Runs ``python argv...`` in a fresh process, which must print one JSON object as its last
    stdout line; returns it. A process whose RSS passes ``mem_limit_gb`` (polled every 0.1 s,
    Linux only) is killed and reported as ``{"error": "out of memory (> X GB)"}``."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})
    killed = threading.Event()

    def watch():
        while proc.poll() is None:
            if mem_limit_gb and _rss_of(proc.pid) > mem_limit_gb:
                killed.set()
                proc.kill()
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return {"error": f"timed out after {timeout_s:.0f} s"}
    watcher.join()
    if killed.is_set():
        return {"error": f"out of memory (> {mem_limit_gb:g} GB)"}
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["?"])[-1]
        oom = proc.returncode in (-9, 137) or "RESOURCE_EXHAUSTED" in err or "MemoryError" in err
        return {"error": "out of memory" if oom else f"exit {proc.returncode}: {last[:200]}"}
    return json.loads(out.strip().splitlines()[-1])


def machine() -> dict:
    """What the numbers were measured on."""
    import jax

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__,
            "backend": jax.default_backend(), "python": platform.python_version()}


def markdown_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """``columns``: (key, header) pairs; floats get 3 significant digits, missing cells '—'."""
    def cell(value):
        if value is None:
            return "—"
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(h for _, h in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)
