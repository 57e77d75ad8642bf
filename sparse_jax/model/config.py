"""The model's config: ``ModelConfig``, a frozen, validated dataclass of everything the model is
built from (the model never sees a ConfigDict; ``model_config`` converts ``config.model``), with
what follows from it: the attention pattern of every layer (``ModelConfig.specs``), the kernel
options where they apply, the remat policies and dtypes by name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from sparse_jax.attention import (
    IMPLEMENTATIONS,
    custom,
    fused,
    patterns,
    resolve_implementation,
    tiles,
)
from sparse_jax.attention.blocks import BlockSizes
from sparse_jax.attention.fused import RESIDUALS
from sparse_jax.attention.patterns import MODES
from sparse_jax.attention.spec import PatternSpec, layer_specs

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attention": jax.checkpoint_policies.save_only_these_names(RESIDUALS),
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
POS_EMBS = ("image", "text", "single", "none")
PATTERNS = patterns.KINDS


MAX_LAYERS = 4096  # the deepest model accepted: 32x the paper's deepest (128 layers)


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
    pattern: str = "strided"  #: dense | local | strided | fixed | module:name(k=v, ...) (yours)
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
    remat: str = "none"  #: none | full | dots | attention (see module docstring)
    scan_layers: bool = False  #: jax.lax.scan over groups of layers
    dtype: str = "float32"  #: compute: float32 | bfloat16
    attention: str = "xla"  #: sparse attention: xla | native (CPU kernels) | pallas (fused) | auto
    kernel: str = ""  #: Pallas kernel options, e.g. "chained:h2" (BlockSizes.parse); "": default
    param_dtype: str = "float32"  #: storage
    pattern_fingerprint: str = ""  #: a named pattern's index arrays at seq_len, as recorded

    def __post_init__(self):
        def fail(field, why):
            raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: {why}")

        for name in ("seq_len", "num_layers", "d_model", "num_heads", "vocab_size", "stride",
                     "c"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(name, "must be a positive integer")
        if self.num_layers > MAX_LAYERS:  # each layer's pattern is listed (`specs`)
            fail("num_layers", f"above {MAX_LAYERS:,} layers (the paper's deepest has 128); "
                               "give fewer")
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
            if not 0 < width <= 2**31 - 1 or width != int(width):
                fail(name, f"times d_model={self.d_model} must be a positive integer (at most "
                           "2^31 - 1)")
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
        if custom.is_named(self.pattern):  # a pattern of the user's (attention.custom)
            try:
                fingerprint = named_fingerprint(self.pattern, self.seq_len)
            except ValueError as e:
                fail("pattern", str(e))
            if self.pattern_fingerprint and self.pattern_fingerprint != fingerprint:
                fail("pattern", f"its definition changed since this config was recorded: its "
                                f"index arrays at seq_len={self.seq_len} have fingerprint "
                                f"{fingerprint}, the record {self.pattern_fingerprint}; restore "
                                "the definition, or train a new run")
            if self.mode != "merged" or self.schedule:
                fail("pattern", "a named pattern gives its own head groups: leave mode='merged' "
                                "and schedule=''")
        elif self.pattern_fingerprint:
            fail("pattern_fingerprint", f"records a named pattern (module:name), not "
                                        f"{self.pattern!r}; leave it empty")
        choices = [("pattern", PATTERNS), ("summary", patterns.SUMMARY_CONVENTIONS),
                   ("mode", MODES), ("pos_emb", POS_EMBS), ("remat", tuple(REMAT_POLICIES)),
                   ("dtype", tuple(DTYPES)), ("param_dtype", tuple(DTYPES)),
                   ("attention", IMPLEMENTATIONS)]
        for name, allowed in choices:
            if name == "pattern" and custom.is_named(self.pattern):
                continue
            if getattr(self, name) not in allowed:
                fail(name, f"must be one of {list(allowed)}")
        if self.attention == "native":  # on this machine: a CPU, kernels that build
            try:
                resolve_implementation("native")
            except (ValueError, OSError) as e:
                fail("attention", f"{str(e).splitlines()[0]}; or set attention='auto' (the "
                                  "same numbers, on the XLA path where the kernels cannot run)")
        if self.local_width is not None and self.local_width > self.seq_len:
            fail("local_width", f"exceeds seq_len={self.seq_len}: a window wider than the "
                                "context (each query's keys are listed)")
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
        shape = self.image_shape
        if not (isinstance(shape, (tuple, list)) and len(shape) == 3 and all(
                isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in shape)):
            fail("image_shape", "must be (rows, columns, channels): 3 positive integers")
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
        if sizes is not None and sizes.variant == "onepass":
            for spec in {s for specs in self.specs() for s in specs if s.kind != "dense"}:
                try:
                    fused.check_onepass(spec, sizes.heads_per_program)
                except ValueError as e:
                    fail("kernel", str(e))
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
        unused = []  # options the kernel has but this model's pattern or backend never reads
        if kernel_backend() == "mosaic" and (sizes.num_warps, sizes.num_stages) != (
                default.num_warps, default.num_stages):
            unused.append("warps and stages (wN, sN): they are Triton's (a GPU), and this "
                          "TPU's kernels compile through Mosaic")
        if (sizes.summary_q or sizes.summary_k) and self.pattern != "fixed":
            unused.append(f"summary tiles (sumQxK): only the fixed pattern has a summary term, "
                          f"and pattern={self.pattern!r}")
        return ("model.kernel's " + "; and its ".join(u.replace(":", " are not used:", 1)
                                                       for u in unused)) if unused else None

    @property
    def base_spec(self) -> PatternSpec:
        """The whole pattern (part="both"), with only the fields its kind uses."""
        if custom.is_named(self.pattern):  # the first head group's
            return named_pattern(self.pattern).groups[0]
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
        if custom.is_named(self.pattern):
            return named_pattern(self.pattern).groups
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


@functools.lru_cache(maxsize=16)
def named_pattern(pattern: str) -> custom.Pattern:
    """The user's pattern a config names (``custom.load``), loaded once per process."""
    return custom.load(pattern)


@functools.lru_cache(maxsize=16)
def named_fingerprint(pattern: str, seq_len: int) -> str:
    """``Pattern.fingerprint`` of a named pattern at ``seq_len`` (what a run records)."""
    return named_pattern(pattern).fingerprint(seq_len)


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
