"""Stopping: every script that starts child processes or writes temporary folders leaves neither
behind when it is stopped by SIGINT (Ctrl-C) or SIGTERM, whatever it is doing then.

Each script runs a small command with $TMPDIR a fresh folder and a marker in its environment
(which its children inherit); once it has started a child process (or after a few seconds, for
one that starts none), it gets the signal. Then it must end with status 128 + the signal's
number, no process with the marker may be left, and $TMPDIR must be empty. Linux only (the
processes are found in /proc).
"""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KJV = os.path.join(ROOT, "data", "kjv.html.gz")
# The scripts that start processes or temporary folders, each with a command that does so at
# once and runs long enough to be stopped (compile_report needs the GPU compilers' folder).
# benchmark_sampling starts no process and its one folder is a TemporaryDirectory; a signal
# that lands inside XLA's compiler there was seen to end it with status 0 or a crash at exit,
# under load, so its status is not a fact this test can hold it to.
COMMANDS = {
    "accelerator_report": ["--dry_run", "--stages=env", "--output_dir={tmp}/report"],
    "benchmark_attention": ["--seq_lens=256", "--patterns=dense", "--passes=fwd", "--repeats=1",
                            "--devices=1", "--output_dir={tmp}/out"],
    "benchmark_model": ["--seq_len=256", "--num_layers=1", "--d_model=16", "--num_heads=1",
                        "--stride=16", "--steps=1", "--cases=strided:none:unrolled"],
    "benchmark_training": ["--seq_lens=64", "--steps=300", "--patterns=dense",
                           f"--data={KJV}"],
    "compare_patterns": [f"--config={ROOT}/configs/quickstart.py:data=embedded",
                         "--workdir={tmp}/study", "--patterns=dense", "--steps=300"],
}
SIGNALS = (signal.SIGINT, signal.SIGTERM)


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


@pytest.mark.slow  # starts the scripts
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_a_stopped_script_leaves_no_process_and_no_temporary_folder(script, sig, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    marker = f"SPARSE_JAX_STOP_TEST={uuid.uuid4().hex}"
    env = {**os.environ, "TMPDIR": str(scratch), "JAX_PLATFORMS": "cpu",
           marker.split("=")[0]: marker.split("=")[1]}
    argv = [a.replace("{tmp}", str(tmp_path)) for a in COMMANDS[script]]
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", f"{script}.py"),
                             *argv], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        start = time.monotonic()  # until it has a child, or a few seconds in
        while proc.poll() is None and time.monotonic() - start < 120:
            children = [p for p in _marked(marker) if p != proc.pid]
            if children:
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"{script} ended before it was stopped: {proc.stderr.read()}"
        time.sleep(1.0)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    left = []
    for _ in range(50):  # a killed child is reaped by init a moment later
        left = _marked(marker)
        if not left:
            break
        time.sleep(0.1)
    for pid in left:  # not to leave them running after a failure
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, f"exit {proc.returncode}: {err[-500:]}"
    assert not left, f"processes left running: {left}"
    assert sorted(os.listdir(scratch)) == [], f"left in $TMPDIR: {os.listdir(scratch)}"
