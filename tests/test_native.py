"""The fused CPU kernels (``implementation="native"``, ``sparse_jax/cpu_kernels.cc``) against the
dense reference, and how they are built, cached, chosen and refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax import attention as A
from sparse_jax import native
from sparse_jax.patterns import PatternSpec
from test_attention import SPECS, assert_matches_dense, dense_ref, qkv
from test_kernel import assert_model_matches_xla

# No skip where the kernels do not build: the project's tests need a C++ compiler, as "auto"
# on a CPU does to use them; the first test says what is missing.


def test_the_kernels_build_here():
    native.require()


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


def test_value_dim_may_differ_from_query_dim():
    q, k, v = qkv((2, 72, 2, 16), dv=32, seed=2)
    assert_matches_dense(PatternSpec("strided", stride=8), q, k, v, attend=native_attention)


def test_equals_the_xla_path_under_shard_map():
    """Under ``shard_map`` (how devices split the heads) the results carry the inputs' per-device
    type; the numbers equal the XLA path's to rounding."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    heads = P(None, None, "heads", None)
    mesh = Mesh(np.array(jax.devices()[:1]), ("heads",))
    spec = PatternSpec("strided", stride=8)

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
    """A second build reuses the library; another CPU (its flags) gets a build of its own."""
    first = native.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first and first.stat().st_mtime_ns == mtime
    monkeypatch.setattr(native, "_cpu_flags", lambda: "flags : another cpu")
    second = native.build(tmp_path)
    assert second != first and second.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, second.name])


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

    from sparse_jax.model import ModelConfig, SparseTransformer

    base = dict(seq_len=64, num_layers=1, d_model=64, num_heads=2, pattern="strided", stride=8,
                qk_ratio=0.5)
    assert_model_matches_xla(base, "native")
    model = SparseTransformer(ModelConfig(**base, attention="native"), rngs=nnx.Rngs(0))
    tokens = jnp.zeros((1, 64), jnp.int32)
    text = nnx.jit(lambda m, x: m(x)).lower(model, tokens).as_text()
    assert "sparse_jax_band_forward" in text and "sparse_jax_column_forward" in text
