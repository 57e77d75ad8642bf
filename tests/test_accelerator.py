"""The accelerator report (scripts/accelerator_report.py): its dry run end to end on the CPU, so
that a renamed flag, a moved function or a broken import fails here and not on the day a GPU
is lent; FlexAttention's mask against the pattern; the report's arguments."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from sparse_jax.bench import accelerator
from sparse_jax.patterns import PatternSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_dry_run_runs_every_stage_and_writes_the_report(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "scripts/accelerator_report.py", "--dry_run",
                           f"--output_dir={out}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "results.json").read_text())
    assert list(report["stages"]) == list(accelerator.STAGES)
    for name, stage in report["stages"].items():
        torch_missing = name == "flex" and "torch is not installed" in stage.get("skipped", "")
        assert stage["status"] == "ok" or torch_missing, (name, stage, proc.stdout[-3000:])
    stages = report["stages"]
    assert stages["tests"]["counts"]["passed"] >= 1 and stages["tests"]["counts"]["failed"] == 0
    assert all("median_ms" in r for r in stages["attention"]["rows"]), stages["attention"]
    assert {r["pattern"].split("@")[1].split(":")[0] for r in stages["attention"]["rows"]} == {
        "xla", "pallas"}
    assert stages["train_step"]["rows"][0]["tokens_per_s"] > 0
    preset = stages["preset"]
    assert preset["steps_done"] == preset["steps"] and preset["test_bits"] > 0
    assert abs(sum(c["share"] for c in preset["test_classes"]["classes"]) - 1) < 1e-6
    files = sorted(os.listdir(out))  # one piece: at most 8 files, no folders
    assert files == ["log.txt", "results.json", "results.md", "sample.txt"]
    assert "| preset | ok |" in (out / "results.md").read_text()


def test_flex_mask_mod_is_the_pattern():
    torch = pytest.importorskip("torch")
    for spec in (PatternSpec("strided", stride=16), PatternSpec("fixed", stride=16, c=4),
                 PatternSpec("strided", stride=12, local_width=30)):
        q, k = torch.arange(100)[:, None], torch.arange(100)[None, :]
        mask = accelerator.flex_mask_mod(spec)(0, 0, q, k)
        assert np.array_equal(mask.numpy(), spec.mask(100))


def test_caps_and_stages_are_checked_before_anything_runs(tmp_path):
    assert accelerator.parse_caps(["tests=150", "flex=90.5"]) == {"tests": 150.0, "flex": 90.5}
    for bad in (["tests"], ["gpu=10"], ["tests=-1"], ["tests=x"]):
        with pytest.raises(ValueError, match="STAGE=SECONDS"):
            accelerator.parse_caps(bad)
    with pytest.raises(ValueError, match="unknown stage"):
        accelerator.run_report(str(tmp_path / "r"), stages=("env", "benchmarks"))
    with pytest.raises(ValueError, match="no such folder"):
        accelerator.run_report(str(tmp_path / "r"), wheels=str(tmp_path / "missing"))
    assert not (tmp_path / "r").exists()  # refused before writing anything


def test_the_full_plan_fits_eight_minutes_and_knows_its_chips():
    assert sum(accelerator.CAPS.values()) <= 480
    plan = accelerator.plan_for(dry_run=False)
    assert plan["attention"]["seq_lens"][0] == 16384  # the goal's length comes first
    names = {c["name"] for c in plan["train_step"]["cases"]}
    assert set(plan["preset"]["preset_cases"]) <= names
    assert accelerator.peak_tflops("NVIDIA H200") == 989.0
    assert accelerator.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert accelerator.peak_tflops("cpu") is None
