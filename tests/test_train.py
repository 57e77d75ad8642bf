"""The trainer end to end on tiny configs and small files in the real formats: checkpoints, exact
resume after SIGKILL / SIGTERM, NaN, and bad input."""

import errno
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import configs
from conftest import fake_enwik8
from sparse_jax import files, train
from sparse_jax.data import cifar10, sources
from sparse_jax.data.batches import ByteWindows, Stage
from sparse_jax.run import config as config_lib
from sparse_jax.run import optim, setup
from sparse_jax.run import workdir as workdir_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def get_config(name, arg="size=tiny", **overrides):
    """configs/<name>.py:<arg>, then overrides given as {"optimizer__lr": ...}."""
    return configs.load(f"{name}:{arg or ''}",
                        {k.replace("__", "."): v for k, v in overrides.items()})


# A 2-layer, d=16 model on 20 KB of the generated stream: 4 steps, checkpoints at 2 and 4.
TINY_TEXT = dict(data__embedded_bytes=20_000, model__seq_len=64, model__num_layers=2,
                 model__d_model=16, model__num_heads=2, model__stride=8, batch_size=4,
                 total_steps=4, eval_every=2, checkpoint_every=2, log_every=2, eval_batches=2,
                 optimizer__warmup_steps=1, optimizer__lr=3e-2)


def read_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def checkpoint_steps(workdir):
    return sorted(int(p) for p in os.listdir(os.path.join(workdir, "checkpoints")) if p.isdigit())


# ---------------------------------------------------------------------------------------------
# End to end.


def test_tiny_enwik8_trains_checkpoints_logs_and_resumes(tmp_path, monkeypatch, capsys):
    zip_path, raw, md5 = fake_enwik8(tmp_path, size=20_000)
    monkeypatch.setattr(sources, "ENWIK8_SIZE", len(raw))
    monkeypatch.setattr(sources, "ENWIK8_MD5", md5)
    config = get_config("enwik8", "size=tiny", data__path=zip_path)
    monkeypatch.chdir(tmp_path)
    workdir = "run"  # relative, as users type it (Orbax itself needs absolute paths)
    result = train.train(config, workdir)
    assert result["step"] == 20 and result["interrupted"] is None
    assert np.isfinite(result["valid_bits"]) and 0 < result["valid_bits"] < 9
    assert result["best_valid_bits"] <= result["valid_bits"]
    rows = read_metrics(workdir)
    assert [(r["step"], r["split"]) for r in rows] == [
        (5, "train"), (10, "train"), (10, "valid"), (15, "train"), (20, "train"), (20, "valid")]
    assert {"bits", "lr", "grad_norm", "tokens_per_s", "steps_per_s"} <= set(rows[0])
    assert rows[-1]["bits"] == pytest.approx(result["valid_bits"])
    assert rows[0]["bits"] > rows[-2]["bits"]  # it learns something
    assert config_lib.read_record(workdir).to_dict() == config.to_dict()
    events = glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))
    assert events and os.path.getsize(events[0]) > 0
    assert checkpoint_steps(workdir) == [10, 20]
    out = capsys.readouterr().out
    assert "Starting" in out and "step 20/20" in out and "valid" in out

    again = train.train(config, workdir)  # a finished run resumes and does nothing
    out = capsys.readouterr().out
    assert "Resuming from step 20" in out and "nothing to do" in out
    assert again["step"] == 20 and len(read_metrics(workdir)) == len(rows)


def test_tiny_cifar10_trains_end_to_end(cifar, tmp_path, monkeypatch):
    data_dir, _ = cifar
    monkeypatch.setattr(cifar10, "CIFAR10_VALID_SIZE", 4)  # of the 20 images of the tiny archive
    config = get_config("cifar10", "size=tiny", data__data_dir=data_dir)
    result = train.train(config, str(tmp_path / "run"))
    assert result["step"] == 4 and 0 < result["valid_bits"] < 9
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows if r["split"] == "valid"] == [2, 4]


def test_golden_one_step(tmp_path):
    """A tiny model's training loss before and after one optimizer step, and its validation
    bits, pinned: any change to initialization, data order, the model's numerics or the
    optimizer moves them (values from the trainer as of the layout redesign, float32 on CPU)."""
    overrides = {**TINY_TEXT, "total_steps": 2, "log_every": 1, "eval_every": 2}
    result = train.train(get_config("quickstart", "data=embedded", **overrides),
                         str(tmp_path / "run"))
    bits = {(r["step"], r["split"]): r["bits"] for r in read_metrics(tmp_path / "run")}
    assert bits == {(1, "train"): pytest.approx(8.028453, abs=2e-5),
                    (2, "train"): pytest.approx(8.040126, abs=2e-5),
                    (2, "valid"): pytest.approx(8.167952, abs=2e-5)}
    assert result["valid_bits"] == bits[(2, "valid")]


# ---------------------------------------------------------------------------------------------
# Exact resume after SIGKILL and after SIGTERM, through scripts/train.py.


def start(workdir, byte_file, log):
    args = [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
            f"--config={os.path.join(ROOT, 'configs', 'bytes.py')}:size=tiny",
            f"--workdir={workdir}", f"--config.data.path={byte_file}",
            "--config.total_steps=60", "--config.checkpoint_every=10",
            "--config.eval_every=40", "--config.log_every=5", "--config.model.dropout=0.1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT)


def wait_for(predicate, process):
    """Until `predicate()` holds; the run is finite, so a predicate that never holds fails when
    the run ends (no clock: a loaded machine is slower, not wrong)."""
    while not predicate():
        assert process.poll() is None, "the run ended before the test could interrupt it"
        time.sleep(0.01)


@pytest.mark.slow  # starts other processes
def test_resume_after_sigkill_and_sigterm_gives_the_same_losses(tmp_path, byte_file):
    reference = str(tmp_path / "reference")
    assert start(reference, byte_file, tmp_path / "reference.log").wait() == 0

    workdir = str(tmp_path / "interrupted")
    run = start(workdir, byte_file, tmp_path / "1.log")
    wait_for(lambda: os.path.isdir(os.path.join(workdir, "checkpoints", "10")), run)
    run.send_signal(signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL

    run = start(workdir, byte_file, tmp_path / "2.log")
    wait_for(lambda: "Resuming from step" in (tmp_path / "2.log").read_text(), run)
    resumed = int((tmp_path / "2.log").read_text().split("Resuming from step ")[1].split()[0])
    assert 10 <= resumed < 60
    wait_for(lambda: max([0] + [r["step"] for r in read_metrics(workdir)]) > resumed + 5, run)
    run.send_signal(signal.SIGTERM)
    assert run.wait() == 128 + signal.SIGTERM
    log = (tmp_path / "2.log").read_text()
    stopped = int(log.split("Stopped by SIGTERM at step ")[1].split(";")[0])
    assert stopped in checkpoint_steps(workdir)

    run = start(workdir, byte_file, tmp_path / "3.log")
    assert run.wait() == 0
    assert f"Resuming from step {stopped}" in (tmp_path / "3.log").read_text()
    got, want = read_metrics(workdir), read_metrics(reference)
    assert [(r["step"], r["split"]) for r in got] == [(r["step"], r["split"]) for r in want]
    for a, b in zip(got, want):
        for key in ("bits", "grad_norm", "lr"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=0, abs=1e-6), (a, b)


def test_context_stages_train_short_windows_first_and_resume_exactly(tmp_path, capsys):
    """Steps 0-2 on 8 windows of 16 bytes, then 4 of 64: the logged speed counts each stage's
    tokens, and a run resumed from step 2 (before the switch) logs the same losses."""
    config = get_config("quickstart", "data=embedded", **{
        **TINY_TEXT, "total_steps": 6, "log_every": 1, "keep_checkpoints": 10,
        "context_stages": ((3, 16, 8),)})
    workdir = str(tmp_path / "run")
    assert train.train(config, workdir)["step"] == 6
    assert "batch 4 x 64 (steps < 3: 8 x 16)" in capsys.readouterr().out
    rows = [r for r in read_metrics(workdir) if r["split"] == "train"]
    per_step = [r["tokens_per_s"] / r["steps_per_s"] for r in rows]
    assert per_step == pytest.approx([128] * 3 + [256] * 3)
    stages = setup.run_stages(config, config_lib.check_config(config))
    assert stages == [Stage(until=3, seq_len=16, batch_size=8), Stage(6, 64, 4)]
    assert config_lib.context_stages(config) == (stages[0],)  # one spelling: (until, n, batch)
    assert [train.tokens_left(stages, s) for s in (0, 2, 3, 6)] == [
        3 * 128 + 3 * 256, 128 + 3 * 256, 3 * 256, 0]  # the ETA's work left
    assert [train.tokens_at(stages, s) for s in (0, 2, 3, 5, 6)] == [128, 128, 256, 256, 256]
    plain = str(tmp_path / "plain")  # the same run at the full context throughout
    train.train(get_config("quickstart", "data=embedded", **{
        **TINY_TEXT, "total_steps": 6, "log_every": 1, "keep_checkpoints": 10}), plain)
    other = [r["bits"] for r in read_metrics(plain) if r["split"] == "train"]
    assert rows[0]["bits"] != pytest.approx(other[0], abs=1e-4)  # the short windows were read
    assert train.train(config, workdir)["step"] == 6  # finished: resumes and does nothing
    assert "nothing to do" in capsys.readouterr().out
    resumed = str(tmp_path / "resumed")
    shutil.copytree(workdir, resumed)
    for step in checkpoint_steps(resumed):
        if step != 2:
            shutil.rmtree(os.path.join(resumed, "checkpoints", str(step)))
    train.train(config, resumed)
    assert "Resuming from step 2" in capsys.readouterr().out
    for a, b in zip(read_metrics(resumed), read_metrics(workdir), strict=True):
        assert (a["step"], a["split"]) == (b["step"], b["split"])
        assert a["bits"] == pytest.approx(b["bits"], rel=0, abs=1e-6)


@pytest.mark.parametrize("stages, message", [
    (((4, 16, 8),), "until_step 4 must lie after 0 and before total_steps=4"),
    (((2, 64, 8),), "seq_len 64 must be below model.seq_len=64"),
    (((2, 16, 3),), "batch_size 3 must be divisible by"),
    (((2, 16),), "is not (until_step, seq_len, batch_size)"),
    ((2, 16, 8), "2 is not (until_step, seq_len, batch_size) of positive integers; the field "
                 "is a tuple of (until_step, seq_len, batch_size), e.g. ((2000, 256, 16),)"),
    (((2, 16.0, 8),), "(2, 16.0, 8) is not (until_step, seq_len, batch_size)"),
    (((True, 16, 8),), "(True, 16, 8) is not (until_step, seq_len, batch_size)"),
    (((2, 16, 8), (2, 32, 8)), "until_step 2 must lie after 2"),
])
def test_bad_context_stages_are_refused_before_anything_runs(tmp_path, stages, message):
    config = get_config("quickstart", "data=embedded", **{**TINY_TEXT, "context_stages": stages,
                                                          "optimizer__grad_accum": 2})
    with pytest.raises(ValueError, match=re.escape(message)):
        train.train(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")


def test_a_record_from_before_context_stages_resumes(tmp_path):
    """config.json of a run recorded before the field existed reads as context_stages=()."""
    config = get_config("quickstart", "data=embedded", **TINY_TEXT)
    workdir = str(tmp_path / "run")
    train.train(config, workdir)
    path = os.path.join(workdir, "config.json")
    record = json.load(open(path))
    del record["context_stages"]
    json.dump(record, open(path, "w"))
    assert config_lib.resume_changes(config_lib.read_record(workdir), config, workdir) == {}


def test_a_shortened_run_warms_up_for_its_share_and_its_resume_keeps_that_warmup(tmp_path,
                                                                                  capsys):
    """quickstart:data=embedded (500 steps, warmup 50) run for 4 steps with its warmup left to
    the preset (scripts/train.py passes the preset's total_steps): warmup 1, said in one line,
    recorded; resumed for 6 steps it keeps warmup 1 (not 1 of 6 recomputed, nor the preset's
    50, which the resume would refuse) and records only the change of total_steps."""
    left = {k: v for k, v in TINY_TEXT.items() if k != "optimizer__warmup_steps"}
    preset = configs.load("quickstart:data=embedded")
    workdir = str(tmp_path / "run")
    config = get_config("quickstart", "data=embedded", **left)
    assert config.optimizer.warmup_steps == preset.optimizer.warmup_steps == 50
    assert train.train(config, workdir, preset.total_steps)["step"] == 4
    lines = [x for x in capsys.readouterr().out.splitlines() if "warmup" in x]
    assert len(lines) == 1 and "warmup_steps=1 instead of the preset's 50" in lines[0]
    assert config_lib.read_record(workdir).optimizer.warmup_steps == 1
    config = get_config("quickstart", "data=embedded", **{**left, "total_steps": 6})
    assert train.train(config, workdir, preset.total_steps)["step"] == 6
    assert "the run being resumed trained with" in capsys.readouterr().out
    assert config_lib.read_record(workdir).optimizer.warmup_steps == 1
    history = [json.loads(x) for x in open(os.path.join(workdir, config_lib.HISTORY))]
    assert [h["changes"] for h in history] == [{"total_steps": [4, 6]}]


@pytest.mark.slow  # starts another process
def test_describe_sizes_the_mesh_that_train_builds_here():
    """scripts/describe.py splits a CPU into the devices scripts/train.py would (one per core,
    its --cpu_devices default), so the per-device memory it reports is for train's mesh."""
    from sparse_jax import sharding

    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "describe.py"),
                          f"--config={os.path.join(ROOT, 'configs', 'quickstart.py')}", "--json"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["per_device"]["mesh"] == sharding.mesh_shape(
        sharding.cpu_cores(), -1, 1)


# ---------------------------------------------------------------------------------------------
# Failures.


def test_nan_loss_stops_with_error_and_keeps_the_last_good_checkpoint(tmp_path, byte_file,
                                                                       monkeypatch):
    real_batch = ByteWindows.batch_at

    def corrupt(self, step):  # from the 7th step on, a token outside the vocabulary: NaN
        batch = real_batch(self, step)
        if step >= 6:
            batch["inputs"][0, 0] = 1000
        return batch

    monkeypatch.setattr(ByteWindows, "batch_at", corrupt)
    config = get_config("bytes", data__path=byte_file, checkpoint_every=5)
    workdir = str(tmp_path / "run")
    with pytest.raises(FloatingPointError,
                       match=r"non-finite training loss at step 7 \(loss nan") as e:
        train.train(config, workdir)
    assert "last good checkpoint is step 5" in str(e.value)
    assert checkpoint_steps(workdir) == [5]

    monkeypatch.setattr(ByteWindows, "batch_at", real_batch)  # the data is fixed: resume
    assert train.train(config, workdir)["step"] == 20


def test_missing_dataset_fails_before_the_model_is_built(tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("built the model before checking the data")

    monkeypatch.setattr(optim, "SparseTransformer", no_model)  # where the trainer builds it
    config = get_config("enwik8", data__path=str(tmp_path / "corpora" / "enwik8.zip"))
    with pytest.raises(FileNotFoundError, match="mattmahoney.net"):
        train.train(config, str(tmp_path / "run1"))
    config = get_config("cifar10", data__data_dir=str(tmp_path / "tfds"),
                        data__manual_dir=str(tmp_path / "manual"))
    with pytest.raises(FileNotFoundError, match="cifar-10-binary.tar.gz"):
        train.train(config, str(tmp_path / "run2"))
    config = get_config("bytes", data__path=None)  # --config.data.path unset
    with pytest.raises(ValueError, match="data.path"):
        train.train(config, str(tmp_path / "run3"))


def test_context_length_the_pattern_cannot_serve(tmp_path, byte_file):
    config = get_config("bytes", data__path=byte_file, model__seq_len=8)  # stride 16 > 8
    with pytest.raises(ValueError, match="stride"):
        train.train(config, str(tmp_path / "run"))
    config = get_config("cifar10", model__seq_len=1024)  # an image has 3,072 sub-pixels
    with pytest.raises(ValueError, match="image_shape"):
        train.train(config, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run")  # refused before touching the workdir


def test_workdir_with_a_checkpoint_of_another_config_is_refused(tmp_path, byte_file):
    workdir = str(tmp_path / "run")
    train.train(get_config("bytes", data__path=byte_file), workdir)
    def files():  # path -> (size, mtime) of every file; the write probe touches only the folder
        paths = glob.glob(os.path.join(workdir, "**"), recursive=True)
        return {p: (os.path.getsize(p), os.path.getmtime(p)) for p in paths if os.path.isfile(p)}

    before = files()
    for change, field in [({"model__d_model": 32}, "model.d_model"),
                          ({"data__seed": 1}, "data.seed"), ({"seed": 3}, "seed"),
                          ({"optimizer__lr": 1e-2}, "optimizer.lr"),
                          ({"batch_size": 8}, "batch_size")]:
        other = get_config("bytes", data__path=byte_file, **change)
        with pytest.raises(ValueError, match="trained with another config; refusing") as e:
            train.train(other, workdir)
        assert f"{field}: " in str(e.value) and "\n" not in str(e.value)
    assert files() == before  # nothing written, nothing overwritten


def test_allowed_changes_on_resume_are_recorded(tmp_path, byte_file, capsys):
    workdir = str(tmp_path / "run")
    config = get_config("quickstart", "data=embedded", **TINY_TEXT)
    train.train(config, workdir)
    record = open(os.path.join(workdir, "config.json")).read()
    assert train.train(config, workdir)["step"] == 4  # nothing to do, nothing rewritten
    assert open(os.path.join(workdir, "config.json")).read() == record
    assert not os.path.exists(os.path.join(workdir, "config_history.jsonl"))
    longer = get_config("quickstart", "data=embedded", **{**TINY_TEXT, "total_steps": 6,
                                                          "eval_every": 3})
    assert train.train(longer, workdir)["step"] == 6
    assert config_lib.read_record(workdir).to_dict() == longer.to_dict()
    (row,) = [json.loads(line) for line in open(os.path.join(workdir, "config_history.jsonl"))]
    assert row["step"] == 4 and row["changes"] == {"eval_every": [2, 3], "total_steps": [4, 6]}


def test_workdir_of_someone_else_is_refused(tmp_path, byte_file):
    config = get_config("bytes", data__path=byte_file)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"files this project did not write \(notes.txt\)"):
        train.train(config, str(tmp_path / "theirs"))
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "config.json").write_text('{"learning_rate": 1}')
    with pytest.raises(ValueError, match="config.json was not written by this project"):
        train.train(config, str(tmp_path / "json"))
    assert (tmp_path / "theirs" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "json" / "config.json").read_text() == '{"learning_rate": 1}'


def test_damaged_newest_checkpoint_falls_back_and_is_kept(tmp_path, capsys):
    config = get_config("quickstart", "data=embedded", **{**TINY_TEXT, "log_every": 1})
    reference = str(tmp_path / "reference")
    train.train(config, reference)
    workdir = str(tmp_path / "run")
    train.train(config, workdir)
    assert checkpoint_steps(workdir) == [2, 4]
    # Torn writes: every file of the newest parameters cut short. (Cutting only the largest
    # file was not always enough: which file holds the arrays depends on how Orbax's writer
    # threads ran, and a cut file that no array is read from leaves the checkpoint readable.)
    victims = [p for p in glob.glob(os.path.join(workdir, "checkpoints", "4", "params", "**", "*"),
                                    recursive=True) if os.path.isfile(p)]
    for victim in victims:
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) // 2)
    damaged = {p: open(p, "rb").read() for p in victims}
    capsys.readouterr()
    train.train(config, workdir)
    err = capsys.readouterr().err
    assert "warning: checkpoint 4" in err and "resumed from step 2" in err
    for victim, content in damaged.items():  # kept, never deleted
        aside = victim.replace(os.path.join("checkpoints", "4"),
                               os.path.join("damaged_checkpoints", "4"))
        assert open(aside, "rb").read() == content
    assert checkpoint_steps(workdir) == [2, 4]
    got = {r["step"]: r["bits"] for r in read_metrics(workdir) if r["split"] == "train"}
    want = {r["step"]: r["bits"] for r in read_metrics(reference) if r["split"] == "train"}
    assert got == pytest.approx(want, abs=1e-6)  # steps 3-4 trained again, the same way


def test_a_torn_last_metrics_line_is_dropped_when_the_run_resumes(tmp_path):
    config = get_config("quickstart", "data=embedded", **TINY_TEXT)
    workdir = str(tmp_path / "run")
    train.train(config, workdir)
    kept = read_metrics(workdir)
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "split": "tra')  # a write cut short after the last checkpoint
    config.total_steps = 6
    assert train.train(config, workdir)["step"] == 6  # no manual repair needed
    rows = read_metrics(workdir)
    assert rows[:len(kept)] == kept and [r["step"] for r in rows[len(kept):]] == [6, 6]


def test_a_second_trainer_on_a_workdir_in_use_is_refused(tmp_path):
    from sparse_jax.run import workdir as workdir_lib

    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    config = get_config("quickstart", "data=embedded", **TINY_TEXT)
    with workdir_lib.lock(workdir):
        with pytest.raises(OSError,
                           match=f"in use by another training process \\(pid {os.getpid()}"):
            train.train(config, workdir)
    assert train.train(config, workdir)["step"] == 4  # released


def test_unwritable_workdir_is_a_clear_error(tmp_path, byte_file):
    (tmp_path / "file").write_text("not a folder")
    config = get_config("bytes", data__path=byte_file)
    with pytest.raises(OSError, match="cannot write to the workdir"):
        train.train(config, str(tmp_path / "file" / "run"))
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(OSError, match="cannot write to the workdir"):
            train.train(config, str(tmp_path / "ro"))


def test_failed_checkpoint_write_is_a_clear_error_and_keeps_earlier_ones(tmp_path, byte_file,
                                                                          monkeypatch):
    from orbax.checkpoint._src.handlers import json_checkpoint_handler as jch

    real = jch.JsonCheckpointHandler._save_fn

    async def disk_full(self, item, directory):  # fails in the background, as a full disk does
        if isinstance(item, dict) and item.get("step", 0) >= 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return await real(self, item, directory)

    monkeypatch.setattr(jch.JsonCheckpointHandler, "_save_fn", disk_full)
    threads_before = set(threading.enumerate())
    config = get_config("bytes", data__path=byte_file, checkpoint_every=5)
    workdir = str(tmp_path / "run")
    with pytest.raises(OSError, match="could not write the checkpoint of step 10") as e:
        train.train(config, workdir)
    assert "disk full" in str(e.value) and "intact: steps [5]" in str(e.value)
    assert checkpoint_steps(workdir) == [5]

    # In-process only: the failed save's other writers (params, opt) may still be finishing in
    # Orbax's background threads; a real process would exit first. Let them finish before the
    # resume cleans up the unfinished step directory. (Only threads this run started: earlier
    # tests leave long-lived pool threads that would each cost the whole timeout.)
    deadline = time.time() + 30
    for thread in set(threading.enumerate()) - threads_before:
        if not thread.daemon:
            thread.join(timeout=max(0.0, deadline - time.time()))
    monkeypatch.setattr(jch.JsonCheckpointHandler, "_save_fn", real)  # space freed: resume
    assert train.train(config, workdir)["step"] == 20
    assert checkpoint_steps(workdir) == [15, 20]


def full_disk(monkeypatch, where: str, from_step: int) -> None:
    """Makes the writes of `where` ("metrics.jsonl": `files.append_line`'s single write;
    "tensorboard": the event file's records) fail as on a full disk from step `from_step` on."""
    full = OSError(errno.ENOSPC, "No space left on device")
    if where == "metrics.jsonl":
        class Os:  # `os` as sparse_jax.files sees it
            def __getattr__(self, name):
                return getattr(os, name)

            @staticmethod
            def write(fd, data):
                if json.loads(data).get("step", 0) >= from_step:
                    raise full
                return os.write(fd, data)

        monkeypatch.setattr(files, "os", Os())
    else:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.record_writer import RecordWriter

        real = RecordWriter.write

        def write(self, data):
            if Event.FromString(data).step >= from_step:
                raise full
            return real(self, data)

        monkeypatch.setattr(RecordWriter, "write", write)


LOG_EVERY_STEP = {**TINY_TEXT, "log_every": 1}  # 4 steps, checkpoints at 2 and 4


@pytest.fixture(scope="module")
def resumed_to_8(tmp_path_factory):
    """The metrics of a run trained to step 4, then resumed to step 8, without a failure."""
    workdir = str(tmp_path_factory.mktemp("reference") / "run")
    train.train(get_config("quickstart", "data=embedded", **LOG_EVERY_STEP), workdir)
    train.train(get_config("quickstart", "data=embedded", **{**LOG_EVERY_STEP, "total_steps": 8}),
                workdir)
    return read_metrics(workdir)


@pytest.mark.parametrize("where", ["metrics.jsonl", "tensorboard"])
def test_full_disk_at_a_log_is_one_line_and_the_next_start_resumes(tmp_path, monkeypatch, where,
                                                                    resumed_to_8):
    """The disk fills up as a resumed run logs step 6 (metrics.jsonl, or TensorBoard's event
    file): one line that says so, names the file and what to do; every file written before is
    whole (the logs only grew); with space freed, the same command resumes and logs what a run
    that never failed logs."""
    workdir = str(tmp_path / "run")
    train.train(get_config("quickstart", "data=embedded", **LOG_EVERY_STEP), workdir)
    longer = get_config("quickstart", "data=embedded", **{**LOG_EVERY_STEP, "total_steps": 8})

    def files_now():  # relative path -> bytes; config.json is rewritten by the longer run
        paths = glob.glob(os.path.join(workdir, "**"), recursive=True)
        return {os.path.relpath(p, workdir): open(p, "rb").read() for p in paths
                if os.path.isfile(p) and not p.endswith("config.json")}

    before = files_now()
    full_disk(monkeypatch, where, from_step=6)
    with pytest.raises(OSError) as e:
        train.train(longer, workdir)
    message = str(e.value)
    assert "\n" not in message and os.path.join(workdir, where) in message
    assert "the disk is full" in message and "run the same command again" in message
    after = files_now()
    assert all(after[p][:len(content)] == content for p, content in before.items())
    assert checkpoint_steps(workdir) == [2, 4]

    monkeypatch.undo()  # space freed
    assert train.train(longer, workdir)["step"] == 8
    got = read_metrics(workdir)
    assert [(r["step"], r["split"]) for r in got] == [(r["step"], r["split"]) for r in resumed_to_8]
    assert [r["bits"] for r in got] == pytest.approx([r["bits"] for r in resumed_to_8], abs=1e-6)


@pytest.mark.parametrize("module, writer, name, resume", [
    (config_lib, "atomic_write", "config.json", False),
    (workdir_lib, "atomic_write", "data_fingerprint.json", False),
    (config_lib, "append_line", "config_history.jsonl", True),
])
def test_full_disk_at_the_run_record_is_one_line_and_the_next_start_runs(
        tmp_path, monkeypatch, module, writer, name, resume):
    """The disk is full when a new run records its config or data, or when a resume records an
    allowed change: one line naming the file; with space freed, the same command runs."""
    workdir = str(tmp_path / "run")
    config = get_config("quickstart", "data=embedded", **TINY_TEXT)
    if resume:
        train.train(config, workdir)
        config = get_config("quickstart", "data=embedded", **{**TINY_TEXT, "total_steps": 6})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module, writer, full)
    with pytest.raises(OSError) as e:
        train.train(config, workdir)
    message = str(e.value)
    assert "\n" not in message and os.path.join(workdir, name) in message
    assert "the disk is full" in message and "run the same command again" in message
    monkeypatch.undo()  # space freed
    assert train.train(config, workdir)["step"] == config.total_steps
