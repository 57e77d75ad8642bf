"""Helpers shared by the benchmark scripts: timing after compile, one fresh process per case
with its peak memory, the matmul ceiling of the machine, and tables.

Each case runs in its own process so that its peak resident memory (RSS high-water mark) is its
own, and a case that runs out of memory is reported instead of taking the benchmark down.
"""

from __future__ import annotations

import json
import math
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


# ---------------------------------------------------------------------------------------------
# Training speed against a PyTorch eager twin (scripts/benchmark_training.py).

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINING_CONFIG = os.path.join(REPO, "configs", "bytes.py") + ":size=tiny,pattern=dense"


def training_case(seq_len: int, pattern: str, *, steps: int, data_path: str, stride: int
                  ) -> dict:
    """The flat config overrides of one benchmark model: configs/bytes.py's tiny size reshaped
    to nanoGPT's CPU recipe (4 layers, d=128, 4 heads, batch 12, AdamW at 1e-3), trained on
    `data_path` for `steps` steps with one validation pass at the end."""
    case = {"data.path": data_path, "model.seq_len": seq_len, "model.num_layers": 4,
            "model.d_model": 128, "model.num_heads": 4, "model.pattern": pattern,
            "model.stride": stride, "model.c": max(1, stride // 4), "batch_size": 12,
            "total_steps": steps, "optimizer.lr": 1e-3,
            "optimizer.warmup_steps": min(100, steps // 10),
            "optimizer.min_lr_ratio": 0.1, "log_every": max(1, steps // 10),
            "eval_every": steps, "checkpoint_every": steps, "eval_batches": 20}
    return case


def _training_config(overrides: dict):
    from sparse_jax import compare

    config = compare.load_config_file(TRAINING_CONFIG)
    config.update_from_flattened_dict(overrides)
    return config


def run_training_case(case: dict) -> dict:
    """One benchmark run, in this (fresh) process: {"impl": "jax"} trains with
    `sparse_jax.train.train` on `case["cpu_devices"]` CPU devices, {"impl": "torch"} the
    PyTorch eager twin (`sparse_jax.torch_reference`) on the same batches from the same initial
    parameters."""
    from sparse_jax import sharding

    if case["impl"] == "jax":
        sharding.set_cpu_devices(case["cpu_devices"])
    from flax import nnx

    from sparse_jax import data as data_lib, model as model_lib, train as train_lib

    config = _training_config(case["overrides"])
    cfg = train_lib.check_config(config)
    if case["impl"] == "torch":
        from sparse_jax import torch_reference

        dataset = data_lib.make_dataset(config.data, cfg.seq_len)
        init = nnx.to_pure_dict(nnx.state(model_lib.SparseTransformer(
            cfg, rngs=nnx.Rngs(config.seed)), nnx.Param))
        return torch_reference.train_and_evaluate(config, dataset, init)
    import jax

    start = time.perf_counter()
    result = train_lib.train(config, case["workdir"])
    with open(os.path.join(case["workdir"], "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    speeds = [r["steps_per_s"] for r in rows if r["split"] == "train"][1:]  # not the compile
    return {"train_s": time.perf_counter() - start, "steps_per_s": statistics.median(speeds),
            "train_bits": {r["step"]: r["bits"] for r in rows if r["split"] == "train"},
            "valid_bits": result["valid_bits"], "devices": len(jax.devices()),
            "jax": jax.__version__}


def compare_training(seq_lens, *, steps: list[int], data_path: str, patterns=("dense", "strided"),
                     cpu_devices: int = -1, output_dir: str | None = None, command: str = "",
                     log=print) -> dict:
    """For each context length (and its number of steps): the PyTorch eager twin (dense
    attention), then this project's trainer with each of `patterns` (stride ~ sqrt(n)), each in
    a fresh process, one after another. Writes results.md and results.json to `output_dir`;
    returns the JSON."""
    import shutil
    import tempfile

    rows = []
    for seq_len, num_steps in zip(seq_lens, steps, strict=True):
        stride = 2 ** round(math.log2(math.sqrt(seq_len)))
        cases = [("torch", "dense")] + [("jax", p) for p in patterns]
        for impl, pattern in cases:
            overrides = training_case(seq_len, pattern, steps=num_steps, data_path=data_path,
                                      stride=stride)
            workdir = tempfile.mkdtemp(prefix="sparse_jax_bench_")
            case = {"impl": impl, "overrides": overrides, "workdir": workdir,
                    "cpu_devices": cpu_devices}
            start = time.perf_counter()
            out = run_isolated(["-m", "sparse_jax.benchmarking", json.dumps(case)],
                               timeout_s=None)
            shutil.rmtree(workdir, ignore_errors=True)
            row = {"seq_len": seq_len, "impl": impl, "pattern": pattern,
                   "stride": None if pattern == "dense" else stride, "steps": num_steps,
                   "wall_s": time.perf_counter() - start, **out}
            if "error" not in out:
                row["tokens_per_s"] = out["steps_per_s"] * overrides["batch_size"] * seq_len
                torch_row = next((r for r in rows if r["seq_len"] == seq_len
                                  and r["impl"] == "torch"), row)
                if "steps_per_s" in torch_row:
                    row["vs_torch"] = out["steps_per_s"] / torch_row["steps_per_s"]
                row["final_train_bits"] = list(out["train_bits"].values())[-1]
            log(f"n={seq_len} {impl} {pattern}: " + (out.get("error") or (
                f"{out['steps_per_s']:.2f} steps/s ({row.get('vs_torch', 1):.2f}x torch), "
                f"valid {out['valid_bits']:.3f} bits/byte, {row['wall_s']:.0f} s in all")))
            rows.append(row)
    info = {"command": command, "machine": machine(),
            "data": data_path, "rows": rows}
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "results.json"), "w") as f:
            json.dump(info, f, indent=2)
        table = markdown_table(rows, [
            ("seq_len", "context"), ("impl", "implementation"), ("pattern", "attention"),
            ("stride", "stride"), ("steps", "steps"), ("steps_per_s", "steps/s"),
            ("tokens_per_s", "tokens/s"),
            ("vs_torch", "× PyTorch"), ("final_train_bits", "train bits"),
            ("valid_bits", "valid bits/byte"), ("wall_s", "wall s"), ("error", "error")])
        with open(os.path.join(output_dir, "results.md"), "w") as f:
            f.write(f"`{command}`\n\n{table}\n")
    return info


if __name__ == "__main__":
    print(json.dumps(run_training_case(json.loads(sys.argv[1]))), flush=True)
