"""SparseTransformer: shapes, causality by gradients, a plain masked reference, remat, scan,
cached decoding, initialization, parameter counts, dtypes, config validation, describe() and its
script."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sparse_jax.attention import dense_attention
from sparse_jax.model.config import ModelConfig, model_config
from sparse_jax.model.transformer import SparseTransformer, loss_bits
from sparse_jax.run.sizing import describe, describe_text, param_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(seq_len=16, num_layers=2, d_model=16, num_heads=2, stride=4, c=1)


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, **overrides})


def make(cfg, seed=0):
    return SparseTransformer(cfg, rngs=nnx.Rngs(seed))


def tokens(batch=2, n=16, seed=0):
    return jax.random.randint(jax.random.key(seed), (batch, n), 0, 256, dtype=jnp.int32)


# One jitted forward for every model (nnx.jit caches on the model's structure).
apply = nnx.jit(lambda model, x, rng=None: model(x, dropout_rng=rng))


def params_of(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def layer_params(model):
    """Per-layer parameter dicts, whether the layers are a list or scanned groups."""
    params = params_of(model)
    if "blocks" in params:
        return [params["blocks"][k] for k in range(model.cfg.num_layers)]
    groups = params["block_groups"]["blocks"]
    period = model.cfg.period
    return [jax.tree.map(lambda x: x[k // period], groups[k % period])  # noqa: B023
            for k in range(model.cfg.num_layers)]


# Every way of scheduling attention over layers (2 layers; 3 where a cycle needs them).
SCHEDULES = {
    "dense": dict(pattern="dense"),
    "local": dict(pattern="local"),
    "strided-merged": dict(pattern="strided"),
    "strided-interleaved": dict(pattern="strided", mode="interleaved"),
    "strided-multihead": dict(pattern="strided", mode="multihead"),
    "strided-openai-cycle": dict(pattern="strided", schedule="local,local,strided",
                                 num_layers=3),
    "strided-rotary": dict(pattern="strided", mode="interleaved", rotary=True, pos_emb="none"),
    # column heads shifted by 1..l (stride 2: two heads, shifts 1 and 2)
    "strided-shifted": dict(pattern="strided", mode="interleaved", stride=2, rotary=True,
                            rotary_fraction=0.5, pos_emb="none", shifted_heads=True),
    "strided-shifted-merged": dict(pattern="strided", stride=2, shifted_heads=True),
    "strided-image-rotary": dict(pattern="strided", rotary=True, pos_emb="image",
                                 image_shape=(4, 2, 2)),  # rows of 2 pixels x 2 channels
    "fixed-merged": dict(pattern="fixed"),
    "fixed-interleaved": dict(pattern="fixed", mode="interleaved"),
    "fixed-multihead": dict(pattern="fixed", mode="multihead"),
    "fixed-distinct": dict(pattern="fixed", c=2, mode="multihead", distinct_summaries=True),
    "fixed-lra-cycle": dict(pattern="fixed", summary="lra", schedule="block,summary,both",
                            num_layers=3),
    "strided-scan-remat": dict(pattern="strided", scan_layers=True, remat="full"),
}


# ---------------------------------------------------------------------------------------------
# Shapes, dtypes, dropout, prefixes.


def test_shapes_dtypes_prefix_and_dropout():
    model = make(tiny(dropout=0.5))
    x = tokens()
    logits = apply(model, x)
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
    # n < seq_len uses positions 0..n-1: a prefix gets the prefix of the logits (causality).
    np.testing.assert_allclose(apply(model, x[:, :11]), logits[:, :11], atol=1e-6)
    with pytest.raises(ValueError, match="exceeds seq_len"):
        model(tokens(n=17))
    # Dropout is active iff a key is given; the same key gives the same result.
    np.testing.assert_array_equal(apply(model, x), logits)
    with_a, with_a2, with_b = (apply(model, x, jax.random.key(s)) for s in (1, 1, 2))
    np.testing.assert_array_equal(with_a, with_a2)
    assert not np.allclose(with_a, logits) and not np.allclose(with_a, with_b)
    abstract = nnx.eval_shape(lambda: make(tiny(param_dtype="bfloat16", dtype="bfloat16")))
    assert {p.dtype for p in jax.tree.leaves(params_of(abstract))} == {jnp.dtype(jnp.bfloat16)}


def test_loss_bits():
    logits = jnp.zeros((2, 5, 256))
    targets = jnp.zeros((2, 5), jnp.int32)
    np.testing.assert_allclose(loss_bits(logits, targets), 8.0, rtol=1e-6)  # uniform: 8 bits
    logits = logits.at[0, :, 0].set(100.0)  # row 0 certain and right: 0 bits
    np.testing.assert_allclose(loss_bits(logits, targets, mask=jnp.arange(2)[:, None] == 0)
                               + 1.0, 1.0, atol=1e-6)
    assert loss_bits(logits.astype(jnp.bfloat16), targets).dtype == jnp.float32


# ---------------------------------------------------------------------------------------------
# Causality by gradients and the masked reference.


@pytest.mark.parametrize("name", SCHEDULES)
def test_causal_by_gradients(name):
    """d logits[i] / d embeddings[j] == 0 exactly for every j > i, through the whole model."""
    cfg = tiny(dropout=0.1, **SCHEDULES[name])
    model = make(cfg)
    x = tokens(batch=1)
    readout = jax.random.normal(jax.random.key(1), (256,))

    @jax.jit
    def jacobian(h):  # [n, d] perturbation of the embeddings -> [n (output), n, d]
        f = lambda h: model.from_embeddings(  # noqa: E731
            model.embed(x) + h[None], dropout_rng=jax.random.key(2))[0] @ readout
        return jax.jacrev(f)(h)

    size = np.abs(np.asarray(jacobian(jnp.zeros((16, cfg.d_model))))).sum(-1)
    assert np.all(size[np.triu_indices(16, 1)] == 0), f"{name}: a logit sees a later position"
    assert np.all(np.diag(size) > 0)


def _layer_norm(x, p, eps=1e-6):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * p["scale"] + p["bias"]


def reference_logits(params, cfg, x):
    """A plain causal transformer on ``dense_attention`` with each layer's masks, written from
    docs/design.md §4 and the parameters alone."""
    n = x.shape[1]
    dense = lambda v, p: v @ p["kernel"] + p["bias"]  # noqa: E731
    pos = np.arange(n)
    cols = min(cfg.stride, cfg.seq_len)
    h = params["token_embed"]["embedding"][x]
    if cfg.pos_emb == "text":
        h = (h + params["pos_embeds"][0]["embedding"][pos // cols]
             + params["pos_embeds"][1]["embedding"][pos % cols])

    def rotary(y):  # features (f, f + R/2) as one complex number, times e^(i·pos·base^(-f/(R/2)))
        half = cfg.rotary_dims // 2  # the first R features of a head; the rest pass unchanged
        turn = np.exp(1j * pos[:, None] * 10_000.0 ** (-np.arange(half) / half))[:, None]
        z = (y[..., :half] + 1j * y[..., half:2 * half]) * turn
        return jnp.concatenate([z.real, z.imag, y[..., 2 * half:]], -1).astype(y.dtype)

    blocks = params["blocks"]
    for k in range(cfg.num_layers):
        p, specs = blocks[k], cfg.layer_specs(k)
        y = _layer_norm(h, p["attn_norm"])
        q, kk, v = (dense(y, p["attn"][m]).reshape(*x.shape, cfg.num_heads, -1)
                    for m in ("query", "key", "value"))
        if cfg.rotary:
            q, kk = rotary(q), rotary(kk)
        shifts = cfg.head_shifts(k) or (0,) * cfg.num_heads

        def moved(arr, head, by):  # the head's row j := row j - by (zero before position 0)
            src = np.arange(n) - by
            return jnp.where((src >= 0)[None, :, None], arr[:, np.maximum(src, 0), head], 0)

        for head, s in enumerate(shifts):  # key of j - s, value of j - s + 1
            kk = kk.at[:, :, head].set(moved(kk, head, s))
            v = v.at[:, :, head].set(moved(v, head, max(s - 1, 0)))
        g = cfg.num_heads // len(specs)  # head group i uses specs[i]
        mask = np.concatenate([np.broadcast_to(s.mask(n), (g, n, n)) for s in specs])
        a = dense(dense_attention(q, kk, v, mask).reshape(*x.shape, -1), p["attn"]["out"])
        b = dense(jax.nn.gelu(dense(_layer_norm(h + a, p["ff_norm"]), p["ff_in"])), p["ff_out"])
        h = h + a + b
    return dense(_layer_norm(h, params["final_norm"]), params["head"])


@pytest.mark.parametrize("name", ["dense", "fixed-distinct", "strided-openai-cycle",
                                  "strided-rotary", "strided-shifted", "strided-shifted-merged"])
def test_matches_plain_masked_transformer(name):
    """Forward and parameter gradients equal the reference (half-size QK and FF)."""
    cfg = tiny(qk_ratio=0.5, ff_mult=2.0, **SCHEDULES[name])
    model = make(cfg)
    x = tokens()
    params = params_of(model)
    graphdef, state = nnx.split(model)
    with_logits = lambda logits: (loss_bits(logits, x), logits)  # noqa: E731
    (_, logits), grads = jax.jit(jax.value_and_grad(
        lambda st: with_logits(nnx.merge(graphdef, st)(x)), has_aux=True))(state)
    (_, ref_logits), ref_grads = jax.jit(jax.value_and_grad(
        lambda p: with_logits(reference_logits(p, cfg, x)), has_aux=True))(params)
    np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-3),
                 nnx.to_pure_dict(grads), ref_grads)


# ---------------------------------------------------------------------------------------------
# Remat, scan and dtypes change how, not what, the model computes.


@jax.jit
def _loss_and_grads(graphdef, state, x, rng):
    def loss(state):
        return loss_bits(nnx.merge(graphdef, state)(x[:, :-1], dropout_rng=rng), x[:, 1:])
    return jax.value_and_grad(loss)(state)


def loss_and_grads(model, x, rng=None):
    """Loss and per-layer parameter gradients (list layout whatever the model's layout)."""
    graphdef, state = nnx.split(model)
    loss, grads = _loss_and_grads(graphdef, state, x, rng)
    return loss, layer_params(nnx.merge(graphdef, grads))


def test_remat_and_scan_change_neither_parameters_nor_outputs_nor_gradients():
    """remat "full" (unrolled) and "dots" with scan_layers against the plain unrolled model, with
    dropout on: same per-layer parameters, loss and gradients."""
    cfg = tiny(num_layers=4, dropout=0.2, schedule="local,strided")
    x, rng = tokens(n=17), jax.random.key(3)
    base = make(cfg)
    loss, grads = loss_and_grads(base, x, rng)
    for variant in (dict(remat="full"), dict(remat="dots", scan_layers=True)):
        model = make(dataclasses.replace(cfg, **variant))
        jax.tree.map(np.testing.assert_array_equal, layer_params(model), layer_params(base))
        loss_v, grads_v = loss_and_grads(model, x, rng)
        np.testing.assert_allclose(loss_v, loss, rtol=1e-6, err_msg=str(variant))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                     grads_v, grads)


def test_remat_attention_keeps_the_kernels_residuals_and_changes_nothing_computed(capsys):
    """remat "attention" with the Pallas kernel (interpret mode here): the kernel's residuals (q,
    k, v, output, log-sum-exp) are what each block saves beside its input, and the loss and
    gradients equal the model's without remat; on the XLA path it saves what "full" does."""
    from jax.ad_checkpoint import print_saved_residuals

    from sparse_jax.attention.fused import RESIDUALS

    cfg = tiny(num_layers=2, pattern="fixed", attention="pallas", scan_layers=True)
    x = tokens(n=17)
    base = make(cfg)
    loss, grads = loss_and_grads(base, x)
    model = make(dataclasses.replace(cfg, remat="attention"))
    loss_v, grads_v = loss_and_grads(model, x)
    np.testing.assert_allclose(loss_v, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 grads_v, grads)

    def saved(cfg):  # one line per residual the backward pass keeps
        graphdef, state = nnx.split(make(cfg))
        capsys.readouterr()
        print_saved_residuals(lambda s: loss_bits(nnx.merge(graphdef, s)(x[:, :-1]),
                                                  x[:, 1:]), state)
        return capsys.readouterr().out.splitlines()

    def scanned(cfg):  # what the scanned blocks keep: their input, and what the policy saves
        return sorted(w.split(" from ")[0] for w in saved(cfg) if "output of scan" in w)

    full, kept = (scanned(dataclasses.replace(cfg, remat=r)) for r in ("full", "attention"))
    assert full == ["f32[2,2,16,16] output of scan"]  # each layer's input: [layers, B, n, d]
    # and q, k, v, the output ([layers, B, n', H, d/H]) and the log-sum-exp: the 5 residuals
    assert len(kept) == 6 and sum("[2,2,2," in w for w in kept) == 5, kept
    assert RESIDUALS == "sparse_attention_residuals"
    onepass = dataclasses.replace(cfg, pattern="strided", kernel="16x16:onepass:s1",
                                  remat="attention")  # its own custom VJP names them too
    kept = scanned(onepass)  # q, k, v, the output [layers, B, n, H, d/H] and the log-sum-exp
    assert len(kept) == 6 and sum("[2,2,16,2," in w for w in kept) == 5, kept
    on_xla = dataclasses.replace(cfg, attention="xla")
    assert scanned(dataclasses.replace(on_xla, remat="attention")) == scanned(
        dataclasses.replace(on_xla, remat="full"))


def test_bfloat16_compute_close_to_float32():
    """bf16 compute (float32 weights, residual stream, head and loss): logits within 3% of the
    logits' scale, the loss within 0.01 bits, of float32."""
    cfg = tiny(pattern="fixed")
    x = tokens()
    f32 = apply(make(cfg), x)
    bf16 = apply(make(dataclasses.replace(cfg, dtype="bfloat16")), x)
    assert bf16.dtype == jnp.float32
    assert float(jnp.abs(bf16 - f32).max()) < 0.03 * float(f32.std())
    assert abs(float(loss_bits(bf16, x)) - float(loss_bits(f32, x))) < 0.01


# ---------------------------------------------------------------------------------------------
# Cached decoding: the model's public one-position step.


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("name", ["strided-openai-cycle", "fixed-distinct", "strided-rotary",
                                  "strided-image-rotary", "strided-shifted",
                                  "strided-shifted-merged"])
def test_decode_step_equals_full_forward(name, scan):
    """init_cache, then decode_step position by position, gives the full forward pass's logits
    at every position, with the layers unrolled or scanned (weights scaled up so that logits
    are O(1) and attention is peaked)."""
    cfg = tiny(scan_layers=scan, **SCHEDULES[name])
    model = make(cfg)
    nnx.update(model, jax.tree.map(lambda p: p * 4.0, nnx.state(model, nnx.Param)))
    x = tokens()
    full = np.asarray(apply(model, x))
    assert full.std() > 0.3  # not a trivially small comparison
    cache = model.init_cache(2, 16)
    assert [c.shape for c in cache] == [(cfg.num_layers, 2, 16, 2, 8)] * 2
    step = nnx.jit(lambda model, *args: model.decode_step(*args))  # i: a jit argument
    logits = []
    for i in range(16):
        row, cache = step(model, x[:, i], i, cache)
        logits.append(row)
    assert logits[0].shape == (2, 256) and logits[0].dtype == jnp.float32
    np.testing.assert_allclose(np.stack(logits, axis=1), full, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="does not fit seq_len=16"):
        model.init_cache(2, 17)


@pytest.mark.parametrize("mode", ["interleaved", "merged"])
def test_shifted_heads_reach_every_earlier_byte_in_one_hop(mode):
    """With ``shifted_heads`` the column heads (strided, l = 4) read keys of j - s for s = 1..4:
    the key positions a query i reaches through one layer's heads are all of 0..i-1, each once
    in the interleaved column layer (the value read with the key of p is that of p + 1)."""
    cfg = ModelConfig(seq_len=40, num_layers=2, d_model=16, num_heads=4, stride=4,
                      mode=mode, shifted_heads=True)
    layer = 1 if mode == "interleaved" else 0
    (spec,), shifts = cfg.layer_specs(layer), cfg.head_shifts(layer)
    assert shifts == (1, 2, 3, 4)
    if mode == "interleaved":
        assert cfg.head_shifts(0) == (0, 0, 0, 0)  # the local layer is left alone
    keys = spec.indices(cfg.seq_len)
    for i in range(cfg.seq_len):
        row = keys[i][keys[i] >= 0]
        reached = [j - s for s in shifts for j in row if j - s >= 0]
        if mode == "interleaved":
            assert sorted(reached) == list(range(i)), i
        else:
            assert set(reached) == set(range(i)), i


def test_rotary_scores_depend_on_distance_alone():
    """A rotated query and key score the same wherever the pair sits (only i - j counts), and
    differ between distances; an odd query/key width per head is refused."""
    from sparse_jax.model.layers import rotate
    q, k = jax.random.normal(jax.random.key(0), (2, 1, 1, 1, 16))
    score = lambda i, j: float((rotate(q, jnp.array([i])) * rotate(k, jnp.array([j]))).sum())  # noqa: E731
    for i, j in [(5, 2), (40, 0), (3000, 2999)]:
        for shift in (1, 17, 4096):
            assert score(i + shift, j + shift) == pytest.approx(score(i, j), abs=2e-4)
    assert abs(score(5, 2) - score(5, 3)) > 1e-3
    with pytest.raises(ValueError, match="rotary.*even query/key width per head, got 3"):
        tiny(rotary=True, d_model=12, num_heads=4)


# ---------------------------------------------------------------------------------------------
# Initialization and parameter counts.


def test_initialization_statistics():
    """Every weight matrix's std within 5% of docs/design.md §4's target (mean near 0); biases 0,
    norm scales 1. d=256 keeps each estimate's error near 1%."""
    d, n_layers = 256, 2
    cfg = ModelConfig(seq_len=1024, num_layers=n_layers, d_model=d, num_heads=2, ff_mult=2.0,
                      qk_ratio=0.5, pattern="strided", stride=32, pos_emb="image",
                      image_shape=(8, 8, 16))
    params = params_of(make(cfg))
    base, out = 0.125 / math.sqrt(d), 1 / math.sqrt(2 * n_layers)
    targets = {("token_embed", "embedding"): base, ("head", "kernel"): base}
    targets.update({("pos_embeds", t, "embedding"): 0.125 / math.sqrt(3 * d) for t in range(3)})
    for k in range(n_layers):
        for name in ("query", "key", "value"):
            targets[("blocks", k, "attn", name, "kernel")] = base
        targets[("blocks", k, "attn", "out", "kernel")] = base * out
        targets[("blocks", k, "ff_in", "kernel")] = base
        targets[("blocks", k, "ff_out", "kernel")] = 0.125 / math.sqrt(cfg.ff_dim) * out
    checked = set()
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        key = tuple(getattr(p, "key", getattr(p, "idx", None)) for p in path)
        value = np.asarray(value, np.float64)
        if key[-1] == "bias":
            np.testing.assert_array_equal(value, 0, err_msg=str(key))
        elif key[-1] == "scale":
            np.testing.assert_array_equal(value, 1, err_msg=str(key))
        else:
            target = targets[key]
            assert abs(value.std() / target - 1) < 0.05, (key, value.std(), target)
            assert abs(value.mean()) < 0.05 * target, key
            checked.add(key)
    assert checked == set(targets)


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(pos_emb="single", qk_ratio=0.5, ff_mult=2.0),
    dict(pos_emb="none", rotary=True),  # no position tables; rotary adds no parameter
    dict(pos_emb="image", image_shape=(2, 4, 2), vocab_size=17),
    dict(seq_len=13, pattern="fixed", mode="multihead", d_model=24, num_heads=4),
    dict(pattern="dense", stride=128),  # text grid of (1, seq_len)
    dict(schedule="local,strided", num_layers=4, scan_layers=True),
])
def test_param_count_formula_matches_allocated_model(overrides):
    cfg = tiny(**overrides)
    allocated = sum(x.size for x in jax.tree.leaves(params_of(make(cfg))))
    assert param_count(cfg) == allocated == describe(cfg)["params"]


def test_paper_parameter_counts():
    """Paper §5: 95M (enwik8) and 59M (CIFAR-10), both by formula and by nnx.eval_shape."""
    enwik8 = ModelConfig(seq_len=12288, num_layers=30, d_model=512, num_heads=8,
                         pattern="fixed", stride=128, c=32, pos_emb="text")
    cifar10 = ModelConfig(seq_len=3072, num_layers=128, d_model=256, num_heads=2, ff_mult=2.0,
                          qk_ratio=0.5, stride=96, pos_emb="image", scan_layers=True)
    for cfg, paper in [(enwik8, 95e6), (cifar10, 59e6)]:
        abstract = nnx.eval_shape(lambda: make(cfg))  # noqa: B023
        count = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
        assert count == param_count(cfg)
        assert abs(count / paper - 1) < 0.02, (cfg, count)


# ---------------------------------------------------------------------------------------------
# Config validation.


@pytest.mark.parametrize("overrides,field", [
    (dict(d_model=18, num_heads=4), "d_model"),
    (dict(qk_ratio=0.3), "qk_ratio"),
    (dict(qk_ratio=0.25, num_heads=8), "qk_ratio"),  # 4 query/key dims over 8 heads
    (dict(ff_mult=0), "ff_mult"),
    (dict(ff_mult="4"), "ff_mult"),
    (dict(num_layers=0), "num_layers"),
    (dict(dropout=1.0), "dropout"),
    (dict(pattern="axial"), "pattern"),
    (dict(mode="mixed"), "mode"),
    (dict(pattern="fixed", c=5), "pattern"),  # c > stride
    (dict(stride=32), "stride"),  # a stride beyond seq_len
    (dict(pos_emb="image"), "image_shape"),  # 32*32*3 != 16
    (dict(pos_emb="rope"), "pos_emb"),
    (dict(schedule="local,block"), "schedule"),
    (dict(schedule="local,strided", mode="interleaved"), "schedule"),
    (dict(distinct_summaries=True), "distinct_summaries"),
    (dict(pattern="fixed", mode="multihead", distinct_summaries=True), "num_heads"),
    (dict(num_heads=1, mode="multihead"), "num_heads"),
    (dict(local_width=3, pattern="fixed"), "local_width"),
    (dict(shifted_heads=True, pattern="fixed"), "shifted_heads"),
    (dict(shifted_heads=True), "shifted_heads"),  # 2 heads on the column, stride 4
    (dict(shifted_heads=1, stride=2), "shifted_heads"),
    (dict(rotary=True, rotary_fraction=0.125), "rotary_fraction"),  # 1 of 8 features: odd
    (dict(rotary_fraction=0.5), "rotary_fraction"),  # without rotary
    (dict(rotary=True, rotary_fraction=0), "rotary_fraction"),
    (dict(remat="sometimes"), "remat"),
    (dict(dtype="float64"), "dtype"),
    (dict(scan_layers=True, num_layers=3, mode="interleaved"), "scan_layers"),
])
def test_bad_config_raises_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}="):
        tiny(**overrides)


def test_model_config_factory():
    from ml_collections import config_dict
    cfg = config_dict.ConfigDict({**TINY, "image_shape": [4, 2, 2], "pos_emb": "image"})
    assert model_config(cfg) == tiny(image_shape=(4, 2, 2), pos_emb="image")
    assert model_config(dict(TINY)) == tiny()
    with pytest.raises(ValueError, match="unknown.*'strides'"):
        model_config({**TINY, "strides": 4})
    with pytest.raises(ValueError, match="missing.*'d_model'"):
        model_config({k: v for k, v in TINY.items() if k != "d_model"})


# ---------------------------------------------------------------------------------------------
# describe() and scripts/describe.py.


def test_describe():
    cfg = tiny(pattern="dense", num_layers=3, dropout=0.1)
    info = describe(cfg, batch_size=2)
    d, n = cfg.d_model, cfg.seq_len
    assert info["params"] == param_count(cfg)
    assert info["schedule"] == ["dense"] * 3
    assert info["mean_keys_per_query"] == (n + 1) / 2
    layer = 2 * 4 * d * d + 2 * 2 * d * 4 * d + 2 * (n + 1) / 2 * 2 * d  # qkvo, ff, attention
    assert info["flops_per_token"] == 3 * layer + 2 * d * 256
    assert info["flops_per_step"] == 3 * info["flops_per_token"] * n * 2
    assert info["activation_bytes_remat"] < info["activation_bytes"]
    # A block-sparse layer's workspace is its accumulators, whatever its keys per query.
    sparse = [describe(tiny(pattern=p, num_layers=3, dropout=0.1), batch_size=2)
              for p in ("strided", "fixed")]
    assert sparse[0]["mean_keys_per_query"] != sparse[1]["mean_keys_per_query"]
    assert sparse[0]["activation_bytes"] == sparse[1]["activation_bytes"] \
        < info["activation_bytes"]
    cycle = describe(tiny(schedule="local,local,strided", num_layers=4))
    assert cycle["schedule"] == ["strided(stride=4, part=local)"] * 2 + [
        "strided(stride=4, part=strided)", "strided(stride=4, part=local)"]
    heads = describe(tiny(pattern="fixed", mode="multihead"))["schedule"][0]
    assert heads == "fixed(stride=4, c=1, part=block) | fixed(stride=4, c=1, part=summary)"
    positions = lambda cfg: [line for line in describe_text(cfg, describe(cfg)).splitlines()  # noqa: E731
                             if line.startswith("positions ")]
    assert positions(tiny()) == ["positions            text tables"]
    assert positions(tiny(pos_emb="none", rotary=True)) == [
        "positions            no absolute tables, rotary queries and keys"]
    assert positions(tiny(stride=2, shifted_heads=True)) == [
        "positions            text tables, column heads' keys/values shifted 1..2 back"]


def test_describe_script(tmp_path):
    config = tmp_path / "tiny_config.py"
    config.write_text(textwrap.dedent(f"""
        from ml_collections import config_dict

        def get_config(arg=None):
            config = config_dict.ConfigDict()
            config.model = config_dict.ConfigDict({TINY!r})
            config.model.pattern = arg or "strided"
            return config
    """))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, os.path.join(ROOT, "scripts", "describe.py"), *args],
        capture_output=True, text=True, env=env, check=True).stdout
    info = json.loads(run(f"--config={config}:fixed", "--json"))
    expected = describe(tiny(pattern="fixed"))
    for key in ("params", "flops_per_token", "mean_keys_per_query"):
        assert info[key] == expected[key]
    text = run(f"--config={config}", "--config.model.num_layers=3")
    assert "parameters" in text and f"{param_count(tiny(num_layers=3)):,}" in text


def test_the_feed_forward_gelu_keeps_only_its_product_for_the_backward(capsys):
    """The feed-forward's GeLU (``layers._linear_gelu``) equals ``gelu(nnx.Linear(x))`` bit for
    bit, forward and gradients, and its backward keeps one [B, n, 4d] residual, the product the
    matrix multiply writes anyway, where jax's derivative of ``gelu(linear(x))`` keeps five (the
    biased input, the tanh and the products around it): on the one-GPU preset's compiled step
    for an H100 that is 2.1 GB less planned memory and 4.3 GB less traffic
    (docs/cost_model.md)."""
    from jax.ad_checkpoint import print_saved_residuals

    from sparse_jax.model import layers

    lin = nnx.Linear(32, 128, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (2, 16, 32))
    ours = lambda x: layers._linear_gelu(lin, x)  # noqa: E731
    plain = lambda x: jax.nn.gelu(lin(x))  # noqa: E731
    cot = jax.random.normal(jax.random.key(2), (2, 16, 128), jnp.bfloat16)
    got = []
    for f in (ours, plain):
        out, vjp = jax.vjp(f, x)
        got.append((out, *vjp(cot)))
    assert all(np.array_equal(a, b) for a, b in zip(*got))
    hidden = []
    for f in (ours, plain):
        print_saved_residuals(lambda x, f=f: f(x).astype(jnp.float32).sum(), x)
        hidden.append(capsys.readouterr().out.count("bf16[2,16,128]"))
    assert hidden[0] == 1 and hidden[1] >= 2, hidden
