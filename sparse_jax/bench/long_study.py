r"""Long context at GPU scale (issue 49), the `study` stage of the accelerator report: does
sparse attention buy a long context for the cost of a short one?

One model, `configs/bytes.py:size=gpu` (8 layers, d=512, 8 heads, bfloat16, rotary on top of the
text position tables), trained on the shipped code corpus (data/cpython_lib.py.gz) three times
for the same wall time, each run in its own process:

  short sparse   context 4,096, strided l=64 (window l + 1 = 65), 16 windows a step: the preset
  long sparse    context 16,384, strided l=128 (window 129), 4 windows a step
  long dense     context 16,384, dense causal attention (cuDNN's fused kernel on a GPU), 4 windows
  long fixed     optional: context 16,384, fixed l=128 c=32, 4 windows; only if time is left

Every run reads 65,536 bytes a step with the same optimizer and schedule shape. Equal wall time
is the pattern study's (`bench.pattern_study`): in the run's process `study.calibrate` times
its start-up (data, compilation, the first step), a median step and a validation pass,
`study.budget_steps` turns `run_seconds` into steps and `study.budget_config` rescales the
schedule to them (4 validation passes, warmup 10% of the run), within the plan's least and most
steps (`bounded_steps`: the dry run's 4 steps, not its time, bound every run there; each row
says what bounded it, and results.md's text says so from the runs' figures, not from the plan).
Calibrating costs each run one extra compilation (~15 s on an H100), which buys equal time on a
chip and at contexts no run has measured yet. Then `sparse_jax.train.train` trains, and
`sparse_jax.evaluate.evaluate` scores the test part:

  plain          non-overlapping windows: every byte once, with whatever context its window gives
  matched        `--min_context=M`, M = half the short context (2,048): every byte (but the
                 split's first M) scored with at least M bytes before it, by every model, so
                 the short model's window starts no longer count against it; the long models may
                 still see up to 16,383 bytes
  Table 4        the long models at min_context 0, 1,024, 2,048, 4,096, 8,192 and 14,336: how
                 the bits fall with guaranteed context (the paper's Tables 3-4 protocol)
  copy classes   every pass split by how far back an exact copier finds the byte
                 (`baselines.copy_classes`, k = 12): <= 512, 513-4,096, 4,097-16,384, the rest
  attention      where each model looks (`sparse_jax.attention_stats`, a few test windows): each
                 layer's mass beyond 512 and 4,096 bytes (the short context), and by chance

  plan(dry_run)   the sizes: one H100, or toy ones for a CPU
  run(plan, emit) runs the study (plan["deadline"]: time.time() to end by; plan["workdir"]: a
                  scratch folder), calling emit(results so far) as they come; returns them
  check(result)   None when every planned row was measured, else ("partial" | "failed", why)
  markdown(result) the section of results.md, as lines; its text says what bounded the runs
                  (wall time or a step cap) from their own figures (`bounds_text`)

It runs as the report's `study` stage (`sparse_jax.bench.accelerator.study`, which holds its
cap); on a CPU at toy sizes, in about two minutes:

  python scripts/accelerator_report.py --dry_run --stages=study --output_dir=/tmp/study
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time

from sparse_jax.bench.accelerator.common import CODE_CORPUS, REPO, TIME_UP

# What bounded a run's steps (a row's "bound"; `bounded_steps`).
WALL_TIME, STEP_CAP, STEP_FLOOR = "wall time", "step cap", "step floor"

# ---------------------------------------------------------------------------------------------
# The plan.


def matched_context(short_len: int) -> int:
    """The guaranteed context at which the short and long models are compared: half the short
    model's window, so each of its windows scores its second half (twice a plain pass)."""
    return short_len // 2


def table4_contexts(long_len: int, matched: int) -> list[int]:
    """The guaranteed contexts of Table 4 for a model of context `long_len` (0, n/16, n/4, n/2,
    n - n/8: 0, 1,024, 4,096, 8,192, 14,336 at 16,384) and the matched one."""
    n = long_len
    return sorted({0, n // 16, matched, n // 4, n // 2, n - n // 8})


def copy_edges(short_len: int, long_len: int) -> list[int]:
    """Copy-class bounds: what a window of an eighth of the short context copies, what only the
    short context can, what only the long one can (512, 4,096, 16,384 at 4,096 and 16,384)."""
    return [short_len // 8, short_len, long_len]


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def plan(dry_run: bool) -> dict:
    """The study's sizes. Real: one H100 (the step times below are estimates, see
    docs/long_context.md); dry run: toy models on a CPU, a few steps each."""
    if dry_run:
        short, long = 64, 256
        model = {"model.num_layers": 1, "model.d_model": 32, "model.num_heads": 2,
                 "model.attention": "xla", "model.dtype": "float32"}
        # max_steps decides: run_seconds only has to hold any CPU's start-up, however loaded
        # (the stage's cap, not this, bounds the dry run's time)
        p = {"run_seconds": 3600, "min_steps": 2, "max_steps": 4, "data_bytes": 40_000,
             "need_s": 45, "evals": 2, "attention_windows": 2}
        strides, batches = (8, 16), (8, 2)
    else:
        short, long = 4096, 16384
        model = {}
        # A run's whole time, need_s: run_seconds, and beyond them start-up and imports
        # (~10 s), calibration (~25 s), test passes (~15-20 s), attention statistics (~5-10 s);
        # 3 x 150 = 450 s of the cap (2026-11-28, before the statistics: 360 s for all three).
        p = {"run_seconds": 85, "min_steps": 2, "max_steps": 20000, "data_bytes": None,
             "need_s": 150, "evals": 4, "attention_windows": 4}
        strides, batches = (64, 128), (16, 4)
    matched = matched_context(short)
    # budget_config keeps the number of validation passes and the warmup's share: p["evals"]
    # passes over the whole valid part (the curve shows over-fitting), warmup 10% of the run (the
    # preset stage's measured runs).
    every = 6000 // p.pop("evals")
    base = {**model, "data.path": CODE_CORPUS, "eval_batches": -1, "total_steps": 6000,
            "eval_every": every, "checkpoint_every": every, "optimizer.warmup_steps": 600}

    def one(name, pattern, n, optional=False, **extra):
        stride = strides[n == long]
        return {"name": name, "optional": optional,
                "overrides": {**base, "model.pattern": pattern, "model.seq_len": n,
                              "model.stride": stride, "model.c": stride // 4,
                              "batch_size": batches[n == long], **extra},
                "test_contexts": table4_contexts(n, matched) if n == long else [0, matched]}

    return {"dry_run": dry_run, "config": "configs/bytes.py:size=gpu", **p,
            "short": short, "long": long, "matched_context": matched,
            "copy_edges": copy_edges(short, long),
            "runs": [one("short sparse", "strided", short), one("long sparse", "strided", long),
                     one("long dense", "dense", long)]
            + ([] if dry_run else [one("long fixed", "fixed", long, optional=True)])}


def run_config(p: dict, spec: dict, data_path: str):
    """The checked config of one planned run (ValueError before anything trains)."""
    import configs
    from sparse_jax.run import config as config_lib

    config = configs.load(p["config"], {**spec["overrides"], "data.path": data_path})
    config_lib.check_config(config)
    return config


# ---------------------------------------------------------------------------------------------
# The stage.


def run(plan: dict, emit) -> dict:
    """Trains and scores every planned run that fits before plan["deadline"], one process each,
    in plan["workdir"]/<run>; emit(results so far) after every step of every run."""
    p, workdir, deadline = plan, plan["workdir"], plan["deadline"]
    import jax  # checking the configs starts a JAX backend: the host's, so that this process

    jax.config.update("jax_platforms", "cpu")  # holds none of the accelerator's memory
    os.makedirs(workdir, exist_ok=True)
    data_path = os.path.join(REPO, CODE_CORPUS)
    if p["data_bytes"]:  # the dry run: the corpus's first bytes, so every pass is short
        from sparse_jax.data import sources

        data_path = os.path.join(workdir, "code_head.py")
        with open(data_path, "wb") as f:
            f.write(bytes(sources.load_bytes(os.path.join(REPO, CODE_CORPUS))[:p["data_bytes"]]))
    configs = {s["name"]: run_config(p, s, data_path) for s in p["runs"]}  # all checked first
    result = {"dry_run": p["dry_run"], "config": p["config"], "run_seconds": p["run_seconds"],
              "min_steps": p["min_steps"], "max_steps": p["max_steps"],
              "matched_context": p["matched_context"], "copy_edges": p["copy_edges"],
              "runs": [{"name": s["name"], "optional": s["optional"],
                        "seq_len": s["overrides"]["model.seq_len"],
                        "pattern": s["overrides"]["model.pattern"],
                        "batch_size": s["overrides"]["batch_size"],
                        "test_contexts": s["test_contexts"]} for s in p["runs"]]}
    emit(result)
    for spec, row in zip(p["runs"], result["runs"]):
        left = deadline - time.time()
        if left < p["need_s"]:
            row["skipped" if spec["optional"] else "error"] = (
                f"{TIME_UP} ({left:.0f} s left, a run needs ~{p['need_s']:.0f} s)")
            emit(result)
            continue
        from sparse_jax.run import config as config_lib

        run_dir = os.path.join(workdir, slug(spec["name"]))
        os.makedirs(run_dir, exist_ok=True)
        config_lib.write_record(run_dir, configs[spec["name"]])  # what the worker reads
        job = {k: p[k] for k in ("run_seconds", "min_steps", "max_steps", "copy_edges",
                                 "attention_windows")}
        job["test_contexts"] = spec["test_contexts"]

        def update(line, row=row):
            row.update(line)
            emit(result)

        how = _run_worker(run_dir, job, deadline - time.time() - 5, update)
        if row.get("phase") != "done" and "error" not in row:
            row["error"] = how or "the run's process ended before it was scored"
        emit(result)
    return result


def _run_worker(run_dir: str, job: dict, timeout: float, update) -> str | None:
    """Runs one study run in a fresh process (its output to this one's stderr, its JSON lines
    to `update`); past `timeout` it gets SIGTERM (training saves a checkpoint and stops), then
    SIGKILL 20 s later. Returns None, or how the process ended when it failed."""
    proc = subprocess.Popen([sys.executable, "-m", "sparse_jax.bench.long_study", "worker",
                             run_dir, json.dumps(job)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=sys.stderr, text=True)
    stopped = []

    def stop():
        stopped.append(f"stopped at its {max(timeout, 0):.0f} s cap (stage time up)")
        proc.terminate()
        killer = threading.Timer(20, proc.kill)
        killer.daemon = True
        killer.start()

    timer = threading.Timer(max(timeout, 0), stop)
    timer.daemon = True
    timer.start()
    try:
        for line in proc.stdout:
            if line.startswith("{"):
                update(json.loads(line))
        proc.wait()
    finally:
        timer.cancel()
    if stopped:
        return stopped[0]
    return None if proc.returncode == 0 else f"exit {proc.returncode} (see the log)"


# ---------------------------------------------------------------------------------------------
# One run, in its own process.


def bounded_steps(time_steps: int, min_steps: int, max_steps: int) -> tuple[int, str]:
    """(steps, what bounded them): "wall time" when `time_steps` (what the run's seconds hold,
    `study.budget_steps`) lies within [min_steps, max_steps], else "step cap" (max_steps, fewer
    than the time holds: equal steps, not equal time) or "step floor" (min_steps, more)."""
    if time_steps > max_steps:
        return max_steps, STEP_CAP
    if time_steps < min_steps:
        return min_steps, STEP_FLOOR
    return time_steps, WALL_TIME


def _worker(run_dir: str, job: dict) -> None:
    """Calibrates, trains and scores the run whose config is run_dir/config.json, printing its
    row so far as a JSON line after each part (Python's other output goes to stderr)."""
    from sparse_jax import sharding

    sharding.set_cpu_devices()  # as scripts/train.py: one CPU device per core
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        import jax  # a persistent cache: training reuses calibration's init and eval programs

        jax.config.update("jax_compilation_cache_dir", os.path.join(run_dir, "..", "jax_cache"))
    out = {}

    def emit(**fields):
        out.update(fields)
        sys.__stdout__.write(json.dumps(fields) + "\n")
        sys.__stdout__.flush()

    with contextlib.redirect_stdout(sys.stderr):
        try:
            _train_and_score(run_dir, job, emit)
        except Exception as e:  # noqa: BLE001  one line for the report, the traceback in the log
            import traceback

            traceback.print_exc()
            emit(error=" ".join(f"{type(e).__name__}: {e}".split())[:300])


def _train_and_score(run_dir: str, job: dict, emit) -> None:
    from absl import logging

    from sparse_jax import evaluate as eval_lib
    from sparse_jax import train as train_lib
    from sparse_jax.bench import pattern_study as study
    from sparse_jax.bench import tools
    from sparse_jax.run import config as config_lib

    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    emit(phase="calibrating")
    config = config_lib.read_record(run_dir)
    evals = -(-config.total_steps // config.eval_every)
    calibration = study.calibrate(run_dir, time.time())
    time_steps = study.budget_steps(calibration, job["run_seconds"], evals)
    steps, bound = bounded_steps(time_steps, job["min_steps"], job["max_steps"])
    config = study.budget_config(config, steps)
    config_lib.write_record(run_dir, config)
    emit(phase="training", calibration=calibration, planned_steps=steps, time_steps=time_steps,
         bound=bound)

    start = time.time()
    trained = train_lib.train(config, run_dir)
    session = {"start": start, "end": time.time(), "step": trained["step"],
               "peak_rss_gb": tools.peak_rss_gb()}
    if trained["interrupted"] or trained["valid_bits"] is None:
        emit(error=f"training stopped by {trained['interrupted']} at step {trained['step']} of "
                   f"{steps}")
        return
    # What study.summarize reads: the session and the last validation (the whole valid split).
    with open(os.path.join(run_dir, study.STUDY_FILE), "w") as f:
        json.dump({"sessions": [session], "calibration": calibration,
                   "final": {"split": "valid", "step": trained["step"],
                             "bits": trained["valid_bits"], "unit": "byte"}}, f)
    summary = study.summarize(run_dir, config)
    emit(phase="scoring", **{k: summary[k] for k in (
        "spec", "params", "mean_keys_per_query", "steps", "s_per_step", "tokens_per_s",
        "valid_bits", "train_bits", "wall_s", "curve", "peak_rss_gb")},
        steps_s=summary["steps"] * (summary["s_per_step"] or calibration["s_per_step"]))

    tests = []
    for context in job["test_contexts"]:
        r = eval_lib.evaluate(run_dir, "test", min_context=context or None,
                              copy_edges=tuple(job["copy_edges"]), progress=False, write=False)
        tests.append({"min_context": context, "bits": r["bits"], "num_scored": r["num_scored"],
                      "wall_s": r["wall_s"], "copy_classes": r["copy_classes"]["classes"],
                      **({"by_position": r["by_position"]} if not context else {})})
        emit(test=tests)
    emit(phase="done")
    try:  # after "done": a run cut short here keeps its scores, without this table
        from sparse_jax import attention_stats

        edges, windows = job["copy_edges"], job["attention_windows"]
        stats = attention_stats.attention_stats(
            run_dir, "test", windows=windows, write=False, progress=False,
            bands=[e for e in edges if e < config.model.seq_len - 1])
        emit(attention={"windows": windows, "far": attention_stats.far_by_layer(stats, edges)})
    except Exception as e:  # noqa: BLE001  the table says it is missing and why
        import traceback

        traceback.print_exc()
        emit(attention={"error": " ".join(f"{type(e).__name__}: {e}".split())[:300]})


# ---------------------------------------------------------------------------------------------
# Reading the results.


def test_row(row: dict, context: int) -> dict | None:
    """The test pass of `row` at guaranteed context `context` (0: plain windows), or None."""
    return next((t for t in row.get("test", []) if t["min_context"] == context), None)


def missing(result: dict) -> list[str]:
    """What the study planned and did not measure, one phrase each ([] when complete). An
    optional run skipped for time is not missing."""
    out = []
    for row in result.get("runs", []):
        if row.get("skipped") or row.get("optional") and "error" in row:
            continue
        if "error" in row:
            out.append(f"{row['name']}: {row['error']}")
            continue
        if row.get("valid_bits") is None:
            out.append(f"{row['name']}: not trained")
        lacking = [c for c in row["test_contexts"] if test_row(row, c) is None]
        if lacking:
            out.append(f"{row['name']}: no test pass at min_context {lacking}")
    return out


def check(result: dict, plan: dict | None = None) -> tuple[str, str] | None:
    """None when every planned run was trained and scored; else ("partial" | "failed", why)."""
    rows = [r for r in result.get("runs", []) if not r.get("optional")]
    gaps = missing(result)
    if not gaps:
        return None if rows else ("failed", "no run planned")
    trained = [r for r in rows if r.get("valid_bits") is not None]
    return ("partial" if trained else "failed", "; ".join(gaps)[:300])


def _f(value, spec=".4f"):
    return "—" if value is None else format(value, spec)


def _span(values: list, spec: str) -> str:
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low}–{high}"


def bounds_text(result: dict) -> str:
    """What bounded the runs, from their own figures (each trained run's "bound", the steps its
    seconds held, its training's wall time), never from the plan alone: "each run 85 s of wall
    time ...: equal time", "each run capped at 4 steps, fewer than ...: equal steps, not equal
    time", which run each bound held when they differ, or that no run trained."""
    trained = [r for r in result.get("runs", []) if r.get("steps") is not None]
    if not trained:
        return "no run trained (each row says why)"
    seconds, cap, floor = (result.get(k) for k in ("run_seconds", "max_steps", "min_steps"))
    walls = [r["wall_s"] for r in trained if r.get("wall_s") is not None]
    took = f"; training took {_span(walls, '.0f')} s" if walls else ""
    bounds = {}
    for r in trained:
        bounds.setdefault(r.get("bound"), []).append(r["name"])
    held = [r["time_steps"] for r in trained if r.get("time_steps") is not None]
    held = f" ({_span(held, ',')} steps)" if held else ""
    if set(bounds) == {WALL_TIME}:
        return (f"each run {seconds} s of wall time from its start (compilation, steps, "
                f"validation passes; `study.calibrate` / `budget_steps`): equal time{took}")
    if set(bounds) == {STEP_CAP}:
        return (f"each run capped at {_f(cap, ',')} steps, fewer than its {seconds} s of wall time "
                f"held{held}: equal steps, not equal time{took}")
    what = {WALL_TIME: f"{seconds} s of wall time", STEP_CAP: f"the cap of {_f(cap, ',')} steps",
            STEP_FLOOR: f"the least of {floor} steps, more than {seconds} s held",
            None: "not recorded"}
    return ("runs bounded by " + "; ".join(f"{what.get(b, b)} ({', '.join(names)})"
                                           for b, names in bounds.items())
            + (": equal time only among those bounded by wall time" if WALL_TIME in bounds
               else ": not equal time") + took)


def markdown(result: dict) -> list[str]:
    """The study's section of results.md: the runs, Table 4 of the long models, the copy
    classes in plain windows and at the matched context."""
    rows = result.get("runs", [])
    m = result.get("matched_context")
    lines = ["## Long context: short and long, sparse and dense (study)", ""]
    verdict = check(result)
    if verdict:
        lines += [f"**{verdict[0]}**: {verdict[1]}", ""]
    dry = " (dry run)" if result.get("dry_run") else ""
    lines += [f"`{result.get('config')}` on the code corpus{dry}, {bounds_text(result)}; "
              "test bits/byte in plain windows and with at least "
              f"{m:,} bytes of context for every byte (matched).", "",
              "| run | context | batch | params | steps | bounded by | s/step | bytes/s | "
              "s of steps | train bits | valid bits | test bits | test ≥ " + f"{m:,} |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = r.get("error") or r.get("skipped")
        plain, matched = test_row(r, 0) or {}, test_row(r, m) or {}
        lines.append(
            f"| {r['name']}" + (f" ({note})" if note else "") + f" | {r['seq_len']:,} "
            f"{r['pattern']} | {r['batch_size']} | {_f(r.get('params'), ',')} | "
            f"{_f(r.get('steps'), ',')} | {r.get('bound') or '—'} | "
            f"{_f(r.get('s_per_step'), '.4f')} | "
            f"{_f(r.get('tokens_per_s'), ',.0f')} | {_f(r.get('steps_s'), '.1f')} | "
            f"{_f(r.get('train_bits'))} | {_f(r.get('valid_bits'))} | {_f(plain.get('bits'))} | "
            f"{_f(matched.get('bits'))} |")
    long_rows = [r for r in rows if len(r["test_contexts"]) > 2 and r.get("test")]
    if long_rows:
        contexts = long_rows[0]["test_contexts"]
        lines += ["", "Table 4: test bits/byte with at least … bytes of context for every byte:",
                  "", "| run | " + " | ".join(f"{c:,}" for c in contexts) + " |",
                  "|---|" + "---|" * len(contexts)]
        lines += [f"| {r['name']} | " + " | ".join(_f((test_row(r, c) or {}).get("bits"))
                                                   for c in contexts) + " |" for r in long_rows]
    scored = [r for r in rows if test_row(r, 0)]
    if scored:
        names = [c["name"] for c in test_row(scored[0], 0)["copy_classes"]]
        header = [f"{r['name']}{' ≥ ' + format(m, ',') if c else ''}" for r in scored
                  for c in (0, m)]
        lines += ["", "Test bits/byte by how far back an exact copier finds the byte (k = 12), "
                  "plain windows and matched:", "",
                  "| bytes | share | " + " | ".join(header) + " |",
                  "|---|---|" + "---|" * len(header)]
        for i, name in enumerate(names):
            share = test_row(scored[0], 0)["copy_classes"][i]["share"]
            cells = [_f(t["copy_classes"][i]["bits"]) if t else "—"
                     for r in scored for t in (test_row(r, 0), test_row(r, m))]
            lines.append(f"| {name} | {share:.1%} | " + " | ".join(cells) + " |")
    return lines + attention_lines(result) + [""]


def attention_lines(result: dict) -> list[str]:
    """Where each run looks (``attention_stats.format_far``) and what that says about the reach
    beyond the short context; [] when no run has the figures."""
    from sparse_jax.attention_stats import far_text, format_far

    if not (rows := [r for r in result.get("runs", []) if r.get("attention")]):
        return []
    runs, short = [(r["name"], r["attention"]) for r in rows], result["copy_edges"][1]
    said = far_text(runs, short)
    return ["", f"Attention beyond … bytes back ({rows[0]['attention'].get('windows')} test "
            "windows, `sparse_jax.attention_stats`): each layer's share of its attention, the "
            "mean over its heads / its most far-looking head's / the mean if its heads spread "
            "their weight evenly over their keys (chance); — where the context ends:", "",
            *format_far(runs, result["copy_edges"])] + (
        ["", f"Beyond the short model's context ({short:,} bytes): {said}."] if said else [])


if __name__ == "__main__":  # one run, in its own process: python -m ... worker RUN_DIR JOB_JSON
    if len(sys.argv) != 4 or sys.argv[1] != "worker":
        raise SystemExit("usage: python -m sparse_jax.bench.long_study worker RUN_DIR JOB_JSON "
                         "(the study runs as a stage: scripts/accelerator_report.py "
                         "--stages=env,study)")
    _worker(sys.argv[2], json.loads(sys.argv[3]))
