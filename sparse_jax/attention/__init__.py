"""Attention of the factorized patterns, from the index sets to the kernels.

Lower modules are imported by higher ones only:

* ``patterns``: the patterns as pure NumPy index sets, their block-level terms, ``PatternSpec``
  and the patterns of a layer's head groups;
* ``pallas``: Pallas kernels (GPU through Triton, TPU through Mosaic) that know nothing of
  patterns: flash passes over block lists;
* ``native`` (with ``cpu_kernels.cc``): the fused CPU kernels, C++ through XLA's FFI;
* ``blocks``: the fused path of the block terms: their layouts, mask rules and block lists, the
  merge and its custom VJP (``BlockSizes``);
* ``xla``: the references, the block terms in plain ``jnp`` with a custom backward, and the
  public entry points that choose an implementation;
* ``context``: one sequence split over devices (exact).

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
