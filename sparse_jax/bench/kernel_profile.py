"""Where a step's time goes, kernel by kernel: a ``jax.profiler`` trace read back (its
``*.xplane.pb``, through ``jax.profiler.ProfileData``), its kernels summed by name, the costliest
listed, attention's kernels and the rest summed apart.

  trace_steps(fn, steps, folder)   runs fn() `steps` times under jax.profiler.trace
  kernel_times(folder)             {kernel name: {"ms", "count"}} of every trace under folder
  summarize(times, steps, top)     the `top` costliest kernels per step, attention and the rest

Which events are kernels: on a GPU the device plane's stream lines (each event one kernel
launch, named by its kernel: ``sparse_forward_rows`` for ours, cuDNN's ``cudnn_...``/``sm90_...
flash...``, XLA's fusions ``loop_fusion_3``, ``gemm_...``); where the trace has no device plane
(a CPU), the host's XLA executor threads' events that carry an ``hlo_op`` (each an HLO thunk:
``ynn_fusion.1``, ``custom-call``, ...). A kernel counts as attention when its name matches
``ATTENTION``: our Pallas kernels (``sparse_*``), cuDNN's and FlashAttention's fused attention,
Mosaic GPU's kernels. XLA's fusions that feed them (layout transposes) count as the rest.
"""

from __future__ import annotations

import glob
import os
import re

# Kernel names that are attention: ours (pallas_call names sparse_forward_rows, ...), cuDNN's
# fused attention (cudnn_generated_fort_native_sdpa..., sm90_..._flash_...fmha...), Mosaic
# GPU's (attention_mgpu's kernels), and anything naming attention or softmax-attention.
ATTENTION = re.compile(r"^sparse_|cudnn|fmha|flash|sdpa|mosaic|attention|attn", re.I)
# Host events that are bookkeeping of the CPU executor, not work.
_HOST_NOISE = ("ThreadpoolListener", "end: ", "ThunkExecutor")


def trace_steps(fn, steps: int, folder: str) -> str:
    """Runs ``fn()`` (one step, which blocks until done) `steps` times inside a jax.profiler
    trace written under `folder`; returns `folder`."""
    import jax

    os.makedirs(folder, exist_ok=True)
    with jax.profiler.trace(folder):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("step", step_num=i):
                fn()
    return folder


def kernel_times(folder: str) -> dict[str, dict]:
    """{kernel name: {"ms": summed milliseconds, "count": launches}} over every ``*.xplane.pb``
    under `folder` (see the module's docstring for which events are kernels). A ValueError if
    there is no trace there, or no kernel in it."""
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise ValueError(f"no *.xplane.pb trace under {folder}")
    out: dict[str, dict] = {}
    for path in paths:
        data = ProfileData.from_file(path)
        planes = list(data.planes)
        device = [p for p in planes if p.name.startswith("/device:")]
        events = []
        for plane in device:  # the streams' kernels, else XLA's ops line
            lines = list(plane.lines)
            streams = [line for line in lines if line.name.startswith("Stream")] or [
                line for line in lines if line.name == "XLA Ops"]
            for line in streams:
                events += [(e.name, e.duration_ns) for e in line.events]
        if not device:
            for plane in planes:
                if not plane.name.startswith("/host:CPU"):
                    continue
                for line in plane.lines:
                    if line.name == "python":
                        continue
                    for e in line.events:
                        if e.name.startswith(_HOST_NOISE):
                            continue
                        if any(key == "hlo_op" for key, _ in e.stats):
                            events.append((e.name, e.duration_ns))
        for name, ns in events:
            entry = out.setdefault(name, {"ms": 0.0, "count": 0})
            entry["ms"] += ns / 1e6
            entry["count"] += 1
    if not out:
        raise ValueError(f"the trace under {folder} holds no kernel events (on a GPU the device "
                         "plane needs CUPTI: pip install nvidia-cuda-cupti-cu12)")
    return out


def summarize(times: dict[str, dict], steps: int = 1, top: int = 10) -> dict:
    """Per step: the `top` costliest kernels (name, ms, launches, share of all kernel time,
    whether attention), and the sums: kernels_ms (every kernel), attention_ms, rest_ms, and
    how many distinct kernels and launches there were."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    total = sum(t["ms"] for t in times.values()) / steps
    attention = sum(t["ms"] for n, t in times.items() if ATTENTION.search(n)) / steps
    order = sorted(times.items(), key=lambda item: -item[1]["ms"])
    rows = [{"name": name, "ms": t["ms"] / steps, "launches": t["count"] / steps,
             "share": (t["ms"] / steps) / total if total else None,
             "attention": bool(ATTENTION.search(name))} for name, t in order[:top]]
    return {"steps": steps, "kernels_ms": total, "attention_ms": attention,
            "rest_ms": total - attention, "kernels": len(times),
            "launches": sum(t["count"] for t in times.values()) / steps, "top": rows}
