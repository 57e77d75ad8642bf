"""Block-sparse attention against dense causal attention, forward and forward + backward, over
sequence lengths (scripts/benchmark_attention.py).

  benchmark_attention   the driver: every (pattern, seq_len, pass) in a fresh process
                        (`tools.run_isolated`), a `jnp.dot` ceiling per round, tables and a plot
  run_attention_case    one case: `python -m sparse_jax.bench.attention CASE_JSON` prints its
                        result as one JSON line

Nothing here imports JAX before a case has set up its devices.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from sparse_jax.bench import tools
from sparse_jax.bench.tools import case_bar, log_line

# dense@xla / dense@cudnn: jax.nn.dot_product_attention's implementations; dense@chunked: this
# project's dense path (sparse_attention with PatternSpec("dense")); dense@torch: PyTorch's
# fused scaled_dot_product_attention on the CPU, one thread per device, what a user would pick.
DENSE_IMPLEMENTATIONS = ("xla", "cudnn", "chunked", "torch")


def parse_pattern(name: str, seq_len: int, backend: str | None = None):
    """``dense``, ``strided:L``, ``fixed:L:C``, ``local:W``, ``strided:sqrt`` (stride round(√n))
    or a pattern of one's own, ``module:name(k=v, ...)`` (``attention.custom.load``),
    optionally followed by ``@IMPL``, as (PatternSpec, implementation, kernel tiles or None):
    for dense ``@xla`` or ``@cudnn`` (``jax.nn.dot_product_attention``'s; none: its default
    choice), ``@chunked`` (this project's dense path) or ``@torch`` (PyTorch's SDPA), for the
    sparse patterns ``@xla`` (the default), ``@pallas`` or ``@auto``
    (``attention.sparse_attention``). ``@pallas`` takes ``:``-separated kernel options
    (``kernel.BlockSizes``; unnamed ones keep ``backend``'s defaults, by default those of the
    platform traced for: Mosaic's on a TPU), to compare kernels in one sweep: ``QxK`` tiles (Q
    queries by K keys), a variant (``terms`` or ``chained``), ``hG`` heads per program, ``wN``
    Triton warps, ``sN`` Triton stages, ``one_loop`` (one loop over a program's blocks),
    ``bandTxG`` (Mosaic's band kernels; ``band0``: none); e.g. ``strided:128@pallas:128x64``,
    ``strided:128@pallas:64x64:chained:h2``, ``fixed:128:32@pallas:chained:w8:s3``."""
    from sparse_jax.attention import IMPLEMENTATIONS
    from sparse_jax.attention.blocks import BlockSizes
    from sparse_jax.attention.spec import PatternSpec

    name, _, implementation = name.partition("@")
    implementation, *options = implementation.split(":")
    kind, *args = name.split(":")
    allowed = DENSE_IMPLEMENTATIONS if kind == "dense" else IMPLEMENTATIONS
    if implementation and implementation not in allowed:
        raise ValueError(f"pattern {name}@{implementation}: unknown implementation; for {kind} "
                         f"choose from {', '.join(allowed)}")
    implementation = implementation or (None if kind == "dense" else "xla")
    sizes = None
    if options:
        try:
            if implementation != "pallas":
                raise ValueError("kernel options apply to @pallas only")
            from sparse_jax.model.config import kernel_backend

            sizes = BlockSizes.parse(":".join(options),
                                     BlockSizes.for_backend(backend or kernel_backend()))
        except (ValueError, TypeError) as e:
            raise ValueError(f"pattern {name}@{implementation}:{':'.join(options)}: {e} "
                             "(e.g. @pallas:128x64 or @pallas:64x64:chained:h2)") from e
    if args == ["sqrt"]:
        args = [str(round(math.sqrt(seq_len)))]
    from sparse_jax.attention import custom
    from sparse_jax.attention.patterns import KINDS

    if kind not in KINDS and custom.is_named(name):  # a pattern of one's own, module:name(...)
        groups = custom.load(name).groups
        if len(groups) != 1:
            raise ValueError(f"pattern {name!r} has {len(groups)} head groups; the benchmark "
                             "times one pattern: name a one-group pattern")
        return groups[0], implementation, sizes
    try:
        ints = [int(a) for a in args]
        if kind == "fixed":
            spec = PatternSpec("fixed", stride=ints[0], c=ints[1])
        elif kind == "local":
            spec = PatternSpec("local", stride=ints[0], local_width=ints[0])
        else:
            spec = PatternSpec(kind, stride=ints[0] if ints else None)
    except (ValueError, IndexError, TypeError) as e:
        raise ValueError(f"pattern {name!r}: {e}; give dense, strided:L, strided:sqrt, "
                         "fixed:L:C or local:W") from e
    return spec, implementation, sizes


def run_attention_case(case: dict) -> dict:
    """One (pattern, seq_len, pass) with heads split over case["devices"] devices: compile
    seconds, median/min/max ms of case["repeats"] runs, peak RSS and XLA's temporary memory;
    or, for {"matmul": True}, the matmul ceiling in GFLOP/s (in case["dtype"])."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from sparse_jax.attention import sparse_attention

    if case["matmul"]:
        return {"gflops": tools.matmul_gflops(dtype=case["dtype"]),
                "size": tools.matmul_size()}
    n = case["seq_len"]
    spec, implementation, sizes = parse_pattern(case["pattern"], n)
    if implementation == "torch":
        return _run_torch_case(case, spec)
    dtype = jnp.dtype(case["dtype"])
    shape = (case["batch"], n, case["heads"], case["head_dim"])
    mesh = Mesh(jax.devices()[:case["devices"]], ("heads",))
    heads = P(None, None, "heads", None)
    q, k, v = (jax.device_put(jax.random.normal(key, shape, dtype), NamedSharding(mesh, heads))
               for key in jax.random.split(jax.random.PRNGKey(0), 3))
    if spec.kind == "dense" and implementation != "chunked":
        attend = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, implementation=implementation)
    else:
        attend = lambda q, k, v: sparse_attention(  # noqa: E731
            q, k, v, spec, "xla" if implementation == "chunked" else implementation, sizes)
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
    result = tools.time_call(compiled, q, k, v, repeats=case["repeats"])
    result["compile_s"] += compile_s  # compile, then the first run
    return {**result, "peak_rss_gb": tools.peak_rss_gb(), "xla_temp_gb": temp_gb,
            "keys_per_query": spec.mean_keys(n), "spec": str(spec),
            "device_memory_gb": tools.device_peak_memory_gb()}


def _run_torch_case(case: dict, spec) -> dict:
    """The case with PyTorch's causal ``scaled_dot_product_attention`` on the CPU, with as many
    threads as the case has devices; the same result fields (no XLA plan)."""
    import torch

    torch.set_num_threads(case["devices"])
    dtype = getattr(torch, case["dtype"])
    shape = (case["batch"], case["heads"], case["seq_len"], case["head_dim"])
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=generator, dtype=dtype,
                           requires_grad=case["pass"] != "fwd") for _ in range(3))
    attend = torch.nn.functional.scaled_dot_product_attention
    if case["pass"] == "fwd":
        def fn():
            with torch.no_grad():
                return attend(q, k, v, is_causal=True)
    else:
        def fn():
            attend(q, k, v, is_causal=True).float().sum().backward()
    result = tools.time_call(fn, repeats=case["repeats"])
    return {**result, "peak_rss_gb": tools.peak_rss_gb(), "xla_temp_gb": None,
            "keys_per_query": spec.mean_keys(case["seq_len"]), "spec": str(spec),
            "device_memory_gb": None, "torch": torch.__version__}


def default_devices() -> int:
    """One device per core on a CPU, else all local devices."""
    import jax

    return os.cpu_count() if jax.default_backend() == "cpu" else jax.local_device_count()


def benchmark_attention(seq_lens, patterns, *, passes=("fwd", "fwdbwd"), heads: int = 8,
                        head_dim: int = 64, batch: int = 1, dtype: str = "float32",
                        devices: int | None = None, repeats: int = 5, rounds: int = 1,
                        mem_limit_gb: float = 20.0, output_dir: str = "docs/benchmarks/attention",
                        log=log_line) -> dict:
    """Every (pattern, seq_len, pass) `rounds` times, each in a fresh process killed past
    `mem_limit_gb`, with a `jnp.dot` ceiling at each round's start and at the end; reports each
    case's best round (`best_round`), its useful GFLOP/s (4·B·H·n·|S|·d forward, 2.5× that for
    forward + backward) and speed-up over dense. Writes results.json, results.md and
    time_vs_seq_len.png to `output_dir`; returns the JSON."""
    unknown = sorted(set(passes) - {"fwd", "fwdbwd"})
    if unknown:
        raise ValueError(f"--passes: unknown pass(es) {unknown}; choose from fwd, fwdbwd")
    for pattern in patterns:  # every name parses, at every length, before anything runs
        for seq_len in seq_lens:
            parse_pattern(pattern, seq_len)
    os.makedirs(output_dir, exist_ok=True)
    devices = devices or default_devices()
    if heads % devices:
        raise ValueError(f"--heads={heads} cannot be split over {devices} devices")
    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count={devices}".strip()}
    common = dict(heads=heads, head_dim=head_dim, batch=batch, dtype=dtype, devices=devices,
                  repeats=repeats)
    ceiling_case = {"matmul": True, "dtype": dtype}

    def measure_ceiling():
        result = isolated(ceiling_case)
        ceilings.append(result["gflops"])
        return f"jnp.dot {result['size']}² {dtype}"

    def isolated(case):
        return tools.run_isolated(["-m", "sparse_jax.bench.attention", json.dumps(case)],
                                  mem_limit_gb=mem_limit_gb, env=env)

    cases = [{**common, "matmul": False, "pattern": pattern, "seq_len": seq_len, "pass": pass_}
             for pattern in patterns for seq_len in seq_lens for pass_ in passes]
    runs = [[] for _ in cases]  # each case's result in every round
    ceilings = []
    with case_bar(rounds * len(cases), "attention cases") as bar:
        for round_ in range(rounds):
            dot = measure_ceiling()
            log(f"round {round_ + 1}: {dot}: {ceilings[-1]:.0f} GFLOP/s")
            for case, results in zip(cases, runs, strict=True):
                if results and "error" in results[-1]:
                    bar.update()
                    continue  # out of memory (or failed) once is enough
                load = os.getloadavg()[0]  # the machine may be shared: say how busy it was
                results.append({**isolated(case), "load_avg_1min": load})
                r = results[-1]
                log(f"{case['pattern']:>14} n={case['seq_len']:>6} {case['pass']:>6}: " + (
                    f"{r['median_ms']:9.1f} ms  {r['peak_rss_gb']:5.2f} GB RSS  "
                    + (f"{r['xla_temp_gb']:5.2f} GB temp  " if r["xla_temp_gb"] is not None
                       else "") + f"load {load:.1f}"
                    if "median_ms" in r else r["error"]))
                bar.update()
    dot = measure_ceiling()
    ceiling = max(ceilings)  # the best jnp.dot: a busy moment must not flatter the fractions
    log(f"{dot} at the end: {ceilings[-1]:.0f} GFLOP/s")
    rows = [best_round(case, results) for case, results in zip(cases, runs, strict=True)]
    for row in rows:
        if "median_ms" in row:
            flops = 4 * batch * heads * row["seq_len"] * row["keys_per_query"] * head_dim \
                * (2.5 if row["pass"] == "fwdbwd" else 1.0)
            row["gflops"] = flops / (row["median_ms"] / 1e3) / 1e9
            row["of_ceiling"] = row["gflops"] / ceiling
    asked_dense = any(p.split("@")[0] == "dense" for p in patterns)
    missing = []  # (seq_len, pass) where dense was asked for and none was measured
    for row in rows:  # speed-up against the fastest dense at the same seq_len and pass
        dense = [r["median_ms"] for r in rows if r["pattern"].split("@")[0] == "dense"
                 and r["seq_len"] == row["seq_len"] and r["pass"] == row["pass"]
                 and "median_ms" in r]
        if not asked_dense or "median_ms" not in row:
            continue
        row["speedup_vs_dense"] = tools.ratio(min(dense), row["median_ms"]) if dense \
            else tools.NOT_MEASURED
        if not dense and f"dense at n={row['seq_len']} {row['pass']}" not in missing:
            missing.append(f"dense at n={row['seq_len']} {row['pass']}")
    summary = {"machine": tools.machine(), "matmul_gflops": ceiling,
               "baselines_not_measured": missing,
               "matmul_gflops_measured": ceilings, "settings": {**common, "rounds": rounds},
               "rows": rows, "growth": growth_exponents(rows)}
    table = tools.markdown_table([{**r, "result": r.get("error", "ok")} for r in rows], [
        ("pattern", "pattern"), ("seq_len", "n"), ("pass", "pass"), ("median_ms", "ms"),
        ("peak_rss_gb", "peak RSS GB"), ("xla_temp_gb", "XLA temp GB"),
        ("device_memory_gb", "device peak GB"),
        ("keys_per_query", "keys/query"), ("gflops", "GFLOP/s"),
        ("of_ceiling", "of jnp.dot"), ("speedup_vs_dense", "× vs fastest dense"),
        ("load_avg_1min", "load"), ("result", "result")])
    machine = summary["machine"]
    header = (f"Machine: {machine['cpu']}, {machine['cores']} cores, {machine['device']}, jax "
              f"{machine['jax']} ({machine['backend']}); B={batch} H={heads} d={head_dim} "
              f"{dtype}, heads split over {devices} device(s); {rounds} round(s) of every case, "
              f"the round with the lowest median shown; {dot} = {ceiling:.0f} GFLOP/s (best of "
              f"{', '.join(f'{c:.0f}' for c in ceilings)}: each round's start and the end); "
              f"load: the 1-minute load average when the shown round started\n\n")
    growth = tools.markdown_table(summary["growth"], [
        ("pattern", "pattern"), ("pass", "pass"), ("from", "from n"), ("to", "to n"),
        ("exponent", "time ∝ n^x, x =")])
    tools.write_results(output_dir, summary, header + table + "\n\n" + growth + "\n")
    log("\n" + header + table + "\n\n" + growth)
    tools.plot_time_vs_seq_len(rows, os.path.join(output_dir, "time_vs_seq_len.png"))
    return summary


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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m sparse_jax.bench.attention CASE_JSON")
    print(json.dumps(run_attention_case(json.loads(sys.argv[1]))), flush=True)
