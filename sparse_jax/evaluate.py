"""Evaluation of a trained run: bits per byte (text) or per dim (images) over a whole split.

  python scripts/evaluate.py --workdir=DIR [--split=test] [--checkpoint=latest|best|STEP]
      [--min_context=N] [--batch_size=B]

`evaluate(workdir, ...)` reads the config the run trained with (`DIR/config.json`), restores only
the parameters of one checkpoint (`DIR/checkpoints/<step>/params`, see
`sparse_jax.checkpoints`; the optimizer state is never read) and scores the split with one jitted
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
import os
import time

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sparse_jax import checkpoints
from sparse_jax import config as config_lib
from sparse_jax import data as data_lib
from sparse_jax import sharding as sharding_lib
from sparse_jax.logs import Progress
from sparse_jax.model import loss_bits, model_config


def make_eval_step(model_def, activation_sharding=None):
    """eval_step(params, batch) -> (sum of bits over the masked targets, number of targets).
    `activation_sharding`: see `SparseTransformer.from_embeddings`."""

    def eval_step(params, batch):
        logits = nnx.merge(model_def, params)(batch["inputs"],
                                              activation_sharding=activation_sharding)
        count = batch["mask"].sum()
        return loss_bits(logits, batch["targets"], batch["mask"]) * count, count

    return eval_step


def split_bits(eval_step, params, batches, batch_sharding, *, max_batches: int | None = None,
               on_batch=None) -> tuple[float, int]:
    """(sum of bits, number of scored targets) of `eval_step` over `batches` (this process's
    rows of each global batch), at most `max_batches` of them (None or <= 0: all). One batch
    stays in flight: the host prepares batch i + 1 while the devices score batch i.
    `on_batch(i)` is called when i batches are scored."""
    total, scored, pending = 0.0, 0, None
    for i, batch in enumerate(batches):
        if max_batches is not None and 0 < max_batches <= i:
            break
        out = eval_step(params, sharding_lib.to_global(batch, batch_sharding))
        if pending is not None:
            bits, n = jax.device_get(pending)
            total, scored = total + float(bits), scored + int(n)
            if on_batch is not None:
                on_batch(i)
        pending, done = out, i + 1
    if pending is not None:
        bits, n = jax.device_get(pending)
        total, scored = total + float(bits), scored + int(n)
        if on_batch is not None:
            on_batch(done)
    return total, scored


def eval_mesh(config, devices: int):
    """The training mesh's fsdp split (when it divides `devices`) with data over the rest: a
    model trained sharded is evaluated sharded."""
    fsdp = config.mesh.fsdp if devices % config.mesh.fsdp == 0 else 1
    return sharding_lib.make_mesh(-1, fsdp)


@functools.lru_cache(maxsize=8)
def _eval_step(graphdef, batch_sharding):
    """`make_eval_step` jitted once per model and mesh; it runs
    where its arguments live (parameters as restored, batches split over the mesh)."""
    return jax.jit(make_eval_step(graphdef, batch_sharding))


def result_path(workdir: str, split: str, step: int, min_context: int | None) -> str:
    name = f"{split}_{step}" + (f"_minctx{min_context}" if min_context else "")
    return os.path.join(workdir, "eval", name + ".json")


def evaluate(workdir: str, split: str = "test", checkpoint="latest",
             min_context: int | None = None, batch_size: int | None = None, *,
             progress: bool = True, write: bool = True, overwrite: bool = False) -> dict:
    """Bits per byte / dim of one checkpoint over the whole `split`; see the module docstring.

    batch_size: sequences per forward pass over all devices (default: the training batch).
    Returns the result dict (also written to `result_path(...)` if `write`; an existing result
    is replaced only with `overwrite`).
    """
    # Everything cheap is checked before restoring parameters or reading data.
    checkpoints.check_workdir(workdir)
    checkpoint = checkpoints.parse_checkpoint(checkpoint)
    if split not in data_lib.SPLITS:
        raise ValueError(f"split must be one of {data_lib.SPLITS}, got {split!r}")
    config = config_lib.read_record(workdir)
    cfg = model_config(config.model)
    batch_size = config.batch_size if batch_size is None else batch_size
    devices, processes = jax.device_count(), jax.process_count()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1 \
            or batch_size % devices:
        raise ValueError(f"batch_size must be a positive multiple of the {devices} devices, got "
                         f"{batch_size!r}")
    image = data_lib.data_config(config.data).is_image
    if min_context is not None and (image or not 0 <= min_context < cfg.seq_len):
        raise ValueError("min_context applies to byte data only" if image else
                         f"min_context must be in [0, seq_len={cfg.seq_len}), got {min_context}")

    def check_output(step):
        if write and jax.process_index() == 0:
            checkpoints.check_output(result_path(workdir, split, step, min_context), overwrite)

    check_output(checkpoints.step_of(workdir, checkpoint))
    dataset = data_lib.make_dataset(config.data, cfg.seq_len, jax.process_index(), processes,
                                    vocab_size=cfg.vocab_size)
    split_data = dataset.splits[split]
    count = dataset.check_split(split, min_context)  # ValueError if there is nothing to score
    checkpoints.check_data(workdir, config.data, dataset, record=False)  # the data trained on
    mesh = eval_mesh(config, devices)
    batch_sharding = NamedSharding(mesh, P(sharding_lib.MESH_AXES))
    model, config, step = checkpoints.restore_model(workdir, checkpoint, mesh)
    check_output(step)  # again: a damaged checkpoint may have fallen back to another step
    graphdef, params = nnx.split(model)
    eval_step = _eval_step(graphdef, batch_sharding)
    num_batches = -(-count // batch_size)
    bar = Progress(num_batches, f"{split} step {step}", progress and jax.process_index() == 0)
    start, first_done = time.time(), None  # first_done: the first batch (with compilation)

    def on_batch(done):
        nonlocal first_done
        if first_done is None and done < num_batches:
            first_done = time.time()
        bar.update(done, min(done * batch_size, count) * cfg.seq_len, "tokens")

    batches = dataset.eval_batches(split, batch_size // processes, min_context)
    total_bits, scored = split_bits(eval_step, params, batches, batch_sharding, on_batch=on_batch)
    end = time.time()

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
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(result, f, indent=1)
            os.replace(path + ".tmp", path)
        except OSError as e:
            if os.path.exists(path + ".tmp"):
                os.remove(path + ".tmp")
            raise checkpoints.write_error(path, e) from e
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
