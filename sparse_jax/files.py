"""How every file of a run is written, so that a process killed at any instant (or a full disk)
leaves each file either as it was or whole, never torn.

  atomic_write(path)      a whole file: written under a temporary name next to it, flushed to
                          the disk, then renamed over `path` (a rename is atomic); on failure
                          the temporary file is removed and `path` is untouched
  append_line(path, row)  one JSON object as one line of a .jsonl log, in a single write
  read_jsonl(path)        the rows of a .jsonl log, without a torn last line (a write cut short
                          by a full disk or a crash), which a reader never sees as a row
  write_error(path, e, fix)  a failed write as one line that names the file, says when the
                          disk is full, and what to do
  writing(path, fix)      a block whose OSError becomes `write_error(path, ...)`

The data cache (`data.sources`, `sparse_jax.data.images`) writes its files the same way, under
a name unique to the process (`part_suffix`), since several processes may prepare the same file
at once; the parts (files or folders) that a killed process left behind are removed by the next
writer (`remove_dead_parts`). So does the build of the CPU kernels (`sparse_jax.attention.native`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil

TEMPORARY = ".tmp"  # suffix of a file being written (a workdir has one writer: its lock)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "w", suffix: str = TEMPORARY):
    """Yields a file open for writing under `path + suffix`; when the block ends without an
    error it is flushed, synced and renamed to `path`. If anything fails (the block raises, the
    disk is full), the temporary file is removed and the error propagates: `path` keeps what it
    had before, whole."""
    tmp = path + suffix
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def part_suffix(path: str) -> str:
    """".part<pid>": the temporary suffix of this process for `path`, after removing the parts of
    `path` whose process is gone (killed mid-write: nothing else would ever remove them)."""
    remove_dead_parts(glob.escape(path) + ".part*")
    return f".part{os.getpid()}"


def remove_dead_parts(pattern: str) -> None:
    """Removes the files and folders matching `pattern` (a glob of names ending in
    ".part<pid>") whose process is gone; those of live processes stay."""
    for name in glob.glob(pattern):
        pid = name.rpartition(".part")[2]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                if os.path.isdir(name) and not os.path.islink(name):
                    shutil.rmtree(name)
                else:
                    os.remove(name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    return True


def append_line(path: str, row: dict) -> None:
    """Appends `row` as one JSON line with a single write (O_APPEND): a crash leaves the line
    whole or absent, and only a full disk can cut it short (`read_jsonl` drops such a line)."""
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        if written != len(data):  # a short write: the disk filled up mid-line
            raise OSError(errno.ENOSPC, f"No space left on device (wrote {written} of "
                                        f"{len(data)} bytes)")
    finally:
        os.close(fd)


def read_jsonl(path: str) -> list[dict]:
    """The rows of a .jsonl file written by `append_line`; a line that does not parse (cut short
    by a full disk or a crash) is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                with contextlib.suppress(ValueError):
                    row = json.loads(line)
                    if isinstance(row, dict):
                        rows.append(row)
    return rows


def write_error(path: str, error: OSError, fix: str) -> OSError:
    """A failed write of `path` as one line (an OSError of the same errno) that names it, says
    so when the disk is full, and ends with `fix`: what to do."""
    reason = " ".join((error.strerror or str(error)).split())
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = f"the disk is full ({reason})"
    return OSError(error.errno, f"could not write {path}: {reason}; {fix}")


AGAIN = "free some space and run the same command again"


@contextlib.contextmanager
def writing(path: str, fix: str = AGAIN):
    """Runs the block; an OSError in it becomes `write_error(path, error, fix)`."""
    try:
        yield
    except OSError as e:
        raise write_error(path, e, fix) from e
