"""Every rich table tokaudit prints: the check report, per-record weights, the loss curve."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import pandas as pd
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from tokaudit._render.text import factor_text, finding_counts, many, printable, q_range_text, ratio_text, reported_note
from tokaudit._render.text import steps_text, verdict_counts
from tokaudit._report import AuditReport, Finding, RunSummary

if TYPE_CHECKING:
    from tokaudit._postmortem import ProbeQ

VERDICT_STYLE = {"correct": "bold green", "incorrect": "bold red", "inconclusive": "bold yellow"}
SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


WIDE = 100
"""Below this many columns, each run is a block instead of a table row (and above it too when the table
would not fit): names and verdicts never vanish or fold."""
BRIEF_RUNS = 8
"""Above this many runs, each finding is its header and the gist of its message (a folder of many runs reads on
a screen or two; `--run` gives one run in full)."""
LEGEND = (
    "q = e·N: each valid token's weight relative to 1/N (1 when correct) · max ratio: the largest ratio "
    "between two tokens' weights in one step · steps a–b (n): first and last affected step (how many)"
)


def _divisors(run: RunSummary) -> str:
    return ", ".join(f"{d:g}" for d in run.divisors) or "–"


def render_report(report: AuditReport, console: Console) -> None:
    """Run summary, then findings most severe first, each with its numbers and its fix (above BRIEF_RUNS runs,
    each run on one line where it fits and each finding in brief)."""
    brief = len(report.runs) > BRIEF_RUNS
    if report.runs:
        console.print(Text("tokaudit: token-loss normalization", style="bold"))
        table = _runs_table(report, console) if console.width >= WIDE else None
        if table is not None:
            console.print(table)
        else:
            for run in report.runs:
                _print_run(run, brief, console)
        console.print(Text(LEGEND, style="dim"))
        console.print()
    if report.findings:
        heading = Text("findings, most severe first", style="bold")
        heading.append(" (`tokaudit explain CODE` derives each)", style="dim")
        console.print(heading)
        for f in report.findings:
            _print_finding(f, brief, console)
        if brief:
            console.print(
                Text(
                    f"{len(report.runs)} runs: each finding in brief; `tokaudit check PATHS --run RUN` "
                    "gives a run's findings in full, with their numbers and fixes (so do --format html "
                    "and markdown).",
                    style="dim",
                )
            )
            console.print()
    elif report.runs:
        console.print("No findings." if not ignored_note(report) else "No findings listed.", style="green")
    for note in (ignored_note(report), below_ratio_note(report)):
        if note:
            console.print(Text(note, style="yellow"))
    if report.runs:
        console.print(summary_line(report), markup=False)


def _print_run(run: RunSummary, brief: bool, console: Console) -> None:
    """A run's verdict, then its normalization and shape on the next line (on the same line where it fits and
    there are many runs)."""
    head = Text(printable(run.run), style="bold")
    head.append(": ")
    head.append(run.verdict, style=VERDICT_STYLE[run.verdict])
    head.append(reported_note(run))
    line = (
        (
            f"{factor_text(run)} · q {q_range_text(run)} · max ratio "
            f"{ratio_text(run.max_weight_ratio)} · {run.steps} steps, {run.ranks} ranks, W "
            f"{', '.join(map(str, run.world_size))}, D {_divisors(run)}"
        )
        if run.steps
        else f"{factor_text(run)}: every step left out (see the findings)"
    )
    if brief and head.cell_len + 3 + len(line) <= console.width:
        head.append(f" · {line}")  # many runs: one line each where it fits
        console.print(head)
        return
    console.print(head)
    console.print(Padding(Text(line), (0, 0, 0, 2)))


def _print_finding(f: Finding, brief: bool, console: Console) -> None:
    """A finding's severity, code, run and steps, then its message and fix (its gist alone when `brief`)."""
    header = Text()
    header.append(f"{f.severity.value:<8}", style=SEVERITY_STYLE[f.severity.value])
    header.append(f" {f.code.value}", style="bold")
    header.append(f"  {printable(f.run)}  steps {steps_text(f.steps)}", style="dim")
    console.print(header)
    if brief:
        console.print(Padding(Text(_gist(printable(f.message))), (0, 0, 0, 9)))
        return
    detail = Text(printable(f.message))
    detail.append("\nfix: ", style="bold")
    detail.append(printable(f.fix))
    if f.fix_code:
        detail.append("\nin code:", style="bold")
    console.print(Padding(detail, (0, 0, 0 if f.fix_code else 1, 9)))
    if f.fix_code:  # code to paste: its lines as they are, never wrapped nor cut at the width
        code = "\n".join(" " * 9 + line if line else line for line in f.fix_code.splitlines())
        console.print(Text(code + "\n", style="cyan"), soft_wrap=True)


def ignored_note(report: AuditReport) -> str:
    """What --ignore left out, from where, and that the verdicts still count it ("" when nothing was)."""
    left_out = [run for run in report.runs if run.ignored]
    if not left_out:
        return ""
    codes = sorted({code for run in left_out for code in run.ignored})
    stays = [
        f"{printable(run.run)} stays {run.verdict}"
        for run in report.runs
        if run.gate_verdict not in (None, run.verdict)
    ]
    verdicts = f" ({'; '.join(stays)})" if stays else ""
    return (
        f"ignored ({printable(report.ignored_from or 'audit(ignore=...)')}): {', '.join(codes)}: left out of the "
        f"findings listed and of what fails the command; the verdict still counts them{verdicts}."
    )


def below_ratio_note(report: AuditReport) -> str:
    """The runs that --min-ratio alone lets the gate pass: their verdict still counts what it made information."""
    passed = [
        f"{printable(run.run)} stays {run.verdict}"
        for run in report.runs
        if run.gate_verdict not in (None, run.verdict) and not run.ignored
    ]
    if not passed:
        return ""
    return (
        f"--min-ratio: the weighting findings below it are information, left out of what fails the command; the "
        f"verdict still counts them ({'; '.join(passed)})."
    )


def _gist(message: str) -> str:
    """A finding's message to its first stop (what happened, before the numbers that show it)."""
    depth = 0
    for i, char in enumerate(message):
        depth += (char == "(") - (char == ")")
        if depth == 0 and char in ":;." and message[i + 1 : i + 2] == " ":  # a stop outside parentheses
            return message[:i] + "."
    return message


def summary_line(report: AuditReport) -> str:
    """The one line a check ends with: the runs by verdict, then the findings by severity."""
    return f"{verdict_counts(report)}; {finding_counts(report)} in {many(report.files, 'file')}."


def _runs_table(report: AuditReport, console: Console) -> Table | None:
    """The runs as a table, or None when it would not fit the console's width as it is: a table that
    does not fit folds run names across lines (then neither readable nor searchable) or crops its
    last columns, so the runs are shown as blocks instead."""
    runs = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    runs.add_column("run", overflow="fold")
    runs.add_column("verdict", no_wrap=True)
    for title in ("steps", "ranks", "W", "D"):
        runs.add_column(title, justify="right", no_wrap=True)
    runs.add_column("normalization", overflow="fold")
    runs.add_column("q = e·N", justify="right", no_wrap=True)
    runs.add_column("max ratio", justify="right", no_wrap=True)
    for run in report.runs:
        verdict = Text(run.verdict, style=VERDICT_STYLE[run.verdict])
        verdict.append(reported_note(run))
        runs.add_row(
            Text(printable(run.run)),
            verdict,
            str(run.steps),
            str(run.ranks),
            ", ".join(map(str, run.world_size)),
            _divisors(run),
            factor_text(run),
            q_range_text(run),
            ratio_text(run.max_weight_ratio),
        )
    natural = Measurement.get(console, console.options.update_width(1 << 20), runs).maximum  # unconstrained
    return runs if natural <= console.width else None


def _number(value: object, digits: int = 5) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def render_weights(run: str, step: int, records: pd.DataFrame, probe: ProbeQ | None, console: Console) -> None:
    """One row per record of one step: n, S, b, c, e and q = e·N (1 when correct); where the probe measured
    the lightest and heaviest valid token (`probe`), those as q too, beside the record's mean (its q)."""
    table = Table(
        title=Text(f"{printable(run)}, step {step}: weight of one valid token (correct: q = e·N = 1)"),
        box=box.SIMPLE_HEAVY,
        title_justify="left",
    )
    probed = probe is not None
    terms = records.term.nunique() > 1  # each loss term is its own token mean, with its own N
    weighted = "term_weight" in records and bool((records.term_weight != 1).any())  # a term's declared λ
    columns = [
        "group",
        *(["term"] if terms else []),
        "rank",
        "micro",
        "n",
        "S",
        "b",
        "c",
        "D",
        "g",
        *(["λ", "e = c·g/(D·λ)"] if weighted else ["e = c·g/D"]),
        "q = e·N",
        *(["probe q"] if probed else []),
        "sync",
    ]
    for header in columns:
        table.add_column(header, justify="left" if header in ("group", "term", "sync") else "right", overflow="fold")
    outside = probe[2] if probe is not None else np.zeros(len(records), dtype=bool)
    rows = [
        _record_cells(row, index, probe, outside, terms, weighted)
        for index, row in enumerate(records.itertuples(index=False))
    ]
    for cells in rows:
        table.add_row(*cells)
    if Measurement.get(console, console.options.update_width(1 << 20), table).maximum <= console.width:
        console.print(table)
    else:  # too narrow for the table (a pipe, 80 columns): one block per record, no number ever split
        console.print(table.title)
        labels = [header.split(" =")[0].replace(" ", "_") for header in columns]  # e, q, probe_q: one word each
        for record in rows:
            block = Text("  ")
            for label, cell in zip(labels, record):
                block.append(f"{label}=")
                block.append(cell)
                block.append("  ")
            console.print(block)
    notes = ["c = b/S, or the probe's Σ∂b/∂ℓ / n where it measured the weights"]
    if probed:
        notes.append("probe q: the lightest and heaviest valid token the probe measured")
    if outside.any():
        notes.append("(q outside): a q outside its probe q, n not the number of tokens the probe saw (count_mismatch)")
    console.print(" · ".join(notes), style="dim")


def _record_cells(
    row: Any, index: int, probe: ProbeQ | None, outside: npt.NDArray[np.bool_], terms: bool, weighted: bool
) -> list[Text]:
    """One record's cells in `render_weights`' table: q green at 1, red off it; the probe's q red outside the
    record's own."""
    q = row.q
    style = "" if pd.isna(q) else ("green" if abs(q - 1) <= 1e-4 else "red")
    extremes: list[Text] = []
    if probe is not None:
        low, high = _number(probe[0][index], 4), _number(probe[1][index], 4)
        shown = "–" if "–" in (low, high) else low if low == high else f"{low}–{high}"
        # marked in words as well as red: a pipe or a CI log shows no colour
        extremes.append(
            Text(f"{shown} (q outside)" if outside[index] else shown, style="red" if outside[index] else "")
        )
    cells = [
        printable(str(row.grp)),
        *([printable(str(row.term))] if terms else []),
        str(row.rank),
        str(row.micro),
        str(row.valid_tokens),
        _number(row.loss_sum),
        _number(row.backward_scalar),
        _number(row.implied_weight),
        _number(row.grad_divisor, 4),
        _number(row.grad_scale, 4),
        *([_number(row.term_weight, 4)] if weighted else []),
        _number(row.eff),
    ]
    return [
        *(Text(cell) for cell in cells),
        Text(_number(q, 4), style=style),
        *extremes,
        Text(_number(None if pd.isna(row.sync) else bool(row.sync))),
    ]


def render_curve_table(
    run: str, shown: pd.DataFrame, steps: int, labels: Sequence[tuple[str, str]], console: Console
) -> None:
    """The curve's rows `shown` (`render.curve.curve_views`: every k-th of its `steps`), a column per series
    (`labels`: key and label, `Curve.labels`)."""
    table = Table(title=Text(f"{printable(run)}: loss per step"), box=box.SIMPLE_HEAVY, title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("N", justify="right")
    for _, header in labels:
        table.add_column(header, justify="right")
    for row in shown.to_dict("records"):
        table.add_row(str(row["step"]), str(row["tokens"]), *(_number(row[key]) for key, _ in labels))
    console.print(table)
    if len(shown) < steps:
        console.print(f"({len(shown)} of {steps} steps shown; --csv writes all)", style="dim")
