"""A ``tileterm.TileTerm`` on the fast paths: its tiles in plain ``jnp`` (the XLA path, and the
CPU kernels' path, whose C++ serves the band, column and summary terms only), and its block lists
and mask for the Pallas kernels.

XLA: a ``lax.scan`` over chunks of query rows of the grid ``[B, R, block, H, d]``; a step gathers
each row's listed key tiles (``tile_plan``: ``M`` per row, padded with an empty mask), scores
them as one ``[block, M * block]`` matmul per row and head, masks them with the tiles' exact
boolean masks (gathered from the plan's table of distinct masks) and merges its row maximum, sum
and weighted values into the running ones of the pattern's other terms (log-sum-exp), as
``xla.grid_forward`` does for its terms. The backward recomputes a step's probabilities from
the saved log-sum-exp and adds dq to its rows, dk and dv to the listed key rows (a scatter-add).

Pallas: the kernels' own tiles (``block_q x block_k``) listed from the rule's kept pairs
(``tile_counts``), and the rule itself as the mask of partial tiles, evaluated in the kernel on
the tiles' positions (FlexAttention's ``mask_mod``): so a rule given as ``allowed(q, k)`` with
array operations (``TileTerm.traceable``) runs there; others run on the XLA path
(``pallas_ready``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.attention import blocks, pallas
from sparse_jax.attention.reference import NEG as _NEG
from sparse_jax.attention.reference import dot
from sparse_jax.attention.tileterm import EMPTY, TileTerm, tile_counts, tile_plan

_STEP_SCORES = 1 << 18  # scores in one scan step, all batch rows and heads (as ``xla``'s)


def tile_terms(spec) -> tuple[TileTerm, ...]:
    return tuple(t for t in spec.terms() if isinstance(t, TileTerm))


_BUCKETS = 6  # most scans per term: query rows grouped by how many tiles they list


@functools.lru_cache(maxsize=32)
def _buckets(term: TileTerm, rows: int, lanes: int):
    """The query rows with tiles, grouped by how many (``M``, rounded up to the group's most:
    a row pads its list only to its group's width, not to the longest row's), each group as a
    scan's steps: (query rows [S, c], key rows [S, c, M], mask ids [S, c, M]), ``c`` rows a
    step; the last step padded with row ``rows`` (outside the grid: read as zeros, written
    nowhere)."""
    plan = tile_plan(term, rows)
    counts = (plan.mask_ids != EMPTY).sum(1)
    widths = sorted(set(counts.tolist()) - {0})
    while len(widths) > _BUCKETS:  # merge the group with fewest rows into the next wider
        sizes = [int(((counts > (widths[i - 1] if i else 0)) & (counts <= w)).sum())
                 for i, w in enumerate(widths[:-1])]
        widths.pop(int(np.argmin(sizes)))
    groups, low = [], 0
    for width in widths:
        members = np.nonzero((counts > low) & (counts <= width))[0]
        low = width
        c = min(len(members), max(1, _STEP_SCORES // (lanes * term.block ** 2 * width)))
        steps = -(-len(members) // c)
        padded = np.full(steps * c, rows, np.int32)
        padded[:len(members)] = members
        key_rows = np.zeros((steps * c, width), np.int32)
        mask_ids = np.full((steps * c, width), EMPTY, np.int32)
        key_rows[:len(members)] = plan.key_rows[members, :width]
        mask_ids[:len(members)] = plan.mask_ids[members, :width]
        groups.append((padded.reshape(steps, c), key_rows.reshape(steps, c, width),
                       mask_ids.reshape(steps, c, width)))
    return plan.masks, groups


def _gather(x, key_rows, c, width):
    """Key rows ``key_rows [c, M]`` of a grid array -> [B, c, M * block, H, ...]."""
    got = jnp.take(x, key_rows.ravel(), axis=1)
    return got.reshape(x.shape[0], c, width * x.shape[2], *x.shape[3:])


def _keep(masks, mask_ids, c, width, b):
    """Gathered tile masks of a step, [1, c, 1, block, M * block] (scores' [B, c, H, Q, K])."""
    m = masks[mask_ids]  # [c, M, b, b]
    return m.transpose(0, 2, 1, 3).reshape(c, b, width * b)[None, :, None]


def _rows(x, rows):
    """Grid rows ``rows`` [c] of [B, R, b, H, ...] as [B, c, H, b, ...] (zeros past R)."""
    return jnp.moveaxis(jnp.take(x, rows, axis=1, mode="fill", fill_value=0), 3, 2)


def _put(x, rows, y, add=False):
    """``x`` with grid rows ``rows`` set to (or plus) ``y`` [B, c, H, b, ...] (none past R)."""
    y = jnp.moveaxis(y, 2, 3).astype(x.dtype)
    at = x.at[:, rows]
    return at.add(y, mode="drop") if add else at.set(y, mode="drop")


def _scan(step, carry, groups):
    for group in groups:
        carry = jax.lax.scan(step, carry, tuple(map(jnp.asarray, group)))[0]
    return carry


def forward(term: TileTerm, scale, q_g, k_g, v_g, state):
    """``state`` (row maximum, sum, weighted values; grid layout, float32) with the term's keys
    merged in."""
    batch, rows, b, heads, _ = q_g.shape
    masks, groups = _buckets(term, rows, batch * heads)
    masks = jnp.asarray(masks)

    def step(carry, xs):
        row_max, total, acc = carry
        r, kr, mi = xs
        c, width = kr.shape
        q = jnp.take(q_g, r, axis=1, mode="fill", fill_value=0) * jnp.asarray(scale, q_g.dtype)
        k, v = (_gather(x, kr, c, width) for x in (k_g, v_g))
        s = dot("bcqhd,bckhd->bchqk", q, k)
        s = jnp.where(_keep(masks, mi, c, width, b), s, _NEG)
        old_max = _rows(row_max, r)
        new_max = jnp.maximum(old_max, s.max(-1))
        p = jnp.exp(s - new_max[..., None])
        rescale = jnp.exp(old_max - new_max)
        new_total = p.sum(-1) + rescale * _rows(total, r)
        values = dot("bchqk,bckhd->bchqd", p.astype(v_g.dtype), v)
        new_acc = values + rescale[..., None] * _rows(acc, r)
        return (_put(row_max, r, new_max), _put(total, r, new_total),
                _put(acc, r, new_acc)), None

    return _scan(step, state, groups)


def backward(term: TileTerm, scale, q_g, k_g, v_g, d_out, lse, delta, grads):
    """``grads`` (dq, dk, dv; grid layout, float32) plus the term's share for the joint
    log-sum-exp ``lse`` and ``delta = dO·O`` ([B, R, b, H])."""
    batch, rows, b, heads, _ = q_g.shape
    masks, groups = _buckets(term, rows, batch * heads)
    masks = jnp.asarray(masks)

    def step(carry, xs):
        d_q, d_k, d_v = carry
        r, kr, mi = xs
        c, width = kr.shape
        q = jnp.take(q_g, r, axis=1, mode="fill", fill_value=0) * jnp.asarray(scale, q_g.dtype)
        do = jnp.take(d_out, r, axis=1, mode="fill", fill_value=0).astype(v_g.dtype)
        k, v = (_gather(x, kr, c, width) for x in (k_g, v_g))
        p = jnp.exp(dot("bcqhd,bckhd->bchqk", q, k) - _rows(lse, r)[..., None])
        p = jnp.where(_keep(masks, mi, c, width, b), p, 0.0)
        dp = dot("bcqhd,bckhd->bchqk", do, v)
        ds = (p * (dp - _rows(delta, r)[..., None])).astype(q_g.dtype)
        d_q = _put(d_q, r, dot("bchqk,bckhd->bchqd", ds, k) * scale, add=True)
        flat = lambda x: x.reshape(batch, c * width, b, *x.shape[3:])  # noqa: E731
        dk = flat(dot("bchqk,bcqhd->bckhd", ds, q))
        dv = flat(dot("bchqk,bcqhd->bckhd", p.astype(v_g.dtype), do))
        return (d_q, d_k.at[:, kr.ravel()].add(dk), d_v.at[:, kr.ravel()].add(dv)), None

    return _scan(step, grads, groups)


# ---------------------------------------------------------------------------------------------
# The Pallas kernels.

_FAR = 1 << 29


def pallas_ready(spec) -> bool:
    """Whether the Pallas kernels can run ``spec``'s tile terms (their rules trace in jnp)."""
    return all(t.traceable for t in tile_terms(spec))


def pallas_keep(term: TileTerm):
    """The kernels' mask of the term (``pallas``' ``keep``): the rule on the tiles' positions,
    causal, nothing for padding (queries' segment < 0, keys unflagged)."""
    def keep(q_pos, q_seg, k_pos, k_seg, k_flag):
        return term.keep(q_pos, k_pos) & (k_pos <= q_pos) & (k_flag != 0) & (q_seg >= 0)
    return keep


@functools.lru_cache(maxsize=32)
def pallas_term(term: TileTerm, rows: int, block_q: int, block_k: int):
    """``(layout, keep, lists)`` of the term on a grid of ``rows`` rows for the kernels' tiles:
    the layout the sequence order (``blocks``' "rows"), the lists from the kept pairs."""
    if not term.traceable:
        raise ValueError(f"{term.name}: the Pallas kernels need a rule allowed(q, k) of array "
                         "operations (it runs in the kernel); run implementation='xla'")
    layout = blocks._Layout("tiles", rows, term.block, (0, None), (0, None))  # as "rows"
    n = rows * term.block
    counts = tile_counts(term, n, block_q, block_k)
    nqb, nkb = counts.shape
    qb, kb = np.nonzero(counts)
    full = counts[qb, kb] == block_q * block_k
    pos_q, pos_k = np.arange(nqb * block_q), np.arange(nkb * block_k)
    seg_q = np.where(pos_q < n, 0, -_FAR)
    flag_k = pos_k < n
    column, row = (lambda x: x.astype(np.int32)[:, None]), (lambda x: x.astype(np.int32)[None])
    lists = pallas.Lists(blocks._pack(qb, kb, full, nqb), blocks._pack(kb, qb, full, nkb),
                         (column(pos_q), column(seg_q)),
                         (row(pos_k), row(np.zeros(len(pos_k))), row(flag_k)))
    return layout, pallas_keep(term), lists
