"""Small phrases shared by every renderer."""

from __future__ import annotations

import math
import unicodedata
from typing import TYPE_CHECKING

from tokaudit._storage import shown_path

if TYPE_CHECKING:  # (the report's module imports pyarrow: the command line imports this one first)
    from tokaudit._report import AuditReport, RunSummary, StepRange


def factor_text(run: RunSummary) -> str:
    """`b·g = 2·S/N` style, the run's recovered normalization in one phrase; where there is none, why: every step
    left out (records dropped, counts the probe contradicts), the files lacking some ranks' records
    (`normalization_judged`), every update said skipped (which changed no weight and is not weighed), or no record
    that weighs its tokens."""
    # here, not at the top: the command line imports this module, and normalization imports pandas
    from tokaudit._normalization import FORMULA, Denominator

    segment = run.normalization
    if not run.normalization_judged:
        return "not judged: ranks without records"
    if segment is None:
        if run.steps and run.skipped_steps >= run.steps:
            return "every update skipped: none weighed"
        return "no valid tokens" if run.steps else "no step judged"
    if segment.denominator == "undetermined":
        # no weight at all where D was seen: every record's weight none or 0 (terms switched off, λ = 0)
        weighed = run.weight_range is not None or not run.divisors
        return "undetermined (balanced counts)" if weighed else "not judged: no record weighs its tokens"
    if segment.denominator == "unexplained" or segment.factor is None:
        return "unexplained"
    factor = f"{segment.factor:.4g}·" if f"{segment.factor:.4g}" != "1" else ""
    formula = FORMULA.get(Denominator(segment.denominator), f"S/{segment.denominator}")
    return f"b·g = {factor}{formula}"


PRECISIONS = {8: "bfloat16", 11: "float16"}


def q_range_text(run: RunSummary, between: str = "–") -> str:
    """The run's range of q = e·N ("1", "0.6–3"; "–" where it is not judged)."""
    if run.weight_range is None:
        return "–"
    low, high = (f"{v:.4g}" for v in run.weight_range)
    return low if low == high else f"{low}{between}{high}"


def many(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def verdict_counts(report: AuditReport) -> str:
    """ "2 runs: 1 correct, 1 incorrect, 0 inconclusive"."""
    counts = [f"{sum(run.verdict == v for run in report.runs)} {v}" for v in ("correct", "incorrect", "inconclusive")]
    return f"{many(len(report.runs), 'run')}: {', '.join(counts)}"


def finding_counts(report: AuditReport) -> str:
    """ "1 error, 1 warning, 0 info"."""
    counts = {s: sum(f.severity.value == s for f in report.findings) for s in ("error", "warning", "info")}
    return f"{many(counts['error'], 'error')}, {many(counts['warning'], 'warning')}, {counts['info']} info"


def reported_note(run: RunSummary) -> str:
    """What to show beside a verdict: that the logged loss is not the token mean, where the verdict is not
    `incorrect` (an incorrect run's findings say it already; the verdict is about the gradient alone), and the
    precision the run was judged at, where it is coarser than float32's."""
    notes = []
    if (
        run.verdict != "correct"
        and run.decided_by
        and run.max_weight_ratio == 1
        and run.weight_range is not None
        and run.weight_range[0] == run.weight_range[1] == 1
    ):
        notes.append(f"by {', '.join(run.decided_by)}")  # q says nothing: say which finding decides
    if run.verdict != "incorrect" and run.reporting == "differs":
        notes.append("reported loss differs")
    if run.precision_bits is not None and run.precision_bits < 24 and run.rtol is not None:
        name = PRECISIONS.get(run.precision_bits, f"{run.precision_bits}-bit")
        notes.append(f"judged at {name} precision, rtol {run.rtol:.2g}")
    return f" ({'; '.join(notes)})" if notes else ""


def ratio_text(ratio: float) -> str:
    return "–" if math.isnan(ratio) else "∞" if not math.isfinite(ratio) else f"{ratio:.3g}"


def steps_text(steps: StepRange) -> str:
    if steps.first == steps.last:
        return str(steps.first)
    return f"{steps.first}–{steps.last} ({steps.count})"


def printable(text: str) -> str:
    """Text from a log or a file name, shown literally: control and format characters (escape codes,
    bidirectional overrides) become visible escapes instead of acting on the terminal."""
    if text.isprintable():
        return text
    out = []
    for char in text:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:  # a byte of a file name that is not UTF-8, as Python holds it: that byte
            out.append(shown_path(char))
        elif unicodedata.category(char) not in ("Cc", "Cf", "Zl", "Zp", "Cs"):
            out.append(char)
        else:
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
    return "".join(out)
