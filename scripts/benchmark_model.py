"""Benchmarks a training step (loss and gradients) of a small Sparse Transformer.

  python scripts/benchmark_model.py --output=model_benchmark.json
  python scripts/benchmark_model.py --compile_cifar --output=compile.json

Default: a 4-layer d=256 model at n=8192, strided attention (stride 128, merged) against dense
attention, each with remat off and on, with layers unrolled and scanned (on XLA:CPU remat
only saves memory inside ``scan_layers``). ``--compile_cifar`` instead measures jit lower + compile
of the loss gradient of the paper's 128-layer CIFAR-10 model (batch 1) with and without
``scan_layers``. Every case runs in a fresh subprocess, so its peak RSS (``ru_maxrss``: the
process's whole peak, including the Python/JAX baseline and compilation) is its own. Prints a
markdown table and writes all numbers as JSON to ``--output``. "XLA temp" is the compiled
step's planned buffer memory; a case whose plan exceeds 80% of the available memory is compiled
but not run.
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

from absl import app, flags

_OUTPUT = flags.DEFINE_string("output", None, "Write the results here as JSON.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 8192, "Sequence length.")
_LAYERS = flags.DEFINE_integer("num_layers", 4, "Layers.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Model width.")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Attention heads.")
_STRIDE = flags.DEFINE_integer("stride", 128, "Stride of the strided pattern.")
_BATCH = flags.DEFINE_integer("batch_size", 1, "Sequences per step.")
_STEPS = flags.DEFINE_integer("steps", 3, "Timed steps per case (after one warm-up step).")
_CASES = flags.DEFINE_list(
    "cases", [f"{p}:{r}:{layout}" for p in ("strided", "dense") for layout in ("unrolled", "scan")
              for r in ("none", "full")],
    "pattern:remat:layout triples (layout: unrolled or scan, i.e. scan_layers).")
_COMPILE_CIFAR = flags.DEFINE_bool("compile_cifar", False,
                                   "Measure compile time of the 128-layer CIFAR-10 model.")
_CASE = flags.DEFINE_string("case", None, "Internal: run one case (JSON) and print JSON.")


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KiB on Linux


def _available_gib() -> float:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) / 2 ** 20


def _grad_fn(cfg):
    """Jitted (loss, grads) of a model with config ``cfg``, and the abstract model."""
    import jax
    from flax import nnx

    from sparse_jax import model as model_lib

    abstract = nnx.eval_shape(lambda: model_lib.SparseTransformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)

    def loss(state, tokens):
        logits = nnx.merge(graphdef, state)(tokens[:, :-1])
        return model_lib.loss_bits(logits, tokens[:, 1:])

    return jax.jit(jax.value_and_grad(loss)), abstract


def run_step_case(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparse_jax import model as model_lib

    cfg = model_lib.ModelConfig(**case["model"])
    step, _ = _grad_fn(cfg)
    state = nnx.state(model_lib.SparseTransformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(0), (case["batch_size"], cfg.seq_len + 1), 0, 256,
                                dtype=jnp.int32)
    info = model_lib.describe(cfg, case["batch_size"])
    start = time.perf_counter()
    compiled = step.lower(state, tokens).compile()
    result = {**case, "compile_s": time.perf_counter() - start,
              "xla_temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2 ** 30,
              "estimated_activation_gib": info["activation_bytes" + (
                  "_remat" if cfg.remat != "none" else "")] / 2 ** 30}
    print(json.dumps(result), flush=True)  # survives if the steps run out of memory
    if result["xla_temp_gib"] > 0.8 * _available_gib():  # don't push a shared machine into OOM
        raise SystemExit(f"skipped: XLA plans {result['xla_temp_gib']:.1f} GiB of buffers, "
                         f"{_available_gib():.1f} GiB available")
    jax.block_until_ready(compiled(state, tokens))  # warm-up
    times = []
    for _ in range(case["steps"]):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, tokens))
        times.append(time.perf_counter() - start)
    return {**result, "median_step_s": statistics.median(times), "step_s": times,
            "peak_rss_gib": _peak_rss_gib()}


def run_compile_case(case: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparse_jax import model as model_lib

    cfg = model_lib.ModelConfig(**case["model"])
    step, abstract = _grad_fn(cfg)
    tokens = jax.ShapeDtypeStruct((1, cfg.seq_len + 1), jnp.int32)
    start = time.perf_counter()
    lowered = step.lower(nnx.state(abstract), tokens)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    lowered.compile()
    compile_s = time.perf_counter() - start
    return {**case, "lower_s": lower_s, "compile_s": compile_s, "total_s": lower_s + compile_s,
            "peak_rss_gib": _peak_rss_gib()}


def _subprocess(case: dict) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        os.environ.get("PYTHONPATH"), root]))}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), f"--case={json.dumps(case)}"],
                          capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else dict(case)
    if proc.returncode:
        result["error"] = ("killed (out of memory?)" if proc.returncode == -9 else
                           (proc.stderr.strip().splitlines() or ["?"])[-1][:200])
    return result


def _fmt(result: dict, key: str, spec: str = ".2f") -> str:
    return format(result[key], spec) if key in result else "-"


def main(argv):
    del argv
    if _CASE.value:
        case = json.loads(_CASE.value)
        run = run_compile_case if case["kind"] == "compile" else run_step_case
        print(json.dumps(run(case)))
        return
    results = []
    if _COMPILE_CIFAR.value:
        cifar = dict(seq_len=3072, num_layers=128, d_model=256, num_heads=2, ff_mult=2.0,
                     qk_ratio=0.5, pattern="strided", stride=96, pos_emb="image")
        print("| model | scan_layers | remat | lower s | compile s | peak RSS GiB |")
        print("|---|---|---|---|---|---|")
        for schedule in ("", "local,local,local,strided"):
            for scan in (False, True):
                for remat in ("none", "full"):
                    model = dict(cifar, schedule=schedule, scan_layers=scan, remat=remat)
                    r = _subprocess(dict(kind="compile", model=model))
                    results.append(r)
                    name = f"CIFAR-10 128 layers, {schedule or 'strided merged'}"
                    print(f"| {name} | {scan} | {remat} | {_fmt(r, 'lower_s', '.1f')} | "
                          f"{_fmt(r, 'compile_s', '.1f')} | {_fmt(r, 'peak_rss_gib')} |"
                          + (f" {r['error']}" if "error" in r else ""), flush=True)
    else:
        print(f"{_LAYERS.value} layers, d={_D_MODEL.value}, {_HEADS.value} heads, "
              f"n={_SEQ_LEN.value}, batch {_BATCH.value}, float32, loss + gradients")
        print("| attention | remat | layers | median step s | compile s | peak RSS GiB "
              "| XLA temp GiB | estimated activations GiB |")
        print("|---|---|---|---|---|---|---|---|")
        for name in _CASES.value:
            pattern, remat, layout = name.split(":")
            model = dict(seq_len=_SEQ_LEN.value, num_layers=_LAYERS.value,
                         d_model=_D_MODEL.value, num_heads=_HEADS.value, pattern=pattern,
                         stride=_STRIDE.value, remat=remat, scan_layers=layout == "scan")
            r = _subprocess(dict(kind="step", model=model, batch_size=_BATCH.value,
                                 steps=_STEPS.value))
            results.append(r)
            label = f"strided ({_STRIDE.value})" if pattern == "strided" else pattern
            print(f"| {label} | {remat} | {layout} | {_fmt(r, 'median_step_s')} | "
                  f"{_fmt(r, 'compile_s', '.1f')} | {_fmt(r, 'peak_rss_gib')} | "
                  f"{_fmt(r, 'xla_temp_gib')} | {_fmt(r, 'estimated_activation_gib')} |"
                  + (f" {r['error']}" if "error" in r else ""), flush=True)
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
