"""count_mismatch: a record's valid_tokens that is not the count the probe saw."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._checks.base import RunContext, RunSteps, StepsSeen, make_finding
from tokaudit.codes import Code
from tokaudit._report import Finding
from tokaudit._schema import UNNAMED


_PROBE_RANGE = frozenset({"probed", "weight_low", "weight_high", "token_weight_low", "token_weight_high"})


def miscounted_rows(rows: pd.DataFrame, rtol: float) -> npt.NDArray[np.bool_]:
    """Rows of the step table (one group, term and step each) where the probe contradicts a recorded count.
    A record's mean probed weight c = Σ∂b/∂ℓᵢ / n is the mean of its valid tokens' weights when n is the
    number of tokens the probe saw, so it lies between the lightest and the heaviest of them; the step's
    extremes of e = c·g/D then lie within those of the probe's (token_weight_low ≤ weight_low, weight_high ≤ token_weight_high, as no
    record's c leaves its own range). A step outside them by more than rtol holds a record whose n is not
    the probe's count. Where no record has the probe's extremes, tok_* are e_* and nothing is found."""
    if not _PROBE_RANGE.issubset(rows.columns):
        return np.zeros(len(rows), dtype=bool)  # a table made without the probe's columns
    probed: npt.NDArray[np.bool_] = rows.probed.to_numpy(dtype=float) > 0
    if not probed.any():
        return probed
    weight_low, weight_high = rows.weight_low.to_numpy(dtype=float), rows.weight_high.to_numpy(dtype=float)
    low, high = rows.token_weight_low.to_numpy(dtype=float), rows.token_weight_high.to_numpy(dtype=float)
    return probed & outside_probe_range(weight_low, weight_high, low, high, rtol)


def outside_probe_range(
    low: npt.NDArray[np.float64],
    high: npt.NDArray[np.float64],
    lightest: npt.NDArray[np.float64],
    heaviest: npt.NDArray[np.float64],
    rtol: float,
) -> npt.NDArray[np.bool_]:
    """Where mean weights (their lowest and highest) leave the probe's lightest and heaviest token by more than
    rtol of the larger: a count that is not the probe's (`miscounted_rows`); NaN anywhere is never outside."""
    slack = rtol * np.fmax(np.abs(lightest), np.abs(heaviest))
    with np.errstate(invalid="ignore"):
        outside: npt.NDArray[np.bool_] = (low < lightest - slack) | (high > heaviest + slack)
    return outside


@dataclass
class Miscounted:
    """The steps `without_miscounted` leaves out, read from the last whole pass over the run's parts."""

    parts: Callable[[], Iterable[pd.DataFrame]]
    steps: StepsSeen
    first: pd.Series | None = None
    """The finding's evidence: a row of the lowest step found."""
    complete: bool = False

    def __bool__(self) -> bool:
        if not self.complete:
            for _ in self.parts():
                pass
        return self.first is not None

    def finding(self, run: str) -> Finding:
        row = self.first
        assert row is not None
        tokens = float(row.tokens)
        low, high = float(row.token_weight_low) * tokens, float(row.token_weight_high) * tokens
        above = float(row.weight_high) * tokens > high
        mean = float(row.weight_high if above else row.weight_low) * tokens
        grp = f" (group {row.grp})" if str(row.grp) != UNNAMED else ""
        measured = (
            f"the same weight, {low:.4g}/N, on every valid token"
            if f"{low:.4g}" == f"{high:.4g}"
            else f"every valid token's weight between {low:.4g}/N and {high:.4g}/N"
        )
        steps = self.steps.range()
        context = RunContext(
            run=run, term=str(row.term), world_size=0, world_sizes=(), microbatches=0, divisor=0.0, rtol=0.0
        )
        return make_finding(
            context,
            Code.COUNT_MISMATCH,
            self.steps,
            f"At step {int(row.step)}{grp} the probe measured {measured}, yet a record's probed weight sum divided "
            "by its recorded valid_tokens gives "
            f"{mean:.4g}/N, {'above' if above else 'below'} that range: valid_tokens is not the number of tokens "
            "the probe saw (a count of another mask, such as attention_mask.sum() where the loss ignores labels "
            "of -100, or padding counted). N and every weight derived from the counts would be wrong, so "
            f"{steps.count} step(s) are left out instead of being judged on them.",
            "record valid_tokens from the mask the loss and rec.probe use (labels != ignore_index), summed over "
            "the same microbatch",
            {
                "step": int(row.step),
                "probe_weight_range": [low, high],
                "mean_weight": mean,
                "global_tokens": int(tokens),
            },
        )


def without_miscounted(source: RunSteps, rtol: float) -> tuple[RunSteps, Miscounted]:
    """The run's table without the steps whose counts the probe contradicts (`miscounted_rows`), every term of
    that group's step, as the steps that lost records are left out; and those steps, noted on each whole pass."""
    found = Miscounted(source.parts, StepsSeen(len(source.groups) > 1))

    def parts() -> Iterator[pd.DataFrame]:
        noting = not found.complete
        steps, first = StepsSeen(found.steps.keep), None
        for part in source.parts():
            flagged = miscounted_rows(part, rtol)
            if flagged.any():
                step = part.step.to_numpy()
                # every term of a flagged (group, step): a step's terms are summed and compared together
                whole = pd.Series(flagged).groupby([part.grp.to_numpy(), step]).transform("any").to_numpy(dtype=bool)
                if noting:
                    if first is None:
                        # the lowest step, the first of its rows in the table's order (group, term): the parts
                        # hold ascending ranges of steps, so whole or in parts it is the same row
                        rows = np.flatnonzero(flagged)
                        first = part.iloc[int(rows[np.argmin(step[rows])])]
                    steps.add(np.unique(step[whole]))
                part = part[~whole].reset_index(drop=True)
            if len(part):
                yield part
        if noting:
            found.steps, found.first, found.complete = steps, first, True

    found.parts = parts
    return replace(source, parts=parts), found
