"""``PatternSpec`` names a pattern (what the attention functions and the model take: its index
arrays, block-level terms and mask), and ``layer_specs`` gives the patterns of a layer's head
groups for each way of combining the parts (``patterns.MODES``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sparse_jax.attention.patterns import (
    KINDS,
    MODES,
    PARTS,
    check_choice,
    check_int,
    indices_to_mask,
    pattern_indices,
)
from sparse_jax.attention.terms import (
    ColumnTerm,
    Term,
    pattern_terms,
    term_key_count,
    term_rows,
)

# --------------------------------------------------------------------------------------------
# A pattern by name, and the patterns of a layer's head groups.


@dataclasses.dataclass(frozen=True)
class PatternSpec:
    """Names an attention pattern; hashable, so it can be a static argument of ``jax.jit``, and
    ordered by ``str``, so it can key a dict that ``jax.jit`` takes as an argument.

    kind: one of ``KINDS``.
    stride: l (strided/fixed); the window of "local" is ``local_width`` (default stride + 1).
    c: summary width of "fixed".
    part: "both", or one part ("local"/"strided" for strided, "block"/"summary" for fixed).
    local_width: local window of "strided"/"local" (default stride + 1, the paper's formula).
    summary: "paper" or "lra" (fixed summary convention).
    summary_block: which summary sub-block of "fixed" (residues [l-(b+1)c, l-bc)).
    """
    kind: str = "strided"
    stride: int | None = None
    c: int | None = None
    part: str = "both"
    local_width: int | None = None
    summary: str = "paper"
    summary_block: int = 0

    def __post_init__(self):
        check_choice("kind", self.kind, KINDS)
        if self.kind != "dense":
            self.terms()  # validates every field

    def _fields(self) -> dict:
        return dict(stride=self.stride, c=self.c, part=self.part, local_width=self.local_width,
                    summary=self.summary, summary_block=self.summary_block)

    def indices(self, seq_len: int) -> np.ndarray:
        """``int32[seq_len, K]`` key indices per query (``pattern_indices``)."""
        return pattern_indices(self.kind, seq_len, **self._fields())

    def terms(self) -> tuple[Term, ...]:
        """Disjoint block-level terms of the pattern (``pattern_terms``)."""
        return pattern_terms(self.kind, **self._fields())

    @property
    def block(self) -> int:
        """Row length of the grid the fast path works on (all terms share it)."""
        blocks = {t.stride if isinstance(t, ColumnTerm) else t.block for t in self.terms()}
        assert len(blocks) == 1, blocks
        return blocks.pop()

    def row_keys(self, i, seq_len: int, xp=np):
        """Keys of query ``i`` (or of each of an array of queries) among ``seq_len`` positions,
        ``[..., C]`` with -1 where absent, not sorted; the same set as row ``i`` of
        ``indices(seq_len)`` without building it. With ``xp=jax.numpy`` ``i`` may be traced
        (``C`` depends only on ``seq_len``): the cached decoder's keys at position ``i``."""
        if self.kind == "dense":
            keys = np.arange(seq_len)
            return xp.where(keys <= xp.asarray(i)[..., None], keys, -1)
        return xp.concatenate([term_rows(t, i, seq_len, xp) for t in self.terms()], axis=-1)

    def mask(self, seq_len: int) -> np.ndarray:
        """``bool[seq_len, seq_len]`` (for references and pictures; O(n²))."""
        return indices_to_mask(self.indices(seq_len), seq_len)

    def mean_keys(self, seq_len: int) -> float:
        """Mean number of keys per query (|S| in FLOP counts), from the disjoint terms in
        O(seq_len): the index array itself is O(seq_len · K) (fixed, l = 256, at 65,536: 4 GB)."""
        seq_len = check_int("seq_len", seq_len)
        if self.kind == "dense":
            return (seq_len + 1) / 2
        return sum(term_key_count(t, seq_len) for t in self.terms()) / seq_len

    def __str__(self) -> str:
        if self.kind == "dense":
            return "dense"
        extras = {k: v for k, v in self._fields().items()
                  if v is not None and v != PatternSpec.__dataclass_fields__[k].default}
        return self.kind + "(" + ", ".join(f"{k}={v}" for k, v in extras.items()) + ")"

    def __lt__(self, other: PatternSpec) -> bool:
        return str(self) < str(other)


def layer_specs(spec: PatternSpec, mode: str, layer: int = 0, *,
                distinct_summaries: bool = False) -> tuple[PatternSpec, ...]:
    """Pattern of each head group of layer ``layer`` (paper §4.3); heads are split evenly over
    the groups.

    merged: one group attending the union of the parts (``spec`` with part="both").
    interleaved: one group, the part ``layer mod 2`` (local/strided, block/summary).
    multihead: one group per part; for fixed with ``distinct_summaries``, group b instead takes
    the whole pattern with ``summary_block=b`` (``stride // c`` groups).
    Dense and local patterns have one part: every mode gives ``(spec,)``.
    """
    check_choice("mode", mode, MODES)
    parts = PARTS[spec.kind][1:] if spec.kind in PARTS else ()
    if not parts or mode == "merged":
        return (spec,)
    if mode == "interleaved":
        return (dataclasses.replace(spec, part=parts[layer % 2]),)
    if spec.kind == "fixed" and distinct_summaries:
        return tuple(dataclasses.replace(spec, part="both", summary_block=b)
                     for b in range(spec.stride // spec.c))
    return tuple(dataclasses.replace(spec, part=p) for p in parts)


def pattern_parts(kind: str, seq_len: int, **spec) -> dict[str, np.ndarray]:
    """The index arrays of a pattern's parts by name (one part for dense and local), as
    scripts/plot_pattern.py draws them."""
    if kind in ("dense", "local"):
        return {kind: pattern_indices(kind, seq_len, **spec)}
    names = PARTS[kind][1:]
    spec = {k: v for k, v in spec.items() if k != "part"}
    return {name: pattern_indices(kind, seq_len, part=name, **spec) for name in names}
