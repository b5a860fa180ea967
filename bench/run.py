"""All benchmarks in one command: `make bench` (or python bench/run.py [--rows N] [--repeat K] [--skip-overhead]
[--processes K] [--process-steps N]).

Prints one table: recorder overhead on a CPU transformer LM, and `tokaudit check` (and its audit work: the
check less its start-up, the imports timed alone beside it) next to a one-query DuckDB floor (per-step N and the extremes of b/S over the same files) and a naive pandas
audit, on synthetic logs (default 10⁷ rows as 64 ranks × 4 microbatches and as 8 ranks × 1 microbatch in
the recorder's layout, 64 × 4 again with every column the recorder writes, both compacted into a few large
files, plus 10,000 one-row shards; --rows 1e8 for 1,024 ranks × 4 and 8 ranks × 1, 12.5M steps).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def measured(kind: str, path: Path) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, str(HERE / "measure.py"), kind, str(path)], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _compare(label: str, log: Path, naive: bool, repeat: int) -> list[tuple[str, str]]:
    """tokaudit check next to the one-query floor (and naive pandas), alternated `repeat` times: the
    best time of each (this machine's noise only ever adds), the largest peak, and the times' range."""
    kinds = ["floor", "check", "startup", *(["naive"] if naive else [])]
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for _ in range(repeat):
        for kind in kinds:
            runs[kind].append(measured(kind, log))

    def figure(kind: str) -> str:
        times = [run["wall_s"] for run in runs[kind]]
        spread = f" (runs {min(times):.2f}–{max(times):.2f} s)" if len(times) > 1 else ""
        return f"{min(times):.2f} s, {max(run['peak_rss_mb'] for run in runs[kind]):.0f} MiB{spread}"

    best = {kind: min(run["wall_s"] for run in runs[kind]) for kind in kinds}
    # audit work: the check less what its imports take, each its best time (the start-up measured beside it)
    work = best["check"] - best["startup"]
    against_pandas = f", {best['check'] / best['naive']:.2f}× naive pandas" if naive else ""
    rows = [
        (
            f"{label}: tokaudit check",
            f"{figure('check')}, {best['check'] / best['floor']:.1f}× the floor{against_pandas}",
        ),
        (
            f"{label}: audit work (check − start-up {best['startup']:.2f} s)",
            f"{work:.2f} s, {work / best['floor']:.1f}× the floor",
        ),
        (f"{label}: one-query floor", figure("floor")),
    ]
    if naive:
        rows.append((f"{label}: naive pandas", figure("naive")))
    return rows


def _kept_heap(steps: int) -> list[tuple[str, str]]:
    """The loops again in a process whose glibc heap keeps its large blocks (`overhead.py --keep-heap`)."""
    from overhead import in_process

    try:
        result = in_process(steps, keep_heap=True)
    except RuntimeError as error:
        return [("recorder: step-time ratio, heap kept", f"not measured ({error})")]
    return [
        (
            "recorder: median step, heap kept: plain → Recorder + probe",
            f"{result['plain_ms']:.1f} ms → {result['recorded_ms']:.1f} ms",
        ),
        ("recorder: step-time ratio, heap kept", _ratio(result)),
    ]


def _ratio(result: dict[str, Any]) -> str:
    """The loops' ratio of median steps, and each fifth's, beside the control loop's, and each loop's page faults a
    step (`overhead.measure`)."""
    from overhead import faults_line

    return (
        f"{result['ratio']:.4f} (per fifth of the steps: {', '.join(f'{r:.3f}' for r in result['block_ratios'])}); "
        f"the control loop, plain again: {result['control_ratio']:.4f}; recorded against both plain loops: "
        f"{result['ratio_to_both']:.4f}; {faults_line(result)}"
    )


def _in_processes(processes: int, steps: int) -> list[tuple[str, str]]:
    """The loops in fresh processes under glibc's default heap (`overhead.in_processes`): each ratio's mean."""
    from overhead import in_processes

    label = f"recorder: step-time ratio, mean of {processes} fresh processes ({steps} steps a loop)"
    try:
        summary = in_processes(processes, steps, keep_heap=False)
    except RuntimeError as error:
        return [(label, f"not measured ({error})")]
    (ratio, ratio_error), (control, control_error) = summary["ratio"], summary["control_ratio"]
    both, both_error = summary["ratio_to_both"]
    each = ", ".join(
        f"{run['ratio']:.3f} ({run['faults']['recorded'] - run['faults']['plain']:+.0f})" for run in summary["runs"]
    )
    return [
        (
            label,
            f"{ratio:.4f} ± {ratio_error:.4f}; the control loop {control:.4f} ± {control_error:.4f}; "
            f"recorded against both plain loops {both:.4f} ± {both_error:.4f} (± one standard error; the "
            f"processes' own recorded/plain, with the recorded loop's page faults a step over the plain "
            f"loop's: {each})",
        )
    ]


def once(log: Path, write: Callable[[Path], object]) -> Path:
    """`log`, written by `write` if it is not there yet: beside it, renamed when whole, so that a bench
    stopped midway leaves no partial log to be taken for a finished one."""
    if not log.exists():
        print(f"writing {log} (once)…", file=sys.stderr)
        partial = log.with_name(log.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        write(partial)
        partial.rename(log)
    return log


def decoded_share(log: Path) -> str:
    """What the audit's plan decodes, over what the log holds: each step range reads the row groups whose step
    statistics overlap it, and a row group overlapping k ranges is decoded k times (compressed bytes, from the
    footers and the ranges `tokaudit._engine.step_ranges` cuts)."""
    import pyarrow.parquet as pq

    from tokaudit._engine import CHUNK_ROWS, step_ranges
    from tokaudit._loading import load

    shards = load([log]).shards
    groups: dict[str, list[tuple[int, int, int]]] = {}
    for shard in shards:
        meta = pq.ParquetFile(str(shard.path)).metadata
        column = meta.schema.to_arrow_schema().get_field_index("step")
        groups[str(shard.path)] = [
            (
                meta.row_group(g).column(column).statistics.min,
                meta.row_group(g).column(column).statistics.max,
                meta.row_group(g).total_byte_size,
            )
            for g in range(meta.num_row_groups)
        ]
    total = sum(size for parts in groups.values() for _, _, size in parts)
    decoded = 0
    for steps, members in step_ranges(shards, CHUNK_ROWS):
        for shard in members:
            decoded += sum(
                size
                for low, high, size in groups[str(shard.path)]
                if steps is None or (low <= steps[1] and high >= steps[0])
            )
    return f"{decoded / total:.2f}"


AUDIT_IMPORTS = """
import sys, sysconfig
from pathlib import Path
import duckdb, tokaudit._auditing, tokaudit.cli, tokaudit._render.json_report
installed = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
for module in list(sys.modules.values()):
    path = Path(str(getattr(module, "__file__", None) or ""))
    if path.name == "__init__.py" and (str(path.parent.parent) in installed or path.parent.name == "tokaudit"):
        print(path.parent)
"""
"""Prints the installed packages the floor (duckdb) and `check --format json` (as it runs) import."""


def _compile_audit_imports() -> None:
    """Bytecode for what the audit and the floor import, as a `pip install` that compiles leaves it: `make setup`
    installs without it, and under PYTHONDONTWRITEBYTECODE (this machine's) every start would compile again.
    The packages are found in a fresh interpreter: this one has imported torch for the recorder's benchmark."""
    found = subprocess.run([sys.executable, "-c", AUDIT_IMPORTS], check=True, capture_output=True, text=True)
    subprocess.run([sys.executable, "-m", "compileall", "-q", *sorted(set(found.stdout.splitlines()))], check=True)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=float, default=1e7, help="rows of the synthetic log (1e7 or 1e8)")
    parser.add_argument("--out", type=Path, default=HERE / "out", help="where synthetic logs are kept")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--steps", type=int, default=150, help="steps per loop in the overhead benchmark")
    parser.add_argument(
        "--processes",
        type=int,
        default=4,
        help="fresh processes of the recorder's loops under glibc's default heap (2 or more)",
    )
    parser.add_argument("--process-steps", type=int, default=60, help="steps per loop in each of those processes")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each audit, alternated (the best time counts)")
    return parser.parse_args()


def _recorder_rows(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The recorder's cost in a training loop (`overhead.py`)."""
    sys.path.insert(0, str(HERE))
    import torch
    from overhead import in_loop_line, measure, parts, parts_per_step

    torch.set_num_threads(2)
    result = measure(args.steps)
    cost = parts()
    per_step, ratio = parts_per_step(cost, result["plain_ms"])
    return [
        ("recorder: median step, plain", f"{result['plain_ms']:.1f} ms"),
        ("recorder: median step, Recorder + probe", f"{result['recorded_ms']:.1f} ms"),
        ("recorder: step-time ratio", _ratio(result)),
        ("recorder: its calls, timed in the loop", in_loop_line(result).removeprefix("in the loop, ")),
        ("recorder: ratio with shard flushes amortized", f"{result['ratio_with_flush']:.4f}"),
        *_in_processes(args.processes, args.process_steps),
        *_kept_heap(args.steps),
        (
            "recorder: parts per microbatch, timed alone",
            ", ".join(f"{name[:-3].replace('_', ' ')} {value:.0f} µs" for name, value in cost.items()),
        ),
        ("recorder: parts per step, as a ratio", f"{per_step:.2f} ms, {ratio:.4f}"),
    ]


def _layout_rows(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The synthetic logs in tokaudit's own layouts: the recorder's (one shard per rank, 4,096 records), then
    compacted logs (few large files, each of many steps and every rank, as compaction or a writer with a large
    flush_every leaves them); half the steps rank-local means, planted."""
    from synthetic import write_log

    # (label, ranks, micro, steps per file, ranks per file, every recorder column, folder suffix)
    layouts = [
        ("64 ranks × 4 micro", 64, 4, 1024, 1, False, ""),
        ("8 ranks × 1 micro", 8, 1, 4096, 1, False, ""),
        ("64 ranks × 4 micro, the recorder's 23 columns", 64, 4, 1024, 1, True, "-recorder"),
        ("64 ranks × 4 micro, compacted in 318 files", 64, 4, 123, 64, False, "-compacted"),
        ("8 ranks × 1 micro, compacted in 40 files", 8, 1, 31250, 8, False, "-compacted"),
    ]
    if args.rows >= 1e8:
        layouts = [
            ("1,024 ranks × 4 micro", 1024, 4, 1024, 1, False, ""),
            ("8 ranks × 1 micro", 8, 1, 4096, 1, False, ""),
        ]
    rows: list[tuple[str, str]] = []
    for label, ranks, micro, steps_per_file, ranks_per_file, recorder, suffix in layouts:
        steps = int(args.rows) // (ranks * micro)
        log = args.out / f"synthetic-{ranks}x{steps}x{micro}{suffix}"
        # (called at once, in this iteration: the lambda's loop variables are this layout's)
        once(
            log,
            lambda path: write_log(
                path, ranks, steps, micro, steps_per_file, ranks_per_file, local_mean_every=2, recorder_columns=recorder
            ),
        )
        rows += _compare(
            f"{ranks * steps * micro:.0e} rows, {label} ({steps:,} steps)",
            log,
            naive=ranks * steps * micro <= 2e7 and not suffix,
            repeat=args.repeat,
        )
    return rows


def _writer_rows(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The same logs as other tools leave them (`synthetic.rewrite`), without tokaudit's metadata."""
    from synthetic import WRITERS, rewrite

    rows: list[tuple[str, str]] = []
    if args.rows < 1e8:
        steps = int(args.rows) // 256
        source = args.out / f"synthetic-64x{steps}x4"
        for writer in WRITERS:
            log = once(args.out / f"synthetic-64x{steps}x4-{writer}", lambda path: rewrite(source, path, writer))
            rows += _compare(
                f"{64 * steps * 4:.0e} rows, 64 ranks × 4 micro written by {writer} ({steps:,} steps)",
                log,
                naive=True,
                repeat=args.repeat,
            )
            rows.append((f"  {writer}: bytes decoded ÷ bytes in the log", decoded_share(log)))
    # The 8 × 1 log as pyarrow writes it, at 10⁸ rows too (a writer's log beside the recorder's): the ranks' 1Mi-row
    # groups overlap in steps, so each segment holds 10⁶ steps, read in windows (`tokaudit._engine.stream`).
    source = args.out / f"synthetic-8x{int(args.rows) // 8}x1"
    log = once(args.out / f"{source.name}-pyarrow", lambda path: rewrite(source, path, "pyarrow"))
    rows += _compare(
        f"{args.rows:.0e} rows, 8 ranks × 1 micro written by pyarrow ({int(args.rows) // 8:,} steps)",
        log,
        naive=args.rows < 1e8,
        repeat=args.repeat,
    )
    rows.append(("  8 × 1 pyarrow: bytes decoded ÷ bytes in the log", decoded_share(log)))
    return rows


def _small_rows(args: argparse.Namespace) -> list[tuple[str, str]]:
    """10,000 one-row shards, with the bench's columns and with every column the recorder writes."""
    from synthetic import write_small_shards

    small = once(args.out / "small-10000", lambda path: write_small_shards(path, 100, 100))
    recorded = once(
        args.out / "small-10000-recorder", lambda path: write_small_shards(path, 100, 100, recorder_columns=True)
    )
    return [
        *_compare("10,000 one-row shards", small, naive=False, repeat=args.repeat),
        *_compare("10,000 one-row shards, the recorder's 23 columns", recorded, naive=False, repeat=args.repeat),
    ]


def main() -> None:
    args = _arguments()
    rows = [] if args.skip_overhead else _recorder_rows(args)
    sys.path.insert(0, str(HERE))
    _compile_audit_imports()
    rows += _layout_rows(args) + _writer_rows(args) + _small_rows(args)
    width = max(len(name) for name, _ in rows)
    print(f"{'benchmark':<{width}}  figure")
    print(f"{'-' * width}  ------")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
