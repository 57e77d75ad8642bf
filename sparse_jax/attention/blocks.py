"""A Pallas block-sparse flash-attention kernel for the patterns' block terms.

``attention.sparse_attention(..., implementation="pallas")`` runs here; the XLA path in
``attention.py`` and this kernel compute the same thing, term by term, and merge the terms with
the same joint log-sum-exp. Each block term of ``pattern_terms`` becomes masked
attention between a query sequence and a key sequence in the term's own layout, so that its keys
are a few contiguous blocks per query block:

* ``BandTerm`` (local window, fixed block): the sequence in its own order;
* ``ColumnTerm`` (the strided part): the sequence read column by column of the ``[rows, stride]``
  grid ("strided transpose"), where a column is a contiguous run of ``rows`` positions and the
  strided part becomes causal attention inside each run;
* ``SummaryTerm``: queries in order, keys the summary positions alone, packed.

Every layout position carries two integers, its position ``pos`` and a segment ``seg`` (a grid
row, or a grid column), and a key carries a flag (a summary residue, for a band with residues).
A key is kept iff ``q.pos - k.pos`` and ``q.seg - k.seg`` lie in the term's two ranges and the key
is flagged (``keep_rule``). The host evaluates that rule on every block pair that can hold a kept
key (NumPy, once per shape) and lists, per query block, the key blocks that hold kept keys, split
into *partial* blocks (the kernel applies the rule in the block) and *full* ones (no mask); per
key block the same for the backward pass (``block_lists``).

The kernels (``sparse_jax.attention.pallas``) are flash attention over those lists: an online
softmax with float32 accumulators returning each term's output and log-sum-exp, merged here; the
backward from the saved joint log-sum-exp, a pass per query block for dq and a pass per key block
for dk and dv (FlashAttention-2's split). Inputs are float32, bfloat16 or float16; products
accumulate in float32. On a GPU they lower through Triton (tiles are powers of two: head dims
are zero-padded to one, lengths to the tile), on a TPU through Mosaic (lists prefetched into
scalar memory, 512 × 512 tiles, band kernels where they suit), and on a CPU they run in Pallas
interpret mode, slowly, for tests. ``BlockSizes.variant="chained"`` (GPU) instead keeps every
array in sequence order (the column term's tiles read with strided loads) and chains the terms:
each kernel resumes from the previous term's partial output or gradients and the last writes
the input dtype, so XLA neither transposes nor merges. Each kernel is one custom call that XLA
cannot split over devices: on a mesh, ``layers.SparseSelfAttention`` runs it inside
``shard_map``. Design: docs/design.md §3.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax.numpy as jnp
import numpy as np

from sparse_jax.attention import gathered_plan, pallas, pallas_onepass, patterns
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.attention.terms import ColumnTerm, SummaryTerm, Term
from sparse_jax.attention.tiles import BACKENDS

_FAR = 1 << 29  # segment of padding: queries get no key, keys reach no query (int32 safe)
_MASK_TILES = 1 << 24  # tile-mask elements the host evaluates at once when listing blocks

VARIANTS = ("terms", "chained", "onepass")  # BlockSizes.variant: how the terms' kernels combine
WARPS = (1, 2, 4, 8, 16, 32)  # BlockSizes.num_warps that Triton takes (32 warps: 1,024 threads)
_BAND_LIMIT = (1024, 8)  # a band kernel's most window keys per own block, and distinct masks
_OPTION_NAMES = {"block_q": "the tiles", "variant": "the variant", "band": "the band tile",
                 "summary_q": "the summary tiles", "dkv": "dkv", "num_warps": "the warps",
                 "heads_per_program": "the heads per program", "num_stages": "the stages"}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Kernel tiles: ``block_q`` queries by ``block_k`` keys (powers of two; at least 16 on a
    GPU, multiples of 128 on a TPU), Triton's ``num_warps`` and ``num_stages``, how the terms'
    kernels are combined (``variant``) and how many heads a GPU program, or a TPU grid step,
    serves (``heads_per_program``). Hashable: a static argument. Defaults: ``for_backend``.

    ``variant``: "terms" (each term's kernels in the term's own layout, float32 outputs merged
    by log-sum-exp in XLA; both backends), "chained" (Triton only: every kernel reads and
    writes the sequence-order arrays, the column term with strided loads; each term's kernel
    resumes from the previous terms' float32 partial result and the last writes the final
    output and gradients in the input dtype: no transposes and no merges in XLA) or "onepass"
    (chained on persistent grids, a backward kernel a term: ``attention.pallas_onepass``).
    ``heads_per_program``: a power of two dividing the head count; a program (on a TPU, a grid
    step) walks its block list once for all its heads. ``one_loop``: a GPU program walks its
    partial and full blocks in one loop, masking every block, which Triton can pipeline (two
    loops of one or two blocks each, as at l = 128, give it nothing to overlap).
    ``band`` (Mosaic only; 0: off): a term whose key blocks of ``band`` rows lie in a narrow
    band around each query block (the strided pattern's row term, and its column term while
    n ≤ l²) runs the band kernels (``pallas.band_forward``) where they score fewer
    pairs than the tiles would: each query block of ``band`` rows takes its whole window of key
    blocks at once, and a grid step serves ``band_group`` query blocks (key blocks in the
    backward's key pass), fewer where the sequence is short. ``summary_q`` × ``summary_k``
    (0: the tiles): the fixed pattern's summary term's own tiles, whose keys are packed (its
    own array), so that its query tiles can be larger than the band term's."""
    block_q: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2
    variant: str = "terms"
    heads_per_program: int = 1
    one_loop: bool = False
    band: int = 0
    band_group: int = 16
    summary_q: int = 0
    summary_k: int = 0
    gathered: bool = False  # the fixed pattern's gathered kernels (gathered_plan.option)
    dkv: tuple[int, int, int] = (0, 0, 0)  # gathered: its dk/dv program's tiles and warps
    atomic_dq: bool = False  # onepass, gathered: dq added atomically (option atomic)

    @staticmethod
    def for_backend(backend: str) -> BlockSizes:
        """64 × 64 for Triton; for Mosaic 512 × 512 tiles (splash attention's blocks; multiples
        of a TPU's 128 lanes) and band kernels on 128-row blocks, 16 a grid step, for the terms
        they suit. Against 128 × 128 tiles alone, libtpu's static cycles for a v5p at 16k
        (fwd+bwd, bounded by the tiles' MXU work) fall 3.2x for strided (l = 128) and 8.1x for
        fixed (l = 128, c = 32): a grid step's fixed cost paid over a larger tile, or over 16
        small blocks that score half the pairs (docs/tpu_compile.md)."""
        return BlockSizes() if backend == "triton" else BlockSizes(512, 512, band=128)

    @staticmethod
    def parse(options: str, default: BlockSizes | None = None) -> BlockSizes:
        """From ``:``-separated options, the others ``default``'s (None: ``BlockSizes()``, the
        GPU's) (a config or benchmark string): ``QxK`` tiles, a variant, ``hG`` heads per
        program, ``wN`` warps, ``sN`` stages, ``one_loop``, ``bandTxG`` band kernels on blocks
        of T rows, G a grid step (``band0``: none), ``sumQxK`` the summary term's tiles,
        ``gathered``, ``dkvQxK[wN]`` (``gathered_plan.option``), ``atomic``
        (``pallas_onepass.option``); e.g. "64x64:chained:h2", "512x512:band128x4",
        "chained:gathered:dkv128x128w8". An option given twice, or two that set the same thing
        ("terms:chained", "h2:h4"), is refused (ValueError), not resolved by order."""
        fields, given = {}, {}  # given: which option set each field
        for option in options.split(":"):
            if re.fullmatch(r"\d+x\d+", option):
                names, values = ("block_q", "block_k"), tuple(map(int, option.split("x")))
            elif option in VARIANTS:
                names, values = ("variant",), (option,)
            elif option == "one_loop":
                names, values = ("one_loop",), (True,)
            elif re.fullmatch(r"band0|band\d+x\d+", option):
                names = ("band", "band_group")
                values = (0, 16) if option == "band0" else tuple(map(int, option[4:].split("x")))
            elif re.fullmatch(r"sum\d+x\d+", option):
                names, values = ("summary_q", "summary_k"), tuple(map(int, option[3:].split("x")))
            elif re.fullmatch(r"[hws]\d+", option):
                names = ({"h": "heads_per_program", "w": "num_warps", "s": "num_stages"}[
                    option[0]],)
                values = (int(option[1:]),)
            else:  # the onepass or gathered kernels' options, or an unknown one (ValueError)
                names, values = pallas_onepass.option(option) or gathered_plan.option(
                    option, options)
            if names[0] in given:
                first = given[names[0]]
                what = f"{option!r} is given twice" if first == option else \
                    f"{first!r} and {option!r} both set {_OPTION_NAMES[names[0]]}"
                raise ValueError(f"kernel options {options!r}: {what}; give each option once")
            for name, value in zip(names, values):
                fields[name], given[name] = value, option
        return dataclasses.replace(default or BlockSizes(), **fields)

    def __post_init__(self):
        for name in ("block_q", "block_k", "heads_per_program"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 \
                    or value & (value - 1):
                option = "hG" if name == "heads_per_program" else "QxK"
                raise ValueError(f"BlockSizes.{name}={value} (option {option}) must be a power "
                                 "of two")
        if isinstance(self.num_warps, bool) or self.num_warps not in WARPS:
            raise ValueError(f"BlockSizes.num_warps={self.num_warps} (option w{self.num_warps}) "
                             f"must be a power of two from 1 to {WARPS[-1]}: Triton's warps "
                             "per program")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) \
                or self.num_stages < 1:
            raise ValueError(f"BlockSizes.num_stages={self.num_stages} (option "
                             f"s{self.num_stages}) must be at least 1: Triton's pipeline "
                             "stages (1: no pipelining)")
        patterns.check_choice("BlockSizes.variant", self.variant, VARIANTS)
        gathered_plan.check_options(self)
        pallas_onepass.check_options(self)
        for name in ("summary_q", "summary_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 \
                    or value & (value - 1) or (value == 0) != (self.summary_q == 0):
                raise ValueError(f"BlockSizes.{name}={value} (option sumQxK) must be a power "
                                 "of two, or 0 with the other (the tiles)")
        for name in ("band", "band_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 \
                    or value & (value - 1) or (name == "band_group" and value < 1):
                raise ValueError(f"BlockSizes.{name}={value} (option bandTxG) must be a power "
                                 f"of two{' or 0' if name == 'band' else ''}")

    def check_backend(self, backend: str, tiles: bool = True) -> None:
        """ValueError (one line) for options ``backend`` ("triton" or "mosaic") cannot compile:
        the variant and ``one_loop`` are Triton's, and (``tiles``)
        Triton's tiles are at least 16 (its smallest matrix product), Mosaic's multiples of 128
        (a TPU's vector lanes). Interpret mode runs any tiles (tests use small ones), so
        ``compiler_for`` checks tiles only where the kernels compile."""
        patterns.check_choice("backend", backend, BACKENDS)
        size = f"{self.block_q}x{self.block_k}"
        if tiles and self.summary_q and not (
                min(self.summary_q, self.summary_k) >= 16 if backend == "triton"
                else self.summary_q % 128 == 0 == self.summary_k % 128):
            raise ValueError(f"summary tiles {self.summary_q}x{self.summary_k} (option sumQxK): "
                             "Triton needs at least 16 x 16, Mosaic multiples of 128")
        if tiles and backend == "triton" and min(self.block_q, self.block_k) < 16:
            raise ValueError(f"kernel tiles {size}: Triton needs at least 16 queries and 16 keys "
                             "per tile (e.g. 16x16, 64x64, the default)")
        if tiles and backend == "mosaic" and (self.block_q % 128 or self.block_k % 128):
            raise ValueError(f"kernel tiles {size}: Mosaic (a TPU) needs multiples of 128 "
                             "(e.g. 128x128, or 512x512, the default)")
        if backend != "triton" and (self.variant != "terms" or self.one_loop):
            raise ValueError(f"BlockSizes(variant={self.variant!r}, one_loop={self.one_loop}) "
                             f"needs the triton backend (a GPU), not {backend}")
        if backend == "triton" and self.band:
            raise ValueError(f"BlockSizes(band={self.band}) (option band{self.band}x"
                             f"{self.band_group}) needs the mosaic backend (a TPU), not triton; "
                             "give band0 or leave it out")
        if tiles and backend == "mosaic" and self.band % 128:
            raise ValueError(f"kernel option band{self.band}x{self.band_group}: Mosaic (a TPU) "
                             "needs band blocks of a multiple of 128 rows (band128x16, the "
                             "default, or band0: none)")


# ---------------------------------------------------------------------------------------------
# A term in its layout.


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One term as masked attention of ``nq`` queries over ``nk`` keys, for a grid of ``n``
    positions (``rows`` rows of ``block``). ``kind``: "rows" (the sequence order), "columns"
    (column by column) or "summary" (queries in order, keys the residues of every row).
    ``distance`` and ``segments``: inclusive ranges (None: unbounded) of ``q.pos - k.pos`` and
    ``q.seg - k.seg``; ``residues``: the flagged keys' offsets in their row (None: all)."""
    kind: str
    rows: int
    block: int
    distance: tuple[int | None, int | None]
    segments: tuple[int, int | None]
    residues: tuple[int, ...] | None = None

    @property
    def n(self) -> int:
        return self.rows * self.block

    @property
    def nk(self) -> int:
        return self.rows * len(self.residues) if self.kind == "summary" else self.n

    def attributes(self):
        """NumPy ``(q_pos, q_seg), (k_pos, k_seg, k_flag)`` of the real positions (int64)."""
        i = np.arange(self.n)
        if self.kind == "columns":  # position r * block + col sits at col * rows + r
            pos, seg = i % self.rows, i // self.rows
            return (pos, seg), (pos, seg, np.ones(self.n, bool))
        q = (i, i // self.block)
        if self.kind == "summary":
            keys = (np.arange(self.rows)[:, None] * self.block + np.array(self.residues)).ravel()
            return q, (keys, keys // self.block, np.ones(len(keys), bool))
        flag = np.ones(self.n, bool) if self.residues is None else np.isin(
            i % self.block, self.residues)
        return q, (i, i // self.block, flag)

    def _grid(self, x, axis=2):  # [B, H, n, ...] -> [B, H, rows, block, ...] (n on axis)
        return x.reshape(*x.shape[:axis], self.rows, self.block, *x.shape[axis + 1:])

    def _flat(self, x, axis=2):
        return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])

    def queries(self, x):
        """[B, H, n, ...] in sequence order -> the query layout."""
        return self._flat(self._grid(x).swapaxes(2, 3)) if self.kind == "columns" else x

    def queries_back(self, x):
        """Inverse of ``queries``."""
        if self.kind != "columns":
            return x
        t = x.reshape(*x.shape[:2], self.block, self.rows, *x.shape[3:])
        return self._flat(t.swapaxes(2, 3))

    def keys(self, x, axis=2):
        """[B, H, n, ...] in sequence order -> the key layout (summary keys: the length on
        ``axis``, e.g. 1 for [B, n, H, ...])."""
        if self.kind == "summary":
            return self._flat(jnp.take(self._grid(x, axis), np.array(self.residues),
                                       axis=axis + 1), axis)
        return self.queries(x)

    def keys_back(self, g, axis=2):
        """Gradient in the key layout -> [B, H, n, ...] in sequence order (zeros elsewhere)."""
        if self.kind != "summary":
            return self.queries_back(g)
        g = g.reshape(*g.shape[:axis], self.rows, len(self.residues), *g.shape[axis + 1:])
        full = jnp.zeros((*g.shape[:axis + 1], self.block, *g.shape[axis + 2:]), g.dtype)
        index = (slice(None),) * (axis + 1) + (np.array(self.residues),)
        return self._flat(full.at[index].set(g), axis)


def term_layout(term: Term, rows: int) -> _Layout:
    if isinstance(term, ColumnTerm):
        return _Layout("columns", rows, term.stride, (term.min_rows, None), (0, 0))
    if isinstance(term, SummaryTerm):
        return _Layout("summary", rows, term.block, (None, None), (1, None), term.residues)
    return _Layout("rows", rows, term.block, (0, term.max_distance), (0, term.prev),
                   term.residues)


def keep_rule(layout: _Layout, q_pos, q_seg, k_pos, k_seg, k_flag):
    """The term's mask on broadcastable position arrays (NumPy on the host, jnp in a kernel)."""
    seg = q_seg - k_seg
    keep = (seg >= layout.segments[0]) & (k_flag != 0)
    if layout.segments[1] is not None:
        keep = keep & (seg <= layout.segments[1])
    lo, hi = layout.distance
    if lo is not None or hi is not None:
        distance = q_pos - k_pos
        keep = keep & (distance >= lo) if lo is not None else keep
        keep = keep & (distance <= hi) if hi is not None else keep
    return keep


def _in_residues(offset, residues):
    """Whether ``offset`` is one of ``residues`` (None: all), with comparisons alone."""
    if residues is None:
        return offset >= 0
    lo, hi = min(residues), max(residues)
    if len(residues) == hi - lo + 1:  # a run of residues (the paper's summary): two compares
        return (offset >= lo) & (offset <= hi)
    flag = offset < 0  # all False, of offset's kind
    for r in residues:
        flag = flag | (offset == r)
    return flag


def mask_rule(spec: PatternSpec):
    """``keep(q, k)``: whether query position q attends key position k under ``spec``, on
    broadcastable integer arrays of any library with ``//``, ``%``, comparisons, ``&`` and
    ``|`` (NumPy, jax.numpy, torch; scalars too). The union of the terms' rules (``keep_rule``)
    in sequence coordinates: what the kernel's block lists keep, and what FlexAttention's
    ``mask_mod`` needs to attend with the same pattern. Equals ``spec.mask(n)``."""
    if spec.kind == "dense":
        return lambda q, k: k <= q
    layouts = [term_layout(term, 1) for term in spec.terms()]

    def keep(q, k):
        out = None
        for layout in layouts:
            b = layout.block
            if layout.kind == "columns":  # (row, column) of the [rows, block] grid
                kept = keep_rule(layout, q // b, q % b, k // b, k % b, k >= 0)
            else:
                kept = keep_rule(layout, q, q // b, k, k // b, _in_residues(k % b, layout.residues))
            out = kept if out is None else out | kept
        return out

    return keep


# ---------------------------------------------------------------------------------------------
# Block lists (host, NumPy).


def _pack(owner: np.ndarray, other: np.ndarray, full: np.ndarray, count: int) -> np.ndarray:
    """Rows ``[n_partial, n_full, partial..., full...]`` of each owner block (pairs sorted)."""
    order = np.lexsort((other, full, owner))  # by owner, partial before full, then block
    owner, other, full = owner[order], other[order], full[order]
    per = np.bincount(owner, minlength=count)
    width = 2 + int(per.max(initial=0))
    rows = np.zeros((count, width), np.int32)
    rows[:, 0] = np.bincount(owner, weights=~full, minlength=count)
    rows[:, 1] = np.bincount(owner, weights=full, minlength=count)
    slot = np.arange(len(owner)) - np.concatenate([[0], np.cumsum(per)[:-1]])[owner]
    rows[owner, 2 + slot] = other
    return rows


def _ranges_meet(a, b, lo, hi):
    """Whether ``x - y`` for x in [a_min, a_max], y in [b_min, b_max] can lie in [lo, hi]
    (a = (min, max) per query block [nqb, 1], b per key block [1, nkb])."""
    meet = np.ones(np.broadcast_shapes(a[0].shape, b[0].shape), bool)
    if lo is not None:
        meet &= a[1] - b[0] >= lo
    if hi is not None:
        meet &= a[0] - b[1] <= hi
    return meet


def _padded_attributes(layout: _Layout, nq: int, nk: int):
    """``layout.attributes()`` padded to ``nq`` queries and ``nk`` keys: padding queries reach
    no key and padding keys no query (segments ``_FAR`` apart, keys unflagged)."""
    (q_pos, q_seg), (k_pos, k_seg, k_flag) = layout.attributes()

    padded = lambda x, size, fill: np.concatenate(  # noqa: E731
        [x, np.full(size - len(x), fill, x.dtype)])
    return ((padded(q_pos, nq, 0), padded(q_seg, nq, -_FAR)),
            (padded(k_pos, nk, 0), padded(k_seg, nk, _FAR), padded(k_flag, nk, False)))


@functools.lru_cache(maxsize=64)
def block_lists(layout: _Layout, block_q: int, block_k: int):
    """``(pallas.Lists, kept, scored)``: the lists, the kept (query, key) pairs and the
    pairs in the listed tiles."""
    nqb, nkb = -(-layout.n // block_q), -(-layout.nk // block_k)
    (qp, qs), (kp, ks, kf) = _padded_attributes(layout, nqb * block_q, nkb * block_k)

    def bounds(x, real, blocks, size):  # (min, max) of each block's real entries
        x, real = x.reshape(blocks, size), real.reshape(blocks, size)
        return np.where(real, x, 1 << 40).min(1), np.where(real, x, -1 << 40).max(1)

    q_real = np.arange(nqb * block_q) < layout.n
    k_real = kf  # unflagged keys are never kept
    q_b = [tuple(a[:, None] for a in bounds(x, q_real, nqb, block_q)) for x in (qp, qs)]
    k_b = [tuple(a[None, :] for a in bounds(x, k_real, nkb, block_k)) for x in (kp, ks)]
    candidates = (_ranges_meet(q_b[0], k_b[0], *layout.distance)
                  & _ranges_meet(q_b[1], k_b[1], *layout.segments)
                  & k_real.reshape(nkb, block_k).any(1)[None, :])
    qb, kb = np.nonzero(candidates)
    counts = np.zeros(len(qb), np.int64)
    step = max(1, _MASK_TILES // (block_q * block_k))
    tiles = lambda x, b, size: x.reshape(-1, size)[b]  # noqa: E731
    for s in range(0, len(qb), step):
        q, k = qb[s:s + step], kb[s:s + step]
        keep = keep_rule(layout, tiles(qp, q, block_q)[:, :, None],
                         tiles(qs, q, block_q)[:, :, None], tiles(kp, k, block_k)[:, None, :],
                         tiles(ks, k, block_k)[:, None, :], tiles(kf, k, block_k)[:, None, :])
        counts[s:s + step] = keep.sum((1, 2))
    nonempty = counts > 0
    qb, kb, counts = qb[nonempty], kb[nonempty], counts[nonempty]
    full = counts == block_q * block_k
    column, row = (lambda x: x.astype(np.int32)[:, None]), (lambda x: x.astype(np.int32)[None])
    lists = pallas.Lists(_pack(qb, kb, full, nqb), _pack(kb, qb, full, nkb),
                                 (column(qp), column(qs)), (row(kp), row(ks), row(kf)))
    return lists, int(counts.sum()), len(qb) * block_q * block_k


def _band_masks(layout: _Layout, tile: int, width: int, nb: int, starts: np.ndarray,
                key_side: bool):
    """Distinct masks of own blocks against their windows (``starts``: each own block's first
    window block), as (table [M, tile, width * tile] int32: own rows by window columns, own
    keys by window queries for ``key_side``; index per own block)."""
    (qp, qs), (kp, ks, kf) = _padded_attributes(layout, nb * tile, nb * tile)
    own = np.arange(tile)
    near = starts[:, None] * tile + np.arange(width * tile)[None]
    table, index = {}, np.zeros(nb, np.int32)
    for first in range(0, nb, 256):
        blocks = np.arange(first, min(nb, first + 256))
        mine = blocks[:, None] * tile + own[None]  # [b, tile]
        window = near[blocks]  # [b, width * tile]
        qi, ki = (window, mine) if key_side else (mine, window)
        keep = keep_rule(layout, qp[qi][:, :, None], qs[qi][:, :, None], kp[ki][:, None, :],
                     ks[ki][:, None, :], kf[ki][:, None, :])
        keep = keep.swapaxes(1, 2) if key_side else keep
        for b, m in zip(blocks, keep):
            index[b] = table.setdefault(np.packbits(m).tobytes(), len(table))
            if len(table) > _BAND_LIMIT[1]:
                return None
    shape = (tile, width * tile)
    masks = np.stack([np.unpackbits(np.frombuffer(key, np.uint8))[:shape[0] * shape[1]]
                      .reshape(shape) for key in table]).astype(np.int32)
    return masks, index


def _band_pass(layout, tile, lo, hi, nb, group, key_side):
    """``pallas.Band`` of one pass: own blocks (queries, or keys if ``key_side``) whose
    partners lie in blocks ``own + lo .. own + hi``; None if its masks are too many."""
    width = hi - lo + 1
    steps = nb // group
    start = lambda first, span: np.clip(first, 0, nb - span)  # noqa: E731
    step_starts = start(np.arange(steps) * group + lo, group + width - 1)
    own_starts = start(np.arange(nb) + lo, width)
    masks = _band_masks(layout, tile, width, nb, own_starts, key_side)
    if masks is None:
        return None
    relative = own_starts - np.repeat(step_starts, group)
    meta = np.concatenate([step_starts, relative, masks[1]]).astype(np.int32)
    return pallas.Band(tile, width, group, meta, masks[0])


@functools.lru_cache(maxsize=64)
def band_plan(layout: _Layout, tile: int, group: int, block_q: int, block_k: int):
    """The band kernels' plan of a term: (padded length, query-side and key-side ``Band``s), or
    None where the term is no narrow band (summary keys, a window wider than ``_BAND_LIMIT``,
    too many distinct masks) or where the band kernels would score more pairs than ``block_q``
    × ``block_k`` tiles. A grid step serves ``group`` blocks, or fewer where the sequence is
    shorter than a step's window."""
    if layout.kind == "summary":
        return None
    table = block_lists(layout, tile, tile)[0].forward  # [n_partial, n_full, blocks...]
    listed = np.arange(table.shape[1] - 2)[None] < (table[:, 0] + table[:, 1])[:, None]
    if not listed.any():
        return None
    offsets = table[:, 2:][listed] - np.nonzero(listed)[0]  # key block - query block
    lo, hi = int(offsets.min()), int(offsets.max())
    width, blocks = hi - lo + 1, -(-layout.n // tile)
    while group > 1 and (group > blocks or -(-blocks // group) * group < group + width - 1):
        group //= 2
    nb = -(-blocks // group) * group
    if width * tile > _BAND_LIMIT[0] or nb < group + width - 1:
        return None
    if nb * tile * width * tile > block_lists(layout, block_q, block_k)[2]:
        return None
    query_side = _band_pass(layout, tile, lo, hi, nb, group, False)
    key_side = _band_pass(layout, tile, -hi, -lo, nb, group, True)
    if query_side is None or key_side is None:
        return None
    return nb * tile, query_side, key_side

