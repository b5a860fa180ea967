"""A step table read in parts (kept on disk a range at a time, read a few steps at a time) gives the report
of the whole table: every finding, verdict and number, byte for byte in the JSON."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from tests.logs import THOROUGH, UNEVEN_GA, local_mean, records, token_mean, write, write_by_rank
from tokaudit._auditing import audit
from tokaudit._render.json_report import render_json

SAMPLE_LOGS = Path(__file__).resolve().parents[2] / "sample_logs"


def _in_parts(monkeypatch: pytest.MonkeyPatch, chunk_rows: int, block: int) -> None:
    """Every table kept on disk, in ranges of about `chunk_rows` records, read `block` steps at a time, and
    every column the vote and the checks sort (α, q) kept on disk in sorted runs of `block` + 2 values."""
    import tokaudit._checks.base as checks
    import tokaudit._engine.database as engine
    import tokaudit._sorting as sorting

    monkeypatch.setattr(sorting, "RUN_VALUES", block + 2)
    monkeypatch.setattr(sorting, "MERGE_VALUES", 2 * block)
    monkeypatch.setattr(engine, "SPILL_STEPS", 0)
    monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", str(chunk_rows))
    monkeypatch.setattr(checks, "BLOCK_STEPS", block)


def _mixed_log(folder: Path) -> Path:
    """Two groups and two terms with different mistakes, a uniform factor that varies, a reported loss
    rounded to 3 decimals and partly the mean of local means, and steps shared by the groups."""
    counts = [[[5, 1], [3, 7]], [[2, 6], [6, 2]], [[8, 4], [2, 8]], [[3, 3], [3, 3]], [[0, 4], [9, 1]]] * 4
    rows = records(counts, local_mean, group="dp0") + records(counts, token_mean, group="dp1")
    rows += [
        dict(r, term="aux", backward_scalar=r["backward_scalar"] * (1.5 if r["step"] % 2 else 3.0))
        for r in records(counts, token_mean, group="dp1")
    ]
    for row in rows:
        if row["step"] % 3 == 0 and row.get("term") is None:
            row["reported_loss"] = round(2.0 + row["step"] / 10, 3)
    return write_by_rank(folder, rows, steps_per_file=2)


def _miscounted_log(folder: Path) -> Path:
    """Two groups and two terms, right (W·S/N) and probed; some records count more tokens than the probe saw:
    dp0 at steps 3 and 7, dp1 at steps 2 and 7, dp1's aux term at step 12 (the whole table lists dp0 first,
    the parts reach step 2 first: the evidence is step 2's either way)."""
    counts = [[[5, 1], [3, 7]], [[2, 6], [6, 2]], [[8, 4], [2, 8]]] * 5
    rows = records(counts, token_mean, group="dp0") + records(counts, token_mean, group="dp1")
    rows += [dict(r, term="aux") for r in records(counts, token_mean, group="dp1")]
    for row in rows:
        weight = row["backward_scalar"] / row["loss_sum"]
        row.update(token_weight_sum=weight * row["valid_tokens"], token_weight_min=weight, token_weight_max=weight)
        if (row["group"], row.get("term"), row["step"]) in {
            ("dp0", None, 3),
            ("dp0", None, 7),
            ("dp1", None, 2),
            ("dp1", None, 7),
            ("dp1", "aux", 12),
        } and row["rank"] == row["micro"] == 1:
            row["valid_tokens"] += 3
    return write_by_rank(folder, rows)


def _count_parts_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each part of a table on disk as it is read back (`engine.Spilled.parts`), in order."""
    import tokaudit._engine.database as engine

    read: list[int] = []
    original = engine.Spilled.parts

    def counted(self: Any) -> Any:
        for part in original(self):
            read.append(len(part))
            yield part

    monkeypatch.setattr(engine.Spilled, "parts", counted)
    return read


def _shifted_log(folder: Path, shift: int = 1, first: int = 0) -> Path:
    """Two groups, each step's reported loss from `first` on its group's token mean of the step `shift` away
    (1: a loss reported before its update closed): the neighbours are found across the parts' ends, also
    in a part that holds no reported loss."""
    rows = []
    for group in ("dp0", "dp1"):
        mine = records(UNEVEN_GA * 4 if group == "dp0" else UNEVEN_GA[::-1] * 4, token_mean, group=group)
        means = {
            s: sum(r["loss_sum"] for r in mine if r["step"] == s)
            / sum(r["valid_tokens"] for r in mine if r["step"] == s)
            for s in {r["step"] for r in mine}
        }
        rows += [
            dict(r, reported_loss=means[r["step"] + shift]) if r["step"] + shift in means and r["step"] >= first else r
            for r in mine
        ]
    return write_by_rank(folder, rows)


def _live_log(folder: Path) -> Path:
    rows = records(UNEVEN_GA * 3, token_mean)
    return write_by_rank(folder, [r for r in rows if not (r["rank"] == 1 and r["step"] > 4)])


@pytest.mark.slow
@pytest.mark.parametrize("chunk_rows, block", [(7, 1), (40, 3), (200, 5)] if THOROUGH else [(40, 3)])
def test_a_table_read_in_parts_gives_the_whole_table_s_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_rows: int, block: int
) -> None:
    """Three of the recorded DDP sample logs (all 31, every finding code they hold, with TOKAUDIT_THOROUGH=1),
    a log of two groups and two terms with several mistakes, and a log still being written (`--live`): the
    same JSON, and the same table kept for the caller, whole or in parts."""
    mixed, live = _mixed_log(tmp_path / "mixed" / "run"), _live_log(tmp_path / "live" / "run")
    shifted = _shifted_log(tmp_path / "shifted" / "run")
    late = _shifted_log(tmp_path / "late" / "run", shift=-1, first=5)
    miscounted = _miscounted_log(tmp_path / "miscounted" / "run")
    cases: list[tuple[Path, dict[str, Any]]] = [
        (SAMPLE_LOGS, {"runs": ["bug_local_mean", "correct_token_mean_ga", "aux_head_named"], "keep_steps": True}),
        (mixed.parent, {"keep_steps": True}),
        (live.parent, {"live": True}),
        (live.parent, {}),
        (shifted.parent, {}),
        (late.parent, {}),
        (miscounted.parent, {}),
        *([(SAMPLE_LOGS, {})] if THOROUGH else []),
    ]
    whole = [audit([path], **options) for path, options in cases]
    _in_parts(monkeypatch, chunk_rows, block)
    parts = [audit([path], **options) for path, options in cases]
    for (path, options), expected, found in zip(cases, whole, parts):
        assert render_json(found) == render_json(expected), (path, options)
        if options.get("keep_steps"):
            assert expected.steps is not None and found.steps is not None
            pd.testing.assert_frame_equal(found.steps, expected.steps, check_categorical=False)
    assert {f.code.value for f in whole[1].findings} == {
        "local_mean",
        "world_size_mismatch",
        "zero_token_nonfinite",
        "reported_loss_mismatch",
    }
    assert len([f for f in whole[1].findings if f.term == "aux"]) == 2  # two factors of the aux term
    # without --live, the steps past rank 1's last shard are said and left out (the end a killed rank leaves)
    assert whole[2].findings == [] and [f.code.value for f in whole[3].findings] == ["unfinished_update"]
    (moved,) = whole[4].findings  # steps 0–10 of each group carry the next step's loss (11 steps, counted once)
    assert (
        moved.code.value == "reported_loss_shifted"
        and moved.steps.count == 11
        and whole[4].runs[0].verdict == "correct"
    )
    (late_found,) = whole[5].findings  # steps 5–11 carry the previous step's loss, step 4 reported nothing
    assert (
        late_found.code.value == "reported_loss_shifted"
        and late_found.steps.first == 5
        and "late" in late_found.message
    )
    (counted,) = whole[6].findings  # steps 2, 3, 7 and 12 of a group left out (every term of the group's step)
    assert counted.code.value == "count_mismatch" and counted.steps.count == 4 and counted.evidence["step"] == 2
    assert whole[6].runs[0].verdict == "inconclusive" and whole[6].runs[0].steps == 15 - 1


@pytest.mark.slow
def test_a_long_run_is_audited_from_disk_a_part_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory bound's mechanism: past SPILL_STEPS the step table is kept on disk and read a range at a
    time, never whole, with the same report (what it saves is measured in bench/). 30,000 steps of 2 ranks,
    half of them rank-local means, in ranges of 2,000 steps."""
    import tokaudit._engine.database as engine

    rng = np.random.default_rng(3)
    counts = [[[int(rng.integers(1, 300))], [int(rng.integers(1, 300))]] for _ in range(30_000)]
    rows = records(counts, token_mean)
    for row in rows:
        if row["step"] % 2:
            row["backward_scalar"] = local_mean(row["loss_sum"], row["valid_tokens"])
    for rank in (0, 1):
        mine = [r for r in rows if r["rank"] == rank]
        for start in range(0, len(mine), 2_000):
            write(tmp_path / "run" / f"rank-{rank:05d}-{start:06d}.parquet", mine[start : start + 2_000])

    whole = render_json(audit([tmp_path / "run"], threads=1))
    monkeypatch.setattr(engine, "SPILL_STEPS", 2_000)
    monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", "4000")
    read = _count_parts_read(monkeypatch)
    assert render_json(audit([tmp_path / "run"], threads=1)) == whole
    assert read and max(read) <= 2_000 < sum(read)  # every range read alone, never the table


def test_the_table_on_disk_is_removed_and_a_tmpdir_it_cannot_use_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder of a table kept on disk is made under TMPDIR and removed when the audit ends; a log small
    enough to stay in memory needs no TMPDIR at all; and where TMPDIR cannot be written, a log that needs it
    is one error line saying so (exit 2), not a traceback."""
    import tempfile

    from click.testing import CliRunner

    import tokaudit._engine.database as engine
    from tokaudit.cli import main

    log = _mixed_log(tmp_path / "mixed" / "run")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    expected = render_json(audit([log]))
    assert not list(scratch.iterdir())  # in memory: nothing written
    monkeypatch.setattr(engine, "SPILL_STEPS", 0)
    made: list[Path] = []
    original = engine.Spilled.add

    def noted(self: Any, table: Any) -> None:
        original(self, table)
        made.append(Path(str(self.folder)))

    monkeypatch.setattr(engine.Spilled, "add", noted)
    assert render_json(audit([log])) == expected
    assert made and made[0].parent == scratch and not made[0].exists() and not list(scratch.iterdir())

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no such folder"))
    result = CliRunner().invoke(main, ["check", str(log)])
    lines = [line for line in result.stderr.splitlines() if line.startswith("tokaudit: error:")]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    assert "cannot keep the step table of this log on disk" in lines[0] and "TMPDIR" in lines[0]
    assert "Traceback" not in result.output
    monkeypatch.setattr(engine, "SPILL_STEPS", 2_000_000)
    assert CliRunner().invoke(main, ["check", str(log)]).exit_code == 1  # findings: it stays in memory


def test_the_names_a_range_holds_are_its_rows_names() -> None:
    """`Spilled` notes each range's (run, group, term) from its categories' codes: the same set as every
    row's names read as text, unused categories and a missing name included."""
    from tokaudit._engine.tables import table_names

    rng = np.random.default_rng(9)
    for _ in range(20):
        count = int(rng.integers(1, 60))
        table = {
            name: pd.Categorical(rng.choice(choices, count), categories=sorted(set(choices) | {"unused"}))
            for name, choices in (("run", ["a", "b"]), ("grp", ["0", "dp1", "dp2"]), ("term", ["0", "aux"]))
        }
        table["grp"][rng.random(count) < 0.1] = np.nan
        rows = pd.DataFrame({name: np.asarray(values).astype(str) for name, values in table.items()})
        assert table_names(table) == set(map(tuple, rows.drop_duplicates().itertuples(index=False)))


def test_a_file_with_a_nan_divisor_is_named_whether_the_table_is_kept_on_disk_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN divisor shows in no footer: the aggregation counts it (`Spilled.unusable` as ranges are
    written), and the file is named and left out, the rest audited, the same whole or on disk."""
    rows = records(UNEVEN_GA * 4, token_mean, grad_divisor=2.0)
    write(
        tmp_path / "run" / "rank-00000-000000.parquet",
        [dict(r, grad_divisor=float("nan") if r["step"] == 3 else 2.0) for r in rows if r["rank"] == 0],
    )
    write(tmp_path / "run" / "rank-00001-000000.parquet", [r for r in rows if r["rank"] == 1])
    whole = render_json(audit([tmp_path / "run"]))
    _in_parts(monkeypatch, 7, 2)
    assert render_json(audit([tmp_path / "run"])) == whole
    assert "rank-00000-000000.parquet" in whole and "not a finite positive number" in whole


@pytest.mark.slow
def test_a_long_curve_is_drawn_and_written_from_disk_a_part_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tokaudit curve` of a table kept on disk: the CSV, the chart and the table of the whole table, byte
    for byte, with every step's rows of both groups and terms averaged within one part, and three terms' Σe·S summed
    in one order (the order a range's rows came in made its last bit); what is read at a
    time is one range (the memory bound's mechanism: 12.5M steps took 2.3 GB whole, 0.7 GB in parts)."""
    import tempfile

    from click.testing import CliRunner

    import tokaudit._engine.database as engine
    from tokaudit.cli import main

    log = _mixed_log(tmp_path / "mixed" / "run")
    rng = np.random.default_rng(5)
    counts = [[[int(rng.integers(0, 30)), int(rng.integers(1, 30))], [int(rng.integers(0, 30)), 4]] for _ in range(300)]
    long = write_by_rank(tmp_path / "long" / "run", records(counts, token_mean), steps_per_file=5)
    # three terms whose Σe·S (b·g/D, W = 1) sum to another last bit in another order: 0.1 + 0.2 + 0.3
    one = [[[4]] for _ in range(40)]
    terms = write_by_rank(
        tmp_path / "terms" / "run",
        [
            dict(r, term=name, backward_scalar=b * (1 + r["step"] % 7))
            for name, b in (("a", 0.1), ("b", 0.2), ("c", 0.3))
            for r in records(one, token_mean)
        ],
        steps_per_file=4,
    )

    def curve(path: Path, name: str) -> tuple[str, str]:
        result = CliRunner().invoke(main, ["curve", str(path), "--csv", str(tmp_path / name)], env={"COLUMNS": "100"})
        assert result.exit_code == 0, result.output
        return result.stdout, (tmp_path / name).read_text()

    whole = [curve(path, f"whole{index}.csv") for index, path in enumerate((log, long, terms))]
    assert "(43 of 300 steps shown; --csv writes all)" in whole[1][0]  # steps 0, 7, 14, …, 294
    monkeypatch.setattr(engine, "SPILL_STEPS", 0)
    monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", "24")
    read = _count_parts_read(monkeypatch)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    for index, path in enumerate((log, long, terms)):
        read.clear()
        assert curve(path, f"parts{index}.csv") == whole[index]
        assert read and max(read) <= 24 < sum(read)  # every range read alone, never the table
        assert not list(scratch.iterdir())  # the table on disk removed
    result = CliRunner().invoke(main, ["curve", str(log), "--run", "nosuch"])
    assert result.exit_code == 2 and "no run named 'nosuch'" in result.stderr and not list(scratch.iterdir())
    rows = list(csv.DictReader(whole[0][1].splitlines()))
    assert len(rows) == len({row["step"] for row in rows}) == 20  # one row a step, the groups averaged


def test_a_long_curve_s_plot_draws_each_series_envelope(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past PLOT_STEPS `--plot` draws, in each step bucket, a series' first, last, lowest and highest point,
    read a part at a time: every spike stays, and what is drawn is bounded by the buckets."""
    import tokaudit._postmortem as postmortem

    monkeypatch.setattr(postmortem, "PLOT_BUCKETS", 10)
    x = np.arange(1000, dtype=np.float64)
    ys = np.sin(x / 7.0)
    ys[[3, 517, 518, 998]] = [9.0, -9.0, 8.0, np.nan]  # spikes, one a NaN (no point)
    kept: list[tuple[np.ndarray, np.ndarray]] = [
        postmortem.envelope(x[a:b], ys[a:b], (0.0, 999.0)) for a, b in ((0, 250), (250, 640), (640, 1000))
    ]
    kx, ky = np.concatenate([k[0] for k in kept]), np.concatenate([k[1] for k in kept])
    assert len(kx) <= 4 * (10 + 2)  # four a bucket, and a bucket across two parts four of each
    assert (np.diff(kx) > 0).all() and np.array_equal(ky, ys[kx.astype(int)])  # points of the curve, in order
    bucket = np.minimum((x / 999.0 * 10).astype(int), 9)
    for b in range(10):
        mine = (bucket == b) & np.isfinite(ys)
        inside = np.minimum((kx / 999.0 * 10).astype(int), 9) == b
        assert ky[inside].min() == ys[mine].min() and ky[inside].max() == ys[mine].max()
        assert kx[inside].min() == x[mine].min() and kx[inside].max() == x[mine].max()
    assert {9.0, -9.0, 8.0} <= set(ky.tolist())


@pytest.mark.slow
def test_a_long_curve_s_plot_is_its_envelope_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`curve --plot` of a curve longer than PLOT_STEPS: each series drawn from its envelope (at most four
    points a bucket, its extremes among them), a PNG written; a shorter one draws every step."""
    from click.testing import CliRunner

    import tokaudit._postmortem as postmortem
    import tokaudit._render.curve as curve
    import tokaudit._render.plot as plot
    from tokaudit.cli import main

    rng = np.random.default_rng(9)
    counts = [[[int(rng.integers(1, 30))], [int(rng.integers(1, 30))]] for _ in range(300)]
    log = write_by_rank(tmp_path / "long" / "run", records(counts, local_mean))
    drawn: list[dict[str, tuple[np.ndarray, np.ndarray]]] = []
    original = plot.write_png
    monkeypatch.setattr(
        plot, "write_png", lambda run, points, labels, path: drawn.append(points) or original(run, points, labels, path)
    )
    png = tmp_path / "curve.png"
    assert (
        CliRunner().invoke(main, ["curve", str(log), "--plot", str(png), "--csv", str(tmp_path / "c.csv")]).exit_code
        == 0
    )
    every = drawn.pop()
    assert set(every) == {"token_mean", "mean_of_local_means", "optimized"}  # no reported loss: not drawn
    assert all(len(x) == 300 for x, _ in every.values())
    monkeypatch.setattr(curve, "PLOT_STEPS", 100)
    monkeypatch.setattr(postmortem, "PLOT_BUCKETS", 12)
    assert CliRunner().invoke(main, ["curve", str(log), "--plot", str(png)]).exit_code == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    envelope = drawn.pop()
    for key, (x, y) in envelope.items():
        full_x, full_y = every[key]
        assert len(x) <= 4 * 12 and set(x.tolist()) <= set(full_x.tolist())
        assert y.max() == np.nanmax(full_y) and y.min() == np.nanmin(full_y)
        assert x[0] == full_x[0] and x[-1] == full_x[-1]


@pytest.mark.slow
def test_a_step_that_is_not_there_is_named_from_the_table_read_a_part_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`weights --step` of a step a run lacks says which steps it has, from the whole log read a range at a
    time (a log of millions of steps held whole took gigabytes for this one line); a step of a run that
    the footers cannot single out is still found."""
    from click.testing import CliRunner

    import tokaudit._engine.database as engine
    from tokaudit.cli import main

    log = _mixed_log(tmp_path / "mixed" / "run")
    rows = records([[[3, 1], [2, 2]]] * 6, token_mean)
    other = write_by_rank(tmp_path / "other" / "b", [r for r in rows if r["step"] != 2])

    def weights(*args: str) -> tuple[int, str, str]:
        result = CliRunner().invoke(main, ["weights", *args])
        return result.exit_code, result.stdout, result.stderr

    cases = [
        (str(log), "--step", "20"),
        (str(tmp_path), "--run", "b", "--step", "2"),
        (str(tmp_path), "--step", "3"),
        (str(tmp_path), "--run", "b", "--step", "3"),
    ]
    whole = [weights(*case) for case in cases]
    assert whole[0][0] == 2 and "run 'run' has no step 20 (steps 0–19)" in whole[0][2]
    assert whole[1][0] == 2 and "run 'b' has no step 2 (steps 0–5)" in whole[1][2]
    assert whole[2][0] == 2 and "the logs hold 2 runs; choose one with --run: b, run" in whole[2][2]
    assert whole[3][0] == 0 and "b, step 3" in whole[3][1]
    assert other.exists()
    monkeypatch.setattr(engine, "SPILL_STEPS", 0)
    monkeypatch.setenv("TOKAUDIT_CHUNK_ROWS", "8")
    read = _count_parts_read(monkeypatch)
    import tokaudit._reader as reader

    validated: list[Path] = []
    inspect = reader.inspect_shard
    monkeypatch.setattr(reader, "inspect_shard", lambda path, *args: validated.append(path) or inspect(path, *args))
    assert [weights(*case) for case in cases] == whole
    assert read and max(read) < sum(read)  # each range read alone
    # each file's footer validated once a command, also where the whole log is then read to name the steps
    assert sorted(validated) == sorted(f for case in cases for f in Path(case[0]).rglob("*.parquet"))
