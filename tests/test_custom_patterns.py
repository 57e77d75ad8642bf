"""A pattern of one's own (``attention.custom``): every path equals the dense reference built from
the rule (forward and gradients), at lengths that are and are not multiples of its block; the
built-in strided and fixed patterns through the public definition; the examples against
independent set builders; bad definitions refused in one line."""

import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_jax.attention import custom, dense_attention, sparse_attention
from sparse_jax.attention import fused as fused_lib
from sparse_jax.attention import patterns as P
from sparse_jax.attention.blocks import BlockSizes
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.attention.terms import ColumnTerm, TileTerm, window

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import my_patterns  # noqa: E402

B = 16  # the rules' grid block in the path tests


def _rule_patterns():
    """Rules that exercise every kind of remainder: a window with global keys (a band and tiles),
    pseudo-random pairs no block term covers, a keys(i) rule (not traceable: Pallas falls back to
    XLA), and the examples."""
    return {
        "window+globals": custom.from_rule(
            lambda q, k: (k <= q) & ((q - k < 20) | (k < 3)), block=B, name="wg", probe=256),
        "scattered": custom.from_rule(
            lambda q, k: (k <= q) & ((((q * 7 + k * 13) % 5) == 0) | (k == q)), block=B,
            name="scattered", probe=256),
        "keys": custom.from_rule(keys=lambda i: {i, i // 2, max(0, i - 17)}, block=B,
                                 name="keys", probe=128),
        "bigbird": my_patterns.bigbird(window=24, globals=5, random=2, block=B),
        "axial": my_patterns.axial(width=B),
    }


PATTERNS = _rule_patterns()


def _qkv(n, heads=2, d=8, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q, k, v, cot = (jax.random.normal(x, (1, n, heads, d), jnp.float32) for x in keys)
    return q, k, v, cot


def _value_and_grads(f, q, k, v, cot):
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(cot))


def _assert_matches_dense(spec, n, attend):
    q, k, v, cot = _qkv(n)
    mask = jnp.asarray(spec.mask(n))
    want = _value_and_grads(lambda q, k, v: dense_attention(q, k, v, mask), q, k, v, cot)
    got = _value_and_grads(attend, q, k, v, cot)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.parametrize("name,implementation,n", [
    (name, implementation, n) for name in sorted(PATTERNS)
    for implementation, n in (("xla", 64), ("xla", 75), ("native", 75))])
def test_rule_on_xla_and_cpu_kernels_equals_dense(name, implementation, n):
    spec = PATTERNS[name].groups[0]
    _assert_matches_dense(spec, n, lambda q, k, v: sparse_attention(q, k, v, spec,
                                                                    implementation))


@pytest.mark.parametrize("name,variant,backend,n", [
    ("window+globals", "terms", "triton", 64), ("window+globals", "terms", "triton", 75),
    ("window+globals", "chained", "triton", 75), ("window+globals", "terms", "mosaic", 75),
    ("scattered", "terms", "triton", 75), ("scattered", "chained", "triton", 75),
    ("bigbird", "terms", "mosaic", 75)])
def test_rule_on_pallas_equals_dense(name, variant, backend, n):
    """GPU (Triton) and TPU (Mosaic) kernels in interpret mode, the rule as the mask of partial
    tiles."""
    spec = PATTERNS[name].groups[0]
    sizes = BlockSizes(16, 16, variant=variant)
    rows = -(-n // spec.block)

    def attend(q, k, v):
        seq = lambda x: jnp.pad(x, ((0, 0), (0, rows * spec.block - n), (0, 0), (0, 0)))  # noqa
        out = fused_lib.sequence_attention(spec, seq(q) / np.sqrt(8.0), seq(k), seq(v),
                                           sizes=sizes, backend=backend, interpret=True,
                                           seq_major=True)
        return out[:, :n]

    _assert_matches_dense(spec, n, attend)


def test_keys_rule_on_pallas_takes_the_xla_path(caplog):
    """A keys(i) rule cannot run in a kernel: "pallas" runs it on the XLA path (exact), and
    says so."""
    spec = PATTERNS["keys"].groups[0]
    _assert_matches_dense(spec, 75, lambda q, k, v: sparse_attention(q, k, v, spec, "pallas"))
    assert "runs on the XLA path, not the Pallas kernels" in caplog.text


def test_head_groups_and_every_group_on_its_heads():
    pattern = my_patterns.axial(width=B, split=True)
    specs = pattern.groups
    from sparse_jax.attention import multi_spec_attention
    q, k, v, cot = _qkv(70, heads=4)
    got = multi_spec_attention(q, k, v, specs)
    want = jnp.concatenate([dense_attention(q[:, :, 2 * g:2 * g + 2], k[:, :, 2 * g:2 * g + 2],
                                            v[:, :, 2 * g:2 * g + 2], jnp.asarray(s.mask(70)))
                            for g, s in enumerate(specs)], axis=2)
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("name", ["window+globals", "keys", "axial"])
def test_decoder_keys_are_the_rows(name):
    """The cached decoder's keys of query i (``row_keys`` with a traced i) are row i."""
    spec = PATTERNS[name].groups[0]
    n = 90
    rows = [set(r[r >= 0].tolist()) for r in spec.indices(n)]
    step = jax.jit(lambda i: spec.row_keys(i, n, jnp))
    for i in (0, 5, 16, 47, 89):
        keys = np.asarray(step(i))
        assert set(keys[keys >= 0].tolist()) == rows[i]
        assert len(keys[keys >= 0]) == len(rows[i])  # no key twice
    assert spec.mean_keys(n) == pytest.approx(sum(map(len, rows)) / n)


# ---------------------------------------------------------------------------------------------
# The built-ins through the public definition.

SHAPES = [(1, 1), (5, 1), (16, 4), (17, 4), (23, 5), (12, 12), (7, 12), (40, 3), (64, 8), (31, 7)]


@pytest.mark.parametrize("n,s", SHAPES)
def test_strided_and_fixed_through_the_public_definition(n, s):
    """Index arrays identical to today's builders, every part and convention, and the built-in
    PatternSpec is made of the same terms."""
    for part in P.PARTS["strided"]:
        for w in sorted({None, s, 1, 2 * s} - {None}) + [None]:
            mine = custom.strided(s, w, part).groups[0]
            np.testing.assert_array_equal(mine.indices(n), P.strided_indices(
                n, s, part=part, local_width=w))
            assert mine.terms() == PatternSpec("strided", stride=s, part=part,
                                               local_width=w).terms()
    for part in P.PARTS["fixed"]:
        for summary in P.SUMMARY_CONVENTIONS:
            for c in sorted({1, max(1, s // 4), s}):
                for b in range(s // c):
                    mine = custom.fixed(s, c, part, summary, b).groups[0]
                    np.testing.assert_array_equal(mine.indices(n), P.fixed_indices(
                        n, s, c, part=part, summary=summary, summary_block=b))
                    assert mine.terms() == PatternSpec("fixed", stride=s, c=c, part=part,
                                                       summary=summary,
                                                       summary_block=b).terms()


@pytest.mark.parametrize("s,w", [(8, 9), (8, 8), (16, 17)])
def test_rule_of_the_builtins_finds_their_terms(s, w):
    """Written as rules, strided and fixed decompose into block terms of the built-in kinds
    (the same terms but where w = s, whose window the rule's column widens by one key), and
    their tiles keep nothing at any length tried."""
    strided = custom.from_rule(lambda q, k: (k <= q) & ((q - k < w) | ((q - k) % s == 0)),
                               block=s, name="strided-rule", probe=256).groups[0]
    fixed = custom.from_rule(lambda q, k: (k <= q) & ((q // s == k // s) | (k % s >= s - 2)),
                             block=s, name="fixed-rule", probe=256).groups[0]
    for mine, builtin in [(strided, PatternSpec("strided", stride=s, local_width=w)),
                          (fixed, PatternSpec("fixed", stride=s, c=2))]:
        assert [type(t) for t in mine.terms()[:-1]] == [type(t) for t in builtin.terms()]
        assert mine.terms()[:-1] == builtin.terms() or w == s
        assert isinstance(mine.terms()[-1], TileTerm)
        for n in (1, 37, 300):
            np.testing.assert_array_equal(mine.indices(n), builtin.indices(n))
            assert fused_lib.sparsity(mine, n)["kept"] == fused_lib.sparsity(builtin, n)["kept"]


# ---------------------------------------------------------------------------------------------
# The examples against independent set builders (loops over positions).


def _sets(spec, n):
    return [set(r[r >= 0].tolist()) for r in spec.indices(n)]


def test_longformer_against_a_set_builder():
    spec, n = my_patterns.longformer(window=40, globals=6, block=16).groups[0], 200
    want = [{j for j in range(max(0, i - 39), i + 1)} | {j for j in range(min(6, i + 1))}
            for i in range(n)]
    assert _sets(spec, n) == want


def test_bigbird_against_a_set_builder():
    """Window, globals, and the random blocks listed block by block from the same seeded draw:
    each query block has its own, different from the others', and the same on every build."""
    window, globals_, random, block, n = 32, 8, 2, 16, 320

    def drawn(a, b, seed=0):
        return b < a and ((a * a * 31 + b * b * 17 + a * b * 7 + seed * 101 + 13) % 1009) * a \
            < random * 1009

    chosen = {a: [b for b in range(a) if drawn(a, b)] for a in range(n // block)}
    want = [{j for j in range(max(0, i - window + 1), i + 1)} | set(range(min(globals_, i + 1)))
            | {j for b in chosen[i // block] for j in range(b * block, (b + 1) * block)}
            for i in range(n)]
    spec = my_patterns.bigbird(window, globals_, random, block).groups[0]
    assert _sets(spec, n) == want
    assert len({tuple(c) for c in chosen.values() if c}) > 5  # random blocks differ by row
    other = my_patterns.bigbird(window, globals_, random, block, seed=1).groups[0]
    assert _sets(other, n) != want


def test_dilated_against_a_set_builder():
    spec, n = my_patterns.dilated(window=6, dilation=3, block=16).groups[0], 120
    assert _sets(spec, n) == [{i - 3 * m for m in range(6) if i - 3 * m >= 0} for i in range(n)]


def test_axial_against_a_set_builder():
    width, n = 12, 12 * 9
    want = [{j for j in range(i + 1) if j // width == i // width or (i - j) % width == 0}
            for i in range(n)]
    assert _sets(my_patterns.axial(width).groups[0], n) == want
    row, column = my_patterns.axial(width, split=True).groups
    assert [a | b for a, b in zip(_sets(row, n), _sets(column, n))] == want
    assert any(isinstance(t, ColumnTerm) for t in column.terms())  # found, not tiled


# ---------------------------------------------------------------------------------------------
# Bad definitions: one line, before any work.


def _bad_module(tmp_path, monkeypatch):
    (tmp_path / "bad_patterns.py").write_text("NOT_A_PATTERN = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))


BAD = [
    (lambda: custom.from_rule(lambda q, k: k <= q + 1, block=8), "query 0 keeps key 1, after it"),
    (lambda: custom.from_rule(lambda q, k: (k < q), block=8, self_optional=True),
     "query 0 keeps no key"),
    (lambda: custom.from_rule(lambda q, k: (k < q) | ((k == q) & (q == 0)), block=8),
     "query 1 does not keep itself"),
    (lambda: custom.from_rule(lambda q, k: 1 / 0, block=8), "the rule raised ZeroDivisionError"),
    (lambda: custom.from_rule(lambda q, k: [True], block=8), "must return a boolean array"),
    (lambda: custom.from_rule(lambda q, k: (k <= q)[:, :3], block=8), "returned shape"),
    (lambda: custom.from_rule(lambda q, k: (k <= q) * 1, block=8), "must return booleans"),
    (lambda: custom.from_rule(keys=lambda i: [i, "x"], block=8), "keys(0) raised|integer"),
    (lambda: custom.from_rule(keys=lambda i: [i + 1], block=8), "after it"),
    (lambda: custom.from_rule(block=8), "give one rule"),
    (lambda: custom.from_terms((window(9, 8), ColumnTerm(8, 0))), "overlap"),
    (lambda: custom.from_terms((window(9, 8), ColumnTerm(4, 3))), "grids of"),
    (lambda: custom.from_terms(("band",)), "is not a BandTerm"),
    (lambda: custom.load("no_such_module_xyz:longformer"), "cannot import module"),
    (lambda: custom.load("my_patterns:nope"), "has no 'nope'"),
    (lambda: custom.load("my_patterns:longformer(window=)"), "parameters must be k=v"),
    (lambda: custom.load("my_patterns:longformer(size=3)"), "does not take these parameters"),
    (lambda: custom.load("bad_patterns:NOT_A_PATTERN"), "gives int, not a Pattern"),
    (lambda: custom.load("longformer"), "module:name"),
]


@pytest.mark.parametrize("make,match", BAD, ids=[m for _, m in BAD])
def test_bad_definitions_fail_in_one_line(make, match, tmp_path, monkeypatch):
    _bad_module(tmp_path, monkeypatch)
    with pytest.raises(ValueError, match=match) as e:
        make()
    assert "\n" not in str(e.value)


def test_rule_that_changes_past_the_probe_is_caught():
    """Block terms found on the probe are checked at every length served."""
    pattern = custom.from_rule(lambda q, k: (k <= q) & (q - k < 9) & ((q < 100) | (q - k < 5)),
                               block=8,
                               name="shrinks", probe=64)
    with pytest.raises(ValueError, match="do not hold at query 100, key 92") as e:
        pattern.groups[0].indices(120)
    assert "\n" not in str(e.value)


def test_load_with_parameters_and_fingerprint():
    got = custom.load("my_patterns:longformer(window=40, globals=2, block=16)")
    same = my_patterns.longformer(40, 2, 16)
    other = my_patterns.longformer(40, 3, 16)
    assert got.groups == same.groups and hash(got.groups) == hash(same.groups)
    assert got.fingerprint(100) == same.fingerprint(100) != other.fingerprint(100)


def test_model_config_takes_a_named_pattern_and_checks_it():
    from sparse_jax.model.config import ModelConfig, named_fingerprint

    base = dict(seq_len=64, num_layers=2, d_model=16, num_heads=4)
    name = "my_patterns:axial(width=8, split=True)"
    cfg = ModelConfig(pattern=name, **base)
    assert cfg.layer_specs(1) == my_patterns.axial(8, split=True).groups
    assert str(cfg.base_spec) == "axial-row"
    recorded = named_fingerprint(name, 64)
    assert ModelConfig(pattern=name, pattern_fingerprint=recorded, **base).seq_len == 64
    for fields, match in [({"pattern_fingerprint": "0" * 16}, "its definition changed"),
                          ({"mode": "interleaved"}, "leave mode='merged'"),
                          ({"pattern": "my_patterns:axial(widht=8)"}, "does not take"),
                          ({"pattern": "my_patterns:axial(width=8, split=True)",
                            "num_heads": 3, "d_model": 18}, "cannot be split into 2")]:
        with pytest.raises(ValueError, match=match) as e:
            ModelConfig(**{"pattern": name, **base, **fields})
        assert "\n" not in str(e.value)


@pytest.mark.slow  # compiles in a child process
def test_tile_term_compiles_for_an_h100_without_spills(tmp_path):
    """The generic tiles (a rule no built-in term covers, about 1/8 of the causal blocks) at
    16k, forward and backward, bf16, named to the compile report like a built-in pattern: every
    Triton kernel compiles for sm_90a on this CPU, and none spills a register (--check)."""
    import json
    import subprocess

    from sparse_jax.bench import compiled

    root = pathlib.Path(__file__).resolve().parents[1]
    tools = os.environ.get(compiled.TOOLS_ENV) or str(root / compiled.DEFAULT_TOOLS)
    compiled.install_tools(tools, compiled.REQUIREMENTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "examples"), str(root)])}
    pattern = "my_patterns:random_tiles(density=0.1112;block=128)@pallas"
    proc = subprocess.run([sys.executable, "scripts/compile_report.py", f"--tools={tools}",
                           f"--patterns={pattern}", "--seq_lens=16384", "--check",
                           f"--output_dir={tmp_path}"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [row] = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["name"] == f"attention 16k {pattern}" and "error" not in row
    names = {k["name"] for k in row["kernels"]}
    assert {"sparse_forward_tiles", "sparse_dq_tiles", "sparse_dkv_tiles"} <= names
    assert all(k["spill_bytes"] == 0 and k["registers"] > 0 for k in row["kernels"])
    assert "16k my_patterns:random_tiles(density=0.1112;block=128)" in (
        tmp_path / "results.md").read_text()  # ranked as its own family


@pytest.mark.slow  # compiles in a child process
def test_a_rule_compiles_for_a_tpu_named_from_a_relative_path(tmp_path):
    """A rule with integer division (Mosaic lowers it per chip) compiles for a TPU v5e with no
    TPU, its module found through a relative PYTHONPATH although the child runs elsewhere."""
    import json
    import subprocess

    from sparse_jax.bench import compiled_tpu

    root = pathlib.Path(__file__).resolve().parents[1]
    tools = os.environ.get(compiled_tpu.TOOLS_ENV) or str(root / compiled_tpu.DEFAULT_TOOLS)
    compiled_tpu.install_tools(tools, compiled_tpu.REQUIREMENTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["examples", str(root)])}
    pattern = "my_patterns:longformer(window=256;globals=64;block=128)@pallas"
    proc = subprocess.run([sys.executable, "scripts/compile_report.py", "--target=v5e",
                           f"--tools={tools}", f"--patterns={pattern}", "--seq_lens=4096",
                           "--check", f"--output_dir={tmp_path}"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [row] = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert "error" not in row and row["fits"]
    assert {"sparse_forward_tiles", "sparse_dq_tiles", "sparse_dkv_tiles"} <= {
        k["name"] for k in row["kernels"]}
