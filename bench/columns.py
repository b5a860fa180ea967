"""Where the step query's time goes, per declared column: `python bench/columns.py LOG [--repeat K]`.

The query of LOG's shape is written from the declarations (`tokaudit.engine.columns`) once whole and once without
each column in turn (a per-rank or per-microbatch value no column reads any more drops out with it); a column's
cost is the whole query's best time less the best time without it, both over the same files, alternated. The
whole query's time and the floor's (per-step N and the extremes of b/S) are printed first.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import duckdb

import tokaudit.engine.sql as sql
from tokaudit.engine import Engine
from tokaudit.engine.columns import PARTIALS, STEP_COLUMNS
from tokaudit.engine.sql import absent_values, one_name_of, one_record_form, step_sql
from tokaudit.loading import load


def timed(engine: Engine, query: str) -> float:
    start = time.perf_counter()
    engine.connection.execute(query).fetchnumpy()
    return time.perf_counter() - start


def without(name: str) -> str:
    """The query with one column left out, and the partials only it read."""
    kept = tuple(c for c in STEP_COLUMNS if c.name != name)
    read = " ".join(c.aggregate + c.single for c in kept)
    original = sql.STEP_COLUMNS, sql.PARTIALS
    sql.STEP_COLUMNS = kept  # type: ignore[misc]
    sql.PARTIALS = tuple(p for p in PARTIALS if p.name in read)  # type: ignore[misc]
    try:
        return step_sql(*SHAPE)
    finally:
        sql.STEP_COLUMNS, sql.PARTIALS = original  # type: ignore[misc]


SHAPE: tuple = ()


def main() -> None:
    global SHAPE
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log", type=Path)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    shards = load([args.log]).shards
    engine = Engine.open(shards)
    engine._whole()  # the views over every file, as the audit of a one-range log defines them
    SHAPE = (one_record_form(shards), False, one_name_of(shards) is not None, absent_values(shards))
    whole = step_sql(*SHAPE)
    floor = ("SELECT step, sum(valid_tokens), min(backward_scalar / loss_sum), max(backward_scalar / loss_sum) "
             "FROM raw_records GROUP BY step")
    queries = {"(whole query)": whole, "(floor)": floor}
    for column in STEP_COLUMNS:
        if not column.evidence and f"AS {column.name}" in whole:
            queries[column.name] = without(column.name)
    best: dict[str, float | None] = {}
    for name, query in queries.items():
        try:
            best[name] = min(timed(engine, query) for _ in range(args.repeat))
        except duckdb.Error:  # another column's value reads it (em_low = e_low · N in the one-record form)
            best[name] = None
    total, floor_time = best.pop("(whole query)"), best.pop("(floor)")
    assert total is not None and floor_time is not None
    print(f"{args.log.name}: whole query {total:.2f} s, floor {floor_time:.2f} s "
          f"({'one-record' if SHAPE[0] else 'general'} form, {len(best)} columns computed)")
    for name, seconds in sorted(best.items(), key=lambda item: -1.0 if item[1] is None else total - item[1],
                                reverse=True):
        level = next(c.level.name.lower() for c in STEP_COLUMNS if c.name == name)
        cost = "read by another column" if seconds is None else f"{total - seconds:+.3f} s"
        print(f"  {name:<22} {level:<6} {cost}")


if __name__ == "__main__":
    main()
