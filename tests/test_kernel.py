"""The Pallas block-sparse kernels (``attention.blocks``, ``sparse_jax.attention.pallas``) against
the dense masked reference: the block lists on the host, then output, log-sum-exp and gradients,
and the lowering of every kernel for a GPU (Triton) and a TPU (Mosaic), which needs neither. On a
CPU the kernels run in Pallas interpret mode; on a GPU the same tests compile them with Triton
(``python -m pytest tests/test_kernel.py``).

Tolerances (inputs ~N(0, 1)): float32 1e-5 on outputs and 1e-4 on gradients, as the XLA path.
bfloat16 is held to the float32 reference of the same (rounded) inputs within 5e-2 on outputs and
gradients: the kernel scales q and rounds the probabilities to bfloat16 before the value product,
as the XLA path does, and one case also requires it to be no further from the reference than
twice the XLA path's error.
"""

import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_jax import attention as A
from sparse_jax.attention import blocks as K
from sparse_jax.attention import patterns as P
from sparse_jax.attention import tiles
from sparse_jax.attention.fused import _terms, compiler_for, sequence_attention, sparsity
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.model.config import ModelConfig
from sparse_jax.model.transformer import SparseTransformer

SMALL = K.BlockSizes(16, 16)  # many blocks at test lengths: skipped, partial and full ones


@pytest.fixture(autouse=True)
def float32_matmuls():
    """On a GPU, XLA's default float32 matmul is TF32; the references need true float32."""
    with jax.default_matmul_precision("highest"):
        yield

LIST_SPECS = [
    PatternSpec("strided", stride=8),
    PatternSpec("strided", stride=16, local_width=16),
    PatternSpec("strided", stride=8, part="strided"),
    PatternSpec("strided", stride=12, local_width=30),
    PatternSpec("fixed", stride=16, c=4),
    PatternSpec("fixed", stride=16, c=4, summary="lra"),
    PatternSpec("fixed", stride=16, c=4, part="summary", summary_block=2),
    PatternSpec("fixed", stride=12, c=3, summary_block=1),
    PatternSpec("local", stride=24, local_width=24),
]


def listed_pairs(spec, seq_len, sizes):
    """The (query, key) sequence positions the kernel's block lists keep: full blocks whole,
    partial blocks through the term's rule, mapped back from each term's layout."""
    rows = -(-seq_len // spec.block)
    pairs = set()
    for term in spec.terms():
        layout = K.term_layout(term, rows)
        lists = K.block_lists(layout, sizes.block_q, sizes.block_k)[0]
        (q_pos, q_seg), (k_pos, k_seg, k_flag) = (
            [a[:, 0] for a in lists.q_attrs], [a[0] for a in lists.k_attrs])
        # sequence position of each layout slot
        q_seq = np.asarray(layout.queries(np.arange(layout.n)[None, None]))[0, 0]
        k_seq = np.asarray(layout.keys(np.arange(layout.n)[None, None]))[0, 0]
        for qb, row in enumerate(lists.forward):
            n_partial, n_full = row[0], row[1]
            for j, kb in enumerate(row[2:2 + n_partial + n_full]):
                qs = slice(qb * sizes.block_q, (qb + 1) * sizes.block_q)
                ks = slice(kb * sizes.block_k, (kb + 1) * sizes.block_k)
                keep = K.keep_rule(layout, q_pos[qs, None], q_seg[qs, None], k_pos[None, ks],
                               k_seg[None, ks], k_flag[None, ks])
                assert keep.any(), "a listed block keeps no pair"
                if j >= n_partial:
                    assert keep.all(), "a block listed as full needs a mask"
                for a, b in zip(*np.nonzero(keep)):
                    i, t = qb * sizes.block_q + a, kb * sizes.block_k + b
                    if i < layout.n and q_seq[i] < seq_len and k_seq[t] < seq_len:
                        pairs.add((int(q_seq[i]), int(k_seq[t])))
        # the backward lists are the same blocks, by key block
        forward = {(qb, kb) for qb, row in enumerate(lists.forward)
                   for kb in row[2:2 + row[0] + row[1]]}
        backward = {(qb, kb) for kb, row in enumerate(lists.backward)
                    for qb in row[2:2 + row[0] + row[1]]}
        assert forward == backward
    return pairs


@pytest.mark.parametrize("spec", LIST_SPECS, ids=str)
@pytest.mark.parametrize("seq_len,sizes", [(96, SMALL), (83, K.BlockSizes(16, 32)),
                                           (70, K.BlockSizes(32, 8))])
def test_block_lists_keep_exactly_the_pattern(spec, seq_len, sizes):
    """Union over the terms of what the lists keep == the pattern's index arrays, at lengths that
    are and are not multiples of the block and of the kernel tiles."""
    indices = spec.indices(seq_len)
    want = {(i, int(j)) for i, row in enumerate(indices) for j in row if j >= 0}
    assert listed_pairs(spec, seq_len, sizes) == want


@pytest.mark.parametrize("spec", LIST_SPECS + [PatternSpec("strided", stride=128),
                                               PatternSpec("fixed", stride=128, c=32),
                                               PatternSpec("dense")], ids=str)
def test_mask_rule_is_the_pattern(spec):
    """kernel.mask_rule (FlexAttention's mask_mod in the accelerator report) on index grids ==
    the pattern's mask, at lengths below, at and past the block."""
    for n in (1, 37, 300):
        assert np.array_equal(K.mask_rule(spec)(np.arange(n)[:, None], np.arange(n)[None, :]),
                              spec.mask(n))


def test_block_lists_skip_the_strided_pattern():
    """The point of the layouts: at n = 16,384, l = 128 (keys per query ~ 2√n) the listed tiles
    are a few percent of the causal triangle (3.5%), and 2/3 of what they score is kept (a
    block mask in sequence order would list every tile of the triangle)."""
    spec, n = PatternSpec("strided", stride=128), 16384
    stats = sparsity(spec, n)
    assert stats["kept"] == int(round(spec.mean_keys(n) * n))
    assert stats["scored"] < 0.05 * n * (n + 1) / 2
    assert stats["kept"] > 0.6 * stats["scored"]


TRITON_CASES = [  # spec, seq_len (a multiple of the block), head dim, dtype, tiles
    (PatternSpec("strided", stride=128), 2048, 128, "bfloat16", K.BlockSizes()),
    (PatternSpec("fixed", stride=128, c=32), 1024, 64, "bfloat16", K.BlockSizes()),
    (PatternSpec("fixed", stride=16, c=4, part="summary", summary="lra", summary_block=1), 112,
     128, "float32", SMALL),
    (PatternSpec("local", stride=24, local_width=24), 92, 24, "float16", K.BlockSizes(16, 32)),
    (PatternSpec("strided", stride=16, part="strided"), 80, 64, "float32", K.BlockSizes(32, 16)),
]


@pytest.mark.parametrize("spec,seq_len,d,dtype,sizes", TRITON_CASES,
                         ids=[f"{c[0]}-d{c[2]}-{c[3]}" for c in TRITON_CASES])
def test_kernels_lower_to_triton_for_a_gpu(spec, seq_len, d, dtype, sizes):
    """Without a GPU: forward and backward lower for CUDA, every kernel through Pallas' Triton
    lowering (which rejects what Triton cannot do, e.g. tiles that are not powers of two), one
    custom call per kernel: forward, dq and dk/dv for each term."""
    x = jax.ShapeDtypeStruct((2, 2, seq_len, d), jnp.dtype(dtype))

    def loss(q, k, v):
        return sequence_attention(spec, q, k, v, sizes=sizes, interpret=False).sum()

    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
        lowering_platforms=("cuda",))
    calls = lowered.as_text().count("custom_call @__gpu$xla.gpu.triton(")
    assert calls == 3 * len(spec.terms())


VARIANT_TRITON_CASES = [  # spec, seq_len, head dim, dtype, tiles
    (PatternSpec("strided", stride=128), 2048, 64, "bfloat16",
     K.BlockSizes(variant="chained", heads_per_program=2)),
    (PatternSpec("strided", stride=96), 3072, 64, "bfloat16", K.BlockSizes(variant="chained")),
    (PatternSpec("fixed", stride=128, c=32), 1024, 64, "bfloat16",
     K.BlockSizes(128, 64, variant="chained")),
    (PatternSpec("strided", stride=16, part="strided"), 80, 64, "float32",
     K.BlockSizes(32, 16, variant="chained")),
    (PatternSpec("strided", stride=128), 2048, 64, "bfloat16", K.BlockSizes(heads_per_program=4)),
    (PatternSpec("fixed", stride=128, c=32), 1024, 64, "bfloat16",
     K.BlockSizes(variant="chained", heads_per_program=2, one_loop=True)),
    (PatternSpec("fixed", stride=128, c=32, summary="lra"), 1024, 64, "bfloat16",
     K.BlockSizes.parse("chained:gathered:dkv128x128w8")),
    (PatternSpec("fixed", stride=128, c=32), 1024, 64, "bfloat16",
     K.BlockSizes.parse("chained:gathered:dkv128x128w8:atomic")),
]


@pytest.mark.parametrize("spec,seq_len,d,dtype,sizes", VARIANT_TRITON_CASES, ids=[
    f"{c[0]}-{c[3]}-{c[4].variant}-h{c[4].heads_per_program}"
    + ("-one_loop" if c[4].one_loop else "") + ("-gathered" if c[4].gathered else "")
    + ("-atomic" if c[4].atomic_dq else "") for c in VARIANT_TRITON_CASES])
def test_kernel_variants_lower_to_triton_for_a_gpu(spec, seq_len, d, dtype, sizes):
    """Without a GPU: the variants lower through Triton (strided loads and stores, the head
    group as a slice), three custom calls per term (gathered: four for both terms) and, for the
    chained variant on ``sparse_attention``'s [B, n, H, d] arrays, neither a transpose nor a
    log-sum-exp merge (an exponential) left to XLA; gathered leaves it no scatter either, and
    with option atomic it has no dq kernel: its two dk/dv kernels add dq atomically."""
    seq_major = sizes.variant == "chained"
    x = jax.ShapeDtypeStruct((1, seq_len, 4, d) if seq_major else (1, 4, seq_len, d),
                             jnp.dtype(dtype))

    def loss(q, k, v):
        return sequence_attention(spec, q, k, v, sizes=sizes, interpret=False,
                                    seq_major=seq_major).astype(jnp.float32).sum()

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = (3 if sizes.atomic_dq else 4) if sizes.gathered else 3 * len(spec.terms())
    assert text.count("custom_call @__gpu$xla.gpu.triton(") == calls
    assert text.count("\\00atomic_rmw\\00") == (2 if sizes.atomic_dq else 0)
    if sizes.gathered:
        assert "stablehlo.scatter" not in text
    if sizes.variant == "chained":
        hlo = [line for line in text.splitlines() if "triton" not in line]
        assert not any("stablehlo.transpose" in line or "stablehlo.exponential" in line
                       for line in hlo)


@pytest.mark.parametrize("spec,terms", [(PatternSpec("strided", stride=128), 2),
                                         (PatternSpec("local", stride=128), 1)])
def test_onepass_lowers_to_two_kernels_a_term_and_nothing_between(spec, terms):
    """Without a GPU: the one-pass variant lowers through Triton to a forward and a backward
    kernel per term (persistent grids of the H100's resident slots), on [B, n, H, d] arrays
    with nothing left to XLA: no transpose, no merge (exponential), no delta (reduction), no
    scaling of q or dq (multiply). (The compile check counts XLA's kernels: the loss's own.)"""
    x = jax.ShapeDtypeStruct((1, 2048, 4, 64), jnp.bfloat16)

    def loss(q, k, v):
        return A.sparse_attention(q, k, v, spec, "pallas",
                                  K.BlockSizes(variant="onepass", num_stages=1))

    with tiles.compiling_for("gpu"):
        text = jax.jit(jax.grad(lambda *a: loss(*a).astype(jnp.float32).sum(),
                                argnums=(0, 1, 2))).trace(x, x, x).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @__gpu$xla.gpu.triton(") == 2 * terms
    hlo = [line for line in text.splitlines() if "triton" not in line]
    for op in ("transpose", "exponential", "reduce", "multiply", "select"):
        assert not any(f"stablehlo.{op}" in line for line in hlo), op
    with pytest.raises(ValueError, match="onepass serves band and column terms .* SummaryTerm"):
        A.sparse_attention(*qkv(64, 16, jnp.float32)[:3], PatternSpec("fixed", stride=16, c=4),
                           "pallas", ONEPASS)


def test_onepass_atomic_backward_lowers_to_atomic_adds_and_dqs_zeros_and_cast():
    """Option atomic: still a forward and a backward kernel a term, the backward's dq added
    with Triton atomics to float32 zeros of XLA's and cast once at the end: XLA's operations
    are the plain one-pass variant's and those two (no transpose, merge, delta or scaling)."""
    x = jax.ShapeDtypeStruct((1, 2048, 4, 64), jnp.bfloat16)

    def lowered(options):
        def loss(q, k, v):
            return A.sparse_attention(q, k, v, PatternSpec("strided", stride=128), "pallas",
                                      K.BlockSizes.parse(options))

        with tiles.compiling_for("gpu"):
            text = jax.jit(jax.grad(lambda *a: loss(*a).astype(jnp.float32).sum(),
                                    argnums=(0, 1, 2))).trace(x, x, x).lower(
                lowering_platforms=("cuda",)).as_text()
        ops = [re.search(r"stablehlo\.(\w+)", line) for line in text.splitlines()
               if "triton" not in line]
        return text, sorted(op.group(1) for op in ops if op)

    text, ops = lowered("onepass:s1:atomic")
    plain_text, plain = lowered("onepass:s1")
    assert text.count("custom_call @__gpu$xla.gpu.triton(") == 4
    assert text.count("\\00atomic_rmw\\00") == 2 and "atomic_rmw" not in plain_text  # dq's
    assert sorted(plain + ["constant", "broadcast_in_dim", "convert"]) == ops  # zeros, cast



TPU_CASES = [  # spec, seq_len (a multiple of the block), head dim, dtype
    (PatternSpec("strided", stride=128), 1024, 128, "bfloat16"),
    (PatternSpec("fixed", stride=128, c=32, summary="lra", summary_block=1), 768, 64, "float32"),
]


@pytest.mark.parametrize("spec,seq_len,d,dtype", TPU_CASES,
                         ids=[f"{c[0]}-d{c[2]}-{c[3]}" for c in TPU_CASES])
def test_kernels_lower_to_mosaic_for_a_tpu(spec, seq_len, d, dtype):
    """Without a TPU: forward and backward lower for a TPU through Pallas' Mosaic lowering (lists
    in scalar memory, 128 × 128 tiles), one custom call per kernel."""
    x = jax.ShapeDtypeStruct((1, 2, seq_len, d), jnp.dtype(dtype))

    def loss(q, k, v):
        return sequence_attention(spec, q, k, v, backend="mosaic", interpret=False).sum()

    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
        lowering_platforms=("tpu",))
    assert lowered.as_text().count("custom_call @tpu_custom_call(") == 3 * len(spec.terms())


@pytest.mark.parametrize("sizes", [K.BlockSizes(256, 256), K.BlockSizes(128, 128,
                                                                       heads_per_program=2)],
                         ids=["256x256", "128x128-h2"])
def test_larger_mosaic_tiles_and_head_groups_lower_for_a_tpu(sizes):
    """Tiles of 256 (two of the pattern's 128-blocks) and grid steps of two heads lower through
    Mosaic too."""
    spec, x = PatternSpec("strided", stride=128), jax.ShapeDtypeStruct((1, 2, 1024, 128),
                                                                        jnp.bfloat16)

    def loss(q, k, v):
        return sequence_attention(spec, q, k, v, sizes=sizes, backend="mosaic",
                                    interpret=False).sum()

    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
        lowering_platforms=("tpu",))
    assert lowered.as_text().count("custom_call @tpu_custom_call(") == 3 * len(spec.terms())


@pytest.mark.parametrize("spec,seq_len,sizes", [
    (PatternSpec("strided", stride=16), 93, SMALL),
    (PatternSpec("fixed", stride=16, c=4), 80, SMALL),
    # a grid step for both heads, tiles larger than the pattern's blocks (as 256 x 256 on l=128)
    (PatternSpec("strided", stride=16), 93, K.BlockSizes(32, 32, heads_per_program=2)),
    (PatternSpec("fixed", stride=16, c=4), 80, K.BlockSizes(32, 16, heads_per_program=2)),
    # the summary term on its own tiles (sumQxK)
    (PatternSpec("fixed", stride=16, c=4), 96, K.BlockSizes(16, 16, summary_q=32, summary_k=16))],
    ids=lambda c: str(c) if not isinstance(c, K.BlockSizes) else
    f"{c.block_q}x{c.block_k}-h{c.heads_per_program}"
    + (f"-sum{c.summary_q}x{c.summary_k}" if c.summary_q else ""))
def test_tpu_kernels_match_dense_in_interpret_mode(spec, seq_len, sizes):
    """The TPU flavour (a grid step per list entry and head group, running softmax in scratch)
    computes the same as the dense reference, forward and gradients, float32, for the three
    layouts (rows, columns, packed summary keys); the mask rule and lists are the GPU
    flavour's."""
    assert_mosaic_matches_dense(spec, seq_len, sizes)


def assert_mosaic_matches_dense(spec, seq_len, sizes):
    """The TPU kernels in interpret mode give the dense reference's output and gradients,
    float32, on [B, n, H, d] arrays (padded to the grid and transposed to the kernels')."""
    q, k, v, cot = qkv(seq_len, 64, jnp.float32)
    mask, rows = spec.mask(seq_len), -(-seq_len // spec.block)

    def kernel(q, k, v):  # [B, n, H, d] -> the grid-padded [B, H, n', d] layout and back
        seq = lambda x: jnp.pad(  # noqa: E731
            x, ((0, 0), (0, rows * spec.block - seq_len), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
        out = sequence_attention(spec, seq(q) / 8.0, seq(k), seq(v), sizes=sizes,
                                   backend="mosaic", interpret=True)
        return out[:, :, :seq_len].transpose(0, 2, 1, 3)

    err = errors(out_and_grads(kernel, q, k, v, cot),
                 out_and_grads(lambda q, k, v: A.dense_attention(q, k, v, mask), q, k, v, cot))
    assert err[0] < 1e-5 and max(err[1:]) < 1e-4, err


BAND_CASES = [  # spec, seq_len, sizes, the terms the band kernels run
    # one window per step clipped at the start, steps of 2 blocks, a ragged end
    (PatternSpec("strided", stride=16), 93, K.BlockSizes(32, 32, band=16, band_group=2),
     {"rows", "columns"}),
    # 16 blocks a step asked for, fewer given (the sequence is 5 blocks)
    (PatternSpec("strided", stride=16), 80, K.BlockSizes(32, 32, band=16), {"rows", "columns"}),
    # columns of 16 rows as 2 blocks of 8: a window of 2 blocks ending at the query's
    (PatternSpec("strided", stride=16), 256, K.BlockSizes(16, 16, band=8, band_group=4),
     {"rows", "columns"}),
    # wider tiles score less than the band would for the columns: the listed kernels run them
    (PatternSpec("strided", stride=16), 200, K.BlockSizes(32, 64, band=16, band_group=4),
     {"rows"}),
    # fixed: its row block by band, its summary keys by lists
    (PatternSpec("fixed", stride=16, c=4), 80, K.BlockSizes(32, 16, band=16), {"rows"}),
]


@pytest.mark.parametrize("spec,seq_len,sizes,kinds", BAND_CASES,
                         ids=[f"{c[0]}-n{c[1]}-band{c[2].band}x{c[2].band_group}"
                              for c in BAND_CASES])
def test_band_kernels_match_dense_in_interpret_mode(spec, seq_len, sizes, kinds):
    """The TPU's band kernels (a term whose keys lie in a window of blocks around each query
    block: whole windows at once, several blocks a grid step, masks from a table, log-sum-exp
    lane-dense) compute what the dense reference does, forward and gradients, float32."""
    compiler = compiler_for(sizes, "mosaic", interpret=True)
    terms = _terms(spec, -(-seq_len // spec.block), compiler)
    assert {layout.kind for layout, _, _, band, _ in terms if band} == kinds
    assert_mosaic_matches_dense(spec, seq_len, sizes)


def test_band_kernels_score_half_the_pairs_of_the_tiles_for_strided():
    """At the paper's l = 128 and 16k, 128-row band blocks score half the (query, key) pairs
    of 256 x 256 tiles (a block and the one before it; a column's own block), and the plan is
    what the kernels read: 16 blocks a step, windows of 17 blocks inside the sequence."""
    spec, n = PatternSpec("strided", stride=128), 16384
    tiles = sparsity(spec, n, K.BlockSizes(256, 256))
    band = sparsity(spec, n, K.BlockSizes.for_backend("mosaic"))
    assert band["kept"] == tiles["kept"] and 1.95 < tiles["scored"] / band["scored"] <= 2
    layout = K.term_layout(spec.terms()[0], n // 128)
    length, queries, keys = K.band_plan(layout, 128, 16, 256, 256)
    assert length == n and (queries.width, queries.group, queries.steps) == (2, 16, 8)
    starts = queries.meta[:queries.steps]
    assert starts.min() == 0 and starts.max() + 17 <= n // 128
    assert len(queries.masks) <= 3 and queries.masks.shape[1:] == (128, 256)


def qkv(seq_len, d, dtype, dv=None, heads=2, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k = (jax.random.normal(key, (2, seq_len, heads, d)).astype(dtype) for key in keys[:2])
    v = jax.random.normal(keys[2], (2, seq_len, heads, dv or d)).astype(dtype)
    cot = jax.random.normal(keys[3], v.shape, jnp.float32)
    return q, k, v, cot


def out_and_grads(attend, q, k, v, cot):
    loss = lambda q, k, v: (attend(q, k, v).astype(jnp.float32) * cot).sum()  # noqa: E731
    return jax.jit(lambda q, k, v: (attend(q, k, v),
                                    jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))(q, k, v)


def errors(got, want):
    out, grads = got
    want_out, want_grads = want
    diff = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max())  # noqa: E731,E501
    return [diff(out, want_out)] + [diff(g, w) for g, w in zip(grads, want_grads)]


KERNEL_CASES = [  # spec, seq_len, head dim, dtype, kernel tiles
    (PatternSpec("strided", stride=16), 128, 64, "float32", SMALL),
    (PatternSpec("strided", stride=16), 117, 128, "float32", K.BlockSizes(16, 32)),
    (PatternSpec("strided", stride=16, local_width=16), 100, 64, "bfloat16", SMALL),
    (PatternSpec("fixed", stride=16, c=4), 128, 64, "float32", SMALL),
    (PatternSpec("fixed", stride=16, c=4, summary="lra"), 90, 64, "float32", SMALL),
    (PatternSpec("fixed", stride=16, c=4, part="summary", summary_block=1), 101, 128,
     "bfloat16", SMALL),
    (PatternSpec("fixed", stride=16, c=4, summary_block=3), 80, 64, "bfloat16",
     K.BlockSizes(32, 16)),
    (PatternSpec("local", stride=24, local_width=24), 96, 128, "float32", SMALL),
    (PatternSpec("strided", stride=16, part="strided"), 75, 64, "float32", SMALL),
]


@pytest.mark.parametrize("spec,seq_len,d,dtype,sizes", KERNEL_CASES,
                         ids=[f"{c[0]}-n{c[1]}-d{c[2]}-{c[3]}" for c in KERNEL_CASES])
def test_kernel_matches_dense(spec, seq_len, d, dtype, sizes):
    q, k, v, cot = qkv(seq_len, d, jnp.dtype(dtype))
    mask = spec.mask(seq_len)
    dense = lambda q, k, v: A.dense_attention(q, k, v, mask)  # noqa: E731
    kernel = lambda q, k, v: A.sparse_attention(q, k, v, spec, "pallas", sizes)  # noqa: E731
    got = out_and_grads(kernel, q, k, v, cot)
    assert got[0].dtype == q.dtype and all(g.dtype == q.dtype for g in got[1])
    if dtype == "float32":
        err = errors(got, out_and_grads(dense, q, k, v, cot))
        assert err[0] < 1e-5 and max(err[1:]) < 1e-4, err
    else:  # against the float32 reference of the same rounded inputs (and, once, the XLA path)
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        want = out_and_grads(dense, *f32, cot)
        err = errors(got, want)
        assert max(err) < 5e-2, err
        if spec.summary_block == 3:
            xla = errors(out_and_grads(lambda q, k, v: A.sparse_attention(q, k, v, spec),
                                       q, k, v, cot), want)
            assert all(e <= 2 * x + 1e-2 for e, x in zip(err, xla)), (err, xla)
    if spec.part == "summary":  # queries before row 0's first summary key have none: zeros
        empty = (spec.indices(seq_len) < 0).all(1)
        assert empty.any()
        np.testing.assert_array_equal(got[0][:, empty], 0)


CHAINED, HEADS2 = K.BlockSizes(16, 16, variant="chained"), K.BlockSizes(16, 16, heads_per_program=2)
BOTH = K.BlockSizes(16, 16, variant="chained", heads_per_program=2)
VARIANT_CASES = [  # spec, seq_len, head dim, dtype, kernel tiles and variant (batch 2, 2 heads)
    (PatternSpec("strided", stride=16), 117, 64, "float32", CHAINED),
    (PatternSpec("strided", stride=16), 128, 64, "bfloat16", BOTH),
    (PatternSpec("strided", stride=16, local_width=16), 100, 64, "float32", BOTH),
    (PatternSpec("strided", stride=12, local_width=30), 96, 32, "float32", CHAINED),
    (PatternSpec("strided", stride=16, part="strided"), 75, 64, "float32",
     K.BlockSizes(32, 16, variant="chained")),
    (PatternSpec("fixed", stride=16, c=4), 90, 64, "float32", BOTH),
    (PatternSpec("fixed", stride=16, c=4, summary="lra"), 80, 64, "bfloat16", CHAINED),
    (PatternSpec("strided", stride=16), 100, 64, "bfloat16", HEADS2),
    (PatternSpec("strided", stride=16), 117, 64, "float32",
     K.BlockSizes(16, 16, variant="chained", heads_per_program=2, one_loop=True)),
    (PatternSpec("fixed", stride=16, c=4, summary="lra"), 90, 64, "bfloat16",
     K.BlockSizes(16, 16, heads_per_program=2, one_loop=True)),
    # queries tiles twice the keys' (the report's 64x32 variants) over a stride of two tiles
    (PatternSpec("strided", stride=32), 200, 64, "float32",
     K.BlockSizes(32, 16, variant="chained", one_loop=True)),
    (PatternSpec("fixed", stride=32, c=8), 160, 64, "bfloat16",
     K.BlockSizes(32, 16, variant="chained")),
    # the summary term on its own tiles (sumQxK), larger than the band's, in both variants
    (PatternSpec("fixed", stride=16, c=4), 90, 64, "float32",
     K.BlockSizes(16, 16, variant="chained", summary_q=32, summary_k=16)),
    (PatternSpec("fixed", stride=16, c=4, summary="lra"), 100, 64, "float32",
     K.BlockSizes(16, 16, summary_q=32, summary_k=32)),
    # gathered (attention.pallas_gathered): both terms at once over the gathered summary keys;
    # lengths that are not and are multiples of the tiles, both summary conventions, the band
    # with residues (part="summary"), tiles over several rows (l = 12), own dk/dv tiles
    (PatternSpec("fixed", stride=16, c=4), 90, 32, "float32",
     K.BlockSizes(16, 16, variant="chained", gathered=True, heads_per_program=2)),
    (PatternSpec("fixed", stride=16, c=4, summary="lra", summary_block=1), 96, 32, "bfloat16",
     K.BlockSizes(16, 16, variant="chained", gathered=True, summary_q=32, summary_k=16,
                  dkv=(16, 32, 0))),
    (PatternSpec("fixed", stride=12, c=3, part="summary", summary="lra"), 75, 32, "float32",
     K.BlockSizes(16, 16, variant="chained", gathered=True)),
    # and with dq added atomically by both dk/dv programs (option atomic), the same cases
    (PatternSpec("fixed", stride=16, c=4), 90, 32, "float32",
     K.BlockSizes(16, 16, variant="chained", gathered=True, heads_per_program=2,
                  atomic_dq=True)),
    (PatternSpec("fixed", stride=16, c=4, summary="lra", summary_block=1), 96, 32, "bfloat16",
     K.BlockSizes(16, 16, variant="chained", gathered=True, summary_q=32, summary_k=16,
                  dkv=(16, 32, 0), atomic_dq=True)),
    (PatternSpec("fixed", stride=12, c=3, part="summary", summary="lra"), 75, 32, "float32",
     K.BlockSizes(16, 16, variant="chained", gathered=True, atomic_dq=True)),
]


ONEPASS = K.BlockSizes(16, 16, variant="onepass")
VARIANT_CASES += [  # the one-pass variant: every band and column pattern it serves
    (PatternSpec("strided", stride=16), 117, 64, "float32", ONEPASS),  # paper: l + 1 keys
    (PatternSpec("strided", stride=16, local_width=16), 128, 64, "bfloat16", ONEPASS),  # l
    (PatternSpec("strided", stride=12, local_width=30), 96, 48, "float32", ONEPASS),
    (PatternSpec("strided", stride=16, part="strided"), 75, 64, "bfloat16",
     K.BlockSizes(32, 16, variant="onepass")),
    (PatternSpec("local", stride=24, local_width=24), 100, 64, "float32", ONEPASS),
    (PatternSpec("strided", stride=32), 200, 64, "bfloat16",
     K.BlockSizes(32, 16, variant="onepass", one_loop=True)),
]
ATOMIC = K.BlockSizes(16, 16, variant="onepass", atomic_dq=True)
VARIANT_CASES += [  # the one-pass backward with dq added atomically (option atomic)
    (PatternSpec("strided", stride=16), 117, 64, "float32", ATOMIC),  # off the blocks
    (PatternSpec("strided", stride=16, local_width=16), 128, 64, "bfloat16", ATOMIC),  # on
    (PatternSpec("strided", stride=12, local_width=30), 96, 48, "float32", ATOMIC),  # scaled
    (PatternSpec("strided", stride=16, part="strided"), 75, 64, "bfloat16",
     K.BlockSizes(32, 16, variant="onepass", atomic_dq=True)),
    (PatternSpec("local", stride=24, local_width=24), 100, 64, "float32", ATOMIC),
    (PatternSpec("strided", stride=32), 200, 64, "bfloat16",
     K.BlockSizes(32, 16, variant="onepass", one_loop=True, atomic_dq=True)),
]


@pytest.mark.parametrize("spec,seq_len,d,dtype,sizes", VARIANT_CASES, ids=[
    f"{c[0]}-n{c[1]}-{c[3]}-{c[4].variant}-h{c[4].heads_per_program}"
    + ("-one_loop" if c[4].one_loop else "")
    + (f"-sum{c[4].summary_q}x{c[4].summary_k}" if c[4].summary_q else "")
    + ("-gathered" if c[4].gathered else "") + ("-atomic" if c[4].atomic_dq else "")
    for c in VARIANT_CASES])
def test_kernel_variant_matches_dense(spec, seq_len, d, dtype, sizes):
    """Each kernel variant (``BlockSizes.variant``: the chained terms, reading the column term
    strided from sequence-order arrays; the one-pass kernels, whose programs walk several
    items each in interpret mode (``pallas_onepass.INTERPRET_PROGRAMS``), with q scaled and
    head dims padded inside (d = 48); ``heads_per_program``: one list walk for two heads;
    ``one_loop``: partial and full blocks in one loop; ``gathered``: the fixed pattern over its
    gathered summary keys; ``atomic_dq``: the one-pass backward adding dq atomically, at
    lengths on and off the blocks) gives the dense reference's output and gradients, at
    lengths that need padding (the chained column term pads rows to its tile), tolerances as
    ``test_kernel_matches_dense``."""
    q, k, v, cot = qkv(seq_len, d, jnp.dtype(dtype))
    kernel = lambda q, k, v: A.sparse_attention(q, k, v, spec, "pallas", sizes)  # noqa: E731
    got = out_and_grads(kernel, q, k, v, cot)
    assert got[0].dtype == q.dtype and all(g.dtype == q.dtype for g in got[1])
    want = out_and_grads(lambda q, k, v: A.dense_attention(q, k, v, spec.mask(seq_len)),
                         *(x.astype(jnp.float32) for x in (q, k, v)), cot)
    err = errors(got, want)
    if dtype == "float32":
        assert err[0] < 1e-5 and max(err[1:]) < 1e-4, err
    else:
        assert max(err) < 5e-2, err


@pytest.mark.parametrize("spec,sizes", [
    (PatternSpec("fixed", stride=128, c=32), K.BlockSizes.parse("chained:gathered:dkv128x128w8")),
    (PatternSpec("fixed", stride=128, c=128, summary="lra"), K.BlockSizes.parse(
        "16x32:chained:gathered")),
    (PatternSpec("fixed", stride=12, c=3, summary="lra"), K.BlockSizes.parse(
        "32x16:chained:gathered:sum64x16:dkv16x32"))], ids=["paper", "whole-row", "l12"])
def test_gathered_kernels_read_and_write_inside_their_arrays(spec, sizes):
    """Every tile the gathered kernels load or store lies inside its array, from the host's copy
    of their index arithmetic: interpret mode clamps a slice that overruns (the tests above
    would not see it), a GPU reads out of bounds."""
    from sparse_jax.attention import gathered_plan as G

    for n in (spec.stride * 3, 4096 + spec.stride):
        p = G.plan(spec, n, compiler_for(sizes, "triton", interpret=True))
        j = np.arange(p.length // p.band_k)
        starts = np.stack([w[0] for w in G.read_windows(j, p)])
        assert starts.min() >= 0 and starts.max() + p.band_k <= p.gathered, (n, p)
        tables = G.tables(p)
        dkv = p.for_dkv()
        entries = p.length // p.block * p.per_row
        assert len(tables["sparse_dkv_gathered"]) * dkv.bk + 2 * p.front == p.gathered
        assert len(tables["sparse_dkv_gathered"]) * dkv.bk >= entries
        i = np.arange(p.length // p.bq)  # forward and dq: gathered then band key tiles
        assert (G.summary_q(i, p)[1] * p.bk + p.front <= p.gathered - p.front).all()
        assert (G.band_q(i, p)[1] * p.band_k <= p.length).all()
        k = np.arange(len(tables["sparse_dkv_gathered"]))  # dk/dv: the query tiles walked
        _, whole, end = G.summary_k(k, dkv)
        assert end == p.length // dkv.bq and np.all(whole <= end)
        assert (G.band_k(j, p)[1] * p.band_q <= p.length).all()


def test_chained_log_sum_exp_matches_dense():
    """The chained (and one-pass) variant's log-sum-exp is the joint one over every term's
    keys, also on sequence-major arrays."""
    spec, n = PatternSpec("strided", stride=16), 64
    q, k, _, _ = qkv(n, 32, jnp.float32, heads=2)
    seq = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    out, lse = sequence_attention(spec, seq(q), seq(k), seq(k), sizes=BOTH, return_lse=True)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    want = jax.nn.logsumexp(jnp.where(spec.mask(n), scores, -jnp.inf), axis=-1)
    np.testing.assert_allclose(lse, want, atol=1e-5, rtol=0)
    assert out.dtype == jnp.float32
    for sizes in (BOTH, SMALL):  # [B, n, H, d] arrays: read as they are, or transposed (terms)
        got = sequence_attention(spec, q, k, k, sizes=sizes, return_lse=True, seq_major=True)
        np.testing.assert_allclose(got[0], seq(out), atol=1e-5)
        np.testing.assert_allclose(got[1], want.swapaxes(1, 2), atol=1e-5, rtol=0)
    # the one-pass variant's, q scaled inside its kernels, on either layout
    for seq_major, x, lse in ((True, seq, lambda a: a.swapaxes(1, 2)),
                              (False, lambda a: a, lambda a: a)):
        got = sequence_attention(spec, *(x(seq(a)) for a in (q * 2, k, k)), sizes=ONEPASS,
                                 return_lse=True, seq_major=seq_major, scale=0.5)
        np.testing.assert_allclose(got[0], x(out), atol=1e-5)
        np.testing.assert_allclose(got[1], lse(want), atol=1e-5, rtol=0)


def test_log_sum_exp_and_half_size_values():
    """The forward's second output is each row's log-sum-exp over its kept scores; values may be
    narrower than queries and keys (the paper's half-size q/k), head dims not powers of two."""
    spec, n, d = PatternSpec("fixed", stride=16, c=4), 96, 24
    q, k, v, _ = qkv(n, d, jnp.float32, dv=40, heads=1)
    seq = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    out, lse = sequence_attention(spec, seq(q) / math.sqrt(d), seq(k), seq(v), sizes=SMALL,
                                    return_lse=True)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    want_lse = jax.nn.logsumexp(jnp.where(spec.mask(n), scores, -jnp.inf), axis=-1)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=0)
    np.testing.assert_allclose(seq(out), A.dense_attention(q, k, v, spec.mask(n)), atol=1e-5)


def test_implementation_choice():
    from sparse_jax.attention import native

    assert A.resolve_implementation("auto") == (
        "pallas" if jax.default_backend() in ("gpu", "tpu")
        else "native" if native.available() else "xla")
    assert A.resolve_implementation("pallas") == "pallas"
    with pytest.raises(ValueError, match="implementation"):
        A.resolve_implementation("triton")
    with pytest.raises(ValueError, match="power of two"):
        K.BlockSizes(48, 64)
    with pytest.raises(ValueError, match="power of two"):
        K.BlockSizes(heads_per_program=3)
    with pytest.raises(ValueError, match="variant"):
        K.BlockSizes(variant="fused")
    with pytest.raises(ValueError, match="chained.*triton"):
        compiler_for(K.BlockSizes(128, 128, variant="chained"), backend="mosaic")
    from sparse_jax.bench.attention import parse_pattern  # a benchmark names a variant

    assert parse_pattern("strided:128@pallas:64x32:chained:h2:w8:s3:one_loop", 1024)[2] == (
        K.BlockSizes(64, 32, 8, 3, variant="chained", heads_per_program=2, one_loop=True))
    with pytest.raises(ValueError, match="unknown kernel option"):
        parse_pattern("strided:128@pallas:fused", 1024)
    assert parse_pattern("strided:128@pallas:onepass:s1", 1024)[2] == K.BlockSizes(
        variant="onepass", num_stages=1)
    assert parse_pattern("strided:128@pallas:onepass:s1:atomic", 1024)[2] == K.BlockSizes(
        variant="onepass", num_stages=1, atomic_dq=True)
    assert parse_pattern("strided:128@pallas:512x512:band128x4", 1024)[2] == K.BlockSizes(
        512, 512, band=128, band_group=4)
    assert K.BlockSizes.parse("band0", K.BlockSizes.for_backend("mosaic")).band == 0
    # options left out keep the backend's defaults: band0 on a TPU keeps its 512 x 512 tiles
    assert parse_pattern("fixed:128:32@pallas:band0", 1024, backend="mosaic")[2] == (
        K.BlockSizes(512, 512, band=0))
    with pytest.raises(ValueError, match="band_group=3 .* power of two"):
        K.BlockSizes(band=128, band_group=3)
    assert parse_pattern("fixed:128:32@pallas:chained:sum128x64", 1024)[2] == K.BlockSizes(
        variant="chained", summary_q=128, summary_k=64)  # the summary term's own tiles
    with pytest.raises(ValueError, match="summary_k=0 .*sumQxK"):
        K.BlockSizes(summary_q=64)
    with pytest.raises(ValueError, match="summary tiles 8x16 .* Triton needs at least 16"):
        compiler_for(K.BlockSizes(summary_q=8, summary_k=16), backend="triton", interpret=False)
    assert parse_pattern("fixed:128:32@pallas:chained:gathered:dkv128x128w8", 1024)[2] == (
        K.BlockSizes(variant="chained", gathered=True, dkv=(128, 128, 8)))
    assert parse_pattern("fixed:128:32@pallas:chained:gathered:atomic", 1024)[2] == (
        K.BlockSizes(variant="chained", gathered=True, atomic_dq=True))
    with pytest.raises(ValueError, match="gathered=True .* needs the chained variant"):
        K.BlockSizes.parse("gathered")
    with pytest.raises(ValueError, match="dkvQxKwN.*give it with gathered"):
        K.BlockSizes.parse("chained:dkv64x64")
    with pytest.raises(ValueError, match="chained.* needs the triton backend"):
        compiler_for(K.BlockSizes(512, 512, variant="chained", gathered=True), backend="mosaic")
    with pytest.raises(ValueError, match="divide the 2 heads"):
        A.sparse_attention(*qkv(32, 8, jnp.float32)[:3], PatternSpec("strided", stride=8),
                           "pallas", K.BlockSizes(16, 16, heads_per_program=4))
    q, k, v, _ = qkv(32, 8, jnp.float32)
    dense = A.sparse_attention(q, k, v, PatternSpec("dense"), "pallas")  # dense: always XLA
    np.testing.assert_allclose(dense, A.sparse_attention(q, k, v, PatternSpec("dense")),
                               atol=1e-5)


def assert_model_matches_xla(base: dict, attention: str, kernel: str = "", on_mesh=True):
    """``ModelConfig(**base, attention=attention, kernel=kernel)`` gives the XLA model's loss
    and gradients, alone and (``on_mesh``) with the batch split on a mesh (the trainer's
    ``activation_sharding``), where the kernel runs inside ``shard_map`` (XLA does not split a
    custom call)."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as Spec

    mesh = Mesh(np.array(jax.devices()).reshape(-1, 1), ("data", "fsdp"))
    batch = NamedSharding(mesh, Spec(("data", "fsdp")))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2 * mesh.size, base["seq_len"]), 0, 256)
    results = {}
    cases = [("xla", None), (attention, None)] + [(attention, batch)] * on_mesh
    for impl, sharding in cases:
        options = {"kernel": kernel} if impl != "xla" else {}
        model = SparseTransformer(ModelConfig(**base, attention=impl, **options),
                                  rngs=nnx.Rngs(0))
        graph, params = nnx.split(model, nnx.Param)

        def loss(params, graph=graph, sharding=sharding):
            logits = nnx.merge(graph, params)(tokens, activation_sharding=sharding)
            return (jax.nn.log_softmax(logits) * jax.nn.one_hot(tokens, 256)).sum()

        uses_shard_map = "shard_map" in str(jax.make_jaxpr(loss)(params))
        assert uses_shard_map == (sharding is not None)
        results[impl, sharding] = jax.jit(jax.value_and_grad(loss))(params)
    want_loss, want_grads = results["xla", None]
    for got_loss, got_grads in [results[case] for case in cases[1:]]:
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
        for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-4)


def test_model_attention_option_and_mesh():
    """``ModelConfig.attention="pallas"`` gives the XLA model's loss and gradients (multi-head
    fixed with distinct summary blocks, half-size q/k), also inside ``shard_map`` on a mesh."""
    base = dict(seq_len=32, num_layers=1, d_model=32, num_heads=2, pattern="fixed", stride=16,
                c=8, mode="multihead", distinct_summaries=True, qk_ratio=0.5)
    assert_model_matches_xla(base, "pallas")
    with pytest.raises(ValueError, match="attention"):
        ModelConfig(**base, attention="cuda")
    assert P.check_choice("implementation", "auto", A.IMPLEMENTATIONS) == "auto"


def test_model_attention_kernel_variant_matches_dense():
    """``ModelConfig.kernel`` reaches the layers' kernel: the chained variant with two heads
    per program gives the XLA model's loss and gradients (strided, rotary; the mesh path is the
    default kernel's test above, the same shard_map), so do the one-pass kernels (also with dq
    added atomically), and so does the gathered fixed pattern (also with
    dq added atomically) with a distinct summary for each head group; a bad option is refused
    in one line when the config is built."""
    base = dict(seq_len=64, num_layers=1, d_model=32, num_heads=2, pattern="strided", stride=8,
                rotary=True)
    assert_model_matches_xla(base, "pallas", kernel="16x16:chained:h2", on_mesh=False)
    assert_model_matches_xla(base, "pallas", kernel="16x16:onepass:s1", on_mesh=False)
    assert_model_matches_xla(base, "pallas", kernel="16x16:onepass:s1:atomic", on_mesh=False)
    fixed = dict(base, pattern="fixed", c=8, rotary=False, stride=16, mode="multihead",
                 distinct_summaries=True)  # two summary blocks, a head each
    assert_model_matches_xla(fixed, "pallas", kernel="16x16:chained:gathered", on_mesh=False)
    assert_model_matches_xla(fixed, "pallas", kernel="16x16:chained:gathered:atomic",
                             on_mesh=False)
    with pytest.raises(ValueError, match="ModelConfig.kernel='h3'.*power of two"):
        ModelConfig(**base, kernel="h3")


BAD_KERNEL_OPTIONS = [  # (model.kernel, the one line's tail); the model has 4 heads
    ("h8", "h8 heads per program must divide the model's 4 heads; give h1, h2, h4"),
    ("w0", "num_warps=0 (option w0) must be a power of two from 1 to 32"),
    ("w3", "num_warps=3 (option w3) must be a power of two from 1 to 32"),
    ("s0", "num_stages=0 (option s0) must be at least 1"),
    ("1x1", "kernel tiles 1x1: Triton needs at least 16 queries and 16 keys per tile"),
    ("terms:chained", "'terms' and 'chained' both set the variant; give each option once"),
    ("h2:h4", "'h2' and 'h4' both set the heads per program; give each option once"),
    ("64x64:32x32", "'64x64' and '32x32' both set the tiles; give each option once"),
    ("chained:chained", "'chained' is given twice; give each option once"),
    ("onepass:h2", "kernel variant onepass walks one head a work item: leave out h2"),
    ("chained:atomic", "atomic_dq=True (option atomic) needs the onepass variant, not 'chained'"),
]


@pytest.mark.parametrize("options, message", BAD_KERNEL_OPTIONS)
def test_bad_kernel_options_are_refused_when_the_config_is_read(tmp_path, options, message):
    """Whatever a kernel option can get wrong is one line when the config is read, on any
    platform and whether or not the kernel runs here: before data, devices or the workdir."""
    import configs
    from sparse_jax import train

    config = configs.load("quickstart.py:data=embedded",
                          {"model.num_heads": 4, "model.kernel": options})
    with pytest.raises(ValueError) as e:
        train.train(config, str(tmp_path / "run"))
    line = str(e.value)
    assert line.startswith(f"ModelConfig.kernel={options!r}: ") and message in line, line
    assert "\n" not in line
    assert os.listdir(tmp_path) == []  # no workdir, nothing else


def test_heads_per_program_are_checked_against_each_head_group():
    """Multi-head mode splits a layer's heads over its patterns: each kernel call attends a
    group's heads, which hG must divide (h4 fits the model's 4 heads, not 2 groups of 2)."""
    base = dict(seq_len=64, num_layers=2, d_model=32, num_heads=4, pattern="strided", stride=8)
    ModelConfig(**base, kernel="h4")
    ModelConfig(**base, mode="multihead", kernel="h2")
    with pytest.raises(ValueError, match=re.escape(
            "ModelConfig.kernel='h4': h4 heads per program must divide the heads of each head "
            "group (2: the 4 heads split evenly over a layer's patterns); give h1, h2")):
        ModelConfig(**base, mode="multihead", kernel="h4")
    with pytest.raises(ValueError, match=re.escape(  # the onepass variant serves no summary
            "ModelConfig.kernel='onepass': kernel variant onepass serves band and column terms "
            "(strided, local), not fixed(stride=8, c=2)'s SummaryTerm: give chained or terms")):
        ModelConfig(**{**base, "pattern": "fixed", "c": 2}, kernel="onepass")
    ModelConfig(**{**base, "pattern": "fixed", "c": 2, "num_layers": 1}, mode="interleaved",
                kernel="onepass")  # its one layer attends fixed's block part alone


def test_kernel_options_are_checked_for_the_platform_traced_for():
    """The tiles and Triton-only options against the backend of ``target_platform``; where the
    options cannot apply, ``kernel_unused`` is the one line that says so (None where they do)."""
    from sparse_jax.attention import native
    from sparse_jax.attention.tiles import compiling_for

    base = dict(seq_len=64, num_layers=1, d_model=32, num_heads=2, pattern="strided", stride=8)
    with compiling_for("gpu"):
        assert ModelConfig(**base, attention="auto", kernel="16x16:chained:h2:w8:s3") \
            .kernel_unused is None
        with pytest.raises(ValueError, match=r"band=128\) .* needs the mosaic backend"):
            ModelConfig(**base, attention="auto", kernel="band128x16")
        assert "dense attention runs" in ModelConfig(**{**base, "pattern": "dense"},
                                                     attention="auto", kernel="chained") \
            .kernel_unused
    with compiling_for("tpu"):
        assert ModelConfig(**base, attention="auto", kernel="256x128").kernel_unused is None
        with pytest.raises(ValueError, match="64x64: Mosaic .* multiples of 128"):
            ModelConfig(**base, attention="auto", kernel="64x64")
        with pytest.raises(ValueError, match="needs the triton backend"):
            ModelConfig(**base, attention="auto", kernel="chained")
        assert ModelConfig(**base, attention="auto", kernel="512x512:band128x4") \
            .kernel_unused is None
        with pytest.raises(ValueError, match="band64x4: Mosaic .* multiple of 128 rows"):
            ModelConfig(**base, attention="auto", kernel="band64x4")
        assert "are Triton's" in ModelConfig(**base, attention="auto", kernel="w8").kernel_unused
    with compiling_for("cpu"):
        runs = "the CPU kernels" if native.available() else "the XLA path"
        assert ModelConfig(**base, attention="auto", kernel="chained").kernel_unused == (
            f"model.kernel='chained' is not used: attention='auto' runs {runs}"
            + (" (attention.native)" if native.available() else "") + " on this cpu, and the "
            "options are the Pallas kernel's (attention='pallas', or 'auto' on a GPU or TPU)")
        assert ModelConfig(**base, attention="pallas", kernel="chained").kernel_unused is None
        assert ModelConfig(**base, attention="auto").kernel_unused is None
        # an option the pattern never reads: the summary term's tiles on a strided model
        assert ModelConfig(**base, attention="pallas", kernel="sum128x64").kernel_unused == (
            "model.kernel's summary tiles (sumQxK) are not used: only the fixed pattern has a "
            "summary term, and pattern='strided'")
        assert ModelConfig(**{**base, "pattern": "fixed", "c": 2}, attention="pallas",
                           kernel="sum128x64").kernel_unused is None
    with compiling_for("tpu"):  # two options unused: one note names both
        note = ModelConfig(**base, attention="auto", kernel="w8:sum128x128").kernel_unused
        assert "are Triton's" in note and "summary tiles (sumQxK) are not used" in note


def test_training_says_once_that_an_unused_kernel_option_is_not_used(tmp_path, capsys):
    """On a CPU, auto runs the CPU kernels (or XLA): --config.model.kernel=chained changes
    nothing, and one warning line says so at start-up, before the data is read (here a file
    too short for a window, refused next; the new workdir is removed again)."""
    import configs
    from sparse_jax import train

    data = tmp_path / "short.txt"
    data.write_bytes(b"too short for a window")
    config = configs.load("bytes.py:size=tiny", {"model.attention": "auto",
                                                 "model.kernel": "chained",
                                                 "data.path": str(data)})
    workdir = tmp_path / "run"
    with pytest.raises(ValueError):
        train.train(config, str(workdir))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: model.kernel='chained' is not used: attention='auto' runs "), warnings
    assert not workdir.exists()
