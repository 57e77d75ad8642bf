"""The accelerator report (scripts/accelerator_report.py): its dry run end to end on the CPU, so
that a renamed flag, a moved function or a broken import fails here and not on the day a GPU
is lent; a stage that measured less than it planned is not "ok" (the H100 report said "every
stage ok" over a tests stage that ran no test, a preset cut before validation and an unmeasured
training step); a stopped report leaves no process and no temporary folder; its arguments are
checked before anything runs (the stages, the report folder: one that holds a report is replaced
only with --overwrite, and then wholly); a stage skipped is named, and a report that measured
nothing is not ok; rows not run print "—"; FlexAttention's mask against the pattern.

No outcome here reads a clock: the dry runs run under caps no loaded machine reaches
(`FAR_CAPS`), a test of the cap path gives a cap no machine can meet, and the waits end on
state, not on a timeout."""

import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

from conftest import cheap_compile, files_in, one_line_error
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.bench import accelerator, tools
from sparse_jax.bench.accelerator import attention, preset, tests, train_step
from sparse_jax.bench.accelerator.common import TIME_UP

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_CAP = 86_400  # s: a stage cap no machine reaches, however loaded (a day)
FAR_CAPS = "--caps=" + ",".join(f"{name}={NO_CAP}" for name in accelerator.MODULES)


def _report(tmp_path, *args, env=None):
    """Runs the script with its temporary folder under tmp_path/tmp, compiling cheaply (its dry
    run's cost is compiling toy programs: `cheap_compile`); (process, output dir).
    Every stage runs under FAR_CAPS, which no loaded machine reaches, unless ``args`` give
    --caps themselves (the flag given last wins). No timeout: the caps bound it."""
    out, tmp = tmp_path / "report", tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, "scripts/accelerator_report.py", "--dry_run",
                           f"--output_dir={out}", FAR_CAPS, *args], cwd=ROOT, capture_output=True,
                          text=True, env=cheap_compile({**os.environ, "TMPDIR": str(tmp),
                                                        **(env or {})}))
    return proc, out


def _refused(proc, *needles):
    """The script's one `error:` line, exit status 2 (a bad argument), no traceback."""
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: --") and "Traceback" not in proc.stderr
    assert all(n in proc.stderr for n in needles), proc.stderr


def _no_torch(tmp_path):
    """A folder that, first on PYTHONPATH, makes `import torch` fail as on a machine without it:
    the flex stage is skipped, at once."""
    folder = tmp_path / "no_torch"
    folder.mkdir(exist_ok=True)
    (folder / "torch.py").write_text("raise ImportError('No module named torch')\n")
    return str(folder)


def _left_in(tmp):
    return [name for name in os.listdir(tmp) if name.startswith(accelerator.TEMP_PREFIX)]


@pytest.mark.slow
def test_dry_run_runs_every_stage_and_writes_the_report(tmp_path):
    # Under caps no loaded machine reaches: the stages' own dry caps (the attention stage's
    # 40 s) cut a row on a busy machine ("not run: stage time up") and turned this red.
    every = [name for name in accelerator.MODULES if name != "study"]  # study: its own test
    proc, out = _report(tmp_path, "--profile", "--stages=" + ",".join(every))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    ok, verdict = accelerator.verdict(report)  # "every stage ok", or flex skipped, named
    assert ok and verdict in ("every stage ok", "every other stage ok; not every stage "
                              f"measured: flex skipped: {report['stages']['flex'].get('skipped')}")
    assert proc.stdout.strip().splitlines()[-1].endswith(verdict), proc.stdout[-500:]
    assert list(report["stages"]) == every
    assert set(accelerator.STAGES) <= set(every)
    for name, stage in report["stages"].items():
        torch_missing = name == "flex" and "torch is not installed" in stage.get("skipped", "")
        assert stage["status"] == "ok" or torch_missing, (name, stage, proc.stdout[-3000:])
    stages = report["stages"]
    assert stages["tests"]["counts"]["passed"] >= 1 and stages["tests"]["counts"]["failed"] == 0
    assert all("median_ms" in r or "not_measured" in r and "mgpu" in r["pattern"]
               for r in stages["attention"]["rows"]), stages["attention"]
    assert {r["pattern"].split("@")[1].split(":")[0] for r in stages["attention"]["rows"]} == {
        "xla", "pallas", "mgpu"}
    rounds = report["plan"]["attention"]["rounds"]  # timed interleaved with the default kernel
    by_pattern = {r["pattern"]: r for r in stages["attention"]["rows"]}
    variant = by_pattern["strided:16@pallas:16x16:chained:h2:one_loop"]
    assert variant["anchor"] == "strided:16@pallas:16x16" and variant["rounds"] == rounds
    assert len(variant["round_ratios"]) == rounds
    assert variant["ratio_min"] <= variant["ratio"] <= variant["ratio_max"]
    assert by_pattern["dense@xla"]["anchor"] is None and "ratio" not in by_pattern["dense@xla"]
    # jax's Mosaic GPU kernel has no GPU here: said, not timed; the forward-only row timed
    assert by_pattern["dense@mgpu"]["not_measured"].startswith("Mosaic GPU kernels run on")
    assert by_pattern["dense@xla:fwd"]["pass"] == "fwd" and by_pattern["dense@xla:fwd"][
        "median_ms"] > 0
    profiled = stages["train_step"]["rows"][0]["kernel_profile"]  # a CPU trace, read back
    assert profiled["kernels"] > 0 and profiled["top"] and profiled["kernels_ms"] > 0
    check = stages["train_step"]["dense_check"]  # no cuDNN here: XLA against the reference
    assert check["diffs"]["xla"]["within"] and "not_measured" in check["legs"]["cudnn"]
    assert stages["train_step"]["rows"][0]["tokens_per_s"] > 0
    profile = stages["train_step"]["profiles"][0]
    assert glob_count(profile["path"], "*.xplane.pb") >= 1, profile
    assert stages["counters"]["sample_rows"][0]["stalls"], stages["counters"]  # ncu's CSV read
    assert [v["variant"] for v in stages["counters"]["variants"]] == \
        report["plan"]["counters"]["variants"]  # each ran (under ncu where there is one)
    million = stages["million"]
    assert len(million["losses"]) == report["plan"]["million"]["steps"] + 1
    assert million["losses"][-1] < million["losses"][0] and million["planned_gb"] > 0
    preset_result = stages["preset"]
    assert preset_result["steps_done"] == preset_result["steps"]
    assert preset_result["test_bits"] > 0 and "valid_bits" in preset_result
    assert "from the measured step of tiny strided@xla" in preset_result["steps_how"]
    assert abs(sum(c["share"] for c in preset_result["test_classes"]["classes"]) - 1) < 1e-6
    files = sorted(os.listdir(out))  # one piece: the report's files, and the traces' folder
    assert files == ["log.txt", "profile", "results.json", "results.md", "sample.txt"]
    summary = (out / "results.md").read_text()
    assert verdict[0].upper() + verdict[1:] + "." in summary and "| preset | ok |" in summary
    assert "None" not in summary
    assert "Steps: " in summary and "Profile of tiny strided@xla" in summary
    assert "Kernel profile of tiny strided@xla" in summary
    assert "Dense check: xla equals the reference within bf16's tolerance" in summary
    assert "| dense@mgpu | 256 | — |" in summary
    assert _left_in(tmp_path / "tmp") == []


def glob_count(folder, pattern):
    import glob

    return len(glob.glob(os.path.join(folder, "**", pattern), recursive=True))


@pytest.mark.slow
def test_a_preset_cut_by_its_cap_is_not_ok(tmp_path, monkeypatch):
    # 100,000 steps cannot end inside an 8 s cap (train.py gets 10 s at least, then SIGTERM):
    # the cut does not depend on how busy the machine is. (With the dry plan's 4 steps, a warm
    # compilation cache let training finish inside the cap.)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    plan = accelerator.plan_for(dry_run=True)
    plan["preset"].update(default_steps=100_000, max_steps=100_000)
    report = accelerator.run_report(str(tmp_path / "r"), dry_run=True, stages=("preset",),
                                    caps={"preset": 8}, plan=plan, log=lambda *a: None)
    result = report["stages"]["preset"]
    assert result["status"] in ("partial", "failed") and result["reason"], result
    assert accelerator.not_ok(report) and accelerator.not_ok(report)[0].startswith("preset (")
    assert "**Not ok: preset (" in (tmp_path / "r/results.md").read_text()
    assert _left_in(tmp_path) == []


@pytest.mark.slow
def test_a_tests_stage_that_runs_no_test_is_not_ok(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    plan = accelerator.plan_for(dry_run=True)
    plan["tests"] = plan["tests"] + ["--collect-only"]  # pytest exits 0, having run nothing
    report = accelerator.run_report(str(tmp_path / "r"), dry_run=True, stages=("tests",),
                                    caps={"tests": NO_CAP}, plan=plan, log=lambda *a: None)
    result = report["stages"]["tests"]
    assert (result["status"], result["reason"]) == ("failed", "no test ran"), result
    assert accelerator.not_ok(report) == ["tests (failed: no test ran)"]
    assert "**Not ok: tests (failed: no test ran).**" in (tmp_path / "r/results.md").read_text()


def _dying(pid: int) -> bool:
    """Whether process `pid` is gone or on its way out: a zombie, exiting (PF_EXITING in its
    flags), or with a SIGKILL pending."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/status") as f:
            pending = [int(line.split()[1], 16) for line in f
                       if line.startswith(("SigPnd:", "ShdPnd:"))]
    except OSError:
        return True
    kill = 1 << (signal.SIGKILL - 1)
    return fields[0] in ("Z", "X") or bool(int(fields[6]) & 0x4) or any(p & kill
                                                                        for p in pending)


def _processes_with(marker: str, but: int) -> list[str]:
    """Live processes (not `but`) whose command line or environment holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == but:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            text = b""
            for part in ("cmdline", "environ"):
                with open(f"/proc/{pid}/{part}", "rb") as f:
                    text += f.read()
        except OSError:  # gone, or not ours
            continue
        if marker.encode() in text:
            found.append(f"{pid}: {text[:200]!r}")
    return found


@pytest.mark.slow
@pytest.mark.parametrize("sig, stage, child", [(signal.SIGTERM, "preset", "scripts/train.py"),
                                               (signal.SIGINT, "tests", "pytest")])
def test_a_stopped_report_leaves_no_process_and_no_temporary_folder(tmp_path, sig, stage,
                                                                    child):
    out, tmp = tmp_path / "report", tmp_path / "tmp"
    tmp.mkdir()
    driver = subprocess.Popen([sys.executable, "scripts/accelerator_report.py", "--dry_run",
                               f"--output_dir={out}", f"--stages={stage}", FAR_CAPS], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp)})
    try:
        # Until the stage's child runs (a driver that never starts it ends, at the latest, at
        # the stage's cap: a failure, however slow the machine).
        while not any(child in p for p in _processes_with(str(tmp), driver.pid)):
            assert driver.poll() is None, driver.communicate()
            time.sleep(0.2)
        driver.send_signal(sig)
        stdout, stderr = driver.communicate()
    finally:
        driver.kill()
    assert driver.returncode == 128 + sig, stdout[-2000:] + stderr[-2000:]
    assert f"interrupted by {sig.name}" in stdout.strip().splitlines()[-1]
    # Each process it started got SIGKILL: wait until they are reaped, and fail at once on one
    # that is still running and not dying (no clock: a busy machine reaps later, never red).
    while left := _processes_with(str(tmp), driver.pid):
        assert all(_dying(int(p.split(":")[0])) for p in left), left
        time.sleep(0.2)
    assert _left_in(tmp) == []
    report = json.loads((out / "results.json").read_text())  # the report of what ran stays
    assert report["interrupted"] == sig.name
    assert report["stages"][stage]["status"] == "interrupted"
    assert f"**Interrupted by {sig.name}**" in (out / "results.md").read_text()


def _wheel(path, member="pkg/__init__.py"):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, "x = 1\n")
        z.writestr("pkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\n")
    return path


def test_caps_budget_stages_and_wheels_are_checked_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert accelerator.parse_caps(["tests=150", "flex=90.5"]) == {"tests": 150.0, "flex": 90.5}
    for bad in (["tests"], ["gpu=10"], ["tests=-1"], ["tests=x"], ["env=nan"], ["env=inf"],
                ["env=0"]):
        with pytest.raises(ValueError, match="STAGE=SECONDS"):
            accelerator.parse_caps(bad)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels / "pkg-1.0-py3-none-any.whl")
    assert accelerator.check_arguments(wheels=str(wheels)) == [
        str(wheels / "pkg-1.0-py3-none-any.whl")]
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "a-1.0-py3-none-any.whl").write_bytes(
        (wheels / "pkg-1.0-py3-none-any.whl").read_bytes()[:-30])
    empty = tmp_path / "empty"
    empty.mkdir()
    for kwargs, message in [
            ({"stages": ("env", "benchmarks")}, "unknown stage"),
            ({"stages": ()}, "--stages is empty"),
            ({"stages": ("env", "flex", "env", "flex")}, "env, flex named more than once"),
            ({"caps": {"env": float("nan")}}, "STAGE=SECONDS"),
            ({"budget_s": -5}, "--budget_s=-5"), ({"budget_s": float("nan")}, "--budget_s"),
            ({"budget_s": 0}, "--budget_s"),
            ({"wheels": str(tmp_path / "missing")}, "no such folder"),
            ({"wheels": str(empty)}, "no .whl files"),
            ({"wheels": str(damaged)}, "a-1.0-py3-none-any.whl is not a readable wheel")]:
        with pytest.raises(ValueError, match=message) as e:
            accelerator.run_report(str(tmp_path / "r"), **kwargs)
        assert "\n" not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["damaged", "empty", "wheels"]  # nothing written


@pytest.mark.slow
def test_the_script_refuses_bad_arguments_in_one_line(tmp_path):
    for args, message in ((["--caps=env=nan"], "--caps"), (["--budget_s=-5"], "--budget_s"),
                          (["--budget_s=nan"], "--budget_s"),
                          # empty: refused, not taken for the default list (the whole report)
                          (["--stages="], "--stages= is an empty list"),
                          (["--stages=env,env"], "env given twice"),
                          (["--stages=env,,flex"], "an empty item")):
        proc, out = _report(tmp_path, *args)
        _refused(proc, message)
        assert not out.exists()
    assert _left_in(tmp_path / "tmp") == []


def test_a_stage_is_ok_only_if_it_measured_what_it_planned():
    plan = accelerator.plan_for(dry_run=False)
    assert tests.check({"counts": dict.fromkeys(tests.WORDS, 0), "done": True}, plan) == (
        "failed", "no test ran")
    assert tests.check({"counts": {**dict.fromkeys(tests.WORDS, 0), "passed": 3},
                        "done": True}, plan) is None
    rows = [{"name": "a", "step_s": 1.0}, {"name": "paper 16k dense (cuDNN)", "error": TIME_UP}]
    status, reason = train_step.check({"rows": rows}, plan)
    assert status == "partial" and "1 of 2 rows" in reason and TIME_UP in reason
    assert train_step.check({"rows": rows[1:]}, plan)[0] == "failed"
    done = {"steps": 100, "steps_done": 100, "valid_bits": 1.4, "test_bits": 1.4,
            "sample_path": "s"}
    assert preset.check(done, plan) is None
    assert preset.check({**done, "steps_done": 80}, plan)[0] == "partial"
    assert preset.check({k: v for k, v in done.items() if k != "valid_bits"}, plan) == (
        "partial", "no validation pass")
    report = {"dry_run": False, "started": "s", "finished": "f", "command": "c", "plan": plan,
              "stages": {"env": {"status": "ok", "seconds": 1},
                         "train_step": {"status": "partial", "reason": reason, "rows": rows}}}
    text = accelerator.summary_markdown(report)
    assert f"**Not ok: train_step (partial: {reason}).**" in text
    assert f"| train_step | partial | 0 | {reason} |" in text


def test_the_preset_plans_its_steps_from_the_measured_step_to_end_before_its_cap():
    p = accelerator.plan_for(dry_run=False)["preset"]
    # the H100 report: 0.0536 s a step, compiled in 15 s; train.py took 142 s for 1,680 steps
    rows = [{"name": "preset strided@pallas", "step_s": 0.0536, "compile_s": 15},
            {"name": "preset strided@pallas:onepass:s1:atomic", "step_s": 0.0601,
             "compile_s": 16}]
    train_s = accelerator.CAPS["preset"] - p["after_s"]
    steps, implementation, timed, how = preset.plan_steps(p, rows, train_s)
    assert implementation == "pallas" and timed is rows[0]
    assert steps * 0.0536 + 52 < train_s  # 52 s: what train.py took beyond its steps
    assert steps > 500 and f"{steps:,} steps from the measured step" in how
    assert preset.plan_steps(p, rows, 1000)[0] == int(p["train_seconds"] / 0.0536)
    assert preset.plan_steps(p, [], train_s)[:2] == (p["default_steps"], "xla")
    # the one-pass kernels, timed beside the default, train the preset where they win
    faster = [rows[0], {**rows[1], "step_s": 0.04}]
    assert preset.plan_steps(p, faster, train_s)[1] == "pallas:onepass:s1:atomic"
    # a kernel variant that wins the step trains the preset (model.kernel, as train.py takes it)
    rows.append({"name": "preset strided@pallas:terms", "step_s": 0.04, "compile_s": 16})
    variant = {**p, "preset_cases": [*p["preset_cases"], "preset strided@pallas:terms"]}
    assert preset.plan_steps(variant, rows, train_s)[1] == "pallas:terms"
    import configs
    from sparse_jax.model.config import model_config

    config = configs.load(p["config"], {"model.attention": "pallas", "model.kernel": "chained"})
    assert model_config(config.model).block_sizes.variant == "chained"


def test_flex_mask_mod_is_the_pattern():
    torch = pytest.importorskip("torch")
    for spec in (PatternSpec("strided", stride=16), PatternSpec("fixed", stride=16, c=4),
                 PatternSpec("strided", stride=12, local_width=30)):
        q, k = torch.arange(100)[:, None], torch.arange(100)[None, :]
        mask = accelerator.flex_mask_mod(spec)(0, 0, q, k)
        assert np.array_equal(mask.numpy(), spec.mask(100))


def test_the_full_plan_fits_nine_minutes_and_every_stage_has_its_parts():
    assert sum(accelerator.CAPS[s] for s in accelerator.STAGES) <= 540
    assert set(accelerator.STAGES) <= set(accelerator.MODULES)
    for name, module in accelerator.MODULES.items():
        assert module.CAP > 0 and module.DRY_CAP > 0, name
        assert callable(module.run) and callable(module.check) and callable(module.summary)
    plan = accelerator.plan_for(dry_run=False)
    assert set(accelerator.MODULES) <= set(plan)
    groups = plan["attention"]["groups"]  # the goal's length first, its variants next
    assert groups[0]["seq_len"] == groups[1]["seq_len"] == 16384
    for group in groups:  # every planned pattern string parses
        for pattern in group["patterns"]:
            attention.parse(pattern, group["seq_len"])
    names = {c["name"] for c in plan["train_step"]["cases"]}
    assert set(plan["preset"]["preset_cases"]) <= names and set(
        plan["train_step"]["profile"]) <= names
    assert accelerator.peak_tflops("NVIDIA H200") == 989.0
    assert accelerator.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert accelerator.peak_tflops("cpu") is None


def _skipped_flex():
    return {"status": "skipped", "skipped": "torch is not installed", "seconds": 1}


def test_a_skipped_stage_is_named_and_a_report_that_measured_nothing_is_not_ok():
    plan = accelerator.plan_for(dry_run=True)

    def report(**stages):
        return {"dry_run": True, "started": "s", "finished": "f", "command": "c", "plan": plan,
                "stages": stages}

    env, tests_ok = {"status": "ok", "seconds": 1}, {"status": "ok", "seconds": 2}
    named = "not every stage measured: flex skipped: torch is not installed"
    # something measured beside the skipped stage: ok, and the skip said
    both = report(env=env, tests=tests_ok, flex=_skipped_flex())
    assert accelerator.verdict(both) == (True, f"every other stage ok; {named}")
    assert f"**Every other stage ok; {named}.**" in accelerator.summary_markdown(both)
    # only the skipped stage, or env (the machine, not a measurement) and the skipped stage
    for nothing in (report(flex=_skipped_flex()), report(env=env, flex=_skipped_flex())):
        assert accelerator.measured_nothing(nothing)
        ok, line = accelerator.verdict(nothing)
        assert not ok and line == ("not ok: no stage measured anything (flex skipped: torch "
                                   "is not installed)")
        assert "Every stage ok" not in accelerator.summary_markdown(nothing)
        assert "**Not ok: no stage measured anything (flex skipped" in (
            accelerator.summary_markdown(nothing))
    assert accelerator.verdict(report(env=env)) == (True, "every stage ok")  # asked: env alone
    bad = report(env=env, tests={"status": "failed", "reason": "no test ran"},
                 flex=_skipped_flex())
    assert accelerator.verdict(bad) == (False, f"not ok: tests (failed: no test ran); {named}")


@pytest.mark.slow
def test_the_script_says_a_stage_was_skipped_and_exits_1_when_nothing_was_measured(tmp_path):
    # --dry_run --stages=flex without torch said "Every stage ok." and exited 0
    proc, out = _report(tmp_path, "--stages=flex",
                        env={"PYTHONPATH": _no_torch(tmp_path)})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.endswith("not ok: no stage measured anything (flex skipped: torch is not "
                         "installed (pip install -r requirements-bench.txt))"), last
    assert "Every stage ok" not in (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text())["stages"]["flex"]["status"] == (
        "skipped")
    assert _left_in(tmp_path / "tmp") == []


def _old_report(folder):
    """A folder holding an earlier report (every file a report writes) and a file of the
    user's."""
    (folder / "profile" / "old_case").mkdir(parents=True)
    (folder / "profile" / "old_case" / "trace.xplane.pb").write_bytes(b"old")
    for name in ("results.md", "results.json", "log.txt", "sample.txt"):
        (folder / name).write_text(f"old {name}\n")
    (folder / "notes.txt").write_text("mine\n")
    return files_in(folder)


def test_a_folder_that_holds_a_report_is_refused_without_overwrite(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    out = tmp_path / "r"
    assert accelerator.check_output_dir(str(out)) == []  # a new folder (not made yet)
    out.mkdir()
    assert accelerator.check_output_dir(str(out)) == []  # an empty one
    before = _old_report(out)
    for kwargs in ({}, {"stages": ("env",), "dry_run": True}):
        one_line_error(ValueError, lambda kwargs=kwargs: accelerator.run_report(
            str(out), **kwargs), f"--output_dir={out} holds a report (results.md, "
            "results.json, log.txt, sample.txt, profile)", "pass --overwrite")
    for name in accelerator.REPORT_FILES:  # any one of them is a report
        only = tmp_path / f"only_{name}"
        only.mkdir()
        if name == "profile":
            (only / name).mkdir()
        else:
            (only / name).write_text("x")
        one_line_error(ValueError, lambda only=only: accelerator.check_output_dir(str(only)),
                       "holds a report", "--overwrite")
    assert accelerator.check_output_dir(str(out), overwrite=True) == list(
        accelerator.REPORT_FILES)
    (tmp_path / "a_file").write_text("mine\n")
    for path, message in ((tmp_path / "a_file", "is a file, not a folder"),
                          (tmp_path / "a_file" / "report", "a_file is not a folder")):
        one_line_error(ValueError, lambda path=path: accelerator.run_report(
            str(path), overwrite=True), message)
    assert files_in(out) == before and (tmp_path / "a_file").read_text() == "mine\n"
    assert _left_in(tmp_path) == []  # refused before the temporary folder


@pytest.mark.slow
def test_the_script_refuses_a_report_folder_and_overwrite_replaces_it_wholly(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    before = _old_report(out)
    no_torch = {"PYTHONPATH": _no_torch(tmp_path)}
    proc, _ = _report(tmp_path, "--stages=flex", env=no_torch)
    _refused(proc, f"--output_dir={out} holds a report", "pass --overwrite")
    assert files_in(out) == before and sorted(os.listdir(out)) == sorted(
        [*accelerator.REPORT_FILES, "notes.txt"])  # the old log not even truncated
    assert _left_in(tmp_path / "tmp") == []
    # --overwrite: the old report's files all go (its sample and traces too), the user's stay
    proc, _ = _report(tmp_path, "--stages=flex", "--overwrite", env=no_torch)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr  # measured nothing
    assert sorted(os.listdir(out)) == ["log.txt", "notes.txt", "results.json", "results.md"]
    assert (out / "notes.txt").read_text() == "mine\n"
    assert list(json.loads((out / "results.json").read_text())["stages"]) == ["flex"]
    assert "old" not in (out / "log.txt").read_text()


def test_variants_are_timed_interleaved_with_their_default_kernel():
    anchor_of = attention.anchors(["dense@cudnn", "strided:128@pallas", "fixed:128:32@pallas",
                                   "strided:128@pallas:chained", "strided:128@pallas:32x32",
                                   "fixed:128:32@pallas:chained"])
    assert anchor_of == {"dense@cudnn": None, "strided:128@pallas": None,
                         "fixed:128:32@pallas": None,
                         "strided:128@pallas:chained": "strided:128@pallas",
                         "strided:128@pallas:32x32": "strided:128@pallas",
                         "fixed:128:32@pallas:chained": "fixed:128:32@pallas"}
    S, B, C, F, G, D = ("strided:128@pallas", "strided:128@pallas:chained",
                        "strided:128@pallas:32x32", "fixed:128:32@pallas",
                        "fixed:128:32@pallas:chained", "dense@cudnn")
    # rounds of A, B, A, C, A: each variant between two runs of its default; the variants'
    # order rotates, so that none always runs first
    assert tools.interleaved_order(anchor_of, 0) == [D, S, B, S, C, S, F, G, F]
    assert tools.interleaved_order(anchor_of, 1) == [D, S, C, S, B, S, F, G, F]


class _FakeGPU:
    """Calls that take the time a table gives them, on a clock of their own; ``slow`` makes the
    machine that many times slower from the call numbered ``slow_from`` to ``slow_to``."""

    def __init__(self, ms, slow=1.0, slow_from=0, slow_to=-1):
        self.now, self.count, self.ms = 0.0, 0, ms
        self.slow, self.slow_from, self.slow_to = slow, slow_from, slow_to
        self.log = []

    def clock(self):
        return self.now

    def call(self, name):
        def run():
            self.log.append(name)
            factor = self.slow if self.slow_from <= self.count < self.slow_to else 1.0
            self.now += self.ms[name] * factor / 1e3
            self.count += 1
        return run


def test_a_slow_stretch_moves_a_round_not_a_ratio():
    ms = {"A": 1.0, "B": 0.8, "C": 0.99}  # B 20% faster than the default A; C within 1%
    anchor_of = {"A": None, "B": "A", "C": "A"}
    # the machine runs at half speed for the first 4 calls: the first round's A, B, A, C
    gpu = _FakeGPU(ms, slow=2.0, slow_from=0, slow_to=4)
    rounds = tools.time_interleaved({n: gpu.call(n) for n in ms}, anchor_of, rounds=5,
                                    clock=gpu.clock)
    assert gpu.log[:5] == ["A", "B", "A", "C", "A"] and gpu.log[5:10] == ["A", "C", "A", "B", "A"]
    assert len(rounds) == 5 and [n for n, _ in rounds[0]] == ["A", "B", "A", "C", "A"]
    stats = tools.interleaved_stats(rounds, anchor_of)
    assert stats["B"]["ratio"] == pytest.approx(0.8) and not stats["B"]["within_noise"]
    assert stats["B"]["median_ms"] == pytest.approx(0.8)
    assert stats["B"]["max_ms"] == pytest.approx(1.6)
    # C's first round straddles the end of the stretch (1.98 ms between 2 and 1): that round's
    # ratio is off, its median is not
    assert stats["C"]["ratio"] == pytest.approx(0.99)
    assert stats["C"]["ratio_max"] == pytest.approx(1.32) and stats["C"]["within_noise"]
    assert len(stats["B"]["round_ratios"]) == 5 and stats["A"]["ratio"] == 1.0
    # the slow stretch shows as the default's own spread, run to run: 1 (0.5-1)
    assert (stats["A"]["ratio_min"], stats["A"]["ratio_max"]) == pytest.approx((0.5, 1.0))
    # timed one after another (all of A's runs, then B's, then C's), the same slow stretch
    # would have made A 2x slower in 4 of its 10 runs; interleaved, B's ratio is exact
    cell = attention.ratio_cell({**stats["B"]})
    assert cell == "0.8 (0.8–0.8)"


def test_rounds_that_disagree_are_within_noise_and_the_summary_says_so():
    anchor_of = {"A": None, "B": "A", "C": "A"}
    # per round (A, B, A, C, A, rotating): B 3% slower in some rounds, 3% faster in others;
    # C always 10% faster
    rounds = [[("A", 1.0), ("B", 1.03), ("A", 1.0), ("C", 0.9), ("A", 1.0)],
              [("A", 1.0), ("C", 0.9), ("A", 1.0), ("B", 0.97), ("A", 1.0)],
              [("A", 1.1), ("B", 1.1), ("A", 1.1), ("C", 0.99), ("A", 1.1)]]
    stats = tools.interleaved_stats(rounds, anchor_of)
    assert stats["B"]["within_noise"] and stats["B"]["ratio"] == pytest.approx(1.0)
    assert stats["B"]["ratio_min"] == pytest.approx(0.97)
    assert not stats["C"]["within_noise"] and stats["C"]["ratio"] == pytest.approx(0.9)
    assert tools.within_noise(stats["B"]["round_ratios"], [1.0, 1.0, 1.0])
    assert not tools.within_noise(stats["C"]["round_ratios"], stats["B"]["round_ratios"])
    assert attention.ratio_cell(stats["B"]).endswith(" ≈")
    names = {"A": "strided:128@pallas", "B": "strided:128@pallas:chained",
             "C": "strided:128@pallas:32x32"}
    rows = [{"pattern": names[n], "seq_len": 16384, **s} for n, s in stats.items()]
    line, _ = attention.fastest(rows)
    assert line.startswith("Fastest strided kernel at 16384: `strided:128@pallas:32x32`")
    assert "1.11× the default kernel (per round 1.11–1.11 over 3 rounds)" in line
    assert "within noise" not in line  # C is faster than the default and than B in every round
    # B and the default within noise of each other: the line says so
    line, _ = attention.fastest([r for r in rows if r["pattern"] != names["C"]])
    assert "`strided:128@pallas`, 1 ms, the default kernel." in line
    assert "`strided:128@pallas:chained` is within noise of it." in line


def test_attention_rows_past_the_stage_deadline_are_not_run():
    plan = accelerator.plan_for(dry_run=True)
    plan["deadline"] = time.time() - 60  # the cap already spent: nothing compiles or runs
    rows = attention.run(plan)["rows"]
    planned = [p for g in plan["attention"]["groups"] for p in g["patterns"]]
    assert [r["pattern"] for r in rows] == planned
    assert all(r["error"] == TIME_UP and "median_ms" not in r for r in rows), rows


def test_interleaved_timing_stops_at_the_deadline_after_one_round():
    gpu = _FakeGPU({"A": 1.0, "B": 2.0})
    clock = iter(range(100))
    rounds = tools.time_interleaved({n: gpu.call(n) for n in "AB"}, {"A": None, "B": "A"},
                                    rounds=7, repeats=3, clock=gpu.clock, deadline=0.5,
                                    now=lambda: next(clock))
    assert len(rounds) == 1 and gpu.log == ["A"] * 3 + ["B"] * 3 + ["A"] * 3
    stats = tools.interleaved_stats(rounds, {"A": None, "B": "A"})
    assert stats["B"]["ratio"] == pytest.approx(2.0) and stats["B"]["rounds"] == 1


def test_rows_not_run_print_a_dash_never_none():
    # --budget_s=1: every stage's rows "not run: stage time up", a training row "None × None"
    plan = accelerator.plan_for(dry_run=False)
    cut = {"status": "failed", "reason": "3 of 3 rows not measured", "seconds": 5}
    attention_rows = [{"pattern": p, "seq_len": 16384, "error": TIME_UP}
                      for p in plan["attention"]["groups"][0]["patterns"]]
    report = {"dry_run": False, "started": "s", "command": "c", "plan": plan, "stages": {
        "env": {"status": "partial", "reason": "no matmul measured", "seconds": 5,
                "device_kind": "NVIDIA H100", "versions": {}},
        "attention": {**cut, "rows": attention_rows},
        "flex": {**cut, "rows": [{"pattern": "dense@sdpa", "seq_len": 16384, "error": TIME_UP}]},
        "train_step": {**cut, "rows": [{"name": c["name"], "error": TIME_UP}
                                       for c in plan["train_step"]["cases"]]},
        "preset": {"status": "failed", "reason": "no training step logged", "seconds": 5,
                   "steps": 10, "config": "configs/bytes.py:size=gpu", "attention": "xla",
                   "overrides": {"data.path": "data/cpython_lib.py.gz"}}}}
    text = accelerator.summary_markdown(report)
    assert "None" not in text, text
    assert f"| {plan['train_step']['cases'][0]['name']} | — | — |" in text
    assert "| dense@sdpa | 16384 | — | — |" in text and "bf16 matmul: —." in text
    assert "— of 10 steps" in text
