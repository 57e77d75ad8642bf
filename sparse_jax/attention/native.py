"""The fused CPU kernels of ``cpu_kernels.cc``: built on first use, registered as XLA FFI targets.

``sparse_attention(..., implementation="native")`` (and "auto" on a CPU) runs a pattern's band,
column and summary terms through these kernels (a band over chosen residues on the XLA path),
and dense causal attention as one kernel forward and one backward.
The source is compiled once per machine with the host's C++ compiler (``$CXX``, else ``c++``),
``-O3 -march=native``, against the FFI headers jaxlib ships, into a cache folder
(``$SPARSE_JAX_CACHE``, else ``$XDG_CACHE_HOME/sparse_jax`` or ``~/.cache/sparse_jax``) keyed by
the source, the compiler, jaxlib and the CPU's flags, so a cache shared by different machines
never loads a build for another CPU. A build says so in a line, and how long it took. The
compiler runs in a process group of its own, with its temporary files in the build's folder: a
stop kills the group and removes the folder. Without a compiler "auto" falls back to the XLA
path and says why once in the log; "native" raises with what to install.

The cache is vouched for like the data files (``sparse_jax.data.sources``): each library is written
whole (``files.atomic_write``) beside ``<library>.verified``, a record of the key it was built
for and its size and SHA-256. A library is loaded only when its record matches it; a missing,
short, damaged or foreign file (a full disk, a half-copied home folder, a sync tool) is built
again in its place before anything maps it, so no bus error can come from the cache. A library
that still will not load is built once more; a second failure is one line that names the file
and ``$SPARSE_JAX_CACHE``. A build compiles in ``<library>.build.part<pid>``; the folders that a
killed build left behind are removed by the next build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from sparse_jax import files
from sparse_jax.logs import timed

SOURCE = Path(__file__).with_name("cpu_kernels.cc")
TARGETS = {"column_forward": "SparseJaxColumnForward",
           "column_backward": "SparseJaxColumnBackward",
           "band_forward": "SparseJaxBandForward",
           "band_backward": "SparseJaxBandBackward",
           "summary_forward": "SparseJaxSummaryForward",
           "summary_backward": "SparseJaxSummaryBackward",
           "dense_forward": "SparseJaxDenseForward",
           "dense_backward": "SparseJaxDenseBackward"}
HEAD_DIM_MULTIPLE = 16  # the kernels' vectors run along the head dimension
CACHE_ENV = "SPARSE_JAX_CACHE"  # the cache folder of the built library
RECORD = ".verified"  # suffix of the library's record: {"key", "size", "sha256"}


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
            "set $CXX")
    return cxx


def _cache_dir() -> Path:
    """$SPARSE_JAX_CACHE, else $XDG_CACHE_HOME/sparse_jax (an absolute path, as the XDG rules
    ask), else ~/.cache/sparse_jax."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "sparse_jax"


def _where(cache_dir: Path) -> str:
    """What to do about the cache folder `cache_dir`, for an error about it."""
    named = os.environ.get(CACHE_ENV) and Path(os.environ[CACHE_ENV]).expanduser() == cache_dir
    return (f"point ${CACHE_ENV} at another folder, or unset it" if named else
            f"set ${CACHE_ENV} to another folder")


def _make_cache(cache_dir: Path) -> None:
    """Creates `cache_dir`; NativeUnavailable in one line if it is a file or cannot be made."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        raise NativeUnavailable(f"the CPU kernels' cache {cache_dir} is not a folder (a file "
                                f"is in the way): {_where(cache_dir)}") from e
    except OSError as e:
        raise NativeUnavailable(f"cannot create the CPU kernels' cache {cache_dir} "
                                f"({e.strerror or e}): {_where(cache_dir)}") from e


def _key(cxx: str, flags: list[str]) -> str:
    import jaxlib

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    return hashlib.sha256("\0".join([SOURCE.read_text(), cxx, version, " ".join(flags),
                                     jaxlib.__version__, _cpu_flags()]).encode()).hexdigest()


def vouched(library: Path, key: str) -> bool:
    """Whether `library`'s record names `key` and the file's very size and SHA-256 (read before
    anything maps the file: a short or damaged one is never loaded)."""
    try:
        record = json.loads(Path(str(library) + RECORD).read_text())
        data = library.read_bytes()
    except (OSError, ValueError):
        return False
    return (isinstance(record, dict) and record.get("key") == key
            and record.get("size") == len(data)
            and record.get("sha256") == hashlib.sha256(data).hexdigest())


_DISK_FULL = ("No space left on device", "File too large", "File size limit exceeded",
              "Disk quota exceeded")  # what a compiler or linker says when it cannot write


def _run_compiler(argv: list[str], scratch: Path) -> subprocess.CompletedProcess:
    """Runs the compiler `argv` in a process group of its own with its temporary files in
    `scratch`: a stop (Ctrl-C, SIGTERM, any exception) while it runs kills the whole group
    (the driver, cc1plus, as, ld), and what they wrote goes with `scratch`."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "TMPDIR": str(scratch)})
    try:
        out, err = proc.communicate()
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:  # the group has ended
            pass
        proc.wait()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _compile(cxx: str, flags: list[str], out: Path) -> None:
    """Compiles SOURCE to `out`, with its temporary files beside it (NativeUnavailable with the
    compiler's last words, or saying that the disk is full where they say so)."""
    result = _run_compiler([cxx, *flags, str(SOURCE), "-o", str(out)], out.parent)
    if result.returncode or not out.is_file():
        words = " ".join(result.stderr.split())
        full = [reason for reason in _DISK_FULL if reason in words]
        if full:
            cache_dir = out.parent.parent
            raise NativeUnavailable(f"could not build the CPU kernels: the disk is full ({cxx} "
                                    f"says: {full[0]}); free some space in {cache_dir} and the "
                                    f"temporary folder, or {_where(cache_dir)}")
        raise NativeUnavailable(f"building {SOURCE.name} with {cxx} failed: {words[-2000:]}")


def build(cache_dir: Path | None = None, rebuild: bool = False) -> Path:
    """The shared library of ``cpu_kernels.cc`` for this machine: the cached one if its record
    vouches for it (``vouched``), else compiled and written in its place (also with
    `rebuild`)."""
    cxx = _compiler()
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno",
             f"-I{jax.ffi.include_dir()}"]
    key = _key(cxx, flags)
    cache_dir = Path(cache_dir or _cache_dir())
    target = cache_dir / f"cpu_kernels-{key[:16]}.so"
    if not rebuild and vouched(target, key):
        return target
    _make_cache(cache_dir)
    files.remove_dead_parts(str(cache_dir / "cpu_kernels-*.build.part*"))  # killed builds'
    work = Path(f"{target.with_suffix('.build')}.part{os.getpid()}")
    try:
        work.mkdir(exist_ok=True)
        with timed("building the CPU kernels (first use on this machine, or a new compiler or "
                   "jaxlib)", "built"):
            _compile(cxx, flags, work / target.name)
        data = (work / target.name).read_bytes()
        record = {"key": key, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for path, content, mode in ((target, data, "wb"),  # the library first: a record
                                    (Path(str(target) + RECORD), json.dumps(record), "w")):
            with files.atomic_write(str(path), mode, files.part_suffix(str(path))) as f:
                f.write(content)                            # never vouches for an older one
    except NativeUnavailable:
        raise
    except OSError as e:  # a full disk, a folder that cannot be written
        raise NativeUnavailable(files.write_error(
            str(target), e, f"free some space, or {_where(cache_dir)}").strerror) from e
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _register(path: Path) -> ctypes.CDLL:
    """Loads the library at `path` and registers its FFI targets (OSError or AttributeError if
    it will not load; nothing is registered then)."""
    library = ctypes.cdll.LoadLibrary(str(path))
    try:
        handlers = {name: getattr(library, symbol) for name, symbol in TARGETS.items()}
    except AttributeError:
        _unload(library)
        raise
    for name, handler in handlers.items():
        jax.ffi.register_ffi_target(f"sparse_jax_{name}", jax.ffi.pycapsule(handler),
                                    platform="cpu")
    return library


def _unload(library: ctypes.CDLL) -> None:
    """dlclose, so that loading the rebuilt file at the same path maps it afresh."""
    import _ctypes

    try:
        _ctypes.dlclose(library._handle)
    except (AttributeError, OSError):
        pass


@functools.cache
def _load() -> ctypes.CDLL:
    path = build()
    try:
        return _register(path)
    except (OSError, AttributeError) as e:  # vouched for, yet it will not load: build it again
        logging.warning("sparse_jax: the CPU kernels at %s would not load (%s); building them "
                        "again", path, e)
    path = build(rebuild=True)
    try:
        return _register(path)
    except (OSError, AttributeError) as e:
        raise NativeUnavailable(f"the CPU kernels at {path}, built afresh, will not load "
                                f"({e}); {_where(path.parent)} (one where programs may run, "
                                "not mounted noexec)") from e


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
    except OSError as e:  # e.g. $CXX that cannot be run
        raise NativeUnavailable(f"building the CPU kernels failed: {e}") from e


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


def dense_forward(q, k, v, scale: float):
    """Dense causal attention over ``[B, n, H, d]`` arrays (float32, query i sees keys 0 .. i):
    the output ``[B, n, H, dv]`` and the log-sum-exp ``[B, n, H]``."""
    return _call("dense_forward", (_result(v, v.shape), _result(q, q.shape[:-1])), q, k, v,
                 scale=np.float32(scale))


def dense_backward(q, k, v, out, d_out, lse, scale: float):
    """Dense causal attention's dq, dk, dv given the output, its gradient and the log-sum-exp."""
    return _call("dense_backward", tuple(_result(x, x.shape) for x in (q, k, v)), q, k, v, out,
                 d_out, lse, scale=np.float32(scale))
