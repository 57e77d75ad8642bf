"""How a script stops on SIGTERM or SIGINT (Ctrl-C), at any instant: one line, the status
128 + the signal's number (143, 130), no child process and no temporary file left.

`install()` (called when `sparse_jax.cli` is imported by a script, and again by `cli.run`)
makes the two signals act by the phase the script is in:

* importing, parsing flags, and after `main` has returned: nothing needs undoing, and an
  exception raised there can be swallowed (a C extension that is being initialised turns it
  into an ImportError, which an optional import catches, and the script went on to exit 0). The
  process ends at once: the line, then `exit_now`.
* in the script's checks and `main` (`during()`): the first signal raises `Stopped` (a
  KeyboardInterrupt) where the script is, so that the `finally` blocks and context managers on
  the way up kill what it started and remove its temporary folders; `cli.call` prints the line.
  A second signal ends the process at once (`exit_now`).
* `exit_now(status)` ends the process without Python's finalisation: it kills every process
  still descending from this one (a child that a cleanup missed, a compiler's driver and its
  process group), flushes the output and calls `os._exit`. Finalisation is what crashed: a
  signal during an XLA compilation interrupts jaxlib's wait for it, but the compilation goes on
  in XLA's thread pool, and `sys.exit` then destroyed the XLA client under it (a segmentation
  fault after the line, status -11). No compilation is awaited and no client destroyed.
* A watcher thread, woken by the signal itself (`signal.set_wakeup_fd`, even while the main
  thread is in a native call that never returns to Python), raises `Stopped` again every
  `AGAIN_S` seconds while the script runs on (a library caught it: a C extension being
  initialised turns it into an ImportError, which an optional import catches), and ends it with
  the line `GRACE_S` seconds after the signal if it is still running then (a native call that
  does not return).

A script that handles the signals itself for a while (the training loop saves a checkpoint
first, then exits 128 + the signal) replaces the handlers and puts them back after. Whatever
path a stop takes, `cli.run` ends it with `exit_now` and a status that is never 0 (`forced`).
Before the script's first statement runs (the interpreter's start, ~0.1 s) Python's defaults
apply: SIGTERM ends the process with nothing done, SIGINT prints a KeyboardInterrupt.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACE_S = 30.0  # a stop that has not ended the process this long after the signal is forced
AGAIN_S = 5.0  # meanwhile `Stopped` is raised again this often (a library may have caught it)
DEFER_S = 0.05  # a stop that lands in an import is raised this long after, until it is out
BEFORE, DURING, AFTER = "before", "during", "after"  # the phases of a script (module docstring)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT, raised where the script is, so that what it started (child processes,
    temporary folders) is ended and removed on the way out; the script ends with status
    128 + the signal's number."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signal = signal.Signals(signum)


class _State:
    phase = BEFORE
    received: signal.Signals | None = None  # the first stop signal our handler got
    reported = False  # its line is written
    again = 0  # signals the watcher sent to raise `Stopped` again
    watched = False  # the watch after the first signal has started
    installed = False
    exiting = threading.Lock()


def line(signum: int) -> str:
    """The one line a stop by `signum` ends with."""
    return "error: interrupted" if signum == signal.SIGINT else \
        f"error: stopped by {signal.Signals(signum).name}"


def received() -> signal.Signals | None:
    """The first SIGTERM / SIGINT our handler received in this process, if any."""
    return _State.received


def report(signum: int, text: str | None = None) -> None:
    """Writes the line of a stop by `signum` (or `text`) on stderr, once per process: straight
    to the file descriptor, since the thread that holds sys.stderr's lock may be the one that
    this signal interrupted."""
    if not _State.reported:
        _State.reported = True
        _flush(sys.stderr.flush)
        try:
            os.write(2, ((text or line(signum)) + "\n").encode())
        except OSError:  # stderr closed: the status still says it
            pass


def _children() -> dict[int, list[int]]:
    """{pid: its children's pids} of every process (Linux: /proc); {} elsewhere."""
    children: dict[int, list[int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return children
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(pid)
    return children


def descendants(pid: int | None = None) -> list[int]:
    """The processes descending from `pid` (default: this one), children first."""
    children, out = _children(), []
    todo = list(children.get(os.getpid() if pid is None else pid, []))
    while todo:
        child = todo.pop(0)
        out.append(child)
        todo += children.get(child, [])
    return out


def kill_descendants() -> None:
    """SIGKILL to every process descending from this one, and to the process groups they lead
    (a compiler's driver started in its own session takes its cc1plus and as with it)."""
    for pid in descendants():
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except OSError:  # ended meanwhile
            pass


def exit_now(status: int) -> None:
    """Ends the process with `status` without Python's finalisation (module docstring): kills
    what descends from it, flushes stdout, stderr and the logging handlers, `os._exit`."""
    if not _State.exiting.acquire(blocking=False):  # another thread is ending it already
        threading.Event().wait()
    kill_descendants()
    for flush in (sys.stdout.flush, sys.stderr.flush, logging.shutdown):
        _flush(flush)
    os._exit(status)


def finish(status: int) -> None:
    """Ends a script that ran to its end (or failed) with `status` as Python's own exit would,
    other threads joined and the atexit functions run, but with the stop handler still in
    place, then `exit_now`. Python's finalisation puts SIGTERM and SIGINT back to their
    defaults before it tears the modules down, and a signal in that window (a JAX process's
    teardown takes a while) killed the process without its line (status -15)."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    exit_now(status)


def _flush(flush) -> None:
    """`flush()`, given a second at most: from the main thread at once; from another thread in
    a helper, since the main thread may hold the lock it needs (a signal interrupted it)."""
    def call():
        try:
            flush()
        except Exception:  # noqa: BLE001  (a closed pipe: the status still counts)
            pass

    if threading.current_thread() is threading.main_thread():
        call()
    else:
        helper = threading.Thread(target=call, daemon=True)
        helper.start()
        helper.join(1.0)


def forced(status) -> int:
    """The exit status for `status` (SystemExit's code): 128 + the signal where a stop signal
    was received, or where the status already says so; else `status` as a number."""
    code = status if isinstance(status, int) else (0 if status is None else 1)
    if _State.received is not None and code in (0, 1):
        return 128 + _State.received
    return code


def _importing(frame) -> bool:
    """Whether `frame` (where the main thread was when the handler ran) is inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _again(signum: int, after_s: float) -> None:
    """Sends `signum` to the main thread again after `after_s` seconds, for `_handle` to raise
    `Stopped` then (not a second signal from outside)."""
    _State.again += 1
    threading.Timer(after_s, signal.pthread_kill,
                    (threading.main_thread().ident, signum)).start()


def _handle(signum, frame):
    again = _State.again > 0  # ours (`_again`), not a second signal from outside
    _State.again = max(0, _State.again - 1)
    if _State.phase == DURING and (_State.received is None or again):
        _State.received = signal.Signals(signum)
        if _importing(frame):  # in a C extension's initialisation an exception can crash
            _again(signum, DEFER_S)  # (jaxlib's) or become an ImportError: after the import
            return
        raise Stopped(signum)
    _State.received = _State.received or signal.Signals(signum)
    report(signum)
    exit_now(128 + signum)


def _watch(read_fd: int) -> None:
    """The watcher thread, woken through the wakeup fd by every signal with a Python handler:
    at the first stop signal that our handler owns, starts `_force_later`."""
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        for signum in data:  # one watch per process (`_again`'s signals come here too)
            if signum in SIGNALS and signal.getsignal(signum) is _handle and not _State.watched:
                _State.watched = True
                threading.Thread(target=_force_later, args=(signum,), daemon=True).start()


def _force_later(signum: int) -> None:
    """Raises the stop again every `AGAIN_S` seconds while the script runs on (a library caught
    it), and ends the process `GRACE_S` seconds after the signal."""
    start = time.monotonic()
    while time.monotonic() - start < GRACE_S - AGAIN_S:
        time.sleep(AGAIN_S)
        if _State.phase == DURING and _State.received is not None \
                and signal.getsignal(signum) is _handle:  # our stop, caught by someone
            _again(signum, 0.0)
    time.sleep(max(0.0, GRACE_S - (time.monotonic() - start)))
    report(signum)
    exit_now(128 + signum)


def install() -> None:
    """Our handler for SIGTERM and SIGINT where they are at their defaults (a signal ignored by
    whoever started the process stays ignored), and the watcher; unblocks the two signals (a
    restart blocks them across `execve`: see `blocked`). Main thread only; once."""
    if _State.installed or threading.current_thread() is not threading.main_thread():
        return
    _State.installed = True
    for sig in SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _handle)
    if signal.getsignal(signal.SIGTERM) is _handle or signal.getsignal(signal.SIGINT) is _handle:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd)
            os.close(write_fd)
        else:
            threading.Thread(target=_watch, args=(read_fd,), daemon=True,
                             name="sparse_jax stop watcher").start()
    previous_hook = sys.unraisablehook

    def unraisable(info):  # raised in a gc callback or a __del__, where Python drops it
        if isinstance(info.exc_value, Stopped) and _State.phase == DURING:
            _again(info.exc_value.signal, DEFER_S)  # raise it again, once out of here
        else:
            previous_hook(info)

    sys.unraisablehook = unraisable
    previous_excepthook = sys.excepthook

    def excepthook(kind, value, tb):  # a C extension's PyErr_Print (numpy's import_array):
        if not isinstance(value, Stopped):  # the stop's traceback, then an ImportError; the
            previous_excepthook(kind, value, tb)  # stop has a line of its own

    sys.excepthook = excepthook
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def blocked() -> None:
    """Blocks SIGTERM and SIGINT, before `os.execve` restarts the process: a signal in the
    restart waits, pending, until the new process has its handler (`install`)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)


def during() -> None:
    """The script's checks and `main` start: a signal now raises `Stopped`."""
    _State.phase = DURING


def after() -> None:
    """`main` has returned (or raised): a signal now ends the process at once."""
    _State.phase = AFTER
