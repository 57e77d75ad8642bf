"""Prints a config's model size, attention schedule and cost estimates, allocating nothing.

  python scripts/describe.py --config=configs/enwik8.py
  python scripts/describe.py --config=configs/cifar10.py --json
  python scripts/describe.py --config=configs/enwik8.py --config.model.pattern=strided
  python scripts/describe.py --config=configs/cifar10.py --devices=16 --config.mesh.fsdp=8

See ``sparse_jax.run.sizing.describe`` for the FLOP and activation-memory formulas. The per-device
parameter and optimizer memory is for the config's mesh (config.mesh.data x config.mesh.fsdp)
over --devices devices (default: the devices scripts/train.py trains on here, whose mesh its
first line prints: on a CPU one per core, as its --cpu_devices=-1), from the sharding rules of
``sparse_jax.sharding``: fsdp > 1 splits them, data parallelism copies them. The config is
completed and checked as scripts/train.py does it first (``run.setup.complete``: shapes from the
data, the warmup, every field, the mesh and the batch split over those devices), so what this
prints is what train.py would run, and a config train.py would refuse is refused here in its
words (one line, exit status 1).
"""

import copy
import json

from absl import flags
from ml_collections import config_flags

from sparse_jax import cli, sharding
from sparse_jax.model.config import model_config
from sparse_jax.run import sizing

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file; uses config.model.",
                                          lock_config=True)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of text.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Sequences per step (default: "
                                   "config.batch_size, else 1).", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices", None, "Devices to lay the mesh over (default: "
                                "those scripts/train.py uses here: on a CPU one per core).",
                                lower_bound=1)
flags.mark_flags_as_required(["config"])


def _devices() -> int:
    """--devices, or the devices scripts/train.py trains on here (on a CPU one per core)."""
    if _DEVICES.value:
        return _DEVICES.value
    import jax

    sharding.set_cpu_devices()  # the devices scripts/train.py splits a CPU into (--cpu_devices)
    return jax.device_count()


def _completed():
    """The config as scripts/train.py would complete it (`run.setup.complete`: shapes from the
    data, the warmup, every field, the mesh and batch split over `_devices()`), with its Run;
    a config without a training section (no optimizer or mesh) is only read, Run None."""
    config = copy.deepcopy(_CONFIG.value)
    if _BATCH_SIZE.value:
        config.batch_size = _BATCH_SIZE.value
    if "optimizer" not in config or "mesh" not in config:
        if "data" in config:  # configs/images.py takes the model's shape from its pictures
            from sparse_jax.data import images

            images.fill_model_shape(config)
        model_config(config.model)
        return config, None
    from sparse_jax.run import setup

    devices = _devices()
    try:
        return config, setup.complete(config, devices=devices)
    except ValueError as e:
        raise ValueError(f"scripts/train.py refuses this config on {devices} devices: {e}"
                         + ("" if _DEVICES.value else " (--devices=N describes it for N)")
                         ) from None


def check(argv):
    """Everything scripts/train.py checks of the config before any work, on the same mesh."""
    cli.no_arguments(argv)
    _completed()


def main(argv):
    config, run = _completed()
    cfg = model_config(config.model)
    batch_size = _BATCH_SIZE.value or config.get("batch_size", 1)
    info = sizing.describe(cfg, batch_size)
    if run is not None:  # a training config: its mesh and split are what train.py would use
        info["per_device"] = sizing.per_device_memory(config, _devices())
    print(json.dumps(info) if _JSON.value else sizing.describe_text(cfg, info))


if __name__ == "__main__":
    cli.run(main, check=check)
