"""Training: AdamW with warmup + cosine decay, data-parallel over a device mesh, validation,
Orbax checkpoints with exact resume, and logs a person and TensorBoard can read.

`train(config, workdir)` runs (or resumes) the run that `config` describes in `workdir`:

  workdir/config.json        the config it ran with (`load_config` reads it back)
  workdir/checkpoints/<step> Orbax: `params` and `opt` (StandardSave), `meta` (JsonSave: step,
                             data iterator position, RNG key, partial log window)
  workdir/metrics.jsonl      one JSON object per logged step: step, split (train | valid), time
                             (Unix seconds when written), bits, ...
  workdir/tensorboard/       TensorBoard events (train/valid bits, lr, gradient norm, tokens/s)

A workdir that holds checkpoints is resumed from its latest one and continues exactly as the
uninterrupted run would have (same batches, same dropout, same losses); a checkpoint of another
model or dataset is refused. SIGTERM / SIGINT save a checkpoint and stop; a NaN/Inf loss stops
the run with an error and keeps the last good checkpoint. The last k checkpoints are kept, plus
the best by validation bits (`CheckpointManager.best_step()`).

The training step is one jitted function of (state, batch, rng): the state (parameters and
optimizer state) is donated and sharded by `sparse_jax.sharding` (replicated over "data", split
over "fsdp"; it is created by a jitted init with those output shardings, so a model is never
whole on one device), the batch is split over all devices of the ("data", "fsdp") mesh, the dropout key is `fold_in(rng, step)`. Metrics of step n-1 are fetched
after step n is dispatched, so the host never waits on the device inside the loop.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sparse_jax import data as data_lib
from sparse_jax import sharding as sharding_lib
from sparse_jax.model import ModelConfig, SparseTransformer, loss_bits, model_config

# Data fields that only say where the data lives; they may change when a run is resumed.
LOCATION_FIELDS = ("download", "data_dir", "manual_dir")
BATCH_AXES = sharding_lib.MESH_AXES  # a batch is split over every device


class _DropTrackedMetricWarning(logging.Filter):
    """Orbax warns at every checkpoint saved without validation metrics; those are expected."""

    def filter(self, record):
        return "tracked_metric" not in record.getMessage()


logging.getLogger("absl").addFilter(_DropTrackedMetricWarning())


# ---------------------------------------------------------------------------------------------
# Config, optimizer, mesh.


def check_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """Validates the fields the trainer reads (ValueError) and returns the ModelConfig."""
    cfg = model_config(config.model)  # ValueError for an invalid model or pattern
    opt = config.optimizer
    positive = {"total_steps": config.total_steps, "batch_size": config.batch_size,
                "log_every": config.log_every, "eval_every": config.eval_every,
                "checkpoint_every": config.checkpoint_every,
                "keep_checkpoints": config.keep_checkpoints,
                "optimizer.grad_accum": opt.grad_accum}
    for name, value in positive.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be a positive integer, got {value!r}")
    if not opt.lr > 0 or not 0 <= opt.min_lr_ratio <= 1 or opt.weight_decay < 0:
        raise ValueError("need optimizer.lr > 0, 0 <= min_lr_ratio <= 1, weight_decay >= 0")
    if not 0 <= opt.warmup_steps < config.total_steps:
        raise ValueError(f"optimizer.warmup_steps={opt.warmup_steps} must be in [0, "
                         f"total_steps={config.total_steps})")
    if config.batch_size % opt.grad_accum:
        raise ValueError(f"batch_size={config.batch_size} is not divisible by optimizer."
                         f"grad_accum={opt.grad_accum}")
    if config.batch_size % jax.process_count():
        raise ValueError(f"batch_size={config.batch_size} is not divisible by the "
                         f"{jax.process_count()} processes")
    if config.data.name in ("enwik8", "bytes") and not config.data.path:
        raise ValueError(f"data {config.data.name!r} needs a file: set --config.data.path=FILE")
    return cfg


def make_mesh(config: ml_collections.ConfigDict) -> Mesh:
    """The ("data", "fsdp") mesh of config.mesh over all devices (see `sparse_jax.sharding`)."""
    mesh = sharding_lib.make_mesh(config.mesh.data, config.mesh.fsdp)
    micro = config.batch_size // config.optimizer.grad_accum
    if micro % mesh.size:
        hint = (f"; choose a batch_size divisible by {mesh.size} or fewer CPU devices "
                "(--cpu_devices=1)" if jax.default_backend() == "cpu" else "")
        raise ValueError(f"the micro-batch of {micro} sequences (batch_size / grad_accum) does "
                         f"not split evenly over {mesh.size} devices{hint}")
    return mesh


def make_optimizer(config: ml_collections.ConfigDict):
    """(optax transform, learning-rate schedule): clip, then AdamW with warmup + cosine decay."""
    opt = config.optimizer
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, opt.lr, opt.warmup_steps, config.total_steps, end_value=opt.lr * opt.min_lr_ratio)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                        mask=decay_mask)
    if opt.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(opt.grad_clip), adamw), schedule
    return adamw, schedule


def load_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a run in `workdir` ran with (lists become tuples, as in the config files)."""
    with open(os.path.join(workdir, "config.json")) as f:
        raw = json.load(f)
    tuples = lambda d: {k: tuples(v) if isinstance(v, dict) else  # noqa: E731
                        tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return ml_collections.ConfigDict(tuples(raw))


def _config_dict(config) -> dict:
    return json.loads(config.to_json())


def config_differences(saved: dict, config: dict) -> list[str]:
    """Model and data fields (except locations) where two configs differ, as readable lines."""
    lines = []
    for section in ("model", "data"):
        old, new = saved.get(section, {}), config.get(section, {})
        for key in sorted(set(old) | set(new)):
            if section == "data" and key in LOCATION_FIELDS:
                continue
            if old.get(key, "<absent>") != new.get(key, "<absent>"):
                lines.append(f"{section}.{key}: {old.get(key, '<absent>')!r} in the checkpoint, "
                             f"{new.get(key, '<absent>')!r} now")
    return lines


# ---------------------------------------------------------------------------------------------
# Steps.


def make_train_step(model_def, opt_def, config, schedule, activation_sharding=None):
    """train_step(state, batch, rng) -> (state, metrics); state = {"params", "opt"}.
    `activation_sharding`: see `SparseTransformer.from_embeddings`."""
    accum = config.optimizer.grad_accum

    def loss_fn(params, inputs, targets, key):
        model = nnx.merge(model_def, params)
        logits = model(inputs, dropout_rng=key, activation_sharding=activation_sharding)
        return loss_bits(logits, targets)

    def train_step(state, batch, rng):
        optimizer = nnx.merge(opt_def, state["opt"])
        step = optimizer.step[...]
        key = jax.random.fold_in(rng, step)
        grad_fn = jax.value_and_grad(loss_fn)
        if accum == 1:
            loss, grads = grad_fn(state["params"], batch["inputs"], batch["targets"], key)
        else:  # micro-batch j = rows j, j + accum, ...: every micro-batch spans all devices
            split = lambda x: x.reshape(-1, accum, *x.shape[1:]).swapaxes(0, 1)  # noqa: E731

            def micro(carry, xs):
                inputs, targets, j = xs
                loss, grads = grad_fn(state["params"], inputs, targets,
                                      jax.random.fold_in(key, j))
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros((), jnp.float32), state["params"]))
            xs = (split(batch["inputs"]), split(batch["targets"]), jnp.arange(accum))
            total, _ = jax.lax.scan(micro, zeros, xs)
            loss, grads = jax.tree.map(lambda x: x / accum, total)
        model = nnx.merge(model_def, state["params"])
        optimizer.update(model, grads)
        metrics = {"bits": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(step)}
        return {"params": nnx.state(model), "opt": nnx.state(optimizer)}, metrics

    return train_step


def make_eval_step(model_def, activation_sharding=None):
    """eval_step(params, batch) -> (sum of bits over the masked targets, number of targets)."""

    def eval_step(params, batch):
        logits = nnx.merge(model_def, params)(batch["inputs"],
                                              activation_sharding=activation_sharding)
        count = batch["mask"].sum()
        return loss_bits(logits, batch["targets"], batch["mask"]) * count, count

    return eval_step


class Jitted(NamedTuple):
    """The jitted functions of a run on a mesh and the shardings they use."""

    init: Any  # () -> state, created sharded (never whole on one device)
    train_step: Any  # (state, batch, rng) -> (state, metrics); the state is donated
    eval_step: Any  # (params, batch) -> (sum of bits, count)
    abstract_state: Any  # ShapeDtypeStructs (with shardings) of the state
    state_sharding: Any  # NamedSharding per array of the state
    batch_sharding: NamedSharding  # a batch split over all devices


def _state_builders(config, cfg: ModelConfig):
    """(create, init, schedule): create() -> (model, optimizer); init() -> the state
    {"params", "opt"} of nnx States; the learning-rate schedule."""
    tx, schedule = make_optimizer(config)

    def create():
        model = SparseTransformer(cfg, rngs=nnx.Rngs(config.seed))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    def init():
        model, optimizer = create()
        return {"params": nnx.state(model), "opt": nnx.state(optimizer)}

    return create, init, schedule


def abstract_train_state(config):
    """Shapes and dtypes ({"params", "opt"} of ShapeDtypeStructs) of the training state of
    `config`, without allocating it."""
    return jax.eval_shape(_state_builders(config, model_config(config.model))[1])


def per_device_memory(config, devices: int) -> dict:
    """What each device stores of the training state on config.mesh over `devices` devices:
    {"mesh", "params_bytes", "optimizer_bytes"}. From shapes and the sharding rules only (no
    device or allocation needed, so it can size a run for a machine you do not have)."""
    shape = sharding_lib.mesh_shape(devices, config.mesh.data, config.mesh.fsdp)
    state = abstract_train_state(config)
    return {"mesh": shape, "params_bytes": sharding_lib.per_device_bytes(state["params"], shape),
            "optimizer_bytes": sharding_lib.per_device_bytes(state["opt"], shape)}


def make_jitted(config, cfg: ModelConfig, mesh: Mesh) -> Jitted:
    """Builds the state layout (shapes only, under eval_shape) and jits init, train and eval
    steps with in/out shardings: parameters and optimizer state by `sparse_jax.sharding`'s
    rules (split over "fsdp", replicated over "data"), batches split over all devices."""
    create, init, schedule = _state_builders(config, cfg)
    model_def, opt_def = (nnx.graphdef(x) for x in nnx.eval_shape(create))
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P(BATCH_AXES))
    abstract = jax.eval_shape(init)
    state_sharding = sharding_lib.state_shardings(abstract, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, state_sharding)
    train_step = jax.jit(make_train_step(model_def, opt_def, config, schedule, batch_sharding),
                         in_shardings=(state_sharding, batch_sharding, replicated),
                         out_shardings=(state_sharding, replicated), donate_argnums=0)
    eval_step = jax.jit(make_eval_step(model_def, batch_sharding),
                        in_shardings=(state_sharding["params"], batch_sharding))
    return Jitted(jax.jit(init, out_shardings=state_sharding), train_step, eval_step, abstract,
                  state_sharding, batch_sharding)


# ---------------------------------------------------------------------------------------------
# Logging.


class Logger:
    """Console lines, a progress bar (on a terminal), metrics.jsonl and TensorBoard; the host
    with process index 0 writes, the others stay silent."""

    def __init__(self, workdir: str, start_step: int, total_steps: int):
        self.active = jax.process_index() == 0
        self.total, self.bar_time = total_steps, 0.0
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
        if not self.active:
            return
        with open(self.path, "a") as f:
            row = {"step": step, "split": split, "time": round(time.time(), 3), **metrics}
            f.write(json.dumps(row) + "\n")
        for name, value in metrics.items():
            self.tb.add_scalar(f"{split}/{name}", value, step)
        self.tb.flush()

    def progress(self, step: int, steps_per_s: float, tokens_per_s: float) -> None:
        now = time.time()
        if not self.bar or now - self.bar_time < 0.2:
            return
        self.bar_time, done = now, step / self.total
        eta = (self.total - step) / steps_per_s if steps_per_s > 0 else float("nan")
        sys.stderr.write(f"\r[{'#' * int(30 * done):<30}] {step}/{self.total} "
                         f"{steps_per_s:.2f} steps/s {tokens_per_s:,.0f} tok/s "
                         f"ETA {_duration(eta)}\033[K")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar:
            sys.stderr.write("\n")
        if self.tb is not None:
            self.tb.close()


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    h, rest = divmod(int(seconds), 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


# ---------------------------------------------------------------------------------------------
# Workdir and checkpoints.


def prepare_workdir(workdir: str, config) -> bool:
    """Creates `workdir` and checks that it is writable and holds no checkpoint of another
    model or dataset; returns whether it holds checkpoints (the run resumes)."""
    try:
        os.makedirs(workdir, exist_ok=True)
        probe = os.path.join(workdir, f".write_test.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise OSError(e.errno, f"cannot write to the workdir {workdir}: "
                               f"{e.strerror or e}") from e
    ckpt_dir = os.path.join(workdir, "checkpoints")
    has_checkpoints = os.path.isdir(ckpt_dir) and any(
        name.isdigit() for name in os.listdir(ckpt_dir))
    if has_checkpoints:
        config_path = os.path.join(workdir, "config.json")
        if not os.path.exists(config_path):
            raise ValueError(f"{workdir} holds checkpoints but no config.json, so they cannot be "
                             "checked against this config; use another --workdir")
        with open(config_path) as f:
            differences = config_differences(json.load(f), _config_dict(config))
        if differences:
            raise ValueError(f"{workdir} holds checkpoints of a different model or dataset; "
                             "refusing to touch them. Use another --workdir or the saved config "
                             f"({config_path}). Differences:\n  " + "\n  ".join(differences))
    return has_checkpoints


def make_checkpoint_manager(workdir: str, keep: int) -> ocp.CheckpointManager:
    """Keeps the `keep` latest checkpoints and the one with the lowest validation bits."""
    policies = ocp.checkpoint_managers
    best = lambda metrics: metrics["valid_bits"]  # noqa: E731
    options = ocp.CheckpointManagerOptions(
        best_fn=best, best_mode="min", cleanup_tmp_directories=True, create=True,
        preservation_policy=policies.AnyPreservationPolicy([
            policies.LatestN(keep),
            policies.BestN(get_metric_fn=best, reverse=True, n=1,
                           keep_checkpoints_without_metrics=False)]))
    # Orbax needs an absolute path; users pass relative workdirs.
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=options)


def _checkpoint_error(manager, step, error) -> OSError:
    manager.reload()
    return OSError(errno.EIO, f"could not write the checkpoint of step {step} to "
                              f"{manager.directory} (disk full or not writable?): "
                              f"{type(error).__name__}: {error}. Earlier checkpoints are intact: "
                              f"steps {manager.all_steps()}")


def wait_for_checkpoint(manager: ocp.CheckpointManager, step: int | None) -> None:
    """Waits for a pending asynchronous save; a failed one becomes a clear OSError."""
    try:
        manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001  (Orbax surfaces write errors in several types)
        raise _checkpoint_error(manager, step, e) from e


def save_checkpoint(manager, step: int, state, meta: dict, valid_bits: float | None) -> None:
    """Starts an asynchronous save of `state` and `meta` at `step` (after the previous one)."""
    wait_for_checkpoint(manager, manager.latest_step())
    args = ocp.args.Composite(params=ocp.args.StandardSave(nnx.to_pure_dict(state["params"])),
                              opt=ocp.args.StandardSave(nnx.to_pure_dict(state["opt"])),
                              meta=ocp.args.JsonSave(meta))
    try:
        manager.save(step, args=args,
                     metrics=None if valid_bits is None else {"valid_bits": valid_bits})
    except Exception as e:  # noqa: BLE001
        raise _checkpoint_error(manager, step, e) from e


def restore_checkpoint(manager, step: int, abstract_state):
    """(state, meta) of checkpoint `step`; arrays land with the shardings of `abstract_state`."""
    pure = {k: nnx.to_pure_dict(v) for k, v in abstract_state.items()}
    restored = manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(pure["params"]), opt=ocp.args.StandardRestore(pure["opt"]),
        meta=ocp.args.JsonRestore()))
    state = jax.tree.map(lambda x: x, abstract_state)  # a copy to fill in
    for key in ("params", "opt"):
        nnx.replace_by_pure_dict(state[key], restored[key])
    return state, restored["meta"]


# ---------------------------------------------------------------------------------------------
# The loop.


class _Signals:
    """Records SIGTERM / SIGINT so the loop can checkpoint and stop; a second one aborts."""

    def __init__(self):
        self.received, self.previous = None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is not None:  # second signal: stop now
            signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _to_global(batch: dict, sharding) -> dict:
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}


def evaluate(eval_step, params, dataset, split: str, config, sharding) -> float:
    """Bits per byte / dim on `split`, over at most config.eval_batches global batches."""
    total, count = 0.0, 0
    per_process = config.batch_size // jax.process_count()
    for i, batch in enumerate(dataset.eval_batches(split, per_process)):
        if 0 < config.eval_batches <= i:
            break
        s, n = eval_step(params, _to_global(batch, sharding))
        total, count = total + s, count + n  # on device: no sync per batch ...
        if i % 8 == 7:  # ... but a bounded queue (many queued all-reduces can stall on CPU)
            jax.block_until_ready(total)
    total, count = jax.device_get((total, count))
    return float(total) / max(float(count), 1.0)


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains (or resumes) the run of `config` in `workdir`; returns the final metrics."""
    cfg = check_config(config)
    mesh = make_mesh(config)
    resuming = prepare_workdir(workdir, config)
    if config.data.name == "cifar10":  # prepares TFDS cifar10 once (fails fast if missing)
        data_lib.prepare_cifar10(config.data.data_dir, config.data.manual_dir,
                                 config.data.download)
    dataset = data_lib.make_dataset(config.data, cfg.seq_len, jax.process_index(),
                                    jax.process_count())  # before any compile
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json(indent=2))

    jitted = make_jitted(config, cfg, mesh)
    abstract, batch_sharding = jitted.abstract_state, jitted.batch_sharding
    train_step, eval_step = jitted.train_step, jitted.eval_step
    replicated = NamedSharding(mesh, P())

    manager = make_checkpoint_manager(workdir, config.keep_checkpoints)
    window = {"bits": 0.0, "grad_norm": 0.0, "count": 0}  # train metrics since the last log
    if resuming:
        step = manager.latest_step()
        state, meta = restore_checkpoint(manager, step, abstract)
        key_data = np.asarray(meta["rng"], np.uint32)
        iterator = dataset.train_batches(config.batch_size // jax.process_count(), meta["data"])
        window, best = meta["window"], meta["best_valid_bits"]
    else:
        step, best = 0, None
        state = jitted.init()
        key_data = np.asarray(jax.random.key_data(jax.random.key(config.seed)))
        iterator = dataset.train_batches(config.batch_size // jax.process_count())
    # On every device of every process (a device_put cannot reach other processes' devices).
    rng = jax.random.wrap_key_data(jax.make_array_from_process_local_data(replicated, key_data))

    log = Logger(workdir, step, config.total_steps)
    params = sum(x.size for x in jax.tree.leaves(abstract["params"]))
    log.print(f"{'Resuming from step ' + str(step) if resuming else 'Starting'} in {workdir}: "
              f"{config.data.name} ({dataset.unit}s), {params / 1e6:.2f}M parameters, "
              f"{cfg.num_layers} layers, pattern {cfg.base_spec}, mesh {dict(mesh.shape)} "
              f"({sharding_lib.per_device_bytes(abstract, dict(mesh.shape)) / 2**20:,.1f} MiB "
              f"of parameters and optimizer state per device), "
              f"batch {config.batch_size} x {cfg.seq_len}")
    tokens_per_step = config.batch_size * cfg.seq_len
    result = {"step": step, "valid_bits": None, "best_valid_bits": best, "interrupted": None}
    pending = None  # (step, metrics) of the last dispatched step, not yet fetched
    clock = {"time": time.time(), "steps": 0}  # throughput since the last log
    since = None  # (time, step) from which the progress bar averages

    def fetch(item):  # host-side checks of one step's metrics
        s, metrics = item
        metrics = jax.device_get(metrics)
        if not (math.isfinite(metrics["bits"]) and math.isfinite(metrics["grad_norm"])):
            wait_for_checkpoint(manager, manager.latest_step())
            raise FloatingPointError(
                f"non-finite training loss {metrics['bits']} (gradient norm "
                f"{metrics['grad_norm']}) at step {s}; stopping. The last good checkpoint is step "
                f"{manager.latest_step()} in {manager.directory}; lower optimizer.lr or raise "
                "warmup_steps, and resume or restart.")
        window["bits"] += float(metrics["bits"])
        window["grad_norm"] += float(metrics["grad_norm"])
        window["count"] += 1
        return float(metrics["lr"])

    def save(valid_bits=None):
        meta = {"step": step, "data": iterator.get_state(),
                "rng": np.asarray(jax.random.key_data(rng)).tolist(), "window": window,
                "best_valid_bits": best}
        save_checkpoint(manager, step, state, meta, valid_bits)

    first_step = step
    try:
        with _Signals() as signals:
            while step < config.total_steps and not signals.received:
                batch = _to_global(next(iterator), batch_sharding)
                state, metrics = train_step(state, batch, rng)
                if pending is not None:
                    fetch(pending)  # step n - 1, while step n runs
                step, pending = step + 1, (step + 1, metrics)
                clock["steps"] += 1
                now = time.time()
                speed = clock["steps"] / max(now - clock["time"], 1e-9)
                if since is None:  # the progress bar's average starts after the compiling step
                    since = (now, step)
                elif step > since[1] + 1:
                    average = (step - since[1]) / (now - since[0])
                    log.progress(step, average, average * tokens_per_step)
                last = step == config.total_steps
                do_eval = step % config.eval_every == 0 or last
                do_log = step % config.log_every == 0 or last
                do_save = do_eval or step % config.checkpoint_every == 0 or signals.received
                if not (do_log or do_save):
                    continue
                lr = fetch(pending)  # never checkpoint a step whose loss was not checked
                pending = None
                if do_log:
                    n = window["count"]
                    row = {"bits": window["bits"] / n, "grad_norm": window["grad_norm"] / n,
                           "lr": lr, "steps_per_s": speed, "tokens_per_s": speed * tokens_per_step}
                    log.write(step, "train", row)
                    log.print(f"step {step}/{config.total_steps}  train {row['bits']:.4f} bits  "
                              f"lr {lr:.2e}  grad norm {row['grad_norm']:.3f}  {speed:.2f} steps/s"
                              f"  {speed * tokens_per_step:,.0f} tok/s  "
                              f"ETA {_duration((config.total_steps - step) / speed)}")
                    window = {"bits": 0.0, "grad_norm": 0.0, "count": 0}
                    result["train_bits"] = row["bits"]
                valid_bits = None
                if do_eval:
                    start = time.time()
                    valid_bits = evaluate(eval_step, state["params"], dataset, "valid", config,
                                          batch_sharding)
                    if not math.isfinite(valid_bits):
                        raise FloatingPointError(f"non-finite validation bits at step {step}")
                    best = valid_bits if best is None else min(best, valid_bits)
                    log.write(step, "valid", {"bits": valid_bits})
                    log.print(f"step {step}/{config.total_steps}  valid {valid_bits:.4f} bits "
                              f"per {dataset.unit} (best {best:.4f})  [{time.time() - start:.1f}s]")
                    result.update(valid_bits=valid_bits, best_valid_bits=best)
                if do_save:
                    save(valid_bits)
                clock = {"time": time.time(), "steps": 0}  # throughput without eval and saving
            if pending is not None:
                fetch(pending)
            if signals.received and manager.latest_step() != step:  # signal during eval/save
                save()
            wait_for_checkpoint(manager, step)
    finally:
        log.close()
        try:
            manager.wait_until_finished()
        except Exception:  # noqa: BLE001  (already reported by the code that raised)
            pass
        manager.close()
    result["step"] = step
    if signals.received:
        result["interrupted"] = signals.received
        log.print(f"Stopped by {signals.received} at step {step}; checkpoint saved in "
                  f"{manager.directory}. Run the same command to resume.")
    elif step == first_step:
        log.print(f"Already at step {step} = total_steps: nothing to do "
                  "(raise --config.total_steps to train on).")
    return result
