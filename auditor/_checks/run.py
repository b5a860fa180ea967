"""One run's checks: every check fed the run's step table block by block, and their findings."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

from tokaudit._checks.reach import Later
from tokaudit._checks.base import Check, Extremes, RunContext, RunSteps, TermInputs, cannot_tell, column_of, world_sizes
from tokaudit.codes import Code
from tokaudit._checks.objective import OneObjective, one_objective
from tokaudit._checks.probe import ProbeCheck, per_sequence_first
from tokaudit._checks.reported import reported_findings
from tokaudit._checks.ranks import MainSteps, MissingRanksCheck, not_recorded_finding, ranks_not_recorded
from tokaudit._checks.structure import DivisorCheck, StructureCheck, ValuesCheck
from tokaudit._checks.sync import OtherTermSyncs, SyncCheck
from tokaudit._checks.duplicates import duplicates_finding, with_copies_in_one_file
from tokaudit._checks.structure import DeclaredWeightCheck, WeightPresenceCheck
from tokaudit._checks.weighting import BalancedCheck, FactorTable, WeightingCheck
from tokaudit._engine import Duplicates, one_value
from tokaudit._normalization import Decisions, FitBlock, Span, Spans, block_fits, close, span_rows
from tokaudit._report import Finding
from tokaudit._schema import Provenance


CHECKS: tuple[type[Check], ...] = (
    WeightingCheck,
    StructureCheck,
    SyncCheck,
    ValuesCheck,
    ProbeCheck,
    MissingRanksCheck,
    DivisorCheck,
    WeightPresenceCheck,
    DeclaredWeightCheck,
    BalancedCheck,
)
"""Every check of a loss term, in the order their findings are listed (`_check_term`): a new check is a `Check`
here, its code and words in `tokaudit.codes`."""


def check_run(
    run: str,
    steps: RunSteps,
    rtol: float,
    duplicates: Duplicates | None = None,
    extremes: Extremes | None = None,
    provenance: Provenance = Provenance(),
    objective: OneObjective | None = None,
) -> tuple[list[Finding], list[Span], int]:
    """All checks for one run's steps (every group and term): its findings, its normalization spans
    (at most `MAX_SPANS` per group and term) and how many spans were left out.

    Each loss term is its own token mean: recovery and weight checks run per term.
    `duplicates`: the repeated keys the engine found and left out (`engine.Duplicates`).
    `extremes`: where the heaviest and lightest token of an evidence step were, when the table does not
    hold them (the audit aggregates them for the few steps a finding names). `provenance`: how the run was
    recorded (`summary.setups_of`): the trainer whose own settings the fixes then name, a pipeline schedule's rescale.

    Each term's table is read three times: twice for the run's decisions (`Decisions.of`, the first also
    for W, D and M), once for every check; once more for the uniform factors' clusters (`FactorTable`)
    where some step may be uniformly off, and twice for the reported losses where there are some.

    The steps are taken as given: the audit leaves out those whose counts the probe contradicts before
    (`without_miscounted`), for its summary too.

    `objective`: the run's terms are one token mean (`one_objective`, which is asked here when not given): their
    weights are judged together, so no term's weighting is judged alone, and the run's normalization is theirs."""
    source = steps
    if absent := ranks_not_recorded(source):  # every step's N is partial: nothing about the normalization is judged
        partial = [not_recorded_finding(run, source, absent, provenance.pipelined)]
        if duplicates is not None:  # (what the files hold twice is no normalization's)
            partial = with_copies_in_one_file([*partial, duplicates_finding(duplicates, run)], duplicates)
        return partial, [], 0
    findings: list[Finding] = []
    spans: list[Span] = []
    if objective is None:
        objective = one_objective(source, rtol)
    if objective is not None:
        findings.extend(objective.findings(run, rtol))
        spans.extend(objective.spans)
    term_findings, term_spans, omitted, reported = _check_terms(
        source, run, rtol, extremes, provenance, judged=objective is None
    )
    findings.extend(term_findings)
    spans.extend(term_spans)
    if reported:
        findings.extend(
            reported_findings(source, run, rtol, source.terms[0], pooled=objective is not None, tied=source.tied)
        )
    if duplicates is not None:
        findings = with_copies_in_one_file([*findings, duplicates_finding(duplicates, run)], duplicates)
    return _cut_short(findings), spans, omitted


def _cut_short(findings: list[Finding]) -> list[Finding]:
    """The run's last update cut short, unsynchronized and never said applied (`missing_sync`, `cut_short`): a kill
    inside it reads the same, and then its weights are part of an update's. What else is said of that step alone
    cannot tell either."""
    cut = next((f for f in findings if f.code == Code.MISSING_SYNC and f.evidence.get("cut_short")), None)
    if cut is None:
        return findings
    step = cut.steps.first
    return cannot_tell(
        findings,
        (),
        f"Step {step} may be an update cut short by a kill, never applied: its weights are part of an update's.",
        where=lambda f: f is not cut and f.steps.first == f.steps.last == step,
    )


def _check_terms(
    source: RunSteps, run: str, rtol: float, extremes: Extremes | None, provenance: Provenance, judged: bool
) -> tuple[list[Finding], list[Span], int, bool]:
    """Every loss term's checks (`_check_term`), in the terms' order: their findings, spans and spans left out,
    and whether the reported losses are to be checked (several terms, or a step with a reported loss). Without
    `judged` (the terms are one objective) no term's weighting is judged alone."""
    findings: list[Finding] = []
    spans: list[Span] = []
    omitted = 0
    terms = source.terms
    # W over every term: read with the main term's first pass when it is the only one.
    sizes: set[int] | None = None if len(terms) == 1 else {w for block in source.blocks() for w in world_sizes(block)}
    reported = len(terms) > 1
    passed: list[tuple[str, Decisions | None, RunContext, FactorTable | None, bool]] = []
    later = Later()  # over every term: they train one model
    # several terms: the main term's steps (its first pass, which comes first) and another's syncs beside them
    main_steps = MainSteps() if len(terms) > 1 else None
    other_syncs = OtherTermSyncs(main_steps) if main_steps is not None else None
    for term in terms:
        noted = main_steps if term == terms[0] else other_syncs
        decisions, shape = _first_pass(source, term, rtol, judged, noted)
        if not shape.blocks:
            continue  # every step of the term was left out (count_mismatch)
        if sizes is None:
            sizes = shape.worlds
        reported = reported or shape.reported
        later = later.joined(shape.later)
        context = shape.context(run, term, tuple(sorted(sizes)), rtol, provenance)
        passed.append((term, decisions, context, _factors(source, term, decisions, context), shape.declared))
    apart = not _one_scale([factors for _, _, _, factors, _ in passed], rtol)
    for term, decisions, context, factors, declared in passed:
        coefficient = apart and not declared and _in_spans(source, term, decisions, factors)
        term_findings, listed, left_out = _check_term(
            source, term, decisions, context, factors, extremes, coefficient, later, (main_steps, other_syncs)
        )
        findings.extend(term_findings)
        spans.extend(listed)
        omitted += left_out
    return findings, spans, omitted, reported


def _first_pass(
    source: RunSteps,
    term: str,
    rtol: float,
    judged: bool,
    noted: MainSteps | OtherTermSyncs | None = None,
) -> tuple[Decisions | None, _Shape]:
    """A term's decisions (`Decisions.of`, None where its weighting is not `judged` alone) and its shape; its blocks
    added to `noted` as well (where there are several terms: the main term's steps, or another's syncs)."""
    shape = _Shape()
    shape.noted = noted
    if not judged:
        for block in source.blocks(term):
            shape.add(block)
        return None, shape

    def observed() -> Iterator[FitBlock]:
        for block in source.blocks(term):
            shape.add(block)
            yield block_fits(block, rtol)

    def again() -> Iterator[FitBlock]:
        return (block_fits(block, rtol) for block in source.blocks(term))

    return Decisions.of(observed(), again, rtol, lambda: shape.worlds), shape


def _factors(source: RunSteps, term: str, decisions: Decisions | None, context: RunContext) -> FactorTable | None:
    """The term's uniform factors' clusters, where its weighting is judged alone (`decisions`). They need every
    uniform q ≠ 1 first: the term is read once more only where a step may have one."""
    if decisions is None:
        return None
    if not decisions.may_be_off:
        return FactorTable(context.rtol, np.zeros(0), {}, [], False)
    return FactorTable.of(((block, decisions.diagnose(block)) for block in source.blocks(term)), context)


def _in_spans(source: RunSteps, term: str, decisions: Decisions | None, factors: FactorTable | None) -> bool:
    """Whether a term's few uniform factors each hold over one span of steps (`FactorTable.in_spans`): read once
    more only where there are several."""
    if decisions is None or factors is None or len(factors.table) < 2:
        return True
    return factors.in_spans((block, decisions.diagnose(block)) for block in source.blocks(term))


def _one_scale(tables: list[FactorTable | None], rtol: float) -> bool:
    """Every term of several off by the same constant factors q (one, or a few over the run: a stale W after each
    resize): nothing weighs a term against another, the whole objective is scaled, as one term alone would be (no
    term's factor reads as a coefficient chosen for it)."""
    sets = [t.anchors for t in tables if t is not None and len(t.table) and not t.varying]
    return (
        len(tables) > 1
        and len(sets) == len(tables)
        and all(len(a) == len(sets[0]) and all(close(q, p, 2 * rtol) for q, p in zip(a, sets[0])) for a in sets)
    )


def _check_term(
    source: RunSteps,
    term: str,
    decisions: Decisions | None,
    context: RunContext,
    factors: FactorTable | None,
    extremes: Extremes | None,
    coefficient: bool,
    later: Later = Later(),
    across: tuple[MainSteps | None, OtherTermSyncs | None] = (None, None),
) -> tuple[list[Finding], list[Span], int]:
    """Every check of one loss term, fed the term's blocks once: its findings, spans and spans left out.
    Without `decisions` (the terms are one objective, judged together) its weighting is not judged alone.
    `coefficient`: the run's terms are not all off by one constant (`_one_scale`), this one declares no λ, and
    each of its factors holds over one span (`_in_spans`): its factors may be a coefficient chosen for it."""
    main = term == source.terms[0]
    # a check of the run's structure reads the main term, and where a group holds none of it, the term that stands
    # for it there (a pipeline stage of another loss): this term's blocks of those groups alone
    standing = None if main else {group for group, t in source.stand_ins.items() if t == term}
    inputs = TermInputs(
        context,
        keep_steps=len(source.groups) > 1,
        main_term=main,
        coefficient=len(source.terms) > 1 and coefficient,
        factors=factors,
        extremes=extremes,
        confused=decisions.confused if decisions is not None else None,
        later=later,
        main_ranks=across[0],
        other_syncs=across[1],
        stand_in=bool(standing),
    )
    checks = [
        (check(inputs), standing if check.main_term_only else None)
        for check in CHECKS
        if (main or standing or not check.main_term_only) and (decisions is not None or not check.judges_weighting)
    ]
    term_spans = Spans()
    for block in source.blocks(term):
        diagnoses = decisions.diagnose(block) if decisions is not None else None
        group = str(block.grp.iloc[0]) if standing and len(block) else ""  # (a block is one group's: `frames`)
        for check, groups in checks:
            if groups is None or group in groups:
                check.add(block, diagnoses)
        if diagnoses is not None:
            term_spans.add(span_rows(block, diagnoses, source.groups, 0))
    findings = per_sequence_first([finding for check, _ in checks for finding in check.findings()])
    if decisions is None:
        return findings, [], 0
    listed, left_out = term_spans.listed(source.groups, [term])
    return findings, listed, left_out


class _Shape:
    """What a term's first pass notes besides the decisions: W and D's counts (their most frequent values,
    the smallest among equally frequent, as pandas' mode), the largest M, every W, and whether any step
    has a reported loss."""

    def __init__(self) -> None:
        self.worlds: set[int] = set()
        self.world_counts: dict[Any, int] = {}
        self.divisor_counts: dict[Any, int] = {}
        self.microbatches = -math.inf
        self.reported = False
        self.declared = False
        self.blocks = 0
        self.later = Later()
        self.noted: MainSteps | OtherTermSyncs | None = None

    def add(self, block: pd.DataFrame) -> None:
        self.blocks += 1
        if self.noted is not None:
            self.noted.add(block)
        self.declared = self.declared or bool((column_of(block, "declared_weights") > 0).any())
        self.worlds.update(world_sizes(block))
        for counts, column in ((self.world_counts, block.world_high), (self.divisor_counts, block.divisor_high)):
            values = column.to_numpy()
            repeat = len(values) if one_value(values) else 1
            values = values[:1] if repeat > 1 else values
            found, times = np.unique(values[~pd.isna(values)], return_counts=True)
            for value, count in zip(found.tolist(), times.tolist()):
                counts[value] = counts.get(value, 0) + count * repeat
        self.microbatches = max(self.microbatches, float(block.microbatches_high.max()))
        self.reported = self.reported or bool((column_of(block, "reported") > 0).any())
        told, finite = column_of(block, "tokens") > 0, np.isfinite(column_of(block, "loss"))
        applied = column_of(block, "skipped_false") > 0
        self.later = self.later.joined(Later.of(column_of(block, "step"), told, finite, applied))

    def context(self, run: str, term: str, sizes: tuple[int, ...], rtol: float, provenance: Provenance) -> RunContext:
        def mode(counts: dict[Any, int]) -> Any:
            return min(counts, key=lambda value: (-counts[value], value)) if counts else math.nan

        return RunContext(
            run=run,
            term=term,
            world_size=int(mode(self.world_counts)),
            world_sizes=sizes,
            microbatches=int(self.microbatches),
            divisor=float(mode(self.divisor_counts)),
            rtol=rtol,
            provenance=provenance,
        )
