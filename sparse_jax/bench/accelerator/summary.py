"""results.md: the verdict (every stage ok, the stages that are not, the stages skipped), the
stages' table (status, and why when not ok), then each stage's section."""

from __future__ import annotations

from sparse_jax.bench.accelerator.common import fmt
from sparse_jax.bench.accelerator.plan import MODULES

OK = ("ok", "skipped")


def not_ok(report: dict) -> list[str]:
    """"stage (status: why)" for every stage that is neither ok nor skipped."""
    return [f"{name} ({r.get('status')}" + (f": {r['reason']}" if r.get("reason") else "") + ")"
            for name, r in report["stages"].items() if r.get("status") not in OK]


def skipped(report: dict) -> list[str]:
    """"stage skipped: why" for every stage asked for that had nothing to measure here (flex
    without torch)."""
    return [f"{name} skipped: {r.get('skipped') or r.get('reason') or 'no reason given'}"
            for name, r in report["stages"].items() if r.get("status") == "skipped"]


def measured_nothing(report: dict) -> bool:
    """Whether the stages asked for measured nothing: every one was skipped, or every one but
    env, which describes the machine and measures nothing of the project (env asked for alone
    measured what it was asked for)."""
    stages = report["stages"]
    measuring = {n: r for n, r in stages.items() if n != "env"} or stages
    return bool(measuring) and all(r.get("status") == "skipped" for r in measuring.values())


def verdict(report: dict) -> tuple[bool, str]:
    """(ok, one line): "every stage ok"; "every other stage ok; not every stage measured: flex
    skipped: why" (ok: what was measured is whole); "not ok: no stage measured anything (...)"
    when `measured_nothing`; else "not ok: " and each stage that is not, with why."""
    bad, skips = not_ok(report), skipped(report)
    gaps = f"not every stage measured: {'; '.join(skips)}" if skips else ""
    if bad:
        return False, f"not ok: {'; '.join(bad)}" + (f"; {gaps}" if gaps else "")
    if measured_nothing(report):
        return False, f"not ok: no stage measured anything ({'; '.join(skips)})"
    return True, f"every other stage ok; {gaps}" if gaps else "every stage ok"


def summary_markdown(report: dict) -> str:
    """The report's tables: the device, the stages, then each stage's own section."""
    stages = report["stages"]
    lines = [f"# Accelerator report{' (dry run on a CPU)' if report['dry_run'] else ''}", "",
             f"{report['started']} to {report.get('finished', '—')}; command: "
             f"`{report['command']}`", ""]
    lines += MODULES["env"].summary(report)
    if report.get("interrupted"):
        lines += [f"**Interrupted by {report['interrupted']}**: the stages after the one it "
                  "stopped did not run.", ""]
    _, line = verdict(report)
    line = line[0].upper() + line[1:] + "."
    lines += [line if line == "Every stage ok." else f"**{line}**", "",
              "| stage | status | seconds | note |", "|---|---|---|---|"]
    for name, result in stages.items():
        note = "; ".join(x for x in (result.get("note"), result.get("reason"),
                                     result.get("skipped")) if x)
        lines.append(f"| {name} | {fmt(result.get('status'))} | "
                     f"{result.get('seconds', 0):.0f} | {note} |")
    lines.append("")
    lines += prediction_lines(report)
    for name, module in MODULES.items():  # each returns [] without its figures
        if name != "env":
            lines += module.summary(report)
    return "\n".join(lines).rstrip("\n") + "\n"


def prediction_lines(report: dict) -> list[str]:
    """How the committed predictions held (``predictions.verdict``), or why none were read."""
    from sparse_jax.bench import predictions

    left_out = [f"Predictions not read: {e}" for e in (report.get("predictions") or {}).get(
        "errors", ())]
    stages = report["stages"]
    measured = [("attention", r["pattern"], r["seq_len"], r["median_ms"])
                for r in stages.get("attention", {}).get("rows", []) if "median_ms" in r]
    measured += [("train_step", r["name"], None, r["step_s"] * 1e3)
                 for r in stages.get("train_step", {}).get("rows", []) if "step_s" in r]
    return predictions.verdict(report.get("predictions"), measured, stages.get(
        "env", {}).get("device_kind")) + ([*left_out, ""] if left_out else [])
