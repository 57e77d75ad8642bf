"""Stage preset: configs/bytes.py:size=gpu trained on the shipped code corpus with the faster
implementation of the train_step stage (scripts/train.py), for as many steps as that stage's
measured step says fit before the cap with a margin; test bits with the byte classes
(scripts/evaluate.py), and a 1,000-byte sample (scripts/sample.py)."""

from __future__ import annotations

import glob
import json
import os
import sys
import time

from sparse_jax.bench.accelerator import train_step
from sparse_jax.bench.accelerator.common import CODE_CORPUS, REPO, emit, fmt, run_script

# The H100 report: 1,680 steps of 0.0536 s took 142 s in train.py (52 s beyond the steps:
# start-up, data, 15 s of compilation, validation, checkpoint); evaluate and sample ~20 s.
CAP, DRY_CAP = 175, 90


def plan(dry_run: bool) -> dict:
    if dry_run:
        return {"config": "configs/bytes.py:size=tiny", "train_seconds": 10,
                "default_steps": 4, "max_steps": 4, "margin": 1.2, "startup_s": 25,
                "after_s": 35, "eval_batches": 2, "data_bytes": 40_000, "prompt_bytes": 64,
                "sample_bytes": 16, "preset_cases": ["tiny strided@xla"]}
    return {"config": "configs/bytes.py:size=gpu",
            "train_seconds": 90,  # at most this many seconds of steps
            "default_steps": 1500,  # when the train_step stage measured no preset step
            "max_steps": 20000,
            "margin": 1.2,  # on the measured step time
            "startup_s": 40,  # train.py's own seconds beyond steps and compilation
            "after_s": 28,  # kept for evaluate and sample
            "eval_batches": -1, "data_bytes": None, "prompt_bytes": 512, "sample_bytes": 1000,
            "preset_cases": ["preset strided@pallas",
                             f"preset strided@pallas:{train_step.ONEPASS}"]}


def inputs(report: dict) -> dict:
    """What it needs of the stages before it, put in its plan by the driver."""
    return {"train_step_rows": report["stages"].get("train_step", {}).get("rows", []),
            "bf16_peak_tflops": report["stages"].get("env", {}).get("bf16_peak_tflops")}


def plan_steps(p: dict, rows: list, train_s: float) -> tuple[int, str, dict | None, str]:
    """(steps, implementation (what follows "@" in the fastest case's name: "xla", "pallas" or
    "pallas:KERNEL_OPTIONS"), the timed row used or None, how: one line for the report). The
    steps are the fewer of `train_seconds` of steps and what `train_s` seconds hold after
    train.py's start-up and the measured compilation, at the measured step time times
    `margin`, so that training and its validation pass end before the stage's cap."""
    timed = [r for r in rows if r.get("name") in p["preset_cases"] and "step_s" in r]
    if not timed:
        steps = max(2, min(p["default_steps"], p["max_steps"]))
        return steps, "xla", None, (f"{steps:,} steps, the plan's default: the train_step "
                                    "stage measured no preset step")
    best = min(timed, key=lambda r: r["step_s"])
    overhead = p["startup_s"] + best.get("compile_s", 0)
    bound, why = min([
        (p["train_seconds"] / best["step_s"], f"{p['train_seconds']} s of steps"),
        ((train_s - overhead) / (best["step_s"] * p["margin"]),
         f"what {train_s:.0f} s for train.py hold after {overhead:.0f} s of start-up and "
         f"compilation, at {p['margin']}× the step time"),
        (p["max_steps"], "the plan's most")], key=lambda b: b[0])
    steps = int(max(2, bound))
    how = (f"{steps:,} steps from the measured step of {best['name']} ({best['step_s']:.3g} s): "
           + (why if steps == int(bound) else f"the least it trains ({why}: {bound:.0f})"))
    return steps, best["name"].rsplit("@", 1)[1], best, how


def run(plan: dict) -> dict:
    """Trains the preset, then test bits and a sample."""
    p = plan["preset"]
    workdir = plan["workdir"]
    start = time.time()
    train_s = plan["deadline"] - start - p["after_s"]
    steps, implementation, timed, how = plan_steps(p, plan.get("train_step_rows", []), train_s)
    data_path = CODE_CORPUS
    if p["data_bytes"]:  # the dry run: the corpus's first bytes, so that every pass is short
        from sparse_jax.data import sources

        data_path = os.path.join(os.path.dirname(workdir), "code_head.py")
        with open(data_path, "wb") as f:
            f.write(bytes(sources.load_bytes(os.path.join(REPO, CODE_CORPUS))[:p["data_bytes"]]))
    attention, _, kernel = implementation.partition(":")  # e.g. "pallas:chained"
    overrides = {"data.path": data_path, "total_steps": steps, "model.attention": attention,
                 **({"model.kernel": kernel} if kernel else {}),
                 "optimizer.warmup_steps": max(1, min(300, steps // 10)),
                 "log_every": max(1, steps // 20), "eval_every": steps,
                 "checkpoint_every": steps, "eval_batches": p["eval_batches"]}
    out = {"config": p["config"], "steps": steps, "steps_how": how,
           "attention": implementation, "overrides": overrides}
    command = [sys.executable, "scripts/train.py", f"--config={p['config']}",
               f"--workdir={workdir}", *(f"--config.{k}={v}" for k, v in overrides.items())]
    out["train_command"] = " ".join(["python", *command[1:]])
    emit(out)
    out["train_exit"] = run_script(command, timeout=max(10, train_s), stop_gently=True)
    out["train_wall_s"] = time.time() - start
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
    if timed and out.get("tokens_per_s"):  # model FLOPs utilisation: the timed step's FLOPs
        flops_per_token = timed["model_tflops"] * 1e12 / timed["tokens_per_s"]
        out["model_tflops"] = out["tokens_per_s"] * flops_per_token / 1e12
        peak = plan.get("bf16_peak_tflops")
        out["mfu"] = out["model_tflops"] / peak if peak else None
    emit(out)
    if not glob.glob(os.path.join(workdir, "checkpoints", "*")):
        return out
    out["evaluate_exit"] = run_script(
        [sys.executable, "scripts/evaluate.py", f"--workdir={workdir}", "--split=test"],
        timeout=max(10, plan["deadline"] - time.time() - 15))
    for path in glob.glob(os.path.join(workdir, "eval", "test_*.json")):
        with open(path) as f:
            evaluation = json.load(f)
        out["test_bits"] = evaluation["bits"]
        out["test_classes"] = evaluation.get("copy_classes", evaluation.get("classes"))
    emit(out)
    prompt_path = os.path.join(workdir, "prompt.txt")
    with open(prompt_path, "wb") as f:
        f.write(_test_prompt(p["prompt_bytes"]))
    sample_path = os.path.join(workdir, "sample.txt")
    out["sample_exit"] = run_script(
        [sys.executable, "scripts/sample.py", f"--workdir={workdir}", "--num_samples=1",
         f"--length={p['sample_bytes']}", "--temperature=0.8", f"--prompt_file={prompt_path}",
         f"--output={sample_path}"], timeout=max(5, plan["deadline"] - time.time() - 2))
    if os.path.exists(sample_path):
        out["sample_path"] = sample_path
    return out


def _test_prompt(size: int) -> bytes:
    """``size`` bytes of the code corpus's test part, starting at a line: the start of the
    test part's second file, so the prompt is code the model never trained on."""
    from sparse_jax.data import sources

    data = sources.load_bytes(os.path.join(REPO, CODE_CORPUS))
    test = bytes(data[int(len(data) * 0.95):int(len(data) * 0.95) + 200_000])
    marker = test.find(b"\n# ==== Lib/", 1)
    return test[marker + 1:marker + 1 + size] if marker >= 0 else test[:size]


def check(result: dict, plan: dict) -> tuple[str, str] | None:
    """Not ok unless training ran every planned step, validated, and the test figure and the
    sample exist."""
    if "steps" not in result:
        return "failed", "training did not start"
    if "steps_done" not in result:
        return "failed", f"no training step logged (train.py: {result.get('train_exit', '?')})"
    if result["steps_done"] < result["steps"]:
        return "partial", (f"training cut at step {result['steps_done']:,} of "
                           f"{result['steps']:,} (train.py: {result.get('train_exit', '?')})"
                           + ("" if "valid_bits" in result else ", no validation pass"))
    if "valid_bits" not in result:
        return "partial", "no validation pass"
    if "test_bits" not in result:
        return "partial", f"no test figure (evaluate.py: {result.get('evaluate_exit', '?')})"
    if "sample_path" not in result:
        return "partial", f"no sample (sample.py: {result.get('sample_exit', '?')})"
    return None


def summary(report: dict) -> list[str]:
    preset = report["stages"].get("preset", {})
    if "steps" not in preset:
        return []
    lines = [f"Preset `{preset['config']}` on `{preset['overrides']['data.path']}`, attention "
             f"{preset['attention']}: {fmt(preset.get('steps_done'))} of "
             f"{preset['steps']:,} steps in {fmt(preset.get('train_wall_s'), '.0f')} s "
             f"(compilation and validation included); "
             f"{fmt(preset.get('tokens_per_s'), ',.0f')} tokens/s, "
             f"{fmt(preset.get('model_tflops'))} model TFLOP/s, MFU "
             f"{fmt(preset.get('mfu'), '.1%')}; valid {fmt(preset.get('valid_bits'), '.4f')}, "
             f"test {fmt(preset.get('test_bits'), '.4f')} bits/byte.", "",
             f"Steps: {preset.get('steps_how', '—')}.", "",
             f"`{preset.get('train_command', '')}`"]
    classes = preset.get("test_classes")
    if isinstance(classes, dict) and classes.get("classes"):
        lines += ["", "| bytes copyable from | share | bits/byte |", "|---|---|---|"]
        lines += [f"| {c['name']} | {fmt(c.get('share'), '.1%')} | {fmt(c.get('bits'), '.4f')} |"
                  for c in classes["classes"]]
    return lines + [""]
