"""Hive-partitioned logs (Spark's `partitionBy`, pyarrow's and pandas' `partition_cols`): what a `column=value`
folder gives the files under it, and the audit of such a log against the same records written whole."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from tests.logs import UNEVEN, UNEVEN_GA, check_json, local_mean, records, token_mean, write_by_rank
from tokaudit.cli import main
from tokaudit.errors import LogFormatError
from tokaudit._partitions import partition_folders, partition_values, run_folder


def test_the_folders_just_above_a_file_are_its_partitions_outermost_first_unquoted() -> None:
    path = PurePosixPath("/data/exp=1/logs/run-a/rank=3/term=aux%20head/part-0.parquet")
    assert partition_folders(path) == (("rank", "3"), ("term", "aux head"))
    assert partition_folders(PurePosixPath("/data/run-a/part-0.parquet")) == ()
    # a folder of a column of the log is a partition, whether the file leaves the column out or holds it too
    assert run_folder(path) == PurePosixPath("/data/exp=1/logs/run-a")
    # a Spark dataset folder named *.parquet: the run is the folder around it, as for its part files
    assert run_folder(PurePosixPath("/logs/run.parquet/rank=0/part-0.parquet")) == PurePosixPath("/logs")
    assert run_folder(PurePosixPath("/logs/run-a/part-0.parquet")) == PurePosixPath("/logs/run-a")
    # a sweep's folders are runs, not partitions
    assert run_folder(PurePosixPath("/sweep/lr=0.001/rank=0/f.parquet")) == PurePosixPath("/sweep/lr=0.001")


def test_the_runs_of_a_sweep_kept_in_lr_folders_stay_apart(tmp_path: Path) -> None:
    for folder, weights in (("lr=0.001", token_mean), ("lr=0.003", local_mean)):
        table = pa.Table.from_pylist(records(UNEVEN_GA, weights))
        ds.write_dataset(table, tmp_path / folder, format="parquet", partitioning=["rank"], partitioning_flavor="hive")
    code, report, _ = check_json(tmp_path)
    assert code == 1
    assert {run["run"]: run["verdict"] for run in report["runs"]} == {"lr=0.001": "correct", "lr=0.003": "incorrect"}


def test_a_folder_gives_a_value_only_to_a_column_the_file_lacks() -> None:
    path = PurePosixPath("/r/date=2026-12-06/rank=3/step=-2/term=__HIVE_DEFAULT_PARTITION__/group=7/f.parquet")
    values = partition_values(partition_folders(path), frozenset({"step"}))
    assert values == {"rank": 3, "term": None, "group": "7"}  # step is the file's; date is no column of the log
    assert isinstance(values["rank"], int) and isinstance(values["group"], str)
    # measured columns too, as pandas' partition_cols leaves them: a float, and a bool as Spark or pandas spells it
    path = PurePosixPath("/r/grad_divisor=1.0/sync=True/skipped=false/f.parquet")
    assert partition_values(partition_folders(path), frozenset()) == {
        "grad_divisor": 1.0,
        "sync": True,
        "skipped": False,
    }


@pytest.mark.parametrize(
    ("folder", "kind"), [("grad_divisor=one", "a float64"), ("sync=yes", "a bool"), ("sync=1", "a bool")]
)
def test_a_folder_whose_value_is_not_of_its_column_s_kind_is_refused_naming_it(folder: str, kind: str) -> None:
    with pytest.raises(LogFormatError) as raised:
        partition_values(partition_folders(PurePosixPath(f"/r/{folder}/f.parquet")), frozenset())
    column, _ = folder.split("=")
    assert raised.value.problem == f"the folder '{folder}' gives '{column}' a value that is not {kind}"


@pytest.mark.parametrize("folder", ["rank=x", "rank=1.5", "step=99999999999999999999", "micro="])
def test_a_folder_whose_value_is_not_an_integer_is_refused_naming_it(folder: str) -> None:
    with pytest.raises(LogFormatError) as raised:
        partition_values(partition_folders(PurePosixPath(f"/r/{folder}/f.parquet")), frozenset())
    column, value = folder.split("=")
    assert raised.value.problem == f"the folder '{folder}' gives '{column}' a value that is not an int64"


def test_a_folder_that_gives_a_required_column_a_null_is_refused_naming_it() -> None:
    with pytest.raises(LogFormatError) as raised:
        partition_values(partition_folders(PurePosixPath("/r/rank=__HIVE_DEFAULT_PARTITION__/f.parquet")), frozenset())
    assert raised.value.problem == (
        "the folder 'rank=__HIVE_DEFAULT_PARTITION__' gives 'rank' a null, and it may hold none"
    )


@pytest.mark.parametrize("writer", ["pyarrow", "pandas"])
def test_a_partitioned_log_gives_the_report_of_the_same_records_written_a_file_per_rank(
    tmp_path: Path, writer: str
) -> None:
    plain = tmp_path / "plain"
    for name, weights, counts in (("good", token_mean, UNEVEN), ("bad", local_mean, UNEVEN_GA)):
        write_by_rank(plain / name, records(counts, weights))
    code, expected, _ = check_json(plain)
    assert code == 1
    partitioned = tmp_path / "partitioned"
    for run in ("good", "bad"):
        table = pq.read_table(plain / run).replace_schema_metadata(None)
        if writer == "pandas":
            table.to_pandas().to_parquet(partitioned / run, partition_cols=["rank"])
        else:
            ds.write_dataset(
                table, partitioned / run, format="parquet", partitioning=["rank"], partitioning_flavor="hive"
            )
    before = {p: p.read_bytes() for p in partitioned.rglob("*.parquet")}
    code, report, _ = check_json(partitioned)
    assert code == 1
    assert report == dict(expected, files=len(before))
    assert {run["run"]: run["verdict"] for run in report["runs"]} == {"good": "correct", "bad": "incorrect"}
    assert {p: p.read_bytes() for p in partitioned.rglob("*.parquet")} == before, "input modified"


def test_a_file_that_holds_the_column_itself_keeps_its_own_values(tmp_path: Path) -> None:
    """A folder names a column only for files that leave it out: where a file holds it, the file's value stands
    (DuckDB's own reading of Hive folders would take the folder's)."""
    plain = write_by_rank(tmp_path / "plain" / "good", records(UNEVEN, token_mean))
    misplaced = tmp_path / "misplaced" / "good" / "rank=0"
    misplaced.mkdir(parents=True)
    for index, shard in enumerate(sorted(plain.glob("*.parquet"))):  # every rank's file under rank=0
        (misplaced / f"part-{index}.parquet").write_bytes(shard.read_bytes())
    (misplaced_run,), (plain_run,) = (
        check_json(tmp_path / "misplaced")[1]["runs"],
        check_json(tmp_path / "plain")[1]["runs"],
    )
    assert misplaced_run == plain_run  # the rank=0 folder is a partition of run good, whose files keep their ranks


@pytest.mark.parametrize("weights", [token_mean, local_mean])
def test_rank_folders_over_files_that_keep_their_rank_are_one_run(tmp_path: Path, weights: object) -> None:
    """Each rank's file under a `rank=R/` folder of its own run, each file holding its rank column too (a rank that
    writes its own file into its folder): one run, judged whole, as the same files side by side are."""
    plain = write_by_rank(tmp_path / "plain" / "exp1", records(UNEVEN_GA, weights))
    for index, shard in enumerate(sorted(plain.glob("*.parquet"))):
        folder = tmp_path / "folders" / "exp1" / f"rank={index}"
        folder.mkdir(parents=True)
        (folder / "part-0.parquet").write_bytes(shard.read_bytes())
    (run,), (plain_run,) = check_json(tmp_path / "folders")[1]["runs"], check_json(tmp_path / "plain")[1]["runs"]
    assert run == plain_run and run["run"] == "exp1"


def test_a_measured_column_given_by_folders_is_read(tmp_path: Path) -> None:
    """A summing reduction's log (b = S/N, D = 1: the token mean) written by pandas with partition_cols=["grad_divisor",
    "rank"]: the files leave D out, and the folders give it (left out, D would default to W and read 1/W)."""
    table = pa.Table.from_pylist(records(UNEVEN_GA, lambda S, N, **_: S / N, grad_divisor=1.0))
    table.to_pandas().to_parquet(tmp_path / "sum", partition_cols=["grad_divisor", "rank"])
    assert (tmp_path / "sum" / "grad_divisor=1").is_dir()  # as pandas writes 1.0
    code, report, _ = check_json(tmp_path)
    assert code == 0 and [(r["run"], r["verdict"]) for r in report["runs"]] == [("sum", "correct")], report


def test_a_rank_beyond_the_world_size_given_by_a_folder_is_one_line(tmp_path: Path) -> None:
    table = pa.Table.from_pylist(records(UNEVEN, token_mean))
    table = table.filter(pc.equal(table["rank"], 0))
    folder = tmp_path / "run" / "rank=5"
    folder.mkdir(parents=True)
    pq.write_table(table.drop_columns(["rank"]), folder / "part-0.parquet")
    result = CliRunner().invoke(main, ["check", str(tmp_path), "--format", "json"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("tokaudit: error:")]
    assert line == (
        f"tokaudit: error: {folder / 'part-0.parquet'}: column 'rank' is not below 'world_size' (5 ≥ 2) at row 0 "
        "(from its folder rank=5)"
    )


def test_a_run_partitioned_by_day_is_one_run_across_midnight(tmp_path: Path) -> None:
    """A log partitioned by date and rank (`date=…/rank=…/`), one run id on every row, rank 1's last step written
    after midnight: the two date folders share no (step, rank), so they are parts of one run (judged whole: the
    token mean), where two folders repeating steps are two runs (test_the_runs_of_a_sweep_kept_in_lr_folders_…)."""
    rows = records(UNEVEN_GA, token_mean, run_id="exp1")
    for (day, rank), mine in {
        ("2026-12-01", 0): [r for r in rows if r["rank"] == 0],
        ("2026-12-01", 1): [r for r in rows if r["rank"] == 1 and r["step"] < 2],
        ("2026-12-02", 1): [r for r in rows if r["rank"] == 1 and r["step"] == 2],
    }.items():
        folder = tmp_path / "logs" / f"date={day}" / f"rank={rank}"
        folder.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(mine).drop_columns(["rank"]), folder / "part-0.parquet")
    code, report, _ = check_json(tmp_path / "logs")
    assert code == 0 and [(r["run"], r["verdict"], r["steps"]) for r in report["runs"]] == [("exp1", "correct", 3)]
    # a file a day holding every rank, the days' steps apart: one run as well
    for day, first in (("2026-12-01", 0), ("2026-12-02", 2)):
        folder = tmp_path / "daily" / f"date={day}"
        folder.mkdir(parents=True)
        pq.write_table(
            pa.Table.from_pylist([r for r in rows if first <= r["step"] < first + 2]), folder / "part-0.parquet"
        )
    code, report, _ = check_json(tmp_path / "daily")
    assert code == 0 and [(r["run"], r["verdict"], r["steps"]) for r in report["runs"]] == [("exp1", "correct", 3)]
    # a file a day holding every rank, step 1 split at midnight (rank 0's before, rank 1's after): the files' step
    # ranges overlap, their records share no (step, rank): one run (it read as two, one missing a rank: incorrect)
    for day, kept in (
        ("2026-12-01", lambda r: (r["step"], r["rank"]) < (1, 1)),
        ("2026-12-02", lambda r: (r["step"], r["rank"]) >= (1, 1)),
    ):
        folder = tmp_path / "midnight" / f"date={day}"
        folder.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist([r for r in rows if kept(r)]), folder / "part-0.parquet")
    code, report, _ = check_json(tmp_path / "midnight")
    assert code == 0 and [(r["run"], r["verdict"], r["steps"]) for r in report["runs"]] == [("exp1", "correct", 3)]
