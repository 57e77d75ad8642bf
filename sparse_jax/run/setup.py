"""A run's config, completed and checked in one place, before any work.

``complete(config, workdir, preset_total_steps)`` turns the config a user gave (a file of
``configs/`` with its overrides) into the one a run trains with, and checks everything that can
be checked without reading data or compiling, in this order:

1. **shapes read from the data**: a picture-folder run takes its model shape from the pictures
   (``data.images.fill_model_shape``);
2. **the schedule**: a warmup that follows a shortened run, or the one the run being resumed
   trained with (``run.config.follow_total_steps``);
3. **every field the trainer reads**: the model (``ModelConfig``: the pattern fits the
   context), the optimizer, the context stages, the data section (``run.config.check_config``);
4. **the mesh and the sequence split**: the ("data", "fsdp", "seq") mesh over all devices, each
   micro-batch split evenly over it and, with ``mesh.seq > 1``, every layer's pattern split over
   the seq devices at every context (``make_mesh``);
5. **the workdir**, read only: a file in its place, files this project did not write, or a
   config that differs from the one the run in ``workdir`` trained with in a field a resume may
   not change (``run.config.resume_changes``) is refused (``run.workdir.admit``).

What it returns (``Run``) is what ``train.train`` runs; what a run records in its workdir
(``config.json``) is this completed config, which evaluation and sampling read back with
``recorded``. The checks that need the data itself or write to the workdir (its lock, the data's
fingerprint) come next, in ``train.train``, before anything compiles.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import ml_collections
from jax.sharding import Mesh

from sparse_jax import cli
from sparse_jax import sharding as sharding_lib
from sparse_jax.attention import context
from sparse_jax.data import images as images_lib
from sparse_jax.data.batches import Stage
from sparse_jax.model.config import ModelConfig, model_config
from sparse_jax.run import config as config_lib
from sparse_jax.run import sizing
from sparse_jax.run import workdir as workdir_lib


class Run(NamedTuple):
    """A completed, checked run config and what follows from it."""

    config: ml_collections.ConfigDict  # completed: shapes from the data, the warmup
    model: ModelConfig
    mesh: Mesh | None  # None when completed for a device count (`complete(..., devices=N)`)
    stages: tuple[Stage, ...]  # the context stages, then the full context until total_steps
    notes: tuple[str, ...]  # one line per field completing changed, for the console
    warnings: tuple[str, ...]  # settings that change nothing here (e.g. unused kernel options)
    mesh_shape: dict[str, int]  # {"data", "fsdp", "seq"}: devices per axis


def complete(config: ml_collections.ConfigDict, workdir: str | None = None,
             preset_total_steps: int | None = None, devices: int | None = None) -> Run:
    """Completes ``config`` in place and checks it (ValueError, one line, before any work; see
    the module docstring). ``workdir``: where the run trains (its recorded run, if any, keeps
    its warmup and bounds what may change); None for a config alone (the pattern study,
    ``describe.py``). ``preset_total_steps``: the total_steps of the config file when the user
    left its warmup alone (``cli.preset_total_steps``). ``devices``: check the mesh and the
    batch split for that many devices instead of this machine's (``describe.py --devices``;
    the Run's mesh is then None)."""
    recorded = workdir_lib.resumable_record(workdir) if workdir else None
    notes = [images_lib.fill_model_shape(config),  # configs/images.py: the pictures' shape
             config_lib.follow_total_steps(config, preset_total_steps, recorded)]
    cfg = config_lib.check_config(config)
    if devices is None:  # sizes that could never train on this machine
        sizing.check_fits(cfg, config.batch_size // max(1, config.optimizer.grad_accum))
        if config.data.name == "embedded":  # the stream, its symbols and choices: ~3 bytes each
            cli.memory_fits(f"data.embedded_bytes={config.data.embedded_bytes:,}: the "
                            "generated stream", 3 * config.data.embedded_bytes,
                            "data.embedded_bytes")
    config_lib.fill_fingerprint(config, cfg)  # a named pattern's, as the record keeps it
    shape = mesh_shape(config, cfg, jax.device_count() if devices is None else devices)
    mesh = None if devices is not None else sharding_lib.make_mesh(
        config.mesh.data, config.mesh.fsdp, config.mesh.get("seq", 1))
    if workdir:
        workdir_lib.admit(workdir, config)  # what is there, read only: a run it may resume
    return Run(config, cfg, mesh, tuple(run_stages(config, cfg)),
               tuple(note for note in notes if note),
               (cfg.kernel_unused,) if cfg.kernel_unused else (), shape)


def make_mesh(config: ml_collections.ConfigDict, cfg: ModelConfig | None = None) -> Mesh:
    """The ("data", "fsdp", "seq") mesh of config.mesh over all devices (see
    ``sparse_jax.sharding``), after `mesh_shape`'s checks."""
    cfg = cfg or model_config(config.model)
    mesh_shape(config, cfg, jax.device_count())
    return sharding_lib.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.get("seq", 1))


def mesh_shape(config: ml_collections.ConfigDict, cfg: ModelConfig | None,
               devices: int) -> dict[str, int]:
    """The mesh of config.mesh over `devices` devices, {"data", "fsdp", "seq"}, checked
    without any device (so a run can be planned for a machine it is not on): the axes must
    divide the devices; with mesh.seq > 1 the model's context (and each context stage's) must
    split over the seq devices for every layer's pattern (``context.check_model_split``); every
    micro-batch must split evenly over the devices its sequences are spread over."""
    cfg = cfg or model_config(config.model)
    seq = config.mesh.get("seq", 1)
    shape = sharding_lib.mesh_shape(devices, config.mesh.data, config.mesh.fsdp, seq)
    if seq > 1:
        if jax.process_count() > 1 and jax.local_device_count() % seq:
            raise ValueError(f"mesh.seq={seq} must divide the {jax.local_device_count()} devices "
                             "of each process (a sequence's shards stay on one host)")
        lengths = {cfg.seq_len} | {s.seq_len for s in config_lib.context_stages(config, cfg)}
        for length in sorted(lengths):
            context.check_model_split(cfg.specs(), length, seq)
    sequences = devices // seq  # the devices a batch's sequences are split over
    batches = {"batch_size": config.batch_size}
    batches.update({f"context_stages[{i}] batch_size": stage.batch_size for i, stage in
                    enumerate(config_lib.context_stages(config, cfg))})
    for name, batch in batches.items():
        micro = batch // config.optimizer.grad_accum
        if micro % sequences:
            hint = (f"; choose a {name} divisible by {sequences} or fewer CPU devices "
                    "(--cpu_devices=1)" if jax.default_backend() == "cpu" else "")
            split = "" if seq == 1 else f" (mesh.data x mesh.fsdp; mesh.seq={seq} splits positions)"
            raise ValueError(f"the micro-batch of {micro} sequences ({name} / grad_accum) does "
                             f"not split evenly over {sequences} devices{split}{hint}")
    return shape


def run_stages(config: ml_collections.ConfigDict, cfg: ModelConfig) -> list[Stage]:
    """The run's context stages (``config_lib.context_stages``), then the full context until
    total_steps: every step lies in one of them."""
    return [*config_lib.context_stages(config, cfg),
            Stage(config.total_steps, cfg.seq_len, config.batch_size)]


def recorded(workdir: str, attention: str | None = None,
             ) -> tuple[ml_collections.ConfigDict, ModelConfig]:
    """The completed config a run recorded in ``workdir`` (what evaluation and sampling read),
    with the attention implementation chosen for this machine (``config.for_this_machine``),
    and its ``ModelConfig``."""
    config = config_lib.for_this_machine(config_lib.read_record(workdir), attention)
    return config, model_config(config.model)
