"""Prints a config's model size, attention schedule and cost estimates, allocating nothing.

  python scripts/describe.py --config=configs/enwik8.py
  python scripts/describe.py --config=configs/cifar10.py --json
  python scripts/describe.py --config=configs/enwik8.py --config.model.pattern=strided
  python scripts/describe.py --config=configs/cifar10.py --devices=64 --config.mesh.fsdp=8

See ``sparse_jax.model.describe`` for the FLOP and activation-memory formulas. The per-device
parameter and optimizer memory is for the config's mesh (config.mesh.data x config.mesh.fsdp)
over --devices devices (default: the devices this machine has), from the sharding rules of
``sparse_jax.sharding``: fsdp > 1 splits them, data parallelism copies them.
"""

import itertools
import json

from absl import app, flags
from ml_collections import config_flags

from sparse_jax import model as model_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file; uses config.model.",
                                          lock_config=True)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of text.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None,
                                   "Sequences per step (default: config.batch_size, else 1).")
_DEVICES = flags.DEFINE_integer("devices", None, "Devices to lay the mesh over (default: "
                                "jax.device_count()).")
flags.mark_flags_as_required(["config"])


def _schedule_lines(schedule: list[str]) -> list[str]:
    """The repeating cycle of layer patterns, or runs of equal layers."""
    n = len(schedule)
    period = next(p for p in range(1, n + 1) if all(schedule[k] == schedule[k % p]
                                                     for k in range(n)))
    if period == 1:
        return [f"  all {n} layers: {schedule[0]}"]
    if period <= n // 2:
        return [f"  a cycle of {period} layers, {n / period:g} times:"] + [
            f"    layer k = {i} mod {period}: {spec}" for i, spec in enumerate(schedule[:period])]
    lines, layer = [], 0
    for spec, run in itertools.groupby(schedule):
        count = len(list(run))
        span = f"{layer}" if count == 1 else f"{layer}-{layer + count - 1}"
        lines.append(f"  layers {span}: {spec}")
        layer += count
    return lines


def main(argv):
    del argv
    config = _CONFIG.value
    cfg = model_lib.model_config(config.model)
    batch_size = _BATCH_SIZE.value or config.get("batch_size", 1)
    info = model_lib.describe(cfg, batch_size)
    if "optimizer" in config and "mesh" in config:  # a training config
        import jax

        from sparse_jax import train

        info["per_device"] = train.per_device_memory(config, _DEVICES.value or jax.device_count())
    if _JSON.value:
        print(json.dumps(info))
        return
    gib = 2 ** 30
    print(f"parameters           {info['params']:,} ({info['params'] / 1e6:.1f}M)")
    print(f"context              {cfg.seq_len:,}, {cfg.num_layers} layers, d={cfg.d_model}, "
          f"{cfg.num_heads} heads, qk={cfg.qk_dim}, ff={cfg.ff_dim}")
    print(f"keys per query       {info['mean_keys_per_query']:.1f} mean over layers "
          f"(dense: {(cfg.seq_len + 1) / 2:.1f})")
    print(f"forward FLOPs/token  {info['flops_per_token'] / 1e6:.1f}M")
    print(f"train FLOPs/step     {info['flops_per_step'] / 1e12:.2f}T (batch {batch_size}, "
          "3x forward)")
    print(f"activation memory    {info['activation_bytes'] / gib:.2f} GiB without remat, "
          f"{info['activation_bytes_remat'] / gib:.2f} GiB with (estimate; config: "
          f"remat={cfg.remat})")
    if "per_device" in info:
        mem, mib = info["per_device"], 2 ** 20
        print(f"per device           {mem['params_bytes'] / mib:,.1f} MiB parameters + "
              f"{mem['optimizer_bytes'] / mib:,.1f} MiB optimizer state on mesh "
              f"data={mem['mesh']['data']} x fsdp={mem['mesh']['fsdp']}")
    print("attention schedule")
    print("\n".join(_schedule_lines(info["schedule"])))


if __name__ == "__main__":
    app.run(main)
