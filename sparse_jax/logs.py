"""What a run shows and records: console lines, a progress line, metrics.jsonl and TensorBoard.

  WORKDIR/metrics.jsonl  one JSON object per logged step: step, split (train | valid), time
                         (Unix seconds when written), bits, ...
  WORKDIR/tensorboard/   TensorBoard events (train/valid bits, lr, gradient norm, tokens/s)

Only the process with index 0 writes; the others stay silent.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import jax


def duration(seconds: float) -> str:
    """"m:ss", or "h:mm:ss" from an hour on; "?" when unknown (NaN or infinite)."""
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else \
        f"{minutes}:{secs:02d}"


class Logger:
    """Console lines, a progress bar (on a terminal), metrics.jsonl and TensorBoard of a run
    that starts (or resumes) at `start_step`."""

    def __init__(self, workdir: str, start_step: int, total_steps: int):
        self.active = jax.process_index() == 0
        self.total, self.bar_time, self.since = total_steps, 0.0, None
        self.bar = self.active and sys.stderr.isatty()
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.tb = None
        if not self.active:
            return
        if os.path.exists(self.path):  # drop what a killed run logged after its last checkpoint
            with open(self.path) as f:
                rows = [line for line in f if line.strip()
                        and json.loads(line)["step"] <= start_step]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(rows)
            os.replace(self.path + ".tmp", self.path)
        from tensorboardX import SummaryWriter

        # Hides events a killed run wrote after start_step (purge_step must be positive).
        self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=start_step + 1)

    def print(self, text: str) -> None:
        if self.active:
            if self.bar:
                sys.stderr.write("\r\033[K")
            print(text, flush=True)

    def write(self, step: int, split: str, metrics: dict) -> None:
        """One row of metrics.jsonl and one TensorBoard scalar per metric ("split/name")."""
        if not self.active:
            return
        with open(self.path, "a") as f:
            row = {"step": step, "split": split, "time": round(time.time(), 3), **metrics}
            f.write(json.dumps(row) + "\n")
        for name, value in metrics.items():
            self.tb.add_scalar(f"{split}/{name}", value, step)
        self.tb.flush()

    def progress(self, step: int, tokens_per_step: int) -> None:
        """Step `step` is done: redraws the progress bar (on a terminal, at most five times a
        second) with the average speed since the first call (so compiling does not count)."""
        now = time.time()
        if self.since is None:
            self.since = (now, step)
        if not self.bar or now - self.bar_time < 0.2 or step <= self.since[1] + 1:
            return
        steps_per_s = (step - self.since[1]) / (now - self.since[0])
        tokens_per_s = steps_per_s * tokens_per_step
        self.bar_time, done = now, step / self.total
        eta = (self.total - step) / steps_per_s
        sys.stderr.write(f"\r[{'#' * int(30 * done):<30}] {step}/{self.total} "
                         f"{steps_per_s:.2f} steps/s {tokens_per_s:,.0f} tok/s "
                         f"ETA {duration(eta)}\033[K")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar:
            sys.stderr.write("\n")
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A progress line with rate and ETA on stderr: redrawn on a terminal, else every 10%.
    Rates are measured from the first update on (so compilation does not count)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled
        self.tty, self.last, self.next_percent, self.first = sys.stderr.isatty(), 0.0, 10, None

    def update(self, done: int, amount: float, unit: str) -> None:
        """`done` of `total` items finished, `amount` units (e.g. tokens) processed so far."""
        if not self.enabled:
            return
        now = time.time()
        if self.first is None:
            self.first = (now, done, amount)
        percent = 100 * done // max(self.total, 1)
        final = done >= self.total
        t0, done0, amount0 = self.first
        if (done == done0 or self.tty and now - self.last < 0.2
                or not self.tty and percent < self.next_percent) and not final:
            return
        self.last, self.next_percent = now, percent // 10 * 10 + 10
        elapsed = max(now - t0, 1e-9)
        rate = f"{(amount - amount0) / elapsed:,.0f} {unit}/s" if done > done0 else "?"
        eta = elapsed / (done - done0) * (self.total - done) if done > done0 else float("nan")
        line = f"{self.label}: {done}/{self.total} ({percent}%)  {rate}  ETA {duration(eta)}"
        sys.stderr.write(("\r" + line + "\033[K" + ("\n" if final else "")) if self.tty
                         else line + "\n")
        sys.stderr.flush()
