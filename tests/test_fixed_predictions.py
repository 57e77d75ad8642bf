"""The committed predictions of the fixed pattern's gathered kernels
(docs/benchmarks/cost_model/predictions_fixed.json) are what the cost model gives on the
committed compile rows and fitted parameters, and say what docs/cost_model.md says of them."""

import json
import os

import pytest

from sparse_jax.bench import fixed_predictions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_committed_predictions_are_the_models():
    with open(os.path.join(REPO, "docs/benchmarks/cost_model/predictions_fixed.json")) as f:
        committed = json.load(f)
    fresh = fixed_predictions.predictions(REPO)
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
    for line in fixed_predictions.markdown(fresh).splitlines()[2:]:
        cells = line.split(" | ")[1:]  # the figures of each row, as the page prints them
        assert " | ".join(cells) in page, line
