"""The audit on a local Ray cluster against one process: `python bench/cluster.py LOG [--workers 1 2]`.

Prints, for LOG: the step ranges and their records; each range aggregated alone in this process (what a worker
runs, `tokaudit._engine.aggregate_range`: records a second, the median range); `tokaudit check LOG` in one
process; and the same through a fresh local cluster of 1 and of 2 worker processes (`--ray`), each with the
coordinator's overhead: its wall time less the ranges' work divided among its workers. Every audit is a
`tokaudit check --format json` in a process of its own; the JSON of each is compared with one process's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def audited(log: Path, *extra: str) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tokaudit", "check", str(log), "--format", "json", "--quiet", *extra],
        capture_output=True,
        text=True,
    )
    if done.returncode not in (0, 1):
        raise SystemExit(done.stderr)
    return time.perf_counter() - start, done.stdout


def range_work(log: Path) -> tuple[int, list[tuple[int, float]]]:
    """(records, [(records, seconds) per range]) of LOG's step ranges, each aggregated alone here."""
    from tokaudit._engine import CHUNK_ROWS, RangeTask, aggregate_range, step_ranges
    from tokaudit._engine.connection import DEFAULT_MEMORY_LIMIT
    from tokaudit._loading import load

    shards = load([log], thorough=False).shards
    order = {id(shard): index for index, shard in enumerate(shards)}
    work = []
    for steps, members in step_ranges(shards, CHUNK_ROWS):
        task = RangeTask(
            tuple(sorted(members, key=lambda s: order[id(s)])), steps, False, True, True, DEFAULT_MEMORY_LIMIT
        )
        start = time.perf_counter()
        aggregate_range(task)
        records = (
            sum(s.rows for s in members)
            if steps is None
            else sum(
                rows
                for s in members
                for first, last, rows in (s.step_groups or ((*(s.step_range or (0, 0)), s.rows),))
                if first <= steps[1] and last >= steps[0]
            )
        )
        work.append((records, time.perf_counter() - start))
    return sum(s.rows for s in shards), work


def on_cluster(log: Path, workers: int) -> tuple[float, str]:
    """`tokaudit check LOG --ray` on a fresh local cluster of `workers` worker processes (its start not timed)."""
    ray = str(Path(sys.executable).with_name("ray"))
    folder = tempfile.mkdtemp(prefix="bray", dir="/tmp")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    subprocess.run(
        [
            ray,
            "start",
            "--head",
            "--node-ip-address",
            "127.0.0.1",
            "--port",
            "6399",
            "--num-cpus",
            str(workers),
            "--temp-dir",
            folder,
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
        ],
        env=env,
        check=True,
        capture_output=True,
    )
    try:
        return audited(log, "--ray", "127.0.0.1:6399")
    finally:
        subprocess.run([ray, "stop", "--force"], env=env, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log", type=Path)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    records, work = range_work(args.log)
    seconds = sum(s for _, s in work)
    rates = [n / s for n, s in work]
    print(f"{args.log.name}: {records:,} records in {len(work)} step range(s)")
    print(
        f"  a range alone (aggregate_range, one thread): median {statistics.median(rates) / 1e6:.2f}M records/s, "
        f"all ranges {seconds:.2f} s"
    )
    alone, expected = audited(args.log)
    print(f"  one process: {alone:.2f} s")
    for workers in args.workers:
        wall, report = on_cluster(args.log, workers)
        same = "the same JSON" if report == expected else "A DIFFERENT JSON"
        print(
            f"  Ray, {workers} worker(s): {wall:.2f} s ({wall / alone:.2f}× one process; coordinator's overhead "
            f"{wall - seconds / workers:.2f} s; {same})"
        )


if __name__ == "__main__":
    main()
