"""What a grouping costs DuckDB on a log: `python bench/groupings.py LOG [--repeat K]`.

The same five aggregates (a count, N, ΣS, the extremes of b) over the log's records, grouped by nothing, by step, by
(step, microbatch) and by (step, rank), and by (step, rank) with a count alone; each query's best of K, alternated
(this machine's speed drifts). The step table needs a grouping of each of these kinds (`engine.sql.step_sql`); the
floor (`bench/measure.py floor`) needs one by step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import duckdb

AGGREGATES = "count(*), sum(valid_tokens), fsum(loss_sum), min(backward_scalar), max(backward_scalar)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    files = sorted(str(p) for p in args.log.rglob("*.parquet"))
    connection = duckdb.connect()
    connection.execute(f"CREATE VIEW records AS SELECT * FROM read_parquet({files!r}, hive_partitioning = false)")
    queries = {
        "no grouping": f"SELECT {AGGREGATES} FROM records",
        "by step": f"SELECT step, {AGGREGATES} FROM records GROUP BY step",
        "by (step, micro)": f"SELECT step, micro, {AGGREGATES} FROM records GROUP BY step, micro",
        "by (step, rank)": f"SELECT step, rank, {AGGREGATES} FROM records GROUP BY step, rank",
        "by (step, rank), a count alone": "SELECT step, rank, count(*) FROM records GROUP BY step, rank",
    }
    groups = {
        name: len(connection.execute(query).fetchall()) if name != "no grouping" else 1
        for name, query in queries.items()
    }
    best = dict.fromkeys(queries, float("inf"))
    for _ in range(args.repeat):
        for name, query in queries.items():
            start = time.perf_counter()
            connection.execute(query).fetchnumpy()
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"{args.log.name}: {len(files)} files, best of {args.repeat}")
    for name, seconds in best.items():
        print(f"  {name:<32} {groups[name]:>10,} groups  {seconds:.2f} s")


if __name__ == "__main__":
    main()
