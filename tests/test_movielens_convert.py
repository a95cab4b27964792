"""convert_movielens checked against an independent re-reading of the raw MovieLens-100K TSV files."""

from __future__ import annotations

import csv
import random
import re
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from trainer.offline.movielens import convert_movielens

SRC = Path(__file__).resolve().parents[2] / "shared" / "data" / "movielens-100k"
if not (SRC / "ml-100k.inter").is_file():
    pytest.skip(f"MovieLens-100K not found at {SRC}", allow_module_level=True)

HISTORY_LEN = 20  # below the default so truncation is exercised on many rows
ROW_GROUP = 4_096

EXPECTED_SCHEMA = [
    ("user_id", pa.int64()),
    ("user_age", pa.int64()),
    ("user_gender", pa.int64()),
    ("user_occupation", pa.int64()),
    ("user_zip", pa.int64()),
    ("item_id", pa.int64()),
    ("item_genres", pa.list_(pa.int64())),
    ("item_genre", pa.int64()),
    ("item_year", pa.int64()),
    ("hour", pa.int64()),
    ("weekday", pa.int64()),
    ("hist_items", pa.list_(pa.int64())),
    ("hist_timestamps", pa.list_(pa.int64())),
    ("hist_ratings", pa.list_(pa.int64())),
    ("hist_genres", pa.list_(pa.int64())),
    ("hist_len", pa.float64()),
    ("rating", pa.float64()),
    ("timestamp", pa.int64()),
    ("label", pa.int64()),
]


def _raw(name: str) -> list[dict[str, str]]:
    """Rows of a raw TSV keyed by the column name without its ':type' suffix."""
    with open(SRC / name, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = [h.split(":")[0] for h in next(reader)]
        return [dict(zip(header, row)) for row in reader if row]


@pytest.fixture(scope="module")
def raw_inter() -> list[tuple[int, int, float, int]]:
    return [
        (int(r["user_id"]), int(r["item_id"]), float(r["rating"]), int(float(r["timestamp"])))
        for r in _raw("ml-100k.inter")
    ]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("movielens")
    summary = convert_movielens(SRC, out, history_len=HISTORY_LEN, row_group_size=ROW_GROUP, files=2)
    return summary, out


def _read_split(out: Path, split: str) -> pa.Table:
    parts = sorted((out / split).glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts])


@pytest.fixture(scope="module")
def train(converted: tuple[dict, Path]) -> pa.Table:
    return _read_split(converted[1], "train")


@pytest.fixture(scope="module")
def valid(converted: tuple[dict, Path]) -> pa.Table:
    return _read_split(converted[1], "valid")


@pytest.fixture(scope="module")
def rows(train: pa.Table, valid: pa.Table) -> dict[tuple[int, int, int], dict]:
    """Every output row keyed by (user, item, timestamp)."""
    out = {}
    for table in (train, valid):
        for r in table.to_pylist():
            out[(r["user_id"], r["item_id"], r["timestamp"])] = r
    return out


def test_files_and_summary(converted: tuple[dict, Path], train: pa.Table, valid: pa.Table) -> None:
    summary, out = converted
    train_parts = sorted((out / "train").glob("part-*.parquet"))
    valid_parts = sorted((out / "valid").glob("part-*.parquet"))
    assert len(train_parts) == 2 and len(valid_parts) == 1
    assert sorted(summary["files"]) == sorted(str(p) for p in train_parts + valid_parts)
    assert not list(out.rglob("*.tmp*"))
    for path in train_parts + valid_parts:
        meta = pq.ParquetFile(path).metadata
        assert all(meta.row_group(i).num_rows <= ROW_GROUP for i in range(meta.num_row_groups))
    assert summary["train_rows"] == train.num_rows and summary["valid_rows"] == valid.num_rows
    assert summary["num_users"] == 943 and summary["num_items"] == 1682
    assert isinstance(summary["time_cut"], int)


def test_row_count_and_schema(train: pa.Table, valid: pa.Table) -> None:
    assert train.num_rows + valid.num_rows == 100_000
    for table in (train, valid):
        assert [(f.name, f.type) for f in table.schema] == EXPECTED_SCHEMA


def test_every_raw_rating_appears_once_with_its_label(raw_inter, rows) -> None:
    assert len(rows) == len(raw_inter)
    for user, item, rating, ts in raw_inter:
        row = rows[(user, item, ts)]
        assert row["rating"] == rating
        assert row["label"] == int(rating >= 4)


def test_time_split(converted, train: pa.Table, valid: pa.Table) -> None:
    train_ts = train.column("timestamp").to_pylist()
    valid_ts = valid.column("timestamp").to_pylist()
    assert train_ts == sorted(train_ts) and valid_ts == sorted(valid_ts)
    assert min(valid_ts) >= converted[0]["time_cut"] > max(train_ts)
    assert 0.09 <= len(valid_ts) / (len(train_ts) + len(valid_ts)) <= 0.11


@pytest.fixture(scope="module")
def rarest_genre() -> dict[int, int]:
    """Each item's genre (ids as the converter numbers them) held by the fewest items, ties to the lower id."""
    items = {int(i["item_id"]): i["class"].split() or ["unknown"] for i in _raw("ml-100k.item")}
    names = sorted({g for gs in items.values() for g in gs})
    count = {g: sum(g in gs for gs in items.values()) for g in names}
    return {item: names.index(min(gs, key=lambda g: (count[g], names.index(g)))) + 1 for item, gs in items.items()}


def test_history_matches_raw(raw_inter, rows, rarest_genre) -> None:
    by_user: dict[int, list[tuple[int, int, float]]] = defaultdict(list)
    for user, item, rating, ts in raw_inter:
        by_user[user].append((ts, item, rating))
    sample = random.Random(0).sample(raw_inter, 2_000)
    for user, item, _, ts in sample:
        # Same-second ratings are ordered by item id: the converter's documented tie-break.
        earlier = [(t, it, r) for t, it, r in sorted(by_user[user]) if t < ts][-HISTORY_LEN:]
        row = rows[(user, item, ts)]
        assert row["hist_len"] == float(len([t for t, _, _ in by_user[user] if t < ts]))
        assert row["hist_items"] == [it for _, it, _ in earlier]
        assert row["hist_timestamps"] == [t for t, _, _ in earlier]
        assert row["hist_ratings"] == [int(r) for _, _, r in earlier]  # MovieLens-100K's stars are whole
        assert row["hist_genres"] == [rarest_genre[it] for _, it, _ in earlier]
        assert row["item_genre"] == rarest_genre[item]


def test_calendar_features_are_utc(raw_inter, rows) -> None:
    for user, item, _, ts in random.Random(1).sample(raw_inter, 500):
        when = datetime.fromtimestamp(ts, tz=UTC)
        row = rows[(user, item, ts)]
        assert (row["hour"], row["weekday"]) == (when.hour, when.weekday())


def test_known_user_and_item(rows) -> None:
    row = rows[(253, 465, 891628467)]
    assert row["label"] == 1
    assert row["user_gender"] == 2  # F
    assert row["user_age"] == 3  # age 26 is in 25-34


def test_user_features_match_raw(rows) -> None:
    users = {int(u["user_id"]): u for u in _raw("ml-100k.user")}
    occupations = sorted({u["occupation"] for u in users.values()})
    age_edges = [18, 25, 35, 45, 50, 56]
    for row in list(rows.values())[::97]:
        raw = users[row["user_id"]]
        assert row["user_age"] == 1 + sum(int(raw["age"]) >= e for e in age_edges)
        assert row["user_gender"] == {"M": 1, "F": 2}[raw["gender"]]
        assert row["user_occupation"] == occupations.index(raw["occupation"]) + 1
        zip_code = raw["zip_code"]
        assert row["user_zip"] == (int(zip_code[0]) + 1 if zip_code[0].isdigit() else 11)


def test_item_features_match_raw(rows) -> None:
    items = {int(i["item_id"]): i for i in _raw("ml-100k.item")}
    genres = sorted({g for i in items.values() for g in (i["class"].split() or ["unknown"])})
    assert len(genres) == 19
    for row in list(rows.values())[::97]:
        raw = items[row["item_id"]]
        expected = sorted({genres.index(g) + 1 for g in raw["class"].split() or ["unknown"]})
        assert sorted(row["item_genres"]) == expected and row["item_genre"] in expected
        year = raw["release_year"]
        assert row["item_year"] == (min(max(int(year) - 1919, 1), 80) if year.isdigit() else 81)


def test_toy_story_genres(rows) -> None:
    toy_story = next(r for r in rows.values() if r["item_id"] == 1)
    ids = toy_story["item_genres"]
    assert len(set(ids)) == len(ids) == 3  # Animation, Children's, Comedy
    assert all(1 <= g <= 19 for g in ids)
    assert toy_story["item_year"] == 1995 - 1919


def test_ids_start_at_one(train: pa.Table, valid: pa.Table) -> None:
    bounds = {"user_age": 7, "user_gender": 2, "user_occupation": 21, "user_zip": 11, "item_year": 81}
    for table in (train, valid):
        for name, high in bounds.items():
            values = table.column(name).to_pylist()
            assert 1 <= min(values) and max(values) <= high, name
        genres = pc.list_flatten(table.column("item_genres")).to_pylist()
        assert min(genres) >= 1 and max(genres) <= 19
        assert min(pc.list_value_length(table.column("item_genres")).to_pylist()) >= 1


def test_missing_file_names_path(tmp_path: Path) -> None:
    expected = f"MovieLens file not found: {tmp_path / 'ml-100k.inter'}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        convert_movielens(tmp_path, tmp_path / "out")


def _tiny_dataset(folder: Path, inter_lines: list[str]) -> Path:
    """A three-file dataset small enough to write by hand, for error paths."""
    (folder / "ml-100k.inter").write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + "".join(inter_lines)
    )
    (folder / "ml-100k.user").write_text(
        "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n1\t30\tF\tartist\tK1A0B\n"
    )
    (folder / "ml-100k.item").write_text(
        "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n1\tX\tunkonwn\t\n"
    )
    return folder


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    src = _tiny_dataset(tmp_path, ["1\t1\t4\t100\n", "1\t1\tfour\t200\n"])
    with pytest.raises(ValueError, match=re.escape(f"{src / 'ml-100k.inter'}:3:")):
        convert_movielens(src, tmp_path / "out")


def test_tiny_dataset_edge_cases(tmp_path: Path) -> None:
    # Same-second ratings must not see each other; a non-numeric zip and a missing year get their own ids.
    src = _tiny_dataset(tmp_path, ["1\t1\t4\t100\n", "1\t1\t2\t100\n", "1\t1\t5\t300\n"])
    summary = convert_movielens(src, tmp_path / "out", valid_fraction=0.34, files=1)
    table = _read_split(tmp_path / "out", "train")
    assert table.column("hist_len").to_pylist() == [0.0, 0.0]
    assert table.column("user_zip").to_pylist() == [11, 11]
    assert table.column("item_year").to_pylist() == [81, 81]
    assert table.column("item_genres").to_pylist() == [[1], [1]]
    valid = _read_split(tmp_path / "out", "valid")
    assert valid.column("hist_items").to_pylist() == [[1, 1]]
    assert valid.column("hist_ratings").to_pylist() == [[4, 2]]  # the same second and item: in file order
    assert valid.column("hist_genres").to_pylist() == [[1, 1]]
    assert summary["time_cut"] == 300


@pytest.mark.parametrize(
    "option, value",
    [("valid_fraction", 0.0), ("valid_fraction", 1.5), ("history_len", 0), ("row_group_size", -1), ("files", 0)],
)
def test_bad_option_is_named(tmp_path: Path, option: str, value: float) -> None:
    with pytest.raises(ValueError, match=option):
        convert_movielens(SRC, tmp_path, **{option: value})
