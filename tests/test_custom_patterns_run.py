"""A pattern defined in a file outside the package, named on the command line: it trains, resumes,
evaluates, samples and reports its attention statistics, and a run whose definition changed is
refused in one line."""

import importlib
import json
import os
import subprocess
import sys

import pytest

import configs
from sparse_jax import attention_stats, evaluate, sample, train
from sparse_jax.model import config as model_config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RULE = """from sparse_jax.attention import custom


def longformer(window=16, globals=4, block=8):
    return custom.from_rule(lambda q, k: (k <= q) & ((q - k < window) | (k < {GLOBALS})),
                            block=block, name=f"longformer({window}, {globals})")
"""
PATTERN = "mine:longformer(window=12)"
TINY = {"data.embedded_bytes": 20_000, "model.seq_len": 64, "model.num_layers": 2,
        "model.d_model": 16, "model.num_heads": 2, "batch_size": 4, "eval_every": 2,
        "checkpoint_every": 2, "log_every": 2, "eval_batches": 2,
        "optimizer.warmup_steps": 1, "model.pattern": PATTERN}


def _define(folder, globals_expr):
    (folder / "mine.py").write_text(RULE.replace("{GLOBALS}", globals_expr))
    sys.modules.pop("mine", None)
    importlib.invalidate_caches()
    model_config_lib.named_pattern.cache_clear()
    model_config_lib.named_fingerprint.cache_clear()


@pytest.mark.slow  # starts another process
def test_user_pattern_trains_resumes_evaluates_samples_and_reports(tmp_path, monkeypatch):
    mods = tmp_path / "mods"
    mods.mkdir()
    _define(mods, "globals")
    monkeypatch.syspath_prepend(str(mods))
    workdir = str(tmp_path / "run")
    flags = [f"--config.{k}={v}" for k, v in {**TINY, "total_steps": 2}.items()]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(mods), ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "train.py"),
                           f"--config={os.path.join(ROOT, 'configs', 'quickstart.py')}:"
                           "data=embedded,pattern=dense", f"--workdir={workdir}", *flags],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "pattern longformer(12, 4)" in proc.stdout
    with open(os.path.join(workdir, "config.json")) as f:
        recorded = json.load(f)["model"]
    assert recorded["pattern"] == PATTERN and len(recorded["pattern_fingerprint"]) == 16

    config = configs.load("quickstart:data=embedded,pattern=dense", {**TINY, "total_steps": 4})
    assert train.train(config, workdir)["step"] == 4  # resumed from step 2
    result = evaluate.evaluate(workdir, "valid", progress=False)
    assert 0 < result["bits"] < 9
    out = sample.sample(workdir, num_samples=1, length=70, prompt="to be")  # past the context
    assert out["samples"][0].startswith(b"to be") and len(out["samples"][0]) == 5 + 70
    stats = attention_stats.attention_stats(workdir, "valid", windows=1, progress=False)
    terms = {name for layer in stats["layers"] for head in layer["heads"]
             for name in head["terms"]}
    assert terms == {"local", "tiles"}

    _define(mods, "globals + 1")  # the definition changes: every reader refuses, in one line
    config = configs.load("quickstart:data=embedded,pattern=dense", {**TINY, "total_steps": 6})
    with pytest.raises(ValueError, match="model.pattern_fingerprint") as e:
        train.train(config, workdir)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="its definition changed since this config was "
                                         "recorded") as e:
        evaluate.evaluate(workdir, "valid", progress=False)
    assert "\n" not in str(e.value)
