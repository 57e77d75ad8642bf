"""The fused CPU kernels (``implementation="native"``, ``sparse_jax/attention/cpu_kernels.cc``)
against the dense reference, and how they are built, cached, chosen and refused."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import attention as A
from sparse_jax.attention import native
from sparse_jax.attention.spec import PatternSpec
from test_attention import SPECS, assert_matches_dense, dense_ref, qkv
from test_kernel import assert_model_matches_xla

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOREIGN = os.path.realpath(__import__("_ctypes").__file__)  # a shared library, not ours

# No skip where the kernels do not build: the project's tests need a C++ compiler, as "auto"
# on a CPU does to use them; the first test says what is missing.


def test_the_kernels_build_here():
    native.require()


def _cut_short(path):
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _seeded(cache):
    """`cache` holding a copy of this session's build and its record; returns the library."""
    good = native.build()
    cache.mkdir(exist_ok=True)
    for path in good.parent.glob(good.name + "*"):
        shutil.copy(path, cache / path.name)
    return cache / good.name


def _compile_by_copy(monkeypatch):
    """The compiler replaced by a copy of the good build (fast); returns the list of builds."""
    builds, good = [], native.build()
    monkeypatch.setattr(native, "_compile", lambda cxx, flags, out: builds.append(
        shutil.copy(good, out)))
    return builds


def native_attention(q, k, v, spec):
    return A.sparse_attention(q, k, v, spec, "native")


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_every_pattern_matches_dense(spec):
    """Every pattern of the XLA path's tests: its band, column and summary terms fused (a band
    over chosen residues on the XLA path), in one joint softmax."""
    assert_matches_dense(spec, *qkv((2, 200, 2, 16), seed=3), attend=native_attention)


@pytest.mark.parametrize("spec,shape", [
    (PatternSpec("strided", stride=4), (2, 37, 3, 16)),  # padded; rows < one block of queries
    (PatternSpec("strided", stride=4, local_width=11), (1, 64, 2, 32)),  # min_rows = 3
    (PatternSpec("strided", stride=8, part="strided"), (2, 96, 1, 16)),  # column term alone
    (PatternSpec("strided", stride=4), (1, 4 * 150, 2, 48)),  # several query and key blocks
    (PatternSpec("strided", stride=2), (1, 2 * 300, 1, 16)),  # key blocks of 128 and a rest
    (PatternSpec("local", stride=300), (1, 700, 2, 16)),  # band windows over 128 keys
    (PatternSpec("fixed", stride=200, c=8), (1, 500, 1, 16)),  # blocks of 200 (same row)
    (PatternSpec("local", stride=8), (2, 2500, 1, 16)),  # the key window buffer moves twice
    (PatternSpec("fixed", stride=8, c=4), (1, 600, 2, 16)),  # 300 summary keys: 3 key blocks
], ids=str)
def test_matches_dense_forward_and_gradients(spec, shape):
    assert_matches_dense(spec, *qkv(shape, seed=11), attend=native_attention)


@pytest.mark.parametrize("shape", [
    (2, 1, 2, 16),  # one position: its own key only
    (2, 7, 3, 16),  # fewer positions than a vector of keys
    (1, 63, 2, 32), (1, 64, 2, 32), (1, 65, 2, 32),  # around one block of queries
    (2, 200, 2, 16),  # query blocks across key blocks of 128 and a rest
    (1, 300, 1, 48),  # three key blocks, a head dim of three vectors
], ids=str)
def test_dense_runs_one_kernel_and_matches_the_reference(shape):
    """Dense causal attention is one fused call forward and one backward (the band whose window
    is the whole sequence), equal to the masked reference, forward and gradients."""
    spec = PatternSpec("dense")
    q, k, v = qkv(shape, seed=shape[1])
    assert_matches_dense(spec, q, k, v, attend=native_attention)
    grad = jax.jit(jax.grad(lambda q, k, v: native_attention(q, k, v, spec).sum(), (0, 1, 2)))
    text = grad.lower(q, k, v).as_text()
    assert "sparse_jax_dense_forward" in text and "sparse_jax_dense_backward" in text
    assert "sparse_jax_band" not in text


def test_dense_takes_the_xla_path_where_the_kernels_do_not_run():
    """bfloat16, or a head dim that is not a multiple of 16: the XLA path's chunks, still right;
    "auto" on a CPU is the kernel for float32."""
    spec = PatternSpec("dense")
    for q, k, v in (qkv((1, 70, 2, 8)), qkv((1, 70, 2, 16), dtype=jnp.bfloat16)):
        text = jax.jit(native_attention, static_argnums=3).lower(q, k, v, spec).as_text()
        assert "sparse_jax_" not in text
        np.testing.assert_allclose(native_attention(q, k, v, spec).astype(jnp.float32),
                                   dense_ref(q, k, v, spec).astype(jnp.float32), atol=2e-2)
    q, k, v = qkv((1, 70, 2, 16))
    auto = lambda q, k, v: A.sparse_attention(q, k, v, spec, "auto")  # noqa: E731
    assert "sparse_jax_dense_forward" in jax.jit(auto).lower(q, k, v).as_text()
    assert_matches_dense(spec, *qkv((1, 40, 2, 16), dv=32, seed=1), attend=native_attention)


def test_value_dim_may_differ_from_query_dim():
    q, k, v = qkv((2, 72, 2, 16), dv=32, seed=2)
    assert_matches_dense(PatternSpec("strided", stride=8), q, k, v, attend=native_attention)


@pytest.mark.parametrize("spec", [PatternSpec("strided", stride=8), PatternSpec("dense")],
                         ids=str)
def test_equals_the_xla_path_under_shard_map(spec):
    """Under ``shard_map`` (how devices split the heads) the results carry the inputs' per-device
    type; the numbers equal the XLA path's to rounding."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    heads = P(None, None, "heads", None)
    mesh = Mesh(np.array(jax.devices()[:1]), ("heads",))

    def sharded(implementation):
        def attend(q, k, v, spec):
            return jax.shard_map(lambda q, k, v: A.sparse_attention(q, k, v, spec, implementation),
                                 mesh=mesh, in_specs=(heads,) * 3, out_specs=heads)(q, k, v)
        return attend

    q, k, v = qkv((1, 200, 2, 16), seed=4)
    assert_matches_dense(spec, q, k, v, attend=sharded("native"))


def test_other_dtypes_and_head_dims_take_the_xla_path():
    """bfloat16 inputs and head dims that are not multiples of 16 run the XLA ops (no kernel in
    the program), still right."""
    spec = PatternSpec("strided", stride=4)
    for q, k, v in (qkv((1, 40, 2, 8)), qkv((1, 40, 2, 16), dtype=jnp.bfloat16)):
        text = jax.jit(native_attention, static_argnums=3).lower(q, k, v, spec).as_text()
        assert "sparse_jax_" not in text
        np.testing.assert_allclose(native_attention(q, k, v, spec).astype(jnp.float32),
                                   dense_ref(q, k, v, spec).astype(jnp.float32), atol=2e-2)
    q, k, v = qkv((1, 40, 2, 16))
    text = jax.jit(native_attention, static_argnums=3).lower(q, k, v, spec).as_text()
    assert "sparse_jax_column_forward" in text and "sparse_jax_band_forward" in text


def test_auto_picks_the_kernels_on_a_cpu():
    assert A.resolve_implementation("auto") == "native"


def test_build_is_cached_and_keyed_by_machine(tmp_path, monkeypatch):
    """A second build reuses the library; another CPU (its flags) gets a build of its own. Each
    library is written beside its record (key, size, SHA-256), and nothing else is left."""
    first = _seeded(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first and first.stat().st_mtime_ns == mtime
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : another cpu")
    builds = _compile_by_copy(monkeypatch)
    second = native.build(tmp_path)
    assert second != first and second.exists() and len(builds) == 1
    names = [first.name, second.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names + [n + native.RECORD for n in names])


def test_no_compiler_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(native.NativeUnavailable, match="CXX=/nonexistent/c\\+\\+ is not a"):
        native.build(tmp_path)
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(native.NativeUnavailable, match="no C\\+\\+ compiler"):
        native.build(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_build_leaves_no_library(tmp_path, monkeypatch):
    bad = tmp_path / "bad.cc"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", bad)
    cache = tmp_path / "cache"
    with pytest.raises(native.NativeUnavailable, match="bad.cc"):
        native.build(cache)
    assert not any(cache.glob("*.so"))


def test_model_with_native_attention_on_a_mesh():
    """``ModelConfig.attention="native"`` gives the XLA model's loss and gradients (strided,
    half-size q/k), also inside ``shard_map`` on a mesh, and its program holds the kernels."""
    from flax import nnx

    from sparse_jax.model.config import ModelConfig
    from sparse_jax.model.transformer import SparseTransformer

    base = dict(seq_len=64, num_layers=1, d_model=64, num_heads=2, pattern="strided", stride=8,
                qk_ratio=0.5)
    assert_model_matches_xla(base, "native")
    model = SparseTransformer(ModelConfig(**base, attention="native"), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 64), jnp.int32)
    text = nnx.jit(lambda m, x: m(x)).lower(model, tokens).as_text()
    assert "sparse_jax_band_forward" in text and "sparse_jax_column_forward" in text


# ---------------------------------------------------------------------------------------------
# The cache vouched for: a damaged, short or foreign library is never loaded, but built again.

def test_a_library_cut_short_is_built_again_and_the_next_run_trains(tmp_path):
    """A cached library cut short (a full disk, a half-copied home folder) used to end every
    later run with "Fatal Python error: Bus error" inside ctypes. The next run builds it again
    in its place, then trains with the kernels."""
    cache = tmp_path / "cache"
    library = _seeded(cache)
    _cut_short(library)
    env = {**os.environ, "SPARSE_JAX_CACHE": str(cache), "JAX_PLATFORMS": "cpu"}
    env.pop("SPARSE_JAX_TRACEBACK", None)
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "train.py"),
         "--config=" + os.path.join(ROOT, "configs", "quickstart.py") + ":data=embedded",
         f"--workdir={tmp_path / 'work'}", "--config.model.attention=native",
         "--config.data.embedded_bytes=20000", "--config.model.seq_len=64",
         "--config.model.num_layers=1", "--config.model.d_model=32",
         "--config.model.num_heads=2", "--config.model.stride=8", "--config.batch_size=4",
         "--config.total_steps=2", "--config.eval_every=2", "--config.checkpoint_every=2",
         "--config.log_every=1", "--config.eval_batches=1",
         "--config.optimizer.warmup_steps=1", "--cpu_devices=1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "step 2" in proc.stdout + proc.stderr
    assert library.read_bytes() == native.build().read_bytes()


@pytest.mark.parametrize("damage", [
    "cut short", "header only", "empty", "garbage", "foreign", "missing", "no record",
    "record damaged", "record of another build", "record of another size"])
def test_a_damaged_cache_is_built_again_before_anything_loads_it(tmp_path, monkeypatch,
                                                                  damage):
    """Each way a cached library or its record can be wrong leads to one build in its place
    (the compiler replaced here by a copy of the good build), never to loading it."""
    good = native.build()
    library = _seeded(tmp_path)
    record = tmp_path / (library.name + native.RECORD)
    if damage == "cut short":
        _cut_short(library)
    elif damage == "header only":
        library.write_bytes(good.read_bytes()[:4096])
    elif damage == "empty":
        library.write_bytes(b"")
    elif damage == "garbage":
        library.write_bytes(np.random.default_rng(0).bytes(good.stat().st_size))
    elif damage == "foreign":
        shutil.copy(FOREIGN, library)
    elif damage == "missing":
        library.unlink()
    elif damage == "no record":
        record.unlink()
    elif damage == "record damaged":
        record.write_text('{"key": ')
    elif damage == "record of another build":
        record.write_text(record.read_text().replace('"key": "', '"key": "0'))
    elif damage == "record of another size":  # a library cut short, its record rewritten
        _cut_short(library)
        record.write_text(record.read_text().replace('"size": ', '"size": 1'))
    builds = _compile_by_copy(monkeypatch)
    assert native.build(tmp_path) == library and len(builds) == 1
    assert library.read_bytes() == good.read_bytes()
    assert native.build(tmp_path) == library and len(builds) == 1  # vouched for now


def test_a_library_that_will_not_load_is_built_again_once(tmp_path, monkeypatch):
    """A vouched-for library that will not load (here: a foreign one with its own record) is
    built once more; one that still will not load is one line naming it and the variable."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    builds = []

    def compile_foreign(cxx, flags, out):
        builds.append(out)
        shutil.copy(FOREIGN, out)

    monkeypatch.setattr(native, "_compile", compile_foreign)
    with pytest.raises(native.NativeUnavailable) as e:
        native._load.__wrapped__()
    assert len(builds) == 2
    message = str(e.value)
    assert "\n" not in message and native.CACHE_ENV in message and "cpu_kernels-" in message


def test_cache_that_is_a_file_is_one_line_naming_the_variable(tmp_path, monkeypatch):
    path = tmp_path / "not_a_folder"
    path.write_text("mine\n")
    monkeypatch.setenv(native.CACHE_ENV, str(path))
    with pytest.raises(native.NativeUnavailable, match=f"{path} is not a folder.*point "
                       f"\\${native.CACHE_ENV} at another folder"):
        native.build()
    assert path.read_text() == "mine\n"
    monkeypatch.setenv(native.CACHE_ENV, str(path / "below"))
    with pytest.raises(native.NativeUnavailable, match="is not a folder"):
        native.build()


def test_a_full_disk_is_one_line_and_leaves_no_part(tmp_path, monkeypatch):
    """A write that fails (EFBIG/ENOSPC) names the library and the variable; no library, record
    or temporary file or folder is left."""
    import errno

    def full(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    _compile_by_copy(monkeypatch)
    monkeypatch.setattr(native.files, "atomic_write", full)
    with pytest.raises(native.NativeUnavailable, match="could not write .*cpu_kernels-.*the disk "
                       f"is full.*{native.CACHE_ENV}"):
        native.build(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_folders_of_killed_builds_are_removed_by_the_next_build(tmp_path, monkeypatch):
    """A build killed mid-way leaves cpu_kernels-*.build.part<pid>; the next build removes those
    of dead processes (any key), and keeps those of live ones."""
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    library = _seeded(tmp_path)
    builds = _compile_by_copy(monkeypatch)
    leftovers = [tmp_path / f"cpu_kernels-0123456789abcdef.build.part{dead.pid}",
                 tmp_path / f"{library.stem}.build.part{dead.pid}"]
    alive = tmp_path / f"cpu_kernels-0123456789abcdef.build.part{os.getppid()}"
    for folder in (*leftovers, alive):
        folder.mkdir()
        (folder / "half.so").write_bytes(b"\x7fELF")
    library.unlink()
    native.build(tmp_path)
    assert len(builds) == 1 and not any(p.exists() for p in leftovers) and alive.exists()


# ---------------------------------------------------------------------------------------------
# The implementation is chosen where a run is read.


def test_a_native_run_is_read_with_xla_where_the_kernels_cannot_run(tmp_path, monkeypatch,
                                                                     capsys):
    """A run trained with attention='native', evaluated and sampled on a machine where the
    kernels cannot be built: read with XLA (a warning line says so), the same bits; the
    `attention` argument (the scripts' --attention) chooses, and a bad choice is one line."""
    from sparse_jax import evaluate as E
    from sparse_jax import sample as S
    from sparse_jax import train
    from test_train import TINY_TEXT, get_config

    workdir = str(tmp_path / "run")
    train.train(get_config("quickstart", "data=embedded", **{
        **TINY_TEXT, "model__d_model": 32, "model__attention": "native"}), workdir)
    here = E.evaluate(workdir, "valid", progress=False, write=False)
    capsys.readouterr()

    def no_compiler():
        raise native.NativeUnavailable("no C++ compiler found for the CPU kernels: install one")

    monkeypatch.setattr(native, "_load", no_compiler)
    monkeypatch.setattr(native, "available", lambda: False)
    there = E.evaluate(workdir, "valid", progress=False, write=False)
    err = capsys.readouterr().err
    assert "warning: this run trained with attention='native'" in err, err
    assert "no C++ compiler" in err and "reading it with attention='xla'" in err
    assert there["bits"] == pytest.approx(here["bits"], abs=1e-5)
    chosen = E.evaluate(workdir, "valid", progress=False, write=False, attention="xla")
    assert chosen["bits"] == there["bits"] and "warning" not in capsys.readouterr().err
    result = S.sample(workdir, 1, 8, output=str(tmp_path / "sample.txt"))
    assert len(result["samples"][0]) == 1 + 8
    with pytest.raises(ValueError, match="attention='native': no C\\+\\+ compiler"):
        E.evaluate(workdir, "valid", write=False, attention="native")
    with pytest.raises(ValueError, match="attention='cuda' must be one of"):
        S.sample(workdir, 1, 8, attention="cuda")
    with open(os.path.join(workdir, "config.json")) as f:
        assert '"attention": "native"' in f.read()  # the record is left as trained


def test_a_compiler_that_cannot_write_says_the_disk_is_full(tmp_path, monkeypatch):
    out = tmp_path / "cache" / "cpu_kernels-x.build.part1" / "cpu_kernels-x.so"
    monkeypatch.setattr(native, "_run_compiler", lambda argv, scratch: subprocess.CompletedProcess(
        argv, 1, "", "/usr/bin/ld: final link failed: No space left on device\ncollect2: error"))
    with pytest.raises(native.NativeUnavailable, match=r"the disk is full .*No space left on "
                       f"device\\); free some space in {tmp_path / 'cache'}"):
        native._compile("c++", [], out)


def test_a_stopped_build_ends_the_compiler_and_everything_it_started(tmp_path):
    """Ctrl-C while the compiler runs: its whole process group goes (a driver's cc1plus, here a
    shell's `sleep`), and its temporary files are in the build's folder (TMPDIR), which the
    build removes."""
    compiler = tmp_path / "cc"
    compiler.write_text('#!/bin/sh\nsleep 300 &\necho $! > "$TMPDIR/child"\nwait\n')
    compiler.chmod(0o755)
    scratch = tmp_path / "build"
    scratch.mkdir()
    main = threading.main_thread().ident
    threading.Timer(1.0, signal.pthread_kill, (main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        native._run_compiler([str(compiler)], scratch)
    child = int((scratch / "child").read_text())  # written where TMPDIR pointed
    for _ in range(100):  # killed; reaped by init a moment later
        if not os.path.exists(f"/proc/{child}") or " Z " in open(f"/proc/{child}/stat").read():
            break
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}") or " Z " in open(f"/proc/{child}/stat").read()
