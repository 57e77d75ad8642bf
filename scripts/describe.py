"""Prints a config's model size, attention schedule and cost estimates, allocating nothing.

  python scripts/describe.py --config=configs/enwik8.py
  python scripts/describe.py --config=configs/cifar10.py --json
  python scripts/describe.py --config=configs/enwik8.py --config.model.pattern=strided
  python scripts/describe.py --config=configs/cifar10.py --devices=64 --config.mesh.fsdp=8

See ``sparse_jax.run.sizing.describe`` for the FLOP and activation-memory formulas. The per-device
parameter and optimizer memory is for the config's mesh (config.mesh.data x config.mesh.fsdp)
over --devices devices (default: the devices scripts/train.py trains on here, whose mesh its
first line prints: on a CPU one per core, as its --cpu_devices=-1), from the sharding rules of
``sparse_jax.sharding``: fsdp > 1 splits them, data parallelism copies them.
"""

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


def main(argv):
    del argv
    sharding.set_cpu_devices()  # the devices scripts/train.py splits a CPU into (--cpu_devices)
    config = _CONFIG.value
    if "data" in config:  # configs/images.py takes the model's shape from its pictures
        from sparse_jax.data import images

        images.fill_model_shape(config)
    cfg = model_config(config.model)
    batch_size = _BATCH_SIZE.value or config.get("batch_size", 1)
    info = sizing.describe(cfg, batch_size)
    if "optimizer" in config and "mesh" in config:  # a training config
        import jax

        info["per_device"] = sizing.per_device_memory(config, _DEVICES.value or jax.device_count())
    print(json.dumps(info) if _JSON.value else sizing.describe_text(cfg, info))


if __name__ == "__main__":
    cli.run(main)
