"""The report's driver: its arguments checked before anything runs, each stage in its own process
(its own session) with its own cap, every stage judged ok / partial / failed / skipped, and
nothing left behind: a SIGINT or SIGTERM kills the running stage's process group, and the
temporary folder (installed wheels, the preset's run, the stages' TMPDIR) goes in every case."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile

from sparse_jax import cli
from sparse_jax.bench import predictions
from sparse_jax.bench.accelerator.common import REPO
from sparse_jax.bench.accelerator.plan import CAPS, DRY_CAPS, MODULES, STAGES, plan_for
from sparse_jax.bench.accelerator.summary import not_ok, summary_markdown
from sparse_jax.bench.accelerator.train_step import PROFILE_S

TEMP_PREFIX = "sparse_jax_accel_"
# What a report writes to its folder: a folder holding any of them holds a report.
REPORT_FILES = ("results.md", "results.json", "log.txt", "sample.txt", "profile")


def parse_caps(items) -> dict:
    """``["tests=150", ...]`` -> {"tests": 150.0}; a bad item is a ValueError."""
    caps = {}
    for item in items or ():
        name, sep, seconds = item.partition("=")
        try:
            if not sep or name not in MODULES:
                raise ValueError
            caps[name] = cli.seconds("caps", seconds)
        except ValueError:
            raise ValueError(f"--caps: {item!r} is not STAGE=SECONDS with a stage of "
                             f"{', '.join(MODULES)} and a positive number of seconds up to "
                             f"{cli.MAX_SECONDS:,} (a week)") from None
    return caps


def check_wheels(folder: str) -> list[str]:
    """The wheels in `folder`, each checked to be a readable zip (every member's CRC) with a
    .dist-info/WHEEL file; a ValueError naming the first that is not."""
    if not os.path.isdir(folder):
        raise ValueError(f"--wheels={folder}: no such folder")
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not wheels:
        raise ValueError(f"--wheels={folder}: no .whl files there; fill it with pip download "
                         "as README's 'Accelerators' says")
    for path in wheels:
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
                has_wheel = any(n.endswith(".dist-info/WHEEL") for n in z.namelist())
        except (OSError, zipfile.BadZipFile, RuntimeError) as e:
            raise ValueError(f"--wheels: {path} is not a readable wheel "
                             f"({' '.join(str(e).split())}); download it again") from None
        if bad or not has_wheel:
            what = f"a damaged member {bad}" if bad else "no .dist-info/WHEEL"
            raise ValueError(f"--wheels: {path} is not a readable wheel ({what}); download "
                             "it again")
    return wheels


def check_arguments(stages=STAGES, caps: dict | None = None, budget_s: float | None = None,
                    wheels: str | None = None) -> list[str]:
    """Everything the command was given, checked before any stage starts: a ValueError of one
    line for the first thing wrong. Returns the wheels to install."""
    stages = tuple(stages)
    if not stages:
        raise ValueError(f"--stages is empty; name one or more of {', '.join(MODULES)}, or "
                         f"leave the flag out for {','.join(STAGES)}")
    unknown = [s for s in stages if s not in MODULES]
    if unknown:
        raise ValueError(f"--stages: unknown stage(s) {', '.join(map(repr, unknown))}; choose "
                         f"from {', '.join(MODULES)}")
    twice = [s for s in dict.fromkeys(stages) if stages.count(s) > 1]
    if twice:
        raise ValueError(f"--stages: {', '.join(twice)} named more than once; name each stage "
                         "once")
    for name, seconds in (caps or {}).items():
        parse_caps([f"{name}={seconds}"])
    if budget_s is not None:
        cli.seconds("budget_s", budget_s)
    return check_wheels(wheels) if wheels is not None else []


def check_output_dir(output_dir: str, overwrite: bool = False) -> list[str]:
    """Before anything runs: the files of an earlier report in `output_dir` (`REPORT_FILES`
    there) that this run replaces, [] for a new or empty folder. A ValueError of one line if
    `output_dir` is not a folder, cannot be made or written, or holds a report and `overwrite`
    is not set (a report is never mixed with another, nor replaced unasked)."""
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output_dir={output_dir} is a file, not a folder; choose another "
                         "--output_dir")
    existing = os.path.abspath(output_dir)
    while not os.path.lexists(existing):  # the folder the report's folders are made in
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output_dir={output_dir}: {existing} is not a folder this user can "
                         "write in; choose another --output_dir")
    old = [name for name in REPORT_FILES if os.path.lexists(os.path.join(output_dir, name))]
    if old and not overwrite:
        raise ValueError(f"--output_dir={output_dir} holds a report ({', '.join(old)}); pass "
                         "--overwrite to replace it, or choose another --output_dir")
    return old


def _remove_old_report(output_dir: str, old: list[str]) -> None:
    """Removes the earlier report's files (`check_output_dir`), so that none of them stays
    beside the new report's; whatever else the folder holds stays."""
    for name in old:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)


def install_wheels(wheels: list[str], target: str) -> list[str]:
    """Installs the wheels into `target` (no network, no dependencies resolved, nothing of the
    machine's own packages touched) and returns their names. The caller puts `target` first on
    the path, so these versions win over the machine's."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--no-compile", "--disable-pip-version-check",
                           "--target", target, *wheels], capture_output=True, text=True)
    if proc.returncode != 0:
        last = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        raise ValueError(f"--wheels: pip could not install them: {(last or ['?'])[-1]}")
    return [os.path.basename(w) for w in wheels]


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM to the driver (a KeyboardInterrupt: outside the stages' loop, the
    entry point ends with "interrupted" like any other)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


def _stage_process(name: str, plan: dict, cap: float, env: dict, log) -> dict:
    """Runs one stage in a fresh process, in its own session, for at most `cap` seconds; its
    output goes to `log`. Returns its last JSON line with "status" and, unless ok, a one-line
    "reason". An Interrupted while it runs kills its process group (the stage and whatever it
    started), records what it had printed, and goes on up."""
    start = time.time()
    plan = {**plan, "deadline": start + cap}
    log.write(f"\n===== stage {name} (cap {cap:.0f} s) =====\n")
    log.flush()
    proc = subprocess.Popen([sys.executable, "-m", "sparse_jax.bench.accelerator", name,
                             json.dumps(plan)], stdout=subprocess.PIPE, stderr=log, text=True,
                            cwd=REPO, env=env, start_new_session=True)
    outcome, out = "exited", ""
    try:
        out, _ = proc.communicate(timeout=cap + 10)
    except subprocess.TimeoutExpired:
        outcome = "timed out"
    except Interrupted as e:
        outcome = e
    finally:
        _kill_group(proc)  # also whatever a finished stage left running
    if outcome != "exited":
        try:
            out, _ = proc.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError, OSError):
            pass
    printed = [line for line in (out or "").splitlines() if line.startswith("{")]
    result = json.loads(printed[-1]) if printed else {}
    result["seconds"] = time.time() - start
    if isinstance(outcome, Interrupted):
        result.update(status="interrupted", reason=f"stopped by {outcome}")
        raise _StageInterrupted(result, outcome.signum)
    reasons, status = [], None
    if outcome == "timed out":
        reasons.append(f"stopped at its {cap:.0f} s cap")
        status = None if printed else "failed"
    elif proc.returncode != 0:
        log.flush()
        with open(log.name, errors="replace") as f:
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
        reasons.append(f"exit {proc.returncode}: {(lines or ['?'])[-1][:300]}")
        status = "failed"
    if "skipped" in result and not reasons:
        result["status"] = "skipped"
        return result
    verdict = MODULES[name].check(result, plan) if printed else ("failed", "no result printed")
    if verdict:
        status = status or verdict[0]
        reasons.append(verdict[1])
    elif reasons:
        status = status or "partial"
    result["status"] = status or "ok"
    if reasons:
        result["reason"] = "; ".join(reasons)
    return result


class _StageInterrupted(Interrupted):
    """An Interrupted, with what the running stage had printed."""

    def __init__(self, result: dict, signum: int):
        super().__init__(signum)
        self.result = result


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _stage_env(scratch: str, site: str | None) -> dict:
    """The stages' environment: the installed wheels first on the path, and TMPDIR inside the
    temporary folder, so that what the stages and their tests leave in temp goes with it. A
    report started by the test suite drops the suite's own variables (its workers' names, its
    compilation cache, which the inner pytest would delete at its end)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PYTEST_") and k != "SPARSE_JAX_TESTS_JAX_CACHE"}
    env.update(PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=os.path.join(scratch, "tmp"))
    os.makedirs(env["TMPDIR"])
    paths = ([site] if site else []) + [REPO]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    return env


def run_report(output_dir: str, *, wheels: str | None = None, dry_run: bool = False,
               stages=STAGES, budget_s: float | None = None, caps: dict | None = None,
               profile: bool = False, overwrite: bool = False, plan: dict | None = None,
               log=print) -> dict:
    """Runs the stages in order, each in its own process with its own cap, and writes to
    `output_dir`: results.json (every figure, each stage's status and why), results.md (the
    summary tables), log.txt (every stage's output), sample.txt (the preset's sample) and, with
    `profile`, profile/ (jax.profiler traces of the training steps). Returns the JSON, whose
    "interrupted" names the signal that stopped it, if one did. `plan` replaces
    plan_for(dry_run) (the tests change one stage's sizes). Arguments are checked first
    (check_arguments, check_output_dir): a ValueError writes nothing. A folder that holds a
    report is refused unless `overwrite`; then the old report's files go before the first
    stage starts (after the wheels are installed), so that none stays beside the new ones."""
    stages = tuple(stages)
    wheel_paths = check_arguments(stages, caps, budget_s, wheels)
    old_report = check_output_dir(output_dir, overwrite)
    caps = {**(DRY_CAPS if dry_run else CAPS), **(caps or {})}
    if profile and "train_step" in stages:
        caps["train_step"] += PROFILE_S
    budget_s = budget_s or sum(caps[s] for s in stages)
    plan = json.loads(json.dumps(plan or plan_for(dry_run)))
    report = {"dry_run": dry_run, "stages": {}, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "command": " ".join(["python", *sys.argv]), "caps_s": caps, "budget_s": budget_s}
    # the committed predictions, printed beside the measurements (docs/cost_model.md); a
    # damaged file costs its own rows (said in results.md), not the loan
    report["predictions"] = predictions.load(strict=False)
    scratch = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    previous = {}
    try:
        try:  # from here a SIGINT or SIGTERM ends the run in order (main thread only)
            previous = {s: signal.signal(s, _raise_interrupted)
                        for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:
            pass
        site = None
        if wheel_paths:
            site = os.path.join(scratch, "site")
            report["wheels"] = install_wheels(wheel_paths, site)
            log(f"installed {len(report['wheels'])} wheels into {site}: "
                f"{', '.join(report['wheels'])}")
        env = _stage_env(scratch, site)
        if dry_run:
            env["JAX_PLATFORMS"] = "cpu"
        _remove_old_report(output_dir, old_report)
        os.makedirs(output_dir, exist_ok=True)
        plan["workdir"] = os.path.join(scratch, "preset_run")
        if profile:
            plan["profile_dir"] = os.path.abspath(os.path.join(output_dir, "profile"))
        report["plan"] = plan
        _run_stages(report, stages, caps, budget_s, env, output_dir, log)
        sample = report["stages"].get("preset", {}).get("sample_path")
        if sample and os.path.exists(sample):
            shutil.copyfile(sample, os.path.join(output_dir, "sample.txt"))
        report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        markdown = summary_markdown(report)
        with open(os.path.join(output_dir, "results.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(output_dir, "results.md"), "w") as f:
            f.write(markdown)
        log("\n" + markdown)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(scratch, ignore_errors=True)
    return report


def _run_stages(report, stages, caps, budget_s, env, output_dir, log) -> None:
    """Each stage in turn; an interrupt marks the running stage "interrupted" and the rest
    "not run", and ends the loop."""
    plan = report["plan"]
    deadline = time.time() + budget_s
    with open(os.path.join(output_dir, "log.txt"), "w") as log_file:
        name = stages[0]
        try:
            for i, name in enumerate(stages):
                later = sum(min(caps[s], 10) for s in stages[i + 1:])  # a few seconds each
                cap = min(caps[name], max(5.0, deadline - time.time() - later))
                inputs = getattr(MODULES[name], "inputs", None)
                stage_plan = {**plan, **(inputs(report) if inputs else {})}
                result = _stage_process(name, stage_plan, cap, env, log_file)
                report["stages"][name] = result
                log(f"stage {name}: {result['status']} in {result['seconds']:.0f} s"
                    + (f": {result['reason']}" if "reason" in result else ""))
        except Interrupted as e:
            report["interrupted"] = signal.Signals(e.signum).name
            if getattr(e, "result", None) is not None or name not in report["stages"]:
                report["stages"][name] = getattr(e, "result", None) or {
                    "status": "interrupted", "reason": f"stopped by {report['interrupted']}",
                    "seconds": 0}
            for rest in stages:
                report["stages"].setdefault(rest, {"status": "not run", "reason": "interrupted",
                                                   "seconds": 0})
            log(f"stage {name}: interrupted by {report['interrupted']}")


__all__ = ["check_arguments", "check_output_dir", "check_wheels", "install_wheels", "not_ok",
           "parse_caps", "REPORT_FILES", "run_report", "TEMP_PREFIX"]
