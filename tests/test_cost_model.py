"""The cost model of the Pallas attention kernels (sparse_jax.bench.cost_model,
scripts/cost_model.py), checked against the committed measurements with no GPU: issue 63's
figures (each row's time within 25% for at least 80% of the rows, the kernels of each report,
pattern and length ranked with a Spearman correlation of at least 0.8), the rows held out of the
fit, physical parameters, the committed results (docs/benchmarks/cost_model) as a fresh fit gives
them, and the designs' feature changes.

The fit reads docs/benchmarks/{h200_2026-11-28,h200,h100} and docs/benchmarks/compiled_h100
(16k and 64k; lengths/: 8k and 32k); a measured row without static figures fails here."""

import json
import os
import subprocess
import sys

import pytest

from sparse_jax.bench import cost_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def result():
    return cost_model.calibrate()


def _row(r):
    return (f"{r['report']} {r['pattern']} n={r['n']}: measured {r['ms']:.3g} ms, predicted "
            f"{r['predicted_ms']:.3g} ms ({r['ratio']:.2f})")


def test_every_measured_pallas_row_is_read_with_its_static_figures():
    rows = cost_model.measured_rows()
    counts = {}
    for r in rows:
        counts[r["report"]] = counts.get(r["report"], 0) + 1
    # the 2026-11-28 report's 23 rows less its 4 cuDNN rows; 2026-11-26: the 4 lengths' two
    # defaults; the H100's 8 defaults and its two 16k tiles (two fixed tiles not run)
    assert counts == {"h200_2026-11-28": 19, "h200_2026-11-26": 8, "h100_2026-11-27": 10}
    assert {r["device"] for r in rows} == {"NVIDIA H200", "NVIDIA H100"}
    static = cost_model.static_rows()
    assert {(r["pattern"], r["n"]) for r in rows} <= set(static)
    for (pattern, _), row in static.items():  # the tiles the model reads are the compile's
        for k in row["kernels"]:  # (a gathered dk/dv kernel's own tiles: its dkvQxK option)
            if "block_q" in k and not (":dkv" in pattern and k["name"] == "sparse_dkv_gathered"):
                assert (k["block_q"], k["block_k"]) == cost_model._tiles(pattern), (pattern, k)


def test_the_model_meets_issue_63s_figures(result):
    rows = result["rows"]
    misses = [_row(r) for r in rows if not r["within"]]
    assert result["within"] >= cost_model.TARGET_SHARE, misses
    # reached on 2026-11-28's data: 35 of 37 rows; the two misses are 8k rows whose own runs
    # spread 59-68% (min to max over their median)
    assert len(misses) <= 2, misses
    for g in result["groups"]:
        assert g["spearman"] >= cost_model.TARGET_SPEARMAN, (g, [
            _row(r) for r in rows if (r["report"], r["pattern"].split(":")[0], r["n"])
            == (g["report"], g["pattern"], g["n"])])
    assert len([g for g in result["groups"] if g["rows"] >= 3]) == 4
    assert all(g["fastest"] == g["predicted_fastest"] for g in result["groups"])


def test_the_rows_held_out_of_the_fit(result):
    held = [r for r in result["rows"] if r["held_out"]]
    print("\nheld out of the fit:\n" + "\n".join(map(_row, held)))
    assert {(r["pattern"], r["n"]) for r in held} == set(cost_model.HELD_OUT)
    assert len(held) == result["held_out_rows"] == 7
    assert result["fitted_rows"] == len(result["rows"]) - 7
    assert all(r["within"] for r in held), [_row(r) for r in held]


def test_the_parameters_are_physical_and_the_fit_repeats(result):
    p = result["params"]
    assert set(p) == {name for name, _, _, _ in cost_model.PARAMS}
    assert all(v > 0 for v in p.values())
    assert p["rate"] <= cost_model.PEAK_TFLOPS / cost_model.SMS * (1 + 1e-9)  # at most peak
    assert 1 < p["launch"] < 50 and 0.1 < p["per_tile"] < 10  # µs
    again = cost_model.calibrate(starts=24)
    assert again["params"] == pytest.approx(p, rel=1e-6)


def test_the_committed_results_are_a_fresh_fits(result):
    with open(os.path.join(ROOT, "docs", "benchmarks", "cost_model", "results.json")) as f:
        committed = json.load(f)
    assert committed["params"] == pytest.approx(result["params"], rel=1e-3)
    assert [r["predicted_ms"] for r in committed["rows"]] == pytest.approx(
        [r["predicted_ms"] for r in result["rows"]], rel=1e-3)
    assert committed["within"] == result["within"]


def test_spearman_with_ties():
    assert cost_model.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert cost_model.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    assert cost_model.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert cost_model.spearman([1, 2, 2], [1, 2, 3]) == pytest.approx(0.866, abs=1e-3)


def test_designs_change_what_they_say_and_are_predicted_faster(result):
    static = cost_model.static_rows()
    f = cost_model.features(static[("strided:128@pallas:chained", 16384)],
                            "strided:128@pallas:chained")
    one = cost_model._one_pass(f)
    assert len(one["kernels"]) == 3 and sum(k["tiles"] for k in one["kernels"]) == pytest.approx(
        sum(k["tiles"] for k in f["kernels"]))
    persistent = cost_model._persistent(f)
    for before, after in zip(f["kernels"], persistent["kernels"]):
        assert after["programs"] <= cost_model.SMS * after["blocks_per_sm"]
        assert after["programs"] * after["tiles"] == pytest.approx(
            before["programs"] * before["tiles"])  # the same work, in fewer programs
    designs = cost_model.what_if(result["params"])
    assert len(designs) == 18 and all(d["gain"] > 1 for d in designs)


def test_the_program_of_a_row_breaks_down_into_shares_that_sum_to_one(result):
    shares = cost_model.breakdown(result["params"], "fixed:128:32@pallas", 65536)
    assert sum(v for k, v in shares.items() if k != "ms") == pytest.approx(1.0)
    assert shares["tiles"] > 0.5  # fixed at 64k: the summary tiles' latency


@pytest.mark.slow
def test_the_script_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "cm" / "results.json"
    proc = subprocess.run([sys.executable, "scripts/cost_model.py", f"--output_json={out}"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| report | pattern | n | measured ms | predicted ms | ratio | held out |" in proc.stdout
    assert "Spearman" in proc.stdout and "Within 25%: 35 of 37 rows" in proc.stdout
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 37 and data["held_out_rows"] == 7
    assert (tmp_path / "cm" / "results.md").read_text().startswith("# The cost model's fit")
