"""Whether a non-finite value of a record of no valid token reached the weights: the next step of its group says."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pandas as pd

from tokaudit._checks.base import column_of, grouped


class Reach:
    """The steps where a record of no valid token backpropagated a non-finite value (0/0), each settled by the next
    step of its group that has valid tokens. Its valid records all finite: the update left the weights finite, so
    the value never reached them (cross-entropy's backward gives an ignored position an exact 0, whatever flows
    into it). One of them not finite: it may have, and every later loss is NaN. A step the trainer said it skipped
    never reached them. Where the run ends first, the logs cannot tell."""

    def __init__(self) -> None:
        self.held = 0
        """Steps whose value never reached the weights."""
        self.reached: list[int] = []
        """Steps whose next step is not finite."""
        self.waiting: dict[str, list[int]] = {}
        """Per group, the steps whose next step with valid tokens is not read yet."""

    def add(self, block: pd.DataFrame, flagged: npt.NDArray[np.bool_], skipped: npt.NDArray[np.bool_]) -> None:
        step = column_of(block, "step")
        informative = column_of(block, "tokens") > 0
        finite = column_of(block, "nonfinite_valid") == 0
        for group, rows in grouped(block.grp):
            steps, told = step[rows], np.flatnonzero(informative[rows])
            waiting = self.waiting.pop(group, [])
            for index in np.flatnonzero(flagged[rows]):
                if skipped[rows][index]:
                    self.held += 1
                    continue
                after = told[told > index]
                if len(after):
                    self._settle([int(steps[index])], bool(finite[rows][after[0]]))
                else:
                    waiting.append(int(steps[index]))
            if waiting and len(told):
                first = told[0]
                settled = [s for s in waiting if s < steps[first]]
                self._settle(settled, bool(finite[rows][first]))
                waiting = [s for s in waiting if s >= steps[first]]
            if waiting:
                self.waiting[group] = waiting

    def _settle(self, steps: list[int], finite: bool) -> None:
        if finite:
            self.held += len(steps)
        else:
            self.reached.extend(steps)

    @property
    def unsettled(self) -> int:
        """Steps the run ends after before a step with valid tokens: the logs cannot tell."""
        return sum(len(steps) for steps in self.waiting.values())
