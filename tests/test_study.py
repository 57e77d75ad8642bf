"""The pattern study on a tiny quickstart-shaped model: two patterns trained in their own
processes, the table, JSON and plot, reuse of finished runs, the timing arithmetic, and bad
input refused before anything trains."""

import json
import os
import subprocess
import sys
import time

import pytest

from sparse_jax.bench import pattern_study as study
from sparse_jax.model.config import model_config
from sparse_jax.run import config as config_lib
from sparse_jax.run.sizing import describe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py") + ":data=embedded"
# 1 layer, d=32, 2 rows of the 127-wide grid, 4 steps of 2 windows; 64 KB of embedded data.
SMALL = {"model.d_model": 32, "model.num_layers": 1, "model.seq_len": 254, "batch_size": 2,
         "data.embedded_bytes": 2**16, "log_every": 1, "eval_every": 2,
         "optimizer.warmup_steps": 1}
PATTERNS = ["dense", "fixed"]


def run_study(workdir, **kwargs):
    args = dict(steps=4, overrides=SMALL, output_dir=os.path.join(workdir, "out"),
                log=lambda line: None)
    return study.compare_patterns(QUICKSTART, workdir, PATTERNS, **{**args, **kwargs})


@pytest.fixture(scope="module")
def study_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("study"))
    return workdir, run_study(workdir)


def files_under(folder):
    """path -> (size, mtime) of every file below `folder`."""
    return {os.path.join(d, n): (os.path.getsize(os.path.join(d, n)),
                                 os.path.getmtime(os.path.join(d, n)))
            for d, _, names in os.walk(folder) for n in names}


@pytest.mark.slow  # starts other processes
def test_every_pattern_is_an_ordinary_run_measured_consistently(study_run):
    workdir, result = study_run
    rows = result["patterns"]
    assert [r["pattern"] for r in rows] == PATTERNS
    by_pattern = study.pattern_configs(QUICKSTART, PATTERNS, steps=4, overrides=SMALL)
    for r in rows:
        run_dir = os.path.join(workdir, r["pattern"])
        # a run evaluate/sample/train can open as any other
        config = config_lib.read_record(run_dir)
        assert config.to_dict() == by_pattern[r["pattern"]].to_dict()
        assert sorted(int(s) for s in os.listdir(os.path.join(run_dir, "checkpoints"))) == [2, 4]
        with open(os.path.join(run_dir, "eval", "valid_4.json")) as f:
            assert r["valid_bits"] == json.load(f)["bits"]  # the whole valid split, last step
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            metrics = [json.loads(line) for line in f]
        valid = [m for m in metrics if m["split"] == "valid"]
        assert [c[0] for c in r["curve"]] == [m["step"] for m in valid] == [2, 4]
        assert r["curve"][-1][2] == pytest.approx(r["valid_bits"], abs=1e-4)  # same split
        assert 0 < r["curve"][0][1] < r["curve"][1][1] <= r["wall_s"]
        assert 0 < r["valid_bits"] < 9 and r["steps"] == 4 and r["sessions"] == 1
        # Seconds per step: steps 2-4 (the window of step 1 includes compilation).
        train_rows = [m for m in metrics if m["split"] == "train"]
        assert r["timed_windows"] == len(train_rows) - 1 == 3
        assert r["s_per_step"] > 0 and 0.1 < r["peak_rss_gb"] < 8
        assert r["tokens_per_s"] * r["s_per_step"] == pytest.approx(2 * 254, rel=1e-6)
        info = describe(model_config(config.model))
        assert (r["params"], r["mean_keys_per_query"]) == (info["params"],
                                                           info["mean_keys_per_query"])
    dense, fixed = rows
    assert dense["params"] == fixed["params"]  # the same model
    assert dense["mean_keys_per_query"] == (254 + 1) / 2 > fixed["mean_keys_per_query"]

    out = os.path.join(workdir, "out")
    with open(os.path.join(out, "results.json")) as f:
        saved = json.load(f)
    assert saved["patterns"] == [{k: v for k, v in r.items() if k != "run_dir"} for r in rows]
    assert (saved["steps"], saved["batch_size"], saved["seed"]) == (4, 2, 0)
    assert saved["machine"]["cores"] >= 1
    with open(os.path.join(out, "results.md")) as f:
        table = f.read()
    assert table.count("\n| ") == 1 + len(rows)  # header and one line per pattern
    assert f"| dense | {dense['params']} | 128 |" in table
    assert f"{fixed['valid_bits']:.3g}" in table and "valid bits/byte" in table
    with open(os.path.join(out, "valid_bits.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # starts other processes
def test_rerun_reuses_finished_runs_without_training_or_overwriting(study_run, monkeypatch):
    workdir, result = study_run
    runs = {p: files_under(os.path.join(workdir, p)) for p in PATTERNS}

    def no_training(*args, **kwargs):
        raise AssertionError("a finished pattern was trained again")

    monkeypatch.setattr(study.tools, "run_isolated", no_training)
    again = run_study(workdir)
    assert again["patterns"] == result["patterns"]
    assert {p: files_under(os.path.join(workdir, p)) for p in PATTERNS} == runs


def test_wall_time_and_step_time_across_a_resumed_run(tmp_path):
    """Two sessions with a gap between them: the gap is not wall time, and the first log window
    of each session (compilation) is not step time."""
    config = study.pattern_configs(QUICKSTART, ["strided"], steps=4, overrides=SMALL)["strided"]
    run = tmp_path / "strided"
    run.mkdir()
    t0, t1 = 1000.0, 5000.0  # the run was interrupted after step 2 and resumed an hour later
    rows = [(2, "train", t0 + 10, 0.2), (2, "valid", t0 + 12, None),
            (3, "train", t1 + 9, 0.1), (4, "train", t1 + 10, 1.0), (4, "valid", t1 + 11, None)]
    with open(run / "metrics.jsonl", "w") as f:
        for step, split, time, speed in rows:
            row = {"step": step, "split": split, "time": time, "bits": 5.0 - step / 4}
            if speed:
                row.update(steps_per_s=speed, tokens_per_s=speed * 508)
            f.write(json.dumps(row) + "\n")
    sessions = [{"start": t0, "end": None, "step": None, "peak_rss_gb": None},  # killed
                {"start": t1, "end": t1 + 13, "step": 4, "peak_rss_gb": 0.7}]
    with open(run / "study.json", "w") as f:
        json.dump({"sessions": sessions, "final": {"step": 4, "bits": 3.9, "unit": "byte"}}, f)
    r = study.summarize(str(run), config)
    assert r["curve"] == [[2, 12.0, 4.5], [4, 12.0 + 11.0, 4.0]]
    assert r["wall_s"] == 12.0 + 13.0 and r["sessions"] == 2
    assert r["timed_windows"] == 1 and r["s_per_step"] == 1.0 and r["tokens_per_s"] == 508
    assert r["peak_rss_gb"] == 0.7 and r["valid_bits"] == 3.9


@pytest.mark.slow  # starts other processes
def test_bad_input_is_refused_before_anything_trains(study_run, tmp_path, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("trained despite bad input")

    monkeypatch.setattr(study.tools, "run_isolated", no_training)
    workdir = str(tmp_path / "runs")
    cases = [
        (dict(patterns=["dense", "sparse"]), "unknown pattern"),
        (dict(patterns=["dense", "dense"]), "listed twice"),
        (dict(steps=0), "steps must be a positive integer"),
        (dict(config=os.path.join(ROOT, "configs", "nope.py")), "nope.py not found"),
        (dict(overrides={**SMALL, "model.seq_len": 100}), r"pattern fixed: .*stride=127.*seq_len"),
        (dict(config=QUICKSTART + ",pattern=dense"), "comes from --patterns"),
        (dict(config=os.path.join(ROOT, "configs", "cifar10.py:size=tiny"), patterns=["local"]),
         "has no variant pattern=local"),
    ]
    for kwargs, message in cases:
        patterns = kwargs.pop("patterns", PATTERNS)
        config = kwargs.pop("config", QUICKSTART)
        args = {"steps": 4, "overrides": SMALL, "log": lambda line: None, **kwargs}
        with pytest.raises(ValueError, match=message):
            study.compare_patterns(config, workdir, patterns, **args)
    assert not os.path.exists(workdir)

    done, _ = study_run  # finished runs of 4 steps: a study of 6 steps must not touch them
    before = files_under(done)
    with pytest.raises(ValueError, match="holds a run of another config.*total_steps"):
        run_study(done, steps=6)
    assert files_under(done) == before

    out = subprocess.run(  # the script reports bad flags the same way, without a traceback
        [sys.executable, os.path.join(ROOT, "scripts", "compare_patterns.py"),
         f"--config={QUICKSTART}", f"--workdir={workdir}", "--patterns=dense,bogus"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "--patterns: unknown pattern(s) ['bogus']" in out.stderr
    assert "Traceback" not in out.stderr and not os.path.exists(workdir)


# ---------------------------------------------------------------------------------------------
# Equal wall-clock budgets (--minutes).


def test_budget_steps_fill_the_minutes_and_keep_the_shape_of_the_run():
    calibration = {"startup_s": 20.0, "first_eval_s": 6.0, "eval_s": 2.0, "s_per_step": 0.5}
    assert study.budget_steps(calibration, 120, evals=4) == (120 - 20 - 6 - 3 * 2) / 0.5 == 176
    with pytest.raises(ValueError, match="no training step.*more minutes"):
        study.budget_steps(calibration, 30, evals=4)
    base = study.pattern_configs(QUICKSTART, ["strided"], steps=400, overrides={
        **SMALL, "eval_every": 100, "optimizer.warmup_steps": 40})["strided"]
    config = study.budget_config(base, 176)
    assert (config.total_steps, config.eval_every, config.checkpoint_every, config.log_every,
            config.optimizer.warmup_steps) == (176, 44, 44, 8, 18)  # 4 passes, warmup 10%
    assert base.total_steps == 400 and base.eval_every == 100  # a copy
    assert set(config_lib.differences(base, config)) == set(study.BUDGET_FIELDS) - {
        "context_stages"}  # the base has none to drop
    staged = base.copy_and_resolve_references()
    staged.context_stages = ((100, 64, 16),)
    assert study.budget_config(staged, 176).context_stages == ()


def test_calibrate_times_a_real_run_and_writes_nothing(tmp_path):
    config = study.pattern_configs(QUICKSTART, ["strided"], steps=4, overrides=SMALL)["strided"]
    run = tmp_path / "strided"
    run.mkdir()
    config_lib.write_record(str(run), config)
    launched = time.time()
    out = study.calibrate(str(run), launched, steps=2)
    assert out["timed_steps"] == 2
    assert 0 < out["s_per_step"] < out["startup_s"] < time.time() - launched  # startup compiles
    assert 0 < out["eval_s"] and 0 < out["first_eval_s"]
    assert os.listdir(run) == ["config.json"]


@pytest.mark.slow  # starts another process
def test_each_pattern_gets_the_steps_its_timing_allows(tmp_path):
    base = study.pattern_configs(QUICKSTART, ["strided"], overrides={
        **SMALL, "total_steps": 8, "eval_every": 4})["strided"]
    run = str(tmp_path / "strided")
    config = study._calibrated(run, base, 10, log=lambda line: None)  # timed in a fresh process
    with open(os.path.join(run, "study.json")) as f:
        calibration = json.load(f)["calibration"]
    assert calibration["startup_s"] > calibration["s_per_step"] > 0
    steps = study.budget_steps(calibration, 600, evals=2)
    assert config.total_steps == steps and config.eval_every == -(-steps // 2)
    assert config_lib.read_record(run).total_steps == 8  # the record is written when it trains


def test_a_budgeted_run_keeps_its_steps_and_another_config_is_refused(tmp_path):
    base = study.pattern_configs(QUICKSTART, ["strided"], steps=40, overrides=SMALL)["strided"]
    run = str(tmp_path / "strided")
    os.makedirs(run)
    config_lib.write_record(run, study.budget_config(base, 123))
    assert study._recorded(run, base).total_steps == 123  # a rerun takes the recorded steps
    other = base.copy_and_resolve_references()
    other.model.d_model = 64
    assert study._recorded(run, other) is other  # which run_status then refuses
    with pytest.raises(ValueError, match="either"):
        study.compare_patterns(QUICKSTART, run, ["strided"], minutes=1, steps=4)
