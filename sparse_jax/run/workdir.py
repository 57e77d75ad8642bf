"""A run's workdir: what may be in it, the checks before a run starts there or reads it, the lock
of its training process, the record of the data it trains on, and the checks of the files that
evaluation and sampling write.

  WORKDIR/config.json             the config the run trains with (`sparse_jax.run.config`)
  WORKDIR/checkpoints/<step>      its checkpoints (`sparse_jax.run.checkpoints`)
  WORKDIR/damaged_checkpoints/    checkpoints that could not be read, set aside, never deleted
  WORKDIR/data_fingerprint.json   what data the run trains on (`check_data`)
  WORKDIR/.lock                   held by the one training process that uses the workdir
  WORKDIR/metrics.jsonl ...       logs (`sparse_jax.logs`); eval/ and samples/: outputs

`prepare_workdir` admits a training run: a new, empty or writable folder, or a run of this
project that the config may resume; anything else there is refused, untouched.
`check_workdir` admits a reader (evaluation, sampling): a config.json and a checkpoint.
`check_output` admits an output file before any work is done. A training run refused by its
checks leaves the workdir as it found it (`undo_if_refused`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil

import jax

from sparse_jax.data import datasets as data_lib
from sparse_jax.files import atomic_write, part_suffix, writing
from sparse_jax.run import config as config_lib

FOLDER = "checkpoints"
DAMAGED = "damaged_checkpoints"
LOCK = ".lock"
FINGERPRINT = "data_fingerprint.json"
PROBE = ".write_test"  # + part_suffix: the file that shows a folder is writable
# What this project writes into a workdir: anything else there is someone else's.
OURS = {config_lib.RECORD, config_lib.HISTORY, FOLDER, DAMAGED, LOCK, FINGERPRINT,
        "metrics.jsonl", "tensorboard", "eval", "samples", "profile", "train.log", "study.json",
        "attention"}  # attention: scripts/attention_stats.py's default output


def steps(workdir: str) -> list[int]:
    """The steps of the checkpoints in `workdir`, ascending (none: [])."""
    folder = os.path.join(workdir, FOLDER)
    if not os.path.isdir(folder):
        return []
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


def _probe(folder: str) -> None:
    """Creates `folder` if needed and writes and removes a small file in it (OSError if it
    cannot). Its name is unique to the process (`part_suffix`), so the next probe removes one
    that a process killed here left behind."""
    os.makedirs(folder, exist_ok=True)
    probe = os.path.join(folder, PROBE)
    probe += part_suffix(probe)
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)


def prepare_workdir(workdir: str, config) -> dict[str, tuple] | None:
    """Creates `workdir` and checks that it is writable and holds nothing but a run of this
    project whose checkpoints `config` may resume. Returns None for a new run, else the config
    changes (`config.resume_changes`: {} when none); ValueError / OSError otherwise."""
    try:
        _probe(workdir)
    except OSError as e:
        raise OSError(e.errno, f"cannot write to the workdir {workdir}: "
                               f"{e.strerror or e}; choose another --workdir") from e
    return admit(workdir, config)


def admit(workdir: str, config) -> dict[str, tuple] | None:
    """`prepare_workdir`'s checks of what `workdir` holds, reading only (`run.setup.complete`
    makes them before any work): a file in its place, files this project did not write, a
    record that is not ours, checkpoints without a record, a config the run there may not
    resume with. None for a new run (also a folder not created yet), else the changes."""
    if os.path.lexists(workdir) and not os.path.isdir(workdir):
        raise NotADirectoryError(errno.ENOTDIR, f"--workdir={workdir} is a file, not a folder; "
                                                "choose another --workdir")
    if not os.path.isdir(workdir):
        return None
    entries = [n for n in os.listdir(workdir) if not n.startswith(PROBE + ".")]
    foreign = sorted(n for n in entries if n not in OURS  # a temporary file being written:
                     and not (n.endswith(".tmp") and n[:-4] in OURS))
    record = os.path.join(workdir, config_lib.RECORD)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(f"{workdir} holds files this project did not write ({shown}); "
                         "refusing to train there: use an empty or new --workdir")
    if not os.path.exists(record):
        if steps(workdir):
            raise ValueError(f"{workdir} holds checkpoints but no config.json, so they cannot "
                             "be checked against this config; use another --workdir")
        return None
    try:
        saved = config_lib.read_record(workdir)
    except ValueError as e:
        raise ValueError(f"{record} was not written by this project (or is damaged); "
                         "refusing to train there: use another --workdir") from e
    missing = [s for s in config_lib.SECTIONS if s not in saved]
    if missing:
        raise ValueError(f"{record} was not written by this project (no {', '.join(missing)} "
                         "section); refusing to train there: use another --workdir")
    if not steps(workdir):
        return None  # a run that never checkpointed starts again
    return config_lib.resume_changes(saved, config, workdir)


def resumable_record(workdir: str):
    """The config the run in `workdir` trained with (`config.read_record`) when it has
    checkpoints that a run there would resume, else None (also for a record that is damaged or
    not this project's: `prepare_workdir` refuses those in its own words)."""
    if not steps(workdir):
        return None
    try:
        saved = config_lib.read_record(workdir)
    except (OSError, ValueError):
        return None
    return saved if all(s in saved for s in config_lib.SECTIONS) else None


def contents(workdir: str) -> tuple[str | None, frozenset[str]]:
    """What `workdir` is before a run starts there, for `undo_if_refused`: (the outermost
    folder that creating it would create, None when it exists; the names in it)."""
    folder, created = os.path.abspath(workdir), None
    while not os.path.exists(folder):
        folder, created = os.path.dirname(folder), folder
    if created is not None:
        return created, frozenset()
    return None, frozenset(os.listdir(folder)) if os.path.isdir(folder) else frozenset()


@contextlib.contextmanager
def undo_if_refused(workdir: str, before: tuple[str | None, frozenset[str]]):
    """Around the checks of a new run that come after `prepare_workdir` and end with its
    config.json (data, fingerprint), under the run's `lock`: if one fails (a refused run), removes
    what the run put in `workdir` since `before` (`contents`), the lock file included, and then
    the folders it created, if that leaves them empty. Nothing that was there before is
    touched."""
    try:
        yield
    except BaseException:
        created, names = before
        for name in sorted(set(os.listdir(workdir)) - names):
            path = os.path.join(workdir, name)
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
        folder = os.path.abspath(workdir)
        while created is not None and (folder + os.sep).startswith(created + os.sep):
            try:
                os.rmdir(folder)  # only an empty folder goes
            except OSError:
                break
            folder = os.path.dirname(folder)
        raise


def check_workdir(workdir: str) -> None:
    """FileNotFoundError unless `workdir` holds a config.json and at least one checkpoint."""
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"workdir {workdir} " + ("is a file, not a folder" if
                                os.path.exists(workdir) else "does not exist"))
    if not os.path.exists(os.path.join(workdir, config_lib.RECORD)):
        raise FileNotFoundError(f"{workdir} has no config.json: not a training workdir "
                                "(scripts/train.py writes one)")
    if not steps(workdir):
        raise FileNotFoundError(f"no checkpoints in {os.path.join(workdir, FOLDER)}: train first")


def check_data(workdir: str, config_data, dataset, record: bool = True) -> None:
    """Records what data a run trains on (`data.fingerprint`) in WORKDIR/data_fingerprint.json
    when it starts (`record`, process 0), and checks on every resume, evaluation or sampling
    that the data is still the same (ValueError naming the file otherwise)."""
    path = os.path.join(workdir, FINGERPRINT)
    recorded = None
    if os.path.exists(path) and steps(workdir):
        try:
            with open(path) as f:
                recorded = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is damaged ({e}); restore it, or delete it to record the "
                             "data as it is now") from e
    current = data_lib.check_fingerprint(recorded, config_data, dataset)
    if record and jax.process_index() == 0 and current != recorded:
        with writing(path), atomic_write(path) as f:
            json.dump(current, f, indent=1)


@contextlib.contextmanager
def lock(workdir: str):
    """Holds WORKDIR/.lock while a training process uses `workdir`; OSError if another one
    holds it. The lock dies with its process (flock), so a killed run never leaves it held."""
    path = os.path.join(workdir, LOCK)
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise OSError(errno.EBUSY, f"{workdir} is in use by another training process (pid "
                                       f"{holder}); wait for it to end or use another --workdir"
                          ) from e
        try:  # a refused run removes its lock file while it holds it (`undo_if_refused`)
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()  # locked a file no longer at `path`: take the one there now
    try:
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def check_output(path: str, overwrite: bool, what: str = "", create: bool = True) -> None:
    """Before any work: FileExistsError if `path` exists and `overwrite` is not set; OSError if
    its folder cannot be created or written. `create`: the folder is created now; else nothing
    is (a failure later leaves no empty folder behind): the nearest existing folder above it is
    checked instead, and the writer creates the rest."""
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, f"{path} is a folder; give the path of a file")
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(errno.EEXIST, f"{path} exists{what}; pass --overwrite to replace "
                                            "it, or choose another output")
    folder = os.path.dirname(os.path.abspath(path))
    probed = folder
    while not create and not os.path.lexists(probed):
        probed = os.path.dirname(probed)
    try:
        if os.path.lexists(probed) and not os.path.isdir(probed):  # a file in the way
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        _probe(probed)
    except OSError as e:
        raise OSError(e.errno, f"cannot write to {folder}: {e.strerror or e}; choose another "
                               "output") from e
