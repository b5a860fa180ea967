"""A run split by a run id made on each rank: each part misses the others' ranks, and says which runs hold them."""

from __future__ import annotations

from pathlib import Path

from tests.logs import UNEVEN_GA, check_json, records, token_mean, write
from tokaudit._checks import with_other_ranks
from tokaudit._report import Finding, StepRange
from tokaudit.codes import Code, Severity


def _absent(run: str, w: int, missing: list[int], first: int = 0, last: int = 9, group: str = "0") -> Finding:
    return Finding(
        run,
        Code.RANKS_NOT_RECORDED,
        Severity.WARNING,
        StepRange(first, last, last - first + 1),
        "The files given hold part of the run.",
        "give the whole run's folder",
        {"world_size": w, "ranks_not_recorded": missing, "group": group},
    )


def _others(findings: list[Finding]) -> dict[str, list[str]]:
    return {f.run: f.evidence.get("runs_with_other_ranks", []) for f in with_other_ranks(findings)}


def test_runs_of_the_same_w_and_steps_whose_ranks_are_disjoint_name_each_other() -> None:
    # W = 4 split as ranks {0, 1}, {2} and {3}: each part names the others
    found = _others([_absent("a", 4, [2, 3]), _absent("b", 4, [0, 1, 3]), _absent("c", 4, [0, 1, 2])])
    assert found == {"a": ["b", "c"], "b": ["a", "c"], "c": ["a", "b"]}


def test_runs_that_share_a_rank_or_no_step_or_another_w_or_group_are_left_as_they_are() -> None:
    alone = [
        _absent("a", 2, [1]),
        _absent("shares rank 0", 2, [1]),  # the same rank as a: a second run of rank 0, not its other half
        _absent("later", 2, [0], first=10, last=19),  # no step in common with a
        _absent("wider", 4, [0, 2, 3]),  # rank 1 of a W = 4 run
        _absent("other group", 2, [0], group="1"),
    ]
    assert _others(alone) == {run.run: [] for run in alone}
    assert with_other_ranks(alone) == alone
    untouched = Finding("x", Code.LOCAL_MEAN, Severity.ERROR, StepRange(0, 9, 10), "m", "f")
    assert with_other_ranks([untouched]) == [untouched]


def test_a_correct_run_recorded_under_a_run_id_per_rank_says_so_and_counts_its_ranks(tmp_path: Path) -> None:
    rows = records(UNEVEN_GA, token_mean)  # W = 2, every step correct
    for rank, run in ((0, "exp-1733000000"), (1, "exp-1733000001")):
        write(tmp_path / run / f"rank-{rank:05d}-000000.parquet", [r for r in rows if r["rank"] == rank])
    code, report, _ = check_json(tmp_path)
    assert code == 0  # inconclusive, and only warnings
    assert {run["run"]: (run["verdict"], run["ranks"]) for run in report["runs"]} == {
        "exp-1733000000": ("inconclusive", 1),
        "exp-1733000001": ("inconclusive", 1),
    }
    named = {f["run"]: f["evidence"]["runs_with_other_ranks"] for f in report["findings"]}
    assert named == {"exp-1733000000": ["exp-1733000001"], "exp-1733000001": ["exp-1733000000"]}
    assert all("run id differed from rank to rank" in f["message"] for f in report["findings"])
    assert all(f["fix"].startswith("give every rank the same run_id") for f in report["findings"])
    # no run_id column: the folders named the runs, and the message and fix say so
    assert all("in a folder of their own without a run_id column" in f["message"] for f in report["findings"])
    assert all("put every rank's files in one folder" in f["fix"] for f in report["findings"])
