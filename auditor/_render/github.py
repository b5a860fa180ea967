"""GitHub Actions: one workflow annotation per finding, and the markdown report as the step summary."""

from __future__ import annotations

import os

from tokaudit._render.markdown import render_markdown
from tokaudit._render.text import printable, steps_text
from tokaudit._report import AuditReport
from tokaudit._schema import UNNAMED

COMMAND = {"error": "error", "warning": "warning", "info": "notice"}


def _data(text: str) -> str:
    """Workflow-command escaping of a message (the runner decodes %25, %0D, %0A)."""
    return printable(text).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def render_annotations(report: AuditReport, fail_on: str = "error") -> str:
    """A run that fails the gate the step exits by (--fail-on) is an error annotation, saying so; the others a
    notice of their verdict."""
    lines = []
    failing = set(report.failing(fail_on))
    for run in report.runs:
        fails = run.run in failing
        said = f"verdict: {run.verdict}" + (f" (fails --fail-on {fail_on})" if fails else "")
        lines.append(f"::{'error' if fails else 'notice'} title={_property(f'tokaudit {run.run}')}::{_data(said)}")
    for f in report.findings:
        title = _property(f"tokaudit {f.code.value} · {f.run}" + (f" · term {f.term}" if f.term != UNNAMED else ""))
        body = _data(f"steps {steps_text(f.steps)}: {f.message} Fix: {f.fix}")
        lines.append(f"::{COMMAND[f.severity.value]} title={title}::{body}")
    for problem in report.problems:
        lines.append(f"::error title=tokaudit unreadable input::{_data(problem)}")
    return "\n".join(lines) + ("\n" if lines else "")


def write_step_summary(report: AuditReport, fail_on: str = "error") -> None:
    """Append the markdown report to $GITHUB_STEP_SUMMARY when the runner provides one."""
    path = os.environ.get("GITHUB_STEP_SUMMARY")
    if not path:
        return
    from tokaudit.errors import UsageError

    try:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(render_markdown(report, fail_on))
    except OSError as error:
        raise UsageError(f"{path}: cannot write the step summary ({error.strerror or error})") from None
