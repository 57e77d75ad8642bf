r"""Pattern study (paper Table 2 at any scale): the same model trained once per attention pattern
on the same data, seed and number of steps, then evaluated; a table, JSON and a plot of
validation bits against wall time.

  python scripts/compare_patterns.py --config=configs/quickstart.py --workdir=DIR \
      [--patterns=dense,strided,fixed] [--steps=N | --minutes=M] [--output_dir=OUT] \
      [--config.FIELD=VALUE]

`pattern_configs` loads the config file once per pattern as the variant `pattern=<name>` (so
each pattern gets the settings its config gives it, e.g. cifar10's layer schedule for strided),
applies the same overrides and step count to all, and checks them all before anything trains:
an unknown pattern, steps < 1, a config without that variant, a pattern that cannot serve the
context length, or patterns that differ in anything but `model` raise ValueError.

`compare_patterns` trains the patterns one after another, each in a fresh Python process
(`sparse_jax.bench.tools.run_isolated`), so that peak memory is the pattern's own and one
pattern's compilation caches do not speed up the next. Each pattern is an ordinary run of
`sparse_jax.train.train` in its own folder, so checkpoints, TensorBoard, resume, evaluation and
sampling work on it as on any run:

  DIR/<pattern>/             config.json, checkpoints/, metrics.jsonl, tensorboard/, eval/
  DIR/<pattern>/train.log    the run's console output (follow it with `tail -f`)
  DIR/<pattern>/study.json   sessions (start, end, peak RSS) and the final evaluation
  OUT/results.md, OUT/results.json, OUT/valid_bits.png  (OUT defaults to DIR)

Running the same command again reuses finished patterns (nothing is retrained or overwritten),
resumes interrupted ones from their last checkpoint, and refuses a folder that holds a run of
another config.

Equal wall-clock (`minutes=M`, the paper's question at a fixed budget rather than a fixed
number of steps): before a pattern trains, a fresh process times its start-up (imports, data,
compilation, the first step), a median training step and a validation pass
(`calibrate`); `budget_steps` turns that into the number of steps that ends training after M
minutes from launch, validation passes included, and `budget_config` rescales the run's
schedule to it (the config's number of validation passes and checkpoints, and its warmup as
the same share of the run). The calibration is kept in `DIR/<pattern>/study.json`, and a
rerun takes the steps recorded in the pattern's config.json, so resuming never recalibrates.

What is measured, per pattern:
- parameters and mean keys per query (over layers): `sizing.describe`;
- seconds per step and tokens/s: the median over the trainer's log windows (steps_per_s in
  metrics.jsonl) without the first window of each process, which includes compilation;
  validation passes and checkpoint saves are outside the windows;
- peak memory: the process's peak RSS, including the Python/JAX baseline, compilation and the
  final evaluation (the largest over sessions, if the run was resumed);
- validation bits: the final checkpoint evaluated on the whole valid split
  (`evaluate.evaluate`); the curve is the trainer's validation passes (config.eval_every,
  config.eval_batches);
- wall time: seconds since the process was launched (Python start-up, compilation, validation
  passes and checkpoints included); the time between an interrupted session and its resumption
  is left out.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import sys
import time

import ml_collections

import configs
from sparse_jax import sharding
from sparse_jax import train as train_lib
from sparse_jax.bench import tools
from sparse_jax.files import atomic_write, read_jsonl
from sparse_jax.model.config import PATTERNS, model_config
from sparse_jax.run import config as config_lib
from sparse_jax.run import setup
from sparse_jax.run import workdir as workdir_lib
from sparse_jax.run.sizing import describe

DEFAULT_PATTERNS = ("dense", "strided", "fixed")
NOTE = ("s/step and tokens/s: median over the log windows after the first (which includes "
        "compilation). Peak RSS: the whole training process. Valid bits: the last checkpoint on "
        "the whole valid split. Wall s: from process launch to the end of that evaluation.")
STUDY_FILE = "study.json"


# ---------------------------------------------------------------------------------------------
# Configs.


def check_patterns(patterns, steps: int | None = None) -> tuple[str, ...]:
    """The pattern names as a tuple; ValueError for unknown or repeated names or steps < 1."""
    patterns = tuple(p.strip() for p in (patterns.split(",") if isinstance(patterns, str)
                                          else patterns))
    unknown = [p for p in patterns if p not in PATTERNS]
    if unknown or not patterns:
        raise ValueError(
            f"unknown pattern(s) {unknown or patterns!r}; choose from {list(PATTERNS)}")
    if len(set(patterns)) != len(patterns):
        raise ValueError(f"a pattern is listed twice in {list(patterns)}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    return patterns


def pattern_configs(config_spec: str, patterns=DEFAULT_PATTERNS, *, steps: int | None = None,
                    overrides: dict | None = None) -> dict[str, ml_collections.ConfigDict]:
    """One validated config per pattern: `config_spec` with `pattern=<name>` added to its
    arguments, then `overrides` (flat: {"optimizer.lr": 1e-3}), then total_steps = steps."""
    patterns = check_patterns(patterns, steps)
    path, arg = configs.split_spec(config_spec)  # ValueError if there is no such file
    arg = arg or ""
    items = [s.strip() for s in arg.split(",") if s.strip()]
    overrides = dict(overrides or {})
    if any(s.partition("=")[0].strip() == "pattern" for s in items) or "model.pattern" in overrides:
        raise ValueError("the pattern comes from --patterns; leave it out of --config")
    if "total_steps" in overrides and steps is not None:
        raise ValueError("give the number of steps once: --steps or --config.total_steps")
    by_pattern = {}
    for pattern in patterns:
        try:
            config = configs.load(f"{path}:{','.join(items + [f'pattern={pattern}'])}")
        except ValueError as e:
            raise ValueError(f"{path} has no variant pattern={pattern}: {e}") from e
        config.update_from_flattened_dict(overrides)
        if steps is not None:
            config.total_steps = steps
        try:
            setup.complete(config)  # shapes, warmup, every field, the mesh: as train.py would
        except ValueError as e:
            raise ValueError(f"pattern {pattern}: {e}") from e
        by_pattern[pattern] = config
    first, *rest = patterns
    for pattern in rest:
        differences = [k for k in config_lib.differences(by_pattern[first], by_pattern[pattern])
                       if not k.startswith("model.")]
        if differences:
            raise ValueError(f"patterns {first} and {pattern} would differ in more than the "
                             f"model: {differences}")
    return by_pattern


# ---------------------------------------------------------------------------------------------
# Runs.


def _read_json(path: str, default=None):
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, value) -> None:
    with atomic_write(path) as f:
        json.dump(value, f, indent=1)


def run_status(run_dir: str, config) -> str:
    """"done" (finished and evaluated), "resume" (checkpoints of this config) or "new";
    ValueError if `run_dir` holds checkpoints of another config (they are never touched)."""
    if not workdir_lib.steps(run_dir):
        return "new"
    saved = _read_json(os.path.join(run_dir, config_lib.RECORD), {})
    differences = list(config_lib.differences(saved, config))
    if differences:
        raise ValueError(f"{run_dir} holds a run of another config (differences: "
                         f"{', '.join(differences)}); use another --workdir")
    final = (_read_json(os.path.join(run_dir, STUDY_FILE)) or {}).get("final")
    return "done" if final and final["step"] == config.total_steps else "resume"


def train_and_evaluate(run_dir: str, launched: float | None = None) -> dict:
    """Trains (or resumes) the run whose config is `run_dir/config.json`, evaluates its last
    checkpoint on the valid split and records the session in `run_dir/study.json`; the session
    starts at `launched` (default: now). Meant to run in a fresh process
    (`python -m sparse_jax.bench.pattern_study RUN_DIR LAUNCH_TIME`)."""
    from sparse_jax import evaluate

    start = time.time() if launched is None else launched
    config = config_lib.read_record(run_dir)
    study_path = os.path.join(run_dir, STUDY_FILE)
    study = _read_json(study_path, {"sessions": []})
    session = {"start": start, "end": None, "step": None, "peak_rss_gb": None}
    study["sessions"].append(session)  # recorded now: a killed session still counts its rows
    _write_json(study_path, study)
    with open(os.path.join(run_dir, "train.log"), "a") as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        result = train_lib.train(config, run_dir)
        final = None
        if not result["interrupted"]:
            final = evaluate.evaluate(run_dir, "valid", progress=False, overwrite=True)
    session.update(end=time.time(), step=result["step"], peak_rss_gb=tools.peak_rss_gb())
    if final is not None:
        study["final"] = {k: final[k] for k in ("split", "step", "bits", "unit", "num_scored")}
    _write_json(study_path, study)
    return {"run_dir": run_dir, "interrupted": result["interrupted"], "final": study.get("final")}


# ---------------------------------------------------------------------------------------------
# Equal wall-clock budgets.

CALIBRATION_STEPS = 5  # timed training steps after the first (which compiles)
BUDGET_FIELDS = ("total_steps", "eval_every", "checkpoint_every", "log_every",
                 "optimizer.warmup_steps", "context_stages")  # what `budget_config` sets


def calibrate(run_dir: str, launched: float, steps: int = CALIBRATION_STEPS) -> dict:
    """Times the run of `run_dir/config.json` without writing anything: start-up from
    `launched` to the end of the first training step (imports, data, compilation), the median
    of `steps` more steps, the first validation pass (with its compilation) and a second one.
    Meant to run in a fresh process
    (`python -m sparse_jax.bench.pattern_study calibrate RUN_DIR TIME`)."""
    import jax

    from sparse_jax import evaluate as eval_lib
    from sparse_jax.data import datasets as data_lib

    config = config_lib.read_record(run_dir)
    cfg = model_config(config.model)
    mesh = setup.make_mesh(config, cfg)
    dataset = data_lib.make_dataset(config.data, cfg.seq_len, vocab_size=cfg.vocab_size,
                                    image_shape=cfg.image_shape)
    batches = dataset.train_batches(config.batch_size)
    jitted = train_lib.make_jitted(config, cfg, mesh)
    state, rng = jitted.init(), jax.random.key(config.seed)

    def timed(fn):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - start

    def train_step():
        nonlocal state
        state, metrics = jitted.train_step(
            state, sharding.to_global(next(batches), jitted.batch_sharding), rng)
        return metrics

    def validate():
        return eval_lib.split_bits(jitted.eval_step, state["params"],
                                   dataset.eval_batches("valid", config.batch_size),
                                   jitted.batch_sharding, max_batches=config.eval_batches).bits

    timed(train_step)
    startup_s = time.time() - launched
    step_s = [timed(train_step) for _ in range(steps)]
    return {"startup_s": startup_s, "s_per_step": statistics.median(step_s),
            "first_eval_s": timed(validate), "eval_s": timed(validate), "timed_steps": steps}


def budget_steps(calibration: dict, seconds: float, evals: int) -> int:
    """Training steps that end a run `seconds` after launch: start-up, `evals` validation passes
    (the first one compiles) and the steps in between; ValueError if none fit."""
    overhead = (calibration["startup_s"] + calibration["first_eval_s"]
                + (evals - 1) * calibration["eval_s"])
    steps = int((seconds - overhead) // calibration["s_per_step"])
    if steps < 1:
        raise ValueError(f"a budget of {seconds:.0f} s leaves no training step: start-up and "
                         f"{evals} validation passes take {overhead:.0f} s and a step "
                         f"{calibration['s_per_step']:.2f} s; give more minutes")
    return steps


def budget_config(config, steps: int) -> ml_collections.ConfigDict:
    """`config` trained for `steps` steps with the same shape of run: as many validation passes
    and checkpoints as it has (one at the end included), warmup as the same share of the run,
    and about 20 log windows. The patterns are compared at the full context: context stages
    (which `calibrate` does not time) are dropped."""
    evals = -(-config.total_steps // config.eval_every)
    every = -(-steps // evals)
    warmup = config_lib.scaled_warmup(config.optimizer.warmup_steps, config.total_steps, steps)
    config = config.copy_and_resolve_references()
    config.total_steps, config.eval_every, config.checkpoint_every = steps, every, every
    config.log_every = max(1, steps // 20)
    config.optimizer.warmup_steps = warmup
    config.context_stages = ()
    return config


# ---------------------------------------------------------------------------------------------
# Measurements.


def _median(values):
    return statistics.median(values) if values else None


def summarize(run_dir: str, config) -> dict:
    """The measured row of one finished pattern run (see the module docstring)."""
    cfg = model_config(config.model)
    info = describe(cfg, config.batch_size)
    study = _read_json(os.path.join(run_dir, STUDY_FILE))
    sessions = sorted(study["sessions"], key=lambda s: s["start"])
    rows = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    # Wall time: a row belongs to the last session that started before it was written; earlier
    # sessions count up to their last kept row (a resumed run redoes what came after it).
    starts = [s["start"] for s in sessions]
    rows = [r for r in rows if "time" in r]  # rows of runs from before rows carried their time
    session = [max([0] + [k for k, t in enumerate(starts) if t <= r["time"]]) for r in rows]
    last = [max([r["time"] for r, i in zip(rows, session) if i == k], default=start)
            for k, start in enumerate(starts)]
    offsets = list(itertools.accumulate([t - start for t, start in zip(last, starts)], initial=0.0))
    wall_s = sum((s["end"] or t) - s["start"] for s, t in zip(sessions, last))
    windows, compiled, curve = [], set(), []
    for row, k in zip(rows, session):
        if row["split"] == "valid":
            curve.append([row["step"], round(offsets[k] + row["time"] - starts[k], 2),
                          row["bits"]])
        elif k in compiled:
            windows.append(row)
        else:  # the session's first log window includes compilation
            compiled.add(k)
    steps_per_s = _median([r["steps_per_s"] for r in windows])
    s_per_step = 1 / steps_per_s if steps_per_s else None
    return {
        "pattern": cfg.pattern, "spec": str(cfg.base_spec), "params": info["params"],
        "mean_keys_per_query": info["mean_keys_per_query"], "steps": study["final"]["step"],
        "s_per_step": s_per_step, "tokens_per_s": _median([r["tokens_per_s"] for r in windows]),
        "timed_windows": len(windows),
        "peak_rss_gb": max(s["peak_rss_gb"] or 0.0 for s in sessions),
        "valid_bits": study["final"]["bits"], "unit": study["final"]["unit"],
        "train_bits": next((r["bits"] for r in reversed(rows) if r["split"] == "train"), None),
        "wall_s": wall_s,
        "sessions": len(sessions),
        "curve": curve,  # [step, wall seconds, valid bits] of every validation pass
        "run_dir": run_dir,
    }


# ---------------------------------------------------------------------------------------------
# Outputs.


def markdown(rows: list[dict]) -> str:
    """The table of `summarize` rows; a "vs dense" column when dense was measured."""
    dense = next((r for r in rows if r["pattern"] == "dense"), None)
    table = [dict(r, vs_dense=None if dense is None else (  # only against a measured dense
        tools.ratio(r["s_per_step"], dense["s_per_step"]) or tools.NOT_MEASURED)) for r in rows]
    unit = rows[0]["unit"] if rows else "byte"
    return tools.markdown_table(table, [
        ("spec", "pattern"), ("params", "parameters"), ("mean_keys_per_query", "keys/query"),
        ("steps", "steps"), ("s_per_step", "s/step"), ("vs_dense", "time vs dense"),
        ("tokens_per_s", "tokens/s"),
        ("peak_rss_gb", "peak RSS GB"), ("valid_bits", f"valid bits/{unit}"),
        ("wall_s", "wall s")])


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """Validation bits against steps and against wall time, one line per pattern."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6), sharey=True)
    for r in rows:
        steps, seconds, bits = zip(*r["curve"]) if r["curve"] else ((), (), ())
        for ax, x in zip(axes, (steps, seconds)):
            ax.plot(x, bits, marker="o", markersize=3, label=r["pattern"])
    unit = rows[0]["unit"] if rows else "byte"
    axes[0].set_ylabel(f"validation bits/{unit}")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall time, s (compilation and validation included)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend()
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _length(info: dict) -> str:
    return f"{info['minutes']:g} min each" if info.get("minutes") else f"{info['steps']} steps"


def write_outputs(rows: list[dict], output_dir: str, info: dict) -> dict[str, str]:
    """results.md, results.json and valid_bits.png in `output_dir`; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    paths = {k: os.path.join(output_dir, name) for k, name in
             [("markdown", "results.md"), ("json", "results.json"), ("plot", "valid_bits.png")]}
    rows = [{k: v for k, v in r.items() if k != "run_dir"} for r in rows]
    _write_json(paths["json"], {**info, "patterns": rows})
    m = info["machine"]
    with open(paths["markdown"], "w") as f:
        if info.get("command"):
            f.write(f"```bash\n{info['command']}\n```\n\n")
        f.write(f"{info['config']}, {_length(info)} of {info['batch_size']} sequences, "
                f"seed {info['seed']}; {m['cpu']}, {m['cores']} cores, jax {m['jax']} "
                f"({m['backend']}).\n\n{markdown(rows)}\n\n{NOTE}\n")
    plot(rows, paths["plot"], f"{info['config']}, {_length(info)}")
    return paths


# ---------------------------------------------------------------------------------------------
# The study.


def _recorded(run_dir: str, config) -> ml_collections.ConfigDict:
    """The config recorded in `run_dir` if it differs from `config` only in `BUDGET_FIELDS` (a
    budgeted run of it), else `config` (which `run_status` then refuses)."""
    saved = config_lib.read_record(run_dir)
    same = not [k for k in config_lib.differences(saved, config) if k not in BUDGET_FIELDS]
    return saved if same else config


def _calibrated(run_dir: str, config, minutes: float, log) -> ml_collections.ConfigDict:
    """`config` with the steps that end training `minutes` after launch (`calibrate`, in a fresh
    process; the timings are kept in `run_dir/study.json`)."""
    os.makedirs(run_dir, exist_ok=True)
    config_lib.write_record(run_dir, config)  # what the calibration process reads
    log(f"{config.model.pattern}: timing start-up, a step and validation")
    out = tools.run_isolated(["-m", "sparse_jax.bench.pattern_study", "calibrate", run_dir,
                              repr(time.time())], timeout_s=None)
    if "error" in out:
        raise RuntimeError(f"timing pattern {config.model.pattern} failed: {out['error']}")
    steps = budget_steps(out, minutes * 60, -(-config.total_steps // config.eval_every))
    log(f"{config.model.pattern}: {out['s_per_step']:.3f} s/step, start-up "
        f"{out['startup_s']:.0f} s, validation {out['eval_s']:.1f} s: {steps} steps in "
        f"{minutes:g} min")
    study_path = os.path.join(run_dir, STUDY_FILE)
    _write_json(study_path, {**_read_json(study_path, {"sessions": []}), "calibration": out})
    return budget_config(config, steps)


def compare_patterns(config_spec: str, workdir: str, patterns=DEFAULT_PATTERNS, *,
                     steps: int | None = None, minutes: float | None = None,
                     overrides: dict | None = None, output_dir: str | None = None,
                     command: str | None = None, log=print) -> dict:
    """Trains and evaluates every pattern (see the module docstring) for `steps` steps each
    (default: the config's), or for `minutes` of wall time each; returns the JSON written to
    `output_dir/results.json` (default `workdir`) plus the output paths under "outputs"."""
    if minutes is not None and (steps is not None or not minutes > 0):
        raise ValueError("give either steps or minutes, and minutes > 0" if steps is None else
                         "give either --steps or --minutes, not both")
    by_pattern = pattern_configs(config_spec, patterns, steps=steps, overrides=overrides)
    runs = {p: os.path.join(workdir, p) for p in by_pattern}
    if minutes:  # runs already in the folder keep their steps; the others are timed first
        started = [p for p in by_pattern if workdir_lib.steps(runs[p])]
        for p in started:
            by_pattern[p] = _recorded(runs[p], by_pattern[p])
            run_status(runs[p], by_pattern[p])  # refuses another config before any timing
        for p in by_pattern:
            if p not in started:
                by_pattern[p] = _calibrated(runs[p], by_pattern[p], minutes, log)
    status = {p: run_status(runs[p], c) for p, c in by_pattern.items()}  # refuses before training
    for pattern, config in by_pattern.items():
        run_dir = runs[pattern]
        if status[pattern] == "done":
            log(f"{pattern}: finished in {run_dir}; reusing it")
            continue
        os.makedirs(run_dir, exist_ok=True)
        config_lib.write_record(run_dir, config)  # the config the worker process reads
        verb = "resuming" if status[pattern] == "resume" else "training"
        log(f"{pattern}: {verb} {config.total_steps} steps in {run_dir} "
            f"(log: {os.path.join(run_dir, 'train.log')})")
        out = tools.run_isolated(
            ["-m", "sparse_jax.bench.pattern_study", run_dir, repr(time.time())], timeout_s=None)
        if "error" in out or out.get("interrupted"):
            raise RuntimeError(f"pattern {pattern} did not finish "
                               f"({out.get('error') or out['interrupted']}); see "
                               f"{os.path.join(run_dir, 'train.log')}. Run the same command to "
                               "resume.")
    rows = [summarize(runs[p], c) for p, c in by_pattern.items()]
    for r in rows:
        log(f"{r['pattern']}: valid {r['valid_bits']:.4f} bits/{r['unit']}, "
            f"{r['s_per_step'] or float('nan'):.3f} s/step, {r['peak_rss_gb']:.2f} GB peak RSS")
    first = next(iter(by_pattern.values()))
    info = {"config": config_spec, "overrides": overrides or {},
            "steps": None if minutes else first.total_steps, "minutes": minutes,
            "batch_size": first.batch_size, "seed": first.seed, "command": command,
            "machine": tools.machine()}
    paths = write_outputs(rows, output_dir or workdir, info)
    return {**info, "patterns": rows, "outputs": paths}


def _worker(argv):
    from absl import logging

    if len(argv) == 4 and argv[1] == "calibrate":
        sharding.set_cpu_devices()
        print(json.dumps(calibrate(argv[2], float(argv[3]))), flush=True)
        return
    if len(argv) not in (2, 3):
        raise SystemExit("usage: python -m sparse_jax.bench.pattern_study [calibrate] RUN_DIR "
                         "[LAUNCH_TIME]")
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    sharding.set_cpu_devices()  # as scripts/train.py: one CPU device per core
    result = train_and_evaluate(argv[1], float(argv[2]) if len(argv) == 3 else None)
    print(json.dumps(result), flush=True)
    if result["interrupted"]:
        import signal

        sys.exit(128 + signal.Signals[result["interrupted"]].value)


if __name__ == "__main__":
    from absl import app

    app.run(_worker)
