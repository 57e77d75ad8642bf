"""The long-context study (the accelerator report's `study` stage): its dry run end to end on the
CPU, so that the GPU's one call does not fail on a renamed field; the helpers that choose what it
measures; its verdict and its section of results.md; cuDNN's dense attention falling back to XLA
where it cannot run."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import cheap_compile
from sparse_jax import attention
from sparse_jax.attention.spec import PatternSpec
from sparse_jax.bench import long_study
from sparse_jax.bench.accelerator import study as study_stage
from sparse_jax.data import baselines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # starts a process per run
def test_dry_run_measures_every_planned_row(tmp_path):
    # Through the report, as a GPU will run it (--stages=env,study there): the stage's
    # registration, its process, its check and its section of results.md.
    # A cap no loaded machine reaches (the stage's 240 s were a clock: a busy CPU timed the
    # last run out), and no timeout here: the report's own cap bounds the run.
    out = tmp_path / "study"
    # Its cost is compiling toy programs (three runs, each calibrated, trained and scored):
    # compiled cheaply (`cheap_compile`), the same programs.
    proc = subprocess.run([sys.executable, "scripts/accelerator_report.py", "--dry_run",
                           "--stages=study", "--caps=study=86400", f"--output_dir={out}"],
                          cwd=ROOT, capture_output=True, text=True,
                          env=cheap_compile(dict(os.environ)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "results.json").read_text())["stages"]["study"]
    assert result["status"] == "ok", (long_study.missing(result), proc.stdout[-3000:])
    plan = long_study.plan(dry_run=True)
    assert [r["name"] for r in result["runs"]] == [s["name"] for s in plan["runs"]]
    m = plan["matched_context"]
    for row in result["runs"]:
        assert row["steps"] >= 2 and row["valid_bits"] > 0 and row["train_bits"] > 0
        assert [t["min_context"] for t in row["test"]] == row["test_contexts"]
        for t in row["test"]:  # the copy classes split every pass exactly
            classes = t["copy_classes"]
            assert len(classes) == len(plan["copy_edges"]) + 1
            assert abs(sum(c["share"] for c in classes) - 1) < 1e-6
            total = sum(c["bits"] * c["count"] for c in classes if c["count"])
            assert total / sum(c["count"] for c in classes) == pytest.approx(t["bits"], 1e-5)
    long_rows = [r for r in result["runs"] if r["seq_len"] == plan["long"]]
    assert len(long_rows) == 2 and all(len(r["test"]) == 6 for r in long_rows)
    text = (out / "results.md").read_text()
    # what bounded each run, from its own figures: at 3,600 s of wall time, the 4-step cap
    assert {row["bound"] for row in result["runs"]} == {long_study.STEP_CAP}
    assert "each run capped at 4 steps" in text and "s of wall time from its start" not in text
    for row in result["runs"]:  # each run's line: steps, plain and matched bits
        line = next(x for x in text.splitlines() if x.startswith(f"| {row['name']} |"))
        assert f"| {row['steps']:,} |" in line
        for context in (0, m):
            assert f"{long_study.test_row(row, context)['bits']:.4f}" in line
    assert "Table 4" in text and f"test ≥ {m}" in text
    for name in baselines.copy_class_names(plan["copy_edges"]):
        assert f"| {name} |" in text
    for row in result["runs"]:  # where each model looks: mass beyond the edges it can reach
        far = row["attention"]["far"]
        assert list(far) == [str(e) for e in plan["copy_edges"] if e < row["seq_len"] - 1]
        for f in far.values():
            assert len(f["mean"]) == 1 and 0 <= f["mean"][0] <= f["max"][0] <= 1
            assert 0 < f["uniform"][0] < 1
    assert "Attention beyond" in text and f"| long sparse | {plan['short']} |" in text
    assert f"Beyond the short model's context ({plan['short']} bytes): long sparse puts" in text


def test_what_the_real_plan_measures():
    plan = long_study.plan(dry_run=False)
    assert long_study.matched_context(plan["short"]) == plan["matched_context"] == 2048
    assert long_study.table4_contexts(16384, 2048) == [0, 1024, 2048, 4096, 8192, 14336]
    assert plan["copy_edges"] == [512, 4096, 16384]
    runs = {r["name"]: r for r in plan["runs"]}
    assert [n for n, r in runs.items() if not r["optional"]] == [
        "short sparse", "long sparse", "long dense"]
    tokens = {r["overrides"]["batch_size"] * r["overrides"]["model.seq_len"] for r in runs.values()}
    assert tokens == {65536}  # the same bytes every step
    assert runs["long sparse"]["overrides"]["model.stride"] == 128  # l = sqrt(16,384)
    assert runs["short sparse"]["test_contexts"] == [0, 2048]
    # every run loads and checks as a config before a GPU is asked for anything
    for spec in plan["runs"]:
        config = long_study.run_config(plan, spec, os.path.join(ROOT, long_study.CODE_CORPUS))
        assert config.model.seq_len == spec["overrides"]["model.seq_len"]
        assert config.model.num_layers == 8 and config.model.d_model == 512
    # the runs' share of the stage: each run's budget and overhead fit its cap
    required = [r for r in plan["runs"] if not r["optional"]]
    assert len(required) * plan["need_s"] <= study_stage.CAP
    assert plan["run_seconds"] < plan["need_s"]


def test_copy_classes_reach_the_long_context():
    # a 20-byte phrase repeated 300 and then 5,000 bytes later: its bytes after the first 12
    # fall in the 1-512 class the first time and in 4,097-16,384 the second
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 12_000, dtype=np.uint8)
    phrase = rng.integers(0, 256, 20, dtype=np.uint8)
    for at in (1000, 1300, 6300):
        data[at:at + 20] = phrase
    classes = baselines.copy_classes(data, long_study.copy_edges(4096, 16384), k=12)
    assert set(classes[1312:1320]) == {0} and set(classes[6312:6320]) == {2}
    assert baselines.copy_class_names([512, 4096, 16384])[2] == "copy 4,097-16,384 back"


def _row(name, contexts, **extra):
    test = [{"min_context": c, "bits": 1.0 + c / 1e5, "num_scored": 10, "wall_s": 0.1,
             "copy_classes": [{"name": "copy 1-8 back", "share": 1.0, "count": 10,
                               "bits": 1.0}]} for c in contexts]
    return {"name": name, "optional": False, "seq_len": 256, "pattern": "strided",
            "batch_size": 2, "test_contexts": contexts, "steps": 4, "valid_bits": 1.2,
            "train_bits": 1.1, "test": test, "phase": "done", **extra}


def test_verdict_names_what_was_not_measured():
    result = {"config": "c", "run_seconds": 30, "matched_context": 32,
              "runs": [_row("long sparse", [0, 16, 32]), _row("short sparse", [0, 32])]}
    assert long_study.check(result) is None
    cut = json.loads(json.dumps(result))
    cut["runs"][1]["test"] = cut["runs"][1]["test"][:1]  # the matched pass never ran
    assert long_study.check(cut)[0] == "partial" and "[32]" in long_study.check(cut)[1]
    cut["runs"].append({"name": "long dense", "optional": False, "seq_len": 256,
                        "pattern": "dense", "batch_size": 2, "test_contexts": [0, 32],
                        "error": long_study.TIME_UP})
    assert "long dense" in long_study.check(cut)[1]
    assert "long dense (not run" in "\n".join(long_study.markdown(cut))
    # an optional run skipped or cut for time leaves the verdict alone
    result["runs"].append({**_row("long fixed", [0, 32]), "optional": True, "test": [],
                           "error": "stopped at its 5 s cap (stage time up)"})
    assert long_study.check(result) is None
    failed = {"runs": [{"name": "x", "optional": False, "test_contexts": [0], "error": "boom"}]}
    assert long_study.check(failed)[0] == "failed"


def test_dense_attention_on_a_gpu_falls_back_to_xla_without_cudnn(monkeypatch):
    q, k, v = (jax.random.normal(key, (1, 96, 2, 64)) for key in jax.random.split(
        jax.random.key(0), 3))
    reference = attention.sparse_attention(q, k, v, PatternSpec("dense"), "xla")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # cuDNN refuses here: XLA
    out = attention.sparse_attention(q, k, v, PatternSpec("dense"), "pallas")
    np.testing.assert_allclose(out, reference, atol=1e-5)
    assert jnp.isfinite(out).all()


def test_the_attention_table_says_where_each_run_looks():
    """Each run's attention beyond each copy edge, per layer (mean over heads, largest head),
    "—" past a run's context, a run whose statistics failed named with why; and the sentence
    on the reach beyond the short context, from the figures."""
    def far(*edges):
        return {str(e): {"mean": [0.001 * e, 0.002 * e], "max": [0.01, 0.02 * e],
                         "uniform": [0.5, 0.25]} for e in edges}

    result = {"config": "c", "run_seconds": 30, "matched_context": 32, "copy_edges": [8, 64, 256],
              "runs": [_row("short sparse", [0, 32], attention={"windows": 2, "far": far(8)}),
                       _row("long sparse", [0, 32], attention={"windows": 2, "far": far(8, 64)}),
                       _row("long dense", [0, 32], attention={"error": "boom"})]}
    text = "\n".join(long_study.markdown(result))
    assert "| run | beyond | layer 0 | layer 1 |" in text
    assert "| short sparse | 8 | 0.0080 / 0.010 / 0.500 | 0.0160 / 0.160 / 0.250 |" in text
    assert "| short sparse | 64 | — | — |" in text and "| long sparse | 256 |" not in text
    assert "| long sparse | 64 | 0.0640 / 0.010 / 0.500 | 0.1280 / 1.280 / 0.250 |" in text
    assert "| long dense (not measured: boom) |" in text
    assert ("Beyond the short model's context (64 bytes): long sparse puts at most 12.80% of a "
            "layer's attention there (layer 1, 25.00% by chance; its most far-looking head "
            "128.00%).") in text
    assert "Attention beyond" not in "\n".join(long_study.markdown(
        {**result, "runs": [_row("x", [0, 32])]}))


def test_no_time_left_runs_nothing_and_says_so(tmp_path):
    plan = {**long_study.plan(dry_run=True), "workdir": str(tmp_path), "deadline": 0.0}
    emitted = []
    result = long_study.run(plan, emitted.append)  # every config checked, nothing started
    assert emitted and all(long_study.TIME_UP in r["error"] for r in result["runs"])
    assert long_study.check(result)[0] == "failed"
    assert not [n for n in os.listdir(tmp_path) if n != "code_head.py"]
    assert jax.default_backend() == "cpu"  # the stage's own process keeps off the accelerator


def test_the_text_says_what_bounded_the_runs_from_their_own_figures():
    assert long_study.bounded_steps(300, 2, 4) == (4, long_study.STEP_CAP)
    assert long_study.bounded_steps(3, 2, 4) == (3, long_study.WALL_TIME)
    assert long_study.bounded_steps(1, 2, 4) == (2, long_study.STEP_FLOOR)
    base = {"config": "c", "run_seconds": 120, "min_steps": 2, "max_steps": 4,
            "matched_context": 32}

    def text(*rows):
        return "\n".join(long_study.markdown({**base, "runs": list(rows)}))

    capped = [_row(name, [0, 32], bound=long_study.STEP_CAP, time_steps=held, wall_s=wall)
              for name, held, wall in (("short sparse", 900, 19.2), ("long sparse", 400, 28.4))]
    said = text(*capped)  # every run capped at steps: equal steps, not equal time
    assert ("each run capped at 4 steps, fewer than its 120 s of wall time held (400–900 "
            "steps): equal steps, not equal time; training took 19–28 s") in said
    assert "s of wall time from its start" not in said and "| 4 | step cap |" in said
    timed = [{**r, "bound": long_study.WALL_TIME} for r in capped]
    assert "each run 120 s of wall time from its start" in text(*timed)
    mixed = text(capped[0], timed[1])
    assert "the cap of 4 steps (short sparse); 120 s of wall time (long sparse)" in mixed
    assert "each run" not in mixed
    # no run trained: no claim about their time at all
    cut = {"name": "long dense", "optional": False, "seq_len": 256, "pattern": "dense",
           "batch_size": 2, "test_contexts": [0, 32], "error": long_study.TIME_UP}
    said = text(cut, {**cut, "name": "short sparse"})
    assert "no run trained (each row says why)" in said
    assert "wall time" not in said and "capped" not in said
    assert "None" not in said and "| — | — |" in said
