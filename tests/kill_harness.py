"""Random-kill harness: runs killed with SIGKILL at random instants, restarted until they finish.

Three subjects, each checked against the same work done without a kill:

* training: `scripts/train.py` (tiny model, the shipped corpus copied to a fresh folder, a
  checkpoint every 4 steps, validation every 10, a log line every 2) is started on one workdir
  and killed at a random instant of its run, again and again (start-up, steps, validation,
  checkpoint saves and log writes all get hit), then run to the end. Pass: every start that was
  not killed exits 0 (no start needs a repair), the final parameters equal the uninterrupted
  run's bit for bit, `metrics.jsonl` has the same rows with the same values (none lost, none
  twice), and nothing is left next to the workdir or the data but what the uninterrupted run
  leaves there.
* the data cache: `sources.load_bytes` of a 200 MB .gz (decompressed next to it, hashed and
  vouched for) killed mid-way, again and again. Pass: the next load returns the right bytes and
  the folder holds only the file, its copy and the copy's record.
* outputs: `scripts/evaluate.py` (JSON and PNG in WORKDIR/eval) and `scripts/sample.py` (text
  in WORKDIR/samples) on a finished 4-step run, in turn, each start killed at a random instant
  of its run or just after a file appears in its output folder (a write under way), from
  nothing or over the previous outputs, then run again to its end with the same command (which
  passes --overwrite). Pass: after each kill an output is absent or whole (the evaluation JSON
  equal to the uninterrupted run's apart from its timings, the PNG and the samples byte for
  byte, for a fixed seed), the next run exits 0 and writes the same, nothing the dead process
  was writing is left after it, and no other file of the workdir changes.

  python tests/kill_harness.py --kills=50 [--data_kills=20] [--output_kills=20] [--seed=0]
      [--output=results.json]

--kills, --data_kills and --output_kills set the kills of each subject (0 skips it);
--output_kills kills evaluate.py and sample.py in turn (half of each at a write). The summary
line of the outputs subject counts the kills that left a half-written temporary file
("mid-write"). `tests/test_kill_harness.py` runs a quick version in the suite.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 40


def _train_args(workdir: str, data: str, *changes: str) -> list[str]:
    """scripts/train.py's argv for the training subject; `changes` ("--config.X=V") replace the
    flags they name."""
    args = [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
            f"--config={os.path.join(ROOT, 'configs', 'bytes.py')}:size=tiny",
            f"--workdir={workdir}", f"--config.data.path={data}",
            f"--config.total_steps={STEPS}", "--config.checkpoint_every=4",
            "--config.eval_every=10", "--config.eval_batches=4", "--config.log_every=2",
            "--config.model.dropout=0.1", "--config.optimizer.warmup_steps=4"]
    names = {change.split("=")[0] for change in changes}
    return [a for a in args if a.split("=")[0] not in names] + list(changes)


def _env(cache: str) -> dict:
    """The runs share a compilation cache (restarts compile in a moment) and see no GPU."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def _files(folder: str, skip: tuple[str, ...] = ()) -> set[str]:
    """Every file and folder under `folder` (relative paths), not descending into `skip`."""
    found = set()
    for top, dirs, files in os.walk(folder):
        rel = os.path.relpath(top, folder)
        dirs[:] = [d for d in dirs if os.path.normpath(os.path.join(rel, d)) not in skip]
        found.update(os.path.normpath(os.path.join(rel, name)) for name in dirs + files)
    return found


def _run(args, env, log_path, kill_after: float | None,
         kill_when=None) -> tuple[int | None, float]:
    """Starts `args`; SIGKILLs it after `kill_after` seconds if still running, or (`kill_when`)
    as soon as `kill_when()` is true, polled every ~0.5 ms. Returns (exit status, or None if
    killed; seconds it ran)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            if kill_when is None:
                status = proc.wait(timeout=kill_after)
            else:
                while (status := proc.poll()) is None and not kill_when():
                    time.sleep(0.0005)
                if status is None:
                    raise subprocess.TimeoutExpired(args, 0)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            status = None
    return status, time.perf_counter() - start


def _metrics(workdir: str) -> list[dict]:
    """metrics.jsonl's rows without their timings (which differ from run to run)."""
    keep = ("step", "split", "bits", "grad_norm", "lr", "count")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [{k: row[k] for k in keep if k in row} for row in map(json.loads, f)]


def _params(workdir: str, steps: int = STEPS) -> list[np.ndarray]:
    """The final checkpoint's (step `steps`) parameters, as arrays in a fixed order."""
    import jax
    from flax import nnx

    from sparse_jax.run import checkpoints

    model, _, step = checkpoints.restore_model(workdir)
    assert step == steps, f"the last checkpoint of {workdir} is step {step}, not {steps}"
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))]


def _last_line(path) -> str:
    lines = [line for line in open(path, errors="replace").read().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def training(kills: int, rng: np.random.Generator, tmp: str, log=print,
             steps: int = STEPS) -> dict:
    """The training subject: campaigns of killed starts on a fresh workdir, each run to its end
    (a start that finishes ends a campaign; the next starts over), until `kills` kills are
    done; each campaign is compared with one uninterrupted run. Runs of `steps` steps (the
    suite's quick version: fewer, still several checkpoints, validations and log lines).
    Returns counts and problems (an empty list: passed)."""
    length = f"--config.total_steps={steps}"
    data = os.path.join(tmp, "data")
    os.makedirs(data)
    for name in ("kjv.html.gz", "SHA256SUMS"):
        shutil.copy(os.path.join(ROOT, "data", name), data)
    corpus = os.path.join(data, "kjv.html.gz")
    env = _env(os.path.join(tmp, "jax_cache"))
    logs = os.path.join(tmp, "logs")
    os.makedirs(logs)
    reference = os.path.join(tmp, "reference")
    for name in ("reference", "probe"):  # the second start compiles nothing: a start's length
        status, duration = _run(_train_args(os.path.join(tmp, name), corpus, length), env,
                                os.path.join(logs, f"{name}.log"), None)
        if status != 0:
            reason = _last_line(os.path.join(logs, f"{name}.log"))
            raise RuntimeError(f"the uninterrupted run failed: {reason}")
    shutil.rmtree(os.path.join(tmp, "probe"))
    skip = ("reference", "logs", "jax_cache")
    outside = _files(tmp, skip=skip)
    want_metrics, want_params = _metrics(reference), _params(reference, steps)
    log(f"training: an uninterrupted start takes {duration:.1f} s; {kills} kills at random "
        "instants of it")
    problems, killed, starts, campaigns = [], 0, 0, 0
    while killed < kills:
        workdir = os.path.join(tmp, f"killed{campaigns}")
        campaigns += 1
        args = _train_args(workdir, corpus, length)
        while True:
            kill_after = float(rng.uniform(0.0, duration)) if killed < kills else None
            status, _ = _run(args, env, os.path.join(logs, f"{starts}.log"), kill_after)
            starts += 1
            killed += status is None
            if status not in (None, 0):
                reason = _last_line(os.path.join(logs, f"{starts - 1}.log"))
                problems.append(f"start {starts - 1} failed by itself: {reason}")
                return {"kills": killed, "starts": starts, "campaigns": campaigns,
                        "problems": problems}
            if status == 0:
                break
        got = _metrics(workdir)
        if got != want_metrics:
            steps = lambda rows: [(r["step"], r["split"]) for r in rows]  # noqa: E731
            problems.append(f"{workdir}: metrics.jsonl rows {steps(got)} against "
                            f"{steps(want_metrics)}" if steps(got) != steps(want_metrics)
                            else f"{workdir}: metrics.jsonl values differ")
        got_params = _params(workdir, steps)
        if len(got_params) != len(want_params) or not all(
                np.array_equal(a, b) for a, b in zip(got_params, want_params)):
            problems.append(f"{workdir}: the final parameters differ from the uninterrupted "
                            "run's")
        skip += (os.path.basename(workdir),)
    left = _files(tmp, skip=skip) - outside
    if left:
        problems.append(f"left behind outside the workdirs: {sorted(left)}")
    return {"kills": killed, "starts": starts, "campaigns": campaigns, "problems": problems,
            "bit_exact": not problems}


SIZE = 200_000_000  # bytes of the decompressed data: ~1 s to decompress and hash, most of a load
LOAD = ("import sys; from sparse_jax.data import sources; "
        "print(sources.load_bytes(sys.argv[1])[:0].size)")


def data_cache(kills: int, rng: np.random.Generator, tmp: str, log=print) -> dict:
    """The data-cache subject: loads of a .gz killed mid-way, then one to the end."""
    folder = os.path.join(tmp, "cache")
    os.makedirs(folder)
    with gzip.open(os.path.join(ROOT, "data", "kjv.html.gz"), "rb") as f:
        text = f.read()
    want = (text * (SIZE // len(text) + 1))[:SIZE]
    path = os.path.join(folder, "big.txt.gz")
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(want)
    args = [sys.executable, "-c", LOAD, path]
    env = _env(os.path.join(tmp, "jax_cache"))
    logs = os.path.join(tmp, "logs")
    os.makedirs(logs, exist_ok=True)
    probe = os.path.join(tmp, "probe")  # how long one load takes, on another copy
    os.makedirs(probe)
    shutil.copy(path, probe)
    status, duration = _run(args[:-1] + [os.path.join(probe, "big.txt.gz")], env,
                            os.path.join(logs, "load_probe.log"), None)
    if status != 0:
        reason = _last_line(os.path.join(logs, "load_probe.log"))
        raise RuntimeError(f"loading the .gz failed: {reason}")
    shutil.rmtree(probe)
    log(f"data cache: one load {duration:.1f} s; {kills} kills at random instants")
    problems, killed = [], 0
    for i in range(kills):
        status, _ = _run(args, env, os.path.join(logs, f"load{i}.log"),
                         float(rng.uniform(0.0, duration)))
        killed += status is None
        if status not in (None, 0):
            reason = _last_line(os.path.join(logs, f"load{i}.log"))
            problems.append(f"load {i} failed by itself: {reason}")
        if status == 0:  # the copy is complete: later loads map it; start over
            os.remove(os.path.join(folder, "big.txt"))
            os.remove(os.path.join(folder, "big.txt.verified"))
    status, _ = _run(args, env, os.path.join(logs, "load_final.log"), None)
    if status != 0:
        reason = _last_line(os.path.join(logs, "load_final.log"))
        problems.append(f"the final load failed: {reason}")
    elif open(os.path.join(folder, "big.txt"), "rb").read() != want:
        problems.append("the decompressed copy differs from the data")
    left = _files(folder) - {"big.txt.gz", "big.txt", "big.txt.verified"}
    if left:
        problems.append(f"left behind next to the data: {sorted(left)}")
    return {"kills": killed, "starts": kills + 1, "problems": problems}


# The outputs subject: scripts/evaluate.py and scripts/sample.py on a finished 4-step run. Both
# pass --overwrite: a kill after the output was written leaves it whole, and the same command
# run again must replace it (without --overwrite it would refuse to, by design).
OUTPUT_STEPS = 4
OUTPUT_COMMANDS = {  # script, its flags, what it writes (relative to the workdir)
    "evaluate": ("evaluate.py", ["--split=valid", "--overwrite"],
                 [f"eval/valid_{OUTPUT_STEPS}.png", f"eval/valid_{OUTPUT_STEPS}.json"]),
    "sample": ("sample.py", ["--length=32", "--num_samples=2", "--seed=0", "--overwrite"],
               [f"samples/{OUTPUT_STEPS}_seed0.txt"]),
}
TIMING = ("tokens_per_s", "scored_per_s", "wall_s")  # an evaluation's timings: run to run
WRITE_DELAY = 0.01  # a kill "at a write" lands 0 to this many seconds after a file appears


def _output(path: str):
    """What a complete output holds: an evaluation result without its timings (None if it is not
    whole JSON), or a file's bytes (a text sample, a PNG: the same for the same result)."""
    if not path.endswith(".json"):
        with open(path, "rb") as f:
            return f.read()
    try:
        with open(path) as f:
            return {k: v for k, v in json.load(f).items() if k not in TIMING}
    except ValueError:
        return None


def _digests(folder: str, skip: tuple[str, ...]) -> dict[str, bytes]:
    """{relative path: bytes} of every file under `folder`, not descending into `skip`."""
    return {rel: open(os.path.join(folder, rel), "rb").read() for rel in _files(folder, skip)
            if os.path.isfile(os.path.join(folder, rel))}


def _strays(workdir: str, written: list[str]) -> list[str]:
    """Files in the output folders of one command other than its outputs: temporary files."""
    folders = {os.path.dirname(rel) for rel in written}
    return sorted(os.path.join(f, name) for f in folders if os.path.isdir(os.path.join(workdir, f))
                  for name in os.listdir(os.path.join(workdir, f))
                  if os.path.join(f, name) not in written)


def _at_a_write(workdir: str, written: list[str], delay: float):
    """kill_when for `_run`: true `delay` seconds after a file other than the finished outputs
    (a temporary file being written, a write probe) appears in the command's output folders."""
    seen = []

    def due() -> bool:
        if not seen and _strays(workdir, written):
            seen.append(time.perf_counter())
        return bool(seen) and time.perf_counter() - seen[0] >= delay
    return due


def outputs(kills: int, rng: np.random.Generator, tmp: str, log=print) -> dict:
    """The outputs subject: `scripts/evaluate.py` and `scripts/sample.py` on a finished tiny
    workdir, each start killed (in turn) at a random instant of its run or at one of its writes
    (`_at_a_write`), its outputs removed first or not (at random), then run again to its end,
    until `kills` kills are done. Returns counts and problems (an empty list: passed)."""
    folder = os.path.join(tmp, "outputs")
    os.makedirs(folder)
    data, workdir = os.path.join(folder, "data.txt"), os.path.join(folder, "run")
    with gzip.open(os.path.join(ROOT, "data", "kjv.html.gz"), "rb") as f:
        with open(data, "wb") as out:
            out.write(f.read(200_000))  # 10 KB to evaluate: a start takes seconds
    env = _env(os.path.join(tmp, "jax_cache"))
    logs = os.path.join(tmp, "logs")
    os.makedirs(logs, exist_ok=True)
    steps = f"--config.total_steps={OUTPUT_STEPS}"
    status, _ = _run(_train_args(workdir, data, steps, f"--config.checkpoint_every={OUTPUT_STEPS}",
                                 f"--config.eval_every={OUTPUT_STEPS}", "--config.log_every=1",
                                 "--config.optimizer.warmup_steps=1"),
                     env, os.path.join(logs, "outputs_train.log"), None)
    if status != 0:
        raise RuntimeError(f"training the workdir failed: "
                           f"{_last_line(os.path.join(logs, 'outputs_train.log'))}")
    commands, want, duration = {}, {}, {}
    for name, (script, flags, written) in OUTPUT_COMMANDS.items():
        commands[name] = [sys.executable, os.path.join(ROOT, "scripts", script),
                          f"--workdir={workdir}", *flags]
        status, duration[name] = _run(commands[name], env,
                                      os.path.join(logs, f"{name}_reference.log"), None)
        if status != 0:
            reason = _last_line(os.path.join(logs, f"{name}_reference.log"))
            raise RuntimeError(f"the uninterrupted {name} failed: {reason}")
        want.update({rel: _output(os.path.join(workdir, rel)) for rel in written})
    skip = tuple(sorted({os.path.dirname(rel) for _, _, w in OUTPUT_COMMANDS.values()
                         for rel in w}))
    inputs, everything = _digests(workdir, skip), _files(folder)
    log(f"outputs: evaluate {duration['evaluate']:.1f} s, sample {duration['sample']:.1f} s; "
        f"{kills} kills at random instants and at writes")
    problems, killed, starts, mid_write = [], 0, 0, 0
    for attempt in range(4 * kills):  # a start that ends before its kill is no kill
        if killed == kills:
            break
        name = ("evaluate", "sample")[attempt % 2]
        at_write = attempt // 2 % 2 == 1
        written = OUTPUT_COMMANDS[name][2]
        if rng.random() < 0.5:  # from nothing, or over the outputs of the run before
            for rel in written:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(workdir, rel))
        kill_when = _at_a_write(workdir, written, float(rng.uniform(0, WRITE_DELAY))) \
            if at_write else None
        log_path = os.path.join(logs, f"{name}{attempt}.log")
        status, _ = _run(commands[name], env, log_path,
                         None if at_write else float(rng.uniform(0.0, duration[name])), kill_when)
        starts += 1
        what = f"{name} start {attempt} ({'killed ' if status is None else ''}" \
               f"{'at a write' if at_write else 'at a random instant'})"
        if status not in (None, 0):
            problems.append(f"{what} failed by itself: {_last_line(log_path)}")
            break
        for rel in written:  # nothing or a whole output, never a partial one
            path = os.path.join(workdir, rel)
            if os.path.exists(path) and _output(path) != want[rel]:
                problems.append(f"{what}: {rel} is partial or differs from the uninterrupted "
                                "run's")
        if status == 0:
            continue
        killed += 1
        mid_write += bool(_strays(workdir, written))  # a temporary file left by the kill
        log_path = os.path.join(logs, f"{name}{attempt}_again.log")
        status, seconds = _run(commands[name], env, log_path, None)  # the same command again
        starts += 1
        duration[name] = min(duration[name], seconds)  # the later starts compile nothing
        if status != 0:
            problems.append(f"{what}: the next run failed: {_last_line(log_path)}")
            break
        for rel in written:
            if _output(os.path.join(workdir, rel)) != want[rel]:
                problems.append(f"{what}: the next run's {rel} differs from the uninterrupted "
                                "run's")
        left = _files(folder) - everything
        if left:
            problems.append(f"{what}: left behind after the next run: {sorted(left)}")
        if _digests(workdir, skip) != inputs:
            problems.append(f"{what}: files of the workdir changed")
    if killed < kills and not problems:
        problems.append(f"only {killed} kills in {starts} starts")
    return {"kills": killed, "starts": starts, "mid_write": mid_write, "problems": problems}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50, help="kills of the training run")
    parser.add_argument("--data_kills", type=int, default=20, help="kills of the data load")
    parser.add_argument("--output_kills", type=int, default=20,
                        help="kills of evaluate.py and sample.py, taking turns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    tmp = tempfile.mkdtemp(prefix="sparse_jax_kills_")
    try:
        subjects = [("training", training, args.kills), ("data_cache", data_cache,
                     args.data_kills), ("outputs", outputs, args.output_kills)]
        results = {name: run(kills, rng, tmp) for name, run, kills in subjects if kills > 0}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, result in results.items():
        verdict = "; ".join(result["problems"]) if result["problems"] else "passed"
        mid_write = f" ({result['mid_write']} mid-write)" if "mid_write" in result else ""
        print(f"{name}: {result['kills']} kills{mid_write} in {result['starts']} starts, "
              f"{verdict}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"seed": args.seed, **results}, f, indent=1)
    return 0 if all(not r["problems"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
