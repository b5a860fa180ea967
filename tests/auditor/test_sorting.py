"""Columns read back in order from sorted runs on disk (`tokaudit._sorting`): the same order, clusters and
medians as the whole column sorted in memory."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import tokaudit._sorting as sorting
from tokaudit._sorting import SortedColumn


def _column(values: np.ndarray, keys: np.ndarray, part: int) -> SortedColumn:
    column = SortedColumn()
    for start in range(0, len(values), part):
        column.add(values[start : start + part], keys[start : start + part])
    return column


def _draw(rng: np.random.Generator, count: int) -> np.ndarray:
    """Values with many exact ties, several clusters a few rtol apart, negatives, zeros and NaN."""
    centers = rng.choice([-3.0, 0.0, 0.25, 1.0, 1.0002, 2.0, 8.0], count)
    values = centers * (1 + rng.uniform(-1, 1, count) * 1e-4 * rng.integers(0, 2, count))
    values[rng.random(count) < 0.05] = np.nan
    return values


@pytest.mark.parametrize("seed", range(6))
def test_runs_on_disk_read_back_as_the_column_sorted(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = _draw(rng, int(rng.integers(50, 400)))
    keys = rng.integers(0, 5, len(values))
    whole = _column(values, keys, 17)
    monkeypatch.setattr(sorting, "RUN_VALUES", int(rng.integers(3, 40)))
    monkeypatch.setattr(sorting, "MERGE_VALUES", int(rng.integers(2, 50)))
    spilled = _column(values, keys, int(rng.integers(1, 30)))
    assert spilled.spilled and not whole.spilled
    chunks = list(spilled.chunks())
    assert len(chunks) > 1
    got_values = np.concatenate([v for v, _ in chunks])
    got_keys = np.concatenate([k for _, k in chunks])
    finite = ~np.isnan(values)
    order = np.argsort(values[finite], kind="stable")
    np.testing.assert_array_equal(got_values, values[finite][order])
    # each value keeps its own key: equal values may meet in another order only at a merge's frontier
    assert sorted(zip(got_values.tolist(), got_keys.tolist())) == sorted(
        zip(values[finite].tolist(), keys[finite].tolist())
    )
    assert (spilled.count, spilled.nan, spilled.low, spilled.high) == (whole.count, whole.nan, whole.low, whole.high)
    spilled.close()


@pytest.mark.parametrize("seed", range(8))
def test_clusters_and_medians_from_disk_are_those_of_the_column_in_memory(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """The vote's clusters of α, the uniform factors' (cluster, W) medians and the unknown divisor's median
    q, from runs on disk: the same numbers, bit for bit, as from the column held whole."""
    from tokaudit._checks.base import median_of
    from tokaudit._checks.weighting import factor_pairs
    from tokaudit._normalization.fits import clusters_of

    rng = np.random.default_rng(100 + seed)
    values = _draw(rng, int(rng.integers(40, 300)))
    if seed % 4 == 3:
        values = 4.0 * (1 + rng.uniform(-1, 1, len(values)) * 1e-5)  # one cluster, the usual run
    keys = rng.choice([2, 4, 8], len(values))

    def results() -> tuple[object, ...]:
        anchors, medians = clusters_of(_column(values, keys, 11), 1e-4)
        bounds, pairs, counts, centers = factor_pairs(
            _column(values[~np.isnan(values)], keys[~np.isnan(values)], 11), 1e-4
        )
        return (
            anchors.tolist(),
            medians,
            bounds.tolist(),
            pairs,
            counts,
            centers,
            median_of(_column(values, keys, 11)),
        )

    whole = results()
    monkeypatch.setattr(sorting, "RUN_VALUES", int(rng.integers(3, 30)))
    monkeypatch.setattr(sorting, "MERGE_VALUES", int(rng.integers(2, 40)))
    assert _column(values, keys, 11).spilled
    assert results() == whole
    assert whole[-1] == pd.Series(values).median()


def test_a_column_that_cannot_go_to_disk_says_so(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from tokaudit.errors import UsageError

    monkeypatch.setattr(sorting, "RUN_VALUES", 4)
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/tokaudit-tmp")
    column = SortedColumn()
    column.add(np.arange(3.0))  # held in memory: no file yet
    with pytest.raises(UsageError, match="cannot sort this log's columns on disk.*TMPDIR"):
        column.add(np.arange(3.0))
    with pytest.raises(ValueError, match="keys every time or never"):
        column.add(np.arange(2.0), np.arange(2))
