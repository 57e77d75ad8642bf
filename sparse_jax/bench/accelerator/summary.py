"""results.md: the stages' table (status, and why when not ok), then each stage's section."""

from __future__ import annotations

from sparse_jax.bench.accelerator.plan import MODULES

OK = ("ok", "skipped")


def not_ok(report: dict) -> list[str]:
    """"stage (status: why)" for every stage that is neither ok nor skipped."""
    return [f"{name} ({r.get('status')}" + (f": {r['reason']}" if r.get("reason") else "") + ")"
            for name, r in report["stages"].items() if r.get("status") not in OK]


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
    bad = not_ok(report)
    lines += [f"**Not ok: {'; '.join(bad)}.**" if bad else "Every stage ok.", "",
              "| stage | status | seconds | note |", "|---|---|---|---|"]
    for name, result in stages.items():
        note = "; ".join(x for x in (result.get("note"), result.get("reason"),
                                     result.get("skipped")) if x)
        lines.append(f"| {name} | {result.get('status')} | {result.get('seconds', 0):.0f} | "
                     f"{note} |")
    lines.append("")
    for name, module in MODULES.items():  # each returns [] without its figures
        if name != "env":
            lines += module.summary(report)
    return "\n".join(lines).rstrip("\n") + "\n"
