"""The Sparse Transformer decoder (paper §5, docs/design.md §4) as a Flax NNX module.

``ModelConfig`` is a frozen, validated dataclass (the model never sees a ConfigDict;
``model_config`` converts ``config.model``). ``SparseTransformer(cfg, rngs=...)`` maps
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
attention, norms and GeLU). On XLA:CPU (jax 0.10) remat saves memory only together with
``scan_layers``: unrolled, the compiler drops jax's optimization barriers and schedules the
recomputation early, so peak memory does not change (see scripts/benchmark_model.py).

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

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_jax.attention import IMPLEMENTATIONS, patterns, resolve_implementation, tiles
from sparse_jax.attention.blocks import BlockSizes
from sparse_jax.attention.patterns import MODES
from sparse_jax.attention.spec import PatternSpec, layer_specs
from sparse_jax.model.layers import Block, linear

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
POS_EMBS = ("image", "text", "single", "none")
PATTERNS = patterns.KINDS


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of ``SparseTransformer``; validated on construction (ValueError)."""
    seq_len: int  #: context n
    num_layers: int  #: N residual blocks
    d_model: int  #: d
    num_heads: int  #: H attention heads
    vocab_size: int = 256  #: bytes
    ff_mult: float = 4.0  #: feed-forward width / d (2.0 = the paper's half-size)
    qk_ratio: float = 1.0  #: query/key width / d (0.5 = half-size)
    dropout: float = 0.0  #: at the end of each residual branch
    pattern: str = "strided"  #: dense | local | strided | fixed
    stride: int = 128  #: l (also the column count of the "text" position grid)
    c: int = 32  #: summary width of "fixed"
    local_width: int | None = None  #: window of strided/local (None: l + 1, the paper)
    summary: str = "paper"  #: fixed summary convention: paper | lra
    mode: str = "merged"  #: merged | interleaved | multihead
    schedule: str = ""  #: cycle of parts per layer, e.g. "local,local,local,strided"
    distinct_summaries: bool = False  #: fixed + multihead: head group h uses summary block h
    pos_emb: str = "text"  #: image | text | single | none
    rotary: bool = False  #: rotary embedding of queries and keys (relative; not in the paper)
    rotary_fraction: float = 1.0  #: share of each head's query/key features rotated (rest: none)
    shifted_heads: bool = False  #: strided column heads read keys/values 1..l back (not in paper)
    image_shape: tuple[int, int, int] = (32, 32, 3)  #: (rows, columns, channels): data, "image"
    remat: str = "none"  #: none | full | dots (see module docstring)
    scan_layers: bool = False  #: jax.lax.scan over groups of layers
    dtype: str = "float32"  #: compute: float32 | bfloat16
    attention: str = "xla"  #: sparse attention: xla | native (CPU kernels) | pallas (fused) | auto
    kernel: str = ""  #: Pallas kernel options, e.g. "chained:h2" (BlockSizes.parse); "": default
    param_dtype: str = "float32"  #: storage

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
        if not isinstance(self.rotary, bool):
            fail("rotary", "must be True or False")
        if self.rotary and (self.qk_dim // self.num_heads) % 2:
            fail("rotary", f"needs an even query/key width per head, got "
                           f"{self.qk_dim // self.num_heads}")
        if (isinstance(self.rotary_fraction, bool)
                or not isinstance(self.rotary_fraction, (int, float))
                or not 0 < self.rotary_fraction <= 1):
            fail("rotary_fraction", "must be a number in (0, 1]")
        width = self.qk_dim // self.num_heads
        if self.rotary and (self.rotary_fraction * width) % 2:  # also catches non-integers
            fail("rotary_fraction", f"gives {self.rotary_fraction} x {width} = "
                                    f"{self.rotary_fraction * width:g} rotated features per head;"
                                    " it must be a positive even number")
        if self.rotary_fraction != 1 and not self.rotary:
            fail("rotary_fraction", "applies with rotary=True")
        if not isinstance(self.shifted_heads, bool):
            fail("shifted_heads", "must be True or False")
        if self.shifted_heads and self.pattern != "strided":
            fail("shifted_heads", f"applies to pattern 'strided' (its column of every l-th "
                                  f"byte), not {self.pattern!r}")
        if not 0.0 <= self.dropout < 1.0:
            fail("dropout", "must be in [0, 1)")
        choices = [("pattern", PATTERNS), ("summary", patterns.SUMMARY_CONVENTIONS),
                   ("mode", MODES), ("pos_emb", POS_EMBS), ("remat", tuple(REMAT_POLICIES)),
                   ("dtype", tuple(DTYPES)), ("param_dtype", tuple(DTYPES)),
                   ("attention", IMPLEMENTATIONS)]
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                fail(name, f"must be one of {list(allowed)}")
        if self.attention == "native":  # on this machine: a CPU, kernels that build
            try:
                resolve_implementation("native")
            except (ValueError, OSError) as e:
                fail("attention", f"{str(e).splitlines()[0]}; or set attention='auto' (the "
                                  "same numbers, on the XLA path where the kernels cannot run)")
        if self.local_width is not None and self.pattern not in ("strided", "local"):
            fail("local_width", f"applies to pattern strided/local, not {self.pattern!r}")
        if self.summary != "paper" and self.pattern != "fixed":
            fail("summary", f"applies to pattern 'fixed', not {self.pattern!r}")
        if not isinstance(self.kernel, str):
            fail("kernel", "must be a string of kernel options, e.g. 'chained:h2'")
        try:
            sizes = self.block_sizes
            if sizes is not None:  # against the backend of the platform traced for
                sizes.check_backend(kernel_backend())
        except ValueError as e:
            fail("kernel", str(e))
        try:
            _ = self.base_spec  # evaluated only to validate the pattern fields
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
        groups = sorted({self.num_heads // len(specs) for specs in set(self.specs())})
        if sizes is not None and any(g % sizes.heads_per_program for g in groups):
            fits = [f"h{2 ** i}" for i in range(math.gcd(*groups).bit_length())
                    if math.gcd(*groups) % 2 ** i == 0]
            heads = (f"the model's {self.num_heads} heads" if groups == [self.num_heads] else
                     f"the heads of each head group ({' and '.join(map(str, groups))}: the "
                     f"{self.num_heads} heads split evenly over a layer's patterns)")
            fail("kernel", f"h{sizes.heads_per_program} heads per program must divide {heads}; "
                           f"give {', '.join(fits)}")
        if self.shifted_heads:  # the pattern is strided (checked above)
            column_groups = {self.num_heads // len(specs) for specs in self.specs()
                             for spec in specs if _has_column(spec)}
            if column_groups and min(column_groups) < self.stride:
                fail("shifted_heads", f"needs at least stride={self.stride} heads attending "
                                      f"the strided column in a layer (one per shift 1..l, so "
                                      f"that they reach every offset); a layer has "
                                      f"{min(column_groups)}: raise num_heads")
        if self.scan_layers and self.num_layers % self.period:
            fail("scan_layers", f"needs num_layers={self.num_layers} to be a multiple of the "
                                f"schedule period {self.period}")

    @property
    def qk_dim(self) -> int:
        return int(self.qk_ratio * self.d_model)

    @property
    def rotary_dims(self) -> int:
        """Rotated query/key features per head: ``rotary_fraction`` of the head's width (an even
        number, checked on construction)."""
        return int(self.rotary_fraction * (self.qk_dim // self.num_heads))

    @property
    def ff_dim(self) -> int:
        return int(self.ff_mult * self.d_model)

    @property
    def schedule_entries(self) -> tuple[str, ...]:
        return tuple(e.strip() for e in self.schedule.split(",")) if self.schedule else ()

    @property
    def block_sizes(self) -> BlockSizes | None:
        """The Pallas kernel's options (``kernel``; the others the default of the backend of
        the platform traced for), or None for the backend's default."""
        if not self.kernel:
            return None
        return BlockSizes.parse(self.kernel, BlockSizes.for_backend(kernel_backend()))

    @property
    def kernel_unused(self) -> str | None:
        """Why ``kernel``'s options change nothing on the platform traced for
        (``tiles.target_platform``), in one line; None when they apply (or are
        unset). They are the Pallas kernel's: the XLA path, the CPU kernels and dense
        attention do not read them, nor Mosaic Triton's warps and stages."""
        if not self.kernel:
            return None
        platform = tiles.target_platform()
        implementation = resolve_implementation(self.attention)
        unused = f"model.kernel={self.kernel!r} is not used: "
        if implementation != "pallas":
            runs = {"native": "the CPU kernels (attention.native)", "xla": "the XLA path"}
            return (unused + f"attention={self.attention!r} runs {runs[implementation]} on "
                    f"this {platform}, and the options are the Pallas kernel's (attention="
                    "'pallas', or 'auto' on a GPU or TPU)")
        if self.pattern == "dense":
            return unused + "dense attention runs a fused dense kernel or XLA, not the " \
                            "block-sparse Pallas kernel the options are for"
        sizes, default = self.block_sizes, BlockSizes.for_backend("mosaic")
        if kernel_backend() == "mosaic" and (sizes.num_warps, sizes.num_stages) != (
                default.num_warps, default.num_stages):
            return ("model.kernel's warps and stages (wN, sN) are not used: they are "
                    "Triton's (a GPU), and this TPU's kernels compile through Mosaic")
        return None

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

    def head_shifts(self, layer: int) -> tuple[int, ...] | None:
        """With ``shifted_heads``, the key/value shift of each head of layer ``layer``
        (``layers.shift_kv``): head h of a group attending the strided column is shifted by
        1 + (h mod l), so the group reaches offset m·l + s for every s in 1..l: every earlier
        byte in one hop. Heads of local-only groups are not shifted. None without."""
        if not self.shifted_heads:
            return None
        specs = self.layer_specs(layer)
        group = self.num_heads // len(specs)
        return tuple(1 + h % self.stride if _has_column(spec) else 0
                     for spec in specs for h in range(group))


def _has_column(spec: PatternSpec) -> bool:
    """Whether a head group with this pattern attends the strided column (every l-th byte)."""
    return spec.kind == "strided" and spec.part in ("both", "strided")


def kernel_backend() -> str:
    """The Pallas backend the kernel compiles through on the platform traced for: "mosaic" on a
    TPU, else "triton" (interpreted on a CPU), as ``fused.compiler_for`` picks it."""
    return "mosaic" if tiles.target_platform() == "tpu" else "triton"


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
# The model.


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
