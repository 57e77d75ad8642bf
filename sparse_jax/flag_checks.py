"""The checks of the values flags give, before any work and writing nothing, each naming the
flag in its one line (`cli`'s error path): paths to read and to write (no file a script did not
write in this run is replaced without its --overwrite), lists of integers and numbers, time
limits (at most a week: `seconds`) and sizes against the memory here (`memory_fits`). Scripts
call them as `cli.input_file`, `cli.seconds`, ...
"""

from __future__ import annotations

import math
import os

from absl import app

MAX_INTEGER = 2**31 - 1  # an integer flag without an upper bound of its own: the int32 limit


# Paths given by flags, checked before any work and writing nothing: each error names the flag.


def input_file(name: str, path: str | None, what: str = "a file") -> None:
    """UsageError unless `path` (the value of --`name`; None: not given) is a readable file."""
    if path is None:
        return
    if not path:
        raise app.UsageError(f"--{name}= is empty; give {what}")
    if os.path.isdir(path):
        raise app.UsageError(f"--{name}={path} is a folder; give {what}")
    if not os.path.exists(path):
        raise app.UsageError(f"--{name}={path} does not exist; give {what}")
    if not os.access(path, os.R_OK):
        raise app.UsageError(f"--{name}={path} cannot be read; give {what}")


def input_dir(name: str, path: str | None, what: str = "a folder") -> None:
    """UsageError unless `path` (the value of --`name`; None: not given) is a readable folder."""
    if path is None:
        return
    if not path:
        raise app.UsageError(f"--{name}= is empty; give {what}")
    if not os.path.exists(path):
        raise app.UsageError(f"--{name}={path} does not exist; give {what}")
    if not os.path.isdir(path):
        raise app.UsageError(f"--{name}={path} is a file, not a folder; give {what}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise app.UsageError(f"--{name}={path} cannot be read; give {what}")


def _writable_above(name: str, path: str) -> None:
    """UsageError unless the nearest existing folder above `path` can be written (what is
    missing below it is created by the writer), and no file stands in the way."""
    above = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise app.UsageError(f"--{name}={path}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise app.UsageError(f"--{name}={path}: {above} cannot be written; choose another place")


def output_file(name: str, path: str | None, overwrite: bool = False,
                beside: tuple[str, ...] = ()) -> None:
    """UsageError unless `path` (the value of --`name`; None: not given) can be written as a
    file: not a folder, its folder writable, and (unless `overwrite`, the script's --overwrite)
    not already there; `beside`: the names of files the script also writes in its folder,
    checked the same way. No script replaces a file it did not write in this run unasked."""
    if path is None:
        return
    if not path:
        raise app.UsageError(f"--{name}= is empty; give the path of a file")
    for where in (path, *(os.path.join(os.path.dirname(path), b) for b in beside)):
        shown = f"--{name}={path}" + ("" if where == path else f": {where}")
        if os.path.isdir(where):
            raise app.UsageError(f"{shown} is a folder; give the path of a file"
                                 + ("" if where == path else " elsewhere"))
        if not overwrite and os.path.lexists(where):
            raise app.UsageError(f"{shown} exists; pass --overwrite to replace it, or "
                                 "choose another path")
    _writable_above(name, path)


def output_dir(name: str, path: str | None, holds: tuple[str, ...] = (),
               overwrite: bool | None = False) -> None:
    """UsageError unless `path` (the value of --`name`; None: not given) can be the folder the
    script writes `holds` (file names) into: not a file, writable, and (`overwrite` False)
    holding none of them already; None: the script replaces them by design."""
    if path is None:
        return
    if not path:
        raise app.UsageError(f"--{name}= is empty; give a folder")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise app.UsageError(f"--{name}={path} is a file, not a folder; give a folder")
    if overwrite is False and os.path.isdir(path):
        there = [h for h in holds if os.path.lexists(os.path.join(path, h))]
        if there:
            raise app.UsageError(f"--{name}={path} already holds {', '.join(there)}: give "
                                 "--overwrite to replace them, or another folder")
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            raise app.UsageError(f"--{name}={path} cannot be written; choose another folder")
    else:
        _writable_above(name, path)


# The longest wait a script accepts (a time limit, a stage's cap, a budget): a week, far beyond
# any run of this project and far below what the waits that consume it take (select's poll()
# counts milliseconds in a C int, ~24.8 days; threading.TIMEOUT_MAX), so a limit that passes the
# checks cannot crash the wait later (`seconds`).
MAX_SECONDS = 7 * 24 * 3600


def seconds(name: str, value, high: float = MAX_SECONDS) -> float:
    """`value` (of --`name`, a number or text) as a number of seconds in (0, `high`]; ValueError
    naming the flag otherwise."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not (math.isfinite(number) and 0 < number <= high):
        raise ValueError(f"--{name}={value}: give a positive number of seconds up to {high:,g}"
                         + (" (a week)" if high == MAX_SECONDS else ""))
    return number


def available_memory() -> int | None:
    """Bytes of host memory a new allocation could get now (Linux's MemAvailable; else the
    physical memory), or None where neither is known."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None


def memory_fits(what: str, need: float, lower: str) -> None:
    """ValueError (one line) when `need` bytes (`what`, e.g. "--heads=8 x --batch=1: q, k, v
    and the output") exceed the host memory available now: a size the flags' own bounds let
    through that no run here could hold. `lower`: the flags or fields to lower."""
    available = available_memory()
    if available is not None and need > available:
        raise ValueError(f"{what} need at least {need / 2**30:,.1f} GiB, and "
                         f"{available / 2**30:,.1f} GiB are available; lower {lower}")


def integers(name: str, items: list[str], low: int = 1, high: int = MAX_INTEGER) -> list[int]:
    """The items of the list flag --`name` as integers in [low, high]; UsageError naming the
    flag for one that is not."""
    out = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise app.UsageError(f"--{name}: {item!r} is not an integer") from None
        if not low <= value <= high:
            raise app.UsageError(f"--{name}: {value} is outside [{low:,}, {high:,}]")
        out.append(value)
    return out


def numbers(name: str, items: list[str], low: float = -math.inf,
            high: float = math.inf) -> list[float]:
    """The items of the list flag --`name` as finite numbers in [low, high]; UsageError naming
    the flag for one that is not."""
    out = []
    for item in items:
        try:
            value = float(item)
        except ValueError:
            raise app.UsageError(f"--{name}: {item!r} is not a number") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise app.UsageError(f"--{name}: {item} is not a finite number in [{low:g}, "
                                 f"{high:g}]")
        out.append(value)
    return out
