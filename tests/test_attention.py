"""Block-sparse attention against the dense masked reference, forward and gradients; the decoding
step; the NNX attention layer."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_jax import attention as A
from sparse_jax.attention import patterns as P
from sparse_jax.attention import xla
from sparse_jax.attention.spec import PatternSpec, layer_specs
from sparse_jax.model.layers import SparseSelfAttention


def qkv(shape, dtype=jnp.float32, seed=0, dv=None):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    v_shape = shape if dv is None else (*shape[:3], dv)
    return (jax.random.normal(kq, shape, dtype), jax.random.normal(kk, shape, dtype),
            jax.random.normal(kv, v_shape, dtype))


SPECS = [
    PatternSpec("local", stride=4),
    PatternSpec("local", stride=4, local_width=3),
    PatternSpec("strided", stride=4),
    PatternSpec("strided", stride=4, part="local"),
    PatternSpec("strided", stride=4, part="strided"),
    PatternSpec("strided", stride=4, local_width=4),  # openai / DeepSpeed window
    PatternSpec("strided", stride=4, local_width=11),  # window over three grid rows
    PatternSpec("strided", stride=5, local_width=1),
    PatternSpec("fixed", stride=8, c=2),
    PatternSpec("fixed", stride=8, c=2, part="block"),
    PatternSpec("fixed", stride=8, c=2, part="summary"),
    PatternSpec("fixed", stride=8, c=2, summary="lra"),
    PatternSpec("fixed", stride=8, c=2, summary_block=3),
    PatternSpec("fixed", stride=8, c=2, part="summary", summary="lra", summary_block=1),
    PatternSpec("fixed", stride=6, c=6),
    PatternSpec("dense"),
]


def dense_ref(q, k, v, spec):
    return A.dense_attention(q, k, v, spec.mask(q.shape[1]))


def out_and_grads(attend, spec, q, k, v):
    """attend(q, k, v, spec) and the gradients of its product with a fixed cotangent, jitted."""
    cot = jax.random.normal(jax.random.PRNGKey(7), v.shape)
    loss = lambda q, k, v: (attend(q, k, v, spec) * cot).sum()  # noqa: E731
    return jax.jit(lambda q, k, v: (attend(q, k, v, spec),
                                    jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)


def assert_matches_dense(spec, q, k, v, attend=A.sparse_attention):
    out, got = out_and_grads(attend, spec, q, k, v)
    want_out, want = out_and_grads(dense_ref, spec, q, k, v)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=0)
    for name, g, w in zip("qkv", got, want):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0, err_msg=f"d{name}")


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("seq_len", [37, 64])
def test_matches_dense_forward_and_gradients(spec, seq_len):
    """seq_len 37 is not a multiple of any stride here: padded internally."""
    assert_matches_dense(spec, *qkv((2, seq_len, 3, 8)))


@pytest.mark.parametrize("spec", [SPECS[2], SPECS[8], SPECS[11]], ids=str)
def test_one_head_over_a_batch(spec):
    """A single head with batch > 1 runs with the batch rows as heads: still exact."""
    assert_matches_dense(spec, *qkv((3, 40, 1, 8), seed=5))


@pytest.mark.parametrize("spec", [PatternSpec("strided", stride=4),
                                  PatternSpec("strided", stride=4, local_width=11),
                                  PatternSpec("local", stride=4, local_width=3),
                                  PatternSpec("fixed", stride=8, c=2)], ids=str)
@pytest.mark.parametrize("chunk_scores,min_sub_row", [(1, 1), (100, 2)])
def test_scanned_chunks_and_sub_rows_match_dense(spec, chunk_scores, min_sub_row, monkeypatch):
    """Terms computed in a lax.scan over chunks of tiles, sliding windows on a grid of sub-rows
    (the defaults do neither at these sizes). With 1 score per step every chunk is one tile, so a
    band slab reaches several sub-rows back (halo > chunk) and before row 0. With 100, chunks
    hold several rows or columns and the last chunk is shorter (a scan over the full chunks, one
    more call for the rest; strided, n=37: 20 sub-rows of 2 in two chunks of 8, then 4). The
    summary term (fixed) goes one query row at a time against blocks of 1 or 12 keys, so its
    steps cover every (row, block) pair the scan visits."""
    monkeypatch.setattr(xla, "_STEP_SCORES", chunk_scores * 6)  # 6 = batch 2 × 3 heads
    monkeypatch.setattr(xla, "_SUMMARY_SCORES", chunk_scores)
    monkeypatch.setattr(xla, "_MIN_SUB_ROW", min_sub_row)
    monkeypatch.setattr(xla, "_SUMMARY_QUERIES", 8)
    q, k, v = qkv((2, 37, 3, 8))
    if chunk_scores == 1:
        jaxpr = jax.make_jaxpr(jax.grad(lambda q: A.sparse_attention(q, k, v, spec).sum()))(q)
        assert "scan" in str(jaxpr)
    assert_matches_dense(spec, q, k, v)


@pytest.mark.parametrize("spec", [PatternSpec("fixed", stride=8, c=2),
                                  PatternSpec("fixed", stride=8, c=2, part="summary")], ids=str)
def test_summary_steps_of_several_rows_and_key_blocks_match_dense(spec, monkeypatch):
    """n=64, l=8: 8 rows in chunks of 2 (16 queries), 16 summary keys in blocks of 6 (the last
    padded): steps whose query rows differ within a step and whose key blocks end mid-row."""
    monkeypatch.setattr(xla, "_SUMMARY_QUERIES", 16)
    monkeypatch.setattr(xla, "_SUMMARY_SCORES", 100)
    term = xla._summary(spec.terms()[-1], 8, 6)
    assert (term.chunk, term.key_block) == (2, 6) and len(term.pairs) > 4
    assert_matches_dense(spec, *qkv((2, 64, 3, 8)))


def test_steps_hold_about_step_scores_over_batch_and_heads():
    """Strided l=128 at n=8,192 (64 rows): the column term goes first (it writes dq, dk and dv
    that the band then adds to); a step holds about _STEP_SCORES scores over batch × heads, as
    a divisor of the tiles where one is near (band: 5 -> 4 of 128 sub-rows)."""
    spec = PatternSpec("strided", stride=128)
    assert [(t.axis, t.chunk) for t in xla._terms(spec, 64, 4)] == [(2, 16), (1, 4)]
    assert [(t.axis, t.chunk) for t in xla._terms(spec, 64, 24)] == [(2, 2), (1, 1)]
    step = xla._STEP_SCORES
    assert xla._chunk(step // 8, 64) == 8 and xla._chunk(step // 8, 20) == 8  # 5 is too far
    assert xla._chunk(step // 5, 128) == 4 and xla._chunk(step * 2, 7) == 1


def test_sub_rows_of_sliding_windows():
    """Strided l=128: sub-rows of 64 score 192 keys per query instead of 256 (129 kept)."""
    from sparse_jax.attention.terms import BandTerm

    assert xla._sub_rows(BandTerm(128, prev=1, max_distance=128)) == 2
    assert xla._sub_rows(BandTerm(128, prev=1, max_distance=127)) == 2  # openai window
    assert xla._sub_rows(BandTerm(256, prev=1, max_distance=256)) == 4
    assert xla._sub_rows(BandTerm(96, prev=1, max_distance=96)) == 1  # 48 < _MIN_SUB_ROW
    assert xla._sub_rows(BandTerm(128, prev=0, same_row=True)) == 1  # fixed block: not by distance


@pytest.mark.parametrize("spec", [PatternSpec("strided", stride=4),
                                  PatternSpec("fixed", stride=8, c=2)], ids=str)
def test_under_shard_map_over_heads(spec):
    """Heads split over a mesh axis (how several devices share the work): the scans'
    accumulators, forward and backward, must have the inputs' per-device type (fixed: the first
    chunk is already in the scan)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    heads = P(None, None, "heads", None)
    mesh = Mesh(np.array(jax.devices()[:1]), ("heads",))

    def sharded(q, k, v, spec):
        attend = lambda q, k, v: A.sparse_attention(q, k, v, spec)  # noqa: E731
        return jax.shard_map(attend, mesh=mesh, in_specs=(heads,) * 3, out_specs=heads)(q, k, v)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(xla, "_STEP_SCORES", 200)  # 100 scores per batch row and head
        patch.setattr(xla, "_SUMMARY_SCORES", 100)
        assert_matches_dense(spec, *qkv((1, 37, 2, 8)), attend=sharded)


@pytest.mark.parametrize("spec", [PatternSpec("strided", stride=16),
                                  PatternSpec("fixed", stride=16, c=4)], ids=str)
def test_long_sequence_and_gather_reference(spec):
    """n=1000 (not a multiple of the stride), many summary chunks; three implementations agree."""
    q, k, v = qkv((1, 1000, 2, 16), seed=3)
    out = jax.jit(A.sparse_attention, static_argnums=3)(q, k, v, spec)
    np.testing.assert_allclose(out, jax.jit(dense_ref, static_argnums=3)(q, k, v, spec),
                               atol=1e-5, rtol=0)
    gathered = jax.jit(A.gather_attention)(q, k, v, spec.indices(1000))
    np.testing.assert_allclose(gathered, out, atol=1e-5, rtol=0)


def test_value_dim_may_differ_from_query_dim():
    """Half-size query/key projections give head_dim(q, k) != head_dim(v)."""
    q, k, v = qkv((1, 40, 2, 4), dv=8)
    spec = PatternSpec("fixed", stride=8, c=2)
    got = jax.jit(A.sparse_attention, static_argnums=3)(q, k, v, spec)
    np.testing.assert_allclose(got, dense_ref(q, k, v, spec), atol=1e-5)


@pytest.mark.parametrize("spec", [SPECS[2], SPECS[8]], ids=str)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_within_tolerance(spec, dtype):
    """bf16/fp16 inputs, fp32 softmax: within 2e-2 (bf16) / 4e-3 (fp16) of the fp32 result on
    the same (rounded) inputs; the output keeps the input dtype."""
    q, k, v = qkv((2, 64, 2, 16), dtype=dtype)
    out = jax.jit(A.sparse_attention, static_argnums=3)(q, k, v, spec)
    assert out.dtype == dtype
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    tol = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    np.testing.assert_allclose(out.astype(jnp.float32), dense_ref(*f32, spec), atol=tol)
    grads = jax.jit(jax.grad(
        lambda q: A.sparse_attention(q, k, v, spec).astype(jnp.float32).sum()))(q)
    assert grads.dtype == dtype and bool(jnp.isfinite(grads.astype(jnp.float32)).all())


@pytest.mark.parametrize("spec", [s for s in SPECS if s.part != "summary"], ids=str)
def test_causal_by_gradients(spec):
    """d out[i] / d (q, k, v)[j] == 0 for every j > i, and != 0 for the attended j."""
    n = 24
    q, k, v = qkv((1, n, 1, 4))
    grad_fn = jax.jit(jax.grad(lambda q, k, v, i: A.sparse_attention(q, k, v, spec)[0, i].sum(),
                               argnums=(0, 1, 2)))
    for i in [0, 5, 13, n - 1]:
        grads = grad_fn(q, k, v, i)
        touched = np.zeros(n, bool)
        for g in grads:
            per_pos = np.abs(np.asarray(g[0, :, 0])).sum(-1)
            assert np.all(per_pos[i + 1:] == 0), f"query {i} depends on a future position"
            touched |= per_pos > 0
        keys = spec.indices(n)[i]
        assert touched[keys[keys >= 0]].all()


def test_query_without_keys_outputs_zero():
    """The fixed summary part alone leaves early queries with no key: zeros, finite grads."""
    spec = PatternSpec("fixed", stride=8, c=2, part="summary")
    q, k, v = qkv((1, 16, 1, 4))
    out = jax.jit(A.sparse_attention, static_argnums=3)(q, k, v, spec)
    assert np.all(np.asarray(out[0, :6]) == 0) and np.all(np.asarray(out[0, 6:]) != 0)
    g = jax.jit(jax.grad(lambda q: A.sparse_attention(q, k, v, spec).sum()))(q)
    assert bool(jnp.isfinite(g).all())


@pytest.mark.parametrize("spec", [SPECS[2], SPECS[8], SPECS[10], PatternSpec("dense")], ids=str)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_attention_equals_rows_of_the_full_pass(spec, dtype):
    """One query over its gathered keys (the cached decoder's step) gives row i of
    ``sparse_attention``; a query with no key (fixed summary part) gives zeros."""
    n = 24
    q, k, v = qkv((2, n, 3, 8), dtype=dtype, dv=4)
    full = jax.jit(A.sparse_attention, static_argnums=3)(q, k, v, spec)
    step = jax.jit(A.decode_attention)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-6
    for i, row in enumerate(spec.indices(n)):
        valid = row >= 0
        got = step(q[:, i], k[:, np.maximum(row, 0)], v[:, np.maximum(row, 0)], valid)
        assert got.dtype == dtype
        np.testing.assert_allclose(got.astype(jnp.float32), full[:, i].astype(jnp.float32),
                                   atol=tol, rtol=0, err_msg=f"row {i}")
        if not valid.any():
            assert np.all(np.asarray(got) == 0)


def _jaxpr_sizes(jaxpr):
    """Element counts of every value computed in a jaxpr, recursing into sub-jaxprs."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield int(np.prod(getattr(var.aval, "shape", ()) or (1,)))
        for param in eqn.params.values():
            for inner in (param if isinstance(param, (list, tuple)) else [param]):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    yield from _jaxpr_sizes(inner)


def test_never_materializes_seq_by_seq():
    """No intermediate of the forward or backward pass has n²/4 elements (n=2048), while the
    dense reference does (so the check can fail)."""
    n = 2048
    q, k, v = qkv((1, n, 1, 8))
    for spec in [PatternSpec("strided", stride=32), PatternSpec("fixed", stride=32, c=8)]:
        fn = jax.value_and_grad(
            lambda q, k, v: A.sparse_attention(q, k, v, spec).sum(),  # noqa: B023 (traced below)
            argnums=(0, 1, 2))
        assert max(_jaxpr_sizes(jax.make_jaxpr(fn)(q, k, v).jaxpr)) < n * n / 4, spec
    dense = jax.grad(lambda q: dense_ref(q, k, v, PatternSpec("dense")).sum())
    assert max(_jaxpr_sizes(jax.make_jaxpr(dense)(q).jaxpr)) >= n * n


def test_no_recompilation_for_equal_shapes():
    traces = []

    def attend(q, k, v, spec):
        traces.append(spec)
        return A.sparse_attention(q, k, v, spec)

    fn = jax.jit(attend, static_argnums=3)
    for seed in range(3):
        # equal specs hash equal
        fn(*qkv((1, 64, 2, 8), seed=seed), PatternSpec("strided", stride=8))
    assert len(traces) == 1
    fn(*qkv((1, 64, 2, 8)), PatternSpec("strided", stride=16))
    assert len(traces) == 2


# ---------------------------------------------------------------------------------------------
# The layer and the three ways of combining parts.


def dense_layer(layer, x, specs):
    """The module's computation with dense_attention and per-group masks."""
    b, n, _ = x.shape
    h = layer.num_heads
    split = lambda y: y.reshape(b, n, h, -1)  # noqa: E731
    q, k, v = split(layer.query(x)), split(layer.key(x)), split(layer.value(x))
    g = h // len(specs)
    outs = [A.dense_attention(q[:, :, i * g:(i + 1) * g], k[:, :, i * g:(i + 1) * g],
                              v[:, :, i * g:(i + 1) * g], s.mask(n)) for i, s in enumerate(specs)]
    return layer.out(jnp.concatenate(outs, axis=2).reshape(b, n, -1))


@pytest.mark.parametrize("base", [PatternSpec("strided", stride=8),
                                  PatternSpec("fixed", stride=8, c=2)], ids=str)
@pytest.mark.parametrize("mode", P.MODES)
@pytest.mark.parametrize("qk_dim", [32, 16])
def test_layer_modes_match_dense_masked(base, mode, qk_dim):
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 40, 32))
    for layer_index in [0, 1]:
        specs = layer_specs(base, mode, layer_index, distinct_summaries=(mode == "multihead"))
        layer = SparseSelfAttention(32, 4, specs, qk_dim=qk_dim, rngs=nnx.Rngs(0))
        got = nnx.jit(lambda layer, x: layer(x))(layer, x)
        np.testing.assert_allclose(got, nnx.jit(dense_layer, static_argnums=2)(layer, x, specs),
                                   atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Bad input.


def test_bad_inputs():
    spec = PatternSpec("strided", stride=4)
    q, k, v = qkv((1, 16, 2, 8))
    with pytest.raises(ValueError, match="same shape"):
        A.sparse_attention(q, k[:, :8], v, spec)
    with pytest.raises(ValueError, match="dtype"):
        A.sparse_attention(q, k.astype(jnp.bfloat16), v, spec)
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        A.sparse_attention(q[0], k[0], v[0], spec)
    with pytest.raises(ValueError, match="floating"):
        A.sparse_attention(*(x.astype(jnp.int32) for x in (q, k, v)), spec)
    with pytest.raises(ValueError, match="PatternSpec"):
        A.sparse_attention(q, k, v, "strided")
    with pytest.raises(ValueError, match="evenly"):
        A.multi_spec_attention(q, k, v, layer_specs(PatternSpec("fixed", stride=8, c=2),
                                                      "multihead", distinct_summaries=True)[:3])
    with pytest.raises(ValueError, match="divisible"):
        SparseSelfAttention(30, 4, [spec], rngs=nnx.Rngs(0))


@pytest.mark.parametrize("implementation", ["xla", "native"])
@pytest.mark.parametrize("name,shapes,message", [
    ("batch", [(0, 16, 2, 16)] * 3, "q has size 0 along axis 0 (batch)"),
    ("seq", [(1, 0, 2, 16)] * 3, "q has size 0 along axis 1 (seq)"),
    ("heads", [(1, 16, 0, 16)] * 3, "q has size 0 along axis 2 (heads)"),
    ("head_dim", [(1, 16, 2, 0)] * 3, "q has size 0 along axis 3 (head_dim)"),
    ("value_dim", [(1, 16, 2, 16)] * 2 + [(1, 16, 2, 0)], "v has size 0 along axis 3"),
])
def test_zero_sizes_name_the_argument_and_axis(implementation, name, shapes, message):
    """Zero-size arrays used to end in a ZeroDivisionError or an empty max() deep inside."""
    q, k, v = (jnp.ones(s) for s in shapes)
    with pytest.raises(ValueError, match=re.escape(message)):
        A.sparse_attention(q, k, v, PatternSpec("strided", stride=4), implementation)


def test_other_bad_arguments_of_the_public_functions():
    spec = PatternSpec("strided", stride=4)
    q, k, v = qkv((1, 16, 2, 8))
    for call, message in [
        (lambda: A.sparse_attention([[1.0]], k, v, spec), "q must be an array"),
        (lambda: A.sparse_attention(q, k, v, spec, block_sizes="big"), "block_sizes must be"),
        (lambda: A.multi_spec_attention(q, k, v, []), "at least one PatternSpec"),
        (lambda: A.multi_spec_attention(q[0], k[0], v[0], [spec, spec]),
         r"got shapes \(16, 2, 8\)"),  # the shapes given, not those of a head group
        (lambda: A.dense_attention(q, k, v, jnp.ones((3, 3), bool)), "mask of shape"),
        (lambda: A.dense_attention(q[:, :0], k[:, :0], v[:, :0], jnp.ones((0, 0), bool)),
         r"along axis 1 \(seq\)"),
        (lambda: A.decode_attention(q[:, 0], k[:, :, 0], v, jnp.ones((1, 2, 16), bool)),
         r"k must be \[batch, keys, heads, head_dim\]"),
        (lambda: A.decode_attention(q[:, 0], k[:, :0], v[:, :0], jnp.ones((1, 2, 0), bool)),
         r"k has size 0 along axis 1 \(keys\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
