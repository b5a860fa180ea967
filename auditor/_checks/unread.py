"""The files of a run that could not be read: what they held is not in the audit, and a gap may be theirs."""

from __future__ import annotations

from collections.abc import Sequence

from tokaudit._checks.base import RunSteps, cannot_tell, run_finding
from tokaudit.codes import Code
from tokaudit._report import Finding

LISTED_FILES = 10
"""The most unreadable files a finding's evidence names (its message names the first)."""


def with_unread_files(run: str, findings: list[Finding], files: Sequence[str], source: RunSteps) -> list[Finding]:
    """A run some files of whose folder could not be read: their records may be any rank's at any step. A step
    lacking a rank's records may have them there, so missing_rank says the logs cannot tell; unreadable_files, over
    every step of the run, says which files, and keeps the run from being called correct."""
    shown = files[0] + (f" and {len(files) - 1} more" if len(files) > 1 else "")
    kind = "file(s)" if all(file.endswith(".parquet") for file in files) else "file(s) or folder(s)"
    perhaps = f"{len(files)} {kind} of this run could not be read ({shown}): the records may be there."
    unread = run_finding(
        run,
        Code.UNREADABLE_FILES,
        source,
        f"{len(files)} {kind} in this run's folder could not be read ({shown}; each is named on a line of its own "
        "with what is wrong). The records they hold, of any rank at any step, are not in this audit: a step judged "
        "without them may lack some of its tokens, so the run is not called correct.",
        "restore or repair the file(s), or move them out of the run's folder to audit what is left as it is",
        {"files": list(files[:LISTED_FILES]), "count": len(files)},
    )
    return [*cannot_tell(findings, [Code.MISSING_RANK], perhaps), unread]
