"""Stage study (not in a plain report: `--stages=env,study`): the long-context study of
``sparse_jax.bench.long_study``, size=gpu trained for equal wall time at context 16,384 (strided,
and dense through cuDNN) and at 4,096 (strided), scored in plain windows, at a matched
guaranteed context, by Table 4's contexts and by copy distance. It needs most of one 8-minute
call, so it runs on its own."""

from __future__ import annotations

import os

from sparse_jax.bench import long_study
from sparse_jax.bench.accelerator.common import emit

# Seconds the stage may take: an 8-minute call less the env stage. The H100 report's preset run
# spent 52 s in train.py beyond its steps (start-up, data, 15 s of compilation, validation,
# checkpoint); here each run also calibrates (~20 s) and scores the test part up to 6 times.
CAP, DRY_CAP = 450, 240


def plan(dry_run: bool) -> dict:
    return long_study.plan(dry_run)


def run(plan: dict) -> dict:
    """The study in its own scratch folder beside the preset's run."""
    workdir = os.path.join(os.path.dirname(plan["workdir"]), "study")
    return long_study.run({**plan["study"], "deadline": plan["deadline"], "workdir": workdir},
                          emit)


def check(result: dict, plan: dict) -> tuple[str, str] | None:
    return long_study.check(result, plan.get("study"))


def summary(report: dict) -> list[str]:
    result = report["stages"].get("study", {})
    return [*long_study.markdown(result), ""] if result.get("runs") else []
