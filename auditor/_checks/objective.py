"""Loss terms that together are one token mean: a loss computed in pieces (chunks of the sequence), each
piece recorded as a term of its own. Each piece alone weighs its tokens 1/N with N the whole microbatch's
count, so alone it reads as a scale of N_t/N; together the pieces are the token mean over their combined
tokens, which is what was trained. Two real heads on the same tokens (MTP, an auxiliary loss) are not: each
weighs its tokens 1/N_t, and together q = 2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tokaudit._checks.base import RunContext, RunSteps, StepsSeen, make_finding
from tokaudit.codes import Code
from tokaudit._normalization import Denominator, Span
from tokaudit._report import Finding


def pooled_sums(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Each row's sums of `columns` over the terms of its (group, step): terms that are one objective pooled,
    as its token mean ΣS/ΣN reads them. The one place terms are pooled row by row (the rank grid's SQL pools
    them in its own grouping, `engine.sql`'s $pooled)."""
    return frame.groupby([frame.grp.astype(str).to_numpy(), frame.step.to_numpy()])[columns].transform("sum")


def pooled_steps(frame: pd.DataFrame, **reductions: tuple[str, str | Any]) -> pd.DataFrame:
    """One row per (group, step) with valid tokens or not, its terms' rows reduced as one: `reductions` as
    pandas' named aggregation (name=(column, reduction)), with the group as a string, sorted."""
    return frame.assign(grp=frame.grp.astype(str)).groupby(["grp", "step"], sort=True).agg(**reductions).reset_index()


@dataclass
class OneObjective:
    """The run's terms read as one token mean: per group, the steps it covers and α in b·g = α·S/N."""

    terms: list[str]
    spans: list[Span]
    steps: StepsSeen
    counts: set[int]
    """Every record's valid-token count, where every record of every step had the same (else empty)."""
    equal_terms: bool = False
    """Every step's terms hold one count N_t: T pieces of one loss and T heads over the same tokens, each off by
    1/T (W missing where T = W), weigh alike."""

    def findings(self, run: str, rtol: float) -> list[Finding]:
        """terms_one_objective, and balanced_counts where no count differs: a mean over each piece's own count
        then weighs the tokens as the token mean does, so the logs cannot tell them apart."""
        context = RunContext(
            run=run, term=self.terms[0], world_size=0, world_sizes=(), microbatches=0, divisor=0.0, rtol=rtol
        )
        found = [self._finding(context)]
        if self.equal_terms and not self.counts:
            found.append(self._equal_terms(context))
        if self.counts:
            counts = sorted(self.counts)
            found.append(
                make_finding(
                    context,
                    Code.BALANCED_COUNTS,
                    self.steps,
                    f"In every step every record had the same valid-token count ({', '.join(map(str, counts))}), so a "
                    "mean over each piece's own count and the token mean give the same weights here: this run cannot "
                    "show which one the code uses.",
                    "audit a run with uneven counts (padding, ignored labels, different sequence lengths per rank)",
                    {"counts": counts, "indistinguishable_from": "n_micro"},
                )
            )
        return found

    def _equal_terms(self, context: RunContext) -> Finding:
        """balanced_counts where the terms' counts never differ: pieces of one loss and heads that miss 1/T alike."""
        t = len(self.terms)
        return make_finding(
            context,
            Code.BALANCED_COUNTS,
            self.steps,
            f"In every step the loss terms {', '.join(self.terms)} held the same valid-token count N_t, so one loss "
            f"computed in {t} equal pieces (the token mean over their combined tokens, as read here) and {t} heads "
            f"over the same tokens, each weighing its tokens 1/({t}·N_t) (a factor 1/{t} missing, W where W = {t}), "
            "give the same weights: this run cannot show which.",
            "record the pieces of one loss under one term; give each head over the same tokens its own token mean "
            "(W·S/N_t into an average)",
            {"terms": self.terms, "indistinguishable_from": "N_t"},
        )

    def _finding(self, context: RunContext) -> Finding:
        names = ", ".join(self.terms)
        return make_finding(
            context,
            Code.TERMS_ONE_OBJECTIVE,
            self.steps,
            f"Loss terms {names} together weigh every valid token 1/N over their combined tokens (q = e·ΣN = 1 at "
            f"every step): one loss computed in pieces, each recorded as a term. They are judged as one token "
            "mean; alone, each would read as a scale of its share of the tokens.",
            "nothing to change in training; record the pieces under one term to audit them as one (a captured "
            "cross-entropy computed in chunks is merged by the recorder itself)",
            {"terms": self.terms, "steps": self.steps.count},
        )


def one_objective(source: RunSteps, rtol: float) -> OneObjective | None:
    """The run's terms as one objective, where it has several and, at every step of every group with valid
    tokens, every token of every term weighs the same e within rtol, with e·ΣN = 1, ΣN over the terms."""
    if len(source.terms) < 2:
        return None
    seen = StepsSeen(keep=False)  # parts hold disjoint ranges of steps, in order: each step is added once
    by_group: dict[str, list[pd.DataFrame]] = {}
    counts: set[int] | None = set()  # None once two counts differ inside a step
    equal_terms = True  # every step's terms hold one N_t
    together = False  # some step holds tokens of two terms: terms that never meet (each update a term of its own,
    # as two optimizers stepping in turn make) are each a token mean alone, no pieces of one
    for part in source.parts():
        steps = _combined(part, rtol)
        if steps is None:
            return None
        seen.add(np.unique(steps.step.to_numpy()))
        together = together or bool((steps.terms.to_numpy() >= 2).any())
        # (a step one term holds alone, the other's count 0, tells pieces from heads: q = 1 there is no 1/T)
        equal_terms = equal_terms and bool((steps.term_tokens_low == steps.term_tokens_high).all())
        if counts is not None:
            counts = (
                counts | set(steps.record_tokens_low.astype(int).tolist())
                if (steps.record_tokens_low == steps.record_tokens_high).all()
                else None
            )
        for group, rows in steps.groupby("grp", sort=False):
            by_group.setdefault(str(group), []).append(rows)
    if not seen or not together:
        return None
    spans = []
    for group in source.groups:
        if group in by_group:
            rows = pd.concat(by_group[group], ignore_index=True)
            spans.append(
                Span(
                    group,
                    source.terms[0],
                    int(rows.step.min()),
                    int(rows.step.max()),
                    len(rows),
                    Denominator.N,
                    float(rows.divisor.median()),
                )
            )
    return OneObjective(list(source.terms), spans, seen, counts or set(), equal_terms)


def _combined(part: pd.DataFrame, rtol: float) -> pd.DataFrame | None:
    """Per (group, step) with valid tokens: ΣN over the terms, D and the records' fewest and most valid tokens
    (over records with some); None where some such step is no token mean
    of its combined tokens, or a valid record in it carries no weight.

    With e·ΣN = 1, b·g = α·S/ΣN has α = c·g·ΣN = e·D·ΣN = D: the reduction's divisor."""
    valid = part.tokens.to_numpy() > 0
    frame = pd.DataFrame(
        {
            "grp": part.grp.astype(str).to_numpy(),
            "step": part.step.to_numpy(),
            "tokens": part.tokens.to_numpy(dtype=float),
            "low": np.where(valid, part.token_weight_low.to_numpy(dtype=float), np.inf),
            "high": np.where(valid, part.token_weight_high.to_numpy(dtype=float), -np.inf),
            "unweighted": part.unweighted_records.to_numpy(),
            "divisor": part.divisor_high.to_numpy(dtype=float),
            "record_tokens_low": np.where(valid, part.record_tokens_low.to_numpy(dtype=float), np.inf),
            "record_tokens_high": np.where(valid, part.record_tokens_high.to_numpy(dtype=float), -np.inf),
            "valid": valid.astype(np.int64),
        }
    )
    steps = pooled_steps(
        frame,
        tokens=("tokens", "sum"),
        low=("low", "min"),
        high=("high", "max"),
        unweighted=("unweighted", "sum"),
        divisor=("divisor", "max"),
        record_tokens_low=("record_tokens_low", "min"),
        record_tokens_high=("record_tokens_high", "max"),
        term_tokens_low=("tokens", "min"),
        term_tokens_high=("tokens", "max"),
        terms=("valid", "sum"),
    )
    steps = steps[steps.tokens > 0]
    with np.errstate(invalid="ignore"):
        # every token's q = e·ΣN within rtol of 1 (NaN, a record without a weight, fails)
        one = (np.abs(steps.low * steps.tokens - 1) <= rtol) & (np.abs(steps.high * steps.tokens - 1) <= rtol)
    if (steps.unweighted > 0).any() or not bool(one.all()):
        return None
    return steps
