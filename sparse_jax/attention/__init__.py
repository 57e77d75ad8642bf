"""Attention of the factorized patterns, from the index sets to the kernels.

Lower modules are imported by higher ones only, in this order:

* ``patterns`` (the index sets), ``tileterm`` (the generic term of a user's rule), ``terms``
  (their block-level view), ``spec`` (``PatternSpec``, ``layer_specs``): pure NumPy;
* ``custom``: a pattern of one's own, as terms or as a rule (it borrows ``blocks``' mask rule);
* ``tiles`` (what every Pallas kernel shares), ``pallas_gpu`` and ``pallas_tpu`` (the programs),
  ``pallas`` (the passes: forward, backward, band passes); they know nothing of patterns;
* ``native`` (with ``cpu_kernels.cc``): the fused CPU kernels, C++ through XLA's FFI;
* ``blocks`` (``BlockSizes``, each term's layout, mask rule and block lists) and ``fused`` (a
  pattern through the Pallas kernels, merged or chained, with its custom VJP);
* ``tilepath``: a user rule's ``TileTerm`` on the XLA path and in the Pallas kernels;
* ``reference`` (the dense references the fast paths are held to), ``xla`` (the block terms in
  plain ``jnp``, custom backward), ``causal`` (dense causal attention without an n x n array),
  ``api`` (``sparse_attention`` and friends: which implementation runs);
* ``shards`` and ``context``: one sequence split over devices, exact;
* ``weights``: the attention weights of a pattern's queries, by key distance and term (what
  ``sparse_jax.attention_stats`` reads a trained model with).

The names below are the public surface (``from sparse_jax.attention import sparse_attention``).
"""

from sparse_jax.attention.api import (
    IMPLEMENTATIONS,
    multi_spec_attention,
    resolve_implementation,
    sparse_attention,
)
from sparse_jax.attention.blocks import BlockSizes
from sparse_jax.attention.context import context_attention, context_parallel_attention
from sparse_jax.attention.reference import decode_attention, dense_attention, gather_attention
from sparse_jax.attention.spec import PatternSpec, layer_specs

__all__ = ["BlockSizes", "IMPLEMENTATIONS", "PatternSpec", "context_attention",
           "context_parallel_attention", "decode_attention", "dense_attention",
           "gather_attention", "layer_specs", "multi_spec_attention", "resolve_implementation",
           "sparse_attention"]
