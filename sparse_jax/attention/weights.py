"""The attention weights of a pattern's queries, exactly, a block of queries at a time and with
no n x n array: summed per head by key distance and by term of the pattern (``layer_sums``, what
``sparse_jax.attention_stats`` reports for a trained model), or whole rows (``query_weights``,
the paper's Figure 2).

Queries take exactly the keys their pattern gives them, term by term (``terms.term_rows``: the
sets training attends; dense: every key j <= i) and are scored as the kernels score them (q
scaled by 1/sqrt(d) in its dtype, float32 dot products), with one softmax over all of a query's
keys. The keys of a fixed pattern's summary term (and dense's) are the same for every query, so
they are gathered once and scored by one matmul per block; the others are gathered per query.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.attention.reference import FLOOR, NEG, dot
from sparse_jax.attention.terms import BandTerm, ColumnTerm, SummaryTerm, TileTerm, term_rows

BLOCK_BYTES = 1 << 26  # the largest array of one block of queries, about


class Sums(NamedTuple):
    """One layer's sums over weighted queries: ``hist`` [H, n] the weight at each distance,
    ``terms`` [H, T] on each term of the head's pattern (T: the most terms of a head group;
    0 past a group's own), ``entropy`` [H] in bits, ``weight`` [] the queries' total weight."""
    hist: jax.Array
    terms: jax.Array
    entropy: jax.Array
    weight: jax.Array


def term_names(spec) -> tuple[str, ...]:
    """A name for each term of ``spec`` (``spec.terms()`` order; dense: one, "all")."""
    if spec.kind == "dense":
        return ("all",)
    names = {ColumnTerm: "column", SummaryTerm: "summary", TileTerm: "tiles"}
    return tuple(names.get(type(t)) or ("summary, own block" if t.residues is not None else
                                        "block" if t.same_row else "local")
                 for t in spec.terms())


def offsets(term, n: int) -> np.ndarray | None:
    """d_C where the term's keys of query i are i - d_C (``term_rows``' columns), else None."""
    if isinstance(term, ColumnTerm):
        return np.arange(-(-n // term.stride)) * term.stride
    if isinstance(term, BandTerm) and term.max_distance is not None and not term.same_row \
            and term.residues is None and term.max_distance <= term.prev * term.block:
        return np.arange(term.max_distance + 1)  # a sliding window
    return None


def shared_keys(term, n: int) -> np.ndarray | None:
    """The keys, in ``term_rows``' columns, that every query of a term shares (valid or not):
    dense (term None) all n, fixed's summary every summary key; None for the other terms."""
    if term is None:
        return np.arange(n)
    if isinstance(term, SummaryTerm):
        keys = (np.arange(-(-n // term.block))[:, None] * term.block
                + np.array(term.residues)[None]).ravel()
        return keys[keys < n]
    return None


def _terms(spec):
    return (None,) if spec.kind == "dense" else spec.terms()


def _gather_shared(k_BNHD, spec) -> dict:
    n = k_BNHD.shape[1]
    return {t: k_BNHD[:, shared_keys(term, n)] for t, term in enumerate(_terms(spec))
            if shared_keys(term, n) is not None}


def block_weights(q_BQHD, k_BNHD, spec, i_Q, shared):
    """The weights of queries ``i_Q`` (one head group: q of those positions, k of all n) over
    their pattern's keys, term by term: ([(keys [Q, C], valid [Q, C], p [B, H, Q, C], score -
    row max)], row sums [B, H, Q, 1]), one softmax over all of a query's keys, scored as the
    model scores (q * 1/sqrt(d) in its dtype, float32 dot). ``shared``: each shared term's keys
    gathered from k once (``shared_keys``)."""
    n = k_BNHD.shape[1]
    q_BQHD = q_BQHD * jnp.asarray(1.0 / math.sqrt(q_BQHD.shape[-1]), q_BQHD.dtype)
    parts = []
    for t, term in enumerate(_terms(spec)):
        if term is None:  # dense: every key j <= i
            keys = jnp.broadcast_to(jnp.arange(n), (len(i_Q), n))
            valid = keys <= i_Q[:, None]
        else:
            keys = term_rows(term, i_Q, n, jnp)
            valid = keys >= 0
        if t in shared:
            scores = dot("bqhd,bchd->bhqc", q_BQHD, shared[t])
            keys = jnp.broadcast_to(jnp.asarray(shared_keys(term, n)), valid.shape)
        else:
            scores = dot("bqhd,bqchd->bhqc", q_BQHD, k_BNHD[:, jnp.clip(keys, 0, n - 1)])
        parts.append((keys, valid, jnp.where(valid[None, None], scores, NEG)))
    top = jnp.maximum(FLOOR, jnp.max(jnp.stack([s.max(-1) for *_, s in parts]), 0))[..., None]
    exps = [jnp.where(v[None, None], jnp.exp(s - top), 0.0) for _, v, s in parts]
    total = jnp.maximum(sum(e.sum(-1, keepdims=True) for e in exps), 1e-30)
    return [(keys, valid, e / total, s - top) for (keys, valid, s), e in zip(parts, exps)], total


def group_sums(q_BNHD, k_BNHD, spec, w_BN, block: int | None = None) -> Sums:
    """``Sums`` of one head group attending with ``spec``, over queries weighted by w [B, n],
    a block of queries at a time (``block``: default from ``BLOCK_BYTES``)."""
    batch, n, heads, dim = q_BNHD.shape
    terms = _terms(spec)
    shared = _gather_shared(k_BNHD, spec)
    if block is None:  # a power of two: a query's gathered keys and 4 arrays of its scores
        gathered = sum(term_rows(t, np.arange(1), n).shape[-1] for i, t in enumerate(terms)
                       if i not in shared)
        size = batch * heads * 4 * (gathered * (dim + 4) + 4 * sum(shared_keys(terms[t], n).size
                                                                    for t in shared))
        fit = max(1, BLOCK_BYTES // size)
        block = min(1 << (n - 1).bit_length(), 1 << fit.bit_length() - 1, 1024)
    blocks = -(-n // block)
    pad = ((0, 0), (0, blocks * block - n))
    q_pad = jnp.pad(q_BNHD, pad + ((0, 0), (0, 0)))
    w_pad = jnp.pad(w_BN.astype(jnp.float32), pad)
    fixed = [offsets(t, n) if t is not None else None for t in terms]

    def body(b, acc):
        hist, mass, entropy = acc
        i_Q = b * block + jnp.arange(block)
        q = jax.lax.dynamic_slice_in_dim(q_pad, b * block, block, 1)
        w_BQ = jax.lax.dynamic_slice_in_dim(w_pad, b * block, block, 1)
        parts, total = block_weights(q, k_BNHD, spec, i_Q, shared)
        ent_BHQ = jnp.where(total[..., 0] >= 1, jnp.log(total[..., 0]), 0.0)  # no key: 0
        for t, (keys, valid, p, s) in enumerate(parts):
            wp_HQC = jnp.einsum("bhqc,bq->hqc", p, w_BQ)
            mass = mass.at[:, t].add(wp_HQC.sum((1, 2)))
            ent_BHQ -= jnp.where(valid[None, None], p * s, 0.0).sum(-1)
            if fixed[t] is not None:  # the distance of a column is the same for every query
                hist = hist.at[:, fixed[t]].add(wp_HQC.sum(1))
            else:
                d_QC = jnp.clip(i_Q[:, None] - keys, 0, n - 1)
                hist = hist.at[jnp.arange(heads)[:, None, None], d_QC[None]].add(
                    jnp.where(valid[None], wp_HQC, 0.0))
        entropy += jnp.einsum("bhq,bq->h", ent_BHQ, w_BQ) / math.log(2)
        return hist, mass, entropy

    zeros = (jnp.zeros((heads, n)), jnp.zeros((heads, len(terms))), jnp.zeros(heads))
    hist, mass, entropy = jax.lax.fori_loop(0, blocks, body, zeros)
    return Sums(hist, mass, entropy, w_pad.sum())


def layer_sums(q_BNHD, k_BNHD, specs, w_BN, block: int | None = None) -> Sums:
    """``Sums`` of a layer whose heads split evenly over ``specs`` (one pattern per head group,
    ``ModelConfig.layer_specs``), from its queries and keys (``SparseSelfAttention.project``)."""
    g = q_BNHD.shape[2] // len(specs)
    parts = [group_sums(q_BNHD[:, :, i * g:(i + 1) * g], k_BNHD[:, :, i * g:(i + 1) * g], s,
                        w_BN, block) for i, s in enumerate(specs)]
    width = max(p.terms.shape[1] for p in parts)
    return Sums(jnp.concatenate([p.hist for p in parts]),
                jnp.concatenate([jnp.pad(p.terms, ((0, 0), (0, width - p.terms.shape[1])))
                                 for p in parts]),
                jnp.concatenate([p.entropy for p in parts]), parts[0].weight)


def query_weights(q_BNHD, k_BNHD, specs, positions) -> jax.Array:
    """The weights of the queries at ``positions`` over all n keys, [B, H, P, n] (0 off their
    pattern): Figure 2's rows."""
    batch, n, heads, _ = q_BNHD.shape
    g, out, i_P = heads // len(specs), [], jnp.asarray(positions)
    for i, spec in enumerate(specs):
        q, k = q_BNHD[:, i_P, i * g:(i + 1) * g], k_BNHD[:, :, i * g:(i + 1) * g]
        shared, rows = _gather_shared(k, spec), jnp.zeros((batch, g, len(positions), n))
        for keys, valid, p, _ in block_weights(q, k, spec, i_P, shared)[0]:
            rows = rows.at[:, :, jnp.arange(len(positions))[:, None], jnp.clip(keys, 0, n - 1)
                           ].add(jnp.where(valid[None, None], p, 0.0))
        out.append(rows)
    return jnp.concatenate(out, axis=1)
