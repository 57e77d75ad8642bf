"""Shared fixtures: small files in the real dataset formats, and a session compilation cache."""

import gzip
import hashlib
import os
import shutil
import signal
import tempfile
import zipfile

# A suite started in the background by a shell without job control (`pytest ... &`) inherits
# SIGINT ignored, and so would every process it starts: the stop tests send SIGINT and need it to
# act, as it does when the suite runs in a terminal or in CI.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The tests in this process compile hundreds of small programs and run most of them once or
# twice: XLA's cheap compile (backend optimisation level 0, no expensive LLVM passes) takes about
# a fifth off their time on a 2-core CPU. XLA reads XLA_FLAGS once, at the first compile, so a
# first compile happens here and the variable goes back to what it was: the scripts and notebooks
# the tests start (training runs whose steps are the cost) compile as users' do, but for the
# processes whose cost is compiling tiny programs (`cheap_compile`).
_CHEAP_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_XLA_FLAGS = os.environ.get("XLA_FLAGS")
os.environ["XLA_FLAGS"] = f"{_XLA_FLAGS or ''} {_CHEAP_COMPILE}".strip()
# On a GPU, JAX reserves 75% of the device's memory when its client starts (at the first compile
# below), once per process: with the suite's pytest-xdist workers (pyproject.toml) every worker
# after the first died of CUDA_ERROR_OUT_OF_MEMORY on an H100 and no test ran. Allocating on
# demand lets the workers share the device, so `python -m pytest` runs the same on a GPU
# machine as on a CPU (where the variable does nothing), and the kernels' compilations still
# run in parallel; `-n 0` was the other way out, one process with the whole device, but serial.
# A value already set is kept, and the scripts the tests start inherit it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402

# Persistent compilation caches for the session, shared with the other pytest-xdist workers
# (they inherit the controller's environment): runs of the same tiny config compile once, not
# every time. This process and the scripts it starts keep separate caches, as they compile with
# different flags and a cache entry's key does not say which. A half-written entry read by
# another process is a warning and a compile, not an error. (JAX decides at its first compile
# whether a cache is used: configured before it.)
_JAX_CACHE = os.environ.get("SPARSE_JAX_TESTS_JAX_CACHE") or tempfile.mkdtemp(
    prefix="sparse_jax_tests_jax_cache_")
os.environ["SPARSE_JAX_TESTS_JAX_CACHE"] = _JAX_CACHE
for _name, _value in [("jax_persistent_cache_min_compile_time_secs", 0),
                      ("jax_persistent_cache_min_entry_size_bytes", 0)]:
    jax.config.update(_name, _value)
    os.environ[_name.upper()] = str(_value)
jax.config.update("jax_compilation_cache_dir", os.path.join(_JAX_CACHE, "tests"))
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(_JAX_CACHE, "scripts")

jax.jit(lambda x: x + 1)(0).block_until_ready()  # the first compile: XLA_FLAGS is read
if _XLA_FLAGS is None:
    del os.environ["XLA_FLAGS"]
else:
    os.environ["XLA_FLAGS"] = _XLA_FLAGS

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import fake_cifar10  # noqa: E402
from sparse_jax import cli  # noqa: E402

# The scripts that tests start find the huge-pages tunable set, so they do not restart for it.
os.environ.update(cli.huge_pages_env())


def cheap_compile(env: dict) -> dict:
    """`env` with XLA's cheap compile added to its XLA_FLAGS, for a process the test starts whose
    time is compiling many tiny programs and hardly running them (the 8-device children, the
    report's dry runs): the same programs, compiled in about four fifths of the time."""
    return {**env, "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} {_CHEAP_COMPILE}".strip()}


def pytest_sessionfinish(session, exitstatus):
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller (or a run with -n 0)
        shutil.rmtree(_JAX_CACHE, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Byte files and enwik8.


@pytest.fixture(scope="session")
def byte_file(tmp_path_factory):
    """60 KB of the generated stream as a plain file (printable bytes: never 255)."""
    from sparse_jax.data import sources

    path = tmp_path_factory.mktemp("bytes") / "data.txt"
    path.write_bytes(sources.embedded_bytes(60_000, seed=1).tobytes())
    return str(path)


def fake_enwik8(folder, size=5000, seed=0, member="enwik8"):
    """A tiny enwik8.zip (single member `member`); returns (zip path, bytes, md5)."""
    raw = np.random.default_rng(seed).integers(32, 127, size=size, dtype=np.uint8).tobytes()
    path = os.path.join(folder, "enwik8.zip")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(member, raw)
    return path, raw, hashlib.md5(raw).hexdigest()


def gz_with_sums(folder, raw: bytes, name="text.txt", listed=True):
    """folder/name.gz holding `raw`, and a SHA256SUMS listing both names (as shipped data)."""
    gz = os.path.join(folder, name + ".gz")
    with gzip.open(gz, "wb") as f:
        f.write(raw)
    if listed:
        with open(os.path.join(folder, "SHA256SUMS"), "w") as f:
            for digest, n in [(hashlib.sha256(open(gz, "rb").read()).hexdigest(), name + ".gz"),
                              (hashlib.sha256(raw).hexdigest(), name)]:
                f.write(f"{digest}  {n}\n")
    return gz


def corrupt_middle(path):
    """Overwrites 64 bytes in the middle of a file (inside a zip's or gzip's deflated data)."""
    content = bytearray(open(path, "rb").read())
    content[len(content) // 2:len(content) // 2 + 64] = bytes(64)
    with open(path, "wb") as f:
        f.write(content)


def one_line_error(exc, fn, *needles):
    """Runs fn expecting `exc` whose message is one line holding every needle; returns it."""
    with pytest.raises(exc) as e:
        fn()
    message = str(e.value)
    assert "\n" not in message and all(str(n) in message for n in needles), message
    return message


def files_in(folder):
    """{name: bytes} of the files in `folder` (a pathlib.Path): to show nothing was lost."""
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))
            if (folder / name).is_file()}


# ---------------------------------------------------------------------------------------------
# CIFAR-10 through the real TFDS builder, from a tiny archive in the official binary format
# (tests/fake_cifar10.py, which also builds the pattern study's synthetic image task).

TRAIN_PER_FILE, NUM_TEST = 4, 5


@pytest.fixture(scope="session")
def cifar(tmp_path_factory):
    """Prepares the real `cifar10` builder once from a tiny archive of random pixels; yields
    (data_dir, {TFDS example key: image in raster order})."""
    return fake_cifar10.prepare(str(tmp_path_factory.mktemp("cifar")), TRAIN_PER_FILE, NUM_TEST)


# ---------------------------------------------------------------------------------------------
# Folders of pictures (sparse_jax.data.images), written with Pillow.


def write_pictures(folder, names, shape=(6, 8, 3), seed=0):
    """A picture of random pixels, uint8 [H, W, C] = `shape`, at folder/<name> for each name
    (PNG, or JPEG for .jpg / .jpeg, which is lossy); returns {name: pixels}."""
    from PIL import Image

    rng, written = np.random.default_rng(seed), {}
    for name in names:
        pixels = rng.integers(0, 256, size=shape, dtype=np.uint8)
        path = os.path.join(folder, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Image.fromarray(pixels[..., 0] if shape[-1] == 1 else pixels).save(path)
        written[name] = pixels
    return written
