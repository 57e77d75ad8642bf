#!/usr/bin/env python
r"""Bad inputs and faults through the command line: every failure is one short, true error line,
and nothing a user has is lost.

  python tests/bad_inputs.py                          # every case (~10 min on 2 CPU cores)
  python tests/bad_inputs.py --jobs=2 --output=bad_inputs.json
  python tests/bad_inputs.py --only=sample/ --keep    # names containing "sample/"; keep folders
  python tests/bad_inputs.py --list                   # the cases, without running them

Each case runs one entry point (`scripts/*.py`) in a fresh temporary folder (its working
directory, so nothing is written into the repository) after a setup function has prepared
files there: data files, a workdir copied from a tiny run trained once per session, damaged
checkpoints, a trainer running in the background. The expected outcome is either

* "error": a non-zero exit status and exactly one line on stderr that starts with `error: `
  and matches the case's regular expression (what is wrong, the path or field); or
* "ok": exit status 0 and the case's check (e.g. a damaged newest checkpoint was set aside and
  training went on from the previous one).

Either way no Python traceback may appear (`SPARSE_JAX_TRACEBACK` is unset), and nothing is
lost: every file in the case's folder (workdir, data, earlier samples and results) is hashed
(sha256) before the command and after it; a file may only change or vanish where the case
allows it (`may_change`), or move into a `damaged*` folder with its bytes intact. New files
are always allowed; so are files whose name contains "lock" (the trainer's lock).

Prints a table (case, expected, got, verdict) and "N cases: X ok, Y failed, Z skipped",
writes the results as JSON to --output, and exits with status 1 if any case failed. A case's
`rule` names the documented behaviour it checks (docs/robustness.md and
"Errors"), listed by --list. Running as root
skips the cases that need file permissions to be enforced (chmod). A full disk is simulated
with a file-size limit (`ulimit -f`: writes fail with EFBIG, "File too large").

`tests/test_bad_inputs.py` runs a few of these cases under pytest (`-m slow`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import fnmatch
import glob
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("train", "evaluate", "sample", "describe", "plot_pattern", "compare_patterns",
           "image_baselines", "repeats", "benchmark_attention", "benchmark_model",
           "benchmark_sampling", "benchmark_training")
TRACEBACK = "Traceback (most recent call last)"
MAX_ERROR_CHARS = 500  # "short": the error line, with the case folder written as {tmp}

# A 1-layer, d=16 model on 20 KB of the generated stream: 4 steps, checkpoints at 2 and 4.
CONFIG = "{root}/configs/quickstart.py:data=embedded"
TINY = ["--config.data.embedded_bytes=20000", "--config.model.seq_len=64",
        "--config.model.num_layers=1", "--config.model.d_model=16", "--config.model.num_heads=2",
        "--config.model.stride=8", "--config.batch_size=4", "--config.total_steps=4",
        "--config.eval_every=2", "--config.checkpoint_every=2", "--config.log_every=2",
        "--config.eval_batches=2", "--config.optimizer.warmup_steps=1", "--cpu_devices=1"]


def tiny(*extra, workdir="{work}", config=CONFIG):
    """argv of scripts/train.py on the tiny config; `extra` flags come last (the last wins)."""
    return ["train", f"--config={config}", f"--workdir={workdir}", *TINY, *extra]


# configs/images.py on {tmp}/pics: pictures of 4 x 4 x 3, a 2-layer d=16 model, 4 steps.
IMAGES = ["--config.data.path={tmp}/pics", "--config.model.d_model=16",
          "--config.data.split_fractions=(0.5,0.25,0.25)", "--cpu_devices=1"]


def tiny_images(*extra, workdir="{work}", shape=(4, 4, 3)):
    """argv of scripts/train.py on configs/images.py:size=tiny and the folder {tmp}/pics, for
    a model of pictures of `shape` (a tuple override given twice would be concatenated)."""
    h, w, c = shape
    return ["train", "--config={root}/configs/images.py:size=tiny", f"--workdir={workdir}",
            *IMAGES, f"--config.model.image_shape=({h},{w},{c})",
            f"--config.model.seq_len={h * w * c}", f"--config.model.stride={w * c}", *extra]


def shortened_images(*extra, workdir="{work}"):
    """argv of scripts/train.py on configs/images.py:size=cpu (2,400 steps, warmup 100) cut to
    2 steps, its warmup left to the preset, on {tmp}/pics with a 1-layer model (4 x 4 x 3
    pictures: the shape from the folder); `extra` flags come last."""
    return ["train", "--config={root}/configs/images.py:size=cpu", f"--workdir={workdir}",
            *IMAGES, "--config.model.num_layers=1", "--config.model.attention=xla",
            "--config.batch_size=2", "--config.total_steps=2", "--config.eval_batches=1", *extra]


def on_bytes(path="{tmp}/data.txt"):
    """Flags that train the tiny model on a byte file instead of the generated stream."""
    return ["--config.data.name=bytes", f"--config.data.path={path}"]


# ---------------------------------------------------------------------------------------------
# Cases.


@dataclasses.dataclass
class Case:
    name: str  # group/what, e.g. "data/truncated .gz"
    argv: list  # the script's short name, then its flags; "{tmp}", "{work}", "{root}" filled in
    expect: str  # "error" or "ok"
    match: str = ""  # error: a regex (case-insensitive) the one `error: ` line must match
    check: Callable | None = None  # fn(Run) -> list of problems (of a refused run too)
    setup: Callable | None = None  # fn(Ctx): prepares files in the case's folder
    may_change: tuple = ()  # globs (relative to the case folder) of files that may change/go
    rule: str = ""  # the documented behaviour this case checks, when not obvious
    nonroot: bool = False  # needs permissions enforced (skipped when running as root)
    timeout: float = 180.0
    fsize_limit: int | None = None  # bytes: RLIMIT_FSIZE of the command (a "full disk")
    env: dict = dataclasses.field(default_factory=dict)


class SetupError(Exception):
    pass


class Fixtures:
    """Things built once per session, lazily: a finished tiny run ("trained")."""

    def __init__(self, root: str, env: dict):
        self.root, self.env = root, env
        self._lock, self._built, self._failed = threading.Lock(), {}, {}

    def get(self, name: str) -> str:
        with self._lock:
            if name in self._failed:
                raise SetupError(f"fixture {name} failed: {self._failed[name]}")
            if name not in self._built:
                try:
                    self._built[name] = getattr(self, "_build_" + name)()
                except SetupError as e:
                    self._failed[name] = str(e)
                    raise
            return self._built[name]

    def _build_kernels(self) -> str:
        """A cache folder holding this machine's build of the CPU kernels (and its record)."""
        folder = os.path.join(self.root, "kernels")
        proc = subprocess.run([sys.executable, "-c", "import sys\nfrom sparse_jax.attention "
                               "import native\nnative.build(sys.argv[1])", folder], env=self.env,
                              capture_output=True, text=True, timeout=600)
        if proc.returncode or not any(n.endswith(".so") for n in os.listdir(folder)):
            raise SetupError(f"building the CPU kernels: {proc.stderr.strip()[-300:]}")
        return folder

    def _build_trained(self) -> str:
        folder = os.path.join(self.root, "trained")
        os.makedirs(folder)
        work = os.path.join(folder, "work")
        run_command(tiny(workdir=work), folder, self.env, what="building the trained fixture")
        if not os.path.isdir(os.path.join(work, "checkpoints", "4")):
            raise SetupError(f"the trained fixture has no checkpoint 4: {os.listdir(work)}")
        return work


def expand(arg, ctx: "Ctx"):
    if isinstance(arg, bytes):
        return arg
    return arg.format(tmp=ctx.tmp, work=ctx.work, root=ROOT)


# Runs argv[2:] with RLIMIT_FSIZE set to argv[1] bytes (exec: the same process, the limit kept).
LIMITED = ("import os, resource, sys; limit = int(sys.argv[1]); "
           "resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)); "
           "os.execv(sys.argv[2], sys.argv[2:])")


def command(argv: list, ctx=None) -> list:
    script, *flags = argv
    if script not in SCRIPTS:
        raise ValueError(f"unknown script {script}")
    flags = [expand(a, ctx) for a in flags] if ctx is not None else flags
    return [sys.executable, os.path.join(ROOT, "scripts", script + ".py"), *flags]


def run_command(argv, cwd, env, what="setup", timeout=300, check=True):
    """Runs a script for a setup step; SetupError unless it succeeds."""
    argv = [a.format(tmp=cwd, work=os.path.join(cwd, "work"), root=ROOT)
            if isinstance(a, str) else a for a in argv]
    proc = subprocess.run(command(argv), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        raise SetupError(f"{what}: {' '.join(argv[:1])} exited {proc.returncode}: {tail}")
    return proc


class Ctx:
    """The case's folder and what its setup started."""

    def __init__(self, tmp: str, fixtures: Fixtures, env: dict, logs: str):
        self.tmp, self.fixtures, self.env, self.logs = tmp, fixtures, env, logs
        self.work = os.path.join(tmp, "work")
        self.background: list[subprocess.Popen] = []
        self.chmodded: list[str] = []

    def path(self, *parts) -> str:
        return os.path.join(self.tmp, *parts)

    def teardown(self):
        for proc in self.background:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for path in self.chmodded:
            if os.path.exists(path):
                os.chmod(path, 0o755)


# Setup steps: each returns fn(ctx).


def seq(*steps):
    def run(ctx):
        for step in steps:
            step(ctx)
    return run


def write(rel: str, content: bytes | str):
    def run(ctx):
        path = ctx.path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
    return run


def mkdir(rel: str):
    return lambda ctx: os.makedirs(ctx.path(rel), exist_ok=True)


def mkfifo(rel: str):
    """A named pipe (FIFO) with no writer: a reader that opens it waits forever."""
    return lambda ctx: os.mkfifo(ctx.path(rel))


def remove(rel: str):
    def run(ctx):
        path = ctx.path(rel)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    return run


def chmod(rel: str, mode: int):
    def run(ctx):
        os.chmod(ctx.path(rel), mode)
        ctx.chmodded.append(ctx.path(rel))
    return run


def trained(dest: str = "work"):
    """A copy of the finished tiny run (checkpoints 2 and 4, config.json, metrics)."""
    def run(ctx):
        shutil.copytree(ctx.fixtures.get("trained"), ctx.path(dest), symlinks=True)
    return run


def train_here(*extra, workdir="{work}", argv=tiny):
    """Trains the tiny config (`argv`: `tiny` or `tiny_images`) in the case folder now (a run
    whose config.json names files there), with `extra` flags."""
    def run(ctx):
        run_command(argv(*extra, workdir=workdir), ctx.tmp, ctx.env, what="training in setup")
    return run


def kernels_cache(how: str = "", dest: str = "cache"):
    """{tmp}/cache holding a copy of the CPU kernels' build, then damaged: "cut short" (half
    the library), "garbage" (random bytes of its size), "foreign" (another shared library at
    its name), "record" (its record damaged), "" (left whole)."""
    def run(ctx):
        shutil.copytree(ctx.fixtures.get("kernels"), ctx.path(dest))
        library = glob_paths(ctx.path(dest, "*.so"))[0]
        with open(library, "rb") as f:
            good = f.read()
        if how == "cut short":
            content = good[:len(good) // 2]
        elif how == "garbage":
            content = random.Random(0).randbytes(len(good))
        elif how == "foreign":
            import _ctypes
            with open(os.path.realpath(_ctypes.__file__), "rb") as f:
                content = f.read()
        elif how == "record":
            with open(library + ".verified", "w") as f:
                f.write('{"key": ')
            return
        else:
            return
        with open(library, "wb") as f:
            f.write(content)
    return run


def glob_paths(pattern: str) -> list[str]:
    return sorted(glob.glob(pattern))


def dead_pid() -> int:
    """The id of a process that has ended."""
    proc = subprocess.Popen([sys.executable, "-c", ""])
    proc.wait()
    return proc.pid


def recorded_attention(value: str, dest: str = "work"):
    """Rewrites the run's config.json as if it had trained with model.attention=`value`."""
    def run(ctx):
        path = ctx.path(dest, "config.json")
        with open(path) as f:
            record = json.load(f)
        record["model"]["attention"] = value
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
    return run


def damage(step: int, how: str = "garbage", dest: str = "work"):
    """Damages checkpoint `step`: "garbage" (every array file overwritten with random bytes of
    its size), "truncate" (every file of params/ and opt/ emptied), "no_params" (params/
    deleted), "no_meta" (meta/ deleted)."""
    def run(ctx):
        folder = ctx.path(dest, "checkpoints", str(step))
        if not os.path.isdir(folder):
            raise SetupError(f"no checkpoint {step} to damage in {folder}")
        if how in ("no_params", "no_meta"):
            shutil.rmtree(os.path.join(folder, how[3:]))
            return
        rng = random.Random(step)
        for part in ("params", "opt"):
            for base, _, files in os.walk(os.path.join(folder, part)):
                for name in files:
                    path = os.path.join(base, name)
                    size = os.path.getsize(path)
                    with open(path, "wb") as f:
                        if how == "garbage":
                            f.write(bytes(rng.randrange(256) for _ in range(max(size, 16))))
    return run


def background_trainer(*extra, wait_for=r"Starting|Resuming", kill=False):
    """Starts the tiny trainer on {work} for 100,000 steps in the background and waits until it
    prints `wait_for` (it holds the workdir then); with `kill`, then SIGKILLs it."""
    def run(ctx):
        argv = tiny("--config.total_steps=100000", "--config.checkpoint_every=100000",
                    "--config.eval_every=100000", "--config.log_every=100000", *extra)
        log_path = os.path.join(ctx.logs, f"background{len(ctx.background)}.log")
        log = open(log_path, "w")
        proc = subprocess.Popen(command(argv, ctx), cwd=ctx.tmp, env=ctx.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        ctx.background.append(proc)
        while True:  # until it holds the workdir; 100,000 steps end, so no clock is needed
            with open(log_path) as f:
                text = f.read()
            if re.search(wait_for, text):
                break
            if proc.poll() is not None:
                raise SetupError(f"the background trainer exited {proc.returncode}: "
                                 f"{text.strip().splitlines()[-1:]}")
            time.sleep(0.2)
        if kill:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    return run


# Data files.


def text_bytes(n: int, seed: int = 0) -> bytes:
    """n bytes of word-like printable ASCII text with newlines (no byte above 126)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 8)))
             for _ in range(300)]
    out, line = bytearray(), 0
    while len(out) < n:
        word = rng.choice(words).encode()
        out += word + (b"\n" if line > 60 else b" ")
        line = 0 if line > 60 else line + len(word) + 1
    return bytes(out[:n])


DATA = text_bytes(20_000)


def gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def zip_bytes(members: dict[str, bytes]) -> bytes:
    path = tempfile.mktemp(suffix=".zip")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    with open(path, "rb") as f:
        data = f.read()
    os.remove(path)
    return data


def picture(shape=(4, 4, 3), seed=0, fmt="PNG", cut: int = 0) -> bytes:
    """A picture of random pixels, uint8 [H, W, C] = `shape`, as PNG or JPEG bytes; `cut`
    bytes taken off its end (its header whole, its pixels damaged)."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels[..., 0] if shape[-1] == 1 else pixels).save(out, format=fmt)
    return out.getvalue()[:len(out.getvalue()) - cut]


def pictures(n: int = 8, folder: str = "pics", **kwargs):
    """n pictures (`picture(seed=i, **kwargs)`) in {tmp}/<folder>/<class>/: a usable folder."""
    return seq(*(write(f"{folder}/{'ab'[i % 2]}/{i:02d}.png", picture(seed=i, **kwargs))
                 for i in range(n)))


def modify_byte(rel: str, offset: int = 10_000):
    """Changes one byte of a file, keeping its size (an edited data file)."""
    def run(ctx):
        with open(ctx.path(rel), "r+b") as f:
            f.seek(offset)
            old = f.read(1)
            f.seek(offset)
            f.write(b"Z" if old != b"Z" else b"Y")
    return run


# Checks of a successful run: each returns fn(run) -> list of problems.


def exists(*rels):
    return lambda run: [f"{rel} does not exist" for rel in rels
                        if not os.path.exists(run.ctx.path(rel))]


def output_matches(regex: str, where: str = "both"):
    def check(run):
        text = {"stdout": run.stdout, "stderr": run.stderr}.get(where, run.stdout + run.stderr)
        return [] if re.search(regex, text, re.I | re.M) else [f"{where} does not match {regex!r}"]
    return check


def file_matches(rel: str, regex: str):
    def check(run):
        path = run.ctx.path(rel)
        if not os.path.isfile(path):
            return [f"{rel} does not exist"]
        with open(path, "rb") as f:
            text = f.read().decode("utf-8", "replace")
        return [] if re.search(regex, text, re.I | re.M) else [f"{rel} does not match {regex!r}"]
    return check


def unchanged(*rels):
    """The files exist and are byte-identical to before the command."""
    def check(run):
        problems = []
        for rel in rels:
            if rel not in run.before:
                problems.append(f"{rel} did not exist before")
            elif run.after.get(rel) != run.before[rel]:
                problems.append(f"{rel} changed")
        return problems
    return check


def changed(rel):
    return lambda run: [] if run.after.get(rel) != run.before.get(rel) else [f"{rel} unchanged"]


def kernels_rebuilt(dest: str = "cache"):
    """The cache's library is again the good build (the fixture's), vouched for."""
    def check(run):
        good = run.ctx.fixtures.get("kernels")
        problems = []
        for name in os.listdir(good):
            mine = run.ctx.path(dest, name)
            with open(os.path.join(good, name), "rb") as a:
                if not os.path.isfile(mine):
                    problems.append(f"{dest}/{name} is missing")
                    continue
                with open(mine, "rb") as b:
                    if a.read() != b.read():
                        problems.append(f"{dest}/{name} is not the good build")
        return problems
    return check


def absent(*rels):
    return lambda run: [f"{rel} still exists" for rel in rels if glob_paths(run.ctx.path(rel))]


def all_of(*checks):
    return lambda run: [p for c in checks for p in c(run)]


# Files a resumed or continued run writes.
RUN_FILES = ("work/metrics.jsonl", "work/tensorboard/*", "work/config_history.jsonl",
             "work/eval/*")


def build_cases() -> list[Case]:
    cases: list[Case] = []

    def add(name, argv, expect, match="", **kw):
        cases.append(Case(name, argv, expect, match, **kw))

    def err(name, argv, match, **kw):
        add(name, argv, "error", match, **kw)

    def ok(name, argv, check=None, **kw):
        add(name, argv, "ok", check=check, **kw)

    trained_run = trained()

    # -- scripts/train.py: flags --------------------------------------------------------------
    err("train/unknown flag", tiny("--bogus=1"), r"bogus")
    err("train/misspelled flag", tiny("--work_dir={tmp}/w"), r"work_dir")
    err("train/missing --workdir", ["train", f"--config={CONFIG}", *TINY], r"workdir")
    err("train/missing --config", ["train", "--workdir={work}", "--cpu_devices=1"], r"config")
    err("train/flag of the wrong type", tiny("--cpu_devices=two"), r"cpu_devices")
    err("train/positional argument", tiny("extra"), r"extra|argument")
    err("train/empty --workdir", tiny(workdir=""), r"workdir")

    # -- --config: the file, its arguments, --config.FIELD ------------------------------------
    err("config/unknown section", tiny("--config.modle.d_model=8"), r"modle")
    err("config/unknown field", tiny("--config.model.d_mdl=8"), r"d_mdl")
    err("config/unknown top-level field", tiny("--config.learning_rate=0.1"), r"learning_rate")
    err("config/wrong type (text for int)", tiny("--config.batch_size=four"), r"batch_size")
    err("config/wrong type (float for int)", tiny("--config.total_steps=4.5"), r"total_steps")
    err("config/wrong type (text for float)", tiny("--config.optimizer.lr=fast"), r"lr")
    err("config/wrong type (bool)", tiny("--config.data.download=maybe"), r"download")
    err("config/bad argument value", tiny(config="{root}/configs/quickstart.py:data=nope"),
        r"data")
    err("config/unknown argument", tiny(config="{root}/configs/quickstart.py:size=tiny"),
        r"size")
    err("config/argument not key=value", tiny(config="{root}/configs/quickstart.py:embedded"),
        r"embedded|key=value")
    err("config/missing file", tiny(config="{tmp}/nope.py"), r"nope\.py")
    err("config/a folder", tiny(config="{root}/configs"), r"configs")
    err("config/empty", tiny(config=""), r"config")
    err("config/file with a syntax error", tiny(config="{tmp}/broken.py"), r"broken\.py",
        setup=write("broken.py", "def get_config(:\n    return None\n"),
        rule="a user's config file that fails to load is a one-line error")
    err("config/file without get_config", tiny(config="{tmp}/empty_config.py"),
        r"empty_config\.py.*get_config|get_config.*empty_config\.py",
        setup=write("empty_config.py", "x = 1\n"),
        rule="a user's config file that fails to load is a one-line error")
    err("config/bytes.py bad size", tiny(config="{root}/configs/bytes.py:size=huge"), r"size")

    # -- values caught by the config checks ---------------------------------------------------
    kernel = "kernel options are checked when the config is read, whatever the platform"
    err("check/kernel heads per program above the heads (was: trained)",
        tiny("--config.model.kernel=h4"),
        r"ModelConfig\.kernel='h4': h4 heads per program must divide the model's 2 heads",
        check=absent("work"), rule=kernel)
    err("check/kernel options that contradict (was: the last won)",
        tiny("--config.model.kernel=terms:chained"),
        r"'terms' and 'chained' both set the variant; give each option once",
        check=absent("work"), rule=kernel)
    err("check/kernel tiles Triton cannot compile", tiny("--config.model.kernel=1x1"),
        r"kernel tiles 1x1: Triton needs at least 16", check=absent("work"), rule=kernel)
    err("check/negative lr", tiny("--config.optimizer.lr=-1"), r"lr")
    err("check/zero lr", tiny("--config.optimizer.lr=0"), r"lr")
    err("check/min_lr_ratio above 1", tiny("--config.optimizer.min_lr_ratio=2"), r"min_lr_ratio")
    err("check/warmup >= total_steps", tiny("--config.optimizer.warmup_steps=4"),
        r"warmup_steps=4 must be in \[0, total_steps=4\): set --config\.optimizer\.warmup_steps")
    ok("check/a preset shortened below its warmup", shortened_images(),
       all_of(exists("work/checkpoints/2"), output_matches(
           r"^optimizer\.warmup_steps=1 instead of the preset's 100: total_steps=2 shortens the "
           r"preset's 2400.*--config\.optimizer\.warmup_steps", "stdout")),
       setup=pictures(), rule="a run shortened below its preset warms up for the preset's share")
    ok("check/a shortened preset resumed keeps its warmup",
       shortened_images("--config.total_steps=3"),
       all_of(exists("work/checkpoints/3"), output_matches(
           r"warmup_steps=1 instead of the preset's 100: as the run being resumed", "stdout"),
           file_matches("work/config.json", r'"warmup_steps": 1\b')),
       setup=seq(pictures(), train_here(argv=shortened_images)),
       may_change=("work/checkpoints/*", "work/config.json", "work/data_fingerprint*",
                   *RUN_FILES),
       rule="a resumed run keeps the warmup it trained with")
    err("check/total_steps 0", tiny("--config.total_steps=0"), r"total_steps")
    err("check/batch_size 0", tiny("--config.batch_size=0"), r"batch_size")
    err("check/keep_checkpoints 0", tiny("--config.keep_checkpoints=0"), r"keep_checkpoints")
    err("check/batch not divisible by grad_accum", tiny("--config.optimizer.grad_accum=3"),
        r"grad_accum|divisible")
    err("check/batch not divisible by devices", tiny("--config.batch_size=3", "--cpu_devices=2"),
        r"devices|divisible|split")
    err("check/fsdp larger than the devices", tiny("--config.mesh.fsdp=3"), r"fsdp|mesh|devices")
    err("check/seq with no devices for it", tiny("--config.mesh.seq=4", "--cpu_devices=2"),
        r"mesh\.fsdp=1 x mesh\.seq=4 does not divide the 2 devices")
    err("check/seq that does not split the context",
        tiny("--config.mesh.seq=2", "--cpu_devices=2", "--config.model.seq_len=72"),
        r"context parallelism over 2 devices needs n/P a multiple of .*8.*n=72",
        rule="a context the seq devices cannot split is refused before any work")
    ok("train/each sequence split over 2 devices", tiny("--config.mesh.seq=2", "--cpu_devices=2"),
       output_matches(r"mesh \{'data': 1, 'fsdp': 1, 'seq': 2\}", "stdout"))
    err("check/stride longer than seq_len", tiny("--config.model.stride=128"), r"stride")
    err("check/unknown pattern", tiny("--config.model.pattern=sparse"), r"pattern")
    err("check/unknown attention implementation", tiny("--config.model.attention=cuda"),
        r"attention")
    err("check/native attention without a compiler", tiny("--config.model.attention=native"),
        r"attention.*CXX=/nonexistent/c\+\+", env={"CXX": "/nonexistent/c++"})
    err("check/pattern field that does not apply", tiny("--config.model.pattern=fixed"),
        r"local_width")
    err("check/heads do not divide d_model", tiny("--config.model.num_heads=3"),
        r"num_heads|d_model")
    err("check/negative seq_len", tiny("--config.model.seq_len=-64"), r"seq_len")
    err("check/dropout 1.5", tiny("--config.model.dropout=1.5"), r"dropout")
    err("check/unknown dataset", tiny("--config.data.name=imagenet"), r"name|imagenet")
    err("check/split fractions do not sum to 1",
        tiny("--config.data.split_fractions=(0.5,0.2,0.2)"), r"split_fractions")
    err("check/vocab smaller than the bytes", tiny("--config.model.vocab_size=64"), r"vocab",
        rule="vocabulary smaller than the data's bytes is refused")

    # -- data ---------------------------------------------------------------------------------
    err("data/missing file", tiny(*on_bytes("{tmp}/nope.txt")), r"nope\.txt")
    err("data/bytes without a path", tiny("--config.data.name=bytes"), r"path")
    err("data/a folder as the file", tiny(*on_bytes("{tmp}/folder")), r"folder",
        setup=mkdir("folder"))
    err("data/empty file", tiny(*on_bytes()), r"data\.txt|empty", setup=write("data.txt", b""))
    err("data/tiny file", tiny(*on_bytes()), r"data\.txt|small|bytes",
        setup=write("data.txt", DATA[:50]),
        rule="empty/too-small splits are refused at start")
    err("data/empty valid split",
        tiny(*on_bytes(), "--config.data.split_fractions=(0.95,0.0,0.05)"), r"valid",
        setup=write("data.txt", DATA),
        rule="empty/too-small splits are refused at start")
    err("data/train split smaller than a window",
        tiny(*on_bytes(), "--config.data.split_fractions=(0.002,0.499,0.499)"), r"train",
        setup=write("data.txt", DATA), rule="empty/too-small splits are refused at start")
    err("data/empty valid split (embedded)", tiny("--config.data.split_fractions=(0.95,0.0,0.05)"),
        r"valid", rule="empty/too-small splits are refused at start")
    err("data/vocab smaller than the file's bytes",
        tiny(*on_bytes(), "--config.model.vocab_size=100"), r"vocab",
        setup=write("data.txt", DATA + bytes([200, 255]) * 50),
        rule="vocabulary smaller than the data's bytes is refused")
    regular = "data is read from a regular file, never opened unless it is one (no wait)"
    err("data/a FIFO as the file (was: waits forever)", tiny(*on_bytes("{tmp}/fifo")),
        r"fifo is a pipe \(FIFO\), not a regular file.*set --config\.data\.path=FILE",
        setup=mkfifo("fifo"), check=absent("work"), rule=regular)
    err("data/a device as the file", tiny(*on_bytes("/dev/zero")),
        r"/dev/zero is a character device, not a regular file", check=absent("work"),
        rule=regular)
    err("data/truncated .gz", tiny(*on_bytes("{tmp}/data.txt.gz")), r"data\.txt\.gz",
        setup=write("data.txt.gz", gz(DATA)[:3000]))
    err("data/not gzip .gz", tiny(*on_bytes("{tmp}/data.txt.gz")), r"data\.txt\.gz",
        setup=write("data.txt.gz", DATA[:5000]))
    err("data/empty .gz", tiny(*on_bytes("{tmp}/data.txt.gz")), r"data\.txt\.gz|empty",
        setup=write("data.txt.gz", b""))
    err("data/.gz next to a different decompressed copy", tiny(*on_bytes("{tmp}/data.txt.gz")),
        r"data\.txt", setup=seq(write("data.txt.gz", gz(DATA)),
                                write("data.txt", b"my own file, not the decompressed data\n")))
    err("data/checksum mismatch (SHA256SUMS)", tiny(*on_bytes()), r"data\.txt|sha256|damaged",
        setup=seq(write("data.txt", DATA),
                  write("SHA256SUMS", "0" * 64 + "  data.txt\n")))
    err("data/unreadable file (chmod 000)", tiny(*on_bytes()), r"data\.txt",
        setup=seq(write("data.txt", DATA), chmod("data.txt", 0)), nonroot=True)
    enwik8 = ["--config.data.name=enwik8", "--config.data.path={tmp}/enwik8.zip"]
    err("data/enwik8 missing", tiny(*enwik8), r"enwik8")
    err("data/enwik8.zip not a zip", tiny(*enwik8), r"enwik8\.zip",
        setup=write("enwik8.zip", DATA[:5000]))
    err("data/enwik8.zip truncated", tiny(*enwik8), r"enwik8\.zip",
        setup=write("enwik8.zip", zip_bytes({"enwik8": DATA})[:4000]))
    err("data/enwik8.zip without the member", tiny(*enwik8), r"member|enwik8",
        setup=write("enwik8.zip", zip_bytes({"other.txt": DATA})))
    err("data/enwik8.zip of the wrong file", tiny(*enwik8), r"enwik8",
        setup=write("enwik8.zip", zip_bytes({"enwik8": DATA})))
    err("data/enwik8 raw file of the wrong size",
        tiny("--config.data.name=enwik8", "--config.data.path={tmp}/enwik8"), r"enwik8",
        setup=write("enwik8", DATA))
    err("data/cifar10 not prepared", tiny("--config.data.name=cifar10",
                                          "--config.data.data_dir={tmp}/tfds"),
        r"cifar|prepared|not found|seq_len|image", setup=mkdir("tfds"))
    # The data file changed since the run started (same size, one byte), then resumed.
    err("data/file changed since the run started", tiny(*on_bytes(), "--config.total_steps=6"),
        r"data\.txt|changed|differ",
        setup=seq(write("data.txt", DATA), train_here(*on_bytes()), modify_byte("data.txt")),
        rule="a data file changed since the run started is detected on resume")
    err("data/file grew since the run started", tiny(*on_bytes(), "--config.total_steps=6"),
        r"data\.txt|changed|differ",
        setup=seq(write("data.txt", DATA), train_here(*on_bytes()),
                  write("data.txt", DATA + DATA[:5000])),
        rule="a data file changed since the run started is detected on resume")
    err("data/path moved to another file on resume",
        tiny(*on_bytes("{tmp}/other.txt"), "--config.total_steps=6"), r"other\.txt|differ|changed",
        setup=seq(write("data.txt", DATA), train_here(*on_bytes()),
                  write("other.txt", text_bytes(20_000, seed=1))),
        rule="data location may change on resume only if the content is the same")
    ok("data/path moved, same content (resumes)",
       tiny(*on_bytes("{tmp}/moved/data.txt"), "--config.total_steps=6"),
       all_of(exists("work/checkpoints/6"), output_matches(r"Resuming")),
       setup=seq(write("data.txt", DATA), train_here(*on_bytes()),
                 write("moved/data.txt", DATA), remove("data.txt")),
       may_change=("work/checkpoints/*", "work/config.json", "work/data_fingerprint*",
                   *RUN_FILES),
       rule="data.path may change on resume when the content is the same")

    # -- image folders (configs/images.py) -----------------------------------------------------
    err("images/folder missing", tiny_images(), r"pics.*not found")
    err("images/a file, not a folder", tiny_images("--config.data.path={tmp}/one.png"),
        r"one\.png.*not a folder", setup=write("one.png", picture()))
    err("images/an image_shape the folder contradicts",
        ["train", "--config={root}/configs/images.py:size=tiny", "--workdir={tmp}/new/work",
         *IMAGES, "--config.model.image_shape=(8,8,3)"],
        r"pics are 4 x 4 x 3 .*image_shape=\(8, 8, 3\).*leave --config\.model\.image_shape out",
        check=all_of(absent("new"), lambda run: ["announced a shape"] * (
            "pictures of" in run.stdout)), setup=pictures(),
        rule="a refused run announces nothing it has not checked, and leaves no workdir")
    err("images/a model shape the data refuses", tiny_images(workdir="{tmp}/new/work",
                                                             shape=(8, 8, 3)),
        r"pics are 4 x 4 x 3", check=absent("new"), setup=pictures(),
        rule="a refused run leaves no workdir")
    err("images/no path", ["train", "--config={root}/configs/images.py:size=tiny",
                           "--workdir={work}"], r"data\.path")
    err("images/no pictures", tiny_images(), r"no PNG or JPEG pictures.*pics",
        setup=write("pics/notes.txt", "my notes\n"))
    err("images/mixed sizes", tiny_images(), r"differ in size.*b/99\.png",
        setup=seq(pictures(), write("pics/b/99.png", picture((5, 4, 3)))))
    err("images/grayscale among RGB", tiny_images(), r"b/99\.png.*grayscale",
        setup=seq(pictures(), write("pics/b/99.png", picture((4, 4, 1)))))
    err("images/not a picture", tiny_images(), r"b/99\.png.*not a readable",
        setup=seq(pictures(), write("pics/b/99.png", b"<html>404 Not Found</html>")))
    err("images/picture damaged past its header", tiny_images(), r"99\.jpg.*damaged",
        setup=seq(pictures(), write("pics/b/99.jpg", picture(fmt="JPEG", cut=40))))
    err("images/train/ without test/", tiny_images(), r"train/ folder but no test/",
        setup=pictures(folder="pics/train"))
    err("images/pictures of another shape than the model",
        tiny_images(shape=(8, 8, 3)), r"4 x 4 x 3.*image_shape=\(4,4,3\)",
        setup=pictures())
    err("images/folder changed since the run started", tiny_images("--config.total_steps=6"),
        r"pictures in .*pics.*changed", setup=seq(pictures(), train_here(argv=tiny_images),
                                                  write("pics/a/new.png", picture(seed=99))),
        may_change=("pics.sparse_jax/*",),
        rule="a data file changed since the run started is detected on resume")
    ba = ["image_baselines", "--path={tmp}/pics", "--split_fractions=0.5,0.25,0.25"]
    err("image_baselines/folder missing", ba, r"pics.*(not found|does not exist)")
    err("image_baselines/limit 0", [*ba, "--limit=0"], r"limit", setup=pictures())
    err("image_baselines/empty split", [*ba, "--split_fractions=0.5,0.5,0"], r"test split.*0",
        setup=pictures())
    err("image_baselines/split fractions not numbers", [*ba, "--split_fractions=a,b,c"],
        r"split_fractions", setup=pictures())
    err("image_baselines/mixed sizes", ba, r"differ in size.*b/99\.png",
        setup=seq(pictures(), write("pics/b/99.png", picture((5, 4, 3)))))
    ok("image_baselines/a folder", [*ba, "--output={tmp}/b.json"],
       all_of(exists("b.json"), output_matches(r"WebP lossless")), setup=pictures())

    rp = ["repeats", f"--config={CONFIG}", "--config.data.embedded_bytes=20000"]
    err("repeats/negative distance", [*rp, "--distances=64,-1"], r"distances.*-1")
    err("repeats/distances not numbers", [*rp, "--distances=a"], r"distances.*'a'.*integer")
    err("repeats/pictures", ["repeats", "--config={root}/configs/images.py:size=tiny",
                             "--config.data.path={tmp}/pics"], r"pictures", setup=pictures())
    ok("repeats/a file too small to train on", ["repeats", "--config={root}/configs/bytes.py",
                                                "--config.data.path={tmp}/ten.txt",
                                                "--split=train"],
       output_matches(r"train split of .*ten\.txt: 9 bytes", "stdout"),
       setup=write("ten.txt", b"0123456789"), rule="repeats measures any file, trains nothing")
    err("repeats/an empty split", ["repeats", "--config={root}/configs/bytes.py",
                                   "--config.data.path={tmp}/ten.txt", "--split=test"],
        r"test split .* has 0 bytes.*another --split", setup=write("ten.txt", b"0123456789"))
    ok("repeats/the generated stream", [*rp, "--output={tmp}/r.json", "--compressors"],
       all_of(exists("r.json"), output_matches(r"\| 4,096 bytes \|"),
              output_matches(r"\| xz -9e \| \d\.\d{3} \|")))

    # -- the workdir --------------------------------------------------------------------------
    err("workdir/is a file", tiny(), r"work", setup=write("work", "my notes\n"))
    err("workdir/inside a file", tiny(workdir="{tmp}/notes/run"), r"notes",
        setup=write("notes", "my notes\n"))
    err("workdir/unwritable folder (chmod 500)", tiny(), r"work",
        setup=seq(mkdir("work"), chmod("work", 0o500)), nonroot=True)
    err("workdir/foreign files", tiny(), r"work",
        setup=seq(write("work/notes.txt", "my notes\n"), write("work/src/main.c", "int main;\n")),
        rule="a non-empty folder without config.json is refused")
    err("workdir/foreign config.json", tiny(), r"config\.json",
        setup=write("work/config.json", json.dumps({"name": "my web app", "port": 8080})),
        rule="a config.json not written by sparse_jax is refused")
    err("workdir/config.json garbage", tiny(), r"config\.json",
        setup=write("work/config.json", "{ this is not json"),
        rule="a config.json not written by sparse_jax is refused")
    err("workdir/config.json empty", tiny(), r"config\.json", setup=write("work/config.json", ""),
        rule="a config.json not written by sparse_jax is refused")
    err("workdir/checkpoints without config.json", tiny(), r"config\.json",
        setup=seq(trained_run, remove("work/config.json")))
    err("workdir/checkpoints without config.json (only config_history)", tiny(), r"config\.json",
        setup=seq(trained_run, remove("work/config.json"),
                  write("work/config_history.jsonl", "")))
    ok("workdir/config.json but no checkpoint yet (starts)", tiny(),
       exists("work/checkpoints/4"),
       setup=seq(trained_run, remove("work/checkpoints"), remove("work/metrics.jsonl"),
                 remove("work/tensorboard")),
       may_change=("work/config.json", *RUN_FILES))
    ok("workdir/relative path", tiny(workdir="rel/run"), exists("rel/run/checkpoints/4"))

    # -- reruns -------------------------------------------------------------------------------
    ok("rerun/same config: nothing to do", tiny(),
       all_of(output_matches(r"nothing to do"), unchanged("work/config.json")),
       setup=trained_run, may_change=("work/tensorboard/*",))
    ok("rerun/total_steps raised: resumes", tiny("--config.total_steps=6"),
       all_of(exists("work/checkpoints/6", "work/config_history.jsonl"),
              output_matches(r"Resuming from step 4"),
              file_matches("work/config_history.jsonl", r"total_steps")),
       setup=trained_run, may_change=("work/checkpoints/*", "work/config.json", *RUN_FILES),
       rule="allowed changes on resume are recorded in WORKDIR/config_history.jsonl")
    ok("rerun/log, eval and checkpoint intervals changed",
       tiny("--config.total_steps=8", "--config.log_every=1", "--config.eval_every=4",
            "--config.checkpoint_every=4", "--config.eval_batches=1",
            "--config.keep_checkpoints=3"),
       all_of(exists("work/checkpoints/8", "work/config_history.jsonl"),
              file_matches("work/config_history.jsonl", r"log_every")),
       setup=trained_run, may_change=("work/checkpoints/*", "work/config.json", *RUN_FILES),
       rule="allowed changes on resume are recorded in WORKDIR/config_history.jsonl")
    ok("rerun/mesh changed", tiny("--config.mesh.data=1", "--config.total_steps=6"),
       exists("work/checkpoints/6"), setup=trained_run,
       may_change=("work/checkpoints/*", "work/config.json", *RUN_FILES),
       rule="mesh.* may change on resume")
    ok("rerun/interrupted run resumes", tiny(),
       all_of(exists("work/checkpoints/4"), output_matches(r"Resuming from step 2")),
       setup=seq(trained_run, remove("work/checkpoints/4")),
       may_change=("work/checkpoints/*", *RUN_FILES))
    forbidden = [("seed", "--config.seed=1", r"seed"),
                 ("optimizer.lr", "--config.optimizer.lr=0.01", r"optimizer\.lr"),
                 ("optimizer.warmup_steps", "--config.optimizer.warmup_steps=2", r"warmup_steps"),
                 ("batch_size", "--config.batch_size=8", r"batch_size"),
                 ("model.d_model", "--config.model.d_model=32", r"d_model"),
                 ("model.num_layers", "--config.model.num_layers=2", r"num_layers"),
                 ("data.embedded_bytes", "--config.data.embedded_bytes=30000", r"embedded_bytes"),
                 ("data.split_fractions", "--config.data.split_fractions=(0.8,0.1,0.1)",
                  r"split_fractions"),
                 ("data.seed", "--config.data.seed=3", r"data\.seed")]
    for field, flag, match in forbidden:
        err(f"rerun/forbidden change: {field}", tiny(flag), match, setup=trained_run,
            rule="only the listed fields may change on resume (the rest is refused)")
    err("rerun/forbidden change: data.name", tiny(*on_bytes()), r"data\.name|name",
        setup=seq(trained_run, write("data.txt", DATA)))
    err("rerun/forbidden change: another pattern variant",
        tiny(config="{root}/configs/quickstart.py:data=embedded,pattern=dense"), r"pattern",
        setup=trained_run)
    err("rerun/forbidden changes: several at once (all listed)",
        tiny("--config.seed=1", "--config.model.d_model=32"), r"seed.*d_model|d_model.*seed",
        setup=trained_run, rule="the refusal lists every difference")

    # -- checkpoints --------------------------------------------------------------------------
    fallback_train = ("work/checkpoints/2/*", "work/checkpoints/4/*", "work/config.json",
                      *RUN_FILES)
    for how in ("garbage", "truncate", "no_params", "no_meta"):
        ok(f"checkpoint/train: newest damaged ({how}) -> falls back",
           tiny(), all_of(exists("work/checkpoints/4", "work/damaged_checkpoints/4"),
                          output_matches(r"damaged|corrupt|cannot|could not|unreadable")),
           setup=seq(trained_run, damage(4, how)),
           # checkpoint 4's damaged files must be moved (same bytes), not overwritten in place
           may_change=tuple(g for g in fallback_train if "/4/" not in g),
           rule="a damaged newest checkpoint is moved to WORKDIR/damaged_checkpoints/<step> "
                   "and training goes on from the previous one")
    err("checkpoint/train: all damaged", tiny(), r"checkpoint|damaged",
        setup=seq(trained_run, damage(2), damage(4)),
        rule="all checkpoints damaged: an error, nothing deleted")
    ok("checkpoint/evaluate: newest damaged -> falls back",
       ["evaluate", "--workdir={work}", "--cpu_devices=1"],
       all_of(exists("work/eval/test_2.json"),
              output_matches(r"damaged|corrupt|cannot|could not|unreadable")),
       setup=seq(trained_run, damage(4)),
       rule="evaluate falls back from a damaged newest checkpoint with a warning")
    err("checkpoint/evaluate: all damaged", ["evaluate", "--workdir={work}", "--cpu_devices=1"],
        r"checkpoint|damaged", setup=seq(trained_run, damage(2), damage(4)))
    err("checkpoint/evaluate: the named step damaged",
        ["evaluate", "--workdir={work}", "--cpu_devices=1", "--checkpoint=4"],
        r"checkpoint|damaged|4", setup=seq(trained_run, damage(4)))
    ok("checkpoint/sample: newest damaged -> falls back",
       ["sample", "--workdir={work}", "--length=8", "--num_samples=1"],
       all_of(exists("work/samples/2_seed0.txt"),
              output_matches(r"damaged|corrupt|cannot|could not|unreadable")),
       setup=seq(trained_run, damage(4, "truncate")),
       rule="sample falls back from a damaged newest checkpoint with a warning")
    err("checkpoint/sample: all damaged", ["sample", "--workdir={work}", "--length=8"],
        r"checkpoint|damaged", setup=seq(trained_run, damage(2), damage(4)))
    err("checkpoint/evaluate: missing step", ["evaluate", "--workdir={work}", "--cpu_devices=1",
                                              "--checkpoint=99"], r"99", setup=trained_run)
    err("checkpoint/sample: missing step", ["sample", "--workdir={work}", "--checkpoint=99"],
        r"99", setup=trained_run)
    no_best = seq(trained_run, remove("work/checkpoints/2/metrics"),
                  remove("work/checkpoints/4/metrics"))
    err("checkpoint/evaluate: best with none scored",
        ["evaluate", "--workdir={work}", "--cpu_devices=1", "--checkpoint=best"], r"best",
        setup=no_best)
    err("checkpoint/sample: best with none scored",
        ["sample", "--workdir={work}", "--checkpoint=best"], r"best", setup=no_best)
    err("checkpoint/evaluate: not a step", ["evaluate", "--workdir={work}", "--cpu_devices=1",
                                            "--checkpoint=newest"], r"checkpoint|newest",
        setup=trained_run)
    err("checkpoint/sample: negative step", ["sample", "--workdir={work}", "--checkpoint=-1"],
        r"checkpoint|-1", setup=trained_run)

    # -- scripts/evaluate.py ------------------------------------------------------------------
    ev = ["evaluate", "--workdir={work}", "--cpu_devices=1"]
    ok("evaluate/valid split", [*ev, "--split=valid"], exists("work/eval/valid_4.json"),
       setup=trained_run)
    err("evaluate/missing --workdir", ["evaluate", "--cpu_devices=1"], r"workdir")
    err("evaluate/unknown flag", [*ev, "--splt=valid"], r"splt", setup=trained_run)
    err("evaluate/positional argument", [*ev, "valid"], r"valid|argument", setup=trained_run)
    err("evaluate/bad split", [*ev, "--split=dev"], r"split|dev", setup=trained_run)
    err("evaluate/min_context = seq_len", [*ev, "--min_context=64"], r"min_context",
        setup=trained_run)
    err("evaluate/negative min_context", [*ev, "--min_context=-1"], r"min_context",
        setup=trained_run)
    err("evaluate/min_context not a number", [*ev, "--min_context=lots"], r"min_context",
        setup=trained_run)
    err("evaluate/batch_size 0", [*ev, "--batch_size=0"], r"batch_size", setup=trained_run)
    err("evaluate/batch_size not a multiple of the devices",
        ["evaluate", "--workdir={work}", "--cpu_devices=2", "--batch_size=3"], r"batch_size",
        setup=trained_run)
    err("evaluate/workdir does not exist", ["evaluate", "--workdir={tmp}/nope"], r"nope")
    err("evaluate/workdir empty", ev, r"work|config\.json", setup=mkdir("work"))
    err("evaluate/workdir is a file", ev, r"work.*(not a (folder|directory)|is a file)",
        setup=write("work", "notes\n"))
    err("evaluate/foreign folder", ev, r"work|config\.json",
        setup=write("work/notes.txt", "my notes\n"))
    err("evaluate/config.json garbage", ev, r"config\.json",
        setup=seq(trained_run, write("work/config.json", "{ nope")))
    err("evaluate/no checkpoints", ev, r"checkpoint",
        setup=seq(trained_run, remove("work/checkpoints")))
    err("evaluate/result exists", ev, r"test_4\.json|exists|overwrite",
        setup=seq(trained_run, write("work/eval/test_4.json", '{"mine": "an earlier result"}\n')),
        rule="outputs that exist are refused unless --overwrite")
    ok("evaluate/result exists, --overwrite", [*ev, "--overwrite"],
       changed("work/eval/test_4.json"),
       setup=seq(trained_run, write("work/eval/test_4.json", '{"mine": "an earlier result"}\n')),
       may_change=("work/eval/test_4.json",), rule="--overwrite replaces an existing output")
    err("evaluate/eval folder is a file", ev, r"eval",
        setup=seq(trained_run, write("work/eval", "not a folder\n")))
    err("evaluate/eval folder unwritable (chmod 500)", ev, r"eval",
        setup=seq(trained_run, mkdir("work/eval"), chmod("work/eval", 0o500)), nonroot=True)
    ok("evaluate/--data another file", [*ev, "--data={tmp}/data.txt", "--split=valid"],
       exists("work/eval/data.txt/valid_4.json"), setup=seq(trained_run, write("data.txt", DATA)))
    err("evaluate/--data an empty file", [*ev, "--data={tmp}/empty.txt"],
        r"empty\.txt is empty; set --data to a file with data",
        check=absent("work/eval/empty.txt"), setup=seq(trained_run, write("empty.txt", b"")),
        rule="errors name the flag of the command that was run")
    err("evaluate/--data a FIFO with no writer (was: waits forever)", [*ev, "--data={tmp}/fifo"],
        r"fifo is a pipe \(FIFO\), not a regular file.*set --data=FILE",
        check=absent("work/eval/fifo"), setup=seq(trained_run, mkfifo("fifo")), rule=regular)
    err("evaluate/--data /dev/zero (was: \"is empty\")", [*ev, "--data=/dev/zero"],
        r"/dev/zero is a character device, not a regular file.*set --data=FILE",
        check=absent("work/eval/zero"), setup=trained_run, rule=regular)
    err("evaluate/--data a folder of pictures", [*ev, "--data={tmp}/pics"],
        r"pics is a folder, and a model of bytes reads a file .*set --data to a file",
        check=absent("work/eval/pics"), setup=seq(trained_run, pictures()))
    err("evaluate/--data a file too short for the split", [*ev, "--data={tmp}/ten.txt"],
        r"test split .* has 0 bytes.*give --data a longer file.*--split=train \(9 bytes\)",
        check=absent("work/eval/ten.txt"),
        setup=seq(trained_run, write("ten.txt", b"0123456789")),
        rule="a trained model's data cut cannot change: the fix is another file or --split")
    err("evaluate/--data a damaged .gz of the user's", [*ev, "--data={tmp}/mine.txt.gz"],
        r"mine\.txt\.gz is damaged or not a gzip file.*set --data to the uncompressed file, "
        r"or compress that again with gzip -f FILE \(not -k.*set --data=FILE\.gz",
        check=all_of(absent("work/eval/mine.txt.gz"), lambda run: ["git checkout"] * (
            "git checkout" in run.stderr)),
        setup=seq(trained_run, write("mine.txt.gz", DATA[:5000])))
    err("evaluate/data file gone", [*ev], r"data\.txt|not found",
        setup=seq(write("data.txt", DATA), train_here(*on_bytes()), remove("data.txt")))
    err("evaluate/data file changed", [*ev], r"data\.txt|changed|differ",
        setup=seq(write("data.txt", DATA), train_here(*on_bytes()), modify_byte("data.txt")),
        rule="a data file changed since training is detected")

    # -- scripts/sample.py --------------------------------------------------------------------
    sa = ["sample", "--workdir={work}", "--num_samples=1", "--length=8"]
    ok("sample/default output", sa, exists("work/samples/4_seed0.txt"), setup=trained_run)
    err("sample/missing --workdir", ["sample", "--length=8"], r"workdir")
    err("sample/unknown flag", [*sa, "--temp=0.5"], r"temp", setup=trained_run)
    err("sample/positional argument", [*sa, "hello"], r"hello|argument", setup=trained_run)
    err("sample/workdir does not exist", ["sample", "--workdir={tmp}/nope"], r"nope")
    err("sample/workdir empty", sa, r"work|config\.json", setup=mkdir("work"))
    err("sample/workdir is a file", sa, r"work.*(not a (folder|directory)|is a file)",
        setup=write("work", "notes\n"))
    err("sample/negative temperature", [*sa, "--temperature=-1"], r"temperature",
        setup=trained_run)
    err("sample/temperature nan", [*sa, "--temperature=nan"], r"temperature", setup=trained_run)
    err("sample/temperature not a number", [*sa, "--temperature=warm"], r"temperature",
        setup=trained_run)
    err("sample/top_k 0", [*sa, "--top_k=0"], r"top_k", setup=trained_run)
    err("sample/top_k above the vocabulary", [*sa, "--top_k=1000"], r"top_k", setup=trained_run)
    err("sample/top_p 0", [*sa, "--top_p=0"], r"top_p", setup=trained_run)
    err("sample/top_p 1.5", [*sa, "--top_p=1.5"], r"top_p", setup=trained_run)
    err("sample/length 0", ["sample", "--workdir={work}", "--length=0"], r"length",
        setup=trained_run)
    err("sample/length beyond memory (was: MemoryError after loading)",
        ["sample", "--workdir={work}", "--length=1000000000000"],
        r"length=1,000,000,000,000 cannot be held.*GiB.*give a length below", setup=trained_run,
        check=absent("work/samples"))
    ok("sample/length past the context (the window slides)",
       ["sample", "--workdir={work}", "--num_samples=1", "--length=1000"],
       file_matches("work/samples/4_seed0.txt", r"prompt 1 bytes \+ 1000 new"), setup=trained_run)
    err("sample/num_samples 0", [*sa, "--num_samples=0"], r"num_samples", setup=trained_run)
    ok("sample/prompt longer than the context (cut, one line)", [*sa, "--prompt=" + "a" * 100],
       all_of(output_matches(r"^warning: the prompt \(100 bytes\) is longer than the model's "
                             r"context of 64 bytes; it is cut to its last 64 bytes$", "stderr"),
              file_matches("work/samples/4_seed0.txt", r"prompt 64 bytes \+ 8 new")),
       setup=trained_run)
    err("sample/prompt not UTF-8", [*sa, b"--prompt=\xff\xfe"], r"prompt|UTF-8",
        setup=trained_run)
    err("sample/prompt_file missing", [*sa, "--prompt_file={tmp}/nope.txt"], r"nope\.txt",
        setup=trained_run)
    err("sample/prompt_file is a folder", [*sa, "--prompt_file={tmp}/folder"], r"folder",
        setup=seq(trained_run, mkdir("folder")))
    err("sample/prompt and prompt_file", [*sa, "--prompt=hi", "--prompt_file={tmp}/p.txt"],
        r"prompt", setup=seq(trained_run, write("p.txt", "hello")))
    err("sample/complete on a text model", [*sa, "--complete=2"], r"complete|image",
        setup=trained_run)
    err("sample/negative complete", [*sa, "--complete=-1"], r"complete", setup=trained_run)
    err("sample/bad split", [*sa, "--split=dev"], r"split|dev", setup=trained_run)
    err("sample/output exists (default path)", sa, r"4_seed0\.txt|exists|overwrite",
        setup=seq(trained_run, write("work/samples/4_seed0.txt", "my favourite sample\n")),
        rule="outputs that exist are refused unless --overwrite")
    err("sample/--output exists", [*sa, "--output={tmp}/mine.txt"], r"mine\.txt|exists",
        setup=seq(trained_run, write("mine.txt", "my own file\n")),
        rule="outputs that exist are refused unless --overwrite")
    ok("sample/--output exists, --overwrite", [*sa, "--output={tmp}/mine.txt", "--overwrite"],
       changed("mine.txt"), setup=seq(trained_run, write("mine.txt", "my own file\n")),
       may_change=("mine.txt",), rule="--overwrite replaces an existing output")
    user_folder = seq(trained_run, write("out/mine.txt", "my file\n"))
    err("sample/--output is a folder", [*sa, "--output={tmp}/out"],
        r"out.*(folder|directory)|(folder|directory).*out", setup=user_folder)
    err("sample/--output is a folder, --overwrite", [*sa, "--output={tmp}/out", "--overwrite"],
        r"out.*(folder|directory)|(folder|directory).*out", setup=user_folder,
        rule="--overwrite replaces a file, never a folder")
    err("sample/--output inside a file", [*sa, "--output={tmp}/notes/s.txt"], r"notes",
        setup=seq(trained_run, write("notes", "my notes\n")))
    err("sample/samples folder is a file", sa, r"samples",
        setup=seq(trained_run, write("work/samples", "not a folder\n")))
    err("sample/output folder unwritable (chmod 500)", [*sa, "--output={tmp}/ro/s.txt"], r"ro",
        setup=seq(trained_run, mkdir("ro"), chmod("ro", 0o500)), nonroot=True)

    # -- a workdir in use ---------------------------------------------------------------------
    err("lock/second trainer refused", tiny(), r"work|use|running|lock|another",
        setup=background_trainer(),
        may_change=("work/tensorboard/*", "work/metrics.jsonl", "work/checkpoints/*"),
        rule="a second training process on a workdir in use is refused")
    ok("lock/not stuck after SIGKILL", tiny(), exists("work/checkpoints/4"),
       setup=background_trainer(kill=True),
       may_change=("work/config.json", "work/checkpoints/*", *RUN_FILES),
       rule="the lock of a killed trainer does not block the next run")

    # -- faults while training ----------------------------------------------------------------
    # Warmup from lr 0: step 1 is good and checkpointed, then the loss explodes.
    err("nan/huge learning rate (caught by validation)",
        tiny("--config.optimizer.lr=1e30", "--config.checkpoint_every=1",
             "--config.optimizer.warmup_steps=2"),
        r"(non-finite|nan|inf).*checkpoint", may_change=("work/checkpoints/*",),
        rule="NaN: one line naming the last good checkpoint")
    err("nan/huge learning rate (caught by the training loss)",
        tiny("--config.optimizer.lr=1e30", "--config.checkpoint_every=1",
             "--config.optimizer.warmup_steps=2", "--config.eval_every=100"),
        r"(non-finite|nan|inf).*checkpoint", may_change=("work/checkpoints/*",),
        rule="NaN: one line naming the last good checkpoint")
    err("disk/full while checkpointing (ulimit -f 12 KiB)", tiny(),
        r"checkpoint|disk|space|too large|write", fsize_limit=12 * 1024,
        env={"JAX_ENABLE_COMPILATION_CACHE": "false"})
    err("disk/full at the first file (ulimit -f 0)", tiny(), r"work|disk|space|too large|write",
        fsize_limit=0, env={"JAX_ENABLE_COMPILATION_CACHE": "false"})
    err("disk/full while resuming", tiny("--config.total_steps=6"),
        r"checkpoint|disk|space|too large|write", setup=trained_run, fsize_limit=12 * 1024,
        may_change=("work/config.json", *RUN_FILES),
        env={"JAX_ENABLE_COMPILATION_CACHE": "false"})
    err("disk/full while evaluating", [*ev, "--split=valid"], r"valid_4\.json|eval",
        setup=trained_run, fsize_limit=200, env={"JAX_ENABLE_COMPILATION_CACHE": "false"})
    err("disk/full while sampling", [*sa, "--length=40", "--num_samples=400"],
        r"4_seed0\.txt|samples", setup=trained_run, fsize_limit=4 * 1024,
        env={"JAX_ENABLE_COMPILATION_CACHE": "false"})

    # -- the CPU kernels' build and cache (SPARSE_JAX_CACHE={tmp}/cache) -----------------------
    cache = {"SPARSE_JAX_CACHE": "{tmp}/cache"}
    native_run = ("--config.model.attention=native", "--config.model.d_model=32")  # head dim 16
    trains = all_of(exists("work/checkpoints/4"), kernels_rebuilt())
    rebuilt = "a damaged, short or foreign library in the cache is built again, never loaded"
    ok("kernels/library cut short (was: Bus error)", tiny(*native_run), trains,
       setup=kernels_cache("cut short"), may_change=("cache/*",), env=cache, rule=rebuilt)
    ok("kernels/library of random bytes", tiny(*native_run), trains,
       setup=kernels_cache("garbage"), may_change=("cache/*",), env=cache, rule=rebuilt)
    auto_run = ("--config.model.attention=auto", "--config.model.d_model=32")
    ok("kernels/foreign library, auto (was: AttributeError)", tiny(*auto_run), trains,
       setup=kernels_cache("foreign"), may_change=("cache/*",), env=cache, rule=rebuilt)
    ok("kernels/record damaged", tiny(*native_run), trains, setup=kernels_cache("record"),
       may_change=("cache/*",), env=cache, rule=rebuilt)
    err("kernels/SPARSE_JAX_CACHE is a file, native", tiny(*native_run),
        r"{tmp}/cache is not a folder.*point \$SPARSE_JAX_CACHE at another folder",
        setup=write("cache", "mine\n"), env=cache)
    ok("kernels/SPARSE_JAX_CACHE is a file, auto", tiny(*auto_run),
       all_of(exists("work/checkpoints/4"), output_matches(r"unavailable.*not a folder.*XLA",
                                                           "stderr")),
       setup=write("cache", "mine\n"), env=cache,
       rule="'auto' without the kernels runs on the XLA path and says why")
    ok("kernels/folders of killed builds removed", tiny(*native_run),
       all_of(exists("work/checkpoints/4"),
              absent("cache/cpu_kernels-0123456789abcdef.build.part*")),
       setup=lambda ctx: os.makedirs(ctx.path(
           "cache", f"cpu_kernels-0123456789abcdef.build.part{dead_pid()}", "tmp")),
       may_change=("cache/*",), env=cache, timeout=300,
       rule="the next build removes the folders of builds that were killed")
    err("kernels/full disk while building (ulimit -f 100 KiB)", tiny(*native_run),
        r"disk is full.*SPARSE_JAX_CACHE", fsize_limit=100 * 1024,
        env={**cache, "JAX_ENABLE_COMPILATION_CACHE": "false"}, timeout=300)
    reads_xla = output_matches(r"^warning: this run trained with attention='native'.*cannot run "
                               r"here.*reading it with attention='xla'", "stderr")
    no_compiler = {"CXX": "/nonexistent/c++"}
    ok("evaluate/a native run without a compiler", [*ev, "--split=valid"],
       all_of(exists("work/eval/valid_4.json"), reads_xla),
       setup=seq(trained_run, recorded_attention("native")), env=no_compiler,
       may_change=("work/eval/*",), rule="the implementation is chosen where a run is read")
    ok("sample/a native run without a compiler", sa, all_of(exists("work/samples/4_seed0.txt"),
                                                            reads_xla),
       setup=seq(trained_run, recorded_attention("native")), env=no_compiler,
       rule="the implementation is chosen where a run is read")
    ok("evaluate/--attention=xla", [*ev, "--split=valid", "--attention=xla"],
       exists("work/eval/valid_4.json"), setup=trained_run)
    err("evaluate/--attention=cuda", [*ev, "--attention=cuda"], r"attention.*cuda",
        setup=trained_run)
    err("sample/--attention=native without a compiler", [*sa, "--attention=native"],
        r"attention='native'.*CXX=/nonexistent", setup=trained_run, env=no_compiler)

    # -- environment variables and config literals --------------------------------------------
    err("env/SPARSE_JAX_HUGE_PAGES=no (was: taken as on)", tiny(),
        r"SPARSE_JAX_HUGE_PAGES='no' must be 1 or 0", env={"SPARSE_JAX_HUGE_PAGES": "no"})
    err("env/SPARSE_JAX_TRACEBACK=yes", tiny(), r"SPARSE_JAX_TRACEBACK='yes' must be 1 or 0",
        env={"SPARSE_JAX_TRACEBACK": "yes"})
    err("env/JAX_COORDINATOR_ADDRESS not HOST:PORT", tiny(),
        r"\$JAX_COORDINATOR_ADDRESS='garbage' must be HOST:PORT",
        env={"JAX_COORDINATOR_ADDRESS": "garbage"})
    err("env/--coordinator_address without a port", tiny("--coordinator_address=10.0.0.1",
                                                          "--num_processes=2", "--process_id=0"),
        r"--coordinator_address='10.0.0.1' must be HOST:PORT")
    err("check/context_stages flat (was: TypeError)", tiny("--config.context_stages=(2,16,8)"),
        r"context_stages: 2 is not .*e\.g\. \(\(2000, 256, 16\),\)")
    err("check/context_stages of pairs", tiny("--config.context_stages=((2,16),)"),
        r"context_stages: \(2, 16\) is not \(until_step, seq_len, batch_size\)")

    # -- scripts/describe.py ------------------------------------------------------------------
    ds = ["describe", f"--config={CONFIG}"]
    kjv = "--config.data.path={root}/data/kjv.html.gz"  # as train.py, it checks the data's file
    ok("describe/quickstart", ["describe", "--config={root}/configs/quickstart.py", kjv],
       output_matches(r"param", "stdout"))
    ok("describe/the mesh train.py builds here", ["describe", "--config={root}/configs/"
                                                  "quickstart.py", kjv],
       output_matches(rf"on mesh data={len(os.sched_getaffinity(0))} x fsdp=1", "stdout"),
       rule="describe sizes the mesh train.py trains on (a CPU: one device per core)")
    err("describe/missing --config", ["describe"], r"config")
    err("describe/unknown flag", [*ds, "--jsn"], r"jsn")
    err("describe/config missing file", ["describe", "--config={tmp}/nope.py"], r"nope\.py")
    err("describe/config unknown field", [*ds, "--config.model.widht=3"], r"widht")
    err("describe/bad pattern", [*ds, "--config.model.pattern=bogus"], r"pattern")
    err("describe/stride longer than seq_len", [*ds, "--config.model.stride=4096"], r"stride")
    err("describe/devices 0", [*ds, "--devices=0"], r"devices")
    err("describe/devices not a number", [*ds, "--devices=many"], r"devices")
    err("describe/batch_size 0", [*ds, "--batch_size=0"], r"batch_size")
    err("describe/fsdp does not divide the devices", [*ds, "--devices=4", "--config.mesh.fsdp=3"],
        r"fsdp|devices|mesh")

    # -- scripts/plot_pattern.py --------------------------------------------------------------
    pp = ["plot_pattern", "--output={tmp}/p.png"]
    ok("plot/strided", [*pp, "--kind=strided"], exists("p.png"))
    err("plot/unknown kind", [*pp, "--kind=bogus"], r"kind|bogus")
    err("plot/seq_len 0", [*pp, "--seq_len=0"], r"seq_len")
    err("plot/stride 0", [*pp, "--stride=0"], r"stride")
    err("plot/stride not a number", [*pp, "--stride=eight"], r"stride")
    err("plot/c 0 (fixed)", [*pp, "--kind=fixed", "--c=0"], r"\bc\b")
    err("plot/local_width 0", [*pp, "--local_width=0"], r"local_width")
    err("plot/query outside the sequence", [*pp, "--query=100"], r"query",
        rule="plot_pattern checks --query")
    err("plot/output inside a file", ["plot_pattern", "--output={tmp}/notes/p.png"], r"notes",
        setup=write("notes", "my notes\n"))
    err("plot/output exists", [*pp], r"p\.png|exists|overwrite", setup=write("p.png", b"mine"),
        rule="outputs that exist are refused unless --overwrite (plot_pattern too?)")

    # -- scripts/compare_patterns.py ----------------------------------------------------------
    cp_flags = ["--workdir={work}", "--steps=2", "--patterns=dense,strided",
                *(f for f in TINY if "total_steps" not in f and "cpu_devices" not in f)]
    cp = ["compare_patterns", f"--config={CONFIG}", *cp_flags]
    err("compare/unknown pattern", [*cp, "--patterns=dense,bogus"], r"bogus|pattern")
    err("compare/pattern twice", [*cp, "--patterns=dense,dense"], r"twice|dense")
    err("compare/steps 0", [*cp, "--steps=0"], r"steps")
    err("compare/pattern in --config",
        ["compare_patterns", f"--config={CONFIG},pattern=dense", *cp_flags], r"pattern")
    err("compare/steps twice", [*cp, "--config.total_steps=3"], r"steps")
    err("compare/unknown config field", [*cp, "--config.bogus=1"], r"bogus")
    err("compare/missing --workdir", ["compare_patterns", f"--config={CONFIG}"], r"workdir")
    err("compare/workdir is a file", cp, r"work", setup=write("work", "my notes\n"))
    err("compare/output_dir is a file", [*cp, "--output_dir={tmp}/notes"], r"notes",
        setup=write("notes", "my notes\n"))

    # -- benchmarks (outputs go to the case folder) -------------------------------------------
    err("bench/attention: heads not split over devices",
        ["benchmark_attention", "--heads=3", "--devices=2", "--output_dir={tmp}/b"], r"heads")
    err("bench/attention: seq_lens not numbers",
        ["benchmark_attention", "--seq_lens=long", "--output_dir={tmp}/b"], r"seq_lens|long")
    err("bench/attention: unknown pattern",
        ["benchmark_attention", "--patterns=bogus:3", "--seq_lens=64", "--passes=fwd",
         "--repeats=1", "--devices=1", "--output_dir={tmp}/b"], r"bogus|pattern", timeout=120)
    err("bench/attention: unknown implementation",
        ["benchmark_attention", "--patterns=strided:8@triton", "--seq_lens=64", "--passes=fwd",
         "--repeats=1", "--devices=1", "--output_dir={tmp}/b"], r"triton|implementation",
        timeout=120)
    err("bench/attention: kernel tiles not powers of two",
        ["benchmark_attention", "--patterns=strided:8@pallas:48x64", "--seq_lens=64",
         "--passes=fwd", "--repeats=1", "--devices=1", "--output_dir={tmp}/b"],
        r"48|power of two", timeout=120)
    err("bench/attention: unknown pass",
        ["benchmark_attention", "--passes=bwd", "--seq_lens=64", "--patterns=dense",
         "--repeats=1", "--devices=1", "--output_dir={tmp}/b"], r"bwd|pass", timeout=120)
    err("bench/model: malformed case", ["benchmark_model", "--cases=strided",
                                        "--output={tmp}/m.json"], r"cases|strided", timeout=120)
    err("bench/model: seq_len not a number", ["benchmark_model", "--seq_len=big"], r"seq_len")
    err("bench/sampling: length above seq_len",
        ["benchmark_sampling", "--seq_len=64", "--length=1000", "--num_layers=1",
         "--d_model=16", "--stride=8", "--noeval", "--output={tmp}/s.json"],
        r"length|1000 new bytes", timeout=120)
    err("bench/sampling: unknown flag", ["benchmark_sampling", "--lenght=10"], r"lenght")
    err("bench/training: steps do not match seq_lens",
        ["benchmark_training", "--seq_lens=64,256,1024", "--steps=1,2",
         "--output_dir={tmp}/t"], r"steps")
    err("bench/training: missing data file",
        ["benchmark_training", "--seq_lens=64", "--steps=1", "--data={tmp}/nope.txt",
         "--output_dir={tmp}/t"], r"nope\.txt", timeout=120)
    err("bench/training: seq_lens not numbers",
        ["benchmark_training", "--seq_lens=short", "--output_dir={tmp}/t"], r"seq_lens|short")
    err("bench/training: unknown baseline",
        ["benchmark_training", "--seq_lens=64", "--steps=1", "--baselines=jit",
         "--output_dir={tmp}/t"], r"baselines.*jit")
    err("bench/training: unknown attention implementation",
        ["benchmark_training", "--seq_lens=64", "--steps=1", "--patterns=strided@cuda",
         "--output_dir={tmp}/t"], r"patterns.*strided@cuda")
    return cases


# ---------------------------------------------------------------------------------------------
# Running a case.


@dataclasses.dataclass
class Run:
    ctx: Ctx
    rc: int | None
    stdout: str
    stderr: str
    before: dict
    after: dict


def snapshot(folder: str) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder` (unreadable: "<unreadable>")."""
    out = {}
    for base, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(base, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            rel = os.path.relpath(path, folder)
            try:
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
                out[rel] = h.hexdigest()
            except OSError:
                out[rel] = "<unreadable>"
    return out


def losses(case: Case, before: dict, after: dict) -> list[str]:
    """Files of `before` changed or gone in `after` without the case allowing it. A file moved
    into a `damaged*` folder with the same bytes is not lost."""
    moved_to = {}
    for rel, digest in after.items():
        if "damaged" in rel and before.get(rel) != digest:
            moved_to.setdefault(digest, rel)
    problems = []
    for rel, digest in sorted(before.items()):
        if after.get(rel) == digest or "lock" in os.path.basename(rel).lower():
            continue
        if any(fnmatch.fnmatch(rel, g) for g in case.may_change):
            continue
        if digest in moved_to:
            continue
        problems.append(f"{'changed' if rel in after else 'lost'}: {rel}")
    if len(problems) > 6:
        problems = problems[:5] + [f"... and {len(problems) - 5} more files changed or lost"]
    return problems


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def summary_of(rc, stderr: str, timed_out: bool, tmp: str = "") -> str:
    if tmp:
        stderr = stderr.replace(tmp, "{tmp}")
    if timed_out:
        return "timed out"
    lines = error_lines(stderr)
    if rc == 0:
        return "ok" + (f" (+{len(lines)} error lines)" if lines else "")
    if lines:
        return lines[0] + (f" (+{len(lines) - 1} more)" if len(lines) > 1 else "")
    last = [line for line in stderr.strip().splitlines() if line.strip()]
    return f"rc={rc}: {last[-1].strip() if last else '(no stderr)'}"


def run_case(case: Case, fixtures: Fixtures, env: dict, scratch: str, keep: bool) -> dict:
    result = {"name": case.name, "expected": case.expect, "match": case.match,
              "rule": case.rule, "argv": None, "rc": None, "got": "", "verdict": "",
              "problems": [], "seconds": 0.0, "folder": None}
    if case.nonroot and os.geteuid() == 0:
        result.update(verdict="skip", got="running as root: permissions are not enforced")
        return result
    folder = tempfile.mkdtemp(prefix=re.sub(r"[^A-Za-z0-9]+", "_", case.name)[:40] + "_",
                              dir=scratch)
    tmp, logs = os.path.join(folder, "case"), os.path.join(folder, "logs")
    os.makedirs(tmp)
    os.makedirs(logs)
    case_env = {**env, **{k: v.format(tmp=tmp, work=os.path.join(tmp, "work"), root=ROOT)
                          for k, v in case.env.items()}}
    ctx = Ctx(tmp, fixtures, case_env, logs)
    result["folder"] = tmp
    start = time.time()
    try:
        try:
            if case.setup:
                case.setup(ctx)
        except Exception as e:  # noqa: BLE001  (a broken setup is this case's failure)
            result.update(verdict="FAIL", got=f"setup failed: {e}", problems=[f"setup: {e}"])
            return result
        argv = command(case.argv, ctx)
        result["argv"] = [a if isinstance(a, str) else os.fsdecode(a) for a in argv]
        before = snapshot(tmp)
        if case.fsize_limit is not None:  # a "full disk": the limit set by a small launcher
            argv = [sys.executable, "-c", LIMITED, str(case.fsize_limit), *argv]
        timed_out = False
        try:  # no preexec_fn: it forks this (JAX-loaded, multithreaded) process's hooks
            proc = subprocess.run(argv, cwd=tmp, env=case_env, capture_output=True,
                                  timeout=case.timeout, start_new_session=True)
            rc, out, err_ = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            timed_out, rc = True, None
            out, err_ = e.stdout or b"", e.stderr or b""
        stdout, stderr = (x.decode("utf-8", "replace") for x in (out, err_))
        ctx.teardown()  # stop background processes before comparing files
        after = snapshot(tmp)
        run = Run(ctx, rc, stdout, stderr, before, after)
        problems = []
        # Regexes are matched with the case folder written as {tmp} (its name holds words).
        lines = [line.replace(tmp, "{tmp}") for line in error_lines(stderr)]
        if timed_out:
            problems.append(f"timed out after {case.timeout:.0f} s")
        elif case.expect == "error":
            if rc == 0:
                problems.append("exit status 0 (expected an error)")
            elif rc is not None and rc < 0:
                problems.append(f"killed by signal {-rc}")
            if len(lines) != 1:
                problems.append(f"{len(lines)} 'error: ' lines on stderr (expected 1)")
            elif not re.search(case.match, lines[0], re.I):
                problems.append(f"the error line does not match {case.match!r}")
            elif len(lines[0]) > MAX_ERROR_CHARS:
                problems.append(f"the error line is {len(lines[0])} characters (not short: > "
                                f"{MAX_ERROR_CHARS})")
            if case.check:  # e.g. what a refused run must not leave behind
                problems += case.check(run)
        else:
            if rc != 0:
                problems.append(f"exit status {rc} (expected 0)")
            if lines:
                problems.append(f"{len(lines)} 'error: ' lines on stderr")
            if rc == 0 and case.check:
                problems += case.check(run)
        if TRACEBACK in stdout or TRACEBACK in stderr:
            problems.append("a Python traceback was printed")
        problems += losses(case, before, after)
        result.update(rc=rc, got=summary_of(rc, stderr, timed_out, tmp), problems=problems,
                      error_lines=lines,
                      verdict="FAIL" if problems else "ok",
                      stderr_tail=stderr[-2000:], stdout_tail=stdout[-1000:])
        return result
    finally:
        ctx.teardown()
        result["seconds"] = round(time.time() - start, 1)
        if not keep:
            for base, dirs, _ in os.walk(folder):  # undo chmods so the folder can be removed
                for d in dirs:
                    try:
                        os.chmod(os.path.join(base, d), 0o755)
                    except OSError:
                        pass
            shutil.rmtree(folder, ignore_errors=True)
            result["folder"] = None


def base_env(cache_dir: str) -> dict:
    env = dict(os.environ)
    env.pop("SPARSE_JAX_TRACEBACK", None)
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    # One persistent compilation cache for all cases (the same tiny model compiles once).
    env.setdefault("JAX_COMPILATION_CACHE_DIR", cache_dir)
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


def select(cases: list[Case], only: list[str] | None) -> list[Case]:
    if not only:
        return cases
    return [c for c in cases if any(s in c.name for s in only)]


def run_cases(cases: list[Case], jobs: int = 1, keep: bool = False, progress=None) -> list[dict]:
    """Runs `cases` (in a fresh scratch folder, sharing the session fixtures); returns their
    results in order."""
    scratch = tempfile.mkdtemp(prefix="sparse_jax_bad_inputs_")
    env = base_env(os.path.join(scratch, "jax_cache"))
    fixtures = Fixtures(os.path.join(scratch, "fixtures"), env)
    os.makedirs(fixtures.root)
    results: list[dict | None] = [None] * len(cases)
    try:
        with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
            futures = {pool.submit(run_case, c, fixtures, env, scratch, keep): i
                       for i, c in enumerate(cases)}
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                i = futures[future]
                results[i] = future.result()
                if progress:
                    r = results[i]
                    progress(f"[{done}/{len(cases)}] {r['verdict']:4} {r['name']}  "
                             f"({r['seconds']:.1f} s)  {r['got'][:100]}")
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
        elif progress:
            progress(f"kept {scratch}")
    return results


def table(results: list[dict]) -> str:
    def cell(text, width):
        text = text.replace("\n", " ")
        return text if len(text) <= width else text[:width - 1] + "…"

    rows = [("case", "expected", "got", "verdict")]
    for r in results:
        expected = "error" + (f" /{r['match']}/" if r["match"] else "") \
            if r["expected"] == "error" else "ok"
        rows.append((r["name"], expected, r["got"],
                     r["verdict"]))
    widths = [min(max(len(cell(row[k], 200)) for row in rows), limit)
              for k, limit in enumerate((58, 34, 90, 7))]
    lines = []
    for n, row in enumerate(rows):
        cells = (cell(v, w).ljust(w) for v, w in zip(row, widths, strict=True))
        lines.append(" | ".join(cells).rstrip())
        if n == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    n = len(results)
    okays = sum(r["verdict"] == "ok" for r in results)
    failed = sum(r["verdict"] == "FAIL" for r in results)
    skipped = sum(r["verdict"] == "skip" for r in results)
    return f"{n} cases: {okays} ok, {failed} failed" + (f", {skipped} skipped" if skipped else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", metavar="SUBSTR",
                        help="run only cases whose name contains SUBSTR (repeatable)")
    parser.add_argument("--keep", action="store_true", help="keep the cases' folders")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at the same time")
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    cases = select(build_cases(), args.only)
    if args.list:
        for c in cases:
            print(f"{c.name}{'  (' + c.rule + ')' if c.rule else ''}")
        print(f"{len(cases)} cases")
        return 0
    if not cases:
        print(f"no case matches {args.only}", file=sys.stderr)
        return 2
    start = time.time()
    results = run_cases(cases, args.jobs, args.keep,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(table(results))
    failures = [r for r in results if r["verdict"] == "FAIL"]
    if failures:
        print("\nProblems:")
        for r in failures:
            print(f"  {r['name']}: " + "; ".join(r["problems"]))
    print(f"\n{summary(results)} ({time.time() - start:.0f} s)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"summary": summary(results), "results": results}, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
