"""Stage train_step: a training step (loss, gradients, AdamW) of the one-GPU preset at 4,096
bytes, batch 16 (Pallas with the measured default and with the one-pass kernels: the faster
one and its measured step time set the preset stage's training), and of the paper's enwik8
model at 16,384 bytes, batch 2: fixed through XLA and Pallas, and dense (cuDNN). Then:

  kernel profile  one more step of the cases in ``kernel_profile`` (the paper's fixed and dense
                  steps) traced with jax.profiler and read back (``bench.kernel_profile``): the
                  ten costliest kernels with their time, attention's kernels and the rest
                  summed, so a report says where the step's time outside attention goes
  dense check     one step's loss and gradients of the paper's model dense through cuDNN,
                  through XLA and with the float32 reference attention (``dense_check``)

With the report's --profile, a jax.profiler trace of a few steps of the preset's and the
paper's Pallas steps goes to the report folder (profile/)."""

from __future__ import annotations

import os
import time

from sparse_jax.bench import predictions
from sparse_jax.bench.accelerator import dense_check
from sparse_jax.bench.accelerator.common import (
    TIME_UP,
    emit,
    fmt,
    one_line,
    peak_tflops,
    rows_verdict,
)
from sparse_jax.model.config import ModelConfig

# The H100 report: the five cases took 108 s at 5 timed steps each (the dense 16k step 3.06 s a
# step, compiled in 10 s); 85 s left that one out. Now 4 timed steps each, and a sixth case (the
# paper's 16k step on the terms variant beside the measured default, ~0.2 s a step, ~15 s; now
# the fixed pattern's gathered kernels beside the measured default, both with remat
# "attention", docs/gpu_compile.md; the remat "full" step of 2026-11-28 is the one before).
# Pallas rows without a kernel option run the GPU's defaults chosen by measurement
# (attention.measured: chained up to 16,384); ":terms" is the kernel they replaced. The preset's
# terms step is no longer timed (2026-11-28: 0.0455 s against chained's 0.0416; ~15 s with its
# compilation): its time goes to the kernel profile (two steps traced and read, ~10 s by the
# H200's 16k steps of 0.17-0.25 s and the profiler's start and stop) and the dense check (three
# compilations of an 8-layer scanned model at 4,096, ~4 s each by the 16k steps' compile times
# of 3-9 s, and their steps): 130 s. The preset's XLA step (16 s to compile, 0.103 s a step)
# gave its place to the one-pass kernels' (a Pallas preset step: ~12 s to compile, ~0.04 s).
CAP, DRY_CAP = 130, 60
# a kernel option of ModelConfig.kernel: the gathered kernels with dq added atomically
GATHERED = "chained:gathered:dkv128x128w8:atomic"
ONEPASS = "onepass:s1:atomic"  # strided's one-pass kernels, dq added atomically
PROFILE_S = 40  # added to the cap by --profile: two more compilations and a few steps traced


def plan(dry_run: bool) -> dict:
    if dry_run:
        return {"cases": [
            {"name": "tiny strided@xla", "batch_size": 2, "model": dict(
                seq_len=64, num_layers=1, d_model=32, num_heads=2, pattern="strided",
                stride=8, c=2, attention="xla")}], "steps": 2,
            "profile": ["tiny strided@xla"], "profile_steps": 2,
            "kernel_profile": ["tiny strided@xla"], "dense_check": dense_check.plan(True)}
    preset_model = dict(seq_len=4096, num_layers=8, d_model=512, num_heads=8,
                        pattern="strided", stride=64, rotary=True, dtype="bfloat16")
    # remat "attention": the blocks recomputed but for the Pallas kernels' forward pass (their
    # residuals kept, +4 GB planned); on XLA's and cuDNN's attention it is "full"
    paper = dict(seq_len=16384, num_layers=30, d_model=512, num_heads=8, pattern="fixed",
                 stride=128, c=32, remat="attention", scan_layers=True, dtype="bfloat16")
    return {"cases": [
        {"name": "preset strided@pallas", "batch_size": 16,
         "model": {**preset_model, "attention": "pallas"}},
        # the one-pass kernels with dq added atomically, predicted to take the preset past 30%
        # MFU (docs/benchmarks/cost_model/predictions.json); the XLA preset step it replaces
        # measured 0.103 s on the H200 (2026-11-28) and 0.117 s on the H100: 2.3-2.5x Pallas's
        {"name": f"preset strided@pallas:{ONEPASS}", "batch_size": 16,
         "model": {**preset_model, "attention": "pallas", "kernel": ONEPASS}},
        {"name": "paper 16k fixed@pallas", "batch_size": 2,
         "model": {**paper, "attention": "pallas"}},
        # the fixed pattern's gathered kernels (attention.pallas_gathered) with option atomic,
        # predicted past 2x the dense step (docs/benchmarks/cost_model/predictions.json); the
        # default's step above
        {"name": f"paper 16k fixed@pallas:{GATHERED}", "batch_size": 2,
         "model": {**paper, "attention": "pallas", "kernel": GATHERED}},
        {"name": "paper 16k fixed@xla", "batch_size": 2,
         "model": {**paper, "attention": "xla"}},
        {"name": "paper 16k dense (cuDNN)", "batch_size": 2,
         "model": {**paper, "pattern": "dense", "attention": "pallas"}}], "steps": 4,
        "profile": ["preset strided@pallas", "paper 16k fixed@pallas"], "profile_steps": 3,
        "kernel_profile": ["paper 16k fixed@pallas", "paper 16k dense (cuDNN)"],
        "dense_check": dense_check.plan(False)}


def run(plan: dict) -> dict:
    import jax

    from sparse_jax.bench.model import run_model_case
    from sparse_jax.model.config import ModelConfig
    from sparse_jax.run import sizing

    p = plan["train_step"]
    peak = peak_tflops(jax.devices()[0].device_kind)
    rows = []
    out = {"rows": rows}
    for case in p["cases"]:
        if time.time() > plan["deadline"] - 5:
            rows.append({"name": case["name"], "error": TIME_UP})
            continue
        row = {"name": case["name"], "batch_size": case["batch_size"], "model": case["model"]}
        try:
            traced = case["name"] in p.get("kernel_profile", ())
            result = run_model_case({
                "kind": "step", "model": case["model"], "batch_size": case["batch_size"],
                "steps": p["steps"], "update": True,
                **({"trace_dir": _trace_dir(case["name"])} if traced else {})})
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
            if "kernel_profile" in result:
                row["kernel_profile"] = result["kernel_profile"]
        except (Exception, SystemExit) as e:  # noqa: BLE001  run_model_case may skip (exit)
            row["error"] = one_line(e)
        rows.append(row)
        emit(out)
    if "dense_check" in p:
        if time.time() > plan["deadline"] - 5:
            out["dense_check"] = {"error": TIME_UP}
        else:
            try:
                out["dense_check"] = dense_check.run_check(p["dense_check"])
            except Exception as e:  # noqa: BLE001
                out["dense_check"] = {"error": one_line(e)}
        emit(out)
    if plan.get("profile_dir"):  # after the timed cases, so that it cannot crowd them out
        out["profiles"] = []
        for name in p["profile"]:
            case = next(c for c in p["cases"] if c["name"] == name)
            entry = {"name": name}
            if time.time() > plan["deadline"] - 5:
                entry["error"] = TIME_UP
            else:
                try:
                    entry["path"] = _profile(case, plan["profile_dir"], p["profile_steps"])
                except Exception as e:  # noqa: BLE001
                    entry["error"] = one_line(e)
            out["profiles"].append(entry)
            emit(out)
    return out


def _trace_dir(name: str) -> str:
    """A fresh folder for a case's kernel-profile trace, in the stage's temporary folder (the
    report's TMPDIR, which goes with it)."""
    import tempfile

    return tempfile.mkdtemp(prefix="".join(c if c.isalnum() else "_" for c in name) + "_")


def _profile(case: dict, folder: str, steps: int) -> str:
    """A jax.profiler trace (TensorBoard's profile plugin, or Perfetto) of `steps` training
    steps of `case` after a warm-up step, in folder/<case name>/; returns that folder."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparse_jax.bench.model import step_function
    from sparse_jax.model import transformer as model_lib

    cfg = ModelConfig(**case["model"])
    step, _, tx = step_function(cfg, update=True)
    state = nnx.state(model_lib.SparseTransformer(cfg, rngs=nnx.Rngs(0)))
    opt_state = tx.init(state)
    tokens = jax.random.randint(jax.random.key(0), (case["batch_size"], cfg.seq_len + 1), 0,
                                256, dtype=jnp.int32)
    _, state, opt_state = jax.block_until_ready(step(state, opt_state, tokens))  # compiles
    path = os.path.join(folder, "".join(c if c.isalnum() else "_" for c in case["name"]))
    with jax.profiler.trace(path):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                _, state, opt_state = step(state, opt_state, tokens)
        jax.block_until_ready(state)
    return path


def check(result: dict, plan: dict) -> tuple[str, str] | None:
    verdict = rows_verdict(result.get("rows", []), lambda r: r["name"])
    if verdict:
        return verdict
    p = plan["train_step"]
    for row in result.get("rows", []):
        if row["name"] in p.get("kernel_profile", ()):
            profile = row.get("kernel_profile") or {"error": "no kernel profile"}
            if "error" in profile:
                return "partial", f"kernel profile of {row['name']}: {profile['error']}"
    if "dense_check" in p:
        check_ = result.get("dense_check") or {"error": "not run"}
        legs = check_.get("legs", {})
        needed = ("xla", "reference") if plan.get("dry_run") else dense_check.LEGS
        missing = [leg for leg in needed if "loss" not in legs.get(leg, {})]
        if "error" in check_ or missing:
            return "partial", "dense check: " + (check_.get("error") or "; ".join(
                f"{leg} {legs.get(leg, {}).get('not_measured', 'not run')}" for leg in missing))
    missing = [p for p in result.get("profiles", []) if "error" in p]
    if not missing:
        return None
    return "partial", f"profile of {missing[0]['name']} not written: {missing[0]['error']}"


def summary(report: dict) -> list[str]:
    result = report["stages"].get("train_step", {})
    rows = result.get("rows", [])
    if not rows:
        return []
    lines = ["Training step (loss, gradients, AdamW), bfloat16:", "",
             "| case | batch × n | step s | predicted s | / predicted | tokens/s | "
             "model TFLOP/s | MFU | planned GB | compile s | result |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    device = report["stages"].get("env", {}).get("device_kind")
    for r in rows:
        predicted, ratio = predictions.cells(
            report.get("predictions"), "train_step", r["name"], None, device,
            r["step_s"] * 1e3 if "step_s" in r else None)
        predicted = fmt(float(predicted) / 1e3) if predicted != "—" else predicted
        model = r.get("model", {})
        shape = (f"{r['batch_size']} × {model.get('seq_len')}" if "batch_size" in r
                 else "—")  # a row not run ("not run: stage time up") has no figure
        lines.append(f"| {r['name']} | {shape} | "
                     f"{fmt(r.get('step_s'))} | {predicted} | {ratio} | "
                     f"{fmt(r.get('tokens_per_s'), ',.0f')} | "
                     f"{fmt(r.get('model_tflops'))} | {fmt(r.get('mfu'), '.1%')} | "
                     f"{fmt(r.get('planned_gb'))} | {fmt(r.get('compile_s'))} | "
                     f"{r.get('error', 'ok')} |")
    for r in rows:
        lines += profile_lines(r)
    check_ = result.get("dense_check")
    if check_:
        lines += [""] + (dense_check.summary(check_, report["plan"]["train_step"]["dense_check"])
                         if "legs" in check_ else [f"Dense check: {check_['error']}.", ""])
    for p in result.get("profiles", []):
        lines += ["", f"Profile of {p['name']}: "
                  + (f"`{os.path.relpath(p['path'], report['plan']['profile_dir'] + '/..')}`"
                     f" ({report['plan']['train_step']['profile_steps']} steps; "
                     "`tensorboard --logdir=` that folder, Profile tab)"
                     if "path" in p else p["error"])]
    return lines + [""]


def profile_lines(row: dict) -> list[str]:
    """A profiled case's kernels: the costliest, then attention's and the rest's sums."""
    k = row.get("kernel_profile")
    if not k:
        return []
    if "error" in k:
        return ["", f"Kernel profile of {row['name']}: {k['error']}"]
    step = row.get("step_s")
    lines = ["", f"Kernel profile of {row['name']} (jax.profiler, {k['steps']} "
             f"step{'s' if k['steps'] > 1 else ''} traced; "
             f"per step: {k['kernels_ms']:.4g} ms in {k['launches']:.0f} launches of "
             f"{k['kernels']} kernels"
             + (f", the timed step {step * 1e3:.4g} ms" if step else "") + "; attention "
             f"{k['attention_ms']:.4g} ms, the rest {k['rest_ms']:.4g} ms):", "",
             "| kernel | ms per step | launches | share | attention |", "|---|---|---|---|---|"]
    for t in k["top"]:
        lines.append(f"| `{t['name'][:80]}` | {t['ms']:.4g} | {t['launches']:.0f} | "
                     f"{fmt(t['share'], '.1%')} | {'yes' if t['attention'] else ''} |")
    return lines
