"""The gathered kernels' plan (``attention.pallas_gathered``): what they need of a fixed pattern
and their options, and which tiles each program walks, as arithmetic on its index that the
kernels trace and the host evaluates (the cost estimates, the compile report, the tests).

  option, check_options   ``BlockSizes``' options ``gathered`` and ``dkvQxK[wN]``
  Plan, plan(spec, ...)   what the kernels need of a pattern; None: not one they serve
  summary_q, summary_k,   per program index its walk: the gathered key tiles of a query tile,
  band_q, band_k          the query tiles of a gathered key tile, and the band's
  tables, read_windows    per program its masked and whole tiles, by kernel name; the band
                          dk/dv's read-back's loads
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from sparse_jax.attention.terms import BandTerm, SummaryTerm


@dataclasses.dataclass(frozen=True)
class Plan:
    """A fixed pattern for these kernels: rows of ``block`` positions, summary ``residues``,
    whether the band term keeps only residues (``part="summary"``); tiles ``bq`` × ``bk`` of
    the gathered walks and ``band_q`` × ``band_k`` of the band's; ``length`` the padded
    sequence and ``front`` the gathered array's leading zero rows (the read-back's reach)."""
    block: int
    residues: tuple[int, ...]
    band_residues: bool
    bq: int
    bk: int
    band_q: int
    band_k: int
    length: int
    front: int
    dkv_q: int = 0  # the gathered keys' dk/dv program: the query tiles it walks,
    dkv_k: int = 0  # its own gathered keys
    dkv_warps: int = 0  # and its warps (0: the compiler's)
    atomic: bool = False  # no dq program: the dk/dv programs add dq atomically (option atomic)

    @property
    def per_row(self) -> int:
        return len(self.residues)

    @property
    def gathered(self) -> int:
        """Rows of the gathered arrays: ``front``, the entries (to both key tiles), ``front``."""
        tile = max(self.bk, self.dkv_k)
        return 2 * self.front + -(-(self.length // self.block * self.per_row) // tile) * tile

    def for_dkv(self) -> Plan:
        """The gathered keys' dk/dv program's plan: its own tiles as ``bq`` × ``bk``."""
        return dataclasses.replace(self, bq=self.dkv_q, bk=self.dkv_k)

    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """Runs of consecutive residues: (first residue, count, index of the first of them)."""
        out = []
        for index, r in enumerate(self.residues):
            if out and out[-1][0] + out[-1][1] == r:
                out[-1][1] += 1
            else:
                out.append([r, 1, index])
        return tuple(map(tuple, out))


def option(option: str, options: str) -> tuple[tuple[str, ...], tuple]:
    """``BlockSizes.parse``'s last options: (fields, values) of ``gathered`` or ``dkvQxK[wN]``
    (Q queries walked × K gathered keys, N warps); ValueError for any other."""
    if option == "gathered":
        return ("gathered",), (True,)
    found = re.fullmatch(r"dkv(\d+)x(\d+)(?:w(\d+))?", option)
    if found:
        return ("dkv",), (tuple(int(x or 0) for x in found.groups()),)
    raise ValueError(f"unknown kernel option {option!r} in {options!r}: give QxK, terms, chained, "
                     "onepass, hG, wN, sN, one_loop, bandTxG, sumQxK, gathered, dkvQxK, atomic")


def check_options(sizes) -> None:
    """ValueError (one line) for ``BlockSizes``' gathered options that cannot be: ``gathered``
    (a bool) needs the chained variant; ``dkv`` (queries × keys tiles, powers of two, and
    warps, or 0s: the summary tiles and ``num_warps``) needs ``gathered``."""
    if sizes.gathered is not False and (sizes.gathered is not True
                                        or sizes.variant != "chained"):
        raise ValueError(f"BlockSizes.gathered={sizes.gathered!r} (option gathered) needs the "
                         f"chained variant, not {sizes.variant!r}: give chained:gathered")
    dkv = sizes.dkv
    if not (isinstance(dkv, tuple) and len(dkv) == 3
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in dkv)
            and all(x & (x - 1) == 0 for x in dkv) and (dkv[0] == 0) == (dkv[1] == 0)
            and dkv[2] <= 32):
        raise ValueError(f"BlockSizes.dkv={dkv!r} (option dkvQxKwN) must be tiles Q x K, "
                         "powers of two (or both 0: the summary tiles), and warps N, a power "
                         "of two up to 32 (or 0: num_warps)")
    if any(dkv) and not sizes.gathered:
        raise ValueError(f"BlockSizes.dkv={dkv!r} (option dkvQxKwN) sets the gathered "
                         "kernels' dk/dv program: give it with gathered")


def plan(spec, n: int, compiler) -> Plan | None:
    """The ``Plan`` of ``spec`` at ``n`` positions (padded to every tile and the block), or
    None if the pattern is not a band of rows with a summary term (only "fixed" is)."""
    terms = spec.terms()
    if len(terms) != 2 or not isinstance(terms[1], SummaryTerm):
        return None
    band, summary = terms
    if not (isinstance(band, BandTerm) and band.prev == 0 and band.same_row
            and band.max_distance is None and band.block == summary.block):
        return None
    bq, bk = compiler.summary_q or compiler.block_q, compiler.summary_k or compiler.block_k
    dkv_q, dkv_k = compiler.dkv[0] or bq, compiler.dkv[1] or bk
    step = math.lcm(bq, bk, dkv_q, dkv_k, compiler.block_q, compiler.block_k, summary.block)
    # a tile multiple, and at least the read-back's reach: a row and a band tile either side
    front = -(-(3 * summary.block + compiler.block_k) // step) * step
    return Plan(summary.block, summary.residues, band.residues is not None, bq, bk,
                compiler.block_q, compiler.block_k, -(-n // step) * step, front, dkv_q, dkv_k,
                compiler.dkv[2], compiler.atomic_dq)


# ---------------------------------------------------------------------------------------------
# Which tiles each program walks: arithmetic on its index (the kernels' and the host's).


def div(x, y):
    """``x // y`` for non-negative x (traced int32, NumPy or Python int), a Python int y."""
    return jax.lax.div(x, jnp.int32(y)) if isinstance(x, jax.Array) else x // y


def minimum(x, y):
    return jnp.minimum(x, y) if isinstance(x, jax.Array) else np.minimum(x, y)


def summary_q(i, p: Plan):
    """(whole, end): query tile ``i`` walks gathered key tiles ``[0, whole)`` unmasked and
    ``[whole, end)`` masked (the end of its rows' prefixes)."""
    first, last = div(i * p.bq, p.block), div(i * p.bq + p.bq - 1, p.block)
    return div(first * p.per_row, p.bk), div(last * p.per_row + p.bk - 1, p.bk)


def summary_k(j, p: Plan):
    """(start, whole, end): gathered key tile ``j`` is attended by query tiles ``[start,
    whole)`` masked (the rows after its first) and ``[whole, end)`` unmasked."""
    first, last = div(j * p.bk, p.per_row), div(j * p.bk + p.bk - 1, p.per_row)
    end = p.length // p.bq
    return (minimum(div((first + 1) * p.block, p.bq), end),
            minimum(div((last + 1) * p.block + p.bq - 1, p.bq), end), end)


def band_q(i, p: Plan):
    """(start, end): query tile ``i`` (of ``bq``) walks key tiles ``[start, end)`` of its
    rows, masked."""
    first = div(i * p.bq, p.block)
    return div(first * p.block, p.band_k), div((i + 1) * p.bq + p.band_k - 1, p.band_k)


def band_k(j, p: Plan):
    """(start, end): key tile ``j`` is attended by query tiles ``[start, end)``, masked."""
    last = div(j * p.band_k + p.band_k - 1, p.block)
    return div(j * p.band_k, p.band_q), div((last + 1) * p.block + p.band_q - 1, p.band_q)


def tables(p: Plan) -> dict[str, np.ndarray]:
    """Per kernel (``sparse_{forward,dq,dkv}_gathered``, ``sparse_dkv_gathered_band``) and
    program: its masked and whole tiles ``[programs, 2]`` (both terms' tiles in forward and dq;
    with ``atomic``, dq's are listed and walked by the dk/dv kernels, the gathered keys' every
    tile masked)."""
    dkv = p.for_dkv()
    i, j = np.arange(p.length // p.bq), np.arange((p.gathered - 2 * p.front) // dkv.bk)
    whole, end = summary_q(i, p)
    band_start, band_end = band_q(i, p)
    start, middle, last = summary_k(j, dkv)
    k_start, k_end = band_k(np.arange(p.length // p.band_k), p)
    both = np.stack([end - whole + band_end - band_start, whole], 1)
    return {"sparse_forward_gathered": both, "sparse_dq_gathered": both,
            "sparse_dkv_gathered": np.stack([last - start, 0 * start], 1) if p.atomic else
            np.stack([middle - start, last - middle], 1),
            "sparse_dkv_gathered_band": np.stack([k_end - k_start, 0 * k_end], 1)}



def read_windows(j, p: Plan):
    """The read-back's loads of band key tile ``j`` (traced, or NumPy for every tile): (start,
    row, first residue, count) per row the tile touches and run of residues; rows ``start ..
    start + band_k`` of the gathered array, entry i kept where position ``j·band_k + i`` lies
    in that row at one of those residues."""
    first = div(j * p.band_k, p.block)
    spans = 1 if p.block % p.band_k == 0 else -(-p.band_k // p.block) + 1
    return [(p.front + (first + s) * p.per_row + index + j * p.band_k - (first + s) * p.block
             - residue, first + s, residue, count)
            for s in range(spans) for residue, count, index in p.runs()]

