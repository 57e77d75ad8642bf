"""This project's trainer against a PyTorch eager twin of the same model
(scripts/benchmark_training.py).

`benchmark_training` runs, for each context length, the twin (`sparse_jax.bench.torch_twin`,
dense attention; in eager mode, and with `torch.compile` if asked) and then
`sparse_jax.train.train` with each attention pattern, every run in a fresh process
(`tools.run_isolated`). A run's process is
`python -m sparse_jax.bench.training CASE_JSON`; it prints the run's result as one JSON line.
Only the twin's runs import torch (`requirements-bench.txt`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

from sparse_jax.bench import tools
from sparse_jax.bench.tools import case_bar, log_line

TRAINING_CONFIG = "bytes.py:size=tiny,pattern=dense"  # a spec for configs.load
BASELINES = {"eager": "torch", "compile": "torch.compile"}  # the twin's modes, as rows name them


def training_overrides(seq_len: int, pattern: str, *, steps: int, data_path: str, stride: int
                       ) -> dict:
    """The flat config overrides of one benchmark model: configs/bytes.py's tiny size reshaped
    to nanoGPT's CPU recipe (4 layers, d=128, 4 heads, batch 12, AdamW at 1e-3), trained on
    `data_path` for `steps` steps with one validation pass at the end. ``pattern``: dense,
    strided or fixed, optionally ``@IMPL`` for the attention's implementation (``@native``: the
    CPU kernels, ``@xla``: the XLA path; default ``auto``, what the configs use: on a CPU the
    kernels where they build, dense attention included)."""
    pattern, _, attention = pattern.partition("@")
    return {"data.path": data_path, "model.seq_len": seq_len, "model.num_layers": 4,
            "model.d_model": 128, "model.num_heads": 4, "model.pattern": pattern,
            "model.attention": attention or "auto",
            "model.stride": stride, "model.c": max(1, stride // 4), "batch_size": 12,
            "total_steps": steps, "optimizer.lr": 1e-3,
            "optimizer.warmup_steps": min(100, steps // 10),
            "optimizer.min_lr_ratio": 0.1, "log_every": max(1, steps // 10),
            "eval_every": steps, "checkpoint_every": steps, "eval_batches": 20}


def run_training_case(case: dict) -> dict:
    """One benchmark run: {"impl": "jax"} trains with `sparse_jax.train.train` on
    `case["cpu_devices"]` CPU devices, {"impl": "torch"} the PyTorch eager twin
    (`sparse_jax.bench.torch_twin`) on the same batches from the same initial parameters,
    through `torch.compile` if case["compile"]."""
    from sparse_jax import sharding

    if case["impl"] == "jax":
        sharding.set_cpu_devices(case["cpu_devices"])
    from flax import nnx

    import configs
    from sparse_jax import train as train_lib
    from sparse_jax.data import datasets as data_lib
    from sparse_jax.model import transformer as model_lib
    from sparse_jax.run.config import check_config

    config = configs.load(TRAINING_CONFIG, case["overrides"])
    cfg = check_config(config)
    if case["impl"] == "torch":
        from sparse_jax.bench import torch_twin

        dataset = data_lib.make_dataset(config.data, cfg.seq_len)
        init = nnx.to_pure_dict(nnx.state(model_lib.SparseTransformer(
            cfg, rngs=nnx.Rngs(config.seed)), nnx.Param))
        return torch_twin.train_and_evaluate(config, dataset, init,
                                             compile=case.get("compile", False))
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


def check_arguments(patterns, baselines, data_path: str) -> None:
    """ValueError (one line naming the flag) for an unknown pattern or baseline, or a --data
    that is not a readable file: before any run starts."""
    unknown = sorted(set(baselines) - set(BASELINES))
    if unknown or not baselines:
        raise ValueError(f"--baselines: {', '.join(unknown) or 'none given'}; choose from "
                         f"{', '.join(BASELINES)}")
    from sparse_jax.attention import IMPLEMENTATIONS
    from sparse_jax.data import sources

    bad = [p for p in patterns if p.partition("@")[0] not in ("dense", "strided", "fixed")
           or p.partition("@")[2] not in ("", *IMPLEMENTATIONS)]
    if bad:
        raise ValueError(f"--patterns: {', '.join(bad)}; give dense, strided or fixed, each "
                         f"optionally @{'/@'.join(IMPLEMENTATIONS)}")
    if not data_path:
        raise ValueError("--data= is empty; the shipped corpus is data/kjv.html.gz")
    sources.require_file(data_path, "--data")


def benchmark_training(seq_lens, *, steps: list[int], data_path: str,
                       patterns=("dense", "strided"), baselines=("eager",), cpu_devices: int = -1,
                       output_dir: str | None = None, command: str = "", log=log_line) -> dict:
    """For each context length (and its number of steps): the PyTorch twin (dense attention) in
    each of `baselines` ("eager", "compile": `torch.compile`), then this project's trainer with
    each of `patterns` (stride ~ sqrt(n)), each in a fresh process, one after another. "×
    PyTorch" is against the first baseline, only where it was measured ("not measured" where it
    failed: `tools.ratio`; the JSON's baselines_not_measured names those rows). Writes
    results.md and results.json to `output_dir`; returns the JSON."""
    import shutil
    import tempfile

    check_arguments(patterns, baselines, data_path)
    rows = []
    cases = [(BASELINES[b], "dense") for b in baselines] + [("jax", p) for p in patterns]
    with case_bar(len(seq_lens) * len(cases), "training runs") as bar:
        for seq_len, num_steps in zip(seq_lens, steps, strict=True):
            stride = 2 ** round(math.log2(math.sqrt(seq_len)))
            for impl, pattern in cases:
                overrides = training_overrides(seq_len, pattern, steps=num_steps,
                                               data_path=data_path, stride=stride)
                workdir = tempfile.mkdtemp(prefix="sparse_jax_bench_")
                case = {"impl": impl.split(".")[0], "compile": impl == "torch.compile",
                        "overrides": overrides, "workdir": workdir, "cpu_devices": cpu_devices}
                start = time.perf_counter()
                try:  # the run's folder goes also when it is interrupted
                    out = tools.run_isolated(
                        ["-m", "sparse_jax.bench.training", json.dumps(case)], timeout_s=None)
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
                row = {"seq_len": seq_len, "impl": impl, "pattern": pattern,
                       "stride": None if overrides["model.pattern"] == "dense" else stride,
                       "steps": num_steps,
                       "wall_s": time.perf_counter() - start, **out}
                baseline = next((r for r in rows if r["seq_len"] == seq_len
                                 and r["impl"] == BASELINES[baselines[0]]), row)
                if "error" not in out:
                    row["tokens_per_s"] = out["steps_per_s"] * overrides["batch_size"] * seq_len
                    row["final_train_bits"] = list(out["train_bits"].values())[-1]
                # × PyTorch: only against the first baseline's row when it was measured
                row["vs_torch"] = tools.ratio(out.get("steps_per_s"), baseline.get("steps_per_s"))
                if "error" not in out and row["vs_torch"] is None:
                    row["vs_torch"] = tools.NOT_MEASURED
                vs = row["vs_torch"]
                log(f"n={seq_len} {impl} {pattern}: " + (out.get("error") or (
                    f"{out['steps_per_s']:.2f} steps/s ("
                    + (f"{vs:.2f}x torch" if isinstance(vs, float) else f"torch {vs}") + "), "
                    f"valid {out['valid_bits']:.3f} bits/byte, {row['wall_s']:.0f} s in all")))
                rows.append(row)
                bar.update()
    missing = sorted({f"{r['impl']} dense at n={r['seq_len']}" for r in rows
                      if r["impl"] == BASELINES[baselines[0]] and "steps_per_s" not in r}) \
        if baselines else []
    info = {"command": command, "machine": tools.machine(), "data": data_path,
            "rows": rows, "baselines_not_measured": missing}
    if output_dir:
        table = tools.markdown_table(rows, [
            ("seq_len", "context"), ("impl", "implementation"), ("pattern", "attention"),
            ("stride", "stride"), ("steps", "steps"), ("steps_per_s", "steps/s"),
            ("tokens_per_s", "tokens/s"),
            ("vs_torch", "× PyTorch"), ("final_train_bits", "train bits"),
            ("valid_bits", "valid bits/byte"), ("wall_s", "wall s"), ("error", "error")])
        tools.write_results(output_dir, info, f"`{command}`\n\n{table}\n", indent=2)
    return info


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m sparse_jax.bench.training CASE_JSON")
    print(json.dumps(run_training_case(json.loads(sys.argv[1]))), flush=True)
