"""Runs that look like one run's ranks under run ids that differ from rank to rank."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from tokaudit._checks.base import step_list
from tokaudit._report import Finding
from tokaudit.codes import Code

NAMED_RUNS = 3
"""Of the runs that hold the other ranks, those named in the message (the evidence names them all)."""


def with_other_ranks(findings: list[Finding]) -> list[Finding]:
    """Each ranks_not_recorded finding whose missing ranks other runs of the audit hold: runs of the same W (and
    group) over overlapping steps whose ranks are disjoint from this run's. Said in its message and evidence
    (`runs_with_other_ranks`), with the likely cause: a run id made on each rank (a time stamp, a tracker's run
    id, the rank in it) splits one run into runs of a few ranks each, every one of them partial. The others
    are returned as they are."""
    present: dict[int, frozenset[int]] = {}
    alike: dict[tuple[int, str], list[int]] = defaultdict(list)
    for index, finding in enumerate(findings):
        # (past W = 64 only the ranks above the highest that recorded are known absent: no run's ranks are known)
        if finding.code == Code.RANKS_NOT_RECORDED and int(finding.evidence["world_size"]) <= 64:
            w = int(finding.evidence["world_size"])
            present[index] = frozenset(range(w)) - frozenset(finding.evidence["ranks_not_recorded"])
            alike[(w, str(finding.evidence["group"]))].append(index)
    told = list(findings)
    for (w, _), members in alike.items():
        for index in members:
            mine = findings[index]
            others = [
                other
                for other in members
                if findings[other].run != mine.run
                and not present[other] & present[index]
                and findings[other].steps.first <= mine.steps.last
                and mine.steps.first <= findings[other].steps.last
            ]
            if others:
                ranks = frozenset().union(*(present[other] for other in others))
                told[index] = _told(mine, [findings[other].run for other in others], ranks, w)
    return told


def _told(finding: Finding, names: list[str], ranks: frozenset[int], w: int) -> Finding:
    """The finding with the runs that hold other ranks of its W over its steps, and what that suggests."""
    named = ", ".join(names[:NAMED_RUNS]) + (f" and {len(names) - NAMED_RUNS} more" if len(names) > NAMED_RUNS else "")
    message = (
        f"{finding.message} Other runs of this audit ({named}) hold rank(s) {step_list(sorted(ranks))} of W={w} "
        "over the same steps: if they are this run's other ranks, its run id differed from rank to rank (a time "
        "stamp, a tracker's run id or the rank in it), or each rank's files lie in a folder of their own without a "
        "run_id column (a run is then named by its folder), which splits one run into runs of a few ranks each."
    )
    fix = (
        "give every rank the same run_id (one the launcher sets, such as TORCHELASTIC_RUN_ID, or rank 0's, "
        f"broadcast), or put every rank's files in one folder (rank=N/ folders below it are its parts); else {finding.fix}"
    )
    return replace(finding, message=message, fix=fix, evidence={**finding.evidence, "runs_with_other_ranks": names})
