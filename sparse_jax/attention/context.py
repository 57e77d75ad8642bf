"""Context parallelism: one sequence split over the devices of a mesh axis, attention exact.

``context_attention(q, k, v, spec, axis="seq")`` runs inside ``jax.shard_map``: q, k, v
``[B, n/P, H, d]`` are this device's contiguous shard of the sequence along mesh axis ``axis``
(P devices, shard ``jax.lax.axis_index(axis)``), and the result is this shard's rows of
``sparse_attention(q, k, v, spec)`` over the whole sequence. ``context_parallel_attention`` takes
global arrays and a mesh and runs the ``shard_map``. This module is the one place that knows how
each pattern's keys cross shard boundaries:

* a **band** term (local window, fixed block) needs only a **halo**: the last ``prev`` grid rows
  of keys and values of the previous shard (one ``ppermute``; shard 0 gets none). The fixed
  block (``prev = 0``) needs nothing.
* a **column** term (the strided part) runs **residue-sharded**: an ``all_to_all`` gives each
  device ``l/P`` whole columns of the ``[n/l, l]`` grid (every position of its residues, which
  needs ``P | l``), the column attention runs there locally, and a second ``all_to_all`` brings
  the output and its log-sum-exp back.
* a **summary** term (fixed): the summary keys within the shard are the grid's summary term on
  the shard; those of earlier shards (``n·c/l`` keys in all) come by an ``all_gather``.
* **dense**: a ring, P - 1 ``ppermute`` steps passing K/V blocks on; a block from a later shard
  is skipped (``lax.cond``), the one from this shard is causal.

Each part gives an output and its log-sum-exp, merged as ``attention`` merges its terms (one
joint softmax). The parts run the XLA path's (or the fused CPU kernels') term computations of
``attention`` on local data, or with ``implementation="pallas"`` the Pallas kernels of
``kernel`` (its "terms" variant) for the band, own-shard summary and column terms
(``_pallas_forward``, ``_pallas_backward``: the grid layout in and out, as ``attention``'s grid
functions). Forward and backward are a ``custom_vjp``: the backward recomputes each part's
probabilities from the merged log-sum-exp (``attention``'s flash-style backward on
the same local data) and sends the key gradients back the way the keys came (the transposes of
the collectives: halo gradients to the previous shard, ``all_to_all`` back, a ``psum_scatter``
of the summary keys' gradients, the ring's key gradients travelling with their keys).

Heads go a group at a time (``shards._over_heads``), so one group's column layout and gradients are
alive at once. ``communication_bytes`` counts what each device sends per layer (forward, and
what the backward adds), ``planned_memory`` reads XLA's per-device plan of a compiled forward +
backward, ``cost_rows`` tabulates both (``scripts/context_parallel.py``). The term computations
are ``attention``'s own (``grid_forward``, ``grid_backward``): a change there changes
both paths, and the tests compare them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from sparse_jax.attention import api, fused, patterns, reference, shards
from sparse_jax.attention.blocks import BlockSizes
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.attention.terms import BandTerm, ColumnTerm, SummaryTerm, TileTerm

IMPLEMENTATIONS = ("xla", "native", "pallas", "auto")


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """How a sparse pattern's terms are split over ``devices`` shards of ``rows`` grid rows of
    ``block`` positions each: the terms on the shard's own grid (with ``halo`` rows of the
    previous shard before it), the column terms (residue-sharded: ``block / devices`` columns
    per device) and the summary residues whose keys of earlier shards are gathered."""
    block: int
    devices: int
    local: tuple = ()
    halo: int = 0
    columns: tuple = ()
    summary: tuple[int, ...] | None = None


def split_plan(spec: PatternSpec, n: int, devices: int) -> SplitPlan:
    """The split of ``spec`` over ``devices`` shards of a sequence of ``n``; a ValueError in one
    line if the split does not fit the pattern."""
    block = spec.block
    if n % devices or (n // devices) % block:
        raise ValueError(f"context parallelism over {devices} devices needs n/P a multiple of "
                         f"{spec}'s block {block}; got n={n}")
    rows = n // devices // block
    terms = spec.terms()
    local = tuple(t for t in terms if not isinstance(t, ColumnTerm))
    halo = max((t.prev for t in local if isinstance(t, BandTerm)), default=0)
    if halo > rows:
        raise ValueError(f"{spec}'s window reaches {halo} rows of {block} back, more than one "
                         f"shard's {rows} rows (n={n}, P={devices}): use fewer devices")
    columns = tuple(ColumnTerm(block // devices, t.min_rows) for t in terms
                    if isinstance(t, ColumnTerm))
    if columns and block % devices:
        raise ValueError(f"{spec}'s column term splits its {block} residues over the devices: "
                         f"P={devices} must divide the stride {block}")
    summaries = [t.residues for t in terms if isinstance(t, SummaryTerm)]
    assert len(summaries) <= 1 and not (summaries and halo), terms
    return SplitPlan(block, devices, local, halo if devices > 1 else 0,
                 columns, summaries[0] if summaries and devices > 1 else None)


def check_split(spec: PatternSpec, n: int, devices: int) -> None:
    """ValueError (one line) unless a sequence of ``n`` splits over ``devices`` for ``spec``:
    P | n, and for a sparse pattern n/P a multiple of its block, P | l for a column term, a
    window no longer than a shard."""
    n = patterns.check_int("n", n)
    devices = patterns.check_int("devices", devices)
    if n % devices:
        raise ValueError(f"context parallelism over {devices} devices needs P | n; got n={n}")
    if spec.kind != "dense" and any(isinstance(t, TileTerm) for t in spec.terms()):
        raise ValueError(f"context parallelism does not split the tiles of pattern {spec} (a "
                         "rule's keys beyond its block terms) over devices; train it with "
                         "mesh.seq=1")
    if spec.kind != "dense":
        split_plan(spec, n, devices)


def check_model_split(specs, seq_len: int, devices: int) -> None:
    """ValueError (one line, ``check_split``'s) unless a model whose layers attend with
    ``specs`` (one entry a layer: a tuple of PatternSpecs, one per head group, or a PatternSpec)
    can split a sequence of ``seq_len`` over ``devices``: every distinct pattern must."""
    distinct = {}
    for layer in specs:
        for spec in (tuple(layer) if isinstance(layer, (tuple, list)) else (layer,)):
            if not isinstance(spec, PatternSpec):
                raise ValueError(f"specs must hold tuples of PatternSpecs (one a layer), got "
                                 f"{spec!r}")
            distinct.setdefault(spec, None)
    for spec in distinct:
        check_split(spec, seq_len, devices)


# ---------------------------------------------------------------------------------------------
# Entry points.


def _how(implementation: str, block_sizes=None):
    """How the sparse parts run, for ``implementation`` ("auto" as
    ``api.resolve_implementation``: the Pallas kernels on a GPU or TPU, the fused CPU
    kernels on a CPU where they build, else XLA): False (XLA), True (the fused CPU kernels) or
    the Pallas kernels' ``pallas.Compiler`` for ``block_sizes`` (their "terms" variant
    whatever ``block_sizes.variant`` says); a ValueError for what cannot run here."""
    patterns.check_choice("implementation", implementation, IMPLEMENTATIONS)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a sparse_jax.attention.BlockSizes or None, got "
                         f"{type(block_sizes).__name__}")
    resolved = api.resolve_implementation(implementation)
    if resolved == "pallas":
        return fused.compiler_for(block_sizes)
    return resolved == "native"


def _specs(spec, heads: int) -> tuple[PatternSpec, ...]:
    """``spec`` as a tuple of head groups' patterns (one PatternSpec: one group); a ValueError
    unless each is a PatternSpec and they split the heads evenly."""
    specs = tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)
    if not specs or not all(isinstance(s, PatternSpec) for s in specs):
        raise ValueError(f"spec must be a PatternSpec or a sequence of them (head groups), got "
                         f"{spec!r}")
    if heads % len(specs):
        raise ValueError(f"{heads} heads cannot be split evenly into {len(specs)} groups "
                         f"({', '.join(map(str, specs))})")
    return specs


def context_attention(q, k, v, spec: PatternSpec | tuple[PatternSpec, ...], *,
                      axis: str = "seq", implementation: str = "xla",
                      block_sizes: BlockSizes | None = None):
    """This shard's rows of ``sparse_attention`` over the whole sequence; call inside
    ``jax.shard_map`` (``check_vma`` either way) with q, k, v ``[B, n/P, H, d]`` the shard
    ``jax.lax.axis_index(axis)`` of the sequence along mesh axis ``axis`` (the batch may be
    split over other axes: each device's rows are its own). ``spec``: a pattern, or one per
    head group (heads split evenly, as ``multi_spec_attention``). ``implementation``: "xla",
    "native" (the fused CPU kernels for the sparse terms), "pallas" (the Pallas kernels for
    the sparse terms: compiled on a GPU or TPU, interpret mode on a CPU) or "auto" (as
    ``api.resolve_implementation``: Pallas on a GPU or TPU, the CPU kernels on a CPU
    where they build). ``block_sizes``: the Pallas kernels' tiles (``BlockSizes``;
    ignored by "xla" and "native"); inside the split they run the "terms" variant, also for
    ``variant="chained"``. The dense ring and the summary keys of earlier shards run XLA's
    dense blocks whatever the implementation. Differentiable (a custom backward, exact)."""
    reference.check_qkv(q, k, v)
    specs = _specs(spec, q.shape[2])
    if len(specs) > 1:
        g = q.shape[2] // len(specs)
        return jnp.concatenate([context_attention(
            q[:, :, i * g:(i + 1) * g], k[:, :, i * g:(i + 1) * g], v[:, :, i * g:(i + 1) * g],
            s, axis=axis, implementation=implementation, block_sizes=block_sizes)
            for i, s in enumerate(specs)], axis=2)
    spec = specs[0]
    how = _how(implementation, block_sizes)
    if shards.is_pallas(how) and spec.kind != "dense" and q.shape[2] % how.heads_per_program:
        raise ValueError(f"BlockSizes.heads_per_program={how.heads_per_program} must divide "
                         f"the {q.shape[2]} heads")
    try:
        devices = jax.lax.axis_size(axis)
    except NameError:
        raise ValueError(f"context_attention runs inside jax.shard_map over a mesh axis "
                         f"{axis!r}; no such axis is bound here") from None
    n = q.shape[1] * devices
    check_split(spec, n, devices)
    if devices == 1:  # nothing to exchange: today's path
        return api.sparse_attention(q, k, v, spec, implementation, block_sizes)
    if spec.kind == "dense":
        return shards.ring(axis, devices, q, k, v)
    return shards.sparse(split_plan(spec, n, devices), axis, how, q, k, v)


def seq_mesh(devices: int, axis: str = "seq") -> jax.sharding.Mesh:
    """A one-axis mesh of the first ``devices`` devices (axis type Auto, as ``sharding``'s)."""
    devices = patterns.check_int("devices", devices)
    if devices > jax.device_count():
        raise ValueError(f"a {axis} axis of {devices} devices needs {devices} devices; "
                         f"{jax.device_count()} are visible")
    return jax.make_mesh((devices,), (axis,), devices=jax.devices()[:devices],
                         axis_types=(jax.sharding.AxisType.Auto,))


def context_parallel_attention(q, k, v, spec: PatternSpec | tuple[PatternSpec, ...],
                               mesh: jax.sharding.Mesh, *, axis: str = "seq",
                               implementation: str = "xla",
                               block_sizes: BlockSizes | None = None):
    """``sparse_attention(q, k, v, spec)`` (or ``multi_spec_attention`` for a tuple of specs)
    with the sequence split over mesh axis ``axis``: q, k, v ``[B, n, H, d]`` (global arrays),
    each device attending its contiguous ``n/P`` positions with ``context_attention``
    (``implementation``, ``block_sizes``: its). Refuses (ValueError, one line) a split that
    does not fit the pattern before any work."""
    reference.check_qkv(q, k, v)
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r} (axes: {', '.join(mesh.axis_names)})")
    for one in _specs(spec, q.shape[2]):
        check_split(one, q.shape[1], mesh.shape[axis])
    _how(implementation, block_sizes)
    split = jax.sharding.PartitionSpec(None, axis)
    attend = functools.partial(context_attention, spec=spec, axis=axis,
                               implementation=implementation, block_sizes=block_sizes)
    return jax.shard_map(attend, mesh=mesh, in_specs=(split,) * 3, out_specs=split,
                         check_vma=False)(q, k, v)


