"""Stage env: device, driver, CUDA, jax/jaxlib/flax/torch/triton versions, the chip's bf16
peak and a measured bf16 matmul."""

from __future__ import annotations

import os
import subprocess
import sys

from sparse_jax.bench.accelerator.common import emit, fmt, one_line, peak_tflops

CAP, DRY_CAP = 15, 20


def plan(dry_run: bool) -> dict:
    return {}


def run(plan: dict) -> dict:
    import platform

    import jax

    from sparse_jax.bench import tools

    versions = {"python": platform.python_version(), "jax": jax.__version__}
    try:  # the first report: a carried flax older than the machine's jax failed here
        from flax import nnx  # noqa: F401
        flax_ok = "ok"
    except Exception as e:  # noqa: BLE001
        flax_ok = one_line(e)
    for name in ("jaxlib", "flax", "optax", "orbax.checkpoint", "numpy", "torch", "triton",
                 "ml_collections", "tensorboardX"):
        try:
            module = __import__(name, fromlist=["__version__"])
            versions[name] = getattr(module, "__version__", "?")
        except Exception as e:  # noqa: BLE001  a missing package is a fact to report
            versions[name] = f"missing ({type(e).__name__})"
    device = jax.devices()[0]
    out = {"backend": jax.default_backend(), "device_kind": device.device_kind,
           "flax_nnx_import": flax_ok,
           "device_count": jax.device_count(), "versions": versions,
           "module_paths": {name: os.path.dirname(__import__(name).__file__)
                            for name in ("jax", "flax") if name in sys.modules}}
    out["bf16_peak_tflops"] = peak_tflops(device.device_kind)
    try:
        info = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,"
                               "clocks.max.sm,power.limit", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
        out["nvidia_smi"] = info.stdout.strip()
        header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=10)
        cuda = [w for line in header.stdout.splitlines() if "CUDA Version" in line
                for w in [line.split("CUDA Version:")[1].split()[0]]]
        out["cuda_driver_version"] = cuda[0] if cuda else None
    except (OSError, subprocess.SubprocessError, IndexError):
        out["nvidia_smi"] = None
    try:
        out["jax_environment"] = jax.print_environment_info(return_string=True)
    except Exception as e:  # noqa: BLE001
        out["jax_environment"] = f"unavailable: {e}"
    emit(out)
    size = 8192 if jax.default_backend() != "cpu" else 1024
    out["matmul_bf16_tflops"] = tools.matmul_gflops(size, dtype="bfloat16") / 1e3
    out["matmul_size"] = size
    out["memory_stats"] = {k: v for k, v in (device.memory_stats() or {}).items()
                           if k in ("bytes_limit", "peak_bytes_in_use")}
    return out


def check(result: dict, plan: dict) -> tuple[str, str] | None:
    if "device_kind" not in result:
        return "failed", "no device found"
    if result.get("flax_nnx_import", "ok") != "ok":
        return "partial", f"flax.nnx does not import: {result['flax_nnx_import']}"
    if "matmul_bf16_tflops" not in result:
        return "partial", "no matmul measured"
    return None


def summary(report: dict) -> list[str]:
    env = report["stages"].get("env", {})
    if not env.get("device_kind"):
        return []
    v = env.get("versions", {})
    lines = []
    if env.get("flax_nnx_import", "ok") != "ok":
        lines += [f"**flax.nnx does not import: {env['flax_nnx_import']}** (a carried flax "
                  "wheel older than the machine's jax? Carry only what is missing.)", ""]
    return lines + [
        f"Device: {env['device_kind']} ({fmt(env.get('backend'))}, "
        f"{fmt(env.get('device_count'))} device(s)); nvidia-smi: {env.get('nvidia_smi') or '—'}; "
        f"CUDA (driver) {env.get('cuda_driver_version') or '—'}; jax {fmt(v.get('jax'))}, "
        f"jaxlib {fmt(v.get('jaxlib'))}, flax {fmt(v.get('flax'))}, torch {fmt(v.get('torch'))}, "
        f"triton {fmt(v.get('triton'))}. bf16 peak (datasheet): "
        f"{fmt(env.get('bf16_peak_tflops'))} TFLOP/s; measured "
        + (f"{env['matmul_size']}² bf16 matmul: {fmt(env.get('matmul_bf16_tflops'))} TFLOP/s."
           if "matmul_size" in env else "bf16 matmul: —."), ""]
