"""A range whose records form a grid is reduced by numpy (`tokaudit.engine.grid`): the query's step table, or the query."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from click.testing import CliRunner

import tokaudit.engine.database as engine_module
import tokaudit.engine.grid as grid_module
from tests.logs import seeds, write
from tokaudit.engine import Engine
from tokaudit.engine.tables import same_bits
from tokaudit.loading import load
from tokaudit.schema import WRITER_SCHEMA

OPTIONAL = ("grad_divisor", "divisor_known", "grad_scale", "positions", "token_weight_sum", "token_weight_min",
            "token_weight_max", "masked_weight_abs_sum", "reported_loss", "sync", "skipped")


def _tables(shards: list[Any], monkeypatch: pytest.MonkeyPatch, **options: Any) -> tuple[Any, Any, list[bool]]:
    """The step table with grids reduced by numpy and by the query, and whether each range was a grid."""
    reduced: list[bool] = []
    real = engine_module.grid_table

    def spy(*args: Any, **kwargs: Any) -> Any:
        table = real(*args, **kwargs)
        reduced.append(table is not None)
        return table

    monkeypatch.setattr(engine_module, "grid_table", spy)
    tables = []
    for grid in (True, False):
        engine = Engine.open(shards, **options)
        engine.grid = grid
        tables.append(engine.step_table(1e-4))
        engine.close()
    return tables[0], tables[1], reduced


def _differences(got: Any, expected: Any) -> list[str]:
    """Columns that differ in name, order, type or any bit (0.0 is not −0.0), the compensated float sums
    (ΣS, Σe·S, the mean of local means) included."""
    assert list(got.columns) == list(expected.columns)
    differ = []
    for column in got.columns:
        one, other = got[column], expected[column]
        if one.dtype != other.dtype:
            differ.append(f"{column}: {one.dtype} against {other.dtype}")
        elif one.dtype.name == "category":
            if not one.equals(other):
                differ.append(column)
        elif not same_bits(one.to_numpy(), other.to_numpy()):
            differ.append(column)
    return differ


STEADY = ("grad_divisor", "grad_scale", "positions", "divisor_known", "sync", "skipped", "masked_weight_abs_sum")
"""Columns a footer may give the one value of (`Shard.constants`)."""


def _random_grid(folder: Path, seed: int, group: str | None = None, terms: list[str | None] | None = None,
                 steady: bool = False) -> dict[str, Any]:
    """A log in the recorder's layout (a rank's records in one to three files, in step and microbatch
    order) with every optional column absent, NULL everywhere, NULL on some records or on none, drawn
    at random: zero-token records, zero losses, a probe, loss scales, several W and D, ranks past 64.
    `terms`: several loss terms recorded in turn at each (step, microbatch), each its own counts and
    values (None: a NULL term, the unnamed one). `steady`: D, g, T and the flags, where a value on every
    record, one value in the whole log or one in each rank's files, as their footers then give it."""
    draw = random.Random(seed)
    micro = draw.choice([1, 2, 3, 4])
    ranks = sorted(draw.sample(range(70), draw.choice([1, 2, 3, 5])))
    world = max(ranks) + 1 + draw.choice([0, 2])
    steps = sorted(draw.sample(range(200), draw.randint(1 if micro > 1 else 2, 9)))  # no one-row file
    kinds = {column: draw.choice(["absent", "null", "some", "all"]) for column in OPTIONAL}
    if steady:
        kinds.update({column: "all" for column in STEADY if draw.random() < 0.7})
    vary_world = draw.random() < 0.3
    columns = ["step", "micro", "rank", "world_size", "loss_sum", "valid_tokens", "backward_scalar",
               *(["group"] if group is not None else []), *(["term"] if terms else []),
               *[c for c in OPTIONAL if kinds[c] != "absent"]]
    schema = pa.schema([WRITER_SCHEMA.field(c) for c in columns])
    if draw.random() < 0.3:  # narrower types, which the query casts and numpy reads as they are
        schema = schema.set(schema.get_field_index("valid_tokens"), pa.field("valid_tokens", pa.int32()))
        schema = schema.set(schema.get_field_index("loss_sum"), pa.field("loss_sum", pa.float32()))

    def value(column: str, record: dict[str, Any]) -> Any:
        kind = kinds[column]
        if kind == "null" or (kind == "some" and draw.random() < 0.4):
            return None
        n, loss = record["valid_tokens"], record["loss_sum"]
        return {
            "grad_divisor": draw.choice([float(world), 2.0 * world, 0.5]),
            "divisor_known": draw.random() < 0.7,
            "grad_scale": draw.choice([1.0, 1 / 65536, 2.0 ** -draw.randint(0, 20)]),
            "positions": draw.randint(n, n + 40),
            "token_weight_sum": draw.choice([0.0, n * draw.uniform(0.001, 0.1), -0.0]),
            "token_weight_min": draw.choice([-0.0, 0.0, draw.uniform(0.0, 0.01)]),
            "token_weight_max": draw.uniform(0.0, 0.02),
            "masked_weight_abs_sum": draw.choice([0.0, draw.uniform(0.0, 1e-3), 0.5]),
            "reported_loss": round(loss / max(n, 1), draw.randint(1, 6)),
            "sync": draw.random() < 0.6,
            "skipped": draw.random() < 0.2,
        }[column]

    steadied = {column: draw.choice(["log", "rank"]) for column in STEADY if steady and kinds[column] == "all"}
    once = {column: value(column, {"valid_tokens": 5000, "loss_sum": 1.0}) for column in steadied}
    for rank in ranks:
        fixed = {column: once[column] if where == "log" else value(column, {"valid_tokens": 5000, "loss_sum": 1.0})
                 for column, where in steadied.items()}
        rows = []
        for step in steps:
            for index in range(micro):
                for term in terms or [None]:
                    n = draw.choice([0, draw.randint(1, 60), draw.randint(1, 5000)])
                    loss = draw.choice([0.0, draw.uniform(0.5, 3.0) * n, -0.0]) if draw.random() < 0.1 else \
                        draw.uniform(0.5, 3.0) * n
                    record = {"step": step, "micro": index, "rank": rank, "loss_sum": loss, "valid_tokens": n,
                              "group": group, "term": term, "world_size": world + (step % 2 if vary_world else 0),
                              "backward_scalar": draw.choice([loss / max(n, 1), world * loss / 1000.0, 0.0, -loss])}
                    record.update({c: value(c, record) for c in OPTIONAL if kinds[c] != "absent"}, **fixed)
                    if record.get("masked_weight_abs_sum") == 0 and "masked_weight_abs_sum" in fixed:
                        record["masked_weight_abs_sum"] = draw.choice([0.0, -0.0])  # its sign read by nothing
                    if record.get("token_weight_sum") is not None and draw.random() < 0.2:
                        record["backward_scalar"] = None  # the probe's weights stand for b
                    rows.append(record)
        cuts = sorted(draw.sample(range(1, len(steps)), min(len(steps) - 1, draw.randint(0, 2)))) if micro > 1 else []
        for part, (start, stop) in enumerate(zip([0, *cuts], [*cuts, len(steps)])):
            inside = [r for r in rows if steps[start] <= r["step"] <= steps[stop - 1]]
            write(folder / f"{group or ''}rank-{rank:05d}-{part:06d}.parquet", inside, schema=schema)
    return {"micro": micro, "ranks": ranks, "kinds": kinds, "steady": steadied}


@pytest.mark.parametrize("seed", seeds(40))
def test_a_grid_reduced_by_numpy_is_the_query_s_step_table(tmp_path: Path, seed: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Random logs in the recorder's layout: numpy's table has the query's columns, in its order, of its
    types, equal bit for bit (its float sums compensated as DuckDB's fsum is); and numpy did reduce every
    range (nothing fell back)."""
    drawn = _random_grid(tmp_path / "run", seed)
    shards = load([tmp_path / "run"]).shards
    got, expected, reduced = _tables(shards, monkeypatch)
    assert reduced and all(reduced), drawn
    assert not _differences(got, expected), (_differences(got, expected), drawn)


@pytest.mark.parametrize("seed", seeds(16))
def test_loss_terms_recorded_in_turn_are_a_grid_each(tmp_path: Path, seed: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Several loss terms in every file, recorded in turn at each (step, microbatch) as the recorder writes
    them (a NULL term is the unnamed one): read once, each term reduced as a grid of its own, the query's
    table bit for bit; in two groups as well."""
    draw = random.Random(seed)
    terms: list[str | None] = draw.choice([["0", "aux"], [None, "aux"], ["mtp1", "mtp2", "0"], ["z", "a"]])
    groups = ["dp0", "dp1"] if seed % 4 == 3 else [None]
    drawn = [_random_grid(tmp_path / "run", seed * 10 + index, group, terms) for index, group in enumerate(groups)]
    shards = load([tmp_path / "run"]).shards
    assert all(s.names is None and s.run_group is not None for s in shards)
    got, expected, reduced = _tables(shards, monkeypatch)
    assert reduced and all(reduced), drawn
    assert sorted(got.term.unique()) == sorted(t or "0" for t in terms)
    assert not _differences(got, expected), (_differences(got, expected), drawn)


@pytest.mark.parametrize("case", ["out of turn", "a term missing", "one term beside several"])
def test_loss_terms_that_are_not_in_turn_take_the_query(tmp_path: Path, case: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Terms out of their order at one microbatch, a term missing from one, or a file of one term beside files
    of several for the same (run, group): the query's table."""
    rows = [dict(r, term=term, loss_sum=r["loss_sum"] * (1 + index))
            for r in _rows(ranks=2, steps=3, micro=2) for index, term in enumerate(["0", "aux"])]
    if case == "out of turn":
        rows[5]["term"], rows[4]["term"] = rows[4]["term"], rows[5]["term"]
    elif case == "a term missing":
        del rows[3]
        rows = [r for r in rows if not (r["rank"] == 1 and r["step"] == 2 and r["micro"] == 1 and r["term"] == "aux")]
    elif case == "one term beside several":
        for row in rows:
            if row["rank"] == 1:
                row["term"] = "0"
    shards = _by_rank(tmp_path / "run", rows)
    got, expected, reduced = _tables(shards, monkeypatch)
    assert not any(reduced)
    assert not _differences(got, expected)


@pytest.mark.parametrize("seed", seeds(12))
def test_groups_that_are_grids_each_give_the_query_s_step_table(tmp_path: Path, seed: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Data-parallel groups that each write their own ranks' files, each a grid of its own (its ranks,
    microbatches, optional columns and schema): one grid per (run, group, term), the query's table."""
    groups = 2 + seed % 3
    drawn = [_random_grid(tmp_path / "run", 100 * seed + index, group=f"dp{index}") for index in range(groups)]
    shards = load([tmp_path / "run"]).shards
    grids = grid_module.grids_of(shards, None)
    assert grids is not None and [g.names[1] for g in grids] == [f"dp{index}" for index in range(groups)]
    got, expected, reduced = _tables(shards, monkeypatch)
    assert reduced and all(reduced), drawn
    assert got.grp.nunique() == groups and not _differences(got, expected), (_differences(got, expected), drawn)


def test_ranks_read_a_block_at_a_time_give_the_table_of_one_block(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid's ranks are read GRID_BLOCK_ROWS records at a time: one rank a block gives what all at once do,
    also in ranges of a few steps."""
    _random_grid(tmp_path / "run", 7)
    shards = load([tmp_path / "run"]).shards
    one_block, expected, _ = _tables(shards, monkeypatch)
    # the mechanism of the memory bound: what is read at once is one block of ranks, however large the range
    held: list[int] = []
    split = grid_module._split
    monkeypatch.setattr(grid_module, "_split", lambda column: held.append(len(column)) or split(column))
    monkeypatch.setattr(engine_module, "GRID_BLOCK_ROWS", 1)
    per_rank: dict[int, int] = {}
    for shard in shards:
        per_rank[shard.rank_range[0]] = per_rank.get(shard.rank_range[0], 0) + shard.rows
    rank_rows = max(per_rank.values())
    for options in ({}, {"chunk_rows": 8}):
        held.clear()
        got, expected, reduced = _tables(shards, monkeypatch, **options)
        assert reduced and all(reduced)
        assert not _differences(got, one_block) and not _differences(got, expected)
        # one rank at a time (in a range of a few steps, that rank's records of those steps)
        assert held and max(held) <= rank_rows < sum(per_rank.values())
        assert max(held) == rank_rows or options


@pytest.mark.parametrize("seed", seeds(24))
def test_columns_whose_footers_give_their_one_value_are_not_read(tmp_path: Path, seed: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """D, g, T and the flags of one value in the whole log or in each rank's files: the value in every
    file's footer is taken for every record and the column not read, and the table is still the query's
    bit for bit."""
    drawn = _random_grid(tmp_path / "run", seed, steady=True)
    shards = load([tmp_path / "run"]).shards
    asked: list[str] = []
    real = grid_module.grid_table

    def spy(connection: Any, *args: Any, **kwargs: Any) -> Any:
        class Asked:
            def sql(self, query: str) -> Any:
                asked.append(query)
                return connection.sql(query)
        return real(Asked(), *args, **kwargs)

    monkeypatch.setattr(engine_module, "grid_table", spy)
    got, expected, _ = _tables(shards, monkeypatch)
    assert not _differences(got, expected), (_differences(got, expected), drawn)
    everywhere = [column for column, where in drawn["steady"].items() if where == "log"]
    columns_read = {query.split(" FROM ")[0] for query in asked}
    assert asked
    for column in everywhere:
        # (a float column read only as the NaN guard on the loss: S − (v − v))
        assert all(f'"{column}" AS' not in read and f', "{column}"' not in read for read in columns_read), (column, drawn)


def _rows(ranks: int = 2, steps: int = 3, micro: int = 2, **change: Any) -> list[dict[str, Any]]:
    return [{"step": step, "micro": index, "rank": rank, "world_size": ranks, "loss_sum": 2.5 * (1 + step + index),
             "valid_tokens": 1 + step + index + rank, "backward_scalar": 0.1 * (1 + rank), **change}
            for rank in range(ranks) for step in range(steps) for index in range(micro)]


def _by_rank(folder: Path, rows: list[dict[str, Any]]) -> list[Any]:
    for rank in sorted({r["rank"] for r in rows}):
        write(folder / f"rank-{rank:05d}.parquet", [r for r in rows if r["rank"] == rank])
    return load([folder], thorough=False).shards


def _not_a_grid(tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    """Logs each of which breaks the grid in one way its footers do not show."""
    steps_differ = _rows()
    for row in steps_differ:
        if row["rank"] == 1 and row["step"] == 2:
            row["step"] = 5  # the same rows, other steps
    repeated = _rows()
    for row in repeated:
        if row["rank"] == 0 and row["step"] == 1:
            row["micro"] = 0  # microbatch 0 twice, 1 missing
    swapped = _rows()
    first = [i for i, r in enumerate(swapped) if r["rank"] == 1 and r["step"] == 1]
    swapped[first[0]], swapped[first[1]] = swapped[first[1]], swapped[first[0]]  # 1 before 0
    nan_loss = _rows()
    nan_loss[3]["loss_sum"] = float("nan")
    huge = _rows()
    huge[2].update(backward_scalar=1e308, loss_sum=1e-300)  # b/S is not finite
    nan_divisor = _rows(grad_divisor=2.0)
    nan_divisor[5]["grad_divisor"] = float("nan")  # its file's footer still gives 2.0, the other NaN-free values
    nan_scale = _rows(grad_scale=0.5)
    nan_scale[1]["grad_scale"] = float("nan")
    # T < n: where a file's one T is below its greatest n (the footer gives T, the column is left unread), and
    # where T varies, held beside NULLs
    below_constant = _rows(positions=4)  # n reaches 5 on rank 1
    below_varying = [dict(r, positions=None if i % 5 == 0 else r["valid_tokens"] + (-1 if i == 9 else 3))
                     for i, r in enumerate(_rows())]
    return {"steps differ": steps_differ, "repeated": repeated, "swapped": swapped, "nan loss": nan_loss,
            "huge weight": huge, "nan divisor": nan_divisor, "nan scale": nan_scale,
            "positions below, one T": below_constant, "positions below": below_varying}


@pytest.mark.parametrize("case", ["steps differ", "repeated", "swapped", "nan loss", "huge weight", "nan divisor",
                                  "nan scale", "positions below, one T", "positions below"])
def test_records_that_are_no_grid_of_finite_values_take_the_query(tmp_path: Path, case: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Footers that promise a grid whose records are not one (a rank's steps differ, a microbatch repeated
    or out of order) or whose values are not finite (the query counts those): numpy gives up, and the
    table is the query's bit for bit."""
    shards = _by_rank(tmp_path / "run", _not_a_grid(tmp_path)[case])
    assert grid_module.grid_of(shards, None) is not None
    got, expected, reduced = _tables(shards, monkeypatch)
    assert reduced == [False]  # numpy gave up; without grids it is not asked
    assert not _differences(got, expected)


def test_the_footers_say_when_files_form_no_grid(tmp_path: Path) -> None:
    """Several names, a file of two ranks, ranks of unequal rows, one-row shards read from their
    footers, files of two schemas, a rank's files overlapping, and a range that cuts a file are no grid."""
    plain = _by_rank(tmp_path / "plain", _rows())
    grid = grid_module.grid_of(plain, None)
    assert grid is not None and grid.ranks == (0, 1) and grid.micro == 2 and grid.rank_rows == 6
    assert grid_module.grid_of(plain, (0, 1)) is None  # the range cuts the files
    assert grid_module.grid_of(plain, (0, 2)) is not None
    two_names = _by_rank(tmp_path / "names", [dict(r, run_id=f"r{r['rank']}") for r in _rows()])
    assert grid_module.grid_of(two_names, None) is None
    # each name's files alone: a grid of one rank each
    assert [g.ranks for g in grid_module.grids_of(two_names, None) or []] == [(0,), (1,)]
    # r0 with a second rank of fewer rows: no grid, and then none is taken
    short = [dict(r, run_id="r0", rank=1, world_size=2) for r in _rows() if r["rank"] == 0][:5]
    write(tmp_path / "short" / "rank-r0-1.parquet", short)
    assert grid_module.grids_of([*two_names, *load([tmp_path / "short"]).shards], None) is None
    write(tmp_path / "mixed" / "all.parquet", _rows())
    assert grid_module.grid_of(load([tmp_path / "mixed"]).shards, None) is None
    uneven = _by_rank(tmp_path / "uneven", [r for r in _rows() if not (r["rank"] == 1 and r["step"] == 2)])
    assert grid_module.grid_of(uneven, None) is None
    one_row = _by_rank(tmp_path / "one", _rows(steps=1, micro=1))
    assert all(s.record is not None for s in one_row) and grid_module.grid_of(one_row, None) is None
    schemas = _by_rank(tmp_path / "schemas", [dict(r, sync=True) if r["rank"] else r for r in _rows()])
    assert grid_module.grid_of(schemas, None) is None
    rows = _rows()
    write(tmp_path / "overlap" / "rank-0-a.parquet", [r for r in rows if r["rank"] == 0 and r["step"] < 2])
    write(tmp_path / "overlap" / "rank-0-b.parquet", [r for r in rows if r["rank"] == 0 and r["step"] >= 1])
    write(tmp_path / "overlap" / "rank-1.parquet", [r for r in rows if r["rank"] == 1] * 1)
    assert grid_module.grid_of(load([tmp_path / "overlap"]).shards, None) is None


def test_an_audit_of_a_grid_is_the_query_s_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end, with the evidence aggregated per finding (as for a log of more than EVIDENCE_ROWS
    records, where grids are reduced by numpy): the JSON report of random grids with numpy is the one
    without it, byte for byte."""
    import tokaudit.auditing as auditing
    from tokaudit.auditing import audit
    from tokaudit.render.json_report import render_json

    monkeypatch.setattr(auditing, "EVIDENCE_ROWS", 0)
    for seed in range(8):
        _random_grid(tmp_path / f"run-{seed}", seed)
    for index in range(3):  # a run of three data-parallel groups
        _random_grid(tmp_path / "groups", 50 + index, group=f"dp{index}")
    paths = [*(tmp_path / f"run-{seed}" for seed in range(8)), tmp_path / "groups"]
    with_grids = render_json(audit(paths))
    monkeypatch.setattr(Engine, "grid", False)
    assert render_json(audit(paths)) == with_grids


def test_a_corrupt_data_page_in_a_grid_is_named_and_the_rest_audited(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A file of a grid whose footer reads but whose data pages do not: as without grids, one problem naming
    it, and the rest audited (the grid's read fails as the query's does, and the file is found): the same
    report."""
    import tokaudit.auditing as auditing
    from tokaudit.auditing import audit
    from tokaudit.render.json_report import render_json

    monkeypatch.setattr(auditing, "EVIDENCE_ROWS", 0)
    _random_grid(tmp_path / "good", 3)
    bad = [dict(r, valid_tokens=r["valid_tokens"] + 1) for r in _rows(steps=200)]
    for rank in (0, 1):
        write(tmp_path / "bad" / f"rank-{rank:05d}.parquet", [r for r in bad if r["rank"] == rank])
    path = tmp_path / "bad" / "rank-00001.parquet"
    data = bytearray(path.read_bytes())
    for index in range(200, min(len(data) - 400, 1200)):  # the data pages, the footer left intact
        data[index] = 0xFF
    path.write_bytes(bytes(data))
    assert grid_module.grids_of(load([tmp_path / "bad"], thorough=False).shards, None) is not None
    reports = []
    for grid in (True, False):
        monkeypatch.setattr(Engine, "grid", grid)
        reports.append(audit([tmp_path]))
    assert render_json(reports[0]) == render_json(reports[1])
    report = reports[0]
    assert [r.run for r in report.runs] == ["bad", "good"] and report.runs[0].ranks == 1  # rank 0's file read
    assert len(report.problems) == 1 and str(path) in report.problems[0] and "corrupt data" in report.problems[0]


def test_a_nan_behind_a_footer_that_gives_one_value_is_named_from_the_command_line(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    """A loss scale of 0.5 on every record but one NaN: the file's footer still gives 0.5 (no statistics
    hold a NaN), the grid leaves the column unread, and its guard on the loss hands the range to the query:
    `tokaudit check` names the file and its problem (exit 2), audits the other files, and says what it says
    without grids."""
    import tokaudit.auditing as auditing
    from tokaudit.cli import main

    monkeypatch.setattr(auditing, "EVIDENCE_ROWS", 0)
    rows = _rows(ranks=3, steps=40, grad_scale=0.5, grad_divisor=3.0)
    rows[len(rows) // 2 + 7]["grad_scale"] = float("nan")
    shards = _by_rank(tmp_path / "run", rows)
    assert {dict(s.constants).get("grad_scale") for s in shards} == {0.5}
    assert grid_module.grid_of(shards, None) is not None
    outputs = []
    for grid in (True, False):
        monkeypatch.setattr(Engine, "grid", grid)
        result = CliRunner().invoke(main, ["check", str(tmp_path / "run"), "--format", "json"])
        assert result.exit_code == 2, result.output
        outputs.append(result.output)
    assert outputs[0] == outputs[1]
    bad = tmp_path / "run" / "rank-00001.parquet"
    assert str(bad) in outputs[0] and "grad_scale" in outputs[0]


@pytest.mark.parametrize("constant", [True, False])
def test_fewer_positions_than_valid_tokens_are_named_from_the_command_line(tmp_path: Path, constant: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One record whose T is below its n (T counts the positions the n valid tokens are among), in a file
    whose footer gives one T or whose T varies so that its statistics cannot tell: `tokaudit check` names
    that file and the record (exit 2), audits the other files, and says the same with and without grids."""
    import tokaudit.auditing as auditing
    from tokaudit.cli import main

    monkeypatch.setattr(auditing, "EVIDENCE_ROWS", 0)
    rows = _rows(ranks=3, steps=40, positions=64)
    bad_row = len(rows) // 3 + 7  # rank 1's 8th record
    if not constant:
        rows = [dict(r, positions=r["valid_tokens"] + i % 3) for i, r in enumerate(rows)]
    if constant:
        rows[bad_row]["valid_tokens"] = 65  # T stays the file's one value
    else:
        rows[bad_row]["positions"] = rows[bad_row]["valid_tokens"] - 1
    shards = _by_rank(tmp_path / "run", rows)
    assert grid_module.grid_of(shards, None) is not None
    assert ({dict(s.constants).get("positions") for s in shards} == {64}) == constant
    outputs = []
    for grid in (True, False):
        monkeypatch.setattr(Engine, "grid", grid)
        result = CliRunner().invoke(main, ["check", str(tmp_path / "run"), "--format", "json"])
        assert result.exit_code == 2, result.output
        outputs.append((result.stdout, result.stderr))
    assert outputs[0] == outputs[1]
    bad = tmp_path / "run" / "rank-00001.parquet"
    lines = [line for line in outputs[0][1].splitlines() if line.startswith("tokaudit: error:")]
    (expected_t, expected_n) = (64, 65) if constant else (rows[bad_row]["positions"], rows[bad_row]["valid_tokens"])
    assert lines == [f"tokaudit: error: {bad}: column 'positions' is below 'valid_tokens' "
                     f"({expected_t} < {expected_n}) at row 7"], lines
    report = json.loads(outputs[0][0])
    assert report["runs"][0]["rows"] == len(rows) * 2 // 3  # ranks 0 and 2 audited
