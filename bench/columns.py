"""Where the step query's time goes, per declared column: `python bench/columns.py LOG [--repeat K]`.

The query of LOG's shape is written from the declarations (`tokaudit._engine.columns`) once whole and once without
each column in turn (a per-rank or per-microbatch value no column reads any more drops out with it); a column's
cost is the whole query's best time less the best time without it, the two alternated over the same files (this
machine's speed drifts by more than most columns cost). The whole query's time and the floor's (per-step N and
the extremes of b/S) are printed first. `--files N`: the first N files only (a range's worth). `--only A,B,…`: the
query of those columns alone beside the whole query and the floor, alternated (what a narrower table would cost).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import duckdb

from tokaudit._engine import Engine
from tokaudit._engine.columns import STEP_COLUMNS
from tokaudit._engine.sql import absent_values, one_name_of, one_record_form, step_sql
from tokaudit._loading import load


def timed(engine: Engine, query: str) -> float:
    start = time.perf_counter()
    engine.connection.execute(query).fetchnumpy()
    return time.perf_counter() - start


Shape = tuple[bool, bool, bool, frozenset[str]]
"""What `step_sql` is told of a log: the one-record form, the evidence, one name, what no record holds."""


def without(shape: Shape, *names: str) -> str:
    """The query of this shape with these columns left out (and the per-rank and per-microbatch values only they
    read)."""
    return step_sql(*shape, declared=[c for c in STEP_COLUMNS if c.name not in names])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--files", type=int, default=0)
    parser.add_argument("--only", default="", help="comma-separated columns: time the query of these alone")
    args = parser.parse_args()
    shards = sorted(load([args.log]).shards, key=lambda s: (s.step_range or (0, 0), str(s.path)))
    shards = shards[: args.files] if args.files else shards
    engine = Engine.open(shards)
    engine._whole()  # the views over every file, as the audit of a one-range log defines them
    shape = (one_record_form(shards), False, one_name_of(shards) is not None, absent_values(shards))
    whole = step_sql(*shape)
    floor = (
        "SELECT step, sum(valid_tokens), min(backward_scalar / loss_sum), max(backward_scalar / loss_sum) "
        "FROM raw_records GROUP BY step"
    )
    # a grouping with its columns: the query without every column of that level
    queries = {
        f"every {level}-level column": without(shape, *(c.name for c in STEP_COLUMNS if c.level.name.lower() == level))
        for level in ("rank", "micro")
    }
    queries.update(
        {c.name: without(shape, c.name) for c in STEP_COLUMNS if not c.evidence and f"AS {c.name}" in whole}
    )  # the columns this shape computes
    if args.only:
        _only(engine, shape, whole, floor, args.only.split(","), args.repeat)
        return
    total = min(timed(engine, whole) for _ in range(args.repeat))
    floor_time = min(timed(engine, floor) for _ in range(args.repeat))
    print(
        f"{args.log.name}: whole query {total:.2f} s, floor {floor_time:.2f} s, {sum(s.rows for s in shards):,} "
        f"records ({'one-record' if shape[0] else 'general'} form, {len(queries) - 2} columns computed)"
    )
    costs: dict[str, float | None] = {}
    for name, query in queries.items():
        try:
            pairs = [(timed(engine, whole), timed(engine, query)) for _ in range(args.repeat)]
        except duckdb.Error:
            # another column's value reads it (weight_by_micro_low = weight_low · N in the one-record form)
            costs[name] = None
            continue
        costs[name] = min(w for w, _ in pairs) - min(q for _, q in pairs)
    for name, cost in sorted(costs.items(), key=lambda item: -1.0 if item[1] is None else item[1], reverse=True):
        level = next((c.level.name.lower() for c in STEP_COLUMNS if c.name == name), "")
        print(f"  {name:<28} {level:<6} {'read by another column' if cost is None else f'{cost:+.3f} s'}")


def _only(engine: Engine, shape: Shape, whole: str, floor: str, names: list[str], repeat: int) -> None:
    """The query of these columns alone (and the per-rank and per-microbatch values they read), the whole query
    and the floor, alternated: what a narrower step table would cost."""
    unknown = sorted(set(names) - {c.name for c in STEP_COLUMNS})
    if unknown:
        raise SystemExit(f"no step column named {', '.join(unknown)}")
    narrow = step_sql(*shape, declared=[c for c in STEP_COLUMNS if c.name in names])
    times: dict[str, list[float]] = {"these columns": [], "whole query": [], "floor": []}
    for _ in range(repeat):
        for name, query in zip(times, (narrow, whole, floor)):
            times[name].append(timed(engine, query))
    for name, seen in times.items():
        print(f"  {name:<14} {min(seen):.2f}–{max(seen):.2f} s")


if __name__ == "__main__":
    main()
