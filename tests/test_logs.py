"""Console progress and the profiler trace (`sparse_jax.logs`): the evaluation progress writes a
line every ~10% to a log file and nothing when disabled; `Profiler` traces exactly the chosen
steps into WORKDIR/profile and writes nothing when off; `check_profile_steps` rejects bad
ranges; the writers (`sparse_jax.files`) leave a file whole or as it was, a torn log line is
never read as a row, and a write probe left by a killed process is removed by the next one;
two runs started in the same second keep their TensorBoard files apart."""

import glob
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from sparse_jax import files, logs


def test_progress_writes_a_line_every_tenth_to_a_log_file(capsys):
    bar = logs.Progress(20, "valid step 5")
    for done in range(1, 21):
        bar.update(done, done * 1024, "tokens")
    bar.update(20, 20 * 1024, "tokens")  # after the end: nothing more
    lines = capsys.readouterr().err.splitlines()
    assert 8 <= len(lines) <= 11 and "\r" not in "".join(lines)
    assert lines[-1].startswith("valid step 5: 20/20 (100%)") and "tokens/s" in lines[-1]

    logs.Progress(3, "off", enabled=False).update(3, 10, "tokens")
    single = logs.Progress(1, "test step 1")
    single.update(1, 10, "tokens")
    assert capsys.readouterr().err.splitlines() == ["test step 1: 1/1 (100%) [00:00<?, ?batch/s]"]


def run_steps(profiler, num_steps):
    """A loop as the trainer's: dispatch step n, then tell the profiler step n is dispatched."""
    f = jax.jit(lambda x: jnp.tanh(x @ x) + 1.0)
    x = jnp.ones((32, 32))
    for step in range(1, num_steps + 1):
        x = f(x)
        profiler.step(step, x)
    profiler.close()
    return x


def test_profiler_traces_the_chosen_steps_and_nothing_when_off(tmp_path):
    run_steps(logs.Profiler(str(tmp_path / "off"), ()), 4)
    assert not os.path.exists(tmp_path / "off" / "profile")

    profiler = logs.Profiler(str(tmp_path / "on"), (2, 3))
    assert not profiler.tracing  # starts only before step 2
    run_steps(profiler, 5)
    assert profiler.done and not profiler.tracing
    runs = glob.glob(str(tmp_path / "on" / "profile" / "plugins" / "profile" / "*"))
    assert len(runs) == 1  # one trace
    names = os.listdir(runs[0])
    assert "perfetto_trace.json.gz" in names and any(n.endswith(".xplane.pb") for n in names)

    # From step 1 on, and a run that ends inside the range: close() stops the trace.
    profiler = logs.Profiler(str(tmp_path / "early"), (1, 10))
    assert profiler.tracing
    run_steps(profiler, 3)
    assert glob.glob(str(tmp_path / "early" / "profile" / "plugins" / "profile" / "*" / "*.pb"))


@pytest.mark.parametrize("steps", [(0, 3), (3, 2), (1,), (1, 2, 3), (1.0, 2), (True, 2), "1,2",
                                   (5, 11)])
def test_bad_profile_steps_are_rejected(steps):
    with pytest.raises(ValueError, match="profile_steps"):
        logs.check_profile_steps(steps, total_steps=10)


def test_good_profile_steps_pass():
    assert logs.check_profile_steps(()) == ()
    assert logs.check_profile_steps([2, 2], total_steps=2) == (2, 2)
    assert logs.check_profile_steps((5, 100)) == (5, 100)


def test_atomic_write_leaves_the_old_file_whole_when_writing_fails(tmp_path):
    path = tmp_path / "result.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with files.atomic_write(str(path)) as f:
            f.write("new, half of it")
            raise RuntimeError("disk full")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["result.json"]
    with files.atomic_write(str(path)) as f:
        f.write("new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["result.json"]


def test_jsonl_lines_are_whole_and_a_torn_one_is_not_read(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    files.append_line(path, {"step": 1, "bits": 2.5})
    files.append_line(path, {"step": 2, "bits": 2.25})
    with open(path, "a") as f:
        f.write('{"step": 3, "bi')  # cut short by a full disk
    assert files.read_jsonl(path) == [{"step": 1, "bits": 2.5}, {"step": 2, "bits": 2.25}]


def test_a_part_left_by_a_killed_writer_is_removed_by_the_next(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    path = str(tmp_path / "data.txt")
    for pid in (dead, "1", "x"):  # gone; alive (init); not a part of ours
        open(f"{path}.part{pid}", "w").close()
    assert files.part_suffix(path) == f".part{os.getpid()}"
    assert sorted(os.listdir(tmp_path)) == ["data.txt.part1", "data.txt.partx"]


def test_a_write_probe_left_by_a_killed_process_is_removed_by_the_next(tmp_path):
    from sparse_jax.run import workdir

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / f".write_test.part{dead}").write_text("ok")  # killed between write and remove
    workdir.check_output(str(tmp_path / "result.json"), overwrite=False)
    assert os.listdir(tmp_path) == []


def read_events(path):
    """The Event protos of a TensorBoard file (TFRecord: length, its CRC, data, data CRC)."""
    from tensorboardX.proto.event_pb2 import Event

    with open(path, "rb") as f:
        events, data = [], f.read()
    while data:
        length = int.from_bytes(data[:8], "little")
        events.append(Event.FromString(data[12:12 + length]))
        data = data[16 + length:]
    return events


def test_runs_started_in_the_same_second_keep_their_tensorboard_files(tmp_path, monkeypatch):
    """The event file is named by the second: a resumed run must not truncate the last one's."""
    from tensorboardX import event_file_writer

    class FrozenClock:
        @staticmethod
        def time():
            return 1_700_000_000.25

    monkeypatch.setattr(event_file_writer, "time", FrozenClock)
    for start, value in ((0, 1.5), (10, 2.5)):
        logger = logs.Logger(str(tmp_path), start_step=start, total_steps=20)
        logger.write(start + 5, "train", {"bits": value})
        logger.close()
    paths = sorted(glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*")))
    assert len(paths) == 2
    logged = sorted((e.step, v.simple_value) for p in paths for e in read_events(p)
                    for v in e.summary.value if v.tag == "train/bits")
    assert logged == [(5, 1.5), (15, 2.5)]
