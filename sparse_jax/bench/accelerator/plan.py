"""Which stages there are, in the order a report runs them, their caps and their sizes.

Every stage is one module of this package with the same names:

  CAP, DRY_CAP      its time cap in seconds, for the full plan and for --dry_run
  plan(dry_run)     its sizes: plan_for puts them under the stage's name
  run(plan)         runs it, in its own process (`python -m sparse_jax.bench.accelerator STAGE
                    PLAN_JSON`), given the whole plan; returns its results, and prints them as
                    JSON lines as they come (`common.emit`), so a cap keeps what was measured
  check(result, plan)  None when it measured everything it planned, else ("partial" |
                    "failed", one line saying why): what keeps the report from saying "ok"
  summary(report)   its section of results.md, as lines ([] for none)
  inputs(report)    optional: what it needs of the stages before it, merged into its plan

To add a stage, write its module, import it here and put it in MODULES where it runs; add its
name to STAGES too if a plain report runs it (otherwise `--stages=...,NAME` does).
"""

from __future__ import annotations

from sparse_jax.bench.accelerator import (
    attention,
    counters,
    env,
    flex,
    million,
    preset,
    study,
    tests,
    train_step,
)

# Every stage, in the order a report runs them.
MODULES = {"env": env, "tests": tests, "attention": attention, "counters": counters,
           "flex": flex, "train_step": train_step, "million": million, "preset": preset,
           "study": study}
# What a report runs without --stages: what the next loan measures (the kernels against their
# goals, their counters, the model's steps, a million bytes on one GPU). The caps sum to 535 s,
# under the 9 minutes a call may take: the H100 and H200 reports' stage times (2026-11-27/28)
# and what the rows their caps cut would have taken, and the new rows' estimates (see each
# stage's CAP). flex and preset
# (FlexAttention on the same masks; the one-GPU preset trained ~3 minutes) were measured on
# 2026-11-28 and run with --stages=...,flex,preset.
STAGES = ("env", "tests", "attention", "counters", "train_step", "million")  # "study": alone
CAPS = {name: module.CAP for name, module in MODULES.items()}
DRY_CAPS = {name: module.DRY_CAP for name, module in MODULES.items()}


def plan_for(dry_run: bool) -> dict:
    """Every stage's sizes. The real plan targets one GPU; the dry run is the same code at toy
    sizes on a CPU (the Pallas kernels in interpret mode, FlexAttention uncompiled)."""
    return {"dry_run": dry_run, **{name: m.plan(dry_run) for name, m in MODULES.items()}}
