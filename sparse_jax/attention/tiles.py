"""What every Pallas kernel shares (``attention.pallas``): the platform a program is traced for
(``target_platform``, ``compiling_for``), a pass's options (``Compiler``) and block lists
(``Lists``), and the tile math of both backends (scores, the online softmax, its finish, the
gradients). Row statistics are ``[block, 1]``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

NEG = -1e30  # masked score (finite: no NaN in values or gradients)
FLOOR = -1e20  # start of a row maximum: exp(NEG - FLOOR) == 0 for a row with no key yet
BACKENDS = ("triton", "mosaic")  # GPU, TPU
PLATFORMS = ("cpu", "gpu", "tpu")
_TARGET = contextvars.ContextVar("sparse_jax_target_platform", default=None)


def target_platform() -> str:
    """The platform the programs traced now are built for: "cpu", "gpu" or "tpu". JAX's default
    backend, unless ``compiling_for`` names another. It picks the attention implementation
    ("auto"), the kernels' backend and whether they compile or run in interpret mode."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str):
    """Trace for ``platform`` ("gpu", "tpu" or "cpu") whatever this process's devices are: a
    deviceless compile for an H100 or a TPU from a CPU host (``scripts/compile_report.py``)
    builds the Triton or Mosaic kernels as the device would, not interpret mode."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r} is not one of {', '.join(PLATFORMS)}")
    token = _TARGET.set(platform)
    try:
        yield
    finally:
        _TARGET.reset(token)


@dataclasses.dataclass(frozen=True)
class Lists:
    """A term's block lists and padded position attributes (see the module docstring)."""
    forward: np.ndarray  # [query blocks, width]
    backward: np.ndarray  # [key blocks, width]
    q_attrs: tuple[np.ndarray, ...]  # q_pos, q_seg: int32 [Nq, 1]
    k_attrs: tuple[np.ndarray, ...]  # k_pos, k_seg, k_flag: int32 [1, Nk]


@dataclasses.dataclass(frozen=True)
class Compiler:
    """How the kernels are built: ``backend`` "triton" or "mosaic", Pallas interpret mode or
    not, tiles of ``block_q`` queries by ``block_k`` keys, and Triton's warps and stages."""
    backend: str
    interpret: bool
    block_q: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    heads_per_program: int = 1
    one_loop: bool = False
    band: int = 0  # band kernels' block rows (BlockSizes.band; 0: none)
    band_group: int = 16  # band kernels' blocks a grid step
    summary_q: int = 0  # the summary term's tiles (BlockSizes.summary_q; 0: block_q)
    summary_k: int = 0  # (BlockSizes.summary_k; 0: block_k)
    gathered: bool = False  # the summary term gathered (BlockSizes.gathered; Triton, chained)
    dkv: tuple[int, int, int] = (0, 0, 0)  # its dk/dv program's tiles, warps (BlockSizes.dkv)
    atomic_dq: bool = False  # onepass, gathered: dq added atomically (BlockSizes.atomic_dq)


# ---------------------------------------------------------------------------------------------
# Tile math, shared by the backends. Row statistics are [block, 1].


def dot(a, b, trans_a=False, trans_b=False):
    a = a.T if trans_a else a
    dims = ((1,), (1,) if trans_b else (0,))
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def scores(keep, q, k, q_attrs, k_attrs, masked):
    """Scores of a query tile against a key tile; masked ones NEG if ``masked`` (a bool, or a
    traced flag: the mask applied to every block, kept whole where the flag is False)."""
    s = dot(q, k, trans_b=True)
    if masked is False:
        return s
    kept = keep(*q_attrs, *k_attrs)
    return jnp.where(kept if masked is True else kept | ~masked, s, NEG)


def online(s, o, m, total, v):
    """One key tile of the online softmax: the running output, row maximum and sum updated."""
    m_new = jnp.maximum(m, s.max(-1, keepdims=True))
    correction = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    return (o * correction + dot(p.astype(v.dtype), v), m_new,
            total * correction + p.sum(-1, keepdims=True))


def start(block, width):
    return (jnp.zeros((block, width), jnp.float32), jnp.full((block, 1), FLOOR, jnp.float32),
            jnp.zeros((block, 1), jnp.float32))


def finish(o, m, total):
    """Output and log-sum-exp (NEG for a row with no key, whose output is 0)."""
    safe = jnp.maximum(total, 1e-30)
    return o / safe, jnp.where(total > 0, m + jnp.log(safe), NEG)


def grads(s, lse, delta, do, v):
    """Probabilities and score gradients of a tile, given the joint log-sum-exp."""
    p = jnp.exp(s - lse)
    return p, p * (dot(do, v, trans_b=True) - delta)

def cost(pass_: str, table: np.ndarray, block_q: int, block_k: int, heads: int, d: int,
         dv: int, itemsize: int, out_itemsize: int = 4, extra_bytes: int = 0) -> pl.CostEstimate:
    """The work of one pass ("forward", "dq" or "dkv") over a term's block list ``table``
    (``Lists.forward``, or ``Lists.backward`` for dkv), for ``heads`` (batch × heads) of
    query/key dim ``d`` and value dim ``dv``, as XLA's cost analysis should see it: per visited
    tile of ``block_q`` × ``block_k`` its matrix products (2 flops a multiply-add) and
    exponentials; bytes: the program's own tiles read and its outputs written once, the listed
    tiles read at every visit (inputs ``itemsize`` bytes, outputs ``out_itemsize``, float32
    statistics, int32 position attributes), plus ``extra_bytes`` (partial results resumed)."""
    visits = int(table[:, 0].sum() + table[:, 1].sum())
    programs = table.shape[0]
    pairs = visits * block_q * block_k
    if pass_ == "forward":  # s = q k^T, o += p v
        flops = 2 * pairs * (d + dv)
        own = block_q * (d * itemsize + 2 * 4) + block_q * (dv * out_itemsize + 4)
        listed = block_k * ((d + dv) * itemsize + 3 * 4)
    elif pass_ == "dq":  # s, dp = do v^T, dq += ds k
        flops = 2 * pairs * (2 * d + dv)
        own = block_q * ((d + dv) * itemsize + 4 * 4) + block_q * d * out_itemsize
        listed = block_k * ((d + dv) * itemsize + 3 * 4)
    elif pass_ == "dkv":  # s, dp, dk += ds^T q, dv += p^T do
        flops = 4 * pairs * (d + dv)
        own = block_k * ((d + dv) * itemsize + 3 * 4) + block_k * (d + dv) * out_itemsize
        listed = block_q * ((d + dv) * itemsize + 4 * 4)
    else:
        raise ValueError(f"pass {pass_!r} is not forward, dq or dkv")
    return pl.CostEstimate(flops=heads * flops, transcendentals=heads * pairs,
                           bytes_accessed=heads * (programs * own + visits * listed)
                           + int(extra_bytes))
