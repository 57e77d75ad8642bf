"""Stopping at any instant: every long-running script, signalled (SIGTERM and SIGINT in turn) at
points spread over its run, ends with one line and status 128 + the signal (or 0 if it finished
first), never a crash, and leaves no child process, no temporary file and nothing damaged.

The points are keyed to the script's own progress, not to a clock: "from the start" (its imports
and set-up), a moment after one of its output lines appears (a compilation under way after
"compiling the training step...", a step, a validation, a progress line) or a line of the log
its worker process writes, or after a child process of its own appears. Each point is one run up
to it, with $TMPDIR a fresh folder and a marker in its environment (which its children inherit);
then no process with the marker may be left and $TMPDIR must be empty. The same command run to
its end afterwards must work (training resumes; evaluation writes whole outputs). Every script
compiles into a compilation cache of its own, so the early points land in real compilations. No
wait has a limit that load can reach: a run is awaited line by line, with a limit (`SAFETY_S`)
only against hanging.
Linux only (the processes are found in /proc).
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV = os.path.join(ROOT, "data", "kjv.html.gz")
SAFETY_S = 1800  # against a hang only: no run comes near it, whatever the load
SIGNALS = (signal.SIGTERM, signal.SIGINT)
START = None  # a point "from the start": (START, seconds after the process starts)
CHILD = "child"  # a point after the script's first child process appears
# (LOG, regex): a point after a line of a log file the script's worker writes ({tmp} filled in)
STOP_LINE = re.compile(r"^(error: (interrupted|stopped by SIG(TERM|INT))"  # the one line, or
                       r"|Stopped by SIG(TERM|INT) at step \d+; checkpoint saved"  # training's
                       r"|Wrote .*; interrupted by SIG(TERM|INT))")  # the accelerator report's


def _train(workdir: str, data: str, steps: int = 6) -> list[str]:
    return ["train", f"--config={ROOT}/configs/bytes.py:size=tiny", f"--workdir={workdir}",
            f"--config.data.path={data}", f"--config.total_steps={steps}",
            "--config.checkpoint_every=2", "--config.eval_every=3", "--config.eval_batches=2",
            "--config.log_every=1", "--config.optimizer.warmup_steps=1"]


# Each script: its command ({tmp}: the test's folder, {run}: a trained workdir, {data}: a byte
# file), the points at which it is signalled (a line's regex, a (log, regex) pair or START /
# CHILD, then seconds), and whether the same command run to its end afterwards must succeed.
SWEEPS = {
    "train": (None, [(START, 0.3), (START, 1.5), (r"^compiling and running the init", 0.3),
                     (r"^compiling the training step", 0.3), (r"^step 2/", 0.0),
                     (r"valid .* bits", 0.0), (r"^step 5/", 0.0)], True),
    "evaluate": (["evaluate", "--workdir={run}", "--split=valid", "--overwrite"],
                 [(START, 0.5), (START, 2.0), (r"%\)", 0.0)], True),
    "sample": (["sample", "--workdir={run}", "--length=48", "--num_samples=2",
                "--output={tmp}/sample.txt", "--overwrite"],
               [(START, 0.5), (START, 2.5), (START, 4.5)], True),
    "attention_stats": (["attention_stats", "--workdir={run}", "--windows=2",
                         "--output_dir={tmp}/attention", "--overwrite"],
                        [(START, 0.5), (START, 2.0), (START, 4.0)], True),
    "benchmark_attention": (["benchmark_attention", "--seq_lens=256", "--patterns=dense",
                             "--passes=fwd", "--repeats=1", "--devices=1",
                             "--output_dir={tmp}/out"],
                            [(START, 0.5), (CHILD, 0.3), (CHILD, 2.0), (r"^round 1", 0.5)],
                            False),
    "benchmark_model": (["benchmark_model", "--seq_len=256", "--num_layers=1", "--d_model=16",
                         "--num_heads=1", "--stride=16", "--steps=1",
                         "--cases=strided:none:unrolled"],
                        [(START, 0.5), (CHILD, 0.3), (CHILD, 2.5)], False),
    "benchmark_training": (["benchmark_training", "--seq_lens=64", "--steps=300",
                            "--patterns=dense", f"--data={KJV}"],
                           [(START, 0.5), (CHILD, 0.3), (CHILD, 3.0)], False),
    "benchmark_sampling": (["benchmark_sampling", "--num_layers=1", "--d_model=32",
                            "--num_heads=2", "--seq_len=256", "--stride=16", "--length=64",
                            "--naive_steps=4", "--noeval", "--output={tmp}/sampling.json"],
                           [(START, 0.5), (START, 2.5), (START, 5.0)], False),
    "compare_patterns": (["compare_patterns",
                          f"--config={ROOT}/configs/quickstart.py:data=embedded",
                          "--workdir={tmp}/study", "--patterns=dense", "--steps=4",
                          "--config.optimizer.warmup_steps=1"],
                         [(START, 0.5), (("{tmp}/study/dense/train.log",
                                          r"^compiling the training step"), 0.3)],
                         False),  # (the training loop's own stops: train's sweep; the worker
    # prints to its train.log, not to the script's output: a point keyed to the script's own
    # lines was never reached, and that run went on to its end unsignalled)
    "accelerator_report": (["accelerator_report", "--dry_run", "--stages=env",
                            "--output_dir={tmp}/report", "--overwrite"],
                           [(START, 0.5), (CHILD, 0.5)], False),
}


def _marked(marker: str) -> list[int]:
    """The processes whose environment holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:  # ended, or not ours
            pass
    return found


def _program(pid: int) -> str:
    """The name of the program process `pid` runs ("" if it has ended)."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return ""


class _Run:
    """A script started with a fresh $TMPDIR and a marker; its output lines are read as they
    come (stdout and stderr together)."""

    def __init__(self, argv: list[str], folder, env: dict | None = None):
        self.scratch = folder / f"tmp{uuid.uuid4().hex[:8]}"
        self.scratch.mkdir()
        self.marker = uuid.uuid4().hex
        env = {**os.environ, "TMPDIR": str(self.scratch), "JAX_PLATFORMS": "cpu",
               "SPARSE_JAX_STOP_TEST": self.marker, **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "scripts", f"{argv[0]}.py"), *argv[1:]],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.started, self.lines, self.new_line = time.monotonic(), [], threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self.new_line.set()
        self.new_line.set()

    def children(self) -> list[int]:
        return [p for p in _marked(self.marker) if p != self.proc.pid]

    def handles(self) -> bool:
        """Whether the script catches SIGTERM yet (its first statement has run: before it,
        while the interpreter starts, Python's default ends the process)."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                caught = next(int(line.split()[1], 16) for line in f
                              if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            return False
        return bool(caught >> (signal.SIGTERM - 1) & 1)

    def wait_for(self, pattern, delay: float) -> None:
        """Until `pattern` (a line's regex, a (log file, regex) pair, START: the script's
        start, or CHILD) is reached, then `delay` seconds, or until the script ends."""
        while self.proc.poll() is None and time.monotonic() - self.started < SAFETY_S:
            if isinstance(pattern, tuple):
                path, regex = pattern
                lines = open(path, errors="replace").read().splitlines() \
                    if os.path.isfile(path) else []
            else:
                regex, lines = pattern, self.lines
            if (pattern is START and self.handles()) or (pattern == CHILD and self.children()) or (
                    pattern not in (START, CHILD)
                    and any(re.search(regex, line) for line in lines)):
                break
            self.new_line.wait(0.05)
            self.new_line.clear()
        time.sleep(delay)

    def finish(self) -> tuple[int, str]:
        """(exit status, output) once it has ended; then nothing of it may be left."""
        try:
            self.proc.wait(timeout=SAFETY_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self.reader.join()
        left = []
        for _ in range(100):  # a killed child is reaped by init a moment later
            left = _marked(self.marker)
            if not left:
                break
            time.sleep(0.05)
        for pid in left:  # not to leave them running after a failure
            os.kill(pid, signal.SIGKILL)
        output = "\n".join(self.lines)
        assert not left, f"processes left running: {left}\n{output[-2000:]}"
        assert sorted(os.listdir(self.scratch)) == [], \
            f"left in $TMPDIR: {os.listdir(self.scratch)}"
        return self.proc.returncode, output


def _stopped_well(sig, status: int, output: str, sent: bool) -> None:
    """What a signalled run must show: status 128 + sig (or 0 if it ended before the signal),
    no crash, no traceback, its last line the stop's one line."""
    where = f"{signal.Signals(sig).name}: exit {status}\n{output[-3000:]}"
    assert "Fatal Python error" not in output and "Traceback" not in output, where
    if not sent or status == 0:
        assert status == 0, where
        return
    assert status == 128 + sig, where
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines and STOP_LINE.match(lines[-1]), where
    assert sum(line.startswith("error:") for line in lines) <= 1, where


@pytest.fixture(scope="module")
def trained(tmp_path_factory, byte_file):
    """A finished 4-step tiny run (for evaluate, sample, attention_stats)."""
    folder = tmp_path_factory.mktemp("trained")
    run = _Run(_train(str(folder / "run"), byte_file, steps=4), folder)
    status, output = run.finish()
    assert status == 0, output[-2000:]
    return str(folder / "run")


@pytest.mark.slow  # starts each script many times
@pytest.mark.parametrize("script", sorted(SWEEPS))
def test_a_script_stopped_at_any_instant_ends_cleanly(script, tmp_path, byte_file, request):
    argv, points, then_whole = SWEEPS[script]
    fill = {"tmp": str(tmp_path), "data": byte_file}
    if argv and "--workdir={run}" in argv:
        fill["run"] = request.getfixturevalue("trained")
    argv = _train(str(tmp_path / "run"), byte_file) if argv is None else \
        [a.format(**fill) for a in argv]
    env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache")}  # compilations of its own
    sent_any = False
    for i, (pattern, delay) in enumerate(points):
        if isinstance(pattern, tuple):  # (LOG, regex)
            pattern = (pattern[0].format(**fill), pattern[1])
        sig = SIGNALS[i % 2]
        run = _Run(argv, tmp_path, env)
        run.wait_for(pattern, delay)
        sent = run.proc.poll() is None
        if sent:
            run.proc.send_signal(sig)
        sent_any |= sent
        status, output = run.finish()
        _stopped_well(sig, status, output, sent)
    assert sent_any, f"{script} ended before every point: nothing was tested"
    if then_whole:  # the same command, run to its end, works on what the stops left
        status, output = _Run(argv, tmp_path, env).finish()
        assert status == 0, output[-3000:]


@pytest.mark.slow
def test_a_stop_during_the_cpu_kernels_build_leaves_no_compiler_and_no_files(tmp_path,
                                                                            byte_file):
    """With an empty kernel cache, SIGTERM while the compiler runs: the compiler's whole process
    group goes (cc1plus too), its temporary files with the build's folder, and nothing half
    built stays in the cache (the next run builds it whole: `vouched`)."""
    cache = tmp_path / "kernels"
    env = {"SPARSE_JAX_CACHE": str(cache),
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache")}
    argv = ["train", f"--config={ROOT}/configs/quickstart.py", f"--workdir={tmp_path}/run",
            f"--config.data.path={byte_file}", "--config.total_steps=2",
            "--config.eval_every=2", "--config.eval_batches=1"]  # a model that uses them
    run = _Run(argv, tmp_path, env)
    run.wait_for(r"^building the CPU kernels", 0.0)
    while run.proc.poll() is None and not any(
            _program(p).startswith(("cc1", "as", "ld", "collect2")) for p in run.children()):
        time.sleep(0.05)  # until the compiler proper runs
    assert run.proc.poll() is None, "the build ended before the test could stop it"
    run.proc.send_signal(signal.SIGTERM)
    status, output = run.finish()
    _stopped_well(signal.SIGTERM, status, output, True)
    assert not [name for name in os.listdir(cache) if ".build.part" in name or
                name.endswith(".so")], os.listdir(cache)  # nothing half built, nothing to use


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_benchmark_case_stopped_by_a_signal_stops_the_benchmark(sig):
    """A case process ended by SIGINT or SIGTERM (Ctrl-C reaches the whole group) raises
    `Stopped` in the benchmark, which then exits 128 + the signal: it used to record the case as
    failed, go on, and exit 0. A case killed otherwise (SIGKILL: out of memory) is a result."""
    from sparse_jax import stopping
    from sparse_jax.bench import tools

    kill = f"import os, signal; os.kill(os.getpid(), {int(sig)})"
    with pytest.raises(stopping.Stopped) as stopped:
        tools.run_isolated(["-c", kill])
    assert stopped.value.signal == sig
    with pytest.raises(stopping.Stopped):
        tools.run_isolated(["-c", f"raise SystemExit({128 + int(sig)})"])
    result = tools.run_isolated(["-c", "import os, signal; os.kill(os.getpid(), 9)"])
    assert result["error"] == "out of memory"
