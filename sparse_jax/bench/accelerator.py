"""The accelerator report (scripts/accelerator_report.py): everything a borrowed GPU (or TPU) can
show about this project, measured by one command in about 8 minutes.

  run_report      the driver: each stage in its own process with its own time cap, a stage that
                  fails or hangs costs one line and the rest go on; writes the report folder
  run_stage       one stage: `python -m sparse_jax.bench.accelerator STAGE PLAN_JSON` prints
                  its results as JSON lines (the last one wins; partial results survive a cap)
  plan_for        the sizes of every stage: the real ones, or toy ones for `--dry_run`
  flex_mask_mod   a pattern's mask as a FlexAttention ``mask_mod`` (the same rule as the
                  Pallas kernel's block lists: ``kernel.mask_rule``)

The stages, in order:

  env         device, driver, CUDA, jax/jaxlib/flax/torch/triton versions, the chip's bf16
              peak and a measured bf16 matmul
  tests       tests/test_kernel.py with the kernels compiled (not interpreted): the dense
              reference checks at float32 and bfloat16
  attention   forward + backward, bfloat16, B=1 H=8 d=64: strided and fixed through XLA and
              Pallas against cuDNN's fused dense attention, at 16k, 8k, 32k then 64k, then
              other kernel tiles at 16k
  flex        the same patterns in PyTorch FlexAttention compiled with the same block mask, and
              PyTorch's fused dense attention (SDPA)
  train_step  a training step (loss, gradients, AdamW) of the paper's enwik8 model at 16,384
              bytes, batch 2: fixed through XLA and Pallas, and dense (cuDNN); also the one-GPU
              preset's step, which sets how many steps the next stage can train
  preset      configs/bytes.py:size=gpu trained for ~3 minutes on the shipped code corpus with
              the faster implementation of the last stage (scripts/train.py), test bits with
              the byte classes (scripts/evaluate.py), and a 1,000-byte sample (scripts/sample.py)

Nothing here imports JAX or torch before a stage has started in its own process.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time

STAGES = ("env", "tests", "attention", "flex", "train_step", "preset")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CODE_CORPUS = "data/cpython_lib.py.gz"

# Dense bfloat16 matmul peaks from the vendors' datasheets (TFLOP/s, no sparsity), by the start
# of jax's device_kind; the report also measures a large matmul, since a chip's clocks and
# power limit decide what is reachable.
BF16_PEAK_TFLOPS = (("NVIDIA H200", 989.0), ("NVIDIA H100", 989.0), ("NVIDIA GH200", 989.0),
                    ("NVIDIA B200", 2250.0), ("NVIDIA A100", 312.0), ("NVIDIA L4", 121.0),
                    ("NVIDIA A10", 125.0), ("TPU v6", 918.0), ("TPU v5p", 459.0),
                    ("TPU v5", 197.0), ("TPU v4", 275.0))

# Seconds each stage may take (full plan); the sum is the 8 minutes the command promises. Set
# from the first report (docs/benchmarks/h200): on an H200 every stage but tests and flex ends
# well inside its cap; all 49 kernel tests took 140 s compiled, so the full plan runs the ones
# that compile kernels (the host-only block-list tests run in CI); flex's compilations took
# ~80 s on a fresh machine. `--caps=tests=150` (scripts/accelerator_report.py) overrides.
CAPS = {"env": 15, "tests": 90, "attention": 70, "flex": 70, "train_step": 85, "preset": 150}
DRY_CAPS = {"env": 20, "tests": 40, "attention": 40, "flex": 30, "train_step": 40, "preset": 90}


def peak_tflops(device_kind: str) -> float | None:
    """The datasheet's dense bf16 peak of a chip, or None if it is not in the table."""
    for prefix, tflops in BF16_PEAK_TFLOPS:
        if device_kind.startswith(prefix):
            return tflops
    return None


# ---------------------------------------------------------------------------------------------
# What each stage runs.


def plan_for(dry_run: bool) -> dict:
    """Every stage's sizes. The real plan targets one GPU; the dry run is the same code at toy
    sizes on a CPU (the Pallas kernels in interpret mode, FlexAttention uncompiled)."""
    if dry_run:
        return {
            "dry_run": True,
            # collecting the file imports every module the GPU run needs
            "tests": ["tests/test_kernel.py", "-k", "test_block_lists_skip_the_strided_pattern"],
            "attention": {"seq_lens": [256], "batch": 1, "heads": 2, "head_dim": 16,
                          "repeats": 2, "patterns": ["dense@xla", "strided:16@xla",
                                                     "strided:16@pallas:16x16",
                                                     "fixed:16:4@xla"],
                          "tiles": {"seq_len": 128, "patterns": ["fixed:16:4@pallas:16x32"]}},
            "flex": {"seq_lens": [128], "compile": False},  # forward only: no CPU backward
            "train_step": {"cases": [
                {"name": "tiny strided@xla", "batch_size": 2, "model": dict(
                    seq_len=64, num_layers=1, d_model=32, num_heads=2, pattern="strided",
                    stride=8, c=2, attention="xla")}], "steps": 2},
            "preset": {"config": "configs/bytes.py:size=tiny", "train_seconds": 10,
                       "default_steps": 4, "max_steps": 4, "eval_batches": 2,
                       "data_bytes": 40_000, "prompt_bytes": 64, "sample_bytes": 16,
                       "preset_cases": ["tiny strided@xla"]},
        }
    preset_model = dict(seq_len=4096, num_layers=8, d_model=512, num_heads=8,
                        pattern="strided", stride=64, rotary=True, dtype="bfloat16")
    paper = dict(seq_len=16384, num_layers=30, d_model=512, num_heads=8, pattern="fixed",
                 stride=128, c=32, remat="full", scan_layers=True, dtype="bfloat16")
    return {
        "dry_run": False,
        "tests": ["tests/test_kernel.py", "-k", "matches_dense or log_sum_exp or "
                  "implementation_choice or model_attention or triton"],
        "attention": {"seq_lens": [16384, 8192, 32768, 65536], "batch": 1, "heads": 8,
                      "head_dim": 64, "repeats": 10,
                      "patterns": ["dense@cudnn", "strided:128@xla", "strided:128@pallas",
                                   "fixed:128:32@xla", "fixed:128:32@pallas"],
                      # after every length: other kernel tiles at 16k (the first report ran
                      # 64 x 64 only; strided reached 2.3% of the bf16 peak there)
                      "tiles": {"seq_len": 16384, "patterns": [
                          "strided:128@pallas:128x64", "strided:128@pallas:128x128",
                          "fixed:128:32@pallas:128x64", "fixed:128:32@pallas:128x128"]}},
        "flex": {"seq_lens": [16384, 8192, 32768, 65536], "compile": True},
        "train_step": {"cases": [
            {"name": "preset strided@pallas", "batch_size": 16,
             "model": {**preset_model, "attention": "pallas"}},
            {"name": "preset strided@xla", "batch_size": 16,
             "model": {**preset_model, "attention": "xla"}},
            {"name": "paper 16k fixed@pallas", "batch_size": 2,
             "model": {**paper, "attention": "pallas"}},
            {"name": "paper 16k fixed@xla", "batch_size": 2,
             "model": {**paper, "attention": "xla"}},
            {"name": "paper 16k dense (cuDNN)", "batch_size": 2,
             "model": {**paper, "pattern": "dense", "attention": "pallas"}}], "steps": 5},
        "preset": {"config": "configs/bytes.py:size=gpu", "train_seconds": 90,
                   "default_steps": 1500, "max_steps": 20000, "eval_batches": -1,
                   "data_bytes": None,
                   "prompt_bytes": 512, "sample_bytes": 1000,
                   "preset_cases": ["preset strided@pallas", "preset strided@xla"]},
    }


def _emit(result: dict) -> None:
    """A stage's results so far, as one JSON line (the driver keeps the last)."""
    print(json.dumps(result), flush=True)


def _stage_env(plan: dict) -> dict:
    import platform

    import jax

    from sparse_jax.bench import tools

    versions = {"python": platform.python_version(), "jax": jax.__version__}
    try:  # the first report: a carried flax older than the machine's jax failed here
        from flax import nnx  # noqa: F401
        flax_ok = "ok"
    except Exception as e:  # noqa: BLE001
        flax_ok = _one_line(e)
    for name in ("jaxlib", "flax", "optax", "orbax.checkpoint", "numpy", "torch", "triton",
                 "ml_collections", "tensorboardX"):
        try:
            module = __import__(name, fromlist=["__version__"])
            versions[name] = getattr(module, "__version__", "?")
        except Exception as e:  # noqa: BLE001  a missing package is a fact to report
            versions[name] = f"missing ({type(e).__name__})"
    device = jax.devices()[0]
    out = {"backend": jax.default_backend(), "device_kind": device.device_kind,
           "flax_nnx_import": flax_ok,
           "device_count": jax.device_count(), "versions": versions,
           "module_paths": {name: os.path.dirname(__import__(name).__file__)
                            for name in ("jax", "flax") if name in sys.modules}}
    peak = peak_tflops(device.device_kind)
    out["bf16_peak_tflops"] = peak
    try:
        info = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                               "clocks.max.sm,power.limit", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
        out["nvidia_smi"] = info.stdout.strip()
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=10)
        cuda = [w for line in header.stdout.splitlines() if "CUDA Version" in line
                for w in [line.split("CUDA Version:")[1].split()[0]]]
        out["cuda_driver_version"] = cuda[0] if cuda else None
    except (OSError, subprocess.SubprocessError, IndexError):
        out["nvidia_smi"] = None
    try:
        out["jax_environment"] = jax.print_environment_info(return_string=True)
    except Exception as e:  # noqa: BLE001
        out["jax_environment"] = f"unavailable: {e}"
    _emit(out)
    size = 8192 if jax.default_backend() != "cpu" else 1024
    out["matmul_bf16_tflops"] = tools.matmul_gflops(size, dtype="bfloat16") / 1e3
    out["matmul_size"] = size
    out["memory_stats"] = {k: v for k, v in (device.memory_stats() or {}).items()
                           if k in ("bytes_limit", "peak_bytes_in_use")}
    return out


def _stage_tests(plan: dict) -> dict:
    """pytest over the plan's selection; counts read from its -v lines (a cap keeps them)."""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                             "--tb=line", "-o", "console_output_style=classic", *plan["tests"]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    failed = []
    for line in proc.stdout:
        print(line, end="", file=sys.stderr, flush=True)  # the log keeps pytest's own words
        for word in counts:
            if f" {word.upper()}" in line and "::" in line:
                counts[word] += 1
                if word in ("failed", "error"):
                    failed.append(line.split(" ")[0])
                _emit({"counts": counts, "failed": failed, "done": False})
    proc.wait()
    result = {"counts": counts, "failed": failed, "done": True, "exit": proc.returncode}
    if proc.returncode != 0:  # a collection error counts no test: the stage fails
        _emit(result)
        raise SystemExit(f"pytest exited with status {proc.returncode} (see the log)")
    return result


def _attention_flops(batch, heads, n, keys_per_query, head_dim) -> float:
    """Useful FLOPs of forward + backward: 4·B·H·n·|S|·d forward, 2.5× that in all."""
    return 2.5 * 4 * batch * heads * n * keys_per_query * head_dim


def _stage_attention(plan: dict) -> dict:
    import jax
    import jax.numpy as jnp

    from sparse_jax.attention import sparse_attention
    from sparse_jax.bench import tools
    from sparse_jax.bench.attention import parse_pattern

    p = plan["attention"]
    peak = peak_tflops(jax.devices()[0].device_kind)
    rows = []
    tiles = p.get("tiles")
    cases = [(n, pattern) for n in p["seq_lens"] for pattern in p["patterns"]] + (
        [(tiles["seq_len"], pattern) for pattern in tiles["patterns"]] if tiles else [])
    for n, pattern in cases:
        if time.time() > plan["deadline"] - 5:
            rows.append({"pattern": pattern, "seq_len": n, "error": "not run: stage time up"})
            continue
        row = {"pattern": pattern, "seq_len": n}
        try:
            spec, implementation, sizes = parse_pattern(pattern, n)
            shape = (p["batch"], n, p["heads"], p["head_dim"])
            q, k, v = (jax.random.normal(key, shape, jnp.bfloat16)
                       for key in jax.random.split(jax.random.PRNGKey(0), 3))
            if spec.kind == "dense":
                def attend(q, k, v, implementation=implementation):
                    return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                        implementation=implementation)
            else:
                def attend(q, k, v, spec=spec, implementation=implementation, sizes=sizes):
                    return sparse_attention(q, k, v, spec, implementation, sizes)
            fn = jax.jit(jax.grad(lambda q, k, v, f=attend: f(q, k, v).astype(
                jnp.float32).sum(), argnums=(0, 1, 2)))
            start = time.perf_counter()
            compiled = fn.lower(q, k, v).compile()
            row["compile_s"] = time.perf_counter() - start
            memory = compiled.memory_analysis()
            row["planned_gb"] = (memory.temp_size_in_bytes + memory.argument_size_in_bytes
                                 + memory.output_size_in_bytes) / 1e9
            row.update(tools.time_call(compiled, q, k, v, repeats=p["repeats"]))
            keys = spec.mean_keys(n)
            tflops = _attention_flops(p["batch"], p["heads"], n, keys, p["head_dim"]) / (
                row["median_ms"] / 1e3) / 1e12
            row.update(keys_per_query=keys, tflops=tflops,
                       of_peak=tflops / peak if peak else None,
                       device_peak_gb=tools.device_peak_memory_gb())
        except Exception as e:  # noqa: BLE001  one line, and the next case runs
            row["error"] = _one_line(e)
        rows.append(row)
        _emit({"rows": rows})
    return {"rows": rows}


def flex_mask_mod(spec):
    """``spec``'s mask as FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``."""
    from sparse_jax import kernel

    rule = kernel.mask_rule(spec)
    return lambda b, h, q_idx, kv_idx: rule(q_idx, kv_idx)


def _stage_flex(plan: dict) -> dict:
    """FlexAttention (torch.compile) with each pattern's block mask, and SDPA's causal dense."""
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed (pip install -r requirements-bench.txt)"}
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from sparse_jax.bench.attention import parse_pattern

    p, a = plan["flex"], plan["attention"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    flex = torch.compile(flex_attention, dynamic=False) if p["compile"] else flex_attention
    peak = None
    if device == "cuda":
        peak = peak_tflops(torch.cuda.get_device_name())
    patterns = [name.split("@")[0] for name in a["patterns"] if not name.startswith("dense")]
    cases = [("dense", "sdpa")] + [(name, "flex") for name in dict.fromkeys(patterns)]
    rows = []

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for n in p["seq_lens"]:
        for name, impl in cases:
            if time.time() > plan["deadline"] - 5:
                rows.append({"pattern": f"{name}@{impl}", "seq_len": n,
                             "error": "not run: stage time up"})
                continue
            row = {"pattern": f"{name}@{impl}", "seq_len": n}
            try:
                spec = parse_pattern(name, n)[0]
                shape = (a["batch"], a["heads"], n, a["head_dim"])
                generator = torch.Generator(device=device).manual_seed(0)
                backward = device != "cpu"  # FlexAttention has no backward on a CPU
                row["pass"] = "fwdbwd" if backward else "fwd"
                q, k, v = (torch.randn(shape, generator=generator, device=device,
                                       dtype=torch.bfloat16, requires_grad=backward)
                           for _ in range(3))
                if impl == "sdpa":
                    def step(q=q, k=k, v=v, backward=backward):
                        out = torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, is_causal=True).float().sum()
                        if backward:
                            out.backward()
                else:
                    start = time.perf_counter()
                    mask = create_block_mask(flex_mask_mod(spec), None, None, n, n,
                                             device=device)
                    row["block_mask_s"] = time.perf_counter() - start

                    def step(q=q, k=k, v=v, backward=backward, mask=mask):
                        out = flex(q, k, v, block_mask=mask).float().sum()
                        if backward:
                            out.backward()
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                step()
                sync()
                row["compile_s"] = time.perf_counter() - start
                times = []
                for _ in range(a["repeats"]):
                    start = time.perf_counter()
                    step()
                    sync()
                    times.append((time.perf_counter() - start) * 1e3)
                times.sort()
                row["median_ms"] = times[len(times) // 2]
                keys = spec.mean_keys(n)
                tflops = _attention_flops(a["batch"], a["heads"], n, keys, a["head_dim"]) / (
                    row["median_ms"] / 1e3) / 1e12 / (1 if backward else 2.5)
                row.update(keys_per_query=keys, tflops=tflops,
                           of_peak=tflops / peak if peak else None,
                           device_peak_gb=(torch.cuda.max_memory_allocated() / 1e9
                                           if device == "cuda" else None))
            except Exception as e:  # noqa: BLE001
                row["error"] = _one_line(e)
            rows.append(row)
            _emit({"rows": rows, "torch": torch.__version__})
    return {"rows": rows, "torch": torch.__version__}


def _stage_train_step(plan: dict) -> dict:
    import jax

    from sparse_jax import sizing
    from sparse_jax.bench.model import run_model_case
    from sparse_jax.model import ModelConfig

    p = plan["train_step"]
    peak = peak_tflops(jax.devices()[0].device_kind)
    rows = []
    for case in p["cases"]:
        if time.time() > plan["deadline"] - 5:
            rows.append({"name": case["name"], "error": "not run: stage time up"})
            continue
        row = {"name": case["name"], "batch_size": case["batch_size"], "model": case["model"]}
        try:
            result = run_model_case({"kind": "step", "model": case["model"],
                                     "batch_size": case["batch_size"], "steps": p["steps"],
                                     "update": True})
            cfg = ModelConfig(**case["model"])
            info = sizing.describe(cfg, case["batch_size"])
            step_s = result["median_step_s"]
            row.update(step_s=step_s, compile_s=result["compile_s"],
                       planned_gb=result["xla_temp_gib"] * 2**30 / 1e9,
                       device_peak_gb=result.get("device_peak_gb"),
                       tokens_per_s=case["batch_size"] * cfg.seq_len / step_s,
                       model_tflops=info["flops_per_step"] / step_s / 1e12,
                       params=info.get("params"))
            row["mfu"] = row["model_tflops"] / peak if peak else None
        except (Exception, SystemExit) as e:  # noqa: BLE001  run_model_case may skip (exit)
            row["error"] = _one_line(e)
        rows.append(row)
        _emit({"rows": rows})
    return {"rows": rows}


def _stage_preset(plan: dict) -> dict:
    """Trains the preset for the planned seconds, then test bits and a sample."""
    p = plan["preset"]
    workdir = plan["workdir"]
    steps, implementation = p["default_steps"], "xla"
    timed = [r for r in plan.get("train_step_rows", [])
             if r.get("name") in p["preset_cases"] and "step_s" in r]
    if timed:  # the faster implementation, and as many steps as its step time allows
        best = min(timed, key=lambda r: r["step_s"])
        implementation = best["name"].rsplit("@", 1)[1]
        steps = int(p["train_seconds"] / best["step_s"])
    steps = max(2, min(steps, p["max_steps"]))
    data_path = CODE_CORPUS
    if p["data_bytes"]:  # the dry run: the corpus's first bytes, so that every pass is short
        from sparse_jax import sources

        data_path = os.path.join(os.path.dirname(workdir), "code_head.py")
        with open(data_path, "wb") as f:
            f.write(bytes(sources.load_bytes(os.path.join(REPO, CODE_CORPUS))[:p["data_bytes"]]))
    overrides = {"data.path": data_path, "total_steps": steps,
                 "model.attention": implementation,
                 "optimizer.warmup_steps": max(1, min(300, steps // 10)),
                 "log_every": max(1, steps // 20), "eval_every": steps,
                 "checkpoint_every": steps, "eval_batches": p["eval_batches"]}
    out = {"config": p["config"], "steps": steps, "attention": implementation,
           "overrides": overrides}
    _emit(out)
    command = [sys.executable, "scripts/train.py", f"--config={p['config']}",
               f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items())]
    out["train_command"] = " ".join(["python", *command[1:]])
    start = time.time()
    budget = plan["deadline"] - start
    result = _run(command, timeout=max(10, budget - 35), stop_gently=True)
    out["train_wall_s"] = time.time() - start
    out["train_exit"] = result
    metrics = []
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            metrics = [json.loads(line) for line in f if line.strip()]
    train_rows = [m for m in metrics if m.get("split") == "train"]
    valid_rows = [m for m in metrics if m.get("split") == "valid"]
    if train_rows:  # the median window after the first (which holds the compilation)
        speeds = [m["tokens_per_s"] for m in train_rows[1:]] or [train_rows[0]["tokens_per_s"]]
        out["tokens_per_s"] = sorted(speeds)[len(speeds) // 2]
        out["train_bits"] = train_rows[-1]["bits"]
        out["steps_done"] = train_rows[-1]["step"]
    if valid_rows:
        out["valid_bits"] = valid_rows[-1]["bits"]
        out["steps_done"] = valid_rows[-1]["step"]
    _emit(out)
    if not glob.glob(os.path.join(workdir, "checkpoints", "*")):
        return out
    result = _run([sys.executable, "scripts/evaluate.py", f"--workdir={workdir}",
                   "--split=test"], timeout=max(10, plan["deadline"] - time.time() - 15))
    out["evaluate_exit"] = result
    for path in glob.glob(os.path.join(workdir, "eval", "test_*.json")):
        with open(path) as f:
            evaluation = json.load(f)
        out["test_bits"] = evaluation["bits"]
        out["test_classes"] = evaluation.get("copy_classes", evaluation.get("classes"))
    _emit(out)
    prompt_path = os.path.join(workdir, "prompt.txt")
    with open(prompt_path, "wb") as f:
        f.write(_test_prompt(p["prompt_bytes"]))
    sample_path = os.path.join(workdir, "sample.txt")
    result = _run([sys.executable, "scripts/sample.py", f"--workdir={workdir}",
                   "--num_samples=1", f"--length={p['sample_bytes']}", "--temperature=0.8",
                   f"--prompt_file={prompt_path}", f"--output={sample_path}"],
                  timeout=max(5, plan["deadline"] - time.time() - 2))
    out["sample_exit"] = result
    if os.path.exists(sample_path):
        out["sample_path"] = sample_path
    return out


def _test_prompt(size: int) -> bytes:
    """``size`` bytes of the code corpus's test part, starting at a line: the start of the
    test part's second file, so the prompt is code the model never trained on."""
    from sparse_jax import sources

    data = sources.load_bytes(os.path.join(REPO, CODE_CORPUS))
    test = bytes(data[int(len(data) * 0.95):int(len(data) * 0.95) + 200_000])
    marker = test.find(b"\n# ==== Lib/", 1)
    return test[marker + 1:marker + 1 + size] if marker >= 0 else test[:size]


def _run(command: list[str], timeout: float, stop_gently: bool = False) -> int | str:
    """Runs a script of the repo, its output into this stage's log; exit status or 'timed out'.
    With `stop_gently` a run past `timeout` gets SIGTERM (training saves a checkpoint and
    stops), and SIGKILL 20 s later."""
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


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text}"[:300]


def run_stage(name: str, plan: dict) -> dict:
    """One stage in this process (see the module docstring)."""
    if plan.get("dry_run"):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return {"env": _stage_env, "tests": _stage_tests, "attention": _stage_attention,
            "flex": _stage_flex, "train_step": _stage_train_step,
            "preset": _stage_preset}[name](plan)


# ---------------------------------------------------------------------------------------------
# The driver.


def install_wheels(folder: str, target: str) -> list[str]:
    """Installs every wheel in `folder` into `target` (no network, no dependencies resolved,
    nothing of the machine's own packages touched) and returns the wheels' names. The caller
    puts `target` first on the path, so these versions win over the machine's."""
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not wheels:
        raise ValueError(f"--wheels={folder}: no .whl files there; fill it with pip download "
                         "as README's 'Accelerator report' says")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--no-compile", "--disable-pip-version-check", "--target", target, *wheels],
                   check=True)
    return [os.path.basename(w) for w in wheels]


def _stage_process(name: str, plan: dict, cap: float, env: dict, log) -> dict:
    """Runs one stage in a fresh process for at most `cap` seconds; its output goes to `log`.
    Returns its last JSON line, with "status" ok / failed / timed out and a one-line "error"."""
    start = time.time()
    plan = {**plan, "deadline": start + cap}
    log.write(f"\n===== stage {name} (cap {cap:.0f} s) =====\n")
    log.flush()
    proc = subprocess.Popen([sys.executable, "-m", "sparse_jax.bench.accelerator", name,
                             json.dumps(plan)], stdout=subprocess.PIPE, stderr=log, text=True,
                            cwd=REPO, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=cap + 10)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the stage and whatever it started
        out, _ = proc.communicate()
        timed_out = True
    printed = [line for line in out.splitlines() if line.startswith("{")]
    result = json.loads(printed[-1]) if printed else {}
    result["seconds"] = time.time() - start
    if timed_out:
        result.update(status="timed out", error=f"timed out after {cap:.0f} s")
    elif proc.returncode != 0:
        log.flush()
        with open(log.name) as f:
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
        result.update(status="failed",
                      error=f"exit {proc.returncode}: {(lines or ['?'])[-1][:300]}")
    else:
        result["status"] = "skipped" if "skipped" in result else "ok"
    return result


def parse_caps(items) -> dict:
    """``["tests=150", ...]`` -> {"tests": 150.0}; a bad item is a ValueError."""
    caps = {}
    for item in items or ():
        name, sep, seconds = item.partition("=")
        try:
            if not sep or name not in STAGES or float(seconds) <= 0:
                raise ValueError
            caps[name] = float(seconds)
        except ValueError:
            raise ValueError(f"--caps: {item!r} is not STAGE=SECONDS with a stage of "
                             f"{', '.join(STAGES)} and positive seconds") from None
    return caps


def run_report(output_dir: str, *, wheels: str | None = None, dry_run: bool = False,
               stages=STAGES, budget_s: float | None = None, caps: dict | None = None,
               log=print) -> dict:
    """Runs the stages in order, each in its own process with its own cap, and writes to
    `output_dir`: results.json (every figure), results.md (the summary tables), log.txt (every
    stage's output) and sample.txt (the preset's sample). Returns the JSON."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"--stages: unknown stage(s) {unknown}; choose from {', '.join(STAGES)}")
    if wheels is not None and not os.path.isdir(wheels):
        raise ValueError(f"--wheels={wheels}: no such folder")
    os.makedirs(output_dir, exist_ok=True)
    caps = {**(DRY_CAPS if dry_run else CAPS), **(caps or {})}
    budget_s = budget_s or sum(caps[s] for s in stages)
    plan = plan_for(dry_run)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    paths = [REPO]
    report = {"dry_run": dry_run, "stages": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "command": " ".join(["python", *sys.argv]), "caps_s": caps}
    if dry_run:
        env["JAX_PLATFORMS"] = "cpu"
    scratch = tempfile.mkdtemp(prefix="sparse_jax_accel_")
    if wheels:
        site = os.path.join(scratch, "site")
        report["wheels"] = install_wheels(wheels, site)
        paths.insert(0, site)
        log(f"installed {len(report['wheels'])} wheels into {site}: "
            f"{', '.join(report['wheels'])}")
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    plan["workdir"] = os.path.join(scratch, "preset_run")
    report["plan"] = plan
    deadline = time.time() + budget_s
    log_path = os.path.join(output_dir, "log.txt")
    with open(log_path, "w") as log_file:
        for i, name in enumerate(stages):
            later = sum(min(caps[s], 10) for s in stages[i + 1:])  # a few seconds for each
            cap = min(caps[name], max(5.0, deadline - time.time() - later))
            if name == "preset":
                plan["train_step_rows"] = report["stages"].get("train_step", {}).get("rows", [])
            result = _stage_process(name, plan, cap, env, log_file)
            report["stages"][name] = result
            log(f"stage {name}: {result['status']} in {result['seconds']:.0f} s"
                + (f": {result['error']}" if "error" in result else ""))
    _preset_mfu(report)
    sample = report["stages"].get("preset", {}).get("sample_path")
    if sample and os.path.exists(sample):
        with open(sample, "rb") as f:
            text = f.read()
        with open(os.path.join(output_dir, "sample.txt"), "wb") as f:
            f.write(text)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    markdown = summary_markdown(report)
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(output_dir, "results.md"), "w") as f:
        f.write(markdown)
    log("\n" + markdown)
    return report


def _preset_mfu(report: dict) -> None:
    """The preset's model FLOPs utilisation: its training tokens/s times the FLOPs per token of
    the same model's timed step (train_step stage), over the chip's bf16 peak."""
    preset = report["stages"].get("preset", {})
    peak = report["stages"].get("env", {}).get("bf16_peak_tflops")
    timed = [r for r in report["stages"].get("train_step", {}).get("rows", [])
             if r.get("name", "").endswith("@" + str(preset.get("attention")))
             and r.get("name") in report["plan"]["preset"]["preset_cases"] and "step_s" in r]
    if timed and preset.get("tokens_per_s"):
        flops_per_token = timed[0]["model_tflops"] * 1e12 / timed[0]["tokens_per_s"]
        preset["model_tflops"] = preset["tokens_per_s"] * flops_per_token / 1e12
        preset["mfu"] = preset["model_tflops"] / peak if peak else None


# ---------------------------------------------------------------------------------------------
# The summary.


def _fmt(value, spec=".3g"):
    if value is None:
        return "—"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def summary_markdown(report: dict) -> str:
    """The report's tables: stages, attention, training step, preset."""
    stages = report["stages"]
    env = stages.get("env", {})
    lines = [f"# Accelerator report{' (dry run on a CPU)' if report['dry_run'] else ''}", "",
             f"{report['started']} to {report['finished']}; command: `{report['command']}`", ""]
    if env.get("device_kind"):
        v = env.get("versions", {})
        if env.get("flax_nnx_import", "ok") != "ok":
            lines += [f"**flax.nnx does not import: {env['flax_nnx_import']}** (a carried flax "
                      "wheel older than the machine's jax? Carry only what is missing.)", ""]
        lines += [f"Device: {env['device_kind']} ({env.get('backend')}, "
                  f"{env.get('device_count')} device(s)); nvidia-smi: "
                  f"{env.get('nvidia_smi') or '—'}; CUDA (driver) "
                  f"{env.get('cuda_driver_version') or '—'}; jax {v.get('jax')}, jaxlib "
                  f"{v.get('jaxlib')}, flax {v.get('flax')}, torch {v.get('torch')}, triton "
                  f"{v.get('triton')}. bf16 peak (datasheet): "
                  f"{_fmt(env.get('bf16_peak_tflops'))} TFLOP/s; measured "
                  f"{env.get('matmul_size')}² bf16 matmul: "
                  f"{_fmt(env.get('matmul_bf16_tflops'))} TFLOP/s.", ""]
    lines += ["| stage | status | seconds | note |", "|---|---|---|---|"]
    for name, result in stages.items():
        note = result.get("error", result.get("skipped", ""))
        if name == "tests" and "counts" in result:
            c = result["counts"]
            note = (f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, "
                    f"{c['error']} errors" + (f"; {note}" if note else ""))
        lines.append(f"| {name} | {result.get('status')} | {result.get('seconds', 0):.0f} | "
                     f"{note} |")
    rows = stages.get("attention", {}).get("rows", []) + stages.get("flex", {}).get("rows", [])
    if rows:
        dense = {r["seq_len"]: r["median_ms"] for r in rows
                 if r["pattern"].startswith("dense@cudnn") and "median_ms" in r}
        a = report["plan"]["attention"]
        lines += ["", f"Attention, forward + backward, bfloat16, B={a['batch']} H={a['heads']} "
                  f"d={a['head_dim']}, median of {a['repeats']} runs after compilation; useful "
                  "FLOPs 10·B·H·n·|S|·d (|S| the mean keys per query; forward alone: "
                  "4·B·H·n·|S|·d); memory: XLA's plan (arguments, outputs, temporaries) or "
                  "torch's peak:", "",
                  "| pattern | n | ms | TFLOP/s | of bf16 peak | × vs cuDNN dense | "
                  "planned / peak GB | compile s | result |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["seq_len"], r["pattern"])):
            speedup = (dense[r["seq_len"]] / r["median_ms"]
                       if r["seq_len"] in dense and "median_ms" in r else None)
            memory = r.get("planned_gb", r.get("device_peak_gb"))
            label = r["pattern"] + (" (forward only)" if r.get("pass") == "fwd" else "")
            lines.append(f"| {label} | {r['seq_len']} | {_fmt(r.get('median_ms'))} | "
                         f"{_fmt(r.get('tflops'))} | {_fmt(r.get('of_peak'), '.1%')} | "
                         f"{_fmt(speedup)} | {_fmt(memory)} | {_fmt(r.get('compile_s'))} | "
                         f"{r.get('error', 'ok')} |")
    rows = stages.get("train_step", {}).get("rows", [])
    if rows:
        lines += ["", "Training step (loss, gradients, AdamW), bfloat16:", "",
                  "| case | batch × n | step s | tokens/s | model TFLOP/s | MFU | planned GB | "
                  "compile s | result |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            model = r.get("model", {})
            lines.append(f"| {r['name']} | {r.get('batch_size')} × {model.get('seq_len')} | "
                         f"{_fmt(r.get('step_s'))} | {_fmt(r.get('tokens_per_s'), ',.0f')} | "
                         f"{_fmt(r.get('model_tflops'))} | {_fmt(r.get('mfu'), '.1%')} | "
                         f"{_fmt(r.get('planned_gb'))} | {_fmt(r.get('compile_s'))} | "
                         f"{r.get('error', 'ok')} |")
    preset = stages.get("preset", {})
    if "steps" in preset:
        lines += ["", f"Preset `{preset['config']}` on `{preset['overrides']['data.path']}`, "
                  "attention "
                  f"{preset['attention']}: {preset.get('steps_done', '—')} of {preset['steps']} "
                  f"steps in {_fmt(preset.get('train_wall_s'), '.0f')} s (compilation and "
                  f"validation included); {_fmt(preset.get('tokens_per_s'), ',.0f')} tokens/s, "
                  f"{_fmt(preset.get('model_tflops'))} model TFLOP/s, MFU "
                  f"{_fmt(preset.get('mfu'), '.1%')}; "
                  f"valid {_fmt(preset.get('valid_bits'), '.4f')}, test "
                  f"{_fmt(preset.get('test_bits'), '.4f')} bits/byte.", "",
                  f"`{preset.get('train_command', '')}`"]
        classes = preset.get("test_classes")
        if isinstance(classes, dict) and classes.get("classes"):
            lines += ["", "| bytes copyable from | share | bits/byte |", "|---|---|---|"]
            lines += [f"| {c['name']} | {_fmt(c.get('share'), '.1%')} | "
                      f"{_fmt(c.get('bits'), '.4f')} |" for c in classes["classes"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m sparse_jax.bench.accelerator STAGE PLAN_JSON")
    _emit(run_stage(sys.argv[1], json.loads(sys.argv[2])))
