r"""What context parallelism costs per pattern: the bytes each device sends per layer (forward,
and what the backward adds) and XLA's planned per-device memory of an attention forward +
backward, the sequence split over P simulated CPU devices (sparse_jax/attention/context.py,
costed by sparse_jax/bench/context_costs.py).
Compiles only, unless --time runs and times the forward + backward.

  python scripts/context_parallel.py --n=65536 --devices=1,2,4,8 \
      --output_dir=docs/benchmarks/context_parallel
  python scripts/context_parallel.py --n=1048576 --devices=8,16,64,128 --nomemory  # on paper
  python scripts/context_parallel.py --n=16384 --devices=1,8 --time  # and run: CPU cost
  python scripts/context_parallel.py --model_steps=5 --devices=8 \
      --output_dir=docs/benchmarks/context_parallel/model  # the model trained split and not

--model_steps=S trains the model of configs/bytes.py:size=tiny (2 layers, d=64, context 256,
l=16) for S steps on the same random batches of 8 with each sequence unsplit (seq=1, data
over the devices) and split over P (mesh.seq=P) for each pattern, and reports the largest
relative difference of the losses and gradient norms over the steps (the training step of
sparse_jax.train, as a run takes it).

The process splits its CPU into max(--devices) devices (up to --cpu_devices) before JAX starts;
a P with more devices than that gets bytes only. Writes results.md and results.json to
--output_dir (if given).
"""

import datetime
import json
import os
import sys

from absl import app, flags

from sparse_jax import cli, sharding

_PATTERNS = flags.DEFINE_list("patterns", ["strided", "fixed", "dense"], "Pattern kinds.")
_STRIDE = flags.DEFINE_integer("stride", 128, "l of strided and fixed.", lower_bound=1)
_C = flags.DEFINE_integer("c", 32, "Summary width of fixed.", lower_bound=1)
_N = flags.DEFINE_list("n", ["65536"], "Sequence lengths.")
_DEVICES = flags.DEFINE_list("devices", ["1", "2", "4", "8"], "Device counts P.")
_HEADS = flags.DEFINE_integer("heads", 8, "Attention heads (at most 4,096: XLA's plan of "
                              "2^31 heads aborts the process).", lower_bound=1, upper_bound=4096)
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dimension (at most 4,096).",
                                 lower_bound=1, upper_bound=4096)
_IMPLEMENTATION = flags.DEFINE_enum("implementation", "xla", ["xla", "native", "auto"],
                                    "Term computations (native: XLA does not see the fused "
                                    "kernels' own memory).")
_MEMORY = flags.DEFINE_bool("memory", True, "Compile for the planned memory.")
_TIME = flags.DEFINE_bool("time", False, "Also run the forward + backward and time it (the "
                          "simulated devices share the CPU's cores).")
_MODEL_STEPS = flags.DEFINE_integer("model_steps", 0, "Instead: train the tiny model this many "
                                    "steps split and unsplit (module docstring; at most "
                                    "1,000).", lower_bound=0, upper_bound=1000)
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 8, "Most simulated CPU devices.",
                                    lower_bound=1, upper_bound=sharding.MAX_CPU_DEVICES)
KINDS = ("strided", "fixed", "dense")  # what --patterns takes
_OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where results.md and results.json go.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the results already in "
                               "--output_dir.")


def _specs():
    """The --patterns as PatternSpecs (--stride and --c checked when they are parsed)."""
    from sparse_jax.attention.spec import PatternSpec

    unknown = [kind for kind in _PATTERNS.value if kind not in KINDS]
    if unknown:
        raise app.UsageError(f"--patterns: unknown pattern {unknown[0]!r}; choose from "
                             f"{', '.join(KINDS)}")
    kinds = {"strided": dict(stride=_STRIDE.value), "dense": {},
             "fixed": dict(stride=_STRIDE.value, c=_C.value)}
    try:
        return [PatternSpec(kind, **kinds[kind]) for kind in _PATTERNS.value]
    except ValueError as e:
        raise app.UsageError(f"--stride={_STRIDE.value} --c={_C.value}: {e}") from None


def check(argv):
    """Every flag, before JAX starts or anything compiles or is written."""
    cli.no_arguments(argv)
    devices = cli.integers("devices", _DEVICES.value)
    lengths = cli.integers("n", _N.value)
    _specs()
    if _TIME.value:  # --time runs the attention: q, k, v and the output are allocated
        cli.memory_fits(f"--heads={_HEADS.value:,} x --head_dim={_HEAD_DIM.value:,} at "
                        f"--n={max(lengths):,}: q, k, v and the output", 16 * _HEADS.value
                        * _HEAD_DIM.value * max(lengths), "--heads, --head_dim or --n")
    cli.output_dir("output_dir", _OUTPUT_DIR.value, holds=("results.json", "results.md"),
                   overwrite=_OVERWRITE.value)
    if _MODEL_STEPS.value:
        # the devices first: the checks below start JAX's backends (jax.process_count)
        sharding.set_cpu_devices(min(max(devices), _CPU_DEVICES.value))
        from sparse_jax.bench.context_costs import tiny_config
        from sparse_jax.run import setup

        if max(devices) > _CPU_DEVICES.value:
            raise app.UsageError(f"--model_steps trains on max(--devices)={max(devices)} "
                                 f"devices, more than --cpu_devices={_CPU_DEVICES.value}")
        for pattern in _PATTERNS.value:  # the run's checks: the batch and the split fit
            for p in devices:
                config = tiny_config(pattern, p, _MODEL_STEPS.value)
                try:
                    setup.mesh_shape(config, None, max(devices))
                except ValueError as e:
                    raise app.UsageError(f"--model_steps over --devices={p} (of "
                                         f"{max(devices)}), pattern {pattern}: {e}") from None


def main(argv):
    devices = [int(d) for d in _DEVICES.value]
    sharding.set_cpu_devices(min(max(devices), _CPU_DEVICES.value))
    from sparse_jax.bench import context_costs

    if _MODEL_STEPS.value:
        rows, lines = context_costs.model_rows(_PATTERNS.value, devices, _MODEL_STEPS.value)
        _write(rows, lines, "Context parallelism: the model trained split and unsplit")
        return
    rows = context_costs.cost_rows(_specs(), [int(n) for n in _N.value], devices, _HEADS.value,
                                   _HEAD_DIM.value, implementation=_IMPLEMENTATION.value,
                                   compile_memory=_MEMORY.value, measure_time=_TIME.value)
    command = "python scripts/context_parallel.py " + " ".join(sys.argv[1:])
    date = datetime.date.today().isoformat()
    lines = [f"`{command.strip()}` on {date}: H={_HEADS.value}, d={_HEAD_DIM.value}, batch 1, "
             f"float32, implementation {_IMPLEMENTATION.value}; MiB per device.", "",
             *context_costs.cost_table(rows)]
    print("\n".join(lines))
    _write(rows, lines, "Context parallelism: bytes sent and per-device memory")


def _write(rows, lines, title):
    """results.json and results.md (`title`, the command and date, the table `lines`) in
    --output_dir, if given."""
    if not _OUTPUT_DIR.value:
        return
    command = ("python scripts/context_parallel.py " + " ".join(sys.argv[1:])).strip()
    date = datetime.date.today().isoformat()
    os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
    with open(os.path.join(_OUTPUT_DIR.value, "results.json"), "w") as f:
        json.dump({"date": date, "command": command, "rows": rows}, f, indent=1)
    with open(os.path.join(_OUTPUT_DIR.value, "results.md"), "w") as f:
        if lines[0].startswith("|"):  # the model table: say what was run first
            lines = [f"`{command}` on {date}, simulated CPU devices, float32.", "", *lines]
        f.write(f"# {title}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    cli.run(main, check=check)
