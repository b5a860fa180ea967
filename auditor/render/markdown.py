"""Markdown for a pull-request comment."""

from __future__ import annotations

from tokaudit.render.text import factor_text, printable, ratio_text, steps_text
from tokaudit.report import AuditReport

ICONS = {"correct": "✅", "incorrect": "❌", "inconclusive": "❔", "error": "❌", "warning": "⚠️", "info": "ℹ️"}


def _cell(text: str) -> str:
    return printable(text).replace("|", "\\|").replace("`", "'")


def render_markdown(report: AuditReport) -> str:
    lines = ["## tokaudit", ""]
    if report.runs:
        lines += ["| run | steps | ranks | W | normalization | max weight ratio | verdict |",
                  "|---|---:|---:|---|---|---:|---|"]
        for run in report.runs:
            norm = run.normalization
            lines.append(f"| `{_cell(run.run)}` | {run.steps} | {run.ranks} | {', '.join(map(str, run.world_size))} "
                         f"| {_cell(factor_text(norm))} | {ratio_text(run.max_weight_ratio)} "
                         f"| {ICONS[run.verdict]} {run.verdict} |")
        lines.append("")
    if report.findings:
        lines += ["| severity | run | code | steps | finding | fix |", "|---|---|---|---|---|---|"]
        for f in report.findings:
            lines.append(f"| {ICONS[f.severity.value]} {f.severity.value} | `{_cell(f.run)}` | `{f.code.value}` "
                         f"| {steps_text(f.steps)} | {_cell(f.message)} | {_cell(f.fix)} |")
        lines.append("")
    elif report.runs:
        lines += ["No findings.", ""]
    for problem in report.problems:
        lines.append(f"- ❌ unreadable: `{_cell(problem)}`")
    return "\n".join(lines).rstrip() + "\n"
