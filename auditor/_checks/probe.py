"""The probe's checks: token weights that differ inside a record (a mean per sequence first), masks weighted."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pandas as pd

from tokaudit._checks.base import Check, TermInputs, column_of, make_finding
from tokaudit._normalization import Diagnoses
from tokaudit.codes import Code, Severity
from tokaudit._report import Finding


class ProbeCheck(Check):
    """nonuniform_in_microbatch, masked_tokens_weighted: judged here at --rtol, from the largest spread of a
    record's token weights and the most weight its masked positions carry (the step table's
    probe_spread and masked_share, which hold no tolerance)."""

    def __init__(self, term: TermInputs) -> None:
        super().__init__(term)
        self.nonuniform, self.spread = self.steps(), 0.0
        self.masked, self.share = self.steps(), 0.0

    def add(self, block: pd.DataFrame, diagnoses: Diagnoses | None) -> None:
        step, rtol = column_of(block, "step"), self.context.rtol
        # spread = (max − min) / |max| > rtol  ⇔  max − min > rtol·|max|: the token weights of one record differ
        spread, share = column_of(block, "probe_spread"), column_of(block, "masked_share")
        uneven, weighted = spread > rtol, share > rtol
        if uneven.any():
            self.nonuniform.add(step[uneven])
            self.spread = max(self.spread, float(spread[uneven].max()))
        if weighted.any():
            self.masked.add(step[weighted])
            self.share = max(self.share, float(share[weighted].max()))

    def findings(self) -> Iterator[Finding]:
        if self.nonuniform:
            steps = self.nonuniform.range().count
            yield make_finding(
                self.context,
                Code.NONUNIFORM_IN_MICROBATCH,
                self.nonuniform,
                f"Valid tokens of one microbatch got different weights in {steps} step(s) ({_spread_text(self.spread)}): "
                "a per-sequence or per-document mean, or a token weighting. Legitimate only when chosen on purpose.",
                "for the token-mean objective, sum per-token losses over the microbatch and divide once by N",
                {"steps": steps, "largest_spread": self.spread},
            )
        if self.masked:
            steps = self.masked.range().count
            yield make_finding(
                self.context,
                Code.MASKED_TOKENS_WEIGHTED,
                self.masked,
                f"Positions that are not valid and whose loss is not 0 (padding labelled as a real token, "
                f"a mask applied after the loss) carry weight in {steps} step(s), {_share_text(self.share)}: "
                "their loss is trained.",
                "label padding and ignored positions with ignore_index (their loss is then exactly 0), or "
                "mask per-token losses before reducing; divide by the valid-token count",
                {"steps": steps, "masked_weight_in_tokens": self.share},
            )


def per_sequence_first(findings: list[Finding]) -> list[Finding]:
    """A mean per sequence (or document) inside each record, which the probe sees as unequal weights in a
    record, makes each record's mean weight its own 1/n as well: b = (1/B)·Σ_s S_s/n_s gives a token of sequence s
    1/(B·n_s), and the record's mean is Σ_s n_s/(B·n_s)/n = 1/n. A local_mean read from those means is then that
    objective's consequence, not a second cause: the per-sequence finding leads, as an error, and local_mean
    follows as a warning that says so (a GRPO loss, or any per-sequence mean)."""
    codes = {finding.code for finding in findings}
    if not {Code.NONUNIFORM_IN_MICROBATCH, Code.LOCAL_MEAN} <= codes:
        return findings
    out = []
    for finding in findings:
        if finding.code == Code.NONUNIFORM_IN_MICROBATCH:
            finding = replace(
                finding,
                severity=Severity.ERROR,
                message=(
                    f"{finding.message} On average each record's tokens then weigh 1/n, n the record's own count, "
                    "which is why the records also read as local means (local_mean)."
                ),
            )
        elif finding.code == Code.LOCAL_MEAN:
            finding = replace(
                finding,
                severity=Severity.WARNING,
                message=(
                    "The probe saw a mean per sequence or document inside the records (nonuniform_in_microbatch), "
                    "which gives every record this mean weight by itself; its sequences count alike across ranks only "
                    f"when every rank holds as many. {finding.message}"
                ),
            )
        out.append(finding)
    return out


def _spread_text(spread: float) -> str:
    if not np.isfinite(spread):
        return "in one record the heaviest token's weight is 0 and another's below it"
    if spread > 1:  # (max − min)/|max| > 1: the lightest below 0, where "a % below" reads as nothing
        return (
            f"in one record token weights differ by {spread:.3g}× the heaviest's magnitude and some are below 0, as "
            "where a loss pushes some tokens' likelihood down, a preference loss's rejected tokens"
        )
    return f"in one record the lightest token's weight is {spread:.0%} below the heaviest's"


def _share_text(share: float) -> str:
    if not np.isfinite(share):
        return "in one record whose valid tokens carry none"
    return f"in one record as much as {share:.3g} valid token(s) carry"
