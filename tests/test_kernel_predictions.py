"""The committed predictions of the kernels built but not yet measured (the strided one-pass
kernels, docs/benchmarks/cost_model/kernels_strided.json; the fixed pattern's gathered kernels,
kernels_fixed.json) are what the cost model gives on the committed compile rows and fitted
parameters, and say what docs/cost_model.md says of them."""

import json
import os

import pytest

from sparse_jax.bench import cost_model, kernel_predictions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_committed_predictions_of_the_gathered_kernels_are_the_models():
    with open(os.path.join(REPO, "docs/benchmarks/cost_model/kernels_fixed.json")) as f:
        committed = json.load(f)
    fresh = kernel_predictions.fixed(REPO)
    assert len(committed["rows"]) == len(fresh["rows"]) == 12
    for old, new in zip(committed["rows"], fresh["rows"]):
        assert (old["pattern"], old["n"]) == (new["pattern"], new["n"])
        for key, ms in new["predicted_ms"].items():
            assert old["predicted_ms"][key] == pytest.approx(ms, rel=1e-9)
    rows = {(r["pattern"], r["n"]): r for r in fresh["rows"]}
    best = "fixed:128:32@pallas:chained:gathered:dkv128x128w8"
    for n in (16384, 65536):  # short of 80% at the fitted latency, past it at half of it
        assert rows[(best, n)]["of_cudnn"]["fitted"] < 0.8 < rows[(best, n)]["of_cudnn"][
            "half_latency"]
        assert 0.5 < rows[(best, n)]["latency_for_target"] < 1
    with open(os.path.join(REPO, "docs/cost_model.md")) as f:
        page = f.read()
    for line in kernel_predictions.fixed_markdown(fresh).splitlines()[2:]:
        cells = line.split(" | ")[1:]  # the figures of each row, as the page prints them
        assert " | ".join(cells) in page, line


def test_the_onepass_kernels_are_predicted_and_the_committed_predictions_repeat():
    """The persistent kernels' figures as the model reads them (a program a resident slot,
    each walking many items), the committed predictions a fresh computation's, and the figure
    at 16k (≥ 10x cuDNN, predicted) held."""
    static = cost_model.static_rows(REPO, (kernel_predictions.ONEPASS,))
    f = cost_model.features(static[("strided:128@pallas:onepass:s1", 16384)],
                            "strided:128@pallas:onepass:s1")
    assert len(f["kernels"]) == 4 and f["xla_kernels"] == 1
    for k in f["kernels"]:
        assert k["programs"] == cost_model.SMS * k["blocks_per_sm"] < k["items"]
        assert k["spill_bytes"] == 0
    backward = [k for k in f["kernels"] if "backward" in k["name"]]
    assert [k["flops"] for k in backward] == [2.0 * 64 * 64 * 64 * 3.5] * 2  # dq 3, dk/dv 4
    rows = kernel_predictions.TABLES["strided"](REPO)["rows"]
    with open(os.path.join(REPO, "docs/benchmarks/cost_model/kernels_strided.json")) as fh:
        committed = json.load(fh)["rows"]
    assert [(r["n"], r["predicted_ms"]) for r in committed] == [
        (r["n"], pytest.approx(r["predicted_ms"], rel=1e-3)) for r in rows]
    by_n = {r["n"]: r for r in rows}
    assert set(by_n) == {8192, 16384, 32768, 65536}
    assert by_n[16384]["ratio"] >= 10 and all(r["per_item_ms"] > r["predicted_ms"] for r in rows)


def test_the_tile_term_is_predicted_beside_a_dense_kernels_rate():
    """A pattern of one's own (the generic tile term at 16k, block densities 1/32 to 1/2, both
    variants): the committed predictions are what the model gives on the committed compile rows,
    time grows with the kept pairs, and no row beats every kept pair at cuDNN's rate."""
    fresh = kernel_predictions.tiles(REPO)["rows"]
    with open(os.path.join(REPO, "docs/benchmarks/cost_model/kernels_tiles.json")) as f:
        committed = json.load(f)["rows"]
    assert [(r["pattern"], r["predicted_ms"]) for r in committed] == [
        (r["pattern"], pytest.approx(r["predicted_ms"], rel=1e-9)) for r in fresh]
    assert len(fresh) == 10
    for variant in (False, True):
        rows = [r for r in fresh if r["pattern"].endswith(":chained") == variant]
        assert [r["pair_density"] for r in rows] == sorted(r["pair_density"] for r in rows)
        assert [r["predicted_ms"] for r in rows] == sorted(r["predicted_ms"] for r in rows)
        assert all(0 < r["of_dense_rate"] < 1 and r["dense_rate_ms"] < r["predicted_ms"]
                   for r in rows)
    with open(os.path.join(REPO, "docs/custom_patterns.md")) as f:
        page = f.read()
    for line in kernel_predictions.tiles_markdown({"rows": fresh}).splitlines()[2:]:
        assert line in page, line
