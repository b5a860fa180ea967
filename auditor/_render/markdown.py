"""Markdown for a pull-request comment or a CI step summary: a one-line summary, the runs, then one
`<details>` per finding. The first line is a stable marker a bot can find to update its comment."""

from __future__ import annotations

import html
import re

from tokaudit._render.text import factor_text, finding_counts, many, printable, q_range_text, ratio_text, reported_note
from tokaudit._render.text import steps_text, verdict_counts
from tokaudit._report import AuditReport
from tokaudit._schema import UNNAMED

MARKER = "<!-- tokaudit-report -->"
ICONS = {"correct": "✅", "incorrect": "❌", "inconclusive": "❔", "error": "❌", "warning": "⚠️", "info": "ℹ️"}


def _in_table(text: str) -> str:
    """Text printed literally, its pipes escaped: inside a table cell (a code span's too), a pipe ends the cell."""
    return printable(text).replace("|", "\\|")


def _cell(text: str) -> str:
    return _in_table(text).replace("`", "'")


def _code(text: str, in_table: bool = True) -> str:
    """Text from the log as a code span, its characters kept (a run id copied from it works in --run): delimited by
    one backtick more than its longest run of them, padded where it begins or ends with one (CommonMark); its pipes
    escaped `in_table` (elsewhere a backslash would show)."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{_in_table(text) if in_table else printable(text)}{pad}{fence}"


def _literal(text: str) -> str:
    """Text that holds the log's (a run, group or file name in a message) printed literally in a paragraph, one line
    (`printable`): each character that can begin markup backslash-escaped, as CommonMark allows for any ASCII
    punctuation (a link or image needs its `[`, emphasis `*` or a `_` at a word's edge, code a backtick, HTML `<`, an
    entity `&`, an @mention or e-mail `@`, an autolink or :emoji: a `:` before a non-space, math `$`), and `www.`'s
    dot (GitHub's autolink of it); the rest, parentheses, commas, slashes, is left as it reads."""
    escaped = re.sub(r"([\\`*\[\]<>#|~@&$])", r"\\\1", printable(text))
    # an underscore inside a word opens no emphasis (n_r), a colon before a space no autolink or emoji
    escaped = re.sub(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])|:(?=\S)", r"\\\g<0>", escaped)
    return re.sub(r"(?i)\b(www)\.", r"\1\\.", escaped)


def summary_line(report: AuditReport, fail_on: str = "error") -> str:
    """The verdicts and findings in a line, and whether the gate the command exits by (--fail-on) fails."""
    verdicts = [run.verdict for run in report.runs]
    worst = "incorrect" if "incorrect" in verdicts else "inconclusive" if "inconclusive" in verdicts else "correct"
    if report.problems or not report.runs:  # input that fails the command (exit 2) is never a green line
        worst = "error"
    line = f"{ICONS[worst]} **tokaudit**: {verdict_counts(report)}; {finding_counts(report)}"
    if report.problems:
        line += f"; {many(len(report.problems), 'unreadable input')}"
    failing = report.failing(fail_on)
    gate = f"fails on {many(len(failing), 'run')}" if failing else "passes"
    return line + f" — the gate (--fail-on {fail_on}) {gate}" + ("" if not report.problems else ", and the input fails")


def render_markdown(report: AuditReport, fail_on: str = "error") -> str:
    lines = [MARKER, summary_line(report, fail_on), ""]
    if report.runs:
        lines += [
            "| run | verdict | steps | ranks | W | D | normalization | q = e·N | max ratio |",
            "|---|---|---:|---:|---|---|---|---|---:|",
        ]
        for run in report.runs:
            q = q_range_text(run, " – ")
            lines.append(
                f"| {_code(run.run)} | {ICONS[run.verdict]} {run.verdict}{reported_note(run)} | {run.steps} | {run.ranks} "
                f"| {', '.join(map(str, run.world_size))} | {', '.join(f'{d:g}' for d in run.divisors)} "
                f"| {_cell(factor_text(run))} | {q} | {ratio_text(run.max_weight_ratio)} |"
            )
        lines += [
            "",
            "q = e·N is each valid token's weight relative to 1/N (1 when correct); max ratio is the "
            "largest ratio between two tokens' weights in one step.",
            "",
        ]
    for f in report.findings:
        # names in code elements: no markup, and no @mention, comes of them
        term = f" · term <code>{html.escape(printable(f.term))}</code>" if f.term != UNNAMED else ""
        lines += [
            f"<details><summary>{ICONS[f.severity.value]} <b>{f.severity.value}</b> <code>{f.code.value}</code> "
            f"· <code>{html.escape(printable(f.run))}</code>{term} · steps {steps_text(f.steps)}</summary>",
            "",
            _literal(f.message),
            "",
            f"**Fix:** {_literal(f.fix)}",
            "",
            *([f"```python\n{f.fix_code}\n```", ""] if f.fix_code else []),
            f"`tokaudit explain {f.code.value}` derives it.",
            "",
            "</details>",
            "",
        ]
    if report.runs and not report.findings:
        lines += ["No findings.", ""]
    for problem in report.problems:
        lines.append(f"- ❌ unreadable: {_code(problem, in_table=False)}")
    return "\n".join(lines).rstrip() + "\n"
