r"""Benchmarks the cached sampler against re-running the model, and evaluation throughput.

  python scripts/benchmark_sampling.py --output=sampling_benchmark.json

Sampling: a randomly initialized strided model (default 4 layers, d=256, 4 heads, context 4096,
stride 64) samples --length bytes after a one-byte prompt, (a) with the pattern-aware cache
(`sparse_jax.sample.generate`, one compiled scan) and (b) naively, one jitted full forward pass
over the whole [batch, n] buffer per new byte. The naive way is timed over --naive_steps steps
after a warm-up step and extrapolated linearly to --length steps (its cost per step does not
depend on the position). (c) An estimate of a smarter naive sampler that runs the forward pass
only on a prefix padded to the next power of two: the forward time at each such length, summed
over the steps that would use it.
Evaluation (--eval): a training run of configs/quickstart.py (1 step, embedded data of
20 x --eval_mib MiB, so the test split is --eval_mib MiB) is evaluated with
`sparse_jax.evaluate.evaluate` over the whole test split; its tokens/s is compared with the
forward-only tokens/s of the same jitted eval step on a batch already on the device, and with a
training step's (loss and gradients) tokens/s. Prints markdown tables; writes JSON.
"""

import importlib.util
import json
import os
import tempfile
import time

from absl import app, flags

_OUTPUT = flags.DEFINE_string("output", None, "Write the results here as JSON.")
_LAYERS = flags.DEFINE_integer("num_layers", 4, "Layers.")
_D_MODEL = flags.DEFINE_integer("d_model", 256, "Width.")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Heads.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 4096, "Context n.")
_STRIDE = flags.DEFINE_integer("stride", 64, "Stride of the strided pattern.")
_LENGTH = flags.DEFINE_integer("length", 4096, "Bytes to sample (<= seq_len).")
_BATCH = flags.DEFINE_integer("batch_size", 1, "Samples drawn in parallel.")
_NAIVE_STEPS = flags.DEFINE_integer("naive_steps", 128, "Timed steps of the naive sampler.")
_EVAL = flags.DEFINE_bool("eval", True, "Also benchmark evaluation throughput.")
_EVAL_MIB = flags.DEFINE_integer("eval_mib", 1, "Size of the evaluated split in MiB.")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _timed(fn, *args, repeats=3):
    """(first call seconds, median seconds of `repeats` more calls)."""
    import jax
    import numpy as np

    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return first, float(np.median(times))


def benchmark_sampling() -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from sparse_jax import sample
    from sparse_jax.model import ModelConfig, SparseTransformer

    n, length, batch = _SEQ_LEN.value, _LENGTH.value, _BATCH.value
    cfg = ModelConfig(seq_len=n, num_layers=_LAYERS.value, d_model=_D_MODEL.value,
                      num_heads=_HEADS.value, pattern="strided", stride=_STRIDE.value)
    model = SparseTransformer(cfg, rngs=nnx.Rngs(0))
    prompt = np.zeros((batch, 1), np.int32)
    first, cached_s = _timed(lambda: sample.generate(model, prompt, length, seed=0), repeats=2)

    graphdef, state = nnx.split(model)

    @jax.jit
    def naive_step(state, buffer, i, key):  # one full forward pass per new byte
        logits = jax.lax.dynamic_index_in_dim(nnx.merge(graphdef, state)(buffer), i, 1, False)
        drawn = jax.random.categorical(jax.random.fold_in(key, i), logits).astype(jnp.int32)
        return jax.lax.dynamic_update_index_in_dim(buffer, drawn, i + 1, 1)

    buffer, key = jnp.zeros((batch, n), jnp.int32), jax.random.key(0)
    jax.block_until_ready(naive_step(state, buffer, 0, key))  # compile
    steps = min(_NAIVE_STEPS.value, length - 1)
    start = time.perf_counter()
    for i in range(steps):
        buffer = naive_step(state, buffer, i, key)
    jax.block_until_ready(buffer)
    naive_step_s = (time.perf_counter() - start) / steps

    forward = nnx.jit(lambda m, x: m(x))
    bucket_s, lengths = {}, [min(2 ** k, n) for k in range(6, n.bit_length() + 1)]
    for m in sorted(set(lengths)):
        bucket_s[m] = _timed(forward, model, jnp.zeros((batch, m), jnp.int32))[1]
    fed = np.arange(1, length + 1)  # the smart naive sampler runs a forward over i + 1 bytes
    buckets = np.array(sorted(bucket_s))
    padded = buckets[np.searchsorted(buckets, fed)]
    bucketed_s = float(sum(bucket_s[int(m)] for m in padded))
    naive_total = naive_step_s * length
    return {
        "model": dict(num_layers=cfg.num_layers, d_model=cfg.d_model, num_heads=cfg.num_heads,
                      seq_len=n, stride=cfg.stride, pattern="strided merged", dtype=cfg.dtype),
        "length": length, "batch_size": batch,
        "cached_first_call_s": first, "cached_s": cached_s,
        "cached_ms_per_byte": cached_s / length * 1e3,
        "naive_timed_steps": steps, "naive_ms_per_byte": naive_step_s * 1e3,
        "naive_extrapolated_s": naive_total, "speedup_vs_naive": naive_total / cached_s,
        "bucketed_forward_s": {str(k): v for k, v in bucket_s.items()},
        "bucketed_naive_estimated_s": bucketed_s,
        "speedup_vs_bucketed_naive": bucketed_s / cached_s,
    }


def benchmark_evaluation(workdir: str) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from sparse_jax import evaluate, train
    from sparse_jax.model import loss_bits

    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(
        ROOT, "configs", "quickstart.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("data=embedded")
    config.data.embedded_bytes = 20 * _EVAL_MIB.value * 2**20  # 5% test split = eval_mib MiB
    config.total_steps, config.eval_batches, config.optimizer.warmup_steps = 1, 1, 0
    train.train(config, workdir)

    result = evaluate.evaluate(workdir, "test", progress=False, write=False)
    model, config, _ = evaluate.restore_model(workdir)
    graphdef, params = nnx.split(model)
    batch_size, n = config.batch_size, model.cfg.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (batch_size, n + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "mask": np.ones((batch_size, n), bool)}
    batch = jax.device_put(batch)
    forward = jax.jit(train.make_eval_step(graphdef))
    _, forward_s = _timed(forward, params, batch, repeats=20)

    def loss(params, batch):
        return loss_bits(nnx.merge(graphdef, params)(batch["inputs"]), batch["targets"])

    _, grad_s = _timed(jax.jit(jax.value_and_grad(loss)), params, batch, repeats=10)
    tokens_per_batch = batch_size * n
    return {
        "model": f"configs/quickstart.py ({model.cfg.num_layers} layers, d={model.cfg.d_model}, "
                 f"n={n}, {model.cfg.base_spec})",
        "split_bytes": result["split_size"], "batch_size": batch_size,
        "bits_per_byte": result["bits"], "num_scored": result["num_scored"],
        "eval_tokens_per_s": result["tokens_per_s"], "eval_wall_s": result["wall_s"],
        "forward_only_tokens_per_s": tokens_per_batch / forward_s,
        "train_step_tokens_per_s": tokens_per_batch / grad_s,
        "eval_over_forward_only": result["tokens_per_s"] * forward_s / tokens_per_batch,
    }


def main(argv):
    del argv
    from sparse_jax import benchmarking

    results = {"machine": benchmarking.machine(), "sampling": benchmark_sampling()}
    s = results["sampling"]
    print(f"Sampling {s['length']} bytes x {s['batch_size']}, {s['model']}")
    print(benchmarking.markdown_table([
        {"way": "cached (pattern-aware KV cache, one scan)", "ms": s["cached_ms_per_byte"],
         "total": s["cached_s"], "speedup": 1.0},
        {"way": f"naive full forward per byte (timed {s['naive_timed_steps']} steps, "
                "extrapolated)", "ms": s["naive_ms_per_byte"], "total": s["naive_extrapolated_s"],
         "speedup": s["speedup_vs_naive"]},
        {"way": "naive forward on the prefix padded to 2^k (estimated)",
         "ms": s["bucketed_naive_estimated_s"] / s["length"] * 1e3,
         "total": s["bucketed_naive_estimated_s"], "speedup": s["speedup_vs_bucketed_naive"]}],
        [("way", "sampler"), ("ms", "ms per byte"), ("total", f"s for {s['length']} bytes"),
         ("speedup", "cached is x faster")]))
    print(f"(cached: first call incl. compilation {s['cached_first_call_s']:.1f} s)")
    if _EVAL.value:
        with tempfile.TemporaryDirectory() as workdir:
            results["evaluation"] = e = benchmark_evaluation(os.path.join(workdir, "run"))
        print(f"\nEvaluation of {e['split_bytes']:,} bytes, {e['model']}, batch {e['batch_size']}")
        print(benchmarking.markdown_table([
            {"what": "evaluate() end to end (after the first batch)",
             "tps": e["eval_tokens_per_s"]},
            {"what": "forward only (same jitted step, batch on device)",
             "tps": e["forward_only_tokens_per_s"]},
            {"what": "training step (loss + gradients)", "tps": e["train_step_tokens_per_s"]}],
            [("what", "measured"), ("tps", "tokens/s")]))
        print(f"evaluate / forward-only = {e['eval_over_forward_only']:.2f}; "
              f"{e['bits_per_byte']:.3f} bits/byte over {e['num_scored']:,} bytes in "
              f"{e['eval_wall_s']:.1f} s")
    if _OUTPUT.value:
        with open(_OUTPUT.value, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    app.run(main)
