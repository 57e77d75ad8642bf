"""The GPU kernel's defaults chosen by measurement (sparse_jax.attention.measured): each choice
holds where it was measured, names a committed report that holds its figures, and applies only
to compiled GPU kernels."""

import pathlib
import re

import pytest

from sparse_jax.attention import measured
from sparse_jax.attention.blocks import BlockSizes

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("choice", measured.CHOICES, ids=lambda c: f"{c.pattern}-{c.up_to}")
def test_each_choice_compiles_for_a_gpu_and_its_report_holds_its_figures(choice):
    sizes = BlockSizes.parse(choice.options, BlockSizes.for_backend("triton"))
    sizes.check_backend("triton")  # options Triton compiles
    report = (ROOT / choice.report).read_text()
    for ms in re.findall(r"(\d+\.\d+) ms", choice.measured):  # every time quoted is in a report
        assert f"| {ms} |" in report or ms in (ROOT / "docs/benchmarks/h200/results.md"
                                                 ).read_text(), ms
    option_rows = [line for line in report.splitlines()
                   if line.startswith(f"| {choice.pattern}:") and f"| {choice.up_to} |" in line]
    assert any(f"@pallas:{choice.options} |" in line for line in option_rows), option_rows


def test_defaults_follow_the_measurements_and_only_on_a_compiled_gpu_kernel():
    chained = measured.default_sizes("triton", False, "strided", 16_384)
    assert chained == BlockSizes(variant="chained")
    assert measured.default_sizes("triton", False, "fixed", 4_096).variant == "chained"
    for kind, n in (("strided", 65_536), ("fixed", 32_768), ("local", 1_024)):
        assert measured.default_sizes("triton", False, kind, n) == BlockSizes()
    assert measured.default_sizes("triton", True, "strided", 16_384) == BlockSizes()
    assert measured.default_sizes("mosaic", False, "strided", 16_384) \
        == BlockSizes.for_backend("mosaic")
