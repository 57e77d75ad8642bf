"""Benchmarks block-sparse attention against dense causal attention.

  python scripts/benchmark_attention.py --seq_lens=4096,8192,12288,16384 \
      --patterns=dense,strided:128,fixed:128:32,strided:sqrt --repeats=3 --rounds=2 \
      --mem_limit_gb=14 --output_dir=docs/benchmarks/attention

Patterns: ``dense`` (``jax.nn.dot_product_attention(..., is_causal=True)``), ``strided:L``,
``fixed:L:C``, ``local:W`` and ``strided:sqrt`` (stride round(√n)). Every (pattern, seq_len,
pass) runs in a fresh process: median time over ``--repeats`` runs after compile, the peak RSS of
that process and the temporary memory XLA planned for the compiled step (all devices together).
Useful GFLOP/s counts 4·B·H·n·|S|·d for the forward pass (|S| the mean number of attended keys)
and 2.5× that for forward+backward, also given as a fraction of a 4096×4096 float32 ``jnp.dot``
measured in the same run. On a shared machine, ``--rounds=R`` runs the whole sweep R times and
reports for each case the round with the lowest median (all rounds' medians are in
results.json), with the best ``jnp.dot`` of the rounds as the ceiling; each row records the
1-minute load average when its round started.

``--devices=N`` splits the heads over N devices with ``shard_map`` (the layout a GPU/TPU mesh
would use); every pattern, dense included, runs with the same N. The default is one device per
CPU core on a CPU (N host-platform devices) and all local devices otherwise: XLA:CPU runs the
many small matmuls of a batched dot one after another on one core, so one device leaves the
other cores mostly idle, while the ``jnp.dot`` ceiling uses them all. ``--devices=1`` measures
one device. Writes results.json, results.md and time_vs_seq_len.png to ``--output_dir``.
"""

import json
import math
import os
import pathlib
import time

from absl import app, flags

_SEQ_LENS = flags.DEFINE_list("seq_lens", ["4096", "8192", "16384"], "Sequence lengths.")
_PATTERNS = flags.DEFINE_list("patterns", ["dense", "strided:128", "fixed:128:32"], "Patterns.")
_PASSES = flags.DEFINE_list("passes", ["fwd", "fwdbwd"], "fwd and/or fwdbwd.")
_HEADS = flags.DEFINE_integer("heads", 8, "Attention heads.")
_HEAD_DIM = flags.DEFINE_integer("head_dim", 64, "Head dimension.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Input dtype.")
_DEVICES = flags.DEFINE_integer(
    "devices", None, "Split heads over this many devices (default: one per core on a CPU, else "
    "all local devices).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed runs per case (median reported).")
_ROUNDS = flags.DEFINE_integer(
    "rounds", 1, "Times every case runs (a fresh process each, interleaved with the other "
    "cases); the round with the lowest median is reported.")
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
    heads = P(None, None, "heads", None)
    q, k, v = (jax.device_put(jax.random.normal(key, shape, dtype), NamedSharding(mesh, heads))
               for key in jax.random.split(jax.random.PRNGKey(0), 3))
    if spec.kind == "dense":
        attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    else:
        attend = lambda q, k, v: sparse_attention(q, k, v, spec)  # noqa: E731
    if case["devices"] > 1:  # each device attends with its own heads
        attend = jax.shard_map(attend, mesh=mesh, in_specs=(heads,) * 3, out_specs=heads)
    if case["pass"] == "fwd":
        fn = jax.jit(attend)
    else:
        fn = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(),
                              argnums=(0, 1, 2)))
    start = time.perf_counter()
    compiled = fn.lower(q, k, v).compile()
    compile_s = time.perf_counter() - start
    temp_gb = compiled.memory_analysis().temp_size_in_bytes * case["devices"] / 1e9  # per device
    result = benchmarking.time_call(compiled, q, k, v, repeats=case["repeats"])
    result["compile_s"] += compile_s  # compile, then the first run
    return {**result, "peak_rss_gb": benchmarking.peak_rss_gb(), "xla_temp_gb": temp_gb,
            "keys_per_query": spec.mean_keys(n), "spec": str(spec)}


def default_devices() -> int:
    import jax

    return os.cpu_count() if jax.default_backend() == "cpu" else jax.local_device_count()


def main(argv):
    del argv
    if _CASE.value:
        print(json.dumps(run_case(json.loads(_CASE.value))))
        return
    from sparse_jax import benchmarking

    out_dir = pathlib.Path(_OUTPUT_DIR.value)
    out_dir.mkdir(parents=True, exist_ok=True)
    devices = _DEVICES.value or default_devices()
    if _HEADS.value % devices:
        raise app.UsageError(f"--heads={_HEADS.value} cannot be split over {devices} devices")
    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count={devices}".strip()}
    common = dict(heads=_HEADS.value, head_dim=_HEAD_DIM.value, batch=_BATCH.value,
                  dtype=_DTYPE.value, devices=devices, repeats=_REPEATS.value)
    script = os.path.abspath(__file__)

    def isolated(case):
        return benchmarking.run_isolated([script, "--case", json.dumps(case)],
                                         mem_limit_gb=_MEM_LIMIT.value, env=env)

    cases = [{**common, "matmul": False, "pattern": pattern, "seq_len": seq_len, "pass": pass_}
             for pattern in _PATTERNS.value for seq_len in map(int, _SEQ_LENS.value)
             for pass_ in _PASSES.value]
    runs = [[] for _ in cases]  # each case's result in every round
    ceilings = []
    for round_ in range(_ROUNDS.value):
        ceilings.append(isolated({"matmul": True})["gflops"])
        print(f"round {round_ + 1}: jnp.dot 4096x4096 float32: {ceilings[-1]:.0f} GFLOP/s")
        for case, results in zip(cases, runs):
            if results and "error" in results[-1]:
                continue  # out of memory (or failed) once is enough
            load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
            results.append({**isolated(case), "load_avg_1min": load})
            r = results[-1]
            print(f"{case['pattern']:>14} n={case['seq_len']:>6} {case['pass']:>6}: " + (
                f"{r['median_ms']:9.1f} ms  {r['peak_rss_gb']:5.2f} GB RSS  "
                f"{r['xla_temp_gb']:5.2f} GB temp  load {load:.1f}"
                if "median_ms" in r else r["error"]), flush=True)
    ceilings.append(isolated({"matmul": True})["gflops"])
    ceiling = max(ceilings)  # the best jnp.dot: a busy moment must not flatter the fractions
    print(f"jnp.dot 4096x4096 float32 at the end: {ceilings[-1]:.0f} GFLOP/s")
    rows = [best_round(case, results) for case, results in zip(cases, runs)]
    for row in rows:
        if "median_ms" in row:
            flops = 4 * _BATCH.value * _HEADS.value * row["seq_len"] * row["keys_per_query"] \
                * _HEAD_DIM.value * (2.5 if row["pass"] == "fwdbwd" else 1.0)
            row["gflops"] = flops / (row["median_ms"] / 1e3) / 1e9
            row["of_ceiling"] = row["gflops"] / ceiling
    for row in rows:  # speed-up against dense at the same seq_len and pass
        dense = next((r for r in rows if r["pattern"] == "dense" and r["seq_len"] == row["seq_len"]
                      and r["pass"] == row["pass"] and "median_ms" in r), None)
        if dense and "median_ms" in row:
            row["speedup_vs_dense"] = dense["median_ms"] / row["median_ms"]
    summary = {"machine": benchmarking.machine(), "matmul_gflops": ceiling,
               "matmul_gflops_measured": ceilings, "settings": {**common, "rounds": _ROUNDS.value},
               "rows": rows, "growth": growth_exponents(rows)}
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1))
    for row in rows:
        row["result"] = row.get("error", "ok")
    table = benchmarking.markdown_table(rows, [
        ("pattern", "pattern"), ("seq_len", "n"), ("pass", "pass"), ("median_ms", "ms"),
        ("peak_rss_gb", "peak RSS GB"), ("xla_temp_gb", "XLA temp GB"),
        ("keys_per_query", "keys/query"), ("gflops", "GFLOP/s"),
        ("of_ceiling", "of jnp.dot"), ("speedup_vs_dense", "× vs dense"),
        ("load_avg_1min", "load"), ("result", "result")])
    header = (f"Machine: {summary['machine']['cpu']}, {summary['machine']['cores']} cores, "
              f"jax {summary['machine']['jax']} ({summary['machine']['backend']}); "
              f"B={_BATCH.value} H={_HEADS.value} d={_HEAD_DIM.value} {_DTYPE.value}, "
              f"heads split over {devices} device(s); {_ROUNDS.value} round(s) of every case, the "
              f"round with the lowest median shown; jnp.dot 4096² = {ceiling:.0f} GFLOP/s (best "
              f"of {', '.join(f'{c:.0f}' for c in ceilings)}: each round's start and the end); "
              f"load: the 1-minute load average when the shown round started\n\n")
    growth = benchmarking.markdown_table(growth_exponents(rows), [
        ("pattern", "pattern"), ("pass", "pass"), ("from", "from n"), ("to", "to n"),
        ("exponent", "time ∝ n^x, x =")])
    (out_dir / "results.md").write_text(header + table + "\n\n" + growth + "\n")
    print("\n" + header + table + "\n\n" + growth)
    plot(rows, out_dir / "time_vs_seq_len.png")


def best_round(case: dict, results: list[dict]) -> dict:
    """The round with the lowest median time (on a shared machine, the least disturbed one),
    with every round's median and the highest peak RSS of all rounds."""
    done = [r for r in results if "median_ms" in r]
    if not done:
        return {**case, **results[-1]}
    best = min(done, key=lambda r: r["median_ms"])
    return {**case, **best, "peak_rss_gb": max(r["peak_rss_gb"] for r in done),
            "round_medians_ms": [r["median_ms"] for r in done]}


def growth_exponents(rows) -> list[dict]:
    """x in time ∝ n^x between the shortest and the longest n that ran, per pattern and pass."""
    out = []
    for pattern in dict.fromkeys(r["pattern"] for r in rows):
        for pass_ in dict.fromkeys(r["pass"] for r in rows):
            pts = sorted((r["seq_len"], r["median_ms"]) for r in rows
                         if r["pattern"] == pattern and r["pass"] == pass_ and "median_ms" in r)
            if len(pts) >= 2 and pts[0][0] < pts[-1][0]:
                (n0, t0), (n1, t1) = pts[0], pts[-1]
                out.append({"pattern": pattern, "pass": pass_, "from": n0, "to": n1,
                            "exponent": math.log(t1 / t0) / math.log(n1 / n0)})
    return out


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
    ax.set_ylabel("seconds (median of the best round)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    app.run(main)
