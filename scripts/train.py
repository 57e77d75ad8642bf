r"""Trains a Sparse Transformer; all logic lives in `sparse_jax.train`.

  python scripts/train.py --config=configs/quickstart.py --workdir=workdirs/quickstart
  python scripts/train.py --config=configs/bytes.py:pattern=strided,size=cpu \
      --workdir=workdirs/code --config.total_steps=100 --config.data.path=data/cpython_lib.py.gz

Any config field can be overridden with --config.FIELD=VALUE; a field that does not exist or a
value of the wrong type is an error. A run shortened below its preset's total_steps warms up for
the same share of its steps (one line says so) unless --config.optimizer.warmup_steps is given.
Running the same command again on the same --workdir resumes from its latest checkpoint, with
the warmup it started with. SIGTERM / Ctrl-C save a checkpoint and stop (exit status
128 + signal number); a second Ctrl-C stops at once.

Many devices: the mesh spans all devices (config.mesh: data x fsdp; mesh.fsdp > 1 shards the
parameters and optimizer state). Many hosts: every process runs the same command, with
--jax_distributed under a cluster launcher that JAX detects (SLURM, Open MPI, Kubernetes, Cloud
TPU), or with --coordinator_address=HOST:PORT --num_processes=N --process_id=I. See docs/scaling.md.
"""

import signal
import sys

from absl import flags
from ml_collections import config_flags

from sparse_jax import cli
from sparse_jax.sharding import define_distributed_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file (configs/*.py), "
                                          "optionally with arguments: FILE:key=value,...",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, logs, config.json.")
_JOIN_DISTRIBUTED = define_distributed_flags()
flags.mark_flags_as_required(["config", "workdir"])


def check(argv):
    """Every flag and config field, before any work (`run.setup.complete` on a copy of the
    config: what `train.train` completes and checks first); a multi-process run's mesh is
    checked once it has joined."""
    cli.no_arguments(argv)
    _JOIN_DISTRIBUTED.check()
    cli.output_dir("workdir", _WORKDIR.value, overwrite=None)
    if not _JOIN_DISTRIBUTED.joins():
        import copy

        from sparse_jax import sharding
        from sparse_jax.run import setup

        sharding.set_cpu_devices(flags.FLAGS.cpu_devices)
        setup.complete(copy.deepcopy(_CONFIG.value), _WORKDIR.value, cli.preset_total_steps())


def main(argv):
    _JOIN_DISTRIBUTED()
    from sparse_jax import train

    result = train.train(_CONFIG.value, _WORKDIR.value, cli.preset_total_steps())
    if result["interrupted"]:
        sys.exit(128 + signal.Signals[result["interrupted"]].value)


if __name__ == "__main__":
    cli.run(main, huge_pages=True, check=check)
