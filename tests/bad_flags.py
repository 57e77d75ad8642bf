#!/usr/bin/env python
r"""Every flag of every script, and every field of the config tree, given the values users
mistype: each is refused in one line that names it, before any work, or accepted for a reason
the table gives (`tests/flag_table.py`).

  python tests/bad_flags.py                    # every script (under a minute on 2 CPU cores)
  python tests/bad_flags.py train sample       # some scripts
  python tests/bad_flags.py --list             # the cases, without running them

The flags are read from absl's registry of each script (`scripts/*.py`, run as `__main__` with
`cli.run` recorded instead of called), so a new flag or script is covered without a line here;
a flag without an entry in the table is a failure. Each script's cases run in ONE process
(`--child=SCRIPT`): for every case the flags are parsed again (`cli.parse_flags`) and the
script's check (`cli.run(main, check=...)`: what its main() runs before any work) is called
through the scripts' one error path (`cli.call`); main itself never runs. So a case costs
milliseconds, and the values are checked without the work behind them.

An accepted value that is an extreme (`flag_table.EXTREMES`: 0, -1, 10^12, a week) is then
also run into the script's work, where the table gives the script flags that make it cheap
(`Script.work`: a dry run, a toy size): the check and then main in the same process, main
stopped after WORK_SECONDS. It must end with status 0 or be stopped, so that a value the checks
pass and the work cannot take (a time limit too long for poll(): an OverflowError once) is
caught here, not by a user.

A case passes when

* "error" (the table gives no reason to accept the value): exit status 2 (`cli.BAD_VALUE`, the
  one status of a bad value in every script, whether absl's parser or the script's check
  refuses it), stderr
  exactly one `error: ` line that names the flag (the table's regular expression, by default
  the flag's name), no traceback, nothing on stdout; or
* "ok" (the table says why the value is valid): exit status 0 and no `error: ` line;

and in both, nothing was written (every file under the case's folder and $TMPDIR, hashed before
and after), no child process was started and nothing was compiled: the check may only read.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import io
import json
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [p for p in (HERE, ROOT) if p not in sys.path]

import bad_inputs  # noqa: E402  (the bad-input harness: its error-line rules and snapshots)
import flag_table  # noqa: E402


def scripts() -> list[str]:
    """The scripts' short names: every scripts/*.py."""
    return sorted(name[:-3] for name in os.listdir(os.path.join(ROOT, "scripts"))
                  if name.endswith(".py") and not name.startswith("_"))


BAD_VALUE = 2  # sparse_jax.cli.BAD_VALUE (not imported here: the parent imports no jax)
CASE_SECONDS = 60  # a check that takes longer is doing work (or never ends)


class WorkStarted(BaseException):
    """Raised when a check starts work: a child process, a compile, a write."""


# ---------------------------------------------------------------------------------------------
# The child: one script's cases in this process.


_UNGUARDED: dict = {}  # what _guard_work replaced: (owner, name) -> the original


def _unguard() -> None:
    """Undoes `_guard_work`'s refusals (the work phase starts processes)."""
    for (owner, name), original in _UNGUARDED.items():
        setattr(owner, name, original)


def _guard_work(record: list[str]) -> None:
    """From here on, starting a child process or writing a file raises WorkStarted, and a
    compile is recorded in `record`."""
    _UNGUARDED[(subprocess.Popen, "__init__")] = subprocess.Popen.__init__
    _UNGUARDED.update({(os, n): getattr(os, n) for n in (
        "fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve", "execvp",
        "execvpe") if hasattr(os, n)})

    def refuse(what):
        def raiser(*args, **kwargs):
            raise WorkStarted(f"{what} {str(args[:2])[:120]}")
        return raiser

    subprocess.Popen.__init__ = refuse("a child process")
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve",
                 "execvp", "execvpe"):
        if hasattr(os, name):
            setattr(os, name, refuse(f"os.{name}"))
    try:
        import jax

        def listener(event, *args, **kwargs):
            if "compil" in event:
                record.append(f"a compile ({event})")
        jax.monitoring.register_event_duration_secs_listener(listener)
        jax.monitoring.register_event_listener(listener)
    except ImportError:
        pass


def _load(script: str):
    """Runs scripts/`script`.py as `__main__` with `cli.run` (and `app.run`) recorded, not
    called; returns what the script passed to it: {"main", "check", "via"}."""
    from absl import app

    from sparse_jax import cli

    recorded = {}
    real = cli.run, app.run
    cli.run = lambda main, huge_pages=False, check=None: recorded.update(
        main=main, check=check, via="cli.run")
    app.run = lambda main, *a, **k: recorded.update(main=main, check=None, via="app.run")
    path = os.path.join(ROOT, "scripts", f"{script}.py")
    sys.argv = [path]
    try:
        runpy.run_path(path, run_name="__main__")
    finally:
        cli.run, app.run = real
    return recorded


def _reset_flags() -> None:
    from absl import flags

    flags.FLAGS.unparse_flags()
    for name in [n for n in flags.FLAGS if n.startswith("config.")]:  # a config's overrides
        delattr(flags.FLAGS, name)


def _run_one(argv: list[str], check, root: str, work: list[str]) -> dict:
    """Parses `argv` and calls `check` the way `cli.run` does; what came of it."""
    from sparse_jax import cli

    _reset_flags()
    sys.argv = list(argv)
    out, err = io.StringIO(), io.StringIO()
    before = bad_inputs.snapshot(root)
    folders_before = _folders(root)
    del work[:]
    status = 0
    def too_long(*_):
        raise WorkStarted(f"the check ran for more than {CASE_SECONDS} s")

    signal.signal(signal.SIGALRM, too_long)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            signal.alarm(CASE_SECONDS)
            rest = cli.parse_flags(list(argv))
            if check is not None:
                cli.call(check, rest, cli.BAD_VALUE)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        except WorkStarted as e:
            status = "work"
            work.append(str(e))
        except BaseException:  # noqa: BLE001  (the case's failure: its traceback is reported)
            status = "crash"
            err.write(traceback.format_exc())
        finally:
            signal.alarm(0)
    after = bad_inputs.snapshot(root)
    wrote = sorted({*(set(after) - set(before)), *(r for r in before if after.get(r) != before[r]),
                    *(_folders(root) - folders_before)})
    for rel in wrote:  # undo it, so the next case finds the folder as it was
        path = os.path.join(root, rel)
        if rel not in before:
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue(),
            "wrote": wrote, "work": list(work)}


WORK_SECONDS = 4  # how long an accepted extreme value runs into the script's work


def _run_work(argv: list[str], recorded: dict, root: str) -> dict:
    """Parses `argv`, calls the check and then main, as `cli.run` does, and stops main after
    WORK_SECONDS (as SIGALRM: `cli.Stopped`, exit 128 + 14) if it has not ended by then: what
    came of it. Whatever main wrote in `root` is removed."""
    from sparse_jax import cli

    _reset_flags()
    sys.argv = list(argv)
    out, err = io.StringIO(), io.StringIO()
    before = set(bad_inputs.snapshot(root)) | _folders(root)
    status = 0

    def stop(signum, frame):
        signal.alarm(0)
        raise cli.Stopped(signum)

    signal.signal(signal.SIGALRM, stop)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rest = cli.parse_flags(list(argv))
            cli.call(recorded["check"], rest, cli.BAD_VALUE)
            signal.alarm(WORK_SECONDS)
            cli.call(recorded["main"], rest)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001  (the case's failure: its traceback is reported)
            status = "crash"
            err.write(traceback.format_exc())
        finally:
            signal.alarm(0)
    for rel in sorted((set(bad_inputs.snapshot(root)) | _folders(root)) - before, reverse=True):
        path = os.path.join(root, rel)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}


def judge_work(got: dict) -> list[str]:
    """What is wrong with an accepted value's first seconds of work: anything but exit 0 or the
    stop (128 + SIGALRM)."""
    if got["status"] in (0, 128 + signal.SIGALRM):
        return []
    text = got["stderr"].strip() or got["stdout"].strip() or "(no output)"
    return [f"accepted, but its first {WORK_SECONDS} s of work ended {got['status']}: "
            f"{text.splitlines()[-1][:300]}"]


def _folders(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(base, d), root)
            for base, dirs, _ in os.walk(root) for d in dirs}


def judge(case: flag_table.Case, got: dict) -> list[str]:
    """What is wrong with what `case` got (empty: it passed)."""
    problems = []
    lines = bad_inputs.error_lines(got["stderr"])
    if got["status"] == "crash":
        return ["the check crashed: " + got["stderr"].strip().splitlines()[-1][:300]]
    if got["status"] == "work":
        return [f"the check started work: {'; '.join(got['work'])}"]
    if case.ok is not None:
        if got["status"] != 0:
            problems.append(f"refused ({got['status']}), but the table accepts it: {case.ok} "
                            f"(got: {(lines or [got['stderr'].strip()[-200:]])[0]})")
    else:
        others = [line for line in got["stderr"].splitlines() if line.strip()
                  and not line.startswith("error: ")]
        if got["status"] == 0:
            problems.append("accepted (exit 0): the table gives no reason to")
        elif got["status"] != BAD_VALUE:
            problems.append(f"exit status {got['status']}, not {BAD_VALUE} (a bad value's, "
                            "sparse_jax/cli.py)")
        elif len(lines) != 1:
            problems.append(f"{len(lines)} 'error: ' lines on stderr (expected 1)")
        elif not re.search(case.match, lines[0], re.I):
            problems.append(f"the error line does not match {case.match!r}: {lines[0]}")
        elif len(lines[0]) > bad_inputs.MAX_ERROR_CHARS:
            problems.append(f"the error line is {len(lines[0])} characters")
        if got["status"] != 0 and others:
            problems.append(f"{len(others)} more lines on stderr: {others[0][:200]}")
        if got["status"] != 0 and got["stdout"].strip():
            problems.append(f"stdout is not empty: {got['stdout'].strip()[:200]}")
    if bad_inputs.TRACEBACK in got["stderr"] + got["stdout"]:
        problems.append("a Python traceback was printed")
    if got["wrote"]:
        problems.append(f"wrote {', '.join(got['wrote'][:4])}")
    if got["work"]:
        problems.append(f"started work: {'; '.join(got['work'])}")
    return problems


def child(script: str, without=()) -> dict:
    """Runs `script`'s cases in this process; returns {"script", "flags", "problems",
    "results"}. `without`: table entries to leave out ("SCRIPT" or "SCRIPT.FLAG"), to see that
    a flag or script without one fails."""
    for name in without:
        where, _, flag = name.partition(".")
        if not flag:
            flag_table.SCRIPTS.pop(where, None)
        elif where in flag_table.SCRIPTS:
            flag_table.SCRIPTS[where].flags.pop(flag, None)
    root = tempfile.mkdtemp(prefix=f"sparse_jax_flags_{script}_")
    tmp = os.path.join(root, "case")
    os.makedirs(os.path.join(root, "tmp"))
    os.environ["TMPDIR"] = os.path.join(root, "tmp")
    tempfile.tempdir = None
    try:
        flag_table.make_fixtures(tmp)
        os.chdir(tmp)
        recorded = _load(script)
        from absl import flags
        from absl import logging as absl_logging

        from sparse_jax import cli

        absl_logging.set_verbosity(absl_logging.WARNING)
        names = sorted(f.name for f in cli._ours(flags.FLAGS))
        problems = []
        if not recorded:
            problems.append(f"scripts/{script}.py does not call cli.run (or app.run) as __main__")
        elif recorded["via"] != "cli.run":
            problems.append(f"scripts/{script}.py calls {recorded['via']}, not cli.run: its "
                            "errors do not take the scripts' one error path")
        entry = flag_table.SCRIPTS.get(script)
        if entry is None:
            problems.append(f"tests/flag_table.py has no entry for scripts/{script}.py (flags: "
                            f"{', '.join(names)})")
            return {"script": script, "flags": names, "problems": problems, "results": []}
        missing = [n for n in names if n not in entry.flags]
        stale = [n for n in entry.flags if n not in names]
        if missing:
            problems.append(f"flags without an entry in tests/flag_table.py: {', '.join(missing)}")
        if entry.config_fields:
            fields = flag_table.config_fields()
            missing = [f for f in fields if f not in flag_table.CONFIG]
            if missing:
                problems.append("config fields without an entry in tests/flag_table.py "
                                f"(CONFIG): {', '.join(missing)}")
            stale += [f"config.{f}" for f in flag_table.CONFIG if f not in fields]
        if stale:
            problems.append(f"entries of flags scripts/{script}.py no longer has: "
                            f"{', '.join(stale)}")
        cases = flag_table.cases(script, entry, tmp)
        flag_table.prepare(cases, entry, tmp)
        work: list[str] = []
        _guard_work(work)
        results = []
        for case in cases:
            start = time.perf_counter()
            got = _run_one(case.argv, (recorded or {}).get("check"), root, work)
            results.append({"name": case.name, "flag": case.flag, "value": case.value,
                            "expected": "ok" if case.ok is not None else "error",
                            "why": case.ok, "argv": case.argv[1:], "status": got["status"],
                            "got": (bad_inputs.error_lines(got["stderr"]) or
                                    [got["stderr"].strip()[-300:] or "(exit 0)"])[0],
                            "problems": judge(case, got),
                            "seconds": round(time.perf_counter() - start, 3)})
            if os.environ.get("BAD_FLAGS_PROGRESS"):
                print(f"{results[-1]['seconds']:7.3f} s {case.name}", file=sys.__stderr__,
                      flush=True)
        if entry.work is not None and recorded.get("main"):
            _unguard()  # the work phase: each accepted extreme value runs into main
            for case, result in zip(cases, results):
                if case.ok is None or case.value not in flag_table.EXTREMES \
                        or result["problems"]:
                    continue
                given = {a.split("=")[0] for a in case.argv[1:]}
                argv = case.argv + [w for w in entry.work if w.split("=")[0] not in given]
                start = time.perf_counter()
                got = _run_work(argv, recorded, root)
                result["work"] = {"argv": argv[1:], "status": got["status"],
                                  "seconds": round(time.perf_counter() - start, 3)}
                result["problems"] = judge_work(got)
        return {"script": script, "flags": names, "problems": problems, "results": results}
    finally:
        os.chdir(ROOT)
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The parent: one child process per script.


def env() -> dict:
    """The children's environment: the CPU split into 2 devices (the mesh checks see the same
    count on every machine), no traceback switch, no restart for huge pages, and no compile
    tools named by the environment (CI's .ci/run names them; an empty --tools then falls back
    to the default folder, which the table's cases expect to be absent)."""
    out = {k: v for k, v in os.environ.items() if k not in (
        "SPARSE_JAX_TRACEBACK", "SPARSE_JAX_GPU_TOOLS", "SPARSE_JAX_TPU_TOOLS")}
    out.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join([ROOT, out.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return out


def run_script(script: str, timeout: float = 600, without=()) -> dict:
    """`script`'s cases in a child process (see the module docstring; `without`: `child`'s)."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--child={script}",
                           *(f"--without={w}" for w in without)],
                          capture_output=True, text=True, env=env(), timeout=timeout, cwd=ROOT)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"script": script, "flags": [], "results": [],
                "problems": [f"the child exited {proc.returncode}: {tail}"]}


def failures(report: dict) -> list[str]:
    """Every problem of a script's report, one line each."""
    out = [f"{report['script']}: {p}" for p in report["problems"]]
    out += [f"{report['script']} {r['name']}: {'; '.join(r['problems'])}"
            for r in report["results"] if r["problems"]]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scripts", nargs="*", help="scripts to run (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--without", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=2, help="scripts run at the same time")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--output", help="write the reports as JSON here")
    args = parser.parse_args(argv)
    if args.child:
        report = child(args.child, args.without)
        sys.stdout.write("\n" + json.dumps(report) + "\n")
        return 0
    chosen = args.scripts or scripts()
    if args.list:
        for script in chosen:
            entry = flag_table.SCRIPTS.get(script)
            for case in flag_table.cases(script, entry, "{tmp}") if entry else ():
                print(f"{script} {case.name}: {'ok: ' + case.ok if case.ok else 'error'}")
        return 0
    start = time.time()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        reports = list(pool.map(run_script, chosen))
    problems = [line for report in reports for line in failures(report)]
    for report in reports:
        n = len(report["results"])
        bad = sum(bool(r["problems"]) for r in report["results"]) + len(report["problems"])
        print(f"{report['script']:22} {len(report['flags']):3} flags {n:4} cases "
              f"{bad:3} problems")
    print("\n".join(problems))
    print(f"{sum(len(r['results']) for r in reports)} cases, {len(problems)} problems "
          f"({time.time() - start:.0f} s)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(reports, f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
