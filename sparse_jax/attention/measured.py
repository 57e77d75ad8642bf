"""The GPU kernel's default options, chosen by measurement.

Where a caller leaves the Pallas kernel's options unset (``BlockSizes`` None: the model's
``kernel=""``, ``sparse_attention(..., implementation="pallas")`` without ``block_sizes``) and
the kernels compile for a GPU, the options are the ones the accelerator report timed fastest
for the pattern at that length, as listed in ``CHOICES`` with the report each came from;
elsewhere (beyond the lengths measured, on a TPU, in interpret mode on a CPU) they are
``BlockSizes.for_backend``'s. Options a caller gives are used as given.

How a choice is made (docs/attention.md, "Defaults chosen by measurement"): every variant of a
(pattern, length) is timed by ``scripts/accelerator_report.py`` in one run, forward + backward,
bfloat16, B = 1, H = 8, d = 64; a variant becomes the default where it is the fastest and ahead
of the current default by more than the run's noise. The H200 is the GPU measured; the H100
(the same sm_90 architecture) and other GPUs take the same choices until a report of theirs
says otherwise.
"""

from __future__ import annotations

import dataclasses

from sparse_jax.attention.blocks import BlockSizes


@dataclasses.dataclass(frozen=True)
class Choice:
    """Options ``options`` (``BlockSizes.parse``) for ``pattern`` at lengths up to ``up_to``,
    measured as ``measured`` says in ``report``."""

    pattern: str  # "strided" | "fixed" | "local"
    up_to: int  # the longest sequence the choice holds for (the longest measured with it)
    options: str
    report: str
    measured: str


_H200 = "docs/benchmarks/h200_2026-11-28/report_results.md"
CHOICES = (
    Choice("strided", 16_384, "chained", _H200,
           "l=128 at 16,384 on an H200: chained 0.612 ms against the default's 0.966 ms (0.709 "
           "ms in docs/benchmarks/h200, 2026-11-26: 1.16x); every chained row faster than the "
           "default; at 65,536 the default is fastest (2.42 ms, chained:64x32:one_loop 2.49)"),
    Choice("fixed", 16_384, "chained", _H200,
           "l=128 c=32 at 16,384 on an H200: chained 1.79 ms against the default's 1.96 ms "
           "(1.09x); at 65,536 the default is fastest (16 ms; chained:64x32 19.5, "
           "128x64:chained:w8:s3 21.8)"),
)


def default_sizes(backend: str, interpret: bool, kind: str, seq_len: int) -> BlockSizes:
    """The kernel's options for pattern ``kind`` at ``seq_len`` when the caller gives none:
    ``CHOICES`` for a compiled GPU kernel (``backend`` "triton", not ``interpret``), else
    ``BlockSizes.for_backend(backend)``."""
    default = BlockSizes.for_backend(backend)
    if backend != "triton" or interpret:
        return default
    for choice in CHOICES:
        if choice.pattern == kind and seq_len <= choice.up_to:
            return BlockSizes.parse(choice.options, default)
    return default
