"""Tools of the benchmarks: one fresh process per case with its peak memory, timing after
compile, interleaved timing of variants against their default (rounds of A, B, A, C, A, ...;
ratios as the median of per-round ratios, with their spread), the matmul ceiling of the machine,
a description of the machine, console lines and a progress bar over the cases, tables and a
plot.

Each case runs in its own process (`run_isolated`) so that its peak resident memory (RSS
high-water mark) is its own, and a case that runs out of memory is reported instead of taking
the benchmark down. The benchmarks themselves are the other modules of `sparse_jax.bench`; the
pattern study (`bench.pattern_study`) uses the same tools. Nothing here imports JAX at import
time: a case sets up its devices first.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import threading
import time

from tqdm import tqdm

from sparse_jax import stopping


def log_line(text: str) -> None:
    """A console line (stdout) that leaves a progress bar intact: tqdm clears and redraws it."""
    with tqdm.external_write_mode():
        print(text, flush=True)


def case_bar(total: int, desc: str) -> tqdm:
    """A progress bar with ETA over a benchmark's cases, on a terminal only (a log file gets the
    result lines alone); the rate is the average over the cases done, whatever their size."""
    return tqdm(total=total, desc=desc, unit="case", smoothing=0, leave=False,
                dynamic_ncols=True, disable=not sys.stderr.isatty())


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


def interleaved_order(anchor_of: dict[str, str | None], round_index: int = 0) -> list[str]:
    """The calls of one round of interleaved timing. ``anchor_of`` maps each name, in order,
    to its anchor (the default it is compared with; None for an anchor or a name compared with
    nothing). Each anchor runs first, then each of its variants followed by the anchor again
    (A, B, A, C, A, ...); names with no anchor run once. The variants are rotated by
    ``round_index``, so that none always runs first."""
    order = []
    for name, anchor in anchor_of.items():
        if anchor is not None:
            continue
        variants = [v for v, a in anchor_of.items() if a == name]
        if variants:
            shift = round_index % len(variants)
            order.append(name)
            for variant in variants[shift:] + variants[:shift]:
                order += [variant, name]
        else:
            order.append(name)
    return order


def time_interleaved(calls: dict, anchor_of: dict[str, str | None], rounds: int,
                     repeats: int = 1, clock=time.perf_counter, deadline: float | None = None,
                     now=time.time) -> list[list[tuple[str, float]]]:
    """Times ``calls`` (name: a function of no arguments that returns when its work is done)
    in ``rounds`` rounds of ``interleaved_order``: each round's list of (name, ms), a sample
    being the median of ``repeats`` calls in a row. Stops before a round that would start
    after ``deadline`` (a ``now()`` time), at least one round run if any may start."""
    out = []
    for r in range(rounds):
        if deadline is not None and now() > deadline and out:
            break
        samples = []
        for name in interleaved_order(anchor_of, r):
            times = []
            for _ in range(repeats):
                start = clock()
                calls[name]()
                times.append((clock() - start) * 1e3)
            samples.append((name, statistics.median(times)))
        out.append(samples)
    return out


def interleaved_stats(rounds: list[list[tuple[str, float]]],
                      anchor_of: dict[str, str | None]) -> dict[str, dict]:
    """Per name of ``time_interleaved``'s rounds: ``median_ms``, ``min_ms``, ``max_ms`` of its
    samples and ``rounds``; per variant with an anchor, its per-round ratios (its sample over
    the mean of the anchor's samples just before and after it in that round), ``ratio`` (their
    median), ``ratio_min``, ``ratio_max`` and ``within_noise``: whether the rounds disagree on
    which is faster (the ratios' range holds 1). An anchor's ``ratio_min`` and ``ratio_max``
    are those of its consecutive samples in a round (A over the A before it): its own noise."""
    samples, ratios = {}, {}
    for samples_of_round in rounds:
        for i, (name, ms) in enumerate(samples_of_round):
            samples.setdefault(name, []).append(ms)
            anchor = anchor_of.get(name)
            if anchor is None:
                if i >= 2 and any(n == name for n, _ in samples_of_round[:i]):
                    before = next(m for n, m in reversed(samples_of_round[:i]) if n == name)
                    ratios.setdefault(name, []).append(ms / before)
                continue
            around = [m for j in (i - 1, i + 1) if 0 <= j < len(samples_of_round)
                      for n, m in [samples_of_round[j]] if n == anchor]
            if around:
                ratios.setdefault(name, []).append(ms / statistics.mean(around))
    out = {}
    for name, values in samples.items():
        stats = {"median_ms": statistics.median(values), "min_ms": min(values),
                 "max_ms": max(values), "rounds": len(rounds)}
        per_round = ratios.get(name, [])
        if anchor_of.get(name) is not None and per_round:
            stats.update(ratio=statistics.median(per_round), ratio_min=min(per_round),
                         ratio_max=max(per_round), round_ratios=per_round,
                         within_noise=min(per_round) <= 1 <= max(per_round))
        elif per_round:  # an anchor: A over the A before it
            stats.update(ratio=1.0, ratio_min=min(per_round), ratio_max=max(per_round))
        out[name] = stats
    return out


def within_noise(ratios_a: list[float], ratios_b: list[float]) -> bool:
    """Whether two variants of one anchor, timed in the same rounds, are within noise of each
    other: their per-round ratios' quotients fall on both sides of 1."""
    quotients = [a / b for a, b in zip(ratios_a, ratios_b)]
    return bool(quotients) and min(quotients) <= 1 <= max(quotients)


def peak_rss_gb() -> float:
    """This process's resident-memory high-water mark in GB (10^9 bytes; Linux reports KiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024) / 1e9


def available_memory_gb() -> float:
    """Memory the kernel could give a new allocation now (``cli.available_memory``), in GB."""
    from sparse_jax import cli

    return (cli.available_memory() or 0) / 1e9


def matmul_size() -> int:
    """Side of the ceiling's square matmul: 4096 on a CPU, 8192 on an accelerator (4096 is too
    small to reach a GPU's peak)."""
    import jax

    return 4096 if jax.default_backend() == "cpu" else 8192


def matmul_gflops(size: int | None = None, repeats: int = 5, dtype: str = "float32") -> float:
    """GFLOP/s of one ``size x size`` ``jnp.dot`` in ``dtype`` (default side ``matmul_size()``):
    the practical compute ceiling."""
    import jax
    import jax.numpy as jnp

    size = size or matmul_size()
    a = jax.random.normal(jax.random.PRNGKey(0), (size, size), dtype)
    b = jax.random.normal(jax.random.PRNGKey(1), (size, size), dtype)
    timing = time_call(jax.jit(jnp.dot), a, b, repeats=repeats)
    return 2 * size**3 / (timing["median_ms"] / 1e3) / 1e9


def device_peak_memory_gb() -> float | None:
    """Peak memory of the first device in GB, where its runtime reports one (GPUs; not a CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 1e9


def _rss_of(pid: int) -> float:
    """The current RSS of process `pid` in GB (0 if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return 0.0


def run_isolated(argv: list[str], *, mem_limit_gb: float | None = None, env: dict | None = None,
                 timeout_s: float | None = 1800) -> dict:
    """Runs ``python argv...`` (a module: ``["-m", "sparse_jax.bench.attention", CASE_JSON]``)
    in a fresh process, which prints its result as a JSON object on a line of its own; returns
    the last such object. A process that fails returns the last object it printed (or {}) plus
    "error": "out of memory" when it was killed or XLA/Python ran out of memory, "out of memory
    (> X GB)" when its RSS passed ``mem_limit_gb`` (polled every 0.1 s, Linux only), "timed out
    after N s", or "exit CODE: last line of stderr". ``env`` adds to this process's
    environment. Interrupted (Ctrl-C, SIGTERM), it kills the process before it passes the
    interrupt on: none outlives the benchmark; a process ended by SIGINT or SIGTERM (Ctrl-C in
    a terminal reaches the whole group) raises `stopping.Stopped` here too, so that the
    benchmark stops rather than record the case as failed and go on."""
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
        proc.communicate()
        return {"error": f"timed out after {timeout_s:.0f} s"}
    except BaseException:  # Ctrl-C or SIGTERM (cli.Stopped): the case's process goes too
        proc.kill()
        proc.wait()
        raise
    watcher.join()
    stopped_by = {-s: s for s in stopping.SIGNALS} | {128 + s: s for s in stopping.SIGNALS}
    if proc.returncode in stopped_by and not killed.is_set():  # the case was stopped (Ctrl-C
        raise stopping.Stopped(stopped_by[proc.returncode])   # to the group): so is the rest
    printed = [line for line in out.splitlines() if line.startswith("{")]
    result = json.loads(printed[-1]) if printed else {}
    if killed.is_set():
        return {**result, "error": f"out of memory (> {mem_limit_gb:g} GB)"}
    if proc.returncode != 0:
        oom = proc.returncode in (-9, 137) or "RESOURCE_EXHAUSTED" in err or "MemoryError" in err
        return {**result, "error": "out of memory" if oom else
                f"exit {proc.returncode}: {error_line(err)[:200]}"}
    return result if printed else {"error": "the process printed no JSON result"}


# Lines a failed process prints after its error that say nothing of it (JAX's note on the
# frames it left out of a traceback, and its rule).
_NOT_THE_ERROR = re.compile(r"^(For simplicity, JAX has removed|-{5,}$|Set JAX_TRACEBACK_FILTER)")


def error_line(stderr: str) -> str:
    """The line of a failed process's stderr that says why: the exception's own line
    ("ValueError: ...") when there is one, else its last line that is not a note about the
    traceback."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()
             and not _NOT_THE_ERROR.match(line.strip())]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b:?", line):
            return line
    return lines[-1] if lines else "?"


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
            "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "python": platform.python_version()}


# Ratios against a baseline row (× PyTorch, × vs dense, time vs dense): one only against a row
# that was measured; a baseline that failed is "not measured" in the tables, and the script
# exits non-zero (`require_baselines`) unless told the baseline is optional.
NOT_MEASURED = "not measured"
OPTIONAL_FLAG = "--baseline_optional"


def ratio(value, baseline) -> float | None:
    """`value` / `baseline` when both were measured (finite numbers, the baseline > 0), else
    None: never a ratio against a run that did not happen."""
    measured = [isinstance(v, (int, float)) and math.isfinite(v) for v in (value, baseline)]
    return value / baseline if all(measured) and baseline > 0 else None


def require_baselines(missing: list[str], optional: bool) -> None:
    """ValueError (one line, exit 1 through `cli.run`) naming the baseline rows in `missing`
    (failed, or not run) unless `optional` (the script's --baseline_optional): the results are
    written first, their ratios to those rows shown as not measured."""
    if missing and not optional:
        raise ValueError(f"the baseline {', '.join(missing)} was not measured, so the ratios "
                         f"to it are shown as {NOT_MEASURED!r}; fix it (its error is in the "
                         f"table) or pass {OPTIONAL_FLAG} to accept results without it")


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


def write_results(output_dir: str, info, markdown: str, indent: int = 1) -> None:
    """Writes `info` as output_dir/results.json and `markdown` as output_dir/results.md."""
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(info, f, indent=indent)
    with open(os.path.join(output_dir, "results.md"), "w") as f:
        f.write(markdown)


def plot_time_vs_seq_len(rows: list[dict], path: str) -> None:
    """A log-log PNG of seconds (``median_ms``) against ``seq_len``: one line per pattern and
    pass (dashed: forward, solid: forward + backward)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for pattern in dict.fromkeys(r["pattern"] for r in rows):
        for pass_, style in [("fwd", "--"), ("fwdbwd", "-")]:
            pts = [(r["seq_len"], r["median_ms"] / 1e3) for r in rows
                   if r["pattern"] == pattern and r["pass"] == pass_ and "median_ms" in r]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", label=f"{pattern} {pass_}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("seconds (median of the best round)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
