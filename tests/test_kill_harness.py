"""A quick run of the random-kill harness (`tests/kill_harness.py`): a training run, a data load,
and evaluate.py / sample.py, each killed at random instants and restarted, end where an
uninterrupted one ends. The long run (50 kills and more) is manual:
`python tests/kill_harness.py --kills=50 --output_kills=20`."""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import kill_harness


@pytest.mark.slow  # starts other processes
def test_training_killed_at_random_instants_ends_bit_exact(tmp_path):
    """Two kills here (the SIGKILL and SIGTERM of test_train.py hit chosen steps), in runs of 20
    steps (checkpoints at 4, 8, ..., 20, validations at 10 and 20: every phase a kill can hit,
    as the manual run's 40); the manual run makes fifty."""
    result = kill_harness.training(2, np.random.default_rng(1), str(tmp_path), log=lambda s: None,
                                   steps=20)
    assert result["problems"] == []
    assert result["kills"] == 2 and result["starts"] >= 3


@pytest.mark.slow
def test_data_cache_killed_at_random_instants_loads_whole(tmp_path):
    result = kill_harness.data_cache(4, np.random.default_rng(2), str(tmp_path), log=lambda s: None)
    assert result["problems"] == [] and result["kills"] >= 1


@pytest.mark.slow
def test_evaluate_and_sample_killed_at_random_instants_leave_whole_outputs(tmp_path):
    """Two kills of each (one at a random instant, one at a write): every output is absent or
    whole after a kill, the same command then writes what an uninterrupted run writes, and
    nothing the dead process was writing is left behind (`kill_harness.outputs`)."""
    result = kill_harness.outputs(4, np.random.default_rng(3), str(tmp_path), log=lambda s: None)
    assert result["problems"] == []
    assert result["kills"] == 4 and result["starts"] >= 8  # each kill and the run after it


@pytest.mark.slow
def test_evaluate_and_sample_beside_a_training_run_use_a_complete_checkpoint(tmp_path,
                                                                             byte_file):
    """Readers started again and again on a workdir whose run is writing checkpoints (one every
    2 steps): each ends well, on a checkpoint that was whole, and says which step it used."""
    workdir, root = str(tmp_path / "run"), kill_harness.ROOT
    args = kill_harness._train_args(workdir, byte_file, "--config.total_steps=400",
                                    "--config.checkpoint_every=2", "--config.eval_every=400",
                                    "--config.log_every=10")
    train = subprocess.Popen(args, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        # Until the first checkpoint; a run that never writes one ends (400 steps) and fails here.
        while not os.path.isdir(os.path.join(workdir, "checkpoints", "2")):
            assert train.poll() is None, "training ended before its first checkpoint"
            time.sleep(0.1)
        used = []
        for i in range(2):
            for script, args in [("evaluate.py", ["--split=valid", "--overwrite"]),
                                 ("sample.py", ["--length=8", "--num_samples=1",
                                                f"--output={tmp_path}/s{i}.txt"])]:
                out = subprocess.run([sys.executable, os.path.join(root, "scripts", script),
                                      f"--workdir={workdir}", *args], cwd=root, text=True,
                                     capture_output=True, timeout=300)
                assert out.returncode == 0, out.stdout + out.stderr
                step = re.search(r"step (\d+)", out.stdout + out.stderr)
                assert step, f"{script} did not say which step it used:\n{out.stdout}"
                used.append(int(step.group(1)))
        assert train.poll() is None, "training ended before the readers did: test nothing"
    finally:
        train.send_signal(signal.SIGTERM)
        train.wait(timeout=120)
    assert all(s % 2 == 0 and s > 0 for s in used) and used == sorted(used)
