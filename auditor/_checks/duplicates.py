"""duplicate_records: the repeated records the engine left out, and which it kept, said with the likely cause."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tokaudit._checks.base import PARTIAL_UPDATE_FACTORS, cannot_tell
from tokaudit._engine import FILES_NAMED, Duplicates
from tokaudit.codes import DEFAULT_SEVERITY, TOKEN_MEAN_FIXES, WEIGHTING, Code, Severity
from tokaudit._report import Finding, StepRange


NOT_DECIDING = " Duplicates do not decide the verdict."


WEIGHED_WRONG = TOKEN_MEAN_FIXES | WEIGHTING
"""What says a launch's tokens were weighed wrong: a normalization's errors."""


@dataclass(frozen=True)
class Replaced:
    """How the records of a run's earlier launches, which a later launch recorded again, are judged alone."""

    codes: tuple[str, ...]
    """The errors that say their tokens were weighed wrong (WEIGHED_WRONG)."""
    ordered: bool = True
    """The files say which launch wrote each copy; else the copy kept is the one in the file modified last, which a
    copy of the folder that did not keep the times may have made the earlier one."""
    steps: tuple[int, int] | None = None
    """The first and last step recorded again, where every step between them was (else None)."""
    unread: bool = False
    """Some file of the copies left out could not be read again to be judged alone."""


def with_replaced(findings: list[Finding], replaced: Replaced) -> list[Finding]:
    """A run whose later launch recorded steps again that an earlier launch's records, judged alone, weigh wrong: the
    later records are kept and judged, but where that launch resumed from a checkpoint taken after those steps (its
    step numbers begun again), the earlier updates trained the model, which the logs cannot tell from a replay from
    an earlier checkpoint. duplicate_records then says the logs cannot tell, and the run is not called correct.
    Where the files do not say which launch was later, the other way round as well: the kept copies' errors over
    the steps recorded again cannot tell where the copies left out weigh their tokens right."""
    if replaced.codes:
        codes = ", ".join(replaced.codes)
        why = (
            f"Judged alone, the earlier launch's records weigh their tokens wrong ({codes}): where the later launch "
            "resumed from a checkpoint taken after them and numbered its steps again, those updates trained the "
            "model; where it replayed them from an earlier checkpoint, they did not. The logs cannot tell which."
        )
        return _copies_cannot_tell(findings, why)
    if replaced.unread:
        why = (
            "The files of the copies left out could not all be read again to be judged alone: where the earlier "
            "launch weighed its tokens wrong and those updates trained the model, the logs here cannot tell."
        )
        return _copies_cannot_tell(findings, why)
    if replaced.ordered or replaced.steps is None:  # (a step between the copies may hold none: it decides)
        return findings
    first, last = replaced.steps

    def kept_wrong(finding: Finding) -> bool:
        within = first <= finding.steps.first and finding.steps.last <= last
        return finding.code in WEIGHED_WRONG and finding.severity is Severity.ERROR and within

    if not any(kept_wrong(f) for f in findings):
        return findings
    why = (
        "The copies lie in files that do not say which launch wrote them: the copy in the file modified last was "
        "judged, and the others, judged alone, weigh their tokens right. Where those were written last (a replay over "
        "the wrong updates from an earlier checkpoint), the updates that trained the model were right: the logs "
        "cannot tell which."
    )
    return _copies_cannot_tell(findings, why, where=kept_wrong)


def with_copies_in_one_file(findings: list[Finding], duplicates: Duplicates) -> list[Finding]:
    """Copies of a key inside one file whose values differ: records its writer did not tell apart (microbatches
    logged under one index, loss terms without a term column), each of which counts, or a step given again, each an
    update of its own. The steps they are in were judged on the later copies alone: the uniform factors over those steps
    (`PARTIAL_UPDATE_FACTORS`: a part of an update's records), and duplicate_records, say the logs cannot tell; weights
    that differ among the copies kept are no artefact of the part, and stand."""
    if duplicates.identical or not duplicates.one_file:
        return findings
    why = (
        "The copies in one file hold other values: records the writer did not tell apart (microbatches logged under "
        "one index, loss terms without a term column), each of which counts, or a step given again, each an update "
        "of its own. Either way the steps they are in were judged on the later copies alone, whose N may be part of the "
        "update's: the logs cannot tell."
    )

    def over_copies(finding: Finding) -> bool:
        # every step it covers among those holding copies: a step without any still says what it says
        steps = finding.steps
        partial = finding.code in PARTIAL_UPDATE_FACTORS and finding.severity.rank >= Severity.WARNING.rank
        contiguous = duplicates.steps == duplicates.last - duplicates.first + 1  # (else a step between may hold none)
        return partial and contiguous and duplicates.first <= steps.first and steps.last <= duplicates.last

    return _copies_cannot_tell(findings, why, where=over_copies)


def _copies_cannot_tell(
    findings: list[Finding], why: str, where: Callable[[Finding], bool] | None = None
) -> list[Finding]:
    """duplicate_records (and what `where` says) as cannot-tell, `why` said: its message no longer says that
    duplicates do not decide the verdict, for here they do."""
    said = [replace(f, message=f.message.replace(NOT_DECIDING, "")) for f in findings]
    return cannot_tell(said, [Code.DUPLICATE_RECORDS], why, where=where)


def _below_their_folder(paths: Sequence[str]) -> list[str]:
    """Files as named below the folder they all share: their names in one folder; in rank=K/ folders, whose files
    are named alike (part-0.parquet in each), the folder too."""
    if len(paths) < 2:
        return [os.path.basename(path) for path in paths]
    shared = os.path.commonpath(paths)
    return [os.path.relpath(path, shared) for path in paths]


def duplicates_finding(duplicates: Duplicates, run: str) -> Finding:
    """duplicate_records: the engine kept one of each repeated (group, term, step, micro, rank), the later. Not
    evidence about the gradient (the verdict reads the records kept): the cause and the files are named."""
    named = _below_their_folder(duplicates.files[:FILES_NAMED])
    files = ", ".join(named) + (" and more" if len(duplicates.files) > FILES_NAMED else "")
    if duplicates.identical and duplicates.same_time:
        cause = (
            "bit-identical copies of the same records (a compacted or copied file beside the shards, or one "
            "folder given twice): one of each is kept"
        )
        fix = "leave the copies out of the folder audited (or audit the copy alone)"
    elif duplicates.identical:
        cause = (
            "the same values written again later: a re-launch of the same script under the same run id, or a "
            "resume that replayed these steps; the later records were kept"
        )
        fix = "give each launch its own run_id (the integrations name it after the trainer's run), or a new folder"
    elif duplicates.one_file:
        cause = (
            "other values for the same step inside one file: where the recorder wrote it (one process, one rank), "
            "the step it was given went back during the run, as a per-epoch batch index or a counter reset each "
            "epoch does; the later records were kept and judged"
        )
        fix = "give the recorder the optimizer's global step (one number per update that never goes back)"
    else:
        later = (
            "the file modified last, at equal times the later name, as these files do not say which launch wrote them"
            if duplicates.unlaunched
            else "the later shard as published, whatever the clocks"
        )
        cause = (
            "other values for the same steps: a re-launch under the same run id, a resume that replayed steps, "
            f"or a step that went back (a per-epoch batch index given as the step), whose later records ({later}) "
            "were kept and judged"
        )
        fix = (
            "give each launch its own run_id, resume from the checkpoint's step into a new shard sequence, and give "
            "the recorder the optimizer's global step"
        )
    return Finding(
        run=run,
        code=Code.DUPLICATE_RECORDS,
        severity=DEFAULT_SEVERITY[Code.DUPLICATE_RECORDS],
        steps=StepRange(duplicates.first, duplicates.last, duplicates.steps),
        message=f"{duplicates.dropped} record(s) repeat a (group, term, step, micro, rank) already logged, "
        f"in {files}: {cause}.{_superseded(duplicates.superseded)}{NOT_DECIDING}",
        fix=fix,
        evidence={
            "dropped_records": duplicates.dropped,
            "files": list(named),
            "identical": duplicates.identical,
            "in_one_file": duplicates.one_file,
            "superseded_records": duplicates.superseded,
            "kept_by_modification_time": duplicates.unlaunched,
        },
    )


def _superseded(records: int) -> str:
    """The records of an earlier launch's steps a later launch recorded again, said where there are some."""
    if not records:
        return ""
    return (
        " A step that a later launch recorded again is that launch's alone (each of its ranks, and no rank past its "
        f"W): {records} more record(s) of the earlier launch's, repeated by none, were left out with the copies."
    )
