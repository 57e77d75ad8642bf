"""A pattern of your own: define a factorized attention pattern in a few lines and every path of
the library runs it (docs/custom_patterns.md).

* ``from_terms(*groups)``: each head group a tuple of block terms (``terms.BandTerm``,
  ``ColumnTerm``, ``SummaryTerm``) on one grid (their shared ``block``), disjoint;
* ``from_rule(allowed=..., block=...)`` or ``from_rule(keys=...)``: a rule over positions,
  ``allowed(q, k)`` on broadcastable integer arrays (a few array operations: it then also runs
  inside the Pallas kernels, as FlexAttention's ``mask_mod``) or ``keys(i)`` listing query
  ``i``'s keys. The rule is a function of positions alone: the pattern at length ``n`` is its
  first ``n`` rows. The library finds the block terms that cover part of it exactly (a sliding
  window or the own block, the strided column, summary residues) and serves the rest through a
  ``tileterm.TileTerm``: the tiles holding a kept pair, with an exact mask on partial tiles;
* ``heads(*patterns)``: head groups side by side (group g takes the g-th share of the heads).

The terms an author writes: ``window(width, block)``, ``own_block(block)``, ``columns(stride,
beyond=width)`` and ``summaries(block, residues)`` (``attention.terms``); the built-in strided
and fixed patterns are made of the same (``strided``, ``fixed`` below give their index arrays).

A definition is checked when it is made, on the first ``probe`` positions: the rule runs and
returns booleans of the broadcast shape, no key after its query, no query without a key, every
query keeps itself unless ``self_optional``, terms are disjoint and on one grid. A bad one is a
``ValueError`` of one line naming the pattern and what is wrong. A pattern is a ``Pattern``:
its groups are ``CustomSpec``, a ``PatternSpec`` that every attention function, the model and
the scripts take. ``load("module:name(k=v, ...)")`` resolves one named in a config.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
from collections.abc import Callable, Sequence

import numpy as np

from sparse_jax.attention.patterns import (
    PARTS,
    check_choice,
    check_int,
    compact,
    indices_to_mask,
    summary_residues,
)
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.attention.terms import (
    BandTerm,
    ColumnTerm,
    SummaryTerm,
    Term,
    columns,
    own_block,
    summaries,
    term_candidates,
    terms_to_indices,
    window,
)
from sparse_jax.attention.tileterm import TileTerm

PROBE = 1024  # positions a definition is checked on (at least 4 grid rows)


@dataclasses.dataclass(frozen=True)
class CustomSpec(PatternSpec):
    """One head group of a user pattern: ``parts``, disjoint terms on a grid of ``grid``
    positions per row; ``name`` says what it is (``str``, logs, the checkpoint)."""
    kind: str = "custom"
    name: str = ""
    grid: int = 1
    parts: tuple = ()

    def __post_init__(self):  # checked by from_terms / from_rule
        pass

    def indices(self, seq_len: int) -> np.ndarray:
        return terms_to_indices(self.parts, seq_len)

    def terms(self) -> tuple[Term, ...]:
        return self.parts

    @property
    def block(self) -> int:
        return self.grid

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A user pattern: ``groups``, the ``CustomSpec`` of each head group."""
    name: str
    groups: tuple[CustomSpec, ...]

    def indices(self, seq_len: int) -> list[np.ndarray]:
        return [g.indices(seq_len) for g in self.groups]

    def fingerprint(self, seq_len: int) -> str:
        """16 hex digits of the groups' index arrays at ``seq_len``: equal iff they are."""
        h = hashlib.sha256()
        for indices in self.indices(seq_len):
            h.update(np.ascontiguousarray(indices, np.int32).tobytes() + b"|")
        return h.hexdigest()[:16]

    def __str__(self) -> str:
        return self.name


def _fail(name: str, why: str):
    raise ValueError(f"pattern {name!r}: {why}")


def _check_mask(name: str, indices: np.ndarray, n: int, self_optional: bool,
                future: np.ndarray | None = None, empty_rows: bool = False):
    """One line for the first query with no key, or without itself; ``future`` a causal
    violation's (query, key) if any."""
    if future is not None:
        _fail(name, f"query {future[0]} keeps key {future[1]}, after it: a pattern is causal "
                    "(keep only keys j <= i)")
    counts = (indices >= 0).sum(1)
    if (counts == 0).any() and not empty_rows:
        _fail(name, f"query {int(np.argmin(counts))} keeps no key (of the first {n} "
                    "positions): every query needs one")
    if not self_optional:
        has_self = (indices == np.arange(n)[:, None]).any(1)
        if not has_self.all():
            _fail(name, f"query {int(np.argmin(has_self))} does not keep itself; keep it, or "
                        "say why not with self_optional=True")


def _check_terms(name: str, terms, probe: int) -> tuple[int, int]:
    """The grid block of ``terms`` and the probe length; one line if they are not block terms
    on one grid, or overlap."""
    if not terms:
        _fail(name, "a head group needs at least one term")
    kinds = (BandTerm, ColumnTerm, SummaryTerm, TileTerm)
    for t in terms:
        if not isinstance(t, kinds):
            _fail(name, f"{t!r} is not a BandTerm, ColumnTerm, SummaryTerm or TileTerm")
    grids = {t.stride if isinstance(t, ColumnTerm) else t.block for t in terms}
    if len(grids) != 1:
        _fail(name, f"its terms are on grids of {sorted(grids)} positions per row; give them "
                    "one block (stride)")
    block = grids.pop()
    n = max(probe, 4 * block)
    seen = np.zeros((n, n + 1), np.int32)
    for t in terms:
        keys = term_candidates(t, n)
        mask = np.zeros((n, n + 1), bool)
        np.put_along_axis(mask, np.where(keys < 0, n, keys), True, axis=1)
        seen += mask
    both = np.argwhere(seen[:, :n] > 1)
    if len(both):
        _fail(name, f"its terms overlap (query {both[0][0]}, key {both[0][1]} is in two): "
                    "give disjoint terms (a ColumnTerm's min_rows leaves out a band's keys)")
    return block, n


def from_terms(*groups: Sequence[Term], name: str = "custom", self_optional: bool = False,
               empty_rows: bool = False, probe: int = PROBE) -> Pattern:
    """A pattern whose head group g attends the union of the disjoint block terms
    ``groups[g]`` (all on one grid: a band's and summary's ``block``, a column's ``stride``).
    ``self_optional``/``empty_rows``: a query may leave itself out / keep no key (it then
    outputs zeros; the fixed pattern's summary part alone does)."""
    if not groups:
        _fail(name, "give at least one head group of terms")
    specs = []
    for g, terms in enumerate(groups):
        terms = tuple(terms) if isinstance(terms, (tuple, list)) else (terms,)
        block, n = _check_terms(name, terms, probe)
        spec = CustomSpec(name=name if len(groups) == 1 else f"{name}[{g}]", grid=block,
                          parts=terms)
        _check_mask(spec.name, spec.indices(n), n, self_optional, empty_rows=empty_rows)
        specs.append(spec)
    return Pattern(name, tuple(specs))


def strided(stride: int, local_width: int | None = None, part: str = "both") -> Pattern:
    """The paper's strided pattern as an author writes it: a window of ``local_width`` keys
    (default stride + 1) and every stride-th key beyond it (``PatternSpec("strided")``)."""
    check_choice("part", part, PARTS["strided"])
    width = stride + 1 if local_width is None else local_width
    terms = {"local": (window(width, stride),), "strided": (columns(stride),),
             "both": (window(width, stride), columns(stride, beyond=width))}[part]
    return from_terms(terms, name=f"strided({stride}, {width}, {part})")


def fixed(stride: int, c: int, part: str = "both", summary: str = "paper",
          summary_block: int = 0) -> Pattern:
    """The paper's fixed pattern as an author writes it: the own block and the summary
    residues of the earlier ones (``PatternSpec("fixed")``)."""
    check_choice("part", part, PARTS["fixed"])
    residues = summary_residues(stride, c, summary_block, summary)
    terms = {"block": (own_block(stride),),
             "summary": (own_block(stride, residues), summaries(stride, residues)),
             "both": (own_block(stride), summaries(stride, residues))}[part]
    return from_terms(terms, name=f"fixed({stride}, {c}, {part}, {summary}, {summary_block})",
                      self_optional=part == "summary", empty_rows=part == "summary")


# ---------------------------------------------------------------------------------------------
# A rule over positions.


def _keys_rule(keys: Callable, name: str) -> Callable:
    """``allowed(q, k)`` (NumPy) of a ``keys(i)`` rule, each query's list asked once."""
    cache: dict[int, np.ndarray] = {}

    def listed(i: int) -> np.ndarray:
        if i not in cache:
            try:
                got = np.asarray(list(keys(i)))
            except Exception as e:  # noqa: BLE001 - the user's rule, reported in one line
                _fail(name, f"keys({i}) raised {type(e).__name__}: {e}")
            if got.size and not np.issubdtype(got.dtype, np.integer):
                _fail(name, f"keys({i}) must give integer positions, got {got.dtype}")
            cache[i] = got.astype(np.int64).ravel()
        return cache[i]

    def allowed(q, k):
        q, k = np.broadcast_arrays(np.asarray(q), np.asarray(k))
        out = np.zeros(q.shape, bool)
        for i in np.unique(q):
            at = q == i
            out[at] = np.isin(k[at], listed(int(i)))
        return out

    return allowed


def _evaluate(rule: Callable, name: str, q, k) -> np.ndarray:
    """The rule on NumPy arrays, checked: it runs, and gives booleans of the broadcast shape."""
    try:
        out = rule(q, k)
    except ValueError as e:
        if str(e).startswith(f"pattern {name!r}"):
            raise
        _fail(name, f"the rule raised ValueError: {e}")
    except Exception as e:  # noqa: BLE001 - the user's rule, reported in one line
        _fail(name, f"the rule raised {type(e).__name__}: {e}")
    shape = np.broadcast_shapes(np.shape(q), np.shape(k))
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        _fail(name, f"the rule must return a boolean array, got {type(out).__name__}")
    if tuple(out.shape) != shape:
        _fail(name, f"the rule returned shape {tuple(out.shape)} for queries {np.shape(q)} and "
                    f"keys {np.shape(k)}; it must broadcast them, to {shape}")
    if out.dtype != bool:
        _fail(name, f"the rule must return booleans, got dtype {out.dtype}")
    return out


def _traceable(rule: Callable, expected: np.ndarray) -> bool:
    """Whether ``rule`` gives the same booleans on jax.numpy int32 arrays (it can then run inside
    a Pallas kernel)."""
    import jax.numpy as jnp

    n = expected.shape[0]
    try:
        got = rule(jnp.arange(n, dtype=jnp.int32)[:, None], jnp.arange(n, dtype=jnp.int32)[None])
        return bool(np.array_equal(np.asarray(got, bool), expected))
    except Exception:  # noqa: BLE001 - any failure: not traceable
        return False


def _run_length(mask: np.ndarray) -> int:
    """The widest window w such that every query keeps its w nearest keys (fewer at the start);
    ``len(mask)`` if every query keeps all its keys."""
    i = np.arange(len(mask))
    for d in range(len(mask)):
        if not mask[i[d:], i[d:] - d].all():
            return d
    return len(mask)


def _find_terms(mask: np.ndarray, block: int) -> tuple[Term, ...]:
    """Block terms inside the probe's ``mask`` (causal, [n, n]): a window or the own row, then
    the column of every ``block``-th key beyond it, then summary residues (own-row band only)."""
    n = len(mask)
    i = np.arange(n)
    terms = []
    w = _run_length(mask)
    own_row = all(mask[i[i % block >= d], i[i % block >= d] - d].all() for d in range(block))
    if own_row and w < block:
        terms.append(own_block(block))
        reach = 1
    elif 1 <= w <= n // 2:
        terms.append(window(w, block))
        reach = (w - 1) // block + 1
    else:
        return ()
    rows = n // block
    column = all(mask[i[i >= m * block], i[i >= m * block] - m * block].all()
                 for m in range(reach, rows))
    if column and rows > reach + 1:
        terms.append(ColumnTerm(block, min_rows=reach))  # columns(block, beyond=w)
    elif reach == 1 and terms[0].same_row:
        later = i[:, None] // block > i[None, :] // block  # keys of earlier rows
        kept = (mask | ~later).all(0)  # kept by every later query
        residues = tuple(int(r) for r in range(block)
                         if kept[r::block][:rows - 1].all())
        if residues:
            terms.append(summaries(block, residues))
    return tuple(terms)


def _union_rule(terms) -> Callable:
    """``covered(q, k)`` of block terms, on NumPy or jax.numpy arrays (``blocks.mask_rule``)."""
    from sparse_jax.attention import blocks

    class _Terms:
        kind = "custom"

        def terms(self):
            return terms

    return blocks.mask_rule(_Terms()) if terms else (lambda q, k: (q < 0) & (k < 0))


def from_rule(allowed: Callable | None = None, *, keys: Callable | None = None,
              block: int = 64, name: str = "rule", self_optional: bool = False,
              find_terms: bool = True, probe: int = PROBE) -> Pattern:
    """A one-group pattern from a rule over positions: ``allowed(q, k)`` or ``keys(i)`` (give
    one). ``block``: the grid's row (the tiles are ``block x block``). ``find_terms``: serve
    the parts block terms cover exactly by them (checked at each length served; False: every
    pair through the tiles). See the module docstring."""
    if (allowed is None) == (keys is None):
        _fail(name, "give one rule: allowed(q, k) or keys(i)")
    block = check_int("block", block)
    rule = allowed if allowed is not None else _keys_rule(keys, name)
    if not callable(rule):
        _fail(name, f"the rule must be a function, got {type(rule).__name__}")
    n = max(check_int("probe", probe), 4 * block)
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = _evaluate(rule, name, q, k)
    future = np.argwhere(mask & (k > q))
    kept = compact(np.where(mask, k, -1), n)
    _check_mask(name, kept, n, self_optional, future[0] if len(future) else None)
    traceable = allowed is not None and _traceable(rule, mask)
    found = _find_terms(mask, block) if find_terms else ()
    covered = _union_rule(found)

    def remainder(q, k):  # on the host (NumPy) checked, in a kernel (jnp) as it is
        host = isinstance(q, np.ndarray) and isinstance(k, np.ndarray)
        got = _evaluate(rule, name, q, k) if host else rule(q, k)
        if host:
            lost = covered(q, k) & ~got & (k <= q)
            if lost.any():
                at = np.argwhere(np.broadcast_to(lost, lost.shape))[0]
                qa, ka = np.broadcast_arrays(q, k)
                _fail(name, f"the block terms found on its first {n} positions do not hold at "
                            f"query {qa[tuple(at)]}, key {ka[tuple(at)]}; pass "
                            "find_terms=False")
        return got & ~covered(q, k)

    tiles = TileTerm(block, remainder, f"{name}:{_rule_id(rule, n)}", traceable)
    spec = CustomSpec(name=name, grid=block, parts=found + (tiles,))
    if not np.array_equal(indices_to_mask(spec.indices(n), n), mask & (k <= q)):
        _fail(name, "its terms do not rebuild the rule (a bug: please report it)")
    return Pattern(name, (spec,))


def _rule_id(rule: Callable, n: int) -> str:
    """A stable id of what a rule keeps on its probe (two rules keeping the same are one)."""
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    return hashlib.sha256(np.packbits(np.asarray(rule(q, k), bool)).tobytes()).hexdigest()[:12]


def heads(*patterns: Pattern, name: str | None = None) -> Pattern:
    """The head groups of ``patterns`` side by side."""
    for p in patterns:
        if not isinstance(p, Pattern):
            _fail(name or "heads", f"{p!r} is not a Pattern (from_terms, from_rule)")
    name = name or "+".join(p.name for p in patterns)
    return Pattern(name, tuple(g for p in patterns for g in p.groups))


# ---------------------------------------------------------------------------------------------
# Named from a config: "module:name" or "module:name(k=v, ...)".


def is_named(pattern: str) -> bool:
    """Whether a config's ``pattern`` names a user pattern (``module:name``)."""
    return isinstance(pattern, str) and ":" in pattern


def parse(pattern: str) -> tuple[str, str, dict]:
    """``(module, name, params)`` of ``"module:name(k=v, ...)"`` (literal values; ``;`` may
    separate them instead of ``,``, as a comma-separated flag needs)."""
    head, _, args = pattern.partition("(")
    module, _, name = head.strip().partition(":")
    if not module or not name.isidentifier():
        raise ValueError(f"pattern {pattern!r}: name a user pattern as module:name or "
                         "module:name(k=v, ...), e.g. my_patterns:longformer(window=256)")
    params = {}
    if args:  # ";" separates parameters too (in comma-separated lists of patterns)
        try:
            call = ast.parse(f"f({args.replace(';', ',')}", mode="eval").body
            params = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
            if call.args or None in params:
                raise ValueError
        except (SyntaxError, ValueError):
            raise ValueError(f"pattern {pattern!r}: parameters must be k=v with literal values, "
                             "e.g. my_patterns:longformer(window=256, globals=4)") from None
    return module, name, params


def load(pattern: str) -> Pattern:
    """The ``Pattern`` a config names: attribute ``name`` of ``module`` (importable: on the
    path), a ``Pattern`` or a function returning one (called with the parameters)."""
    module, name, params = parse(pattern)
    try:
        found = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"pattern {pattern!r}: cannot import module {module!r} ({e}); put "
                         "its directory on PYTHONPATH") from None
    if not hasattr(found, name):
        raise ValueError(f"pattern {pattern!r}: module {module!r} has no {name!r}")
    made = getattr(found, name)
    if callable(made) and not isinstance(made, Pattern):
        try:
            made = made(**params)
        except TypeError as e:
            raise ValueError(f"pattern {pattern!r}: {module}.{name} does not take these "
                             f"parameters: {e}") from None
    elif params:
        raise ValueError(f"pattern {pattern!r}: {module}.{name} is a Pattern, not a function "
                         "of parameters")
    if not isinstance(made, Pattern):
        raise ValueError(f"pattern {pattern!r}: {module}.{name} gives "
                         f"{type(made).__name__}, not a Pattern (from_terms, from_rule)")
    return made
