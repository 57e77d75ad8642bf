"""The Sparse Transformer decoder (paper §5, DESIGN.md §4) as a Flax NNX module.

``ModelConfig`` is a frozen, validated dataclass (the model never sees a ConfigDict;
``model_config`` converts ``config.model``). ``SparseTransformer(cfg, rngs=...)`` maps
``int32[B, n]`` bytes to ``float32[B, n, vocab]`` logits:

  H = token_emb + Σ position tables                          (n_emb = 3 image, 2 text, 1 single)
  per layer:  a = dropout(attn(norm(H))),  b = dropout(ff(norm(H + a))),  H = H + a + b
  logits = head(norm(H))

The residual stream, the final norm, the head and the loss are float32; the branches compute in
``cfg.dtype`` with ``cfg.param_dtype`` weights. Dropout is active iff ``dropout_rng`` is given,
so a training step is a pure function of (state, batch, rng).

Per-layer attention (``ModelConfig.specs``): ``mode`` merged / interleaved / multihead
(``attention.layer_specs``), or a ``schedule`` cycle such as "local,local,local,strided"
(openai's CIFAR-10 layers): layer k uses part ``schedule[k % len(schedule)]``.

Remat (``cfg.remat``, a named ``jax.checkpoint`` policy applied to each residual block, i.e.
attention and feed-forward together): "none"; "full" = ``nothing_saveable`` (only each block's
input is kept; the whole block is recomputed in the backward pass, ~4/3 of the FLOPs);
"dots" = ``dots_with_no_batch_dims_saveable`` (keeps the projection matmul outputs, recomputes
attention, norms and GeLU). On XLA:CPU (jax 0.10) remat saves memory only together with
``scan_layers``: unrolled, the compiler drops jax's optimization barriers and schedules the
recomputation early, so peak memory does not change (measured; see scripts/benchmark_model.py).

``scan_layers``: the layers are grouped by the period of the schedule (1 merged/multihead,
2 interleaved, len(schedule)) and ``jax.lax.scan`` runs over the groups, whose parameters are
stored stacked (leading axis = group). Each layer's parameters are drawn from the same key with
or without scan, so both layouts initialize (and compute) identically.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax import patterns
from sparse_jax.attention import MODES, PatternSpec, SparseSelfAttention, layer_specs

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
POS_EMBS = ("image", "text", "single")
PATTERNS = ("dense", "local", "strided", "fixed")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of ``SparseTransformer``; validated on construction (ValueError)."""
    seq_len: int  # context n
    num_layers: int  # N residual blocks
    d_model: int  # d
    num_heads: int
    vocab_size: int = 256  # bytes
    ff_mult: float = 4.0  # feed-forward width / d (2.0 = the paper's half-size)
    qk_ratio: float = 1.0  # query/key width / d (0.5 = half-size)
    dropout: float = 0.0  # at the end of each residual branch
    pattern: str = "strided"  # dense | local | strided | fixed
    stride: int = 128  # l (also the column count of the "text" position grid)
    c: int = 32  # summary width of "fixed"
    local_width: int | None = None  # window of strided/local (None: l + 1, the paper)
    summary: str = "paper"  # fixed summary convention: paper | lra
    mode: str = "merged"  # merged | interleaved | multihead
    schedule: str = ""  # cycle of parts per layer, e.g. "local,local,local,strided"
    distinct_summaries: bool = False  # fixed + multihead: head group h uses summary block h
    pos_emb: str = "text"  # image | text | single
    image_shape: tuple[int, int, int] = (32, 32, 3)  # (rows, columns, channels) for "image"
    remat: str = "none"  # none | full | dots (see module docstring)
    scan_layers: bool = False  # jax.lax.scan over groups of layers
    dtype: str = "float32"  # compute: float32 | bfloat16
    param_dtype: str = "float32"  # storage

    def __post_init__(self):
        def fail(field, why):
            raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {why}")

        for name in ("seq_len", "num_layers", "d_model", "num_heads", "vocab_size", "stride",
                     "c"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(name, "must be a positive integer")
        if self.local_width is not None and (not isinstance(self.local_width, int)
                                             or self.local_width < 1):
            fail("local_width", "must be None or a positive integer")
        for name in ("ff_mult", "qk_ratio", "dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                fail(name, "must be a number")
        if self.d_model % self.num_heads:
            fail("d_model", f"must be divisible by num_heads={self.num_heads}")
        for name, width in [("ff_mult", self.ff_mult * self.d_model),
                            ("qk_ratio", self.qk_ratio * self.d_model)]:
            if width <= 0 or width != int(width):
                fail(name, f"times d_model={self.d_model} must be a positive integer")
        if self.qk_dim % self.num_heads:
            fail("qk_ratio", f"query/key width {self.qk_dim} is not divisible by "
                             f"num_heads={self.num_heads}")
        if not 0.0 <= self.dropout < 1.0:
            fail("dropout", "must be in [0, 1)")
        choices = [("pattern", PATTERNS), ("summary", patterns.SUMMARY_CONVENTIONS),
                   ("mode", MODES), ("pos_emb", POS_EMBS), ("remat", tuple(REMAT_POLICIES)),
                   ("dtype", tuple(DTYPES)), ("param_dtype", tuple(DTYPES))]
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                fail(name, f"must be one of {list(allowed)}")
        if self.local_width is not None and self.pattern not in ("strided", "local"):
            fail("local_width", f"applies to pattern strided/local, not {self.pattern!r}")
        if self.summary != "paper" and self.pattern != "fixed":
            fail("summary", f"applies to pattern 'fixed', not {self.pattern!r}")
        try:
            self.base_spec
        except ValueError as e:
            fail("pattern", f"invalid pattern fields: {e}")
        if self.pattern in ("strided", "fixed") and self.stride > self.seq_len:
            fail("stride", f"exceeds seq_len={self.seq_len}: the {self.pattern} pattern would "
                           "degenerate to its local/block part")
        object.__setattr__(self, "image_shape", tuple(self.image_shape))
        if self.pos_emb == "image" and (
                len(self.image_shape) != 3 or math.prod(self.image_shape) != self.seq_len):
            fail("image_shape", f"must be (rows, cols, channels) with product seq_len="
                                f"{self.seq_len} for pos_emb='image'")
        allowed = ("both",) + patterns.PARTS.get(self.pattern, ("both",))[1:]
        for entry in self.schedule_entries:
            if entry not in allowed:
                fail("schedule", f"entry {entry!r} is not one of {list(allowed)} "
                                 f"for pattern {self.pattern!r}")
        if self.schedule_entries and self.mode != "merged":
            fail("schedule", f"a schedule replaces mode; leave mode='merged', not {self.mode!r}")
        if self.distinct_summaries and (self.pattern != "fixed" or self.mode != "multihead"):
            fail("distinct_summaries", "needs pattern='fixed' and mode='multihead'")
        for specs in set(self.specs()):
            if self.num_heads % len(specs):
                fail("num_heads", f"cannot be split into {len(specs)} head groups "
                                  f"({', '.join(map(str, specs))})")
        if self.scan_layers and self.num_layers % self.period:
            fail("scan_layers", f"needs num_layers={self.num_layers} to be a multiple of the "
                                f"schedule period {self.period}")

    @property
    def qk_dim(self) -> int:
        return int(self.qk_ratio * self.d_model)

    @property
    def ff_dim(self) -> int:
        return int(self.ff_mult * self.d_model)

    @property
    def schedule_entries(self) -> tuple[str, ...]:
        return tuple(e.strip() for e in self.schedule.split(",")) if self.schedule else ()

    @property
    def base_spec(self) -> PatternSpec:
        """The whole pattern (part="both"), with only the fields its kind uses."""
        if self.pattern == "dense":
            return PatternSpec("dense")
        if self.pattern == "fixed":
            return PatternSpec("fixed", stride=self.stride, c=self.c, summary=self.summary)
        return PatternSpec(self.pattern, stride=self.stride, local_width=self.local_width)

    @property
    def period(self) -> int:
        """Layers per repeat of the attention schedule (the unit of ``scan_layers``)."""
        if self.schedule_entries:
            return len(self.schedule_entries)
        return 2 if self.mode == "interleaved" and self.pattern in patterns.PARTS else 1

    def layer_specs(self, layer: int) -> tuple[PatternSpec, ...]:
        """Pattern of each head group of layer ``layer``."""
        entries = self.schedule_entries
        if entries:
            part = entries[layer % len(entries)]
            return (dataclasses.replace(self.base_spec, part=part),)
        return layer_specs(self.base_spec, self.mode, layer,
                           distinct_summaries=self.distinct_summaries)

    def specs(self) -> list[tuple[PatternSpec, ...]]:
        """``layer_specs`` of every layer."""
        return [self.layer_specs(k) for k in range(self.num_layers)]


def model_config(config) -> ModelConfig:
    """``ModelConfig`` from a ConfigDict (``config.model``) or a mapping; unknown or missing
    fields raise ValueError."""
    if isinstance(config, ModelConfig):
        return config
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ValueError(f"expected a ConfigDict or mapping, got {type(config).__name__}")
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ValueError(f"unknown model config field(s) {unknown}; valid: {sorted(fields)}")
    missing = [n for n, f in fields.items()
               if f.default is dataclasses.MISSING and n not in config]
    if missing:
        raise ValueError(f"missing model config field(s) {missing}")
    return ModelConfig(**config)


# ---------------------------------------------------------------------------------------------
# Modules.


def _dropout(x, rate: float, key):
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def _position_tables(cfg: ModelConfig) -> list[tuple[int, np.ndarray]]:
    """(table size, index of every position 0..seq_len-1) for each position table."""
    p = np.arange(cfg.seq_len)
    if cfg.pos_emb == "single":
        return [(cfg.seq_len, p)]
    if cfg.pos_emb == "text":  # row and column of the (n / l, l) grid
        cols = min(cfg.stride, cfg.seq_len)
        return [(-(-cfg.seq_len // cols), p // cols), (cols, p % cols)]
    rows, width, channels = cfg.image_shape  # raster order, channels innermost
    return [(rows, p // (width * channels)), (width, p // channels % width),
            (channels, p % channels)]


def _linear(d_in, d_out, std, cfg, rngs, dtype=None):
    return nnx.Linear(d_in, d_out, kernel_init=nnx.initializers.normal(std),
                      dtype=dtype or DTYPES[cfg.dtype], param_dtype=DTYPES[cfg.param_dtype],
                      rngs=rngs)


class Block(nnx.Module):
    """Pre-activation residual block: H + a + b with a = dropout(attn(norm(H))),
    b = dropout(ff(norm(H + a)))."""

    def __init__(self, cfg: ModelConfig, specs: tuple[PatternSpec, ...], *, rngs: nnx.Rngs):
        d, dtype, param_dtype = cfg.d_model, DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
        out_scale = 1.0 / math.sqrt(2 * cfg.num_layers)
        norm = functools.partial(nnx.LayerNorm, d, dtype=dtype, param_dtype=param_dtype)
        self.attn_norm = norm(rngs=rngs)
        self.attn = SparseSelfAttention(
            d, cfg.num_heads, specs, qk_dim=cfg.qk_dim, init_std=0.125 / math.sqrt(d),
            out_std=0.125 / math.sqrt(d) * out_scale, dtype=dtype, param_dtype=param_dtype,
            rngs=rngs)
        self.ff_norm = norm(rngs=rngs)
        self.ff_in = _linear(d, cfg.ff_dim, 0.125 / math.sqrt(d), cfg, rngs)
        self.ff_out = _linear(cfg.ff_dim, d, 0.125 / math.sqrt(cfg.ff_dim) * out_scale, cfg, rngs)
        self.dropout = cfg.dropout

    def __call__(self, h_BND, dropout_key=None):
        keys = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        a_BND = _dropout(self.attn(self.attn_norm(h_BND)), self.dropout, keys[0])
        return self.finish(h_BND, a_BND, keys[1])

    def finish(self, h_BND, a_BND, dropout_key=None):
        """The block's output given its attention branch ``a``: H + a + b. (The cached sampler
        computes ``a`` one position at a time and finishes the block here.)"""
        x_BND = self.ff_norm(h_BND + a_BND)
        b_BND = _dropout(self.ff_out(jax.nn.gelu(self.ff_in(x_BND))), self.dropout, dropout_key)
        return h_BND + a_BND + b_BND  # float32 stream + compute-dtype branches -> float32


class _BlockGroup(nnx.Module):
    """One period of the schedule: the blocks of layers ``0 .. period - 1`` (the schedule
    repeats, so group g serves layers ``g * period + p``)."""

    def __init__(self, cfg: ModelConfig, keys_P):
        self.blocks = nnx.List([Block(cfg, cfg.layer_specs(p), rngs=nnx.Rngs(params=keys_P[p]))
                                for p in range(cfg.period)])


def _init_blocks(cfg: ModelConfig, key):
    """All blocks, layer k from key k. Returns (list of blocks, None), or (None, one group with
    parameters stacked [groups, ...]) for ``scan_layers``.

    Traced (``nnx.eval_shape``, a jitted init), the groups are built by one ``jax.vmap``: layer
    by layer in the caller's trace would be quadratic in depth, as every ``nnx.Rngs`` draw on a
    tracer walks the trace's equations (flax 0.12 reads the tracer's ``sharding``; 64 s for the
    128-layer CIFAR-10 model). Eagerly, a plain loop reuses compiled primitives (no compile).
    The two agree to float rounding (~1 ulp); eager scan and no-scan layouts agree exactly.
    """
    groups = -(-cfg.num_layers // cfg.period)
    keys_GP = jax.random.split(key, groups * cfg.period).reshape(groups, cfg.period)
    init_group = lambda keys_P: nnx.state(_BlockGroup(cfg, keys_P))  # noqa: E731
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: _BlockGroup(cfg, keys_GP[0])))
    if isinstance(key, jax.core.Tracer):
        stacked = jax.vmap(init_group)(keys_GP)
        states = [jax.tree.map(lambda x: x[g], stacked) for g in range(groups)]
    else:
        states = [init_group(keys_GP[g]) for g in range(groups)]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states) if cfg.scan_layers else None
    if cfg.scan_layers:
        return None, nnx.merge(graphdef, stacked)
    blocks = [block for state in states for block in nnx.merge(graphdef, state).blocks]
    return nnx.List(blocks[:cfg.num_layers]), None


class SparseTransformer(nnx.Module):
    """Decoder-only Sparse Transformer over bytes; see the module docstring."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig (see model_config), got {type(cfg)}")
        self.cfg = cfg
        d, param_dtype = cfg.d_model, DTYPES[cfg.param_dtype]
        embed = lambda num, std: nnx.Embed(  # noqa: E731
            num, d, embedding_init=nnx.initializers.normal(std), dtype=jnp.float32,
            param_dtype=param_dtype, rngs=rngs)
        self.token_embed = embed(cfg.vocab_size, 0.125 / math.sqrt(d))
        tables = _position_tables(cfg)
        pos_std = 0.125 / math.sqrt(d * len(tables))
        self.pos_embeds = nnx.List([embed(size, pos_std) for size, _ in tables])
        self.blocks, self.block_groups = _init_blocks(cfg, rngs.params())
        self.final_norm = nnx.LayerNorm(d, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        self.head = _linear(d, cfg.vocab_size, 0.125 / math.sqrt(d), cfg, rngs, jnp.float32)

    def embed(self, tokens_BN, positions_N=None) -> jax.Array:
        """Token plus position embeddings, float32[B, n, d]; the tokens sit at positions
        0..n-1, or at ``positions_N`` (int[n], may be traced: the cached sampler embeds one
        position at a time)."""
        seq_len = tokens_BN.shape[1]
        if seq_len > self.cfg.seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds seq_len={self.cfg.seq_len}")
        h_BND = self.token_embed(tokens_BN)
        for table, (_, index) in zip(self.pos_embeds, _position_tables(self.cfg)):
            rows = index[:seq_len] if positions_N is None else jnp.asarray(index)[positions_N]
            h_BND = h_BND + table(jnp.asarray(rows))[None]
        return h_BND

    def from_embeddings(self, h_BND, *, dropout_rng=None, activation_sharding=None
                        ) -> jax.Array:
        """The blocks, final norm and head applied to embeddings: float32[B, n, vocab].

        ``activation_sharding``: where the residual stream [B, n, d] lives between blocks. A
        multi-device caller pins it to the batch split, so that XLA gathers sharded (FSDP)
        weights for each layer instead of splitting the activations along the model width."""
        cfg = self.cfg

        def pinned(h):
            if activation_sharding is None:
                return h
            return jax.lax.with_sharding_constraint(h, activation_sharding)

        def block_fn(block, h, key):  # every block's output (the next one's input) is pinned
            return pinned(block(h, key))

        apply = block_fn
        if cfg.remat != "none":
            apply = nnx.remat(block_fn, policy=REMAT_POLICIES[cfg.remat])

        def layer_key(k):  # layer k's dropout key, the same with or without scan
            return None if dropout_rng is None else jax.random.fold_in(dropout_rng, k)

        h_BND = pinned(h_BND.astype(jnp.float32))
        if cfg.scan_layers:
            graphdef, stacked = nnx.split(self.block_groups)

            def body(h, xs):
                state, group = xs
                for p, block in enumerate(nnx.merge(graphdef, state).blocks):
                    h = apply(block, h, layer_key(group * cfg.period + p))
                return h, None

            groups = cfg.num_layers // cfg.period
            h_BND, _ = jax.lax.scan(body, h_BND, (stacked, jnp.arange(groups)))
        else:
            for k, block in enumerate(self.blocks):
                h_BND = apply(block, h_BND, layer_key(k))
        return self.head(self.final_norm(h_BND)).astype(jnp.float32)

    def __call__(self, tokens_BN, *, dropout_rng: jax.Array | None = None,
                 activation_sharding=None) -> jax.Array:
        """int32[B, n] (n <= seq_len) -> float32[B, n, vocab] logits. Dropout iff
        ``dropout_rng`` is given; ``activation_sharding`` as in ``from_embeddings``."""
        return self.from_embeddings(self.embed(tokens_BN), dropout_rng=dropout_rng,
                                    activation_sharding=activation_sharding)


def loss_bits(logits, targets, mask=None) -> jax.Array:
    """Mean negative log-likelihood in bits (bits per byte / per dim) over ``mask``, float32.

    logits: [..., vocab]; targets: int [...]; mask: [...] (bool or weights), None = all.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if mask is None:
        return nll.mean() / math.log(2)
    mask = jnp.asarray(mask, jnp.float32)
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0) / math.log(2)


# ---------------------------------------------------------------------------------------------
# Sizes and costs, without allocating parameters.


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters, by formula (equals the allocated model's count)."""
    d, f, qk, v = cfg.d_model, cfg.ff_dim, cfg.qk_dim, cfg.vocab_size
    embeddings = v * d + d * sum(size for size, _ in _position_tables(cfg))
    attention = 2 * (d * qk + qk) + 2 * (d * d + d)  # query, key; value, output
    feed_forward = d * f + f + f * d + d
    norms = 2 * 2 * d
    return embeddings + cfg.num_layers * (attention + feed_forward + norms) + 2 * d + d * v + v


@functools.lru_cache(maxsize=64)
def _mean_keys(spec: PatternSpec, seq_len: int) -> float:
    return spec.mean_keys(seq_len)


def describe(cfg: ModelConfig, batch_size: int = 1) -> dict:
    """Size, attention schedule and cost estimates of ``cfg``; allocates no parameters.

    flops_per_token: forward matmul FLOPs (2 per multiply-add) of one token: projections
    2(2d·qk + 2d²), feed-forward 4d·f, attention 2|S|(qk + d) with |S| the layer's mean keys per
    query, head 2d·vocab. The block-sparse kernels also score masked keys inside their tiles
    (up to ~2x |S|), which this does not count. flops_per_step = 3 x forward x n x batch
    (forward + backward); remat recomputes the forward once more (~4x).

    Activation memory (bytes; B batch, n seq_len, c compute-dtype bytes, H heads):
    per layer and token the backward keeps s = 4·2d (float32 residual stream at both norms)
    + c·(2d + 2qk + 2d + 2f) (norm outputs, q, k, v, attention output, GeLU in/out)
    + 4·(d + H) (float32 attention output and log-sum-exp saved by the custom backward)
    [+ 2d dropout masks] [+ 8·H·n for a dense layer: its probabilities and scores];
    the head keeps 4·(d + 2·vocab). A transient attention workspace of one layer,
    w = 8·B·H·n·|S|max (float32 scores and probabilities), comes on top.
    Without remat: B·n·(N·s + head) + w. With remat (whole blocks): B·n·(N·4d + s + head) + w
    (each block's float32 input, plus one block recomputed at a time; on XLA:CPU only reached
    with ``scan_layers``, see the module docstring). This counts what the backward must keep;
    XLA:CPU's buffer plan for scripts/benchmark_model.py's default model (4 layers, n=8192) was
    2.0-2.4x larger (layout copies, backward temporaries), so read it as a lower bound.
    """
    model = nnx.eval_shape(lambda: SparseTransformer(cfg, rngs=nnx.Rngs(0)))
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    d, f, qk, n, heads = cfg.d_model, cfg.ff_dim, cfg.qk_dim, cfg.seq_len, cfg.num_heads
    layer_specs_ = cfg.specs()
    keys_per_layer = [np.mean([_mean_keys(s, n) for s in specs]) for specs in layer_specs_]
    flops = sum(2 * (2 * d * qk + 2 * d * d) + 4 * d * f + 2 * k * (qk + d)
                for k in keys_per_layer) + 2 * d * cfg.vocab_size
    c = jnp.dtype(DTYPES[cfg.dtype]).itemsize
    per_layer = []
    for specs in layer_specs_:
        s = 8 * d + c * (4 * d + 2 * qk + 2 * f) + 4 * (d + heads)
        s += 2 * d if cfg.dropout else 0
        s += sum(8 * heads // len(specs) * n for spec in specs if spec.kind == "dense")
        per_layer.append(s)
    head = 4 * (d + 2 * cfg.vocab_size)
    workspace = 8 * batch_size * heads * n * max(keys_per_layer)
    tokens = batch_size * n
    return {
        "params": params,
        "param_count_formula": param_count(cfg),
        "schedule": [" | ".join(map(str, specs)) for specs in layer_specs_],
        "mean_keys_per_query": float(np.mean(keys_per_layer)),
        "flops_per_token": int(flops),
        "flops_per_step": int(3 * flops * tokens),
        "batch_size": batch_size,
        "activation_bytes": int(tokens * (sum(per_layer) + head) + workspace),
        "activation_bytes_remat": int(tokens * (cfg.num_layers * 4 * d + max(per_layer) + head)
                                      + workspace),
    }
