"""The attention stage's rows beyond ``parse_pattern``'s: jax's own FlashAttention-3 on the Mosaic
GPU backend (``jax.experimental.pallas.ops.gpu.attention_mgpu``: TMA, wgmma, warp
specialization), dense causal, beside cuDNN's fused attention, so that a report says how close
a Pallas kernel gets to cuDNN on the same GPU; and forward-only rows (``:fwd``), since the
kernel's backward may be refused where its forward runs.

  dense@mgpu        forward + backward (``attention_mgpu.attention`` and its custom VJP)
  dense@mgpu:fwd    forward only
  dense@cudnn:fwd   cuDNN's forward only: the base of ``dense@mgpu:fwd``
  PATTERN:fwd       any pattern ``parse_pattern`` takes, forward only

jax's kernel refuses some cases itself: causal masking under CUDA runtimes 12.8-12.9 (a ptxas
miscompilation), the causal backward in jax 0.10, bfloat16 where its float16 scratch meets it
(then the row runs in float16 and says so). A row it refuses, or that cannot run here (no
NVIDIA GPU), says "not measured: <why>" (``not_measured``): it is never a ratio's base and does
not make the stage partial, as it measures jax's kernel, not this project's. The kernel does
not scale the scores by 1/√d: q is scaled before it (one elementwise pass, as cuDNN's own
``scale`` argument does inside its kernel)."""

from __future__ import annotations

import math

# attention_mgpu's tiles: its own benchmark's (block_q 64, block_kv 128, two stages in
# flight), and the backward's four tiles at 64 (compiled for an H100 on a CPU, 2026-11-29)
TUNING = dict(block_q=64, block_kv=128, max_concurrent_steps=2, block_q_dkv=64,
              block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
ROWS = ["dense@mgpu", "dense@mgpu:fwd", "dense@cudnn:fwd"]


def split(pattern: str) -> tuple[str, bool]:
    """(the pattern without ``:fwd``, whether forward only)."""
    return (pattern[:-4], True) if pattern.endswith(":fwd") else (pattern, False)


def is_mgpu(pattern: str) -> bool:
    return split(pattern)[0] == "dense@mgpu"


def unavailable() -> str | None:
    """Why the Mosaic GPU kernel cannot run on this machine's first device, or None."""
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu" or "NVIDIA" not in device.device_kind:
        return (f"Mosaic GPU kernels run on an NVIDIA Hopper GPU; this machine's device is "
                f"{device.device_kind or device.platform}")
    return None


def attend(dtype):
    """Dense causal attention through ``attention_mgpu`` in `dtype` (float16 or bfloat16),
    [B, n, H, d] in and out in the inputs' dtype."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(causal=True, **TUNING)

    def fn(q, k, v):
        scale = jnp.asarray(1 / math.sqrt(q.shape[-1]), q.dtype)
        out = attention_mgpu.attention((q * scale).astype(dtype), k.astype(dtype),
                                       v.astype(dtype), config)
        return out.astype(q.dtype)
    return fn


def compile_row(row: dict, build, q, k, v):
    """Compiles a dense@mgpu row: ``build(attend_fn)`` gives the jitted function to compile.
    bfloat16 first; where the kernel refuses it for its float16 scratch, float16 (the row's
    "dtype" and "note" say so). Returns the compiled function, or None with
    row["not_measured"] set."""
    import jax.numpy as jnp

    from sparse_jax.bench.accelerator.common import one_line

    why = unavailable()
    if why:
        row["not_measured"] = why
        return None
    try:
        compiled = build(attend(jnp.bfloat16)).lower(q, k, v).compile()
        row["dtype"] = "bfloat16"
        return compiled
    except Exception as e:  # noqa: BLE001  jax's kernel refuses: say why
        first = one_line(e)
    if "float16" not in first:
        row["not_measured"] = first
        return None
    try:
        compiled = build(attend(jnp.float16)).lower(q, k, v).compile()
        row.update(dtype="float16", note=f"bfloat16 refused: {first[:150]}")
        return compiled
    except Exception as e:  # noqa: BLE001
        row["not_measured"] = f"{one_line(e)} (bfloat16: {first[:120]})"
        return None


def summary_lines(rows: list[dict]) -> list[str]:
    """One line per length with a Mosaic GPU row: its time against cuDNN's, forward + backward
    and forward only, or why it was not measured."""
    lines = []
    for n in sorted({r["seq_len"] for r in rows if is_mgpu(r["pattern"])}):
        at = {r["pattern"]: r for r in rows if r["seq_len"] == n}
        parts = []
        for mine, base, what in (("dense@mgpu", "dense@cudnn", "forward + backward"),
                                 ("dense@mgpu:fwd", "dense@cudnn:fwd", "forward")):
            r, b = at.get(mine), at.get(base)
            if r is None:
                continue
            if "not_measured" in r:
                parts.append(f"{what}: not measured: {r['not_measured']}")
            elif "median_ms" in r and b and "median_ms" in b:
                parts.append(f"{what} {r['median_ms']:.3g} ms against cuDNN's "
                             f"{b['median_ms']:.3g} ms: {b['median_ms'] / r['median_ms']:.2f}× "
                             f"cuDNN's speed ({r.get('dtype', 'bfloat16')})")
            else:
                parts.append(f"{what}: {r.get('error', 'not timed')}")
        if parts:
            lines.append(f"jax's FlashAttention-3 on Mosaic GPU (`attention_mgpu`, dense causal) "
                         f"at {n}: " + "; ".join(parts) + ".")
    return lines + [""] if lines else []
