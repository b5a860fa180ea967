"""Write a large synthetic log: a correct run (b = W·S/N) with uneven counts, laid out as shards."""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokaudit._schema import WRITER_SCHEMA


_BENCH_COLUMNS = (
    "step",
    "micro",
    "rank",
    "world_size",
    "loss_sum",
    "valid_tokens",
    "backward_scalar",
    "run_id",
    "group",
    "grad_divisor",
    "grad_scale",
    "positions",
    "sync",
)
"""The 13 columns a bench log holds (the recorder writes 23)."""


def write_log(
    out: Path,
    ranks: int,
    steps: int,
    micro: int,
    steps_per_file: int = 500,
    ranks_per_file: int = 64,
    seed: int = 0,
    local_mean_every: int = 0,
    recorder_columns: bool = False,
) -> int:
    """Rows = ranks × steps × micro, one file per (step chunk, rank block), rows sorted by step.
    `recorder_columns`: every column the recorder writes with a probe and a reported loss (the probe's
    weights those b gives each token, NULL extremes on a record of no token, the masked weight 0.0, no loss
    scaler, a time stamp), where the plain log holds the 13 a bench needs."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows = 0
    schema = WRITER_SCHEMA if recorder_columns else pa.schema([WRITER_SCHEMA.field(n) for n in _BENCH_COLUMNS])
    for first in range(0, steps, steps_per_file):
        chunk = min(steps_per_file, steps - first)
        counts = rng.integers(0, 513, size=(chunk, ranks, micro))
        losses = counts * rng.uniform(1.5, 3.5, size=counts.shape)
        for block in range(0, ranks, ranks_per_file):
            r = slice(block, min(block + ranks_per_file, ranks))
            columns = _block_columns(first, counts, losses, r, local_mean_every)
            if recorder_columns:
                columns.update(_recorder_columns(first, counts, losses, r, columns))
            table = pa.table(columns, schema=schema)
            pq.write_table(table, out / f"chunk-{first:07d}-ranks-{r.start:05d}.parquet", row_group_size=65536)
            rows += len(table)
    return rows


def _block_columns(
    first: int, counts: np.ndarray, losses: np.ndarray, r: slice, local_mean_every: int
) -> dict[str, pa.Array]:
    """The bench's columns of ranks `r` in a chunk of steps from `first` (counts and losses [step, rank, micro]):
    b = W·S/N, the token mean, but in the steps planted with a rank-local mean S_r/n_r."""
    chunk, ranks, micro = counts.shape
    n, loss = counts[:, r, :], losses[:, r, :]
    shape, size = n.shape, n.size
    step_tokens = counts.sum(axis=(1, 2))  # N per step
    micro_index = np.broadcast_to(np.arange(micro)[None, None, :], shape)
    scalar = ranks * loss / np.maximum(step_tokens, 1)[:, None, None]  # W·S/N
    if local_mean_every:
        # every other step a rank-local mean S_r/n_r: a mistake planted in known steps
        planted = (first + np.arange(chunk)) % local_mean_every == 1
        rank_tokens = np.broadcast_to(n.sum(axis=2, keepdims=True), shape)
        scalar = np.where(planted[:, None, None], loss / np.maximum(rank_tokens, 1), scalar)
    return {
        "step": pa.array(np.broadcast_to((first + np.arange(chunk))[:, None, None], shape).ravel(), pa.int64()),
        "micro": pa.array(micro_index.ravel(), pa.int32()),
        "rank": pa.array(np.broadcast_to(np.arange(r.start, r.stop)[None, :, None], shape).ravel(), pa.int32()),
        "world_size": pa.array(np.full(size, ranks), pa.int32()),
        "loss_sum": pa.array(loss.ravel()),
        "valid_tokens": pa.array(n.ravel(), pa.int64()),
        "backward_scalar": pa.array(scalar.ravel()),
        "run_id": pa.array(["synthetic"] * size),
        "group": pa.array(["0"] * size),
        "grad_divisor": pa.array(np.full(size, float(ranks))),
        "grad_scale": pa.array(np.ones(size)),
        "positions": pa.array(np.full(size, 512), pa.int64()),
        "sync": pa.array(micro_index.ravel() == micro - 1),
    }


def _recorder_columns(
    first: int, counts: np.ndarray, losses: np.ndarray, r: slice, columns: dict[str, pa.Array]
) -> dict[str, pa.Array]:
    """The recorder's other columns for those records: ∂b/∂ℓᵢ = b/S on each valid token of a mean loss; no loss
    scaler (g NULL); the step's mean loss reported."""
    n = counts[:, r, :]
    size = n.size
    loss, scalar = losses[:, r, :].ravel(), columns["backward_scalar"].to_numpy()
    valid = n.ravel() > 0
    weight = np.where(valid, scalar / np.where(valid, loss, 1.0), 0.0)
    step_mean = losses.sum(axis=(1, 2)) / np.maximum(counts.sum(axis=(1, 2)), 1)
    start = datetime.datetime(2026, 11, 30, tzinfo=datetime.timezone.utc)
    return {
        "term": pa.array(["0"] * size),
        "divisor_known": pa.array(np.ones(size, dtype=bool)),
        "grad_scale": pa.nulls(size, pa.float64()),
        "term_weight": pa.nulls(size, pa.float64()),
        "token_weight_sum": pa.array(weight * n.ravel()),
        "token_weight_min": pa.array(weight, mask=~valid),
        "token_weight_max": pa.array(weight, mask=~valid),
        "masked_weight_abs_sum": pa.array(np.zeros(size)),
        "reported_loss": pa.array(np.broadcast_to(step_mean[:, None, None], n.shape).ravel()),
        "skipped": pa.nulls(size, pa.bool_()),
        "time": pa.array(np.full(size, int(start.timestamp() * 1e6) + first), pa.timestamp("us", tz="UTC")),
        "schema_version": pa.array(np.ones(size, dtype=np.int32)),
        # a float32 model's S and b: 24 significant bits
        "precision_bits": pa.array(np.full(size, 24, dtype=np.int8)),
    }


WRITERS = ("pandas", "pyarrow", "250k-steps", "spark", "spark-by-rank", "one-file")
"""How other tools leave a log (`rewrite`): none of them writes tokaudit's footer metadata."""


def rewrite(source: Path, out: Path, writer: str) -> None:
    """The log at `source` as another writer leaves it, none of tokaudit's metadata kept:
    pandas: one file per rank, `DataFrame.to_parquet` with its defaults; pyarrow: one file per rank,
    `pq.write_table` with its defaults (row groups of up to 1Mi rows); 250k-steps: files of 250,000 steps, every
    rank in each, one row group a file (a compaction job); spark: 8 files of several ranks each, in row groups of
    about 128 MB (Spark's `parquet.block.size`, here rows of about 64 bytes); spark-by-rank: Spark's
    `partitionBy("rank")`, a `rank=R/` folder a rank whose file leaves the column out; one-file: the whole log in one
    file, pyarrow's defaults."""
    import pyarrow.dataset as pads

    out.mkdir(parents=True, exist_ok=True)
    table = pads.dataset(source, format="parquet").to_table()
    table = table.replace_schema_metadata(None)
    if writer in ("pandas", "pyarrow"):
        ranks = table.column("rank").to_numpy()
        for rank in np.unique(ranks):
            part = table.filter(pa.array(ranks == rank)).sort_by([("step", "ascending"), ("micro", "ascending")])
            path = out / f"part-{int(rank):05d}.parquet"
            if writer == "pandas":
                part.to_pandas().to_parquet(path, index=False)
            else:
                pq.write_table(part, path)
        return
    table = table.sort_by([("step", "ascending"), ("rank", "ascending"), ("micro", "ascending")])
    if writer == "250k-steps":
        steps = table.column("step").to_numpy()
        for first in range(0, int(steps.max()) + 1, 250_000):
            part = table.filter(pa.array((steps >= first) & (steps < first + 250_000)))
            pq.write_table(part, out / f"part-{first // 250_000:05d}.parquet", row_group_size=max(part.num_rows, 1))
    elif writer == "spark-by-rank":
        ranks = table.column("rank").to_numpy()
        for rank in np.unique(ranks):
            part = table.filter(pa.array(ranks == rank)).drop_columns(["rank"])
            (out / f"rank={int(rank)}").mkdir()
            pq.write_table(part, out / f"rank={int(rank)}" / "part-00000-c000.snappy.parquet", row_group_size=2_000_000)
    elif writer == "spark":
        ranks = table.column("rank").to_numpy()
        blocks = np.array_split(np.unique(ranks), 8)
        for index, block in enumerate(blocks):
            part = table.filter(pa.array(np.isin(ranks, block)))
            pq.write_table(part, out / f"part-{index:05d}-c000.snappy.parquet", row_group_size=2_000_000)
    else:
        pq.write_table(table, out / "log.parquet")


def write_small_shards(out: Path, steps: int, ranks: int, recorder_columns: bool = False) -> None:
    """steps × ranks one-row shards of a correct run (the many-small-files case): the seven required
    columns, or with `recorder_columns` every column the recorder writes with a probe (`flush_every=1`:
    a time stamp, the probe's sums, the masked weight 0.0, no reported loss)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    start = datetime.datetime(2026, 11, 30, tzinfo=datetime.timezone.utc)
    for step in range(steps):
        counts = rng.integers(1, 100, size=ranks)
        total = int(counts.sum())
        for rank in range(ranks):
            n = int(counts[rank])
            row: dict[str, Any] = {
                "step": step,
                "micro": 0,
                "rank": rank,
                "world_size": ranks,
                "loss_sum": 2.0 * n,
                "valid_tokens": n,
                "backward_scalar": ranks * 2.0 * n / total,
            }
            if recorder_columns:
                row.update(
                    run_id=out.name,
                    group="0",
                    term="0",
                    grad_divisor=float(ranks),
                    divisor_known=True,
                    positions=n + 3,
                    token_weight_sum=ranks * n / total,
                    token_weight_min=ranks / total,
                    token_weight_max=ranks / total,
                    masked_weight_abs_sum=0.0,
                    sync=True,
                    time=start + datetime.timedelta(seconds=step),
                    schema_version=1,
                )
            schema = WRITER_SCHEMA if recorder_columns else pa.schema([WRITER_SCHEMA.field(c) for c in row])
            pq.write_table(pa.Table.from_pylist([row], schema=schema), out / f"rank-{rank:05d}-{step:06d}.parquet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument(
        "--recorder-columns",
        action="store_true",
        help="every column the recorder writes, with a probe and a reported loss",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    rows = write_log(args.out, args.ranks, args.steps, args.micro, recorder_columns=args.recorder_columns)
    print(f"wrote {rows:,} rows to {args.out} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
