"""Hand-made logs for tests: records built from counts and a normalization, written as shards."""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tokaudit.codes import Code
from tokaudit._report import AuditReport, Finding
from tokaudit._schema import WRITER_SCHEMA

Counts = Sequence[Sequence[Sequence[int]]]  # counts[step][rank][micro]

THOROUGH = os.environ.get("TOKAUDIT_THOROUGH") == "1"
"""Run every random case (TOKAUDIT_THOROUGH=1): the suite's default draws a fifth of them."""


def seeds(thorough: int) -> range:
    """Seeds of a test over random inputs: all `thorough` of them with TOKAUDIT_THOROUGH=1, else a fifth (at least
    two); each seed draws the same input every run."""
    return range(thorough if THOROUGH else max(2, thorough // 5))


def token_loss(step: int, rank: int, micro: int, n: int) -> float:
    """A deterministic, positive loss sum S for n tokens (≈2.3 per token, never 0 when n > 0)."""
    return n * (2.0 + 0.1 * ((7 * step + 3 * rank + micro) % 5))


def records(
    counts: Counts, scalar: Callable[..., float], world_size: int | None = None, step_offset: int = 0, **columns: Any
) -> list[dict[str, Any]]:
    """One record per (step, rank, micro). `scalar(S=, n=, N=, N_m=, n_r=, M=, W=)` gives b."""
    rows = []
    for step_index, step_counts in enumerate(counts):
        step = step_index + step_offset
        w = world_size or len(step_counts)
        step_tokens = sum(sum(r) for r in step_counts)
        for rank, mine in enumerate(step_counts):
            for micro, n in enumerate(mine):
                micro_tokens = sum(r[micro] for r in step_counts if micro < len(r))
                loss = token_loss(step, rank, micro, n)
                b = scalar(S=loss, n=n, N=step_tokens, N_m=micro_tokens, n_r=sum(mine), M=len(mine), W=w)
                rows.append(
                    {
                        "step": step,
                        "micro": micro,
                        "rank": rank,
                        "world_size": w,
                        "loss_sum": loss,
                        "valid_tokens": n,
                        "backward_scalar": b,
                        **columns,
                    }
                )
    return rows


def read_rows(log_dir: Path) -> list[dict[str, Any]]:
    """Every record of the shards in one folder, in shard order."""
    return [row for shard in sorted(log_dir.glob("*.parquet")) for row in pq.read_table(shard).to_pylist()]


def write(
    path: Path, rows: list[dict[str, Any]], schema: pa.Schema | None = None, metadata: dict[bytes, bytes] | None = None
) -> Path:
    """Write rows as one shard with the recorder's schema (columns absent from rows are dropped), and `metadata`
    in its footer."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = (
        [f.name for f in WRITER_SCHEMA if any(f.name in row for row in rows)]
        if rows
        else [f.name for f in WRITER_SCHEMA][:7]
    )
    schema = schema or pa.schema([WRITER_SCHEMA.field(n) for n in names])
    table = pa.table(
        {n: pa.array([row.get(n) for row in rows], type=schema.field(n).type) for n in schema.names},
        schema=schema.with_metadata(metadata) if metadata else schema,
    )
    pq.write_table(table, path)
    return path


def write_by_rank(
    folder: Path,
    rows: list[dict[str, Any]],
    metadata: dict[bytes, bytes] | None = None,
    steps_per_file: int | None = None,
) -> Path:
    """One shard per rank, as the recorder writes them; with `steps_per_file`, one per rank and that many steps
    (a long run's shards, which the audit can aggregate a range of steps at a time)."""
    for rank in sorted({row["rank"] for row in rows}):
        mine = [row for row in rows if row["rank"] == rank]
        last = max(row["step"] for row in mine)
        span = steps_per_file or last + 1
        for first in range(0, last + 1, span):
            held = [row for row in mine if first <= row["step"] < first + span]
            if held:
                write(folder / f"rank-{rank:05d}-{first:06d}.parquet", held, metadata=metadata)
    return folder


def check_json(*paths: Path) -> tuple[int, dict[str, Any], list[str]]:
    """`tokaudit check PATHS --format json` as a user runs it: its exit code, its report, its stderr lines (never a
    traceback)."""
    import json

    from click.testing import CliRunner

    from tokaudit.cli import main

    result = CliRunner().invoke(main, ["check", *map(str, paths), "--format", "json"])
    assert "Traceback" not in result.output
    return result.exit_code, json.loads(result.stdout), result.stderr.splitlines()


def audit_rows(tmp_path: Path, rows: list[dict[str, Any]], **kwargs: Any) -> AuditReport:
    """Audit rows written as one shard per rank under tmp_path/run."""
    from tokaudit._auditing import audit

    return audit([write_by_rank(tmp_path / "run", rows)], **kwargs)


def codes(report: AuditReport) -> set[str]:
    return {f.code.value for f in report.findings}


def only(report: AuditReport, code: Code) -> Finding:
    (finding,) = [f for f in report.findings if f.code == code]
    return finding


# Backward scalars of the usual constructions (b per record; D = W unless the test says otherwise).
def token_mean(S: float, N: int, W: int, **_: Any) -> float:
    return W * S / max(N, 1)


def local_mean(S: float, n: int, **_: Any) -> float:
    return S / n if n else float("nan")


UNEVEN: Counts = [[[1], [3]], [[5], [2]], [[4], [6]]]
UNEVEN_GA: Counts = [[[5, 1], [3, 7]], [[2, 6], [6, 2]], [[8, 4], [2, 8]]]


@functools.cache
def bench_synthetic() -> ModuleType:
    """The bench's log writer (bench/synthetic.py; bench/ is scripts, not a package), loaded from its file once,
    the test session's sys.path left as it is."""
    spec = importlib.util.spec_from_file_location(
        "bench_synthetic", Path(__file__).resolve().parents[1] / "bench" / "synthetic.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
