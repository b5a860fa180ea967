"""The JSON report (docs/REPORT.md)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

from tokaudit import __version__
from tokaudit._report import AuditReport, Finding, RunSummary, Segment
from tokaudit._schema import UNNAMED

REPORT_VERSION = 1
"""Changes only when a key is removed or renamed."""


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def _segment(segment: Segment | None) -> dict[str, Any]:
    if segment is None:
        return {"denominator": "undetermined", "factor": None}
    return {"denominator": segment.denominator, "factor": _finite(segment.factor)}


def run_dict(run: RunSummary) -> dict[str, Any]:
    return {
        "run": run.run,
        "rows": run.rows,
        "steps": run.steps,
        "ranks": run.ranks,
        "world_size": run.world_size,
        "verdict": run.verdict,
        "reporting": run.reporting,
        "normalization": _segment(run.normalization),
        "max_weight_ratio": _finite(run.max_weight_ratio),
        "groups": run.groups,
        "microbatches": run.microbatches,
        "terms": run.terms,
        "terms_pooled": run.terms_pooled,
        "skipped_steps": run.skipped_steps,
        "divisors": run.divisors,
        "weight_range": None if run.weight_range is None else list(run.weight_range),
        "segments": [
            {"first": s.first, "last": s.last, "steps": s.steps, **_segment(s), "group": s.group, "term": s.term}
            for s in run.segments
        ],
        "segments_omitted": run.segments_omitted,
        "precision_bits": run.precision_bits,
        "rtol": run.rtol,
        "decided_by": run.decided_by,
        "ignored": run.ignored,
        "gate_verdict": run.gate_verdict or run.verdict,
    }


def finding_dict(finding: Finding) -> dict[str, Any]:
    out = {
        "run": finding.run,
        "code": finding.code.value,
        "severity": finding.severity.value,
        "steps": asdict(finding.steps),
        "message": finding.message,
        "fix": finding.fix,
        "evidence": finding.evidence,
    }
    if finding.term != UNNAMED:
        out["term"] = finding.term
    if finding.fix_code:
        out["fix_code"] = finding.fix_code
    return out


def report_dict(report: AuditReport) -> dict[str, Any]:
    return {
        "tokaudit_version": __version__,
        "report_version": REPORT_VERSION,
        "runs": [run_dict(run) for run in report.runs],
        "findings": [finding_dict(f) for f in report.findings],
        "problems": report.problems,
        "files": report.files,
        "ignored": {"codes": report.ignored, "from": report.ignored_from or None},
    }


def _plain(value: Any) -> Any:
    """numpy scalars and non-finite floats, as JSON can carry them."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return str(value)


def render_json(report: AuditReport) -> str:
    return json.dumps(sanitize(report_dict(report)), indent=2, ensure_ascii=False) + "\n"


def sanitize(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [sanitize(v) for v in value]
    return _plain(value)
