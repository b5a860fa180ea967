"""Checks of the log's structure and values: W, microbatches, divisor, weights present."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._checks.base import Check, FlaggedSteps, RunContext, TermInputs, ListedSteps, StepsSeen
from tokaudit._checks.base import column_of, differ_rows, grouped, make_finding, median_of, nan_sum
from tokaudit._normalization import Diagnoses
from tokaudit.codes import CODE_DOCS, Code, Severity
from tokaudit._report import Finding
from tokaudit._schema import UNNAMED
from tokaudit._sorting import SortedColumn


ALL_CODES: tuple[Code, ...] = tuple(Code)


CHANGES_SAID = 16
"""The most sizes world_size_changed lists, in the order W took them: past it, the first ones and the latest."""


class StructureCheck(Check):
    """world_size_inconsistent, world_size_changed, uneven_microbatches. W's changes are looked for group
    by group, in the groups' order: the sizes in the order W took them (a return said again), and the steps where
    W is not the group's first; a step whose ranks disagree on W is world_size_inconsistent's alone."""

    main_term_only = True

    def __init__(self, term: TermInputs) -> None:
        super().__init__(term)
        keep_steps = term.keep_steps
        self.inconsistent = FlaggedSteps(keep_steps)
        self.uneven = FlaggedSteps(keep_steps)
        self.uneven_known = FlaggedSteps(False)  # those whose every record says whether it synced: decided
        self.unequal = FlaggedSteps(keep_steps)
        self.changes: dict[str, tuple[list[int], StepsSeen]] = {}
        self.cut: set[str] = set()  # groups whose W changed more often than CHANGES_SAID lists
        self.stand_in = term.stand_in  # its records may not count a rank's microbatches (`TermInputs.stand_in`)

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        self.inconsistent.add(block, differ_rows(block, "world_low", "world_high"))
        if not self.stand_in:
            self._add_syncs(block)
        world, steps = column_of(block, "world_high"), column_of(block, "step")
        agreed = column_of(block, "world_low") == world  # (a step whose ranks disagree is world_size_inconsistent's)
        for group, rows in grouped(block.grp):
            values, at = world[rows][agreed[rows]], steps[rows][agreed[rows]]
            if not len(values):
                continue
            if group not in self.changes:
                self.changes[group] = ([int(values[0])], self.steps())
            sizes, changed = self.changes[group]
            # each change in step order, a change back included (3 → 2 → 3), up to CHANGES_SAID
            for w in values[np.r_[True, values[1:] != values[:-1]]].tolist():
                if int(w) == sizes[-1]:
                    continue
                if len(sizes) < CHANGES_SAID:
                    sizes.append(int(w))
                else:  # past CHANGES_SAID, the latest W stands for the ones between (said "… →")
                    sizes[-1] = int(w)
                    self.cut.add(group)
            changed.add(at[values != sizes[0]])

    def _add_syncs(self, block: pd.DataFrame) -> None:
        """Steps whose ranks' synced backwards may not pair one for one (`_sync_findings`). Ranks may run different
        numbers of microbatches as long as each synchronizes as often as the others, its last included: DDP then
        all-reduces as often on every rank (a sum of all-reduced sums is the all-reduced sum), and the weights say
        whether N counted every microbatch. Flagged where the log shows otherwise or does not say."""
        uneven = differ_rows(block, "microbatches_low", "microbatches_high")
        if "sync_known" not in block or "rank_synced_low" not in block:  # a table that holds no sync counts at all
            self.uneven.add(block, uneven)
            return
        # every record says whether it synced, every rank's last microbatch did, and each rank as often as every
        # other: the all-reduces pair off one for one (one synced backward each, or a loss recorded by k layers,
        # k records of each backward on every rank alike)
        known = column_of(block, "sync_known") == column_of(block, "records")
        last = column_of(block, "unsynced_ranks") == 0
        unequal = differ_rows(block, "rank_synced_low", "rank_synced_high")
        paired = known & last & ~unequal & (column_of(block, "rank_synced_low") >= 1)
        self.uneven.add(block, uneven & ~paired)
        self.uneven_known.add(block, uneven & ~paired & known)
        # as many microbatches on every rank, each last one synchronized (else missing_sync's), more often on some
        self.unequal.add(block, known & last & unequal & ~uneven)

    def findings(self) -> Iterator[Finding]:
        context = self.context
        if self.inconsistent:
            row = self.inconsistent.first
            yield make_finding(
                context,
                Code.WORLD_SIZE_INCONSISTENT,
                self.inconsistent.steps,
                f"Ranks disagree on W within one step (step {int(row.step)}: W from {int(row.world_low)} to "
                f"{int(row.world_high)}).",
                "derive W from the process group that averages the gradients "
                "(dist.get_world_size(ddp_model.process_group)) on every rank",
                {"step": int(row.step), "world_size_low": int(row.world_low), "world_size_high": int(row.world_high)},
            )
        for group in sorted(self.changes):
            sizes, changed = self.changes[group]
            if len(sizes) > 1:
                yield make_finding(
                    context,
                    Code.WORLD_SIZE_CHANGED,
                    changed,
                    f"W changed between steps{'' if group == UNNAMED else f' in group {group}'}: "
                    f"{' → '.join(map(str, sizes[:-1]))}{' → …' if group in self.cut else ''} → {sizes[-1]} "
                    "(an elastic restart or a resume on other hardware).",
                    "nothing to fix if the restart was intended; check that N and W were recomputed after it",
                    {"world_sizes": sizes, "world_sizes_cut": group in self.cut},
                )
        yield from self._sync_findings(context)

    def _sync_findings(self, context: RunContext) -> Iterator[Finding]:
        """uneven_microbatches and unequal_syncs: ranks whose synced backwards do not pair one for one."""
        if self.unequal:
            row = self.unequal.first
            low, high = int(row.rank_synced_low), int(row.rank_synced_high)
            yield make_finding(
                context,
                Code.UNEQUAL_SYNCS,
                self.unequal.steps,
                f"Ranks running {int(row.microbatches_low)} microbatch(es) each synchronized gradients different "
                f"numbers of times in one step (step {int(row.step)}: from {low} to {high} synchronized records a "
                "rank): an extra all-reduce pairs with another rank's next one, or waits alone.",
                "run all but each rank's last microbatch under no_sync() on every rank alike",
                {"step": int(row.step), "synced_records_low": low, "synced_records_high": high},
            )
        if self.uneven:
            # the first step the records decide, where some do: one step not said does not make the others so
            known = bool(self.uneven_known)
            row = self.uneven_known.first if known else self.uneven.first
            said = "do not show" if known else "do not say (not every record says whether it synced)"
            yield make_finding(
                context,
                Code.UNEVEN_MICROBATCHES,
                self.uneven.steps,
                f"Ranks ran different numbers of microbatches in one step (step {int(row.step)}: from "
                f"{int(row.microbatches_low)} to {int(row.microbatches_high)}), and the records {said} that every rank "
                "synchronized as often as every other, on its last microbatch among others: every backward that syncs "
                "must be matched on all ranks.",
                "give every rank the same number of microbatches per step (pad with empty ones that "
                "still run backward with a zero contribution)",
                {
                    "step": int(row.step),
                    "microbatches_low": int(row.microbatches_low),
                    "microbatches_high": int(row.microbatches_high),
                },
                undecidable=None if known else True,  # nothing says how often each rank synced
            )


class ValuesCheck(Check):
    """nonfinite_values, zero_token_nonfinite, empty_update, skip_mismatch. Non-finite values of an update the
    trainer skipped (a GradScaler overflow) did not reach the weights: they are not errors."""

    def __init__(self, term: TermInputs) -> None:
        super().__init__(term)
        self.nonfinite, self.nonfinite_records = self.steps(), 0.0
        self.zero_bad, self.zero_records, self.later = self.steps(), 0.0, term.later
        self.zero_steps: list[npt.NDArray[np.int64]] = []
        """Steps whose non-finite value of no valid token the trainer did not say it skipped."""
        self.empty, self.empty_listed, self.disagree_listed = self.steps(), ListedSteps(), ListedSteps()
        self.skip_apart, self.skip_listed = self.steps(), ListedSteps()
        self.unmarked = False
        self.empty_nonfinite: list[int] = []

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        step = column_of(block, "step")
        skipped_true, skipped_false = column_of(block, "skipped_true"), column_of(block, "skipped_false")
        nonfinite_valid, nonfinite_zero = column_of(block, "nonfinite_valid"), column_of(block, "nonfinite_zero")
        nonfinite = (nonfinite_valid > 0) & ~(skipped_true > 0)
        self.nonfinite.add(step[nonfinite])
        self.nonfinite_records += nan_sum(nonfinite_valid[nonfinite])
        self.zero_bad.add(step[nonfinite_zero > 0])
        self.zero_records += nan_sum(nonfinite_zero)
        self.zero_steps.append(step[(nonfinite_zero > 0) & ~(skipped_true > 0)])
        empty = column_of(block, "tokens") == 0
        apart = step[~empty & (skipped_true > 0) & (skipped_false > 0)]  # (with N = 0: empty_update's)
        self.skip_apart.add(apart)
        self.skip_listed.add(apart)
        if empty.any():
            disagree = (skipped_true[empty] > 0) & (skipped_false[empty] > 0)
            self.empty_nonfinite += [int(s) for s in step[empty & (nonfinite_zero > 0) & ~(skipped_true > 0)]]
            # a record that does not say it was skipped (False, null, no skipped column): not every rank says so
            self.unmarked = self.unmarked or bool((~(skipped_true[empty] >= column_of(block, "records")[empty])).any())
            self.empty.add(step[empty])
            self.empty_listed.add(step[empty])
            self.disagree_listed.add(step[empty][disagree])

    def findings(self) -> Iterator[Finding]:
        context = self.context
        if self.nonfinite:
            records = int(self.nonfinite_records)
            yield make_finding(
                context,
                Code.NONFINITE_VALUES,
                self.nonfinite,
                f"NaN or infinity in S, b, g, D or the probe columns of {records} record(s) with valid tokens, or a "
                "weight e = (b/S)·g/D of theirs past the float range (a D near 0); the reduced gradient of those steps "
                "is not finite, or its weight cannot be read.",
                "find the first non-finite loss (torch.autograd.set_detect_anomaly) and guard the division; "
                "record finite grad_scale and grad_divisor values",
                {"records": records, "first_step": int(self.nonfinite.range().first)},
            )
        if self.zero_bad:
            yield self._zero_nonfinite()
        if self.skip_apart:
            yield make_finding(
                context,
                Code.SKIP_MISMATCH,
                self.skip_apart,
                f"Some records of {self.skip_listed.count} update(s) with valid tokens say the update was skipped and "
                f"others that it was applied (step(s) {self.skip_listed.text()}): the ranks' weights differ from "
                "then on.",
                CODE_DOCS[Code.SKIP_MISMATCH].fix,
                {"steps": self.skip_listed.text()},
            )
        if self.empty:
            yield self._empty_update()

    def _zero_nonfinite(self) -> Finding:
        """zero_token_nonfinite: an error where the steps after show the value reached the weights, a warning that
        the logs cannot tell where the run ends first, information where a later loss is finite (`reach.Later`)."""
        steps = np.concatenate([np.zeros(0, dtype=np.int64), *self.zero_steps])
        reached, untold = self.later.reached(steps)
        said = (
            f"{int(self.zero_records)} record(s) with no valid token have a non-finite backward scalar or probe: the "
            "code divided by a zero count (its own, or N where the whole update has no valid token: 0/0)"
        )
        if reached.any():
            severity, undecidable = Severity.ERROR, None
            said += (
                f"; no loss after step {int(steps[reached].min())} is finite: the NaN reached the weights, as DDP "
                "spreads it to every rank"
            )
        elif untold.any():
            severity, undecidable = Severity.WARNING, True
            said += (
                "; the run ends before a step that would show whether the NaN reached the weights: the logs cannot "
                "tell (cross-entropy's backward gives an ignored position 0 whatever flows into it; a mean written "
                "by hand spreads the NaN)"
            )
        else:
            severity, undecidable = Severity.INFO, None
            said += (
                "; a later loss is finite (or the update was skipped), so the NaN never reached the weights "
                "(cross-entropy's backward gives an ignored position 0 whatever flows into it), but a loss written "
                "otherwise would spread it to every rank"
            )
        return make_finding(
            self.context,
            Code.ZERO_TOKEN_NONFINITE,
            self.zero_bad,
            said + ".",
            "divide by the global count N (clamped to at least 1), never by the local count; a rank "
            "with no valid token backpropagates an exact zero that stays connected to the graph",
            {"records": int(self.zero_records), "reached_weights": bool(reached.any())},
            severity=severity,
            undecidable=undecidable,
        )

    def _empty_update(self) -> Finding:
        """empty_update: an error where a rank backpropagated a non-finite value that reached the weights (`Reach`)
        or the ranks disagree on skipping."""
        disagree = self.disagree_listed.count > 0
        reached = bool(self.later.reached(np.array(self.empty_nonfinite, dtype=np.int64))[0].any())
        severity = Severity.ERROR if reached or disagree else Severity.INFO
        details = []
        if disagree:
            details.append(f"ranks disagree on skipping it at step(s) {self.disagree_listed.text()}")
        if reached:
            details.append("some ranks backpropagated a non-finite value, and no later loss is finite")
        elif self.empty_nonfinite:
            details.append(
                "some ranks backpropagated a non-finite value (a later loss shows it never reached the weights, "
                "or none follows)"
            )
        if self.unmarked and not disagree:
            details.append(
                "the log does not say the update was skipped; an optimizer step on zero gradients still "
                "moves weights through momentum and weight decay"
            )
        return make_finding(
            self.context,
            Code.EMPTY_UPDATE,
            self.empty,
            f"No valid token anywhere in {self.empty_listed.count} step(s) (N = 0)"
            + (": " + "; ".join(details) if details else ", and every rank skipped it together."),
            "decide from the global N (known to every rank after one all-reduce): when N = 0, every rank "
            "runs backward on a zero loss and skips optimizer.step() together",
            {"steps": self.empty_listed.text()},
            severity=severity,
        )


class DivisorCheck(Check):
    """unknown_divisor: D could not be seen, so the weights' absolute scale is not judged."""

    def __init__(self, term: TermInputs) -> None:
        super().__init__(term)
        self.unknown, self.records, self.rows = self.steps(), 0.0, 0
        self.weighted = False
        self.q = SortedColumn()

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        unknown = (column_of(block, "unknown_divisor") > 0) & (column_of(block, "tokens") > 0)
        if not unknown.any():
            return
        self.unknown.add(column_of(block, "step")[unknown])
        self.records += nan_sum(column_of(block, "unknown_divisor")[unknown])
        self.rows += int(unknown.sum())
        weighted = unknown & (column_of(block, "weighted_records") > 0)
        if weighted.any():
            self.weighted = True
            weight_low, weight_high = (
                column_of(block, "weight_low")[weighted],
                column_of(block, "weight_high")[weighted],
            )
            self.q.add((weight_low + weight_high) / 2 * column_of(block, "tokens")[weighted])

    def findings(self) -> Iterator[Finding]:
        if not self.unknown:
            return
        context = self.context
        evidence: dict[str, Any] = {"records": int(self.records), "world_size": context.world_size}
        detail = ""
        if self.weighted:
            # The log assumed D = W; with a summing reduction (D = 1) every weight is W× larger.
            q = median_of(self.q)
            self.q.close()
            evidence.update({"distortion_if_average": q, "distortion_if_sum": q * context.world_size})
            detail = (
                f" If the reduction averages (D = W = {context.world_size}), tokens got q = e·N = {q:.4g}; "
                f"if it sums (D = 1), q = {q * context.world_size:.4g} (correct is 1)."
            )
        yield make_finding(
            context,
            Code.UNKNOWN_DIVISOR,
            self.unknown,
            f"The divisor D of the gradient reduction could not be seen in {self.rows} step(s) (a DDP comm hook "
            "the recorder does not know, FSDP2 modules whose divide factors disagree, no DDP or FSDP2 model "
            "given, or a grad_divisor= the model's reduction contradicts), so the absolute scale of the weights is not "
            f"judged; relative checks (local means, per-microbatch denominators) still ran.{detail}",
            "tell the recorder what the reduction divides by: Recorder(..., grad_divisor=1) for a summing "
            f"hook, grad_divisor={context.world_size} for an average (or pass the DDP or FSDP2 model as model=, with one "
            "divide factor on every FSDP2 module)",
            evidence,
        )


class WeightPresenceCheck(Check):
    """no_weights: valid records without a usable weight (no b and no probe, or S = 0 without a probe)."""

    def __init__(self, term: TermInputs) -> None:
        super().__init__(term)
        self.unweighted, self.records, self.none_at_all = self.steps(), 0.0, 0

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        unweighted_records = column_of(block, "unweighted_records")
        unweighted = unweighted_records > 0
        self.unweighted.add(column_of(block, "step")[unweighted])
        self.records += nan_sum(unweighted_records[unweighted])
        self.none_at_all += int((unweighted & (column_of(block, "weighted_records") == 0)).sum())

    def findings(self) -> Iterator[Finding]:
        if not self.unweighted:
            return
        records = int(self.records)
        yield make_finding(
            self.context,
            Code.NO_WEIGHTS,
            self.unweighted,
            f"{records} record(s) with valid tokens carry no usable weight (no backward scalar and no probe, "
            f"or a loss sum of 0 without a probe); {self.none_at_all} step(s) have no weight at all, so their "
            "normalization cannot be judged.",
            "record backward_scalar= with every record, or wrap the per-token loss in rec.probe()",
            {"records": records, "steps_without_weight": self.none_at_all},
        )


class DeclaredWeightCheck(Check):
    """term_weight_inconsistent: records of valid tokens of one step of this term that declare different λ, beyond
    the tolerance (λ = 0.1·3 on one rank, 0.3 on another, is one λ)."""

    def __init__(self, term: TermInputs) -> None:
        super().__init__(term)
        self.differ = FlaggedSteps(term.keep_steps)

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        low, high = column_of(block, "declared_low"), column_of(block, "declared_high")
        with np.errstate(invalid="ignore"):  # (NaN: no record declares one)
            apart = np.abs(high - low) > self.context.rtol * np.maximum(np.abs(high), np.abs(low))
        self.differ.add(block, np.broadcast_to(apart, len(block)))

    def findings(self) -> Iterator[Finding]:
        if not self.differ:
            return
        row = self.differ.first
        yield make_finding(
            self.context,
            Code.TERM_WEIGHT_INCONSISTENT,
            self.differ.steps,
            f"Records of one step declare different weights λ for this loss term (step {int(row.step)}: λ from "
            f"{row.declared_low:.4g} to {row.declared_high:.4g}), so its tokens weigh λ/N by rank or microbatch, "
            "not one λ·ΣS/N: a warm-up or schedule counted per rank, or loss_term(name, weight=λ) said on some "
            "ranks or microbatches only.",
            "compute λ from the optimizer's global step, the same on every rank and microbatch of an update, and "
            "declare it on every record of the term: with rec.loss_term(name, weight=λ)",
            {"step": int(row.step), "declared_low": float(row.declared_low), "declared_high": float(row.declared_high)},
        )
