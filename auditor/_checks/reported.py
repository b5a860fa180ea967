"""The reported loss against ΣS/N: mismatches, rounding, and losses stamped one update off."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tokaudit._checks.base import RunContext, RunSteps, StepsSeen, column_of, make_finding
from tokaudit._checks.objective import pooled_sums
from tokaudit.codes import Code
from tokaudit._report import Finding
from tokaudit._schema import HALF_PRECISION_BITS


MAX_DECIMALS = 6
"""A reported loss rounded to at most this many decimals is compared within half its last digit."""


def decimals(values: np.ndarray) -> np.ndarray:
    """Per value, the fewest decimals (0..MAX_DECIMALS) it is rounded to, float32 storage allowed
    for; −1 when it has more."""
    out = np.full(len(values), -1)
    for k in range(MAX_DECIMALS, -1, -1):
        rounded = np.round(values, k)
        exact = np.abs(values - rounded) <= 1e-7 * np.maximum(np.abs(values), 1e-12)
        out = np.where(exact, k, out)
    return out


HALF_PRECISIONS = ((HALF_PRECISION_BITS["bfloat16"], np.uint32(0xFFFF)), (HALF_PRECISION_BITS["float16"], None))
"""The binary formats a logged loss may have been stored in, coarsest first: bfloat16 (8 significant bits: a float32
whose low 16 bits are 0) and float16 (11; exact where a cast to float16 and back keeps it)."""

BINARY_SEEN = 3
"""Distinct values that must all be exact in a half precision before the losses are read as stored in it (one such
as 2.5 is exact in every one by chance; three losses of a real run, only where a half tensor held them)."""


class _Rounding:
    """Half a unit of the last decimal a trainer rounded its logged losses to, read from all of them (a
    value with few decimals by chance says nothing alone); 0 when they are not rounded. And the relative half unit
    of the coarsest half precision every one of them is exact in (a half tensor's value logged), 0 where none."""

    def __init__(self) -> None:
        self.most = -1
        self.unrounded = False
        self.seen = False
        self.exact_in = {bits: True for bits, _ in HALF_PRECISIONS}
        self.distinct: set[float] = set()

    def add(self, values: np.ndarray) -> None:
        if not len(values):
            return
        k = decimals(values)
        self.seen = True
        self.unrounded = self.unrounded or bool((k < 0).any())
        self.most = max(self.most, int(k.max()))
        finite = values[np.isfinite(values)]
        single = finite.astype(np.float32)
        in_single = bool((single == finite).all())
        for bits, low in HALF_PRECISIONS:
            cast = (single.view(np.uint32) & low) == 0 if low is not None else single.astype(np.float16) == single
            self.exact_in[bits] = self.exact_in[bits] and in_single and bool(np.all(cast))
        if len(self.distinct) < BINARY_SEEN:
            self.distinct.update(finite[:BINARY_SEEN].tolist())

    def value(self) -> float:
        if not self.seen or self.unrounded:
            return 0.0
        return 0.5 * 10.0 ** (-self.most) * (1 + 1e-6)

    def relative(self) -> float:
        """2⁻ᵖ of the coarsest half precision (p bits) every loss is exact in: half a unit in its last place."""
        if len(self.distinct) < BINARY_SEEN:
            return 0.0
        return next((2.0**-bits for bits, _ in HALF_PRECISIONS if self.exact_in[bits]), 0.0)


def _agrees(reported: np.ndarray, truth: np.ndarray, rtol: float, rounding: float) -> np.ndarray:
    """reported equals truth within rtol, or within half a unit of the decimal it was rounded to."""
    tolerance = np.maximum(rtol * np.abs(truth), rounding)
    agrees: np.ndarray = np.abs(reported - truth) <= tolerance
    return agrees


def _step_means(frame: pd.DataFrame, main_term: str, pooled: bool, tied: tuple[str, ...] = ()) -> pd.DataFrame:
    """The main term's steps with valid tokens, in order: the step, its token mean ΣS/N (`mean`) and the sum of
    every term's token mean (`total`), each (group, step)'s own. `pooled`: the terms are one objective
    (`checks.objective`), and `total` is its token mean, ΣS/ΣN over the terms. `tied`: terms the records cannot tell
    from the main one (`RunSteps.tied`), each one's ΣS/N at the same (group, step) a column (`_tied_columns`)."""
    counted = frame[column_of(frame, "tokens") > 0]
    means = counted[["grp", "term", "step"]].assign(mean=counted.loss / counted.tokens)
    if pooled:
        sums = pooled_sums(counted, ["loss", "tokens"])
        total = sums.loss / sums.tokens
    else:
        total = means.groupby(["grp", "step"], observed=True)["mean"].transform("sum")
    rows = means[means.term.astype(str) == main_term]
    at = pd.MultiIndex.from_arrays([rows.grp.astype(str), rows.step])
    theirs = {
        column: means[means.term.astype(str) == term]
        .assign(grp=lambda m: m.grp.astype(str))
        .set_index(["grp", "step"])["mean"]
        .reindex(at)
        .to_numpy(float)
        for column, term in zip(_tied_columns(tied), tied)
    }
    return pd.DataFrame(
        {
            "step": rows.step.to_numpy(np.int64),
            "mean": rows["mean"].to_numpy(float),
            "total": total[rows.index].to_numpy(float),
            **theirs,
        },
        index=rows.index,
    )


def _tied_columns(tied: tuple[str, ...]) -> list[str]:
    """The columns of `_step_means` that hold the tied terms' token means."""
    return [f"tied_{index}" for index in range(len(tied))]


def _step_at(frame: pd.DataFrame, step: int, main_term: str, pooled: bool) -> tuple[float, float] | None:
    """(`mean`, `total`) of `_step_means` at one step of a part; None where it has no valid token there."""
    at = _step_means(frame[column_of(frame, "step") == step], main_term, pooled)
    return (float(at["mean"].iloc[0]), float(at["total"].iloc[0])) if len(at) else None


def _reported_rows(
    source: RunSteps, main_term: str, pooled: bool, tied: tuple[str, ...] = ()
) -> Iterator[pd.DataFrame]:
    """The main term's steps with a reported loss and valid tokens, in the table's order, with the token
    mean of the main term (`mean`) and the sum of every term's token mean (`total`), each (group, step)'s own,
    and those of the step before and after it (`previous_mean`, `next_mean`, `previous_total`, `next_total`;
    NaN where that step has no valid token or is not in the log), across the table's parts."""
    frames = source.frames()
    current = next(frames, None)
    carried: tuple[Any, int, tuple[float, float] | None] | None = None  # (group, step, its means): a part's last
    while current is not None:
        following = next(frames, None)
        group, last = current.grp.iloc[0], int(column_of(current, "step").max())
        if not bool((column_of(current, "reported") > 0).any()):
            # nothing here to compare: only its last step is read, the next part's first step's neighbour
            carried, current = (group, last, _step_at(current, last, main_term, pooled)), following
            continue
        steps = _step_means(current, main_term, pooled, tied)
        step, mean, total = steps.step.to_numpy(), steps["mean"].to_numpy(), steps["total"].to_numpy()
        # each step's neighbours: the rows beside it, where their steps are one apart; at the part's ends,
        # the last step of the part before and the first of the part after, of the same group
        previous, next_ = np.full((2, len(step)), np.nan), np.full((2, len(step)), np.nan)
        adjacent = step[1:] == step[:-1] + 1
        previous[:, 1:] = np.where(adjacent, np.stack([mean[:-1], total[:-1]]), np.nan)
        next_[:, :-1] = np.where(adjacent, np.stack([mean[1:], total[1:]]), np.nan)
        if len(step) and carried is not None and carried[0] == group and carried[1] == step[0] - 1 and carried[2]:
            previous[:, 0] = carried[2]
        if len(step) and following is not None and following.grp.iloc[0] == group:
            after = _step_at(following, int(step[-1]) + 1, main_term, pooled)
            if after is not None:
                next_[:, -1] = after
        carried = (group, last, (float(mean[-1]), float(total[-1])) if len(step) and step[-1] == last else None)
        known = current.loc[
            steps.index,
            [
                "grp",
                "term",
                "step",
                "loss",
                "tokens",
                "reported",
                "reported_low",
                "reported_high",
                "mean_of_local_means",
            ],
        ]
        rows = known.assign(
            mean=mean,
            total=total,
            previous_mean=previous[0],
            previous_total=previous[1],
            next_mean=next_[0],
            next_total=next_[1],
            **{column: steps[column].to_numpy(float) for column in _tied_columns(tied)},
        )
        rows = rows[column_of(rows, "reported") > 0]
        if len(rows):
            yield rows
        current = following


def _agree(
    rows: pd.DataFrame, mean: str, total: str, rtol: float, rounding: float, others: Iterable[str] = ()
) -> np.ndarray:
    """Each row's reported loss (every record's) is its `mean` column's value, or its `total`'s, or one of the
    `others`'."""
    low, high = rows.reported_low.to_numpy(float), rows.reported_high.to_numpy(float)
    agrees: np.ndarray = np.zeros(len(rows), dtype=bool)
    for column in (mean, total, *others):
        truth = rows[column].to_numpy(float)
        agrees |= _agrees(low, truth, rtol, rounding) & _agrees(high, truth, rtol, rounding)
    return agrees


@dataclass
class _Differing:
    """The steps whose reported loss is not their token mean, and what those losses are instead."""

    steps: StepsSeen
    count: int = 0
    first: Any = None
    """The first such row (None: every reported loss agrees)."""
    all_local: bool = True
    any_local: bool = False
    all_next: bool = True
    """Every step that differs carries the next step's token mean (`all_previous`: the previous one's)."""
    all_previous: bool = True

    @classmethod
    def of(
        cls, source: RunSteps, main_term: str, rtol: float, rounding: float, pooled: bool, tied: tuple[str, ...]
    ) -> _Differing:
        found = cls(StepsSeen(len(source.groups) > 1))
        for rows in _reported_rows(source, main_term, pooled, tied):
            fine = _agree(rows, "mean", "total", rtol, rounding, _tied_columns(tied))
            if fine.all():
                continue
            bad = rows[~fine]
            found.all_next = found.all_next and bool(_agree(bad, "next_mean", "next_total", rtol, rounding).all())
            found.all_previous = found.all_previous and bool(
                _agree(bad, "previous_mean", "previous_total", rtol, rounding).all()
            )
            local_of = bad.mean_of_local_means.to_numpy(float)
            local = _agrees(bad.reported_low.to_numpy(float), local_of, rtol, rounding) & _agrees(
                bad.reported_high.to_numpy(float), local_of, rtol, rounding
            )
            found.all_local, found.any_local = (
                found.all_local and bool(local.all()),
                found.any_local or bool(local.any()),
            )
            if found.first is None:
                found.first = bad.iloc[0]
            found.steps.add(bad.step.to_numpy())
            found.count += len(bad)
        return found


def reported_findings(
    source: RunSteps, run: str, rtol: float, main_term: str, pooled: bool = False, tied: tuple[str, ...] = ()
) -> Iterator[Finding]:
    """reported_loss_mismatch: the logged loss against ΣS/N of the main term, or against the sum of
    the terms' token means when the trainer logs the whole objective. Read twice: how the losses were
    rounded is read from all of them first. reported_loss_shifted (information) instead, where every step
    that differs (two or more) carries the token mean of the step after it, or every one that of the step
    before, and none the mean of local means: the right losses, stamped one update off. `tied`: terms the records
    cannot tell from the main term (`RunSteps.tied`): a step whose logged loss is one of theirs at that step is no
    mismatch."""
    rounding_seen = _Rounding()
    for rows in _reported_rows(source, main_term, pooled, tied):
        rounding_seen.add(np.concatenate([rows.reported_low.to_numpy(float), rows.reported_high.to_numpy(float)]))
    if not rounding_seen.seen:
        return
    rounding = rounding_seen.value()
    rtol = max(rtol, rounding_seen.relative())  # (a float16 loss is off by its half unit: no mismatch)

    found = _Differing.of(source, main_term, rtol, rounding, pooled, tied)
    if found.first is None:
        return
    first, bad_steps, bad_count = found.first, found.steps, found.count
    all_local, any_local = found.all_local, found.any_local
    true_value = float(first.loss / first.tokens)
    evidence = {
        "step": int(first.step),
        "reported": float(first.reported_high),
        "token_mean": true_value,
        "mean_of_local_means": float(first.mean_of_local_means),
        "rounding": rounding,
    }
    context = RunContext(run=run, term=main_term, world_size=0, world_sizes=(), microbatches=0, divisor=0.0, rtol=rtol)
    if (found.all_next or found.all_previous) and not any_local and bad_count > 1:
        yield _shifted_finding(found, context, evidence, true_value)
        return
    if all_local:
        what = "the mean of per-rank means, not the token mean"
    elif any_local:
        what = "partly the mean of per-rank means"
    elif not np.isfinite(first.reported_high):  # (a ratio to ΣS/N would read nan× or inf×)
        what = "not finite where ΣS/N is"
    else:
        what = f"{float(first.reported_high) / true_value:.4g}× the token mean" if true_value else "not the token mean"
    yield make_finding(
        context,
        Code.REPORTED_LOSS_MISMATCH,
        bad_steps,
        f"The reported loss differs from ΣS/N in {bad_count} step(s), beyond rounding; it is {what} (step "
        f"{int(first.step)}: reported {float(first.reported_high):.6g}, ΣS/N = {true_value:.6g}, mean of "
        f"local means {float(first.mean_of_local_means):.6g}).",
        "report all_reduce(Σ S)/all_reduce(Σ n) over the step from detached sums and counts",
        evidence,
    )


def _shifted_finding(found: _Differing, context: RunContext, evidence: dict[str, Any], true_value: float) -> Finding:
    """reported_loss_shifted: every step that differs (two or more) carries the token mean of the step after it,
    or every one that of the step before."""
    first, bad_steps, bad_count, all_next = found.first, found.steps, found.count, found.all_next
    # reported[s] = ΣS/N of s + 1 (or s − 1) at every step that differs: a loss stamped on the update beside
    # its own, as report_loss() did by default when called before optimizer.step() closed the update
    neighbour = "next" if all_next else "previous"
    theirs = float(first.next_mean if all_next else first.previous_mean)
    evidence[f"token_mean_of_the_{neighbour}_step"] = theirs
    return make_finding(
        context,
        Code.REPORTED_LOSS_SHIFTED,
        bad_steps,
        f"The reported loss is the token mean ΣS/N of the {neighbour} step, not its own, in all "
        f"{bad_count} step(s) where it differs (step {int(first.step)}: reported "
        f"{float(first.reported_high):.6g}, its own ΣS/N {true_value:.6g}, the {neighbour} step's "
        f"{theirs:.6g}): the losses are right, recorded one update {'early' if all_next else 'late'}.",
        "give the step the loss belongs to (rec.report_loss(value, step=...)), or report it "
        "after optimizer.step() for the update just closed",
        evidence,
    )
