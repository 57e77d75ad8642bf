"""A run's Orbax checkpoints: one CheckpointManager, saving the training state with its `Meta`,
one restore that falls back past checkpoints that cannot be read, restoring a model's
parameters, and the step that "latest", "best" or a number names.

  WORKDIR/checkpoints/<step>  `params` and `opt` (StandardSave of nnx pure dicts) and `meta`
                              (JsonSave of `Meta`: step, data iterator position, RNG key, log
                              window, best validation bits); the manager tracks `valid_bits`
                              for "best"

The rest of a workdir, and the checks before a run starts in one or reads one, are
`sparse_jax.run.workdir`'s.

Training opens the manager read-write (keeps the last `keep` checkpoints and the best by
validation bits); evaluation and sampling open it read-only, which never creates, deletes or
cleans anything in a workdir that may still be training.

A checkpoint that cannot be read (a truncated or missing file) is never deleted: "latest" falls
back to the newest readable checkpoint with a warning (`restore_newest`); training moves the
damaged ones newer than it to WORKDIR/damaged_checkpoints/ (they would block its next saves).

Orbax warns where nothing is wrong here and its background threads print a traceback for every
failed write, which `save` / `wait` report in one line: the first manager a process opens
filters both out (`install_hooks`; SPARSE_JAX_TRACEBACK=1 keeps them).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from sparse_jax import sharding as sharding_lib
from sparse_jax.logs import warn
from sparse_jax.model.transformer import SparseTransformer
from sparse_jax.run import setup
from sparse_jax.run import workdir as workdir_lib

TRACEBACK_ENV = "SPARSE_JAX_TRACEBACK"  # set (not 0): keep Orbax's logs of failed writes
_LISTINGS = 20  # times a reader lists the checkpoints again when one it lists or reads is removed


@dataclasses.dataclass
class Meta:
    """A checkpoint's `meta` item (JSON): what continues the run exactly, besides the arrays."""

    step: int  # optimizer steps done
    data: dict  # the training data iterator's position (its get_state())
    rng: list[int]  # the run's RNG key data
    window: dict  # train metrics summed since the last log line: bits, grad_norm, count
    best_valid_bits: float | None  # the lowest validation bits so far; None before the first

    def to_json(self) -> dict:
        """A copy as plain JSON values (Orbax writes it after `save` returns)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> Meta:
        return cls(**{field.name: raw[field.name] for field in dataclasses.fields(cls)})


# ---------------------------------------------------------------------------------------------
# Orbax's expected warnings and the noise of its failed writes.


def _tracebacks_wanted() -> bool:
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


class _DropExpectedWarnings(logging.Filter):
    """Orbax warns at every checkpoint saved without validation metrics, and that a read-only
    manager's directory is read only: both are expected here. Its background threads also log
    every failed write with a traceback; the failure reaches `save`/`wait`, which report it in
    one line."""

    def filter(self, record):
        message = record.getMessage()
        if record.levelno >= logging.ERROR and ("orbax" in record.pathname or "orbax" in message):
            return _tracebacks_wanted()
        return "tracked_metric" not in message and "is read only" not in message


def _quiet_hook(hook):
    """After a failed write, TensorStore's callbacks into Orbax's finished event loop raise
    "Event loop is closed" from C++ threads; the failure itself is reported by `save`/`wait`."""
    def quiet(*args):
        exc = args[0].exc_value if len(args) == 1 else args[1]
        closed_loop = isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"
        if not closed_loop or _tracebacks_wanted():
            hook(*args)
    return quiet


_hooks = []  # what install_hooks installed, once per process


def install_hooks() -> None:
    """Installs `_DropExpectedWarnings` on the absl and asyncio loggers (Orbax's unretrieved
    tasks log there) and `_quiet_hook` around sys.excepthook and sys.unraisablehook, once per
    process. `manager` calls it: they concern managers only."""
    if _hooks:
        return
    _hooks.append(_DropExpectedWarnings())
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_hooks[0])
    sys.unraisablehook = _quiet_hook(sys.unraisablehook)
    sys.excepthook = _quiet_hook(sys.excepthook)


# ---------------------------------------------------------------------------------------------
# The manager and saving.


def manager(workdir: str, keep: int | None = None) -> ocp.CheckpointManager:
    """The run's CheckpointManager. With `keep`: read-write, keeping the `keep` latest
    checkpoints and the one with the lowest validation bits. Without: read-only."""
    install_hooks()
    best = lambda metrics: metrics["valid_bits"]  # noqa: E731
    if keep is None:
        options = ocp.CheckpointManagerOptions(read_only=True, create=False,
                                               save_interval_steps=0, best_fn=best,
                                               best_mode="min")
    else:
        policies = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            best_fn=best, best_mode="min", cleanup_tmp_directories=True, create=True,
            preservation_policy=policies.AnyPreservationPolicy([
                policies.LatestN(keep),
                policies.BestN(get_metric_fn=best, reverse=True, n=1,
                               keep_checkpoints_without_metrics=False)]))
    # Orbax needs an absolute path; users pass relative workdirs.
    folder = os.path.abspath(os.path.join(workdir, workdir_lib.FOLDER))
    return _listing(lambda: ocp.CheckpointManager(folder, options=options))


def _listing(list_checkpoints):
    """`list_checkpoints()`, an Orbax call that lists the checkpoints and reads their metadata,
    called again while it fails because one vanished meanwhile (the rotation of a run saving
    beside a reader removed it), at most `_LISTINGS` times."""
    for _ in range(_LISTINGS - 1):
        try:
            return list_checkpoints()
        except FileNotFoundError:
            continue
    return list_checkpoints()


def _write_error(mgr, step, error) -> OSError:
    mgr.reload()
    return OSError(errno.EIO, f"could not write the checkpoint of step {step} to "
                              f"{mgr.directory} (disk full or not writable?): "
                              f"{type(error).__name__}: {error}. Earlier checkpoints are intact: "
                              f"steps {mgr.all_steps()}")


def wait(mgr: ocp.CheckpointManager, step: int | None) -> None:
    """Waits for a pending asynchronous save; a failed one becomes a clear OSError."""
    try:
        mgr.wait_until_finished()
    except Exception as e:  # noqa: BLE001  (Orbax surfaces write errors in several types)
        raise _write_error(mgr, step, e) from e


def save(mgr, step: int, state, meta: Meta, valid_bits: float | None) -> None:
    """Starts an asynchronous save of `state` ({"params", "opt"} of nnx States) and `meta` at
    `step`, after the previous save has finished."""
    wait(mgr, mgr.latest_step())
    args = ocp.args.Composite(params=ocp.args.StandardSave(nnx.to_pure_dict(state["params"])),
                              opt=ocp.args.StandardSave(nnx.to_pure_dict(state["opt"])),
                              meta=ocp.args.JsonSave(meta.to_json()))
    try:
        metrics = None if valid_bits is None else {"valid_bits": valid_bits}
        mgr.save(step, args=args, metrics=metrics)
    except Exception as e:  # noqa: BLE001
        raise _write_error(mgr, step, e) from e


def last_good(workdir: str) -> str:
    """What a run stopped by a non-finite loss tells the user about its checkpoints."""
    good = workdir_lib.steps(workdir)
    where = (f"The last good checkpoint is step {good[-1]} in "
             f"{os.path.join(workdir, workdir_lib.FOLDER)}" if good else
             "No checkpoint was saved yet")
    return f"{where}; lower optimizer.lr or raise warmup_steps, and resume or restart."


# ---------------------------------------------------------------------------------------------
# Restoring.


def _reason(error: Exception) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


def restore_newest(mgr, args) -> tuple[int, dict, list[tuple[int, str]]]:
    """(step, restored, damaged): `args` (an `ocp.args.Composite`) restored from the newest
    checkpoint that can be read, and [(step, reason)] of the newer ones that cannot (nothing is
    moved or deleted here). A checkpoint that disappears while it is listed or read (the
    rotation of a run saving beside a reader removed it) sends the reader back to a fresh
    listing. OSError if no checkpoint can be read."""
    for _ in range(_LISTINGS):
        damaged = []
        _listing(mgr.reload)  # list the folder afresh (all_steps(read=True) is deprecated)
        for step in sorted(mgr.all_steps(), reverse=True):
            try:
                return step, mgr.restore(step, args=args), damaged
            except Exception as e:  # noqa: BLE001  (Orbax and TensorStore fail in many types)
                if not os.path.isdir(os.path.join(str(mgr.directory), str(step))):
                    break  # removed while read: list them again
                damaged.append((step, _reason(e)))
        else:
            raise OSError(errno.EIO, f"no checkpoint in {mgr.directory} can be read (newest: "
                                     f"{damaged[0][1] if damaged else 'none'}); nothing was "
                                     "moved or deleted. Use another --workdir to start over")
    raise OSError(errno.EBUSY, f"the checkpoints in {mgr.directory} were removed while being "
                               f"read, {_LISTINGS} times over (a run saving every few seconds?); "
                               "run again, or read --checkpoint=best")


def _state_args(abstract_state) -> ocp.args.Composite:
    pure = {k: nnx.to_pure_dict(v) for k, v in abstract_state.items()}
    return ocp.args.Composite(params=ocp.args.StandardRestore(pure["params"]),
                              opt=ocp.args.StandardRestore(pure["opt"]),
                              meta=ocp.args.JsonRestore())


def restore_latest(mgr, abstract_state, workdir: str) -> tuple[int, dict, Meta]:
    """(step, state, meta) of the newest checkpoint that can be read (`restore_newest`); arrays
    land with the shardings of `abstract_state`. The damaged newer ones are moved to
    WORKDIR/damaged_checkpoints/<step> (never deleted) with a warning."""
    step, restored, damaged = restore_newest(mgr, _state_args(abstract_state))
    for bad, reason in damaged:
        aside = os.path.join(workdir, workdir_lib.DAMAGED, f"{bad}")
        while os.path.exists(aside):
            aside += "_"
        os.makedirs(os.path.dirname(aside), exist_ok=True)
        shutil.move(os.path.join(workdir, workdir_lib.FOLDER, str(bad)), aside)
        warn(f"checkpoint {bad} in {mgr.directory} cannot be read ({reason}); moved it to "
             f"{aside} and resumed from step {step}")
    if damaged:
        mgr.reload()
    state = jax.tree.map(lambda x: x, abstract_state)  # a copy to fill in
    for key in ("params", "opt"):
        nnx.replace_by_pure_dict(state[key], restored[key])
    return step, state, Meta.from_json(restored["meta"])


def _placed(pure, mesh):
    """ShapeDtypeStructs of the arrays of `pure`, sharded as in training over `mesh`, or whole
    on this process's first device without one."""
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: device, pure)
    else:
        shardings = sharding_lib.state_shardings(pure, mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        pure, shardings)


def restore_model(workdir: str, checkpoint="latest", mesh=None, attention: str | None = None):
    """(model, config, step): the run's config and the parameters of one checkpoint.

    Only the `params` item is read (never the optimizer state). Safe beside a run that is
    saving: Orbax lists only finalized checkpoints, and "latest" falls back past damaged ones
    and past one that the run's rotation removes while it is read (`restore_newest`). With a
    `mesh` ("data", "fsdp" axes), the parameters land sharded as in training
    (`sparse_jax.sharding`: split over "fsdp", copied over "data"); without one, whole on this
    process's first device. The model attends with `attention`, or as chosen for this machine
    (`config_lib.for_this_machine`).
    """
    workdir_lib.check_workdir(workdir)
    checkpoint = parse_checkpoint(checkpoint)
    config, cfg = setup.recorded(workdir, attention)
    mgr = manager(workdir)
    try:
        step = resolve_step(mgr, checkpoint)
        graphdef, abstract = nnx.split(nnx.eval_shape(
            lambda: SparseTransformer(cfg, rngs=nnx.Rngs(0))))
        args = ocp.args.Composite(params=ocp.args.StandardRestore(
            _placed(nnx.to_pure_dict(abstract), mesh)))
        if checkpoint == "latest":
            step, restored, damaged = restore_newest(mgr, args)
            for bad, reason in damaged:
                warn(f"checkpoint {bad} in {mgr.directory} cannot be read ({reason}); using "
                     f"step {step}")
        else:
            try:
                restored = mgr.restore(step, args=args)
            except Exception as e:  # noqa: BLE001  (Orbax and TensorStore fail in many types)
                raise OSError(errno.EIO, f"checkpoint {step} in {mgr.directory} cannot be read "
                                         f"({_reason(e)}); choose another with --checkpoint "
                                         f"(steps: {sorted(mgr.all_steps())})") from e
    finally:
        mgr.close()
    nnx.replace_by_pure_dict(abstract, restored["params"])
    return nnx.merge(graphdef, abstract), config, step


# ---------------------------------------------------------------------------------------------
# Which step a checkpoint argument names.


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


def resolve_step(mgr: ocp.CheckpointManager, checkpoint) -> int:
    """The step that `checkpoint` ("latest", "best" or a step) names; FileNotFoundError if none."""
    checkpoint = parse_checkpoint(checkpoint)
    all_steps = sorted(mgr.all_steps())
    if not all_steps:
        raise FileNotFoundError(f"no checkpoints in {mgr.directory}: train first")
    if checkpoint == "latest":
        return mgr.latest_step()
    if checkpoint == "best":
        step = mgr.best_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {mgr.directory} has a validation "
                                    f"score, so none is 'best'; steps: {all_steps}")
        return step
    if checkpoint not in all_steps:
        raise FileNotFoundError(f"no checkpoint of step {checkpoint} in {mgr.directory}; "
                                f"steps: {all_steps}")
    return checkpoint


def step_of(workdir: str, checkpoint="latest") -> int:
    """The step `checkpoint` names in `workdir` (read-only; see `resolve_step`)."""
    mgr = manager(workdir)
    try:
        return resolve_step(mgr, checkpoint)
    finally:
        mgr.close()
