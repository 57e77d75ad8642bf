"""Where a trained model looks (sparse_jax.attention_stats): attention set by hand puts all its
mass where it points, for every pattern and term; the statistics equal a reference computed from
the full n x n attention through the model's own layers (rotary, shifted heads, every mode,
scanned layers); the paper's Figure 2 for a picture run; bad input; the script end to end."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import write_pictures
from sparse_jax import attention_stats as A
from sparse_jax import evaluate, sample, train
from sparse_jax.attention import weights as W
from sparse_jax.attention.reference import dense_attention
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.attention.terms import term_rows
from sparse_jax.model.config import ModelConfig
from sparse_jax.model.transformer import SparseTransformer
from sparse_jax.run import checkpoints
from sparse_jax.run import config as config_lib
from test_evaluate import ROOT, TINY_TEXT, get_config, save_like_train
from test_train import read_metrics

N = 64


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A real 4-step training run of 2 layers (test_evaluate's), checkpoints at steps 2 and 4."""
    workdir = str(tmp_path_factory.mktemp("attention") / "run")
    train.train(get_config("quickstart", "data=embedded", **TINY_TEXT), workdir)
    return workdir
SPECS = [PatternSpec("dense"), PatternSpec("local", stride=5),
         PatternSpec("strided", stride=8), PatternSpec("strided", stride=8, local_width=5),
         PatternSpec("strided", stride=8, part="local"),
         PatternSpec("strided", stride=8, part="strided"), PatternSpec("fixed", stride=8, c=2),
         PatternSpec("fixed", stride=8, c=2, part="block"),
         PatternSpec("fixed", stride=8, c=2, part="summary"),
         PatternSpec("fixed", stride=8, c=2, summary="lra"),
         PatternSpec("fixed", stride=8, c=2, summary_block=2)]


def terms_of(spec):
    return [None] if spec.kind == "dense" else list(spec.terms())


def keys_of(term, n):
    """[n, C] keys of one term per query (-1: none); dense (None): every j <= i."""
    if term is None:
        j = np.arange(n)
        return np.where(j[None] <= j[:, None], j[None], -1)
    return term_rows(term, np.arange(n), n)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_term_shortcuts_are_the_patterns_own_rows(spec):
    """The distances a term's columns share and the keys its queries share are those of the
    pattern's own rows (term_rows), and the terms together are the pattern."""
    i = np.arange(N)
    union = []
    assert len(W.term_names(spec)) == len(terms_of(spec))
    for term in terms_of(spec):
        rows = keys_of(term, N)
        union.append(rows)
        fixed, shared = W.offsets(term, N) if term else None, W.shared_keys(term, N)
        if fixed is not None:
            assert ((i[:, None] - rows == fixed[None]) | (rows < 0)).all()
        if shared is not None:
            assert rows.shape[1] == len(shared) and ((rows == shared[None]) | (rows < 0)).all()
    mask = np.zeros((N, N), bool)
    for rows in union:
        for r, keys in enumerate(rows):
            mask[r, keys[keys >= 0]] = True
    np.testing.assert_array_equal(mask, spec.mask(N) if spec.kind != "dense"
                                  else np.tril(np.ones((N, N), bool)))


def hand_set(targets, n):
    """q, k [1, n, 1, n] with which query i scores 60 on key targets[i] (if >= 0) and 0 on
    every other key: all its weight on that key, to e^-60."""
    q, k = np.zeros((2, 1, n, 1, n), np.float32)
    for i, t in enumerate(targets):
        if t >= 0:
            q[0, i, 0, i], k[0, t, 0, i] = 60 * np.sqrt(n), 1.0
    return jnp.asarray(q), jnp.asarray(k)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_attention_set_by_hand_puts_all_its_mass_at_its_distance_and_term(spec):
    """For each term, a head attending only the key d back (d: the term's farthest key of the
    last query), counted over the queries whose term holds that key: all the mass at d, in d's
    band and on that term; mean and 90th percentile d, entropy 0."""
    i, bands = np.arange(N), A.bands_for(N, [4, 16, 40])
    for term, name in zip(terms_of(spec), W.term_names(spec)):
        rows = keys_of(term, N)
        d = int(N - 1 - rows[-1][rows[-1] >= 0].min())
        holds = ((rows == (i - d)[:, None]) & (rows >= 0)).any(1)
        q, k = hand_set(np.where(holds, i - d, -1), N)
        sums = W.layer_sums(q, k, (spec,), jnp.asarray(holds[None]))
        stats = A.head_stats(sums.hist[0], sums.terms[0], W.term_names(spec), sums.entropy[0],
                             float(sums.weight), bands, far=d - 1)
        assert float(sums.weight) == holds.sum() > 0
        where = [a <= d <= b for a, b in bands]
        np.testing.assert_allclose(stats["bands"], where, atol=1e-6, err_msg=f"{name} d={d}")
        assert stats["terms"][name] == pytest.approx(1, abs=1e-6), (name, stats["terms"])
        assert sum(stats["terms"].values()) == pytest.approx(1, abs=1e-6)
        assert stats["mean_distance"] == pytest.approx(d, abs=1e-4)
        assert stats["p90_distance"] == d and stats["far"] == pytest.approx(1, abs=1e-6)
        assert abs(stats["entropy_bits"]) < 1e-5


def test_uniform_heads_are_the_chance_level():
    """Every score 0: each query spreads its weight evenly over its keys; dense over n queries
    puts sum_{i >= d} 1 / (i + 1) at distance d, mean distance (n - 1) / 4."""
    n, specs = 40, (PatternSpec("dense"), PatternSpec("strided", stride=8))
    sums = A._uniform(specs, jnp.ones((1, n)))
    expected = [sum(1 / (i + 1) for i in range(d, n)) for d in range(n)]
    np.testing.assert_allclose(sums.hist[0], expected, rtol=1e-5)
    stats = A.head_stats(sums.hist[0], sums.terms[0], ("all",), sums.entropy[0], n,
                         A.bands_for(n), 10)
    assert stats["mean_distance"] == pytest.approx((n - 1) / 4, rel=1e-5)
    assert stats["entropy_bits"] == pytest.approx(np.mean(np.log2(np.arange(1, n + 1))), rel=1e-5)
    keys = (specs[1].indices(n) >= 0).sum(1)  # strided: each query's keys, evenly
    assert float(sums.entropy[1]) == pytest.approx(np.log2(keys).sum(), rel=1e-5)


def reference_stats(q, k, specs, w, bands, far):
    """Every head's statistics from its whole [n, n] softmax (float64)."""
    batch, n, heads, dim = q.shape
    group, out = heads // len(specs), []
    i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    for h in range(heads):
        spec = specs[h // group]
        mask = np.tril(np.ones((n, n), bool)) if spec.kind == "dense" else spec.mask(n)
        s = np.einsum("bqd,bkd->bqk", *(np.asarray(x[:, :, h], np.float64) for x in (q, k)))
        s = np.where(mask, s / np.sqrt(dim), -np.inf)
        p = np.exp(s - np.where(mask.any(1)[:, None], s.max(-1, keepdims=True), 0))
        p /= np.maximum(p.sum(-1, keepdims=True), 1e-300)
        wp = p * np.asarray(w, np.float64)[:, :, None]
        hist = np.bincount((i - j)[mask], wp[:, mask].sum(0), minlength=n)
        entropy = -(wp * np.log2(np.where(p > 0, p, 1))).sum()
        terms = []
        for term in terms_of(spec):
            member = np.zeros((n, n), bool)
            for r, keys in enumerate(keys_of(term, n) if term else keys_of(None, n)):
                member[r, keys[keys >= 0]] = True
            terms.append(wp[:, member].sum())
        out.append(A.head_stats(hist, terms, W.term_names(spec), entropy, float(w.sum()),
                                bands, far))
    return out


def sharp_model(cfg, scale=30.0):
    """A model with its query projections scaled up: far from uniform attention."""
    graphdef, state = nnx.split(SparseTransformer(cfg, rngs=nnx.Rngs(1)))
    state = jax.tree_util.tree_map_with_path(
        lambda path, x: x * scale if "query" in jax.tree_util.keystr(path)
        and "kernel" in jax.tree_util.keystr(path) else x, state)
    return nnx.merge(graphdef, state)


MODELS = {  # every mode, rotary (partial), shifted heads, scanned layers, n off the grid
    "strided interleaved rotary shifted": dict(
        pattern="strided", stride=4, mode="interleaved", rotary=True, rotary_fraction=0.5,
        shifted_heads=True, pos_emb="none"),
    "fixed multihead distinct summaries": dict(pattern="fixed", stride=8, c=2, mode="multihead",
                                               distinct_summaries=True),
    "strided multihead rotary scanned": dict(pattern="strided", stride=8, mode="multihead",
                                             rotary=True, scan_layers=True),
    "dense": dict(pattern="dense", num_heads=2),
    "local": dict(pattern="local", stride=6, local_width=9, num_heads=2),
    "fixed lra schedule": dict(pattern="fixed", stride=8, c=2, summary="lra",
                               schedule="block,summary", num_heads=2),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_statistics_equal_the_full_attention_matrix_through_the_models_own_layers(name):
    """Through each layer of the model (its own project, as its attention uses it: the output
    of dense attention over project's q, k, v equals the layer's), every head's bands, far mass,
    terms, mean and 90th percentile distance and entropy equal those of the full [n, n] softmax
    to 1e-5 (float32), over two windows with some queries weighted 0; and Figure 2's rows are
    the softmax's rows."""
    cfg = ModelConfig(**{"seq_len": 45, "num_layers": 2, "d_model": 32, "num_heads": 4,
                         **MODELS[name]})
    model, n = sharp_model(cfg), cfg.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (2, n)).astype(np.int32)
    w = rng.random((2, n)) < 0.8
    bands, far, positions = A.bands_for(n, [4, 16, 40]), 12, (0, 9, 44)
    sums, rows = A.model_sums(model, tokens, w, (0, 1), positions)
    h = model.embed(jnp.asarray(tokens))
    for layer, block in enumerate(A.model_blocks(model)):
        x = block.attn_norm(h)
        q, k, v = block.attn.project(x)
        specs, group = block.attn.specs, cfg.num_heads // len(block.attn.specs)
        assert specs == cfg.layer_specs(layer)
        heads = [slice(g * group, (g + 1) * group) for g in range(len(specs))]
        out = jnp.concatenate([dense_attention(q[:, :, s], k[:, :, s], v[:, :, s], spec.mask(n)
                                               if spec.kind != "dense" else
                                               np.tril(np.ones((n, n), bool)))
                               for s, spec in zip(heads, specs)], axis=2)
        np.testing.assert_allclose(block.attn.out(out.reshape(2, n, -1)), block.attn(x),
                                   atol=1e-5)
        expected = reference_stats(q, k, specs, w, bands, far)
        s = sums[layer]
        for hd, ref in enumerate(expected):
            got = A.head_stats(s.hist[hd], s.terms[hd], W.term_names(specs[hd // group]),
                               s.entropy[hd], float(s.weight), bands, far)
            for key in ("bands", "curve"):
                np.testing.assert_allclose(got[key], ref[key], atol=1e-5, err_msg=key)
            assert got["terms"] == pytest.approx(ref["terms"], abs=1e-5)
            assert got["far"] == pytest.approx(ref["far"], abs=1e-5)
            assert got["mean_distance"] == pytest.approx(ref["mean_distance"], rel=1e-5)
            assert got["entropy_bits"] == pytest.approx(ref["entropy_bits"], abs=1e-5)
            assert got["p90_distance"] == ref["p90_distance"]
            assert sum(got["bands"]) == pytest.approx(1, abs=1e-5) or specs[0].part == "summary"
        probs = W.query_weights(q[:1], k[:1], specs, positions)
        np.testing.assert_allclose(rows[layer], probs[0], atol=1e-6)
        for hd in range(cfg.num_heads):  # each row: the query's softmax over its own keys
            spec = specs[hd // group]
            mask = np.tril(np.ones((n, n), bool)) if spec.kind == "dense" else spec.mask(n)
            for r, p in zip(positions, np.asarray(probs[0, hd])):
                assert (p[~mask[r]] == 0).all() and p.sum() == pytest.approx(
                    1 if mask[r].any() else 0, abs=1e-5)
        h = block(h)


def picture_run(tmp_path):
    folder = tmp_path / "pics"
    write_pictures(folder, [f"train/{i}.png" for i in range(8)]
                   + [f"test/{i}.png" for i in range(3)], (8, 8, 3))
    config = get_config("images", "size=tiny", data__path=str(folder),
                        model__image_shape=(8, 8, 3), model__seq_len=192, model__stride=24,
                        model__c=6, model__d_model=16, data__split_fractions=(0.75, 0.25, 0.0))
    workdir = str(tmp_path / "run")
    save_like_train(config, workdir)
    return workdir


def test_figure2_of_a_picture_run(tmp_path):
    workdir = picture_run(tmp_path)
    queries = [(4, 4, 0), (7, 2), (0, 0, 2)]
    result = A.attention_stats(workdir, "test", windows=2, queries=queries, progress=False)
    assert result["unit"] == "dim" and result["seq_len"] == 192 and result["windows"] == 2
    assert result["queries"] == 2 * 192
    paths = result["paths"]
    assert os.path.basename(paths["figure2"]) == "test_1_figure2.png"
    for key in ("png", "figure2"):
        with open(paths[key], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert json.load(open(paths["json"]))["layers"] == result["layers"]
    assert A.query_positions(queries, (8, 8, 3)) == (4 * 24 + 12, 7 * 24 + 6, 2)
    for query in [(8, 0, 0), (0, 8), (0, 0, 3), (-1, 0)]:
        with pytest.raises(ValueError, match="lies outside the picture: rows 0-7, columns 0-7"):
            A.attention_stats(workdir, "test", queries=[query], overwrite=True)


def test_bad_input_fails_in_one_line_before_restoring_and_writes_nothing(text_run, tmp_path,
                                                                         monkeypatch):
    def expensive(*args, **kwargs):
        raise AssertionError("checks must come before restoring parameters")

    monkeypatch.setattr(checkpoints, "restore_model", expensive)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(config_lib.read_record(text_run).to_json())
    with pytest.raises(FileNotFoundError, match="no checkpoints"):
        A.attention_stats(str(empty))
    for kwargs, error, message in [
            (dict(layers=[2]), ValueError, r"--layers: layer 2 does not exist: the model has 2 "
                                           r"layers \(0-1\)"),
            (dict(heads=[0, 5]), ValueError, "--heads: head 5 does not exist"),
            (dict(bands=[16, 100]), ValueError, "a band up to 100 lies beyond the context: "
                                                "distances run 0-63"),
            (dict(bands=[16, 8]), ValueError, "must increase"),
            (dict(far=63), ValueError, "--far=63 lies beyond the context"),
            (dict(windows=0), ValueError, "--windows"),
            (dict(windows=10**6), ValueError, r"--windows=1000000: the test split holds"),
            (dict(split="dev"), ValueError, "split"),
            (dict(checkpoint=9), FileNotFoundError, "no checkpoint of step 9"),
            (dict(queries=[(0, 0)]), ValueError, "--queries: Figure 2 draws a picture model")]:
        with pytest.raises(error, match=message) as e:
            A.attention_stats(text_run, **kwargs)
        assert "\n" not in str(e.value)
    assert not os.path.exists(os.path.join(text_run, "attention"))
    assert A.bands_for(64) == [(0, 0), (1, 63)] and A.bands_for(4096)[-1] == (513, 4095)
    assert A.bands_for(16384) == [(0, 0), (1, 64), (65, 512), (513, 4096), (4097, 16383)]
    assert [A.default_far(n) for n in (64, 256, 3072, 4096, 16384)] == [16, 64, 512, 512, 4096]


def test_a_run_trained_with_its_sequences_split_is_read_unsplit(text_run, tmp_path):
    """A run whose record splits each sequence over devices (mesh.seq=2; its parameters are
    stored whole) is read on one device, unsplit, with the same figures as any run's."""
    split = tmp_path / "split"
    shutil.copytree(text_run, split)
    config = config_lib.read_record(str(split))
    config.mesh.seq = 2
    config_lib.write_record(str(split), config)
    kwargs = dict(split="valid", windows=2, layers=[1], write=False, progress=False)
    result, plain = A.attention_stats(str(split), **kwargs), A.attention_stats(text_run, **kwargs)
    assert result["mesh_seq"] == 2 and plain["mesh_seq"] == 1 and result["devices"] == 1
    assert result["layers"] == plain["layers"]


@pytest.mark.slow  # starts a process
def test_script_prints_the_table_writes_its_files_and_refuses_bad_input(text_run, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    script = os.path.join(ROOT, "scripts", "attention_stats.py")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, script, f"--workdir={text_run}", "--split=valid",
                           "--windows=2", "--bands=8,32", f"--output_dir={out}"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| layer | head | pattern | 0 | 1–8 | 9–32 | 33–63 | > 16 |" in proc.stdout
    assert "attention of valid step 4" in proc.stderr  # progress
    names = sorted(os.listdir(out))
    assert names == ["valid_4.json", "valid_4.md", "valid_4.png"]
    result = json.load(open(out / "valid_4.json"))
    assert [layer["layer"] for layer in result["layers"]] == [0, 1]
    for layer in result["layers"]:
        for head in layer["heads"]:
            assert sum(head["bands"]) == pytest.approx(1, abs=1e-5)
            assert set(head["terms"]) == {"local", "column"}
    again = subprocess.run([sys.executable, script, f"--workdir={text_run}", "--split=valid",
                            f"--output_dir={out}"], capture_output=True, text=True, env=env,
                           timeout=300)
    assert again.returncode == 2 and "valid_4.png exists" in again.stderr  # refused first
    bad = subprocess.run([sys.executable, script, f"--workdir={text_run}", "--heads=7",
                          f"--output_dir={tmp_path / 'bad'}"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --heads: head 7 does not exist")
    assert len(bad.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "bad")


def test_training_resumes_after_every_script_wrote_its_default_outputs_into_the_workdir(
        text_run, tmp_path):
    """evaluate.py, sample.py and attention_stats.py write into the workdir by default (eval/,
    samples/, attention/): each is a name run/workdir.py knows, so the run trains on there
    (attention/ once made train.py refuse the workdir as holding files not its own)."""
    run = str(tmp_path / "run")
    shutil.copytree(text_run, run)
    before = set(os.listdir(run))
    evaluate.evaluate(run, split="valid", progress=False)
    sample.sample(run, num_samples=1, length=4)
    A.attention_stats(run, split="valid", windows=1, layers=[0], progress=False)
    assert set(os.listdir(run)) - before == {"eval", "samples", "attention"}
    metrics = train.train(get_config("quickstart", "data=embedded",
                                     **{**TINY_TEXT, "total_steps": 6}), run)
    assert metrics["step"] == 6
    assert [r["step"] for r in read_metrics(run) if r.get("split") == "train"][-1] == 6
