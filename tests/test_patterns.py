"""Pattern index builders against brute-force sets written straight from docs/design.md §2;
PatternSpec and the layer schedules."""

import dataclasses
import tracemalloc

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_jax.attention import patterns as P
from sparse_jax.attention import spec as spec_lib
from sparse_jax.attention import terms as terms_lib
from sparse_jax.attention.spec import PatternSpec, layer_specs
from sparse_jax.attention.terms import (
    pattern_terms,
    term_candidates,
    term_key_count,
    terms_to_indices,
)

# ---------------------------------------------------------------------------------------------
# Brute force: loop over every (i, j <= i) and test the formula.


def brute(seq_len, keep):
    return [[j for j in range(i + 1) if keep(i, j)] for i in range(seq_len)]


def brute_strided(n, l, part="both", w=None):
    w = l + 1 if w is None else w
    local = lambda i, j: i - w + 1 <= j  # noqa: E731
    strided = lambda i, j: (i - j) % l == 0  # noqa: E731
    keep = {"local": local, "strided": strided, "both": lambda i, j: local(i, j) or strided(i, j)}
    return brute(n, keep[part])


def brute_fixed(n, l, c, part="both", summary_block=0, summary="paper"):
    b = summary_block
    residues = set(range(l - (b + 1) * c, l - b * c)) | ({0} if summary == "lra" else set())
    block = lambda i, j: j // l == i // l  # noqa: E731
    summ = lambda i, j: j % l in residues  # noqa: E731
    keep = {"block": block, "summary": summ, "both": lambda i, j: block(i, j) or summ(i, j)}
    return brute(n, keep[part])


def rows(indices):
    return [[int(j) for j in row if j >= 0] for row in indices]


def check_format(indices, seq_len):
    """Ascending, no duplicates, padded with -1 at the end, K minimal, causal."""
    assert indices.dtype == np.int32 and indices.ndim == 2 and indices.shape[0] == seq_len
    valid = indices >= 0
    counts = valid.sum(1)
    assert counts.max() == indices.shape[1], "K is not the smallest width that fits every row"
    assert np.all(valid == (np.arange(indices.shape[1])[None] < counts[:, None])), \
        "padding not at end"
    diffs = np.diff(np.where(valid, indices, np.iinfo(np.int32).max), axis=1)
    assert np.all(diffs[valid[:, 1:]] > 0), "rows not strictly ascending"
    assert np.all(indices <= np.arange(seq_len)[:, None]), "a key after its query"


SHAPES = [(1, 1), (5, 1), (16, 4), (17, 4), (23, 5), (12, 12), (7, 12), (40, 3), (64, 8), (31, 7)]


@pytest.mark.parametrize("n,l", SHAPES)
@pytest.mark.parametrize("part", ["both", "local", "strided"])
@pytest.mark.parametrize("w", [None, "l", 1, "2l"])
def test_strided_matches_brute_force(n, l, part, w):
    w = {"l": l, "2l": 2 * l}.get(w, w)
    got = P.strided_indices(n, l, part=part, local_width=w)
    check_format(got, n)
    assert rows(got) == brute_strided(n, l, part, w)


@pytest.mark.parametrize("n,l", SHAPES)
@pytest.mark.parametrize("part", ["both", "block", "summary"])
@pytest.mark.parametrize("summary", ["paper", "lra"])
def test_fixed_matches_brute_force(n, l, part, summary):
    for c in sorted({1, max(1, l // 4), l}):
        for b in range(l // c):
            got = P.fixed_indices(n, l, c, part=part, summary_block=b, summary=summary)
            check_format(got, n)
            assert rows(got) == brute_fixed(n, l, c, part, b, summary), (c, b)


@pytest.mark.parametrize("n", [1, 2, 9, 33])
def test_dense_and_local(n):
    check_format(P.dense_indices(n), n)
    assert rows(P.dense_indices(n)) == brute(n, lambda i, j: True)
    for w in [1, 2, 5, 40]:
        got = P.local_indices(n, w)
        check_format(got, n)
        assert rows(got) == brute(n, lambda i, j: i - j < w)  # noqa: B023
        assert got.shape[1] == min(w, n)


def test_worked_example_each_convention():
    """docs/design.md §2: l=4, c=1, query 13."""
    paper = P.fixed_indices(16, 4, 1)
    assert rows(paper)[13] == [3, 7, 11, 12, 13]
    lra = P.fixed_indices(16, 4, 1, summary="lra")
    assert rows(lra)[13] == [0, 3, 4, 7, 8, 11, 12, 13]
    # Strided windows: paper l+1 keys (i-l .. i); openai/DeepSpeed l keys (i-l+1 .. i).
    assert rows(P.strided_indices(16, 4, part="local"))[13] == [9, 10, 11, 12, 13]
    assert rows(P.strided_indices(16, 4, part="local", local_width=4))[13] == [10, 11, 12, 13]
    assert rows(P.strided_indices(16, 4))[13] == [1, 5, 9, 10, 11, 12, 13]


def test_indices_to_mask_roundtrip():
    idx = P.strided_indices(37, 5)
    mask = P.indices_to_mask(idx, 37)
    assert mask.shape == (37, 37) and mask.dtype == bool
    assert [list(np.flatnonzero(r)) for r in mask] == rows(idx)
    assert not np.triu(mask, 1).any()


# ---------------------------------------------------------------------------------------------
# Bounds on K (the docstring formulas) and exact row sizes.


@pytest.mark.parametrize("n,l", SHAPES + [(200, 9), (300, 16)])
def test_row_sizes_and_bounds(n, l):
    i = np.arange(n)
    for w in [l + 1, l, 2 * l + 3]:
        counts = (P.strided_indices(n, l, local_width=w) >= 0).sum(1)
        assert np.array_equal(counts, np.minimum(i + 1, w) + np.maximum(0, i // l - (w - 1) // l))
        assert counts.max() <= min(n, w + -(-n // l) - 1)
        assert P.strided_indices(n, l, part="strided", local_width=w).shape[1] == -(-n // l)
        assert P.strided_indices(n, l, part="local", local_width=w).shape[1] == min(w, n)
    for c in sorted({1, max(1, l // 3), l}):
        for summary in ["paper", "lra"]:
            s = len(P.summary_residues(l, c, 0, summary))
            counts = (P.fixed_indices(n, l, c, summary=summary) >= 0).sum(1)
            assert np.array_equal(counts, i % l + 1 + (i // l) * s)
            assert counts.max() <= l + s * (-(-n // l) - 1)
            summary_width = P.fixed_indices(n, l, c, part="summary", summary=summary).shape[1]
            assert summary_width <= s * -(-n // l)
            assert P.fixed_indices(n, l, c, part="block").shape[1] == min(l, n)


# ---------------------------------------------------------------------------------------------
# Connectivity (paper §4.2): every j <= i reachable from i within two attention steps.


def reach_two_steps(later, earlier, n):
    """Positions reachable by an output at i of a layer using ``later`` stacked on ``earlier``:
    one step through either part, or i -> k (later) -> j (earlier)."""
    a = P.indices_to_mask(later, n).astype(np.int32)
    b = P.indices_to_mask(earlier, n).astype(np.int32)
    return (a @ b + a + b) > 0


@pytest.mark.parametrize("n,l", [(16, 4), (30, 4), (50, 7), (64, 8), (9, 16)])
def test_connectivity(n, l):
    causal = np.tril(np.ones((n, n), dtype=bool))
    for w in [l, l + 1]:
        local = P.strided_indices(n, l, part="local", local_width=w)
        strided = P.strided_indices(n, l, part="strided")
        both = P.strided_indices(n, l, local_width=w)
        assert np.array_equal(reach_two_steps(strided, local, n), causal)
        assert np.array_equal(reach_two_steps(local, strided, n), causal)
        assert np.array_equal(reach_two_steps(both, both, n), causal)
    for c in range(1, l + 1):
        for summary in ["paper", "lra"]:
            block = P.fixed_indices(n, l, c, part="block")
            summ = P.fixed_indices(n, l, c, part="summary", summary=summary)
            both = P.fixed_indices(n, l, c, summary=summary)
            assert np.array_equal(reach_two_steps(summ, block, n), causal)
            assert np.array_equal(reach_two_steps(both, both, n), causal)
    # A local window alone is not connected beyond two windows: the criterion can fail.
    if n > 2 * l + 1:
        local = P.local_indices(n, l)
        assert not np.array_equal(reach_two_steps(local, local, n), causal)


# ---------------------------------------------------------------------------------------------
# Block-level view: disjoint terms whose union is the pattern.


def term_specs(l):
    yield "local", dict(stride=l)
    yield "local", dict(stride=l, local_width=3)
    for part in P.PARTS["strided"]:
        for w in [None, l, 2 * l + 1, 1]:
            yield "strided", dict(stride=l, part=part, local_width=w)
    for part in P.PARTS["fixed"]:
        for summary in ["paper", "lra"]:
            for c in sorted({1, max(1, l // 2), l}):
                for b in range(l // c):
                    yield "fixed", dict(stride=l, c=c, part=part, summary=summary, summary_block=b)


@pytest.mark.parametrize("n,l", [(16, 4), (17, 4), (3, 8), (40, 6), (25, 1)])
def test_terms_are_disjoint_and_cover_pattern(n, l):
    for kind, spec in term_specs(l):
        terms = pattern_terms(kind, **spec)
        expected = P.indices_to_mask(P.pattern_indices(kind, n, **spec), n)
        total = np.zeros((n, n), dtype=np.int32)
        for term in terms:
            total += P.indices_to_mask(terms_to_indices([term], n), n)
        assert total.max() <= 1, f"terms overlap for {kind} {spec}"
        assert np.array_equal(total.astype(bool), expected), f"{kind} {spec}"


@pytest.mark.parametrize("n,l", [(1, 4), (16, 4), (17, 4), (3, 8), (40, 6), (25, 1)])
def test_row_keys_are_the_rows_of_the_index_arrays(n, l):
    """The cached decoder's keys of query i, computed from i (NumPy for all rows at once, and
    jax.numpy inside jit for a traced i), list the same keys as row i of ``indices``."""
    specs = [PatternSpec("dense")] + [PatternSpec(kind, **spec) for kind, spec in
                                        term_specs(l)]  # every part and convention
    for k, spec in enumerate(specs):
        expected = spec.indices(n)
        got = spec.row_keys(np.arange(n), n)
        assert got.shape[0] == n and rows(P.compact(got, n)) == rows(expected), spec
        if k % 3:  # the traced path (one compilation each) for every third spec
            continue
        traced = jax.jit(lambda i, spec=spec: spec.row_keys(i, n, jax.numpy))
        for i in sorted({0, n // 2, n - 1}):
            assert np.array_equal(np.asarray(traced(i)), got[i]), (spec, i)


def test_decoder_keys_at_long_context_build_no_index_array(monkeypatch):
    """Fixed, l=256, c=64, at 65,536 positions: a step's candidates are the own block's 256
    keys and the 16,384 summary keys, where ``indices`` would be a 4 GB array."""
    for module in (P, spec_lib):  # where PatternSpec looks it up, and its home
        monkeypatch.setattr(module, "pattern_indices",
                            lambda *a, **k: pytest.fail("built an index array"))
    spec, i = PatternSpec("fixed", stride=256, c=64), 40_000
    keys = np.asarray(jax.jit(lambda i: spec.row_keys(i, 65536, jax.numpy))(i))
    assert keys.shape == (256 + 256 * 64,)
    kept = np.sort(keys[keys >= 0])
    assert kept.size == i % 256 + 1 + i // 256 * 64 and kept[-1] == i
    assert set(kept[kept < i // 256 * 256] % 256) == set(range(192, 256))


# ---------------------------------------------------------------------------------------------
# Property-based.


@pytest.mark.parametrize("n,l", [(1, 4), (16, 4), (17, 4), (3, 8), (40, 6), (25, 1), (100, 8)])
def test_key_counts_from_terms_equal_the_index_arrays(n, l):
    """mean_keys counts each term's keys in O(n) (no [n, K] array): equal to the index array's
    count for every pattern, part and convention, n a multiple of l or not."""
    for kind, spec in term_specs(l):
        for term in pattern_terms(kind, **spec):
            assert term_key_count(term, n) == (term_candidates(term, n) >= 0).sum(), term
        assert PatternSpec(kind, **spec).mean_keys(n) == \
            P.mean_keys_per_query(P.pattern_indices(kind, n, **spec)), (kind, spec)


def test_mean_keys_at_long_context_builds_no_index_array(monkeypatch):
    """Fixed, l=256, c=64 at 65,536: its index array would be 4 GB (the context benchmark's
    process peaked at 17.5 GiB for it)."""
    def no_array(*args, **kwargs):
        raise AssertionError("built an index array")

    monkeypatch.setattr(P, "pattern_indices", no_array)
    monkeypatch.setattr(spec_lib, "pattern_indices", no_array)
    monkeypatch.setattr(terms_lib, "term_candidates", no_array)
    spec = PatternSpec("fixed", stride=256, c=64)
    # block: 256·257/2 keys per row; summary: 64 per earlier row, rows 0..255 of 256
    assert spec.mean_keys(65536) == (256 * 257 / 2 * 256 + 64 * 256 * 255 / 2 * 256) / 65536


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 90), l=st.integers(1, 20), w=st.one_of(st.none(), st.integers(1, 45)),
       part=st.sampled_from(P.PARTS["strided"]))
def test_strided_property(n, l, w, part):
    got = P.strided_indices(n, l, part=part, local_width=w)
    check_format(got, n)
    assert rows(got) == brute_strided(n, l, part, w)
    terms = pattern_terms("strided", stride=l, part=part, local_width=w)
    assert rows(terms_to_indices(terms, n)) == rows(got)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(1, 90), l=st.integers(1, 20),
       part=st.sampled_from(P.PARTS["fixed"]), summary=st.sampled_from(P.SUMMARY_CONVENTIONS))
def test_fixed_property(data, n, l, part, summary):
    c = data.draw(st.integers(1, l))
    b = data.draw(st.integers(0, l // c - 1))
    got = P.fixed_indices(n, l, c, part=part, summary_block=b, summary=summary)
    check_format(got, n)
    assert rows(got) == brute_fixed(n, l, c, part, b, summary)
    terms = pattern_terms("fixed", stride=l, c=c, part=part, summary_block=b, summary=summary)
    assert rows(terms_to_indices(terms, n)) == rows(got)


# ---------------------------------------------------------------------------------------------
# Bad input and scale.


@pytest.mark.parametrize("call,match", [
    (lambda: P.strided_indices(0, 4), "seq_len"),
    (lambda: P.strided_indices(16.0, 4), "seq_len"),
    (lambda: P.strided_indices(True, 4), "seq_len"),
    (lambda: P.strided_indices(16, -1), "stride"),
    (lambda: P.strided_indices(16, 4, part="row"), "part"),
    (lambda: P.strided_indices(16, 4, local_width=0), "local_width"),
    (lambda: P.fixed_indices(16, 4, 5), "c"),
    (lambda: P.fixed_indices(16, 4, 0), "c"),
    (lambda: P.fixed_indices(16, 4, 2, summary_block=2), "summary_block"),
    (lambda: P.fixed_indices(16, 4, 2, summary_block=-1), "summary_block"),
    (lambda: P.fixed_indices(16, 4, 2, part="strided"), "part"),
    (lambda: P.fixed_indices(16, 4, 2, summary="openai"), "summary"),
    (lambda: P.local_indices(16, 2.5), "width"),
    (lambda: P.dense_indices(-3), "seq_len"),
    (lambda: P.pattern_indices("butterfly", 16, stride=4), "kind"),
    (lambda: P.indices_to_mask(np.zeros((3, 2), np.int32), 4), "shape"),
    (lambda: P.indices_to_mask(np.full((4, 2), 9, np.int32), 4), "lie in"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_error_names_value_and_range():
    with pytest.raises(ValueError) as err:
        P.fixed_indices(64, 8, 4, summary_block=2)
    message = str(err.value)
    assert "summary_block" in message and "2" in message and "[0, 1]" in message


def _peak_bytes(build):
    """What ``build()`` returns, and the most memory Python allocated while it ran."""
    tracemalloc.start()
    try:
        return build(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_huge_input_fails_before_allocating():
    def build():
        with pytest.raises(ValueError, match="summary_block"):
            P.fixed_indices(10**12, 128, 32, summary_block=4)

    assert _peak_bytes(build)[1] < 1 << 20


def test_long_sequences_never_build_a_dense_mask():
    # Less memory than one byte per (query, key) pair: a 16,384² boolean mask alone is 268 MB
    # (the strided builder peaks at 173 MB: its int32 index arrays). Speed is the benchmarks'
    # business, not the suite's.
    for build in [lambda: P.strided_indices(16384, 128),
                  lambda: P.fixed_indices(16384, 128, 32, part="block"),
                  lambda: P.local_indices(16384, 129)]:
        idx, peak = _peak_bytes(build)
        assert idx.shape[0] == 16384 and idx.shape[1] <= 300
        assert peak < 16384 * 16384, peak


# ---------------------------------------------------------------------------------------------
# PatternSpec and the patterns of a layer's head groups.


def test_layer_specs():
    strided = PatternSpec("strided", stride=8)
    assert layer_specs(strided, "merged") == (strided,)
    interleaved = (layer_specs(strided, "interleaved", i)[0] for i in range(3))
    assert [s.part for s in interleaved] == ["local", "strided", "local"]
    assert [s.part for s in layer_specs(strided, "multihead")] == ["local", "strided"]
    fixed = PatternSpec("fixed", stride=8, c=2)
    distinct = layer_specs(fixed, "multihead", distinct_summaries=True)
    assert [s.summary_block for s in distinct] == [0, 1, 2, 3]
    assert layer_specs(PatternSpec("dense"), "interleaved", 1) == (PatternSpec("dense"),)
    with pytest.raises(ValueError, match="mode"):
        layer_specs(strided, "mixed")


@pytest.mark.parametrize("fields,match", [
    (dict(kind="butterfly", stride=4), "kind"),
    (dict(kind="strided"), "stride"),
    (dict(kind="strided", stride=0), "stride"),
    (dict(kind="strided", stride=4, part="block"), "part"),
    (dict(kind="fixed", stride=4, c=8), "c"),
    (dict(kind="fixed", stride=4, c=2, summary_block=2), "summary_block"),
    (dict(kind="fixed", stride=4, c=2, summary="openai"), "summary"),
    (dict(kind="local", stride=4, local_width=0), "local_width"),
])
def test_spec_validation(fields, match):
    with pytest.raises(ValueError, match=match):
        PatternSpec(**fields)


def test_spec_is_hashable_ordered_and_describes_itself():
    spec = PatternSpec("fixed", stride=128, c=32)
    assert hash(spec) == hash(dataclasses.replace(spec))
    assert str(spec) == "fixed(stride=128, c=32)"
    assert str(dataclasses.replace(spec, summary_block=1)) == \
        "fixed(stride=128, c=32, summary_block=1)"
    assert spec.block == 128
    assert abs(spec.mean_keys(1024) - (spec.indices(1024) >= 0).sum() / 1024) < 1e-9
    # Ordered by name, so specs can key a dict that jax.jit takes as an argument.
    specs = [PatternSpec("strided", stride=4, c=2), PatternSpec("strided", stride=4), spec]
    assert sorted(specs) == sorted(specs, key=str)
    tables = {s: s.indices(8) for s in specs}
    out = jax.jit(lambda t: {s: x + 1 for s, x in t.items()})(tables)
    assert all(np.array_equal(out[s], tables[s] + 1) for s in specs)

