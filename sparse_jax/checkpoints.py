"""A run's workdir and its Orbax checkpoints: the checks before a run starts or is read, one
CheckpointManager, save / restore of the training state, and restoring a model's parameters.

  WORKDIR/config.json         the config the run trains with (`sparse_jax.config`)
  WORKDIR/checkpoints/<step>  `params` and `opt` (StandardSave of nnx pure dicts) and `meta`
                              (JsonSave: step, data iterator position, RNG key, log window, best
                              validation bits); the manager tracks `valid_bits` for "best"

Training opens the manager read-write (keeps the last `keep` checkpoints and the best by
validation bits); evaluation and sampling open it read-only, which never creates, deletes or
cleans anything in a workdir that may still be training.

A checkpoint that cannot be read (a truncated or missing file) is never deleted: "latest" falls
back to the newest readable checkpoint with a warning; training moves the damaged ones newer
than it to WORKDIR/damaged_checkpoints/ (they would block its next saves). One training process
at a time holds WORKDIR/.lock (an flock: a killed run does not leave it held).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from sparse_jax import config as config_lib
from sparse_jax import data as data_lib
from sparse_jax import sharding as sharding_lib
from sparse_jax.files import atomic_write, part_suffix
from sparse_jax.model import SparseTransformer, model_config

FOLDER = "checkpoints"
DAMAGED = "damaged_checkpoints"
LOCK = ".lock"
# What this project writes into a workdir: anything else there is someone else's.
OURS = {config_lib.RECORD, config_lib.HISTORY, FOLDER, DAMAGED, LOCK, "metrics.jsonl",
        "tensorboard", "eval", "samples", "profile", "train.log", "study.json",
        "data_fingerprint.json"}  # FINGERPRINT


class _DropExpectedWarnings(logging.Filter):
    """Orbax warns at every checkpoint saved without validation metrics, and that a read-only
    manager's directory is read only: both are expected here. Its background threads also log
    every failed write with a traceback; the failure reaches `save`/`wait`, which report it in
    one line (set SPARSE_JAX_TRACEBACK=1 to keep Orbax's logs)."""

    def filter(self, record):
        message = record.getMessage()
        if record.levelno >= logging.ERROR and ("orbax" in record.pathname or "orbax" in message):
            return os.environ.get("SPARSE_JAX_TRACEBACK", "") not in ("", "0")
        return "tracked_metric" not in message and "is read only" not in message


logging.getLogger("absl").addFilter(_DropExpectedWarnings())
logging.getLogger("asyncio").addFilter(_DropExpectedWarnings())  # Orbax's unretrieved tasks


def _closed_loop(exc) -> bool:
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _quiet_hook(hook):
    """After a failed write, TensorStore's callbacks into Orbax's finished event loop raise
    "Event loop is closed" from C++ threads; the failure itself is reported by `save`/`wait`."""
    def quiet(*args):
        exc = args[0].exc_value if len(args) == 1 else args[1]
        if not _closed_loop(exc) or os.environ.get("SPARSE_JAX_TRACEBACK", "") not in ("", "0"):
            hook(*args)
    return quiet


sys.unraisablehook = _quiet_hook(sys.unraisablehook)
sys.excepthook = _quiet_hook(sys.excepthook)


def steps(workdir: str) -> list[int]:
    """The steps of the checkpoints in `workdir`, ascending (none: [])."""
    folder = os.path.join(workdir, FOLDER)
    if not os.path.isdir(folder):
        return []
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


PROBE = ".write_test"  # + part_suffix: the file that shows a folder is writable


def _probe(folder: str) -> None:
    """Creates `folder` if needed and writes and removes a small file in it (OSError if it
    cannot). Its name is unique to the process (`part_suffix`), so the next probe removes one
    that a process killed here left behind."""
    os.makedirs(folder, exist_ok=True)
    probe = os.path.join(folder, PROBE)
    probe += part_suffix(probe)
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)


def prepare_workdir(workdir: str, config) -> dict[str, tuple] | None:
    """Creates `workdir` and checks that it is writable and holds nothing but a run of this
    project whose checkpoints `config` may resume. Returns None for a new run, else the config
    changes (`config.resume_changes`: {} when none); ValueError / OSError otherwise."""
    try:
        _probe(workdir)
    except OSError as e:
        raise OSError(e.errno, f"cannot write to the workdir {workdir}: "
                               f"{e.strerror or e}; choose another --workdir") from e
    entries = [n for n in os.listdir(workdir) if not n.startswith(PROBE + ".")]
    foreign = sorted(n for n in entries if n not in OURS  # a temporary file being written:
                     and not (n.endswith(".tmp") and n[:-4] in OURS))
    record = os.path.join(workdir, config_lib.RECORD)
    if foreign:
        shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(f"{workdir} holds files this project did not write ({shown}); "
                         "refusing to train there: use an empty or new --workdir")
    if not os.path.exists(record):
        if steps(workdir):
            raise ValueError(f"{workdir} holds checkpoints but no config.json, so they cannot "
                             "be checked against this config; use another --workdir")
        return None
    try:
        saved = config_lib.read_record(workdir)
    except ValueError as e:
        raise ValueError(f"{record} was not written by this project (or is damaged); "
                         "refusing to train there: use another --workdir") from e
    missing = [s for s in config_lib.SECTIONS if s not in saved]
    if missing:
        raise ValueError(f"{record} was not written by this project (no {', '.join(missing)} "
                         "section); refusing to train there: use another --workdir")
    if not steps(workdir):
        return None  # a run that never checkpointed starts again
    return config_lib.resume_changes(saved, config, workdir)


FINGERPRINT = "data_fingerprint.json"


def check_data(workdir: str, config_data, dataset, record: bool = True) -> None:
    """Records what data a run trains on (`data.fingerprint`) in WORKDIR/data_fingerprint.json
    when it starts (`record`, process 0), and checks on every resume, evaluation or sampling
    that the data is still the same (ValueError naming the file otherwise)."""
    path = os.path.join(workdir, FINGERPRINT)
    recorded = None
    if os.path.exists(path) and steps(workdir):
        try:
            with open(path) as f:
                recorded = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path} is damaged ({e}); restore it, or delete it to record the "
                             "data as it is now") from e
    current = data_lib.check_fingerprint(recorded, config_data, dataset)
    if record and jax.process_index() == 0 and current != recorded:
        with atomic_write(path) as f:
            json.dump(current, f, indent=1)


@contextlib.contextmanager
def lock(workdir: str):
    """Holds WORKDIR/.lock while a training process uses `workdir`; OSError if another one
    holds it. The lock dies with its process (flock), so a killed run never leaves it held."""
    path = os.path.join(workdir, LOCK)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise OSError(errno.EBUSY, f"{workdir} is in use by another training process (pid "
                                   f"{holder}); wait for it to end or use another --workdir"
                      ) from e
    try:
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def last_good(workdir: str) -> str:
    """What a run stopped by a non-finite loss tells the user about its checkpoints."""
    good = steps(workdir)
    where = (f"The last good checkpoint is step {good[-1]} in {os.path.join(workdir, FOLDER)}"
             if good else "No checkpoint was saved yet")
    return f"{where}; lower optimizer.lr or raise warmup_steps, and resume or restart."


def check_workdir(workdir: str) -> None:
    """FileNotFoundError unless `workdir` holds a config.json and at least one checkpoint."""
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"workdir {workdir} " + ("is a file, not a folder" if
                                os.path.exists(workdir) else "does not exist"))
    if not os.path.exists(os.path.join(workdir, config_lib.RECORD)):
        raise FileNotFoundError(f"{workdir} has no config.json: not a training workdir "
                                "(scripts/train.py writes one)")
    if not steps(workdir):
        raise FileNotFoundError(f"no checkpoints in {os.path.join(workdir, FOLDER)}: train first")


def manager(workdir: str, keep: int | None = None) -> ocp.CheckpointManager:
    """The run's CheckpointManager. With `keep`: read-write, keeping the `keep` latest
    checkpoints and the one with the lowest validation bits. Without: read-only."""
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
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, FOLDER)), options=options)


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


def save(mgr, step: int, state, meta: dict, valid_bits: float | None) -> None:
    """Starts an asynchronous save of `state` ({"params", "opt"} of nnx States) and `meta` at
    `step`, after the previous save has finished."""
    wait(mgr, mgr.latest_step())
    args = ocp.args.Composite(params=ocp.args.StandardSave(nnx.to_pure_dict(state["params"])),
                              opt=ocp.args.StandardSave(nnx.to_pure_dict(state["opt"])),
                              meta=ocp.args.JsonSave(meta))
    try:
        metrics = None if valid_bits is None else {"valid_bits": valid_bits}
        mgr.save(step, args=args, metrics=metrics)
    except Exception as e:  # noqa: BLE001
        raise _write_error(mgr, step, e) from e


def restore(mgr, step: int, abstract_state):
    """(state, meta) of checkpoint `step`; arrays land with the shardings of `abstract_state`."""
    pure = {k: nnx.to_pure_dict(v) for k, v in abstract_state.items()}
    restored = mgr.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(pure["params"]), opt=ocp.args.StandardRestore(pure["opt"]),
        meta=ocp.args.JsonRestore()))
    state = jax.tree.map(lambda x: x, abstract_state)  # a copy to fill in
    for key in ("params", "opt"):
        nnx.replace_by_pure_dict(state[key], restored[key])
    return state, restored["meta"]


def _reason(error: Exception) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:160]}{'...' if len(text) > 160 else ''}"


def warn(message: str) -> None:
    """One `warning:` line on stderr (process 0 only)."""
    if jax.process_index() == 0:
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()


def restore_latest(mgr, abstract_state, workdir: str):
    """(step, state, meta) of the newest checkpoint that can be read. Damaged newer ones are
    moved to WORKDIR/damaged_checkpoints/<step> (never deleted) with a warning; OSError, moving
    nothing, if none can be read."""
    damaged = []
    for step in sorted(mgr.all_steps(), reverse=True):
        try:
            state, meta = restore(mgr, step, abstract_state)
        except Exception as e:  # noqa: BLE001  (Orbax and TensorStore fail in many types)
            damaged.append((step, _reason(e)))
            continue
        for bad, reason in damaged:
            aside = os.path.join(workdir, DAMAGED, f"{bad}")
            while os.path.exists(aside):
                aside += "_"
            os.makedirs(os.path.dirname(aside), exist_ok=True)
            shutil.move(os.path.join(workdir, FOLDER, str(bad)), aside)
            warn(f"checkpoint {bad} in {mgr.directory} cannot be read ({reason}); moved it to "
                 f"{aside} and resumed from step {step}")
        if damaged:
            mgr.reload()
        return step, state, meta
    raise OSError(errno.EIO, f"no checkpoint in {mgr.directory} can be read (newest: "
                             f"{damaged[0][1] if damaged else 'none'}); nothing was moved or "
                             "deleted. Use another --workdir to start over")


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


def check_output(path: str, overwrite: bool, what: str = "") -> None:
    """Before any work: FileExistsError if `path` exists and `overwrite` is not set; OSError if
    its folder cannot be created or written."""
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, f"{path} is a folder; give the path of a file")
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(errno.EEXIST, f"{path} exists{what}; pass --overwrite to replace "
                                            "it, or choose another output")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        _probe(folder)
    except OSError as e:
        raise OSError(e.errno, f"cannot write to {folder}: {e.strerror or e}; choose another "
                               "output") from e


_LISTINGS = 20  # times a reader lists the checkpoints again when the one it read was removed


def restore_model(workdir: str, checkpoint="latest", mesh=None):
    """(model, config, step): the run's config and the parameters of one checkpoint.

    Only the `params` item is read (never the optimizer state). Safe beside a run that is
    saving: Orbax lists only finalized checkpoints, and one that the run's rotation removes
    while it is read sends the reader back to the newest that exists. With a `mesh` ("data", "fsdp"
    axes), the parameters land sharded as in training (`sparse_jax.sharding`: split over
    "fsdp", copied over "data"); without one, whole on this process's first device.
    """
    check_workdir(workdir)
    checkpoint = parse_checkpoint(checkpoint)
    config = config_lib.read_record(workdir)
    cfg = model_config(config.model)
    mgr = manager(workdir)
    try:
        step = resolve_step(mgr, checkpoint)
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
        restored = None
        for _ in range(_LISTINGS):  # a run that saves meanwhile may rotate a checkpoint away
            candidates = (sorted(mgr.all_steps(read=True), reverse=True)
                          if checkpoint == "latest" else [step])
            for k, step in enumerate(candidates):
                try:
                    restored = mgr.restore(step, args=ocp.args.Composite(
                        params=ocp.args.StandardRestore(target)))
                    break
                except Exception as e:  # noqa: BLE001  (Orbax and TensorStore fail in many types)
                    if checkpoint == "latest" and not os.path.isdir(
                            os.path.join(str(mgr.directory), str(step))):
                        break  # removed while read by the run's rotation: list them again
                    if k + 1 == len(candidates):
                        raise OSError(errno.EIO, f"checkpoint {step} in {mgr.directory} cannot "
                                      f"be read ({_reason(e)}); "
                                      + ("no older checkpoint can be read either" if k else
                                         f"choose another with --checkpoint (steps: "
                                         f"{sorted(mgr.all_steps())})")) from e
                    warn(f"checkpoint {step} in {mgr.directory} cannot be read ({_reason(e)}); "
                         f"using step {candidates[k + 1]}")
            if restored is not None:
                break
        else:
            raise OSError(errno.EBUSY, f"the checkpoints in {mgr.directory} were removed while "
                          f"being read, {_LISTINGS} times over (a run saving every few "
                          "seconds?); run again, or read --checkpoint=best")
    finally:
        mgr.close()
    nnx.replace_by_pure_dict(abstract, restored["params"])
    return nnx.merge(graphdef, abstract), config, step
