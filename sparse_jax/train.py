"""Training: AdamW with warmup + cosine decay, data-parallel over a device mesh, validation,
checkpoints with exact resume.

`train(config, workdir)` runs (or resumes) the run that `config` describes in `workdir`. What it
writes there: config.json (`sparse_jax.run.config`), checkpoints/ (`sparse_jax.run.checkpoints`),
metrics.jsonl and tensorboard/ (`sparse_jax.logs`), data_fingerprint.json and .lock
(`sparse_jax.run.workdir`, which also says what a workdir may hold before a run starts there).

A workdir that holds checkpoints is resumed from its latest readable one and continues exactly
as the uninterrupted run would have (same batches, dropout and losses); which config changes a
resume accepts: `sparse_jax.run.config`. SIGTERM / SIGINT save a checkpoint and stop; a NaN/Inf
loss stops the run with an error and keeps the last good checkpoint.

The training step is one jitted function of (state, batch, rng): the state (parameters and
optimizer state) is donated and sharded by `sparse_jax.sharding` (replicated over "data", split
over "fsdp"; it is created by a jitted init with those output shardings, so a model is never
whole on one device), the batch is split over all devices of the ("data", "fsdp") mesh, the
dropout key is `fold_in(rng, step)`. Metrics of step n-1 are fetched after step n is dispatched,
so the host never waits on the device inside the loop.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparse_jax import evaluate as eval_lib
from sparse_jax import sharding as sharding_lib
from sparse_jax.data import datasets as data_lib
from sparse_jax.data.batches import Stage
from sparse_jax.logs import Logger, Profiler, duration, timed, warn
from sparse_jax.model.config import ModelConfig
from sparse_jax.model.transformer import loss_bits
from sparse_jax.run import checkpoints, setup
from sparse_jax.run import config as config_lib
from sparse_jax.run import workdir as workdir_lib
from sparse_jax.run.optim import state_builders

# ---------------------------------------------------------------------------------------------
# Schedule.


def tokens_left(stages: list[Stage], step: int) -> int:
    """Tokens of the steps from `step` on (`stages`: `setup.run_stages`): at the current tokens per
    second, the time left (a step of a later, longer stage costs about its tokens' worth)."""
    starts = [0] + [stage.until for stage in stages[:-1]]
    return sum(max(0, s.until - max(step, start)) * s.batch_size * s.seq_len
               for start, s in zip(starts, stages))


def tokens_at(stages: list[Stage], step: int) -> int:
    """Tokens of the batch that trains step `step` (0-based; `stages`: `run_stages`); the full
    context from total_steps on, where a finished run resumes."""
    stage = next((s for s in stages if step < s.until), stages[-1])
    return stage.batch_size * stage.seq_len


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


class Jitted(NamedTuple):
    """The jitted functions of a run on a mesh and the shardings they use."""

    init: Any  # () -> state, created sharded (never whole on one device)
    train_step: Any  # (state, batch, rng) -> (state, metrics); the state is donated
    eval_step: Any  # (params, batch) -> (bits, count) per position, summed over the batch
    abstract_state: Any  # ShapeDtypeStructs (with shardings) of the state
    state_sharding: Any  # NamedSharding per array of the state
    batch_sharding: NamedSharding  # a batch split over all devices


def make_jitted(config, cfg: ModelConfig, mesh: Mesh) -> Jitted:
    """Builds the state layout (shapes only, under eval_shape) and jits init, train and eval
    steps with in/out shardings: parameters and optimizer state by `sparse_jax.sharding`'s
    rules (split over "fsdp", replicated over "data"), batches split over all devices."""
    create, init, schedule = state_builders(config, cfg)
    model_def, opt_def = (nnx.graphdef(x) for x in nnx.eval_shape(create))
    replicated = NamedSharding(mesh, P())
    batch_sharding = sharding_lib.batch_sharding(mesh)
    abstract = jax.eval_shape(init)
    state_sharding = sharding_lib.state_shardings(abstract, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, state_sharding)
    train_step = jax.jit(make_train_step(model_def, opt_def, config, schedule, batch_sharding),
                         in_shardings=(state_sharding, batch_sharding, replicated),
                         out_shardings=(state_sharding, replicated), donate_argnums=0)
    eval_step = jax.jit(eval_lib.make_eval_step(model_def, batch_sharding),
                        in_shardings=(state_sharding["params"], batch_sharding))
    return Jitted(jax.jit(init, out_shardings=state_sharding), train_step, eval_step, abstract,
                  state_sharding, batch_sharding)


# ---------------------------------------------------------------------------------------------
# The loop.


class _Signals:
    """Records SIGTERM / SIGINT so the loop can checkpoint and stop; a second one aborts. Until
    `armed` (the first step has compiled and been dispatched: there is something to save) a
    signal goes to the handler from before (`sparse_jax.stopping`: it stops the compilation
    and the CPU kernels' build at once, rather than after them)."""

    def __init__(self):
        self.received, self.previous, self.armed = None, {}, False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        before = self.previous.get(signum)
        if not self.armed and callable(before):
            return before(signum, frame)
        if self.received is not None:  # second signal: stop now
            signal.signal(signum, self.previous.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def train(config: ml_collections.ConfigDict, workdir: str,
          preset_total_steps: int | None = None) -> dict[str, Any]:
    """Trains (or resumes) the run of `config` in `workdir`; returns the final metrics. Every
    check that can fail (config, mesh, workdir, data) runs before anything compiles, and a run
    they refuse leaves the workdir as it found it (`workdir.undo_if_refused`).

    The config is completed and checked first, in one place (`run.setup.complete`: shapes from
    the data, the warmup, every field, the mesh and sequence split, what a resume may change).
    `preset_total_steps`: the total_steps of the config file when the user left its warmup
    alone (scripts/train.py: `cli.preset_total_steps`); the warmup then follows a shortened run
    and a resumed one keeps the warmup it trained with (`config.follow_total_steps`)."""
    primary = jax.process_index() == 0
    run = setup.complete(config, workdir, preset_total_steps)  # every check that needs no data
    config, cfg, mesh = run.config, run.model, run.mesh
    for note in run.notes:
        if primary:
            print(note, flush=True)
    for warning in run.warnings:  # e.g. --config.model.kernel=chained where the CPU kernels run
        warn(warning)
    before = workdir_lib.contents(workdir)
    changes = workdir_lib.prepare_workdir(workdir, config)  # None: a new run
    with workdir_lib.lock(workdir) if primary else contextlib.nullcontext():
        with workdir_lib.undo_if_refused(workdir, before) if primary and changes is None \
                else contextlib.nullcontext():
            data_lib.prepare(config.data)  # e.g. TFDS cifar10, once (fails fast if it is missing)
            dataset = data_lib.make_dataset(config.data, cfg.seq_len, jax.process_index(),
                                            jax.process_count(), vocab_size=cfg.vocab_size,
                                            image_shape=cfg.image_shape)
            workdir_lib.check_data(workdir, config.data, dataset)  # the same data on resume
            processes = jax.process_count()
            iterator = dataset.train_batches(config.batch_size // processes, stages=tuple(
                stage._replace(batch_size=stage.batch_size // processes)
                for stage in config_lib.context_stages(config, cfg)))
            if primary and changes is None:
                config_lib.write_record(workdir, config)
        return _run(config, cfg, mesh, dataset, iterator, workdir, changes)


def _run(config, cfg, mesh, dataset, iterator, workdir, changes) -> dict[str, Any]:
    resuming = changes is not None

    jitted = make_jitted(config, cfg, mesh)
    abstract, batch_sharding = jitted.abstract_state, jitted.batch_sharding
    train_step, eval_step = jitted.train_step, jitted.eval_step
    replicated = NamedSharding(mesh, P())

    manager = checkpoints.manager(workdir, config.keep_checkpoints)
    per_process = config.batch_size // jax.process_count()  # rows this process reads per step
    window = {"bits": 0.0, "grad_norm": 0.0, "count": 0}  # train metrics since the last log
    if resuming:
        step, state, meta = checkpoints.restore_latest(manager, abstract, workdir)
        if changes and jax.process_index() == 0:
            config_lib.record_changes(workdir, config, step, changes)
        key_data = np.asarray(meta.rng, np.uint32)
        iterator.set_state(meta.data)
        window, best = meta.window, meta.best_valid_bits
    else:
        step, best = 0, None
        with timed("compiling and running the initialisation", "initialised"):
            state = jitted.init()
        key_data = np.asarray(jax.random.key_data(jax.random.key(config.seed)))
    # On every device of every process (a device_put cannot reach other processes' devices).
    rng = jax.random.wrap_key_data(jax.make_array_from_process_local_data(replicated, key_data))

    log = Logger(workdir, step, config.total_steps)
    stages = list(setup.run_stages(config, cfg))
    profiler = Profiler(workdir, config.profile_steps, step)  # traces of chosen steps, if any
    params = sum(x.size for x in jax.tree.leaves(abstract["params"]))
    log.print(f"{'Resuming from step ' + str(step) if resuming else 'Starting'} in {workdir}: "
              f"{config.data.name} ({dataset.unit}s), {params / 1e6:.2f}M parameters, "
              f"{cfg.num_layers} layers, pattern {cfg.base_spec}, mesh {dict(mesh.shape)} "
              f"({sharding_lib.per_device_bytes(abstract, dict(mesh.shape)) / 2**20:,.1f} MiB "
              f"of parameters and optimizer state per device), "
              f"batch {config.batch_size} x {cfg.seq_len}" + "".join(
                  f" (steps < {s.until}: {s.batch_size} x {s.seq_len})" for s in stages[:-1]))
    tokens_per_step = tokens_at(stages, step)
    result = {"step": step, "valid_bits": None, "best_valid_bits": best, "interrupted": None}
    pending = None  # (step, metrics) of the last dispatched step, not yet fetched
    clock = {"time": time.time(), "steps": 0}  # throughput since the last log

    def fetch(item):  # host-side checks of one step's metrics
        s, metrics = item
        metrics = jax.device_get(metrics)
        if not (math.isfinite(metrics["bits"]) and math.isfinite(metrics["grad_norm"])):
            checkpoints.wait(manager, manager.latest_step())
            what = ("training loss" if not math.isfinite(metrics["bits"]) else "gradient norm")
            raise FloatingPointError(
                f"non-finite {what} at step {s} (loss {metrics['bits']}, gradient norm "
                f"{metrics['grad_norm']}); stopping. {checkpoints.last_good(workdir)}")
        window["bits"] += float(metrics["bits"])
        window["grad_norm"] += float(metrics["grad_norm"])
        window["count"] += 1
        return float(metrics["lr"])

    def save(valid_bits=None):
        meta = checkpoints.Meta(step=step, data=iterator.get_state(),
                                rng=np.asarray(jax.random.key_data(rng)).tolist(),
                                window=window, best_valid_bits=best)
        checkpoints.save(manager, step, state, meta, valid_bits)

    first_step = step
    try:
        with _Signals() as signals:
            while step < config.total_steps and not signals.received:
                batch = sharding_lib.to_global(next(iterator), batch_sharding)
                with timed("compiling the training step", "compiled") if step == first_step \
                        else contextlib.nullcontext():
                    state, metrics = train_step(state, batch, rng)
                signals.armed = True
                if pending is not None:
                    fetch(pending)  # step n - 1, while step n runs
                step, pending = step + 1, (step + 1, metrics)
                tokens_per_step = tokens_at(stages, step - 1)
                profiler.step(step, state)
                clock["steps"] += 1
                log.progress(step, tokens_per_step)
                last = step == config.total_steps
                do_eval = step % config.eval_every == 0 or last
                do_log = step % config.log_every == 0 or last
                do_save = do_eval or step % config.checkpoint_every == 0 or signals.received
                if not (do_log or do_save):
                    continue
                lr = fetch(pending)  # never checkpoint a step whose loss was not checked
                pending = None  # every step of the window has run: its time is the steps' own
                speed = clock["steps"] / max(time.time() - clock["time"], 1e-9)
                if do_log:
                    n = window["count"]
                    row = {"bits": window["bits"] / n, "grad_norm": window["grad_norm"] / n,
                           "lr": lr, "steps_per_s": speed, "tokens_per_s": speed * tokens_per_step}
                    log.write(step, "train", row)
                    eta = tokens_left(stages, step) / max(row["tokens_per_s"], 1e-9)
                    log.print(f"step {step}/{config.total_steps}  train {row['bits']:.4f} bits  "
                              f"lr {lr:.2e}  grad norm {row['grad_norm']:.3f}  {speed:.2f} steps/s"
                              f"  {row['tokens_per_s']:,.0f} tok/s  ETA {duration(eta)}")
                    window = {"bits": 0.0, "grad_norm": 0.0, "count": 0}
                    result["train_bits"] = row["bits"]
                valid_bits = None
                if do_eval:
                    start = time.time()
                    scores = eval_lib.split_bits(
                        eval_step, state["params"], dataset.eval_batches("valid", per_process),
                        batch_sharding, max_batches=config.eval_batches)
                    valid_bits = scores.mean
                    if not math.isfinite(valid_bits):
                        raise FloatingPointError(f"non-finite validation bits at step {step}; "
                                                 f"stopping. {checkpoints.last_good(workdir)}")
                    best = valid_bits if best is None else min(best, valid_bits)
                    buckets = scores.buckets(eval_lib.position_edges(cfg.seq_len))
                    log.write(step, "valid", {"bits": valid_bits, "by_position": {
                        f"{b['first']}-{b['last']}": b["bits"] for b in buckets if b["count"]}})
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
            checkpoints.wait(manager, step)
    finally:
        profiler.close()
        log.close()
        with contextlib.suppress(Exception):  # a failed save: reported by the code that raised
            manager.wait_until_finished()
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
