"""A run's workdir and its Orbax checkpoints: the checks before a run starts or is read, one
CheckpointManager, save / restore of the training state, and restoring a model's parameters.

  WORKDIR/config.json         the config the run trains with (`sparse_jax.config`)
  WORKDIR/checkpoints/<step>  `params` and `opt` (StandardSave of nnx pure dicts) and `meta`
                              (JsonSave: step, data iterator position, RNG key, log window, best
                              validation bits); the manager tracks `valid_bits` for "best"

Training opens the manager read-write (keeps the last `keep` checkpoints and the best by
validation bits); evaluation and sampling open it read-only, which never creates, deletes or
cleans anything in a workdir that may still be training.
"""

from __future__ import annotations

import errno
import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from sparse_jax import config as config_lib
from sparse_jax import sharding as sharding_lib
from sparse_jax.model import SparseTransformer, model_config

FOLDER = "checkpoints"


class _DropExpectedWarnings(logging.Filter):
    """Orbax warns at every checkpoint saved without validation metrics, and that a read-only
    manager's directory is read only: both are expected here."""

    def filter(self, record):
        message = record.getMessage()
        return "tracked_metric" not in message and "is read only" not in message


logging.getLogger("absl").addFilter(_DropExpectedWarnings())


def steps(workdir: str) -> list[int]:
    """The steps of the checkpoints in `workdir`, ascending (none: [])."""
    folder = os.path.join(workdir, FOLDER)
    if not os.path.isdir(folder):
        return []
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


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
    if not steps(workdir):
        return False
    record = os.path.join(workdir, config_lib.RECORD)
    if not os.path.exists(record):
        raise ValueError(f"{workdir} holds checkpoints but no config.json, so they cannot be "
                         "checked against this config; use another --workdir")
    changed = config_lib.differences(config_lib.read_record(workdir), config, ("model", "data"))
    if changed:
        raise ValueError(f"{workdir} holds checkpoints of a different model or dataset; "
                         "refusing to touch them. Use another --workdir or the saved config "
                         f"({record}). Differences:\n  "
                         + "\n  ".join(config_lib.describe_differences(changed)))
    return True


def check_workdir(workdir: str) -> None:
    """FileNotFoundError unless `workdir` holds a config.json and at least one checkpoint."""
    if not os.path.isdir(workdir):
        raise FileNotFoundError(f"workdir {workdir} does not exist")
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


def restore_model(workdir: str, checkpoint="latest", mesh=None):
    """(model, config, step): the run's config and the parameters of one checkpoint.

    Only the `params` item is read (never the optimizer state). With a `mesh` ("data", "fsdp"
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
        restored = mgr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(target)))
    finally:
        mgr.close()
    nnx.replace_by_pure_dict(abstract, restored["params"])
    return nnx.merge(graphdef, abstract), config, step
