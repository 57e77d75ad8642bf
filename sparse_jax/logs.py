"""What a run shows and records: console lines, progress bars (tqdm), metrics.jsonl, TensorBoard
and, if asked for, a profiler trace of chosen steps.

  WORKDIR/metrics.jsonl  one JSON object per logged step: step, split (train | valid), time
                         (Unix seconds when written), bits, ...; valid rows add by_position
                         (bits of positions "0-63", "64-127", ... of the window)
  WORKDIR/tensorboard/   TensorBoard events (train/valid bits, lr, gradient norm, tokens/s)
  WORKDIR/profile/       the trace of config.profile_steps (`Profiler`), one folder per trace
                         under plugins/profile/: HOST.xplane.pb (TensorBoard's profile plugin,
                         xprof) and perfetto_trace.json.gz (https://ui.perfetto.dev)

Only the process with index 0 writes; the others stay silent. A write that fails (a full disk)
stops the run with one line that names the file (`files.write_error`); what was written before
stays whole, and the same command run again resumes from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import sys
import time

import jax
from tqdm import tqdm

from sparse_jax.files import append_line, atomic_write, read_jsonl, write_error

AGAIN = ("free some space and run the same command again (it resumes from the last "
         "checkpoint)")  # what to do when a log cannot be written


def warn(message: str) -> None:
    """One `warning:` line on stderr (process 0 only)."""
    if jax.process_index() == 0:
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()


@contextlib.contextmanager
def timed(what: str, done: str):
    """A block that takes a while before anything else shows (a build, a compilation): one line
    "`what`..." as it starts and "`done` in N s" when it ends well (stdout, process 0 only)."""
    def say(text):
        if jax.process_index() == 0:
            with tqdm.external_write_mode():
                print(text, flush=True)

    say(f"{what}...")
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    took = f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s" if seconds < 60 else \
        duration(seconds)
    say(f"{done} in {took}")


def duration(seconds: float) -> str:
    """"m:ss", or "h:mm:ss" from an hour on; "?" when unknown (NaN or infinite)."""
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else \
        f"{minutes}:{secs:02d}"


class _Events:
    """A TensorBoard event file in `folder`, written in the calling thread, so that a failed
    write raises where the run reports it. (tensorboardX's SummaryWriter writes from a thread of
    its own: a failed write ended that thread with a traceback, its queue filled up, and the run
    hung for good, deaf to SIGTERM.) TensorBoard hides the events of steps >= `purge_step` that
    earlier files hold: what a killed run logged after its last checkpoint."""

    def __init__(self, folder: str, purge_step: int):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.summary import scalar

        self.folder, self._event, self._scalar = folder, Event, scalar
        os.makedirs(folder, exist_ok=True)
        # The writer names its file by the second and the host, and opens it with "wb": a run
        # resumed within the second that the last one started in would empty that one's file.
        # The process id and a random tag keep the names apart.
        self.writer = EventsWriter(os.path.join(folder, "events"),
                                   filename_suffix=f".{os.getpid()}.{secrets.token_hex(4)}")
        self.writer.write_event(Event(wall_time=time.time(), step=purge_step,
                                      session_log=SessionLog(status=SessionLog.START)))
        self.writer.flush()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.write_event(self._event(wall_time=time.time(), step=step,
                                            summary=self._scalar(tag, value)))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Logger:
    """Console lines, a progress bar (on a terminal only), metrics.jsonl and TensorBoard of a
    run that starts (or resumes) at `start_step`."""

    def __init__(self, workdir: str, start_step: int, total_steps: int):
        self.active = jax.process_index() == 0
        self.total, self.since, self.bar = total_steps, None, None
        self.show_bar = self.active and sys.stderr.isatty()
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb, self.failed = None, False
        if not self.active:
            return
        if os.path.exists(self.path):  # drop what a killed run logged after its last checkpoint
            rows = [r for r in read_jsonl(self.path) if r.get("step", math.inf) <= start_step]
            with self._writing(self.path), atomic_write(self.path) as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        folder = os.path.join(workdir, "tensorboard")
        with self._writing(folder):
            self.tb = _Events(folder, purge_step=start_step + 1)

    @contextlib.contextmanager
    def _writing(self, path: str):
        """An OSError while writing `path` becomes one line that names it (`files.write_error`)."""
        try:
            yield
        except OSError as e:
            self.failed = True
            raise write_error(path, e, AGAIN) from e

    def print(self, text: str) -> None:
        """One console line (stdout); the progress bar is cleared first and redrawn after."""
        if self.active:
            with tqdm.external_write_mode():
                print(text, flush=True)

    def write(self, step: int, split: str, metrics: dict) -> None:
        """One row of metrics.jsonl and one TensorBoard scalar per metric ("split/name"); a
        metric that is a dict gives one scalar per key ("split/name/key")."""
        if not self.active:
            return
        with self._writing(self.path):
            append_line(self.path, {"step": step, "split": split, "time": round(time.time(), 3),
                                    **metrics})
        with self._writing(self.tb.folder):
            for name, value in metrics.items():
                for tag, scalar in (value.items() if isinstance(value, dict) else [("", value)]):
                    self.tb.add_scalar(f"{split}/{name}" + (f"/{tag}" if tag else ""), scalar,
                                       step)
            self.tb.flush()

    def progress(self, step: int, tokens_per_step: int) -> None:
        """Step `step` is done: moves the progress bar (on a terminal; tqdm redraws it at most
        five times a second). Rates are averages from the first call on, so compiling the step
        does not count."""
        if not self.show_bar:
            return
        if self.bar is None:
            self.since = (time.time(), step)
            self.bar = tqdm(total=self.total, initial=step, desc="train", unit="step", smoothing=0,
                            mininterval=0.2, dynamic_ncols=True)
            return
        steps_per_s = (step - self.since[1]) / max(time.time() - self.since[0], 1e-9)
        self.bar.set_postfix_str(f"{steps_per_s * tokens_per_step:,.0f} tok/s", refresh=False)
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        """Closes the progress bar and the event file; after a failed write, quietly (its error
        is the one the run reports)."""
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            with contextlib.suppress(OSError) if self.failed else self._writing(self.tb.folder):
                self.tb.close()


class _Lines(tqdm):
    """tqdm for a log file: a line of its own for each new count, no carriage returns."""

    shown = None  # the count of the last line written

    def display(self, msg=None, pos=None):
        if msg is None and self.n != self.shown:  # msg="": clearing a terminal line
            self.fp.write(self.__str__() + "\n")
            self.fp.flush()
            self.shown = self.n
        return msg is None

    def clear(self, nolock=False):  # a line written is never taken back
        pass


class Progress:
    """Progress with rate and ETA on stderr (tqdm): a bar redrawn on a terminal, else a line
    every 10%. Rates are measured from the first update on (so compilation does not count)."""

    def __init__(self, total: int, label: str, enabled: bool = True, unit: str = "batch"):
        self.total, self.label, self.enabled, self.unit = total, label, enabled, unit
        self.bar, self.first = None, None

    def update(self, done: int, amount: float, unit: str) -> None:
        """`done` of `total` items finished, `amount` units (e.g. tokens) processed so far."""
        if not self.enabled or self.bar is not None and self.bar.disable:  # disable: closed
            return
        now = time.time()
        if self.bar is None:
            self.first = (now, amount)
            tty = sys.stderr.isatty()
            options = dict(mininterval=0.2, dynamic_ncols=True) if tty else dict(
                mininterval=0, miniters=max(1, -(-self.total // 10)), maxinterval=math.inf,
                leave=False,  # the last line stays anyway: no blank line after it
                bar_format="{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) "
                           "[{elapsed}<{remaining}, {rate_fmt}{postfix}]")
            self.bar = (tqdm if tty else _Lines)(
                total=self.total, initial=done, desc=self.label, unit=self.unit, smoothing=0,
                delay=0 if tty else 1e-6, **options)  # a log file skips the 0% line
        else:
            t0, amount0 = self.first
            self.bar.set_postfix_str(f"{(amount - amount0) / max(now - t0, 1e-9):,.0f} {unit}/s",
                                     refresh=False)
            self.bar.update(done - self.bar.n)
        if done >= self.total:
            self.bar.refresh()  # the final line, whatever the interval
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# Profiling (config.profile_steps).


def check_profile_steps(steps, total_steps: int | None = None) -> tuple[int, ...]:
    """config.profile_steps as a tuple: () (off) or (first, last) with 1 <= first <= last
    (<= total_steps if given); ValueError otherwise."""
    steps = tuple(steps) if isinstance(steps, (tuple, list)) else steps
    ok = steps == () or (isinstance(steps, tuple) and len(steps) == 2 and all(
        isinstance(s, int) and not isinstance(s, bool) for s in steps)
        and 1 <= steps[0] <= steps[1] and (total_steps is None or steps[1] <= total_steps))
    if not ok:
        limit = "" if total_steps is None else f" <= total_steps={total_steps}"
        raise ValueError(f"config.profile_steps must be () (off) or (first, last) with "
                         f"1 <= first <= last{limit}, got {steps!r}")
    return steps


class Profiler:
    """A `jax.profiler` trace of the training steps first..last (counted from 1, inclusive)
    into WORKDIR/profile, on process 0; does nothing for steps=().

    Call `step(step, outputs)` after dispatching step `step` with that step's outputs (e.g. the
    new state): the trace starts before step `first` runs and stops after step `last` has
    finished on the device (both wait for the outputs, so the trace holds exactly those steps'
    work). A run resumed inside the range traces the rest of it. `close()` stops a trace that
    is still running (a run that ended early)."""

    def __init__(self, workdir: str, steps, start_step: int = 0):
        steps = check_profile_steps(steps)
        self.dir = os.path.join(workdir, "profile")
        self.first, self.last = steps if steps and jax.process_index() == 0 else (0, -1)
        self.tracing = self.done = False
        self.step(start_step)

    def step(self, step: int, outputs=None) -> None:
        """Steps 1..`step` are dispatched; `outputs` are step `step`'s results."""
        if self.tracing and step >= self.last:
            jax.block_until_ready(outputs)
            self.close()
        elif not (self.tracing or self.done) and self.first <= step + 1 <= self.last:
            jax.block_until_ready(outputs)
            jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
            self.tracing = True

    def close(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing, self.done = False, True
