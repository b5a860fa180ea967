"""tokaudit: audit how distributed training normalized its token losses.

import tokaudit
report = tokaudit.audit(["runs/"])           # AuditReport: runs, findings, problems
report.runs[0].verdict, report.to_pandas()   # the findings as a DataFrame
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

if TYPE_CHECKING:
    from tokaudit._auditing import audit
    from tokaudit._engine import Aggregating
    from tokaudit._report import AuditReport, Finding, RunSummary

    Report = AuditReport

__all__ = ["Aggregating", "AuditReport", "Finding", "Report", "RunSummary", "__version__", "audit"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `tokaudit --version` and `tokaudit explain` need no DuckDB or pandas.
    if name == "audit":
        from tokaudit._auditing import audit

        return audit
    if name == "Aggregating":
        from tokaudit._engine import Aggregating

        return Aggregating
    if name in ("AuditReport", "Report", "Finding", "RunSummary"):
        import tokaudit._report as report

        return getattr(report, "AuditReport" if name == "Report" else name)
    raise AttributeError(f"module 'tokaudit' has no attribute {name!r}")
