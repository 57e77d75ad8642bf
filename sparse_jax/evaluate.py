"""Evaluation of a trained run: bits per byte (text) or per dim (images) over a whole split.

  python scripts/evaluate.py --workdir=DIR [--split=test] [--checkpoint=latest|best|STEP]
      [--min_context=N] [--batch_size=B]

`evaluate(workdir, ...)` reads the config the run trained with (`DIR/config.json`), restores only
the parameters of one checkpoint (`DIR/checkpoints/<step>/params`, see
`run.checkpoints`; the optimizer state is never read) and scores the split with one jitted
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

Bits by position: position j of a window sees j + 1 bytes (or sub-pixels) of context, so how
the bits fall with j shows how much of its context a model uses. "by_position" holds the bits
of positions 0-63, 64-127, 128-255, ..., n/2 - n-1 (with their counts, the buckets average to
"bits" exactly), "position_curve" finer buckets (4 per doubling), drawn against log position
in `<same name>.png` (`plot_by_position` draws several results on one figure). Training logs
the same buckets with every validation pass (metrics.jsonl, TensorBoard).

Bits by copy class (bytes): what a long context can buy is mostly copying, so the scored
bytes are split by how far back an exact copier finds them (`baselines.copy_classes`, k = 12:
the 12 bytes before a byte last occurred D back in the split and the byte after them then is
the same): D <= 512, 512 < D <= 4,096, and the rest (further back, or no copy). "copy_classes"
holds each class's share, count and bits; weighted by their counts they give "bits" exactly
(the same float32 partial sums, added in float64). A model that reads far back gains most on
the middle class; `copy_edges` sets other bounds.

Checkpoints are opened read-only (safe while the run is still training). The batch is split
over all devices (data parallel, and parameters split as in training when the run used
mesh.fsdp > 1); with several processes each reads its share of the windows.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax import sharding as sharding_lib
from sparse_jax.data import baselines, sources
from sparse_jax.data import datasets as data_lib
from sparse_jax.data.batches import eval_windows
from sparse_jax.files import atomic_write, write_error
from sparse_jax.logs import Progress
from sparse_jax.model.transformer import token_bits
from sparse_jax.run import checkpoints, setup
from sparse_jax.run import workdir as workdir_lib


def make_eval_step(model_def, activation_sharding=None, num_classes: int = 0):
    """eval_step(params, batch) -> (bits_N, count_N), float32 [seq_len] each: per position of
    the window, the bits of the masked targets summed over the batch, and how many there were.
    num_classes > 0: (bits_CN, count_CN), the same split by the targets' classes
    (batch["classes"], int [batch, seq_len] in [0, num_classes)); elementwise sums, no matmul,
    so a GPU's reduced-precision float32 dots cannot touch them.
    `activation_sharding`: see `SparseTransformer.from_embeddings`."""

    def eval_step(params, batch):
        logits = nnx.merge(model_def, params)(batch["inputs"],
                                              activation_sharding=activation_sharding)
        mask = batch["mask"].astype(jnp.float32)
        bits = token_bits(logits, batch["targets"]) * mask
        if not num_classes:
            return bits.sum(0), mask.sum(0)
        in_class_BCN = (batch["classes"][:, None, :]
                        == jnp.arange(num_classes)[None, :, None]).astype(jnp.float32)
        return (bits[:, None] * in_class_BCN).sum(0), (mask[:, None] * in_class_BCN).sum(0)

    return eval_step


class PositionBits(NamedTuple):
    """Bits of a split by position in the window: `bits[j]` sums the bits of every target scored
    at position j (which sees j + 1 bytes of context, or j + 1 earlier sub-pixels), `count[j]`
    counts them (float64 [seq_len] each, accumulated on the host)."""

    bits: np.ndarray
    count: np.ndarray

    @property
    def total(self) -> float:
        return float(self.bits.sum())

    @property
    def scored(self) -> int:
        return int(round(self.count.sum()))

    @property
    def mean(self) -> float:
        """Bits per scored target over the whole split."""
        return self.total / max(self.scored, 1)

    def buckets(self, edges) -> list[dict]:
        """[{"first", "last", "bits", "count"}] over positions edges[i] .. edges[i+1] - 1; the
        count-weighted mean of "bits" is `mean` (buckets with no target: bits None)."""
        out = []
        for a, b in zip(edges[:-1], edges[1:]):
            count = float(self.count[a:b].sum())
            out.append({"first": int(a), "last": int(b) - 1, "count": int(round(count)),
                        "bits": float(self.bits[a:b].sum()) / count if count else None})
        return out


def position_edges(seq_len: int, per_octave: int = 1) -> list[int]:
    """Bucket edges over positions 0 .. seq_len - 1. per_octave=1: 0, 64, 128, 256, ...,
    seq_len (the first bucket is 0 - 63, or the first half of a window of at most 128);
    per_octave=k: edges at round(2^(i/k)), k per doubling of the context, for plots."""
    if per_octave == 1:
        first = 64 if seq_len > 128 else max(1, seq_len // 2)
        inner = [first << i for i in range(seq_len.bit_length()) if first << i < seq_len]
    else:
        top = math.log2(seq_len) * per_octave
        inner = [round(2 ** (i / per_octave)) for i in range(int(top) + 1)]
    return sorted({0, seq_len, *(e for e in inner if 0 < e < seq_len)})


def split_bits(eval_step, params, batches, batch_sharding, *, max_batches: int | None = None,
               on_batch=None) -> PositionBits:
    """The bits of `eval_step` over `batches` (this process's rows of each global batch), at
    most `max_batches` of them (None or <= 0: all), by position (`PositionBits`; `.mean` is the
    split's bits per byte or dim). One batch stays in flight: the host prepares batch i + 1
    while the devices score batch i. `on_batch(i)` is called when i batches are scored."""
    bits = count = 0.0
    pending, done = None, 0
    for i, batch in enumerate(batches):
        if max_batches is not None and 0 < max_batches <= i:
            break
        out = eval_step(params, sharding_lib.to_global(batch, batch_sharding))
        if pending is not None:
            b, n = jax.device_get(pending)
            bits, count = bits + np.asarray(b, np.float64), count + np.asarray(n, np.float64)
            if on_batch is not None:
                on_batch(i)
        pending, done = out, i + 1
    if pending is not None:
        b, n = jax.device_get(pending)
        bits, count = bits + np.asarray(b, np.float64), count + np.asarray(n, np.float64)
        if on_batch is not None:
            on_batch(done)
    return PositionBits(np.asarray(bits, np.float64), np.asarray(count, np.float64))


def eval_mesh(config, devices: int):
    """The training mesh's fsdp and seq splits (each where it divides `devices`) with data over
    the rest: a model trained sharded is evaluated sharded, and one whose sequences were split
    over devices (mesh.seq) is read with them split the same way."""
    fsdp = config.mesh.fsdp if devices % config.mesh.fsdp == 0 else 1
    seq = config.mesh.get("seq", 1)
    seq = seq if devices % (fsdp * seq) == 0 else 1
    return sharding_lib.make_mesh(-1, fsdp, seq)


@functools.lru_cache(maxsize=8)
def _eval_step(graphdef, batch_sharding, num_classes=0):
    """`make_eval_step` jitted once per model, mesh and number of byte classes; it runs
    where its arguments live (parameters as restored, batches split over the mesh)."""
    return jax.jit(make_eval_step(graphdef, batch_sharding, num_classes))


COPY_EDGES = (512, 4096)  # the byte classes' default bounds: bytes copyable from <= 512 back, ...
COPY_K = 12  # bytes of context that must repeat for a byte to count as copyable


def with_classes(batches, data_T: np.ndarray, classes_T: np.ndarray, seq_len: int,
                 min_context: int | None, batch_size: int, process_index: int = 0,
                 process_count: int = 1):
    """Adds batch["classes"] (int32 [batch, seq_len]: the class of each target, split byte
    starts[w] + 1 + j) to the byte batches of `Dataset.eval_batches(split, batch_size,
    min_context)` over the split `data_T`. It recomputes their rows (global batches of
    batch_size x process_count, this process's block of them, padding rows reading window 0)
    and checks each batch's first inputs against the split, so the two cannot drift apart."""
    starts_W = eval_windows(data_T, seq_len, min_context).starts
    count, j = len(starts_W), np.arange(seq_len)
    padded_T = np.concatenate([classes_T, np.zeros(seq_len + 1, classes_T.dtype)])
    for first, batch in zip(range(0, count, batch_size * process_count), batches):
        rows = first + process_index * batch_size + np.arange(batch_size)
        starts = starts_W[np.where(rows < count, rows, 0)]
        if not np.array_equal(batch["inputs"][:, 0], data_T[starts]):
            raise AssertionError(f"evaluation batch at row {first} does not read the windows "
                                 "with_classes expects (data.eval_batches changed?)")
        batch["classes"] = padded_T[starts[:, None] + 1 + j].astype(np.int32)
        yield batch


def class_results(bits_C: np.ndarray, count_C: np.ndarray, edges, k: int) -> dict:
    """The JSON of the byte classes: what they are and each one's count, share and bits."""
    total = count_C.sum()
    names = baselines.copy_class_names(edges)
    return {"k": k, "edges": list(edges), "classes": [
        {"name": name, "count": int(round(n)), "share": float(n / total) if total else 0.0,
         "bits": float(b / n) if n else None} for name, b, n in zip(names, bits_C, count_C)]}


CURVE_PER_OCTAVE = 4  # buckets per doubling of the context in "position_curve" (plots)


def result_path(workdir: str, split: str, step: int, min_context: int | None,
                data_path: str | None = None) -> str:
    """WORKDIR/eval/<split>_<step>[_minctx<M>].json; a result on another file (`data_path`) goes
    to WORKDIR/eval/<that file's name>/, beside nothing of the run's own."""
    name = f"{split}_{step}" + (f"_minctx{min_context}" if min_context else "")
    folder = os.path.join(workdir, "eval", *([os.path.basename(data_path)] if data_path else []))
    return os.path.join(folder, name + ".json")


def check_arguments(workdir: str, split: str = "test", checkpoint="latest",
                    min_context: int | None = None, batch_size: int | None = None, *,
                    copy_edges=COPY_EDGES, attention: str | None = None, write: bool = True,
                    overwrite: bool = False, data_path: str | None = None) -> dict:
    """`evaluate`'s checks of its arguments, everything cheap, before restoring parameters or
    reading data (scripts/evaluate.py runs them before any work): the workdir and its record,
    the checkpoint, the batch split, --data, the copy classes, min_context and the result's
    path. Returns {"config" (with --data in it), "model", "mesh", "checkpoint", "batch_size",
    "copy_edges"}."""
    workdir_lib.check_workdir(workdir)
    checkpoint = checkpoints.parse_checkpoint(checkpoint)
    if split not in data_lib.SPLITS:
        raise ValueError(f"split must be one of {data_lib.SPLITS}, got {split!r}")
    config, cfg = setup.recorded(workdir, attention)
    batch_size = config.batch_size if batch_size is None else batch_size
    devices = jax.device_count()
    mesh = eval_mesh(config, devices)
    sequences = devices // sharding_lib.seq_size(mesh)  # devices a batch's sequences split over
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1 \
            or batch_size % sequences:
        split = "" if sequences == devices else f" (mesh.seq={sharding_lib.seq_size(mesh)} " \
            "splits each sequence's positions)"
        raise ValueError(f"batch_size must be a positive multiple of the {sequences} devices"
                         f"{split}, got {batch_size!r}")
    image = data_lib.data_config(config.data).is_image
    if data_path is not None:  # scripts/evaluate.py --data: the errors name that flag
        if image or cfg.vocab_size != 256:
            raise ValueError(f"--data={data_path}: only a model of bytes reads another file; "
                             f"this run models {config.data.name}")
        sources.require_file(data_path, "--data")  # a file (not a folder) that can be read
        config.data.name, config.data.path = "bytes", os.path.abspath(data_path)
    copy_edges = () if image or not copy_edges else tuple(copy_edges)
    if copy_edges and any(not isinstance(e, int) or isinstance(e, bool) for e in copy_edges) \
            or any(b <= a for a, b in zip((0, *copy_edges), copy_edges)):
        raise ValueError(f"copy_edges must be positive increasing byte distances, got "
                         f"{copy_edges}")
    if min_context is not None and (image or not 0 <= min_context < cfg.seq_len):
        raise ValueError("min_context applies to byte data only" if image else
                         f"min_context must be in [0, seq_len={cfg.seq_len}), got {min_context}")
    if write and jax.process_index() == 0:
        step = checkpoints.step_of(workdir, checkpoint)
        workdir_lib.check_output(result_path(workdir, split, step, min_context, data_path),
                                 overwrite, create=False)  # a refused run leaves no folder
    return {"config": config, "model": cfg, "mesh": mesh, "checkpoint": checkpoint,
            "batch_size": batch_size, "copy_edges": copy_edges}


def evaluate(workdir: str, split: str = "test", checkpoint="latest",
             min_context: int | None = None, batch_size: int | None = None, *,
             copy_edges=COPY_EDGES, attention: str | None = None, progress: bool = True,
             write: bool = True, overwrite: bool = False, data_path: str | None = None) -> dict:
    """Bits per byte / dim of one checkpoint over the whole `split`; see the module docstring.

    batch_size: sequences per forward pass over all devices (default: the training batch).
    attention: the attention implementation to read the run with (default: the recorded one,
    or as `config_lib.for_this_machine` chooses where that cannot run here).
    copy_edges: bytes only, the bounds of the byte classes by copy distance
    (`baselines.copy_classes`, k = COPY_K); () or None: no classes.
    data_path: score a byte model on another file instead of the data it trained on (any file;
    a .gz is decompressed), cut into splits as training cuts its own (`split` picks the part):
    how a model trained on one corpus reads another. The run's data record is not checked.
    Returns the result dict (also written to `result_path(...)` if `write`; an existing result
    is replaced only with `overwrite`).
    """
    checked = check_arguments(workdir, split, checkpoint, min_context, batch_size,
                              copy_edges=copy_edges, attention=attention, write=write,
                              overwrite=overwrite, data_path=data_path)
    config, cfg, mesh = checked["config"], checked["model"], checked["mesh"]
    checkpoint, batch_size, copy_edges = (checked[k] for k in ("checkpoint", "batch_size",
                                                               "copy_edges"))
    data_name, devices, processes = config.data.name, jax.device_count(), jax.process_count()

    def check_output(step):
        if write and jax.process_index() == 0:
            workdir_lib.check_output(result_path(workdir, split, step, min_context, data_path),
                                     overwrite, create=False)  # a refused run leaves no folder

    dataset = data_lib.make_dataset(config.data, cfg.seq_len, jax.process_index(), processes,
                                    vocab_size=cfg.vocab_size, image_shape=cfg.image_shape,
                                    training=False, path_flag="--data")
    split_data = dataset.splits[split]
    others = dataset.scorable(split)  # the run's split_fractions are fixed: what can change
    also = f"score another part: {' or '.join(others)}" if others else ""
    count = dataset.check_split(split, min_context, (  # ValueError if there is nothing to score
        f"give --data a longer file{', or ' + also if also else ''}" if data_path is not None
        else also or None))
    if data_path is None:
        workdir_lib.check_data(workdir, config.data, dataset, record=False)  # the data trained on
    batch_sharding = sharding_lib.batch_sharding(mesh)
    model, config, step = checkpoints.restore_model(workdir, checkpoint, mesh, cfg.attention)
    check_output(step)  # again: a damaged checkpoint may have fallen back to another step
    graphdef, params = nnx.split(model)
    num_classes = len(copy_edges) + 1 if copy_edges else 0
    eval_step = _eval_step(graphdef, batch_sharding, num_classes)
    num_batches = -(-count // batch_size)
    bar = Progress(num_batches, f"{split} step {step}", progress and jax.process_index() == 0)
    start, first_done = time.time(), None  # first_done: the first batch (with compilation)

    def on_batch(done):
        nonlocal first_done
        if first_done is None and done < num_batches:
            first_done = time.time()
        bar.update(done, min(done * batch_size, count) * cfg.seq_len, "tokens")

    batches = dataset.eval_batches(split, batch_size // processes, min_context)
    if num_classes:  # the class of every byte of the split, then of every target of a batch
        classes_T = baselines.copy_classes(split_data, copy_edges, COPY_K)
        batches = with_classes(batches, split_data, classes_T, cfg.seq_len, min_context,
                               batch_size // processes, jax.process_index(), processes)
    scores = split_bits(eval_step, params, batches, batch_sharding, on_batch=on_batch)
    by_position = scores
    if num_classes:  # float64 sums of the same float32 partials, by position and by class
        by_position = PositionBits(scores.bits.sum(0), scores.count.sum(0))
    scored, end = by_position.scored, time.time()

    # Throughput of the windows actually computed (padding rows excluded), after compilation.
    timed_batches = num_batches - 1 if first_done is not None else num_batches
    timed_s = end - first_done if first_done is not None else end - start
    timed_rows = count - batch_size if first_done is not None else count
    result = {
        "split": split, "step": int(step), "bits": by_position.mean,
        "unit": dataset.unit, "num_scored": scored, "min_context": min_context,
        "dataset": data_name, "split_size": len(split_data),
        "data_path": None if data_path is None else os.path.abspath(data_path),
        "num_sequences": count, "seq_len": cfg.seq_len, "batch_size": batch_size,
        "num_batches": num_batches, "tokens_per_s": timed_rows * cfg.seq_len / timed_s,
        "scored_per_s": scored / (end - start), "timed_batches": timed_batches,
        "wall_s": end - start, "workdir": os.path.abspath(workdir),
        "devices": devices, "backend": jax.default_backend(),
        # Bits by position in the window (position j: j + 1 bytes or sub-pixels of context),
        # in doubling buckets and in finer ones for plots; count-weighted, they average to bits.
        "by_position": by_position.buckets(position_edges(cfg.seq_len)),
        "position_curve": by_position.buckets(position_edges(cfg.seq_len, CURVE_PER_OCTAVE)),
    }
    if num_classes:  # bits of the bytes a copier finds <= 512, 513-4,096, ... back, and the rest
        result["copy_classes"] = class_results(scores.bits.sum(1), scores.count.sum(1),
                                               copy_edges, COPY_K)
    if write and jax.process_index() == 0:
        path = result_path(workdir, split, step, min_context, data_path)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            plot_by_position([result], path[:-len(".json")] + ".png")  # the JSON last: whole
            with atomic_write(path) as f:                               # results or none
                json.dump(result, f, indent=1)
        except OSError as e:
            raise write_error(path, e, "free some space or choose another output") from e
        result["path"] = path
    return result


def plot_by_position(results: list[dict], path: str, labels=None, title: str = "") -> None:
    """Bits against position in the window (log x), one line per evaluation result (their
    "position_curve"), written as a PNG to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for i, result in enumerate(results):
        points = [b for b in result["position_curve"] if b["count"]]
        x = [math.sqrt((b["first"] + 1) * (b["last"] + 1)) for b in points]  # bytes of context
        label = labels[i] if labels else f"{os.path.basename(result['workdir'])} step " \
                                         f"{result['step']}: {result['bits']:.3f}"
        ax.plot(x, [b["bits"] for b in points], marker="o", markersize=2.5, label=label)
    unit = results[0]["unit"]
    ax.set_xscale("log")
    ax.set_xlabel(f"position in the window + 1 ({unit}s of context)")
    ax.set_ylabel(f"{results[0]['split']} bits/{unit}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format="png", dpi=90)
    plt.close(fig)


def format_positions(result: dict) -> str:
    """Markdown table of bits by position bucket (`result["by_position"]`)."""
    unit = result["unit"]
    rows = ["| positions | scored | bits/" + unit + " |", "|---|---|---|"]
    rows += [f"| {b['first']}–{b['last']} | {b['count']:,} | "
             + ("—" if b["bits"] is None else f"{b['bits']:.4f}") + " |"
             for b in result["by_position"]]
    return "\n".join(rows)


def format_classes(result: dict) -> str:
    """Markdown table of the bits by copy class (`result["copy_classes"]`; "" if none)."""
    if not result.get("copy_classes"):
        return ""
    rows = ["| bytes | share | scored | bits/byte |", "|---|---|---|---|"]
    rows += [f"| {c['name']} | {c['share']:.1%} | {c['count']:,} | "
             + ("—" if c["bits"] is None else f"{c['bits']:.4f}") + " |"
             for c in result["copy_classes"]["classes"]]
    return "\n".join(rows)


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
