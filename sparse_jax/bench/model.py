"""A small model's training step (loss and gradients, optionally the AdamW update) and the jit
compile time of a large one (scripts/benchmark_model.py).

  benchmark_model       a training step by pattern, remat, layer layout and context length
  benchmark_compile     jit lower + compile of the 128-layer CIFAR-10 model's loss gradient
                        (scripts/benchmark_model.py --compile_cifar)
  run_model_case        one case: `python -m sparse_jax.bench.model CASE_JSON` prints its
                        result as one JSON line

Every case runs in a fresh process (`tools.run_isolated`), so its peak memory is its own.
Nothing here imports JAX before a case has set up its devices.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import sys
import time

from sparse_jax.bench import tools
from sparse_jax.bench.tools import case_bar, log_line
from sparse_jax.model.config import ModelConfig

GIB = 2**30

def step_function(cfg, update: bool = False, activation_sharding=None):
    """(step, abstract model, optimizer): step(state, opt_state, tokens) is jitted and returns
    (loss, grads), or with `update` (loss, new state, new opt_state) after an AdamW update with
    gradient clipping, as training does (state and optimizer state donated).
    `activation_sharding`: the model's (`SparseTransformer.from_embeddings`), e.g. each
    sequence split over a mesh's seq axis."""
    import jax
    import optax
    from flax import nnx

    from sparse_jax.model import transformer as model_lib

    abstract = nnx.eval_shape(lambda: model_lib.SparseTransformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(3e-4, b2=0.95, weight_decay=0.01))

    def loss(state, tokens):
        logits = nnx.merge(graphdef, state)(tokens[:, :-1],
                                            activation_sharding=activation_sharding)
        return model_lib.loss_bits(logits, tokens[:, 1:])

    if not update:
        return jax.jit(lambda state, opt_state, tokens: jax.value_and_grad(loss)(state, tokens)
                       ), abstract, tx

    def train_step(state, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(state, tokens)
        updates, opt_state = tx.update(grads, opt_state, state)
        return value, optax.apply_updates(state, updates), opt_state

    return jax.jit(train_step, donate_argnums=(0, 1)), abstract, tx


def _peak_rss_gib() -> float:
    return tools.peak_rss_gb() * 1e9 / GIB


def run_model_case(case: dict) -> dict:
    """{"kind": "step"}: compiles one training step of case["model"] (ModelConfig fields) on
    random bytes, prints what it knows (compile time, XLA's buffer plan) in case the run goes
    out of memory, then times case["steps"] steps after a warm-up step; a plan over 80% of the
    available memory is not run. With case["trace_dir"], case["trace_steps"] (default 1) more
    steps are traced there (jax.profiler) and "kernel_profile" says where their time went
    (``kernel_profile.summarize``). {"kind": "compile"}: jit lower and compile seconds of the loss
    gradient at batch 1, without running it. case["seq"] > 1: the process's CPU is split into
    that many devices and each sequence's positions over them (a mesh of one seq axis, the
    model's context parallelism); XLA's figures are then per device."""
    from sparse_jax import sharding

    seq = case.get("seq", 1)
    if seq > 1:
        sharding.set_cpu_devices(seq)
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparse_jax.model import transformer as model_lib
    from sparse_jax.run import sizing

    cfg = ModelConfig(**case["model"])
    update = case.get("update", False)
    mesh = sharding.make_mesh(1, 1, seq) if seq > 1 else None
    step, abstract, tx = step_function(cfg, update, mesh and sharding.batch_sharding(mesh))
    if case["kind"] == "compile":
        tokens = jax.ShapeDtypeStruct((1, cfg.seq_len + 1), jnp.int32)
        start = time.perf_counter()
        lowered = step.lower(nnx.state(abstract), None, tokens)
        lower_s = time.perf_counter() - start
        start = time.perf_counter()
        lowered.compile()
        compile_s = time.perf_counter() - start
        return {**case, "lower_s": lower_s, "compile_s": compile_s,
                "total_s": lower_s + compile_s, "peak_rss_gib": _peak_rss_gib()}
    state = nnx.state(model_lib.SparseTransformer(cfg, rngs=nnx.Rngs(0)))
    opt_state = tx.init(state) if update else None
    tokens = jax.random.randint(jax.random.key(0), (case["batch_size"], cfg.seq_len + 1), 0, 256,
                                dtype=jnp.int32)
    if mesh is not None:  # on every device of the mesh (the model splits the activations)
        everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        state, opt_state, tokens = jax.device_put((state, opt_state, tokens), everywhere)
    info = sizing.describe(cfg, case["batch_size"])
    start = time.perf_counter()
    compiled = step.lower(state, opt_state, tokens).compile()
    memory = compiled.memory_analysis()
    result = {**case, "compile_s": time.perf_counter() - start,
              "xla_temp_gib": memory.temp_size_in_bytes / GIB,
              "xla_arguments_gib": memory.argument_size_in_bytes / GIB,
              "estimated_activation_gib": info["activation_bytes" + (
                  "_remat" if cfg.remat != "none" else "")] / GIB}
    print(json.dumps(result), flush=True)  # survives if the steps run out of memory
    available_gib = tools.available_memory_gb() * 1e9 / GIB
    planned = result["xla_temp_gib"] * seq  # every simulated device's, in this process
    if planned > 0.8 * available_gib:  # don't push a shared machine into OOM
        raise SystemExit(f"skipped: XLA plans {planned:.1f} GiB of buffers, "
                         f"{available_gib:.1f} GiB available")
    def run():
        nonlocal state, opt_state
        out = compiled(state, opt_state, tokens)
        if update:
            _, state, opt_state = out
        jax.block_until_ready(out)

    run()  # warm-up
    times = []
    for _ in range(case["steps"]):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    result = {**result, "median_step_s": statistics.median(times), "step_s": times,
              "peak_rss_gib": _peak_rss_gib(),
              "device_peak_gb": tools.device_peak_memory_gb()}
    if case.get("trace_dir"):  # after the timed steps: the trace cannot slow them
        from sparse_jax.bench import kernel_profile

        steps = case.get("trace_steps", 1)
        try:
            kernel_profile.trace_steps(run, steps, case["trace_dir"])
            result["kernel_profile"] = kernel_profile.summarize(
                kernel_profile.kernel_times(case["trace_dir"]), steps)
        except Exception as e:  # noqa: BLE001  the timed steps stand; the profile says why
            result["kernel_profile"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return result


def _fmt(result: dict, key: str, spec: str = ".2f") -> str:
    return format(result[key], spec) if key in result else "-"


def _model_case(case: dict) -> dict:
    """The case's result; a failed case keeps what it printed and says why in "error"."""
    return {**case, **tools.run_isolated(["-m", "sparse_jax.bench.model", json.dumps(case)],
                                         timeout_s=None)}


def _stride(stride, seq_len: int) -> int:
    """An int, or "sqrt": the largest power of two <= sqrt(seq_len) (64 at 4096, 256 at 65,536
    and at 131,072)."""
    return 2 ** (int(math.log2(seq_len)) // 2) if stride == "sqrt" else int(stride)


def check_cases(cases, *, seq_lens=(8192,), num_layers: int = 4, d_model: int = 256,
                num_heads: int = 4, stride="128", dtype: str = "float32",
                seq: int = 1, batch_size: int = 1) -> dict[tuple[int, str], dict]:
    """Every case of `benchmark_model` checked before anything runs (ValueError, one line
    naming the flag): each parses, each model is valid (``ModelConfig``) at each length, and
    with `seq` > 1 each splits its sequence over `seq` devices as a run would
    (``context.check_model_split``), and a step of `batch_size` sequences can fit this machine
    (``sizing.check_fits``). Returns {(seq_len, case): the model's fields}."""
    from sparse_jax.attention import IMPLEMENTATIONS
    from sparse_jax.attention.context import check_model_split
    from sparse_jax.run import sizing

    for name in cases:  # every case parses before anything runs
        parts = name.split(":")
        if (len(parts) not in (3, 4) or parts[2] not in ("unrolled", "scan")
                or parts[3:] and parts[3] not in IMPLEMENTATIONS):
            raise ValueError(f"--cases: {name!r} is not pattern:remat:layout[:attention] (e.g. "
                             "strided:none:unrolled:pallas; layout unrolled or scan, attention "
                             f"one of {', '.join(IMPLEMENTATIONS)})")
    if stride != "sqrt" and not (str(stride).isdigit() and 0 < int(stride) < 2**31):
        raise ValueError(f"--stride must be a positive integer or sqrt, got {stride!r}")
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
        raise ValueError(f"--seq must be a positive integer, got {seq!r}")
    models = {}
    for seq_len, name in itertools.product(sorted(seq_lens), cases):
        pattern, remat, layout, *implementation = name.split(":")
        width = _stride(stride, seq_len)
        model = dict(seq_len=seq_len, num_layers=num_layers, d_model=d_model,
                     num_heads=num_heads, pattern=pattern, stride=width, c=max(1, width // 4),
                     remat=remat, scan_layers=layout == "scan", dtype=dtype,
                     attention=implementation[0] if implementation else "xla")
        try:
            cfg = ModelConfig(**model)
            if seq > 1:
                check_model_split(cfg.specs(), seq_len, seq)
            sizing.check_fits(cfg, batch_size, fields="--batch_size, --seq_len, --d_model or "
                                                      "--num_layers")
        except ValueError as e:
            raise ValueError(f"--cases={name} at --seq_len={seq_len}"
                             + (f" over --seq={seq}" if seq > 1 else "") + f": {e}") from None
        models[seq_len, name] = model
    return models


def benchmark_model(cases, *, seq_lens=(8192,), num_layers: int = 4, d_model: int = 256,
                    num_heads: int = 4, stride="128", batch_size: int = 1, steps: int = 3,
                    dtype: str = "float32", update: bool = False, seq: int = 1,
                    log=log_line) -> list[dict]:
    """A training step of one model for each "pattern:remat:layout[:attention]" in `cases` at
    each length of `seq_lens` (layout: unrolled or scan, i.e. scan_layers; attention:
    ModelConfig.attention, default xla), computing in `dtype`: loss and gradients, plus the
    AdamW update with `update`. `stride`: an int or "sqrt" (`_stride`). A case that fails or
    is skipped at one length is not run at longer ones. `seq` > 1: each sequence split over
    that many simulated CPU devices (`run_model_case`; XLA's figures per device). Logs a
    markdown table row by row and returns every case's numbers."""
    models = check_cases(cases, seq_lens=seq_lens, num_layers=num_layers, d_model=d_model,
                         num_heads=num_heads, stride=stride, dtype=dtype, seq=seq,
                         batch_size=batch_size)
    what = "loss, gradients and AdamW update" if update else "loss + gradients"
    split = f", each sequence split over {seq} CPU devices (XLA per device)" if seq > 1 else ""
    log(f"{num_layers} layers, d={d_model}, {num_heads} heads, batch {batch_size}, {dtype}, "
        f"{what}{split}")
    log("| n | attention | remat | layers | implementation | median step s | compile s "
        "| peak RSS GiB | XLA temp GiB | estimated activations GiB |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    results, failed = [], set()
    with case_bar(len(cases) * len(seq_lens), "model cases") as bar:
        for seq_len, name in itertools.product(sorted(seq_lens), cases):
            pattern, remat, layout, *implementation = name.split(":")
            attention = implementation[0] if implementation else "xla"
            width = _stride(stride, seq_len)
            model = models[seq_len, name]
            case = dict(kind="step", model=model, batch_size=batch_size, steps=steps,
                        update=update, seq=seq)
            r = ({**case, "error": "not run: failed at a shorter length"} if name in failed
                 else _model_case(case))
            if "error" in r:
                failed.add(name)
            results.append(r)
            label = {"strided": f"strided ({width})",
                     "fixed": f"fixed ({width}, c={width // 4})"}.get(pattern, pattern)
            log(f"| {seq_len} | {label} | {remat} | {layout} | {attention} | "
                f"{_fmt(r, 'median_step_s')} | {_fmt(r, 'compile_s', '.1f')} | "
                f"{_fmt(r, 'peak_rss_gib')} | {_fmt(r, 'xla_temp_gib')} | "
                f"{_fmt(r, 'estimated_activation_gib')} |"
                + (f" {r['error']}" if "error" in r else ""))
            bar.update()
    return results


def benchmark_compile(log=log_line) -> list[dict]:
    """Lower + compile seconds of the paper's 128-layer CIFAR-10 model (batch 1), merged strided
    or a local,local,local,strided schedule, with and without scan_layers and remat; logs a
    markdown table row by row and returns every case's numbers."""
    cifar = dict(seq_len=3072, num_layers=128, d_model=256, num_heads=2, ff_mult=2.0,
                 qk_ratio=0.5, pattern="strided", stride=96, pos_emb="image")
    log("| model | scan_layers | remat | lower s | compile s | peak RSS GiB |")
    log("|---|---|---|---|---|---|")
    results = []
    cases = list(itertools.product(("", "local,local,local,strided"), (False, True),
                                   ("none", "full")))
    with case_bar(len(cases), "compile cases") as bar:
        for schedule, scan, remat in cases:
            model = dict(cifar, schedule=schedule, scan_layers=scan, remat=remat)
            r = _model_case(dict(kind="compile", model=model))
            results.append(r)
            name = f"CIFAR-10 128 layers, {schedule or 'strided merged'}"
            log(f"| {name} | {scan} | {remat} | {_fmt(r, 'lower_s', '.1f')} | "
                f"{_fmt(r, 'compile_s', '.1f')} | {_fmt(r, 'peak_rss_gib')} |"
                + (f" {r['error']}" if "error" in r else ""))
            bar.update()
    return results


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m sparse_jax.bench.model CASE_JSON")
    print(json.dumps(run_model_case(json.loads(sys.argv[1]))), flush=True)
