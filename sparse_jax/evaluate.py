"""Evaluation of a trained run: bits per byte (text) or per dim (images) over a whole split.

  python scripts/evaluate.py --workdir=DIR [--split=test] [--checkpoint=latest|best|STEP]
      [--min_context=N] [--batch_size=B]

`evaluate(workdir, ...)` reads the config the run trained with (`DIR/config.json`), restores only
the parameters of one checkpoint (`DIR/checkpoints/<step>/params`, the Orbax layout of
`sparse_jax.train`; the optimizer state is never read) and scores the split with one jitted
forward pass per batch:

* bytes: windows of seq_len from `data.eval_windows`. Default: non-overlapping windows, every
  byte scored once with whatever context its window gives it. `min_context=m`: overlapping
  windows (stride seq_len - m) that score only positions with at least m bytes of context
  before them (paper Table 3; the first window scores everything). Either way every byte of the
  split except the first (which is only context) is scored exactly once: num_scored = len - 1.
* images: every sub-pixel of every image of the split (num_scored = images x seq_len).

The result is printed as a table and written as JSON to `DIR/eval/<split>_<step>.json`
(`<split>_<step>_minctx<m>.json` with min_context), outside the checkpoint folders so that it
survives checkpoint rotation; keys: split, step, bits, unit, num_scored, min_context, ...

Checkpoints are opened read-only (safe while the run is still training). The batch is split
over all devices (data parallel, and parameters split as in training when the run used
mesh.fsdp > 1); with several processes each reads its share of the windows.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from sparse_jax import data as data_lib
from sparse_jax import sharding as sharding_lib
from sparse_jax import train as train_lib
from sparse_jax.model import SparseTransformer, model_config


class _DropReadOnlyWarning(logging.Filter):
    """Orbax warns that a read-only CheckpointManager's directory is read only: that is wanted."""

    def filter(self, record):
        return "is read only" not in record.getMessage()


logging.getLogger("absl").addFilter(_DropReadOnlyWarning())


# ---------------------------------------------------------------------------------------------
# Workdirs and checkpoints (shared with `sample`).


def check_workdir(workdir: str) -> None:
    """FileNotFoundError unless `workdir` holds a config.json and at least one checkpoint."""
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"workdir {workdir} does not exist")
    if not os.path.exists(os.path.join(workdir, "config.json")):
        raise FileNotFoundError(f"{workdir} has no config.json: not a training workdir "
                                "(scripts/train.py writes one)")
    ckpt_dir = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(ckpt_dir) or not any(n.isdigit() for n in os.listdir(ckpt_dir)):
        raise FileNotFoundError(f"no checkpoints in {ckpt_dir}: train first")


def parse_checkpoint(checkpoint) -> str | int:
    """"latest" | "best" | a step number (int or digits); ValueError otherwise."""
    if isinstance(checkpoint, str) and checkpoint in ("latest", "best"):
        return checkpoint
    if isinstance(checkpoint, str) and checkpoint.isdigit():
        return int(checkpoint)
    if isinstance(checkpoint, (int, np.integer)) and not isinstance(checkpoint, bool) \
            and checkpoint >= 0:
        return int(checkpoint)
    raise ValueError(f"checkpoint must be 'latest', 'best' or a step number, got {checkpoint!r}")


def _manager(workdir: str) -> ocp.CheckpointManager:
    """Read-only: never creates, deletes or cleans anything in a (maybe running) workdir."""
    options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0,
        best_fn=lambda metrics: metrics["valid_bits"], best_mode="min")
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=options)


def resolve_step(manager: ocp.CheckpointManager, checkpoint) -> int:
    """The step that `checkpoint` ("latest", "best" or a step) names; FileNotFoundError if none."""
    checkpoint = parse_checkpoint(checkpoint)
    steps = sorted(manager.all_steps())
    if not steps:
        raise FileNotFoundError(f"no checkpoints in {manager.directory}: train first")
    if checkpoint == "latest":
        return manager.latest_step()
    if checkpoint == "best":
        step = manager.best_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {manager.directory} has a validation "
                                    f"score, so none is 'best'; steps: {steps}")
        return step
    if checkpoint not in steps:
        raise FileNotFoundError(f"no checkpoint of step {checkpoint} in {manager.directory}; "
                                f"steps: {steps}")
    return checkpoint


def restore_model(workdir: str, checkpoint="latest", mesh=None):
    """(model, config, step): the run's config and the parameters of one checkpoint.

    Only the `params` item is read. With a `mesh` ("data", "fsdp" axes), the parameters land
    sharded as in training (`sparse_jax.sharding`: split over "fsdp", copied over "data");
    without one, whole on this process's first device.
    """
    check_workdir(workdir)
    checkpoint = parse_checkpoint(checkpoint)
    config = train_lib.load_config(workdir)
    cfg = model_config(config.model)
    manager = _manager(workdir)
    try:
        step = resolve_step(manager, checkpoint)
        graphdef, abstract = nnx.split(nnx.eval_shape(
            lambda: SparseTransformer(cfg, rngs=nnx.Rngs(0))))
        pure = nnx.to_pure_dict(abstract)
        if mesh is None:
            device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            shardings = jax.tree.map(lambda _: device, pure)
        else:
            shardings = sharding_lib.state_shardings(pure, mesh)
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              pure, shardings)
        restored = manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target)))
    finally:
        manager.close()
    nnx.replace_by_pure_dict(abstract, restored["params"])
    return nnx.merge(graphdef, abstract), config, step


def eval_mesh(config, devices: int):
    """The training mesh's fsdp split (when it divides `devices`) with data over the rest: a
    model trained sharded is evaluated sharded."""
    fsdp = config.mesh.fsdp if devices % config.mesh.fsdp == 0 else 1
    return sharding_lib.make_mesh(-1, fsdp)


# ---------------------------------------------------------------------------------------------
# Evaluation.


class Progress:
    """A progress line with rate and ETA on stderr: redrawn on a terminal, else every 10%.
    Rates are measured from the first update on (so compilation does not count)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled
        self.tty, self.last, self.next_percent, self.first = sys.stderr.isatty(), 0.0, 10, None

    def update(self, done: int, amount: float, unit: str) -> None:
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
        line = f"{self.label}: {done}/{self.total} ({percent}%)  {rate}  ETA {_duration(eta)}"
        sys.stderr.write(("\r" + line + "\033[K" + ("\n" if final else "")) if self.tty
                         else line + "\n")
        sys.stderr.flush()


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else \
        f"{minutes}:{secs:02d}"


@functools.lru_cache(maxsize=8)
def _eval_step(graphdef, batch_sharding):
    """The trainer's eval step (sum of bits, count), jitted once per model and mesh; it runs
    where its arguments live (parameters as restored, batches split over the mesh)."""
    return jax.jit(train_lib.make_eval_step(graphdef, batch_sharding))


def result_path(workdir: str, split: str, step: int, min_context: int | None) -> str:
    name = f"{split}_{step}" + (f"_minctx{min_context}" if min_context else "")
    return os.path.join(workdir, "eval", name + ".json")


def evaluate(workdir: str, split: str = "test", checkpoint="latest",
             min_context: int | None = None, batch_size: int | None = None, *,
             progress: bool = True, write: bool = True) -> dict:
    """Bits per byte / dim of one checkpoint over the whole `split`; see the module docstring.

    batch_size: sequences per forward pass over all devices (default: the training batch).
    Returns the result dict (also written to `result_path(...)` if `write`).
    """
    # Everything cheap is checked before restoring parameters or reading data.
    check_workdir(workdir)
    checkpoint = parse_checkpoint(checkpoint)
    if split not in data_lib.SPLITS:
        raise ValueError(f"split must be one of {data_lib.SPLITS}, got {split!r}")
    config = train_lib.load_config(workdir)
    cfg = model_config(config.model)
    batch_size = config.batch_size if batch_size is None else batch_size
    devices, processes = jax.device_count(), jax.process_count()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1 \
            or batch_size % devices:
        raise ValueError(f"batch_size must be a positive multiple of the {devices} devices, got "
                         f"{batch_size!r}")
    image = config.data.name == "cifar10"
    if min_context is not None and (image or not 0 <= min_context < cfg.seq_len):
        raise ValueError("min_context applies to byte data only" if image else
                         f"min_context must be in [0, seq_len={cfg.seq_len}), got {min_context}")

    mesh = eval_mesh(config, devices)
    batch_sharding = NamedSharding(mesh, P(sharding_lib.MESH_AXES))
    model, config, step = restore_model(workdir, checkpoint, mesh)
    dataset = data_lib.make_dataset(config.data, cfg.seq_len, jax.process_index(), processes)
    graphdef, params = nnx.split(model)
    eval_step = _eval_step(graphdef, batch_sharding)

    split_data = dataset.splits[split]
    count = len(split_data) if dataset.unit == "dim" else len(
        data_lib.eval_windows(split_data, cfg.seq_len, min_context).starts)
    if count == 0:
        raise ValueError(f"the {split} split has nothing to score ({len(split_data)} items)")
    num_batches = -(-count // batch_size)
    bar = Progress(num_batches, f"{split} step {step}", progress and jax.process_index() == 0)
    total_bits, scored, outputs = 0.0, 0, []
    start = time.time()
    first_done = None  # time when the first batch (which includes compilation) finished
    for i, batch in enumerate(dataset.eval_batches(split, batch_size // processes, min_context)):
        batch = {k: jax.make_array_from_process_local_data(batch_sharding, v)
                 for k, v in batch.items()}
        outputs.append(eval_step(params, batch))  # dispatched; the host reads the next batch
        if i > 0:  # wait for the previous batch only: one batch stays in flight
            bits, n = jax.device_get(outputs[i - 1])
            total_bits, scored = total_bits + float(bits), scored + int(n)
            if first_done is None:
                first_done = time.time()
            bar.update(i, min(i * batch_size, count) * cfg.seq_len, "tokens")
    bits, n = jax.device_get(outputs[-1])
    total_bits, scored = total_bits + float(bits), scored + int(n)
    end = time.time()
    bar.update(num_batches, count * cfg.seq_len, "tokens")

    # Throughput of the windows actually computed (padding rows excluded), after compilation.
    timed_batches = num_batches - 1 if first_done is not None else num_batches
    timed_s = end - first_done if first_done is not None else end - start
    timed_rows = count - batch_size if first_done is not None else count
    result = {
        "split": split, "step": int(step), "bits": total_bits / max(scored, 1),
        "unit": dataset.unit, "num_scored": scored, "min_context": min_context,
        "dataset": config.data.name, "split_size": len(split_data),
        "num_sequences": count, "seq_len": cfg.seq_len, "batch_size": batch_size,
        "num_batches": num_batches, "tokens_per_s": timed_rows * cfg.seq_len / timed_s,
        "scored_per_s": scored / (end - start), "timed_batches": timed_batches,
        "wall_s": end - start, "workdir": os.path.abspath(workdir),
        "devices": devices, "backend": jax.default_backend(),
    }
    if write and jax.process_index() == 0:
        path = result_path(workdir, split, step, min_context)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(path + ".tmp", path)
        result["path"] = path
    return result


def format_table(result: dict) -> str:
    """One-row markdown table of an evaluation result."""
    fmt = {"bits": "{:.4f}", "num_scored": "{:,}", "tokens_per_s": "{:,.0f}", "wall_s": "{:.1f}"}
    cols = [("split", "split"), ("step", "step"), ("bits", f"bits/{result['unit']}"),
            ("num_scored", "scored"), ("min_context", "min context"),
            ("tokens_per_s", "tokens/s"), ("wall_s", "wall s")]
    cells = ["—" if result.get(k) is None else fmt.get(k, "{}").format(result[k])
             for k, _ in cols]
    return "\n".join(["| " + " | ".join(h for _, h in cols) + " |",
                      "|" + "|".join("---" for _ in cols) + "|", "| " + " | ".join(cells) + " |"])
