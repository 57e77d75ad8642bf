"""Benchmarks block-sparse attention against dense causal attention.

  python scripts/benchmark_attention.py --seq_lens=4096,8192,16384 \
      --patterns=dense,strided:128,fixed:128:32,strided:sqrt --output_dir=docs/benchmarks/attention

Patterns: ``dense`` (``jax.nn.dot_product_attention(..., is_causal=True)``), ``strided:L``,
``fixed:L:C``, ``local:W`` and ``strided:sqrt`` (stride round(√n)). Every (pattern, seq_len,
pass) runs in a fresh process: median time over ``--repeats`` runs after compile and the peak
RSS of that process. Useful GFLOP/s counts 4·B·H·n·|S|·d for the forward pass (|S| the mean
number of attended keys) and 2.5× that for forward+backward, also given as a fraction of a
4096×4096 float32 ``jnp.dot`` measured in the same run. ``--devices=N`` splits heads over N
devices (on CPU: N host-platform devices, one per core), the same sharding a GPU/TPU mesh uses.
Writes results.json, results.md and time_vs_seq_len.png to ``--output_dir``.
"""

import json
import math
import os
import pathlib

from absl import app, flags

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["4096", "8192", "16384"], "Sequence lengths.")
_PATTERNS = flags.DEFINE_list("patterns", ["dense", "strided:128", "fixed:128:32"], "Patterns.")
_PASSES = flags.DEFINE_list("passes", ["fwd", "fwdbwd"], "fwd and/or fwdbwd.")
_HEADS = flags.DEFINE_integer("heads", 8, "Attention heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dimension.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Input dtype.")
_DEVICES = flags.DEFINE_integer("devices", 1, "Split heads over this many devices.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per case (median reported).")
_MEM_LIMIT = flags.DEFINE_float("mem_limit_gb", 20.0, "Kill a case whose RSS passes this.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "docs/benchmarks/attention", "Where results go.")
_CASE = flags.DEFINE_string("case", None, "Internal: run one JSON-encoded case and print JSON.")


def parse_pattern(name: str, seq_len: int):
    from sparse_jax.attention import PatternSpec

    kind, *args = name.split(":")
    if args == ["sqrt"]:
        args = [str(round(math.sqrt(seq_len)))]
    ints = [int(a) for a in args]
    if kind == "fixed":
        return PatternSpec("fixed", stride=ints[0], c=ints[1])
    if kind == "local":
        return PatternSpec("local", stride=ints[0], local_width=ints[0])
    return PatternSpec(kind, stride=ints[0] if ints else None)


def run_case(case: dict) -> dict:
    """Runs in the child process."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from sparse_jax import benchmarking
    from sparse_jax.attention import sparse_attention

    if case["matmul"]:
        return {"gflops": benchmarking.matmul_gflops()}
    n, spec = case["seq_len"], parse_pattern(case["pattern"], case["seq_len"])
    dtype = jnp.dtype(case["dtype"])
    shape = (case["batch"], n, case["heads"], case["head_dim"])
    mesh = Mesh(jax.devices()[:case["devices"]], ("heads",))
    sharding = NamedSharding(mesh, P(None, None, "heads", None))
    q, k, v = (jax.device_put(jax.random.normal(key, shape, dtype), sharding)
               for key in jax.random.split(jax.random.PRNGKey(0), 3))
    if spec.kind == "dense":
        attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    else:
        attend = lambda q, k, v: sparse_attention(q, k, v, spec)  # noqa: E731
    if case["pass"] == "fwd":
        fn = jax.jit(attend)
    else:
        fn = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
                              argnums=(0, 1, 2)))
    result = benchmarking.time_call(fn, q, k, v, repeats=case["repeats"])
    return {**result, "peak_rss_gb": benchmarking.peak_rss_gb(), "keys_per_query": spec.mean_keys(n),
            "spec": str(spec)}


def main(argv):
    del argv
    if _CASE.value:
        print(json.dumps(run_case(json.loads(_CASE.value))))
        return
    from sparse_jax import benchmarking

    out_dir = pathlib.Path(_OUTPUT_DIR.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count={_DEVICES.value}".strip()}
    common = dict(heads=_HEADS.value, head_dim=_HEAD_DIM.value, batch=_BATCH.value,
                  dtype=_DTYPE.value, devices=_DEVICES.value, repeats=_REPEATS.value)
    script = os.path.abspath(__file__)

    def isolated(case):
        return benchmarking.run_isolated([script, "--case", json.dumps(case)],
                                         mem_limit_gb=_MEM_LIMIT.value, env=env)

    ceiling = isolated({"matmul": True})["gflops"]
    print(f"jnp.dot 4096x4096 float32: {ceiling:.0f} GFLOP/s")
    rows = []
    for pattern in _PATTERNS.value:
        for seq_len in map(int, _SEQ_LENS.value):
            for pass_ in _PASSES.value:
                case = {**common, "matmul": False, "pattern": pattern, "seq_len": seq_len,
                        "pass": pass_}
                result = isolated(case)
                row = {**case, **result}
                if "median_ms" in result:
                    flops = 4 * _BATCH.value * _HEADS.value * seq_len * result["keys_per_query"] \
                        * _HEAD_DIM.value * (2.5 if pass_ == "fwdbwd" else 1.0)
                    row["gflops"] = flops / (result["median_ms"] / 1e3) / 1e9
                    row["of_ceiling"] = row["gflops"] / ceiling
                rows.append(row)
                print(f"{pattern:>14} n={seq_len:>6} {pass_:>6}: " + (
                    f"{result['median_ms']:9.1f} ms  {result['peak_rss_gb']:5.2f} GB  "
                    f"{row['gflops']:6.1f} GFLOP/s ({row['of_ceiling']:.1%})"
                    if "median_ms" in result else result["error"]), flush=True)
    for row in rows:  # speed-up against dense at the same seq_len and pass
        dense = next((r for r in rows if r["pattern"] == "dense" and r["seq_len"] == row["seq_len"]
                      and r["pass"] == row["pass"] and "median_ms" in r), None)
        if dense and "median_ms" in row:
            row["speedup_vs_dense"] = dense["median_ms"] / row["median_ms"]
    summary = {"machine": benchmarking.machine(), "matmul_gflops": ceiling, "settings": common,
               "rows": rows}
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1))
    for row in rows:
        row["result"] = row.get("error", "ok")
    table = benchmarking.markdown_table(rows, [
        ("pattern", "pattern"), ("seq_len", "n"), ("pass", "pass"), ("median_ms", "ms"),
        ("peak_rss_gb", "peak RSS GB"), ("keys_per_query", "keys/query"), ("gflops", "GFLOP/s"),
        ("of_ceiling", "of jnp.dot"), ("speedup_vs_dense", "× vs dense"), ("result", "result")])
    header = (f"Machine: {summary['machine']['cpu']}, {summary['machine']['cores']} cores, "
              f"jax {summary['machine']['jax']} ({summary['machine']['backend']}); "
              f"B={_BATCH.value} H={_HEADS.value} d={_HEAD_DIM.value} {_DTYPE.value}, "
              f"{_DEVICES.value} device(s); jnp.dot 4096² = {ceiling:.0f} GFLOP/s\n\n")
    (out_dir / "results.md").write_text(header + table + "\n")
    print("\n" + header + table)
    plot(rows, out_dir / "time_vs_seq_len.png")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for pattern in dict.fromkeys(r["pattern"] for r in rows):
        for pass_, style in [("fwd", "--"), ("fwdbwd", "-")]:
            pts = [(r["seq_len"], r["median_ms"] / 1e3) for r in rows
                   if r["pattern"] == pattern and r["pass"] == pass_ and "median_ms" in r]
            if pts:
                ax.plot(*zip(*pts), style, marker="o", label=f"{pattern} {pass_}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("seconds (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    app.run(main)
