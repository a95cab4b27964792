"""Tests for the synthetic ranking-log writer (trainer.offline.synth)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from trainer.offline.synth import FIRST_SECOND, _build_teacher, write_days, write_synthetic

ROWS = 20_000
NUM_USERS = 5_000
NUM_ITEMS = 2_000
SEED = 7

EXPECTED_TYPES = {
    "user_id": pa.int64(),
    "user_age": pa.int64(),
    "user_gender": pa.int64(),
    "user_activity": pa.float64(),
    "item_id": pa.int64(),
    "item_category": pa.int64(),
    "item_tags": pa.list_(pa.int64()),
    "item_price": pa.float64(),
    "hour": pa.int64(),
    "weekday": pa.int64(),
    "device": pa.int64(),
    "hist_items": pa.list_(pa.int64()),
    "click": pa.int64(),
    "like": pa.int64(),
    "request_time": pa.int64(),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """One 20k-row dataset shared by the read-only tests."""
    out = tmp_path_factory.mktemp("synth")
    summary = write_synthetic(out, rows=ROWS, files=4, row_group_size=2_048, seed=SEED)
    return out, summary


@pytest.fixture(scope="module")
def table(written: tuple[Path, dict]) -> pa.Table:
    """All rows, train then valid."""
    return _read(written[1]["files"])


def _read(paths: list[str]) -> pa.Table:
    return pa.concat_tables([pq.read_table(p) for p in paths]).combine_chunks()


def _col(table: pa.Table, name: str) -> np.ndarray:
    return table[name].to_numpy()


def _lists(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list column."""
    arr = table[name].combine_chunks()
    return arr.values.to_numpy(), arr.offsets.to_numpy()


def test_layout_and_summary(written: tuple[Path, dict]) -> None:
    out, summary = written
    assert set(summary) == {"train_rows", "valid_rows", "files", "ctr", "like_rate"}
    assert summary["valid_rows"] == 2_000
    assert summary["train_rows"] == ROWS - 2_000
    train = [str(out / "train" / f"part-{i:05d}.parquet") for i in range(4)]
    assert summary["files"] == train + [str(out / "valid" / "part-00000.parquet")]
    assert not list(out.rglob("*.tmp"))
    train_rows = sum(pq.ParquetFile(p).metadata.num_rows for p in train)
    assert train_rows == summary["train_rows"]


def test_schema_and_row_groups(written: tuple[Path, dict]) -> None:
    for path in written[1]["files"]:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
        assert schema.names == list(EXPECTED_TYPES)
        assert {f.name: f.type for f in schema} == EXPECTED_TYPES
        if pf.metadata.num_rows > 2_048:
            assert pf.metadata.num_row_groups > 1


def test_value_ranges(table: pa.Table) -> None:
    assert table.num_rows == ROWS
    for name in table.column_names:
        assert table[name].null_count == 0, name
    ranges = {
        "user_id": (1, NUM_USERS),
        "user_age": (1, 8),
        "user_gender": (1, 2),
        "item_id": (1, NUM_ITEMS),
        "item_category": (1, 32),
        "hour": (0, 23),
        "weekday": (0, 6),
        "device": (1, 4),
        "click": (0, 1),
        "like": (0, 1),
    }
    for name, (lo, hi) in ranges.items():
        values = _col(table, name)
        assert values.min() >= lo and values.max() <= hi, name
    assert (_col(table, "user_activity") >= 0).all()
    assert np.isfinite(_col(table, "user_activity")).all()
    assert (_col(table, "item_price") > 0).all()
    assert np.isfinite(_col(table, "item_price")).all()
    click, like = _col(table, "click"), _col(table, "like")
    assert (like <= click).all()
    assert 0 < like.sum() < click.sum()


def test_list_columns(table: pa.Table) -> None:
    tags = table["item_tags"].combine_chunks()
    assert pc.min(pc.list_value_length(tags)).as_py() >= 1
    assert pc.max(pc.list_value_length(tags)).as_py() <= 4
    values = tags.values.to_numpy()
    assert values.min() >= 1 and values.max() <= 200
    rows = pc.list_parent_indices(tags).to_numpy()
    assert len(np.unique(rows * 1_000 + values)) == len(values), "tags repeat within a row"

    hist_values, hist_offsets = _lists(table, "hist_items")
    lengths = np.diff(hist_offsets)
    assert lengths.min() >= 0 and lengths.max() <= 30
    assert 0 < lengths.mean() < 30
    assert hist_values.min() >= 1 and hist_values.max() <= NUM_ITEMS


def test_entity_attributes_are_fixed(table: pa.Table) -> None:
    for key, attrs in [
        ("user_id", ["user_age", "user_gender", "user_activity"]),
        ("item_id", ["item_category", "item_price"]),
    ]:
        ids = _col(table, key)
        for attr in attrs:
            pairs = np.unique(np.stack([ids, _col(table, attr).astype(np.float64)], axis=1), axis=0)
            assert len(pairs) == len(np.unique(ids)), f"{attr} varies within a {key}"
    tags = table["item_tags"].to_pylist()
    first: dict[int, list[int]] = {}
    for item, item_tags in zip(_col(table, "item_id").tolist(), tags):
        assert first.setdefault(item, item_tags) == item_tags


def test_summary_rates_match_data(written: tuple[Path, dict], table: pa.Table) -> None:
    summary = written[1]
    assert summary["ctr"] == pytest.approx(_col(table, "click").mean())
    assert summary["like_rate"] == pytest.approx(_col(table, "like").mean())
    assert 0.18 < summary["ctr"] < 0.32
    assert 0.02 < summary["like_rate"] < summary["ctr"]


def test_deterministic(tmp_path: Path) -> None:
    kwargs = dict(rows=3_000, files=2, row_group_size=500, num_users=300, num_items=200)
    first = _read(write_synthetic(tmp_path / "a", seed=3, **kwargs)["files"])
    second = _read(write_synthetic(tmp_path / "b", seed=3, **kwargs)["files"])
    other = _read(write_synthetic(tmp_path / "c", seed=4, **kwargs)["files"])
    assert first.equals(second)
    assert not first.equals(other)


def test_rows_do_not_depend_on_file_layout(tmp_path: Path) -> None:
    kwargs = dict(rows=3_000, seed=5, num_users=300, num_items=200)
    one = _read(write_synthetic(tmp_path / "a", files=1, row_group_size=1_000, **kwargs)["files"])
    many = _read(write_synthetic(tmp_path / "b", files=8, row_group_size=128, **kwargs)["files"])
    assert one.equals(many)


def test_stale_parts_are_removed(tmp_path: Path) -> None:
    write_synthetic(tmp_path, rows=1_000, files=8, num_users=50, num_items=40)
    write_synthetic(tmp_path, rows=1_000, files=1, num_users=50, num_items=40)
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["part-00000.parquet"]
    assert sorted(p.name for p in (tmp_path / "valid").iterdir()) == ["part-00000.parquet"]


def test_ids_are_skewed(table: pa.Table) -> None:
    for key, n in [("user_id", NUM_USERS), ("item_id", NUM_ITEMS)]:
        counts = np.sort(np.bincount(_col(table, key), minlength=n + 1)[1:])[::-1]
        top_share = counts[: n // 100].sum() / table.num_rows
        assert top_share > 0.2, f"top 1% of {key} hold only {top_share:.1%} of rows"


def test_preferred_category_cross(table: pa.Table) -> None:
    teacher = _build_teacher(SEED, NUM_USERS, NUM_ITEMS)
    users, click = _col(table, "user_id"), _col(table, "click")
    match = teacher.user_pref_mask[users, _col(table, "item_category")]
    assert 0.1 < match.mean() < 0.9
    assert click[match].mean() - click[~match].mean() > 0.1

    hist_values, hist_offsets = _lists(table, "hist_items")
    owners = np.repeat(users, np.diff(hist_offsets))
    in_pref = teacher.user_pref_mask[owners, teacher.item_category[hist_values]]
    assert in_pref.mean() > 0.7


def test_history_category_cross(table: pa.Table) -> None:
    """Teacher-free check: history sharing the item's category raises the click rate."""
    hist_values, hist_offsets = _lists(table, "hist_items")
    lengths = np.diff(hist_offsets)
    categories = dict(zip(_col(table, "item_id").tolist(), _col(table, "item_category").tolist()))
    known = np.array([v in categories for v in hist_values.tolist()])
    hist_cats = np.array([categories.get(v, -1) for v in hist_values.tolist()])
    rows = np.repeat(np.arange(table.num_rows), lengths)
    same = hist_cats == _col(table, "item_category")[rows]
    shared = np.bincount(rows, weights=same, minlength=table.num_rows)
    seen = np.bincount(rows, weights=known, minlength=table.num_rows)
    frac = np.divide(shared, seen, out=np.zeros_like(shared), where=seen > 0)
    click = _col(table, "click")
    high, none = click[(seen >= 3) & (frac >= 0.5)], click[(seen >= 3) & (frac == 0)]
    assert len(high) > 500 and len(none) > 500
    assert high.mean() - none.mean() > 0.1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rows": 0}, "rows must be positive, got 0"),
        ({"rows": -5}, "rows must be positive, got -5"),
        ({"rows": 1}, "rows must be at least 2 (one train and one valid row), got 1"),
        ({"rows": 2.5}, "rows must be an integer, got 2.5"),
        ({"valid_fraction": 0.0}, "valid_fraction must be in (0, 1), got 0.0"),
        ({"valid_fraction": 1.0}, "valid_fraction must be in (0, 1), got 1.0"),
        ({"files": 0}, "files must be positive, got 0"),
        ({"row_group_size": 0}, "row_group_size must be positive, got 0"),
        ({"num_users": 0}, "num_users must be positive, got 0"),
        ({"num_items": -1}, "num_items must be positive, got -1"),
        ({"seed": -1}, "seed must be non-negative, got -1"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        write_synthetic(tmp_path, **kwargs)
    assert not list(tmp_path.iterdir()), "nothing is written for bad arguments"


def test_a_cache_made_by_two_runs_at_once_keeps_the_first_complete_one(tmp_path):
    """Runs sharing data.cache_dir (parallel tests, two users' jobs) may both generate the
    same folder: the one renamed second must not replace the folder the first may be reading."""
    from trainer.data.datasets import _prepared

    folder = tmp_path / "synth-100-seed0"

    def make_while_another_run_finishes_first(out: Path) -> dict:
        out.mkdir()
        (out / "part-0.parquet").write_text("this run's")
        folder.mkdir()  # the other run's rename lands meanwhile
        (folder / "_SUCCESS").write_text("the other run's")
        return {"rows": 100}

    assert _prepared(folder, make_while_another_run_finishes_first) == folder
    assert (folder / "_SUCCESS").read_text() == "the other run's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no temporary folder left


def test_rows_come_one_a_second_in_row_order(table: pa.Table) -> None:
    """request_time, for data.split=time: train then valid, one second apart from FIRST_SECOND
    (2026-01-01 00:00 UTC)."""
    assert FIRST_SECOND == 1_767_225_600
    assert np.array_equal(_col(table, "request_time"), FIRST_SECOND + np.arange(ROWS))


def test_a_days_rows_spread_over_its_seconds(tmp_path: Path) -> None:
    write_days(tmp_path, days=2, drift=0.1, rows=1_000, files=3)
    for day in range(2):
        times = _col(_read(sorted(str(p) for p in tmp_path.glob(f"date=2026-01-0{day + 1}/*.parquet"))),
                     "request_time")
        start = FIRST_SECOND + 86_400 * day
        assert np.array_equal(times, start + np.arange(1_000) * 86_400 // 1_000)
