"""The Sparse Transformer decoder (paper §5, docs/design.md §4) as a Flax NNX module.

``ModelConfig`` (``model.config``) is a frozen, validated dataclass (the model never sees a
ConfigDict; ``model_config`` converts ``config.model``). ``SparseTransformer(cfg, rngs=...)`` maps
``int32[B, n]`` bytes to ``float32[B, n, vocab]`` logits:

  H = token_emb + Σ position tables                          (n_emb = 3 image, 2 text, 1 single)
  per layer:  a = dropout(attn(norm(H))),  b = dropout(ff(norm(H + a))),  H = H + a + b
  logits = head(norm(H))

(the block and its attention layer: ``sparse_jax.model.layers``).

The residual stream, the final norm, the head and the loss are float32; the branches compute in
``cfg.dtype`` with ``cfg.param_dtype`` weights. Dropout is active iff ``dropout_rng`` is given,
so a training step is a pure function of (state, batch, rng).

Per-layer attention (``ModelConfig.specs``): ``mode`` merged / interleaved / multihead
(``layer_specs``), or a ``schedule`` cycle such as "local,local,local,strided"
(openai's CIFAR-10 layers): layer k uses part ``schedule[k % len(schedule)]``.

Remat (``cfg.remat``, a named ``jax.checkpoint`` policy applied to each residual block, i.e.
attention and feed-forward together): "none"; "full" = ``nothing_saveable`` (only each block's
input is kept; the whole block is recomputed in the backward pass, ~4/3 of the FLOPs);
"dots" = ``dots_with_no_batch_dims_saveable`` (keeps the projection matmul outputs, recomputes
attention, norms and GeLU); "attention" = ``save_only_these_names`` of the Pallas attention's
residuals (``attention.fused.RESIDUALS``: q, k, v, its output and log-sum-exp; 8 bytes per
position and model dimension a layer in bfloat16) and nothing else: the block is recomputed but
for the attention kernels' forward pass and the q, k, v projections (compiled for an H100, the
paper's 16k step launches each forward kernel once instead of twice: docs/gpu_compile.md); on
other attention implementations it is "full". On XLA:CPU (jax 0.10) remat saves memory only
together with ``scan_layers``: unrolled, the compiler drops jax's optimization barriers and
schedules the recomputation early, so peak memory does not change (scripts/benchmark_model.py).

``scan_layers``: the layers are grouped by the period of the schedule (1 merged/multihead,
2 interleaved, len(schedule)) and ``jax.lax.scan`` runs over the groups, whose parameters are
stored stacked (leading axis = group). Each layer's parameters are drawn from the same key with
or without scan, so both layouts initialize (and compute) identically.

Decoding with a key/value cache is part of the model: ``init_cache(batch, length)`` and
``decode_step(token_B, i, cache)`` give the logits of position i from one token, each
attention layer writing that position's key and value into the cache and attending its
pattern's cached keys (``layers.SparseSelfAttention.decode_step``). The full forward pass and
the cached step walk the blocks the same way (``_over_blocks``): a list, or scanned groups.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax.model.config import DTYPES, REMAT_POLICIES, ModelConfig
from sparse_jax.model.layers import Block, linear

# ---------------------------------------------------------------------------------------------
# The model.


def position_table_sizes(cfg: ModelConfig) -> list[int]:
    """The rows of each position table (`position_tables`' sizes), without an array of the
    positions (a size check of a huge seq_len must not allocate it)."""
    if cfg.pos_emb == "none":
        return []
    if cfg.pos_emb == "single":
        return [cfg.seq_len]
    if cfg.pos_emb == "text":
        cols = min(cfg.stride, cfg.seq_len)
        return [-(-cfg.seq_len // cols), cols]
    return list(cfg.image_shape)


def position_tables(cfg: ModelConfig) -> list[tuple[int, np.ndarray]]:
    """(table size, index of every position 0..seq_len-1) for each position table."""
    p = np.arange(cfg.seq_len)
    if cfg.pos_emb == "none":  # no absolute position (with ``rotary``: relative only)
        return []
    if cfg.pos_emb == "single":
        return [(cfg.seq_len, p)]
    if cfg.pos_emb == "text":  # row and column of the (n / l, l) grid
        cols = min(cfg.stride, cfg.seq_len)
        return [(-(-cfg.seq_len // cols), p // cols), (cols, p % cols)]
    rows, width, channels = cfg.image_shape  # raster order, channels innermost
    return [(rows, p // (width * channels)), (width, p // channels % width),
            (channels, p % channels)]


class _BlockGroup(nnx.Module):
    """One period of the schedule: the blocks of layers ``0 .. period - 1`` (the schedule
    repeats, so group g serves layers ``g * period + p``)."""

    def __init__(self, cfg: ModelConfig, keys_P):
        self.blocks = nnx.List([Block(
            cfg.d_model, cfg.num_heads, cfg.layer_specs(p), qk_dim=cfg.qk_dim, ff_dim=cfg.ff_dim,
            num_layers=cfg.num_layers, dropout=cfg.dropout, attention=cfg.attention,
            block_sizes=cfg.block_sizes,
            rotary=cfg.rotary, rotary_dims=cfg.rotary_dims if cfg.rotary else None,
            shifts=cfg.head_shifts(p), dtype=DTYPES[cfg.dtype],
            param_dtype=DTYPES[cfg.param_dtype], rngs=nnx.Rngs(params=keys_P[p]))
            for p in range(cfg.period)])


def _init_blocks(cfg: ModelConfig, key):
    """All blocks, layer k from key k. Returns (list of blocks, None), or (None, one group with
    parameters stacked [groups, ...]) for ``scan_layers``.

    Traced (``nnx.eval_shape``, a jitted init), the groups are built by one ``jax.vmap``: layer
    by layer in the caller's trace would be quadratic in depth, as every ``nnx.Rngs`` draw on a
    tracer walks the trace's equations (flax 0.12 reads the tracer's ``sharding``). Eagerly, a
    plain loop reuses compiled primitives (no compile).
    The two agree to float rounding (~1 ulp); eager scan and no-scan layouts agree exactly.
    """
    groups = -(-cfg.num_layers // cfg.period)
    keys_GP = jax.random.split(key, groups * cfg.period).reshape(groups, cfg.period)
    init_group = lambda keys_P: nnx.state(_BlockGroup(cfg, keys_P))  # noqa: E731
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: _BlockGroup(cfg, keys_GP[0])))
    if isinstance(key, jax.core.Tracer):
        stacked = jax.vmap(init_group)(keys_GP)
        states = [jax.tree.map(lambda x: x[g], stacked) for g in range(groups)]  # noqa: B023
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
        tables = position_tables(cfg)
        pos_std = 0.125 / math.sqrt(d * max(1, len(tables)))
        self.pos_embeds = nnx.List([embed(size, pos_std) for size, _ in tables])
        self.blocks, self.block_groups = _init_blocks(cfg, rngs.params())
        self.final_norm = nnx.LayerNorm(d, dtype=jnp.float32, param_dtype=param_dtype, rngs=rngs)
        self.head = linear(d, cfg.vocab_size, 0.125 / math.sqrt(d), dtype=jnp.float32,
                           param_dtype=param_dtype, rngs=rngs)

    def embed(self, tokens_BN, positions_N=None) -> jax.Array:
        """Token plus position embeddings, float32[B, n, d]; the tokens sit at positions
        0..n-1, or at ``positions_N`` (int[n], may be traced: ``decode_step`` embeds one
        position at a time)."""
        seq_len = tokens_BN.shape[1]
        if seq_len > self.cfg.seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds seq_len={self.cfg.seq_len}")
        h_BND = self.token_embed(tokens_BN)
        for table, (_, index) in zip(self.pos_embeds, position_tables(self.cfg)):
            rows = index[:seq_len] if positions_N is None else jnp.asarray(index)[positions_N]
            h_BND = h_BND + table(jnp.asarray(rows))[None]
        return h_BND

    def from_embeddings(self, h_BND, *, dropout_rng=None, activation_sharding=None
                        ) -> jax.Array:
        """The blocks, final norm and head applied to embeddings: float32[B, n, vocab].

        ``activation_sharding``: where the residual stream [B, n, d] lives between blocks. A
        multi-device caller pins it to the batch split, so that XLA gathers sharded (FSDP)
        weights for each layer instead of splitting the activations along the model width; a
        fused attention kernel then runs on each device's own sequences."""
        cfg = self.cfg

        def pinned(h):
            if activation_sharding is None:
                return h
            return jax.lax.with_sharding_constraint(h, activation_sharding)

        def block_fn(block, h, key):  # every block's output (the next one's input) is pinned
            return pinned(block(h, key, activation_sharding))

        apply = block_fn
        if cfg.remat != "none":
            apply = nnx.remat(block_fn, policy=REMAT_POLICIES[cfg.remat])

        def layer(block, k, h):  # layer k's dropout key is the same with or without scan
            key = None if dropout_rng is None else jax.random.fold_in(dropout_rng, k)
            return apply(block, h, key)

        return self._logits(self._over_blocks(layer, pinned(h_BND.astype(jnp.float32))))

    def __call__(self, tokens_BN, *, dropout_rng: jax.Array | None = None,
                 activation_sharding=None) -> jax.Array:
        """int32[B, n] (n <= seq_len) -> float32[B, n, vocab] logits. Dropout iff
        ``dropout_rng`` is given; ``activation_sharding`` as in ``from_embeddings``."""
        return self.from_embeddings(self.embed(tokens_BN), dropout_rng=dropout_rng,
                                    activation_sharding=activation_sharding)

    def init_cache(self, batch: int, length: int) -> tuple[jax.Array, jax.Array]:
        """An empty key/value cache of ``length`` <= seq_len positions for ``decode_step``:
        (k [layers, batch, length, H, qk_dim / H], v [layers, batch, length, H, d / H]) in the
        compute dtype."""
        cfg = self.cfg
        if not 1 <= length <= cfg.seq_len:
            raise ValueError(f"a cache of {length} positions does not fit seq_len={cfg.seq_len}")
        shape, dtype = (cfg.num_layers, batch, length, cfg.num_heads), DTYPES[cfg.dtype]
        return (jnp.zeros((*shape, cfg.qk_dim // cfg.num_heads), dtype),
                jnp.zeros((*shape, cfg.d_model // cfg.num_heads), dtype))

    def decode_step(self, token_B, i, cache) -> tuple[jax.Array, tuple]:
        """Position ``i`` (may be traced) reading ``token_B`` (int [B]), given the keys and values
        of positions < i in ``cache`` (``init_cache``): the logits float32[B, vocab] (equal to
        row i of the full forward pass over the same tokens) and the cache with position i
        written; each layer computes its pattern's keys of position i (``PatternSpec.row_keys``).
        No dropout."""
        h_B1D = self.embed(token_B[:, None], jnp.asarray(i)[None])

        def layer(block, k, carry):
            h_B1D, cache = carry
            return block.decode_step(h_B1D, cache, k, i)

        h_B1D, cache = self._over_blocks(layer, (h_B1D, cache))
        return self._logits(h_B1D)[:, 0], cache

    def _over_blocks(self, fn, carry):
        """``carry = fn(block, k, carry)`` for the blocks in order, layer k. Unrolled over
        ``blocks``, or for ``scan_layers`` a ``jax.lax.scan`` over the stacked groups of
        ``block_groups`` (k is then traced)."""
        cfg = self.cfg
        if not cfg.scan_layers:
            for k, block in enumerate(self.blocks):
                carry = fn(block, k, carry)
            return carry
        graphdef, stacked = nnx.split(self.block_groups)

        def body(carry, xs):
            state, group = xs
            for p, block in enumerate(nnx.merge(graphdef, state).blocks):
                carry = fn(block, group * cfg.period + p, carry)
            return carry, None

        groups = jnp.arange(cfg.num_layers // cfg.period)
        return jax.lax.scan(body, carry, (stacked, groups))[0]

    def _logits(self, h_BND):
        return self.head(self.final_norm(h_BND)).astype(jnp.float32)


def _nll(logits, targets) -> jax.Array:
    """Negative log-likelihood in nats of each target, float32 [...]."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def token_bits(logits, targets) -> jax.Array:
    """The bits of each target, float32 [...] (logits: [..., vocab]; targets: int [...])."""
    return _nll(logits, targets) / math.log(2)


def loss_bits(logits, targets, mask=None) -> jax.Array:
    """Mean negative log-likelihood in bits (bits per byte / per dim) over ``mask``, float32.

    logits: [..., vocab]; targets: int [...]; mask: [...] (bool or weights), None = all.
    """
    nll = _nll(logits, targets)
    if mask is None:
        return nll.mean() / math.log(2)
    mask = jnp.asarray(mask, jnp.float32)
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0) / math.log(2)
