"""Cached sampling against re-running the model, and evaluation throughput
(scripts/benchmark_sampling.py). Both run in this process, one after the other.

  sampling_speed        `decode.generate` (pattern-aware cache, one scan) against a full forward
                        pass per new byte, and against a sampler that re-runs padded prefixes
  evaluation_speed      `evaluate.evaluate` over a whole split against the forward-only rate
  benchmark_sampling    both, as tables and JSON
"""

from __future__ import annotations

import json
import os
import time

from sparse_jax.bench import tools
from sparse_jax.bench.tools import log_line

EVAL_CONFIG = "quickstart.py:data=embedded"  # a spec for configs.load: the evaluated run


def _seconds(timing: dict) -> tuple[float, float]:
    """(first call s, median s of the repeats) of a `tools.time_call` result."""
    return timing["compile_s"], timing["median_ms"] / 1e3


def sampling_speed(*, seq_len: int = 4096, num_layers: int = 4, d_model: int = 256,
                   num_heads: int = 4, stride: int = 64, length: int = 4096, batch_size: int = 1,
                   naive_steps: int = 128, workdir: str | None = None) -> dict:
    """A randomly initialized strided model (or with `workdir`, the latest checkpoint of that
    run, whose config then replaces the model arguments) samples `length` bytes after a one-byte
    prompt:
    (a) with `decode.generate` (pattern-aware cache, one scan), first call and median of 2
    more; (b) naively, one jitted full forward pass over the [batch, seq_len] buffer per new
    byte, timed over `naive_steps` steps after a warm-up step and extrapolated linearly to
    `length` (its cost does not depend on the position); (c) estimated: a forward pass over
    the prefix padded to the next power of two, the median forward time at each such length
    summed over the steps that would use it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from sparse_jax.model import decode
    from sparse_jax.model.config import ModelConfig
    from sparse_jax.model.transformer import SparseTransformer

    if workdir is not None:
        from sparse_jax.run import checkpoints

        model, _, step = checkpoints.restore_model(workdir)
        cfg, trained = model.cfg, {"workdir": workdir, "step": int(step)}
    else:
        cfg = ModelConfig(seq_len=seq_len, num_layers=num_layers, d_model=d_model,
                          num_heads=num_heads, pattern="strided", stride=stride)
        model, trained = SparseTransformer(cfg, rngs=nnx.Rngs(0)), {}
    n, batch = cfg.seq_len, batch_size
    if not 1 <= length <= n:
        raise ValueError(f"length must be in [1, seq_len={n}], got {length}")
    prompt = np.zeros((batch, 1), np.int32)
    first, cached_s = _seconds(tools.time_call(
        lambda: decode.generate(model, prompt, length, seed=0), repeats=2))

    graphdef, state = nnx.split(model)

    @jax.jit
    def naive_step(state, buffer, i, key):  # one full forward pass per new byte
        logits = jax.lax.dynamic_index_in_dim(nnx.merge(graphdef, state)(buffer), i, 1, False)
        drawn = jax.random.categorical(jax.random.fold_in(key, i), logits).astype(jnp.int32)
        return jax.lax.dynamic_update_index_in_dim(buffer, drawn, i + 1, 1)

    buffer, key = jnp.zeros((batch, n), jnp.int32), jax.random.key(0)
    jax.block_until_ready(naive_step(state, buffer, 0, key))  # compile
    steps = min(naive_steps, length - 1)
    start = time.perf_counter()
    for i in range(steps):
        buffer = naive_step(state, buffer, i, key)
    jax.block_until_ready(buffer)
    naive_step_s = (time.perf_counter() - start) / steps

    forward = nnx.jit(lambda m, x: m(x))
    bucket_s, lengths = {}, [min(2 ** k, n) for k in range(6, n.bit_length() + 1)]
    for m in sorted(set(lengths)):
        bucket_s[m] = _seconds(tools.time_call(
            forward, model, jnp.zeros((batch, m), jnp.int32), repeats=3))[1]
    fed = np.arange(1, length + 1)  # the smart naive sampler runs a forward over i + 1 bytes
    buckets = np.array(sorted(bucket_s))
    padded = buckets[np.searchsorted(buckets, fed)]
    bucketed_s = float(sum(bucket_s[int(m)] for m in padded))
    naive_total = naive_step_s * length
    return {
        "model": dict(num_layers=cfg.num_layers, d_model=cfg.d_model, num_heads=cfg.num_heads,
                      seq_len=n, stride=cfg.stride, pattern=f"{cfg.base_spec} {cfg.mode}",
                      dtype=cfg.dtype, **trained),
        "length": length, "batch_size": batch,
        "cached_first_call_s": first, "cached_s": cached_s,
        "cached_ms_per_byte": cached_s / length * 1e3,
        "naive_timed_steps": steps, "naive_ms_per_byte": naive_step_s * 1e3,
        "naive_extrapolated_s": naive_total, "speedup_vs_naive": naive_total / cached_s,
        "bucketed_forward_s": {str(k): v for k, v in bucket_s.items()},
        "bucketed_naive_estimated_s": bucketed_s,
        "speedup_vs_bucketed_naive": bucketed_s / cached_s,
    }


def evaluation_speed(workdir: str, eval_mib: int = 1) -> dict:
    """Trains `EVAL_CONFIG` for 1 step in `workdir` (embedded data of 20 x `eval_mib` MiB, so
    the test split is `eval_mib` MiB) and evaluates it with `evaluate.evaluate` over the whole
    test split; its tokens/s next to the forward-only tokens/s of the same jitted eval step on a
    batch already on the device (median of 20) and a training step's (loss and gradients,
    median of 10)."""
    import jax
    import numpy as np
    from flax import nnx

    import configs
    from sparse_jax import evaluate, train
    from sparse_jax.model.transformer import loss_bits
    from sparse_jax.run import checkpoints

    config = configs.load(EVAL_CONFIG, {
        "data.embedded_bytes": 20 * eval_mib * 2**20,  # 5% test split = eval_mib MiB
        "total_steps": 1, "eval_batches": 1, "optimizer.warmup_steps": 0})
    train.train(config, workdir)

    result = evaluate.evaluate(workdir, "test", progress=False, write=False)
    model, config, _ = checkpoints.restore_model(workdir)
    graphdef, params = nnx.split(model)
    batch_size, n = config.batch_size, model.cfg.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (batch_size, n + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "mask": np.ones((batch_size, n), bool)}
    batch = jax.device_put(batch)
    forward = jax.jit(evaluate.make_eval_step(graphdef))
    _, forward_s = _seconds(tools.time_call(forward, params, batch, repeats=20))

    def loss(params, batch):
        return loss_bits(nnx.merge(graphdef, params)(batch["inputs"]), batch["targets"])

    _, grad_s = _seconds(tools.time_call(jax.jit(jax.value_and_grad(loss)), params, batch,
                                         repeats=10))
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


def benchmark_sampling(*, evaluation: bool = True, eval_mib: int = 1, output: str | None = None,
                       log=log_line, **sampling) -> dict:
    """`sampling_speed(**sampling)`, then (if `evaluation`) `evaluation_speed` of a run in a
    temporary folder; logs markdown tables, writes {"machine", "sampling", "evaluation"} as
    JSON to `output` and returns it."""
    import tempfile

    results = {"machine": tools.machine(), "sampling": sampling_speed(**sampling)}
    s = results["sampling"]
    log(f"Sampling {s['length']} bytes x {s['batch_size']}, {s['model']}")
    log(tools.markdown_table([
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
    log(f"(cached: first call incl. compilation {s['cached_first_call_s']:.1f} s)")
    if evaluation:
        with tempfile.TemporaryDirectory() as workdir:
            results["evaluation"] = e = evaluation_speed(os.path.join(workdir, "run"), eval_mib)
        log(f"\nEvaluation of {e['split_bytes']:,} bytes, {e['model']}, batch {e['batch_size']}")
        log(tools.markdown_table([
            {"what": "evaluate() end to end (after the first batch)",
             "tps": e["eval_tokens_per_s"]},
            {"what": "forward only (same jitted step, batch on device)",
             "tps": e["forward_only_tokens_per_s"]},
            {"what": "training step (loss + gradients)", "tps": e["train_step_tokens_per_s"]}],
            [("what", "measured"), ("tps", "tokens/s")]))
        log(f"evaluate / forward-only = {e['eval_over_forward_only']:.2f}; "
            f"{e['bits_per_byte']:.3f} bits/byte over {e['num_scored']:,} bytes in "
            f"{e['eval_wall_s']:.1f} s")
    if output:
        with open(output, "w") as f:
            json.dump(results, f, indent=1)
    return results


