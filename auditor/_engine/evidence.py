"""One step's evidence, by an engine of its own (`extremes_at`)."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from tokaudit._engine.columns import EVIDENCE
from tokaudit._engine.database import Engine
from tokaudit._reader import Shard


def extremes_at(shards: Sequence[Shard], step: int, threads: int | None = None) -> pd.DataFrame:
    """The EVIDENCE columns of one step, a row per (run, grp, term): the step aggregated again, alone, from the
    files whose footers say they can hold it, with the evidence aggregates the full query leaves out.
    The same records (deduplicated the same way) in the same aggregation as the full query's."""
    engine = Engine.open(
        [s for s in shards if s.may_hold(step, step)], threads=threads, only_steps=(step, step), extremes=True
    )
    try:
        table = engine.step_table()
    finally:
        engine.close()
    return table[["run", "grp", "term", "step", *EVIDENCE]]


def inexact_scalars(
    shards: Sequence[Shard], run: str, steps: tuple[int, int], bits: Sequence[int], threads: int | None = None
) -> tuple[int, list[int]]:
    """Over these steps of one run, read again: how many distinct finite, nonzero backward scalars b there are, and
    for each of `bits`, how many of them do not hold that many significant bits exactly (b = m·2^e, 1/2 ≤ |m| < 1,
    holds p bits where m·2^p is whole)."""
    first, last = steps
    engine = Engine.open([s for s in shards if s.may_hold(first, last)], threads=threads, only_steps=steps)
    scaled = "backward_scalar * pow(2, {p} - 1 - floor(log2(abs(backward_scalar))))"
    inexact = ", ".join(f"count_if(usable AND {scaled.format(p=p)} <> round({scaled.format(p=p)}))" for p in bits)
    try:
        engine._whole()
        row = engine.connection.execute(
            f"""SELECT count(DISTINCT backward_scalar) FILTER (usable), {inexact} FROM (
                    SELECT backward_scalar, isfinite(backward_scalar) AND backward_scalar <> 0 AS usable
                    FROM records WHERE run = ? AND step BETWEEN ? AND ?)""",
            [run, first, last],
        ).fetchone()
    finally:
        engine.close()
    assert row is not None
    return int(row[0]), [int(n) for n in row[1:]]
