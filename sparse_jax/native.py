"""The fused CPU kernels of ``cpu_kernels.cc``: built on first use, registered as XLA FFI targets.

``sparse_attention(..., implementation="native")`` (and "auto" on a CPU) runs a pattern's band,
column and summary terms through these kernels (a band over chosen residues on the XLA path).
The source is compiled once per machine with the host's C++ compiler (``$CXX``, else ``c++``),
``-O3 -march=native``, against the FFI headers jaxlib ships, into a cache directory
(``$SPARSE_JAX_CACHE``, else ``~/.cache/sparse_jax``) keyed by the source, the compiler, jaxlib
and the CPU's flags, so a cache shared by different machines never loads a build for another
CPU. Without a compiler "auto" falls back to the XLA path and says why once in the log; "native"
raises with what to install.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
TARGETS = {"column_forward": "SparseJaxColumnForward",
           "column_backward": "SparseJaxColumnBackward",
           "band_forward": "SparseJaxBandForward",
           "band_backward": "SparseJaxBandBackward",
           "summary_forward": "SparseJaxSummaryForward",
           "summary_backward": "SparseJaxSummaryBackward"}
HEAD_DIM_MULTIPLE = 16  # the kernels' vectors run along the head dimension


class NativeUnavailable(OSError):
    """The CPU kernels cannot be built or loaded on this machine (an OSError: the scripts print
    it as one ``error:`` line)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str:
    if os.environ.get("CXX"):
        if not shutil.which(os.environ["CXX"]):
            raise NativeUnavailable(f"$CXX={os.environ['CXX']} is not a program on this "
                                    "machine: point it at a C++ compiler, or unset it")
        return shutil.which(os.environ["CXX"])
    cxx = shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise NativeUnavailable(
            "no C++ compiler found for the CPU kernels: install one (e.g. apt install g++) or "
            "set $CXX, or use implementation='xla'")
    return cxx


def _cache_dir() -> Path:
    root = os.environ.get("SPARSE_JAX_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparse_jax"
    return Path(root)


def build(cache_dir: Path | None = None) -> Path:
    """The shared library of ``cpu_kernels.cc`` for this machine, compiled if not cached."""
    import jaxlib

    cxx = _compiler()
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
             f"-I{jax.ffi.include_dir()}"]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, version, " ".join(flags),
                                    jaxlib.__version__, _cpu_flags()]).encode()).hexdigest()[:16]
    cache_dir = Path(cache_dir or _cache_dir())
    target = cache_dir / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:  # built aside, then renamed: other
        built = Path(tmp) / target.name                       # processes never see half a file
        result = subprocess.run([cxx, *flags, str(SOURCE), "-o", str(built)],
                                capture_output=True, text=True)
        if result.returncode:
            raise NativeUnavailable(f"building {SOURCE.name} with {cxx} failed: "
                                    f"{result.stderr.strip()[-2000:]}")
        os.replace(built, target)
    return target


@functools.cache
def _load() -> ctypes.CDLL:
    library = ctypes.cdll.LoadLibrary(str(build()))
    for name, symbol in TARGETS.items():
        handler = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(f"sparse_jax_{name}", handler, platform="cpu")
    return library


@functools.cache
def available() -> bool:
    """Whether the CPU kernels build and load here (the reason is logged once if not)."""
    try:
        _load()
    except OSError as e:  # NativeUnavailable included
        logging.warning("sparse_jax: the fused CPU kernels are unavailable (%s); "
                        "using the XLA path", e)
        return False
    return True


def require() -> None:
    """Build and load the kernels, or raise ``NativeUnavailable`` with what to do."""
    try:
        _load()
    except NativeUnavailable:
        raise
    except OSError as e:  # the library would not load
        raise NativeUnavailable(f"loading the CPU kernels failed: {e}") from e


def supports(*arrays) -> bool:
    """Whether the kernels take these grid arrays: float32 with a head dim that is a multiple of
    ``HEAD_DIM_MULTIPLE`` (else the term runs on the XLA path)."""
    return all(x.dtype == jnp.float32 and x.shape[-1] % HEAD_DIM_MULTIPLE == 0 for x in arrays)


def _result(like, shape):
    """A float32 result of ``shape`` typed like the input ``like`` (under ``shard_map``: varying
    over the same mesh axes, as the scans it feeds require)."""
    return jax.typeof(like).update(shape=tuple(shape), dtype=jnp.dtype(jnp.float32))


def _call(name, outs, *args, aliases=None, **attrs):
    return jax.ffi.ffi_call(f"sparse_jax_{name}", outs, vmap_method="sequential",
                            input_output_aliases=aliases)(*args, **attrs)


def _flat(x):  # a grid array [B, R, block, H, ...] as [B, n, H, ...]: a reshape
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _grid(x, like):  # the inverse of _flat, to ``like``'s grid
    return x.reshape(like.shape[:3] + x.shape[2:])


def column_forward(q_g, k_g, v_g, min_rows: int, scale: float):
    """The column term over grid arrays ``[B, R, l, H, d]`` (float32): the row maximum and sum
    of exponentials ``[B, R, l, H]`` and the weighted values ``[B, R, l, H, dv]`` (not divided),
    as the first term of the joint softmax writes them."""
    q, k, v = (_flat(x) for x in (q_g, k_g, v_g))
    stats = _result(q, q.shape[:-1])
    outs = _call("column_forward", (stats, stats, _result(v, v.shape)), q, k, v,
                 stride=np.int64(q_g.shape[2]), min_rows=np.int64(min_rows),
                 scale=np.float32(scale))
    return tuple(_grid(x, q_g) for x in outs)


def column_backward(q_g, k_g, v_g, d_out, lse, delta, min_rows: int, scale: float):
    """The column term's dq, dk, dv (grid arrays, float32) given the output's gradient, the joint
    log-sum-exp and D = dO · O (``[B, R, l, H]``): the first term's, written, not added."""
    args = [_flat(x) for x in (q_g, k_g, v_g, d_out, lse, delta)]
    outs = _call("column_backward", tuple(_result(x, x.shape) for x in args[:3]), *args,
                 stride=np.int64(q_g.shape[2]), min_rows=np.int64(min_rows),
                 scale=np.float32(scale))
    return tuple(_grid(x, q_g) for x in outs)


def _band_attrs(band, scale):
    return dict(block=np.int64(band.block), prev=np.int64(band.prev),
                max_distance=np.int64(-1 if band.max_distance is None else band.max_distance),
                same_row=bool(band.same_row), scale=np.float32(scale))


def band_supported(band) -> bool:
    """Band terms the kernel takes: every key in the window that the distance and row rules keep
    (not a subset of residues)."""
    return band.residues is None


def band_forward(q_g, k_g, v_g, row_max, total, acc, band, scale: float):
    """``band`` (a ``patterns.BandTerm``) merged into the joint softmax's running row maximum,
    sum and weighted values (grid arrays; updated in place where XLA can)."""
    args = [_flat(x) for x in (q_g, k_g, v_g, row_max, total, acc)]
    outs = _call("band_forward", tuple(_result(x, x.shape) for x in args[3:]), *args,
                 aliases={3: 0, 4: 1, 5: 2}, **_band_attrs(band, scale))
    return tuple(_grid(x, q_g) for x in outs)


def band_backward(q_g, k_g, v_g, d_out, lse, delta, d_q, d_k, d_v, band, scale: float):
    """``d_q, d_k, d_v`` plus ``band``'s gradients (grid arrays, float32)."""
    args = [_flat(x) for x in (q_g, k_g, v_g, d_out, lse, delta, d_q, d_k, d_v)]
    outs = _call("band_backward", tuple(_result(x, x.shape) for x in args[6:]), *args,
                 aliases={6: 0, 7: 1, 8: 2}, **_band_attrs(band, scale))
    return tuple(_grid(x, q_g) for x in outs)


def _summary_attrs(q_g, residues, scale):
    return dict(block=np.int64(q_g.shape[2]), residues=np.asarray(residues, np.int64),
                scale=np.float32(scale))


def summary_forward(q_g, k_g, v_g, row_max, total, acc, residues, scale: float):
    """The summary term (each grid row against ``residues`` of every earlier row) merged into
    the joint softmax's running statistics, as ``band_forward``."""
    args = [_flat(x) for x in (q_g, k_g, v_g, row_max, total, acc)]
    outs = _call("summary_forward", tuple(_result(x, x.shape) for x in args[3:]), *args,
                 aliases={3: 0, 4: 1, 5: 2}, **_summary_attrs(q_g, residues, scale))
    return tuple(_grid(x, q_g) for x in outs)


def summary_backward(q_g, k_g, v_g, d_out, lse, delta, d_q, d_k, d_v, residues, scale: float):
    """``d_q, d_k, d_v`` plus the summary term's gradients, as ``band_backward``."""
    args = [_flat(x) for x in (q_g, k_g, v_g, d_out, lse, delta, d_q, d_k, d_v)]
    outs = _call("summary_backward", tuple(_result(x, x.shape) for x in args[6:]), *args,
                 aliases={6: 0, 7: 1, 8: 2}, **_summary_attrs(q_g, residues, scale))
    return tuple(_grid(x, q_g) for x in outs)
