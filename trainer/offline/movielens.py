"""Convert MovieLens-100K (RecBole layout) into the train/valid parquet parts the trainer reads.

All categorical ids are contiguous from 1 so that id 0 stays free for padding. The split is by a
global time cut, so validation measures how well the model predicts the future, not the past.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainer.offline.time_cut import time_cut

__all__ = ["convert_movielens", "SCHEMA"]

SCHEMA = pa.schema(
    [
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
)

_INTER_COLS = ("user_id", "item_id", "rating", "timestamp")
_USER_COLS = ("user_id", "age", "gender", "occupation", "zip_code")
_ITEM_COLS = ("item_id", "release_year", "class")  # titles are not a feature

# Upper bounds (exclusive) of the MovieLens-1M age groups; ids run 1..7.
_AGE_EDGES = np.array([18, 25, 35, 45, 50, 56])
_GENDERS = {"M": 1, "F": 2}
_NON_NUMERIC_ZIP = 11
_YEAR_BASE, _YEAR_MAX, _YEAR_MISSING = 1919, 80, 81
_UNKNOWN_GENRE = "unknown"
_POSITIVE_RATING = 4.0
_MAX_ID = 2**63 - 1


@dataclass(frozen=True)
class _Inter:
    user: np.ndarray  # int64
    item: np.ndarray  # int64
    rating: np.ndarray  # float64
    ts: np.ndarray  # int64


@dataclass(frozen=True)
class _Users:
    """Per-user features; row i describes user ids[i]. Ids may reach 2^63 - 1, so nothing is
    sized by the largest id."""

    ids: np.ndarray  # int64, sorted, distinct
    age: np.ndarray
    gender: np.ndarray
    occupation: np.ndarray
    zip: np.ndarray


@dataclass(frozen=True)
class _Items:
    """Per-item features; row i describes item ids[i] (sorted, distinct int64)."""

    ids: np.ndarray
    genres: pa.ListArray
    genre: np.ndarray  # int64: the item's rarest genre (the fewest items), ties to the lower id
    year: np.ndarray


def convert_movielens(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    valid_fraction: float = 0.1,
    history_len: int = 50,
    row_group_size: int = 8_192,
    files: int = 2,
) -> dict:
    """MovieLens-100K (RecBole layout) -> out/train/part-*.parquet and out/valid/part-*.parquet; returns a summary
    {"train_rows", "valid_rows", "time_cut" (int unix seconds), "positive_rate", "num_users", "num_items",
    "files": [str]}.

    ``positive_rate`` is over all rows; ``train_positive_rate`` and ``valid_positive_rate`` are added for convenience.
    Ties in timestamp are broken by (user_id, item_id) for row order and by item_id inside ``hist_items``.
    """
    _check_options(valid_fraction, history_len, row_group_size, files)
    src = Path(src)
    paths = {kind: src / f"ml-100k.{kind}" for kind in ("inter", "user", "item")}
    for path in paths.values():
        if not path.is_file():
            raise ValueError(f"MovieLens file not found: {path}")
    inter = _read_inter(paths["inter"])
    users = _read_users(paths["user"])
    items = _read_items(paths["item"])
    user_rows = _rows_of(inter.user, users.ids, "user_id", paths["inter"])
    item_rows = _rows_of(inter.item, items.ids, "item_id", paths["inter"])

    table = _build_table(inter, users, items, user_rows, item_rows, history_len)
    # the first timestamp at or above the (1 - valid_fraction) quantile: rows at or after it are validation
    cut = time_cut(inter.ts, 1.0 - valid_fraction, f"valid_fraction={valid_fraction}")
    # Sorting by (timestamp, user, item) keeps the output deterministic when timestamps tie.
    order = np.lexsort((inter.item, inter.user, inter.ts))
    in_valid = inter.ts[order] >= cut
    train, valid = table.take(order[~in_valid]), table.take(order[in_valid])

    out = Path(out)
    written = _write_split(train, out / "train", files, row_group_size)
    written += _write_split(valid, out / "valid", 1, row_group_size)
    labels = table.column("label").to_numpy()
    return {
        "train_rows": train.num_rows,
        "valid_rows": valid.num_rows,
        "time_cut": cut,
        "positive_rate": float(labels.mean()),
        "train_positive_rate": _mean_label(train),
        "valid_positive_rate": _mean_label(valid),
        "num_users": int(users.ids.size),
        "num_items": int(items.ids.size),
        "files": [str(p) for p in written],
    }


def _check_options(valid_fraction: float, history_len: int, row_group_size: int, files: int) -> None:
    """Reject options that would silently produce an empty or nonsensical split."""
    if not isinstance(valid_fraction, (int, float)) or isinstance(valid_fraction, bool) or not 0 < valid_fraction < 1:
        raise ValueError(f"valid_fraction must be a number in (0, 1), got {valid_fraction!r}")
    for name, value in (("history_len", history_len), ("row_group_size", row_group_size), ("files", files)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text without its line end) of each line; a line that is not UTF-8 is
    a ValueError naming the file and the line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") \
                    from None
            yield lineno, text.rstrip("\r\n")


def _read_rows(path: Path, columns: tuple[str, ...]) -> list[tuple[int, list[str]]]:
    """(line number, fields in ``columns`` order) for each data line, matching columns by header name."""
    lines = _lines(path)
    header = next(lines, (1, ""))[1].split("\t")
    names = [h.split(":", 1)[0] for h in header]
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"{path}:1: header lacks column(s) {missing}; got {header}")
    pick = [names.index(c) for c in columns]
    rows = []
    for lineno, line in lines:
        if not line:
            continue
        fields = line.split("\t")
        if len(fields) != len(names):
            raise ValueError(f"{path}:{lineno}: expected {len(names)} tab-separated fields, got {len(fields)}")
        rows.append((lineno, [fields[i] for i in pick]))
    return rows


def _malformed(path: Path, lineno: int, what: str) -> ValueError:
    return ValueError(f"{path}:{lineno}: malformed line: {what}")


def _finite(text: str) -> float:
    """`float(text)`, refusing inf and nan."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"not finite: {text!r}")
    return value


def _read_inter(path: Path) -> _Inter:
    """Ratings as parallel numpy arrays."""
    rows = _read_rows(path, _INTER_COLS)
    user, item = np.empty(len(rows), np.int64), np.empty(len(rows), np.int64)
    rating, ts = np.empty(len(rows), np.float64), np.empty(len(rows), np.int64)
    for i, (lineno, (u, it, r, t)) in enumerate(rows):
        try:
            user[i], item[i], rating[i], ts[i] = int(u), int(it), _finite(r), int(_finite(t))
        except (ValueError, OverflowError):  # OverflowError: a timestamp beyond int64
            raise _malformed(path, lineno, f"{u!r} {it!r} {r!r} {t!r}") from None
    if not len(rows):
        raise ValueError(f"{path}: no interactions")
    return _Inter(user, item, rating, ts)


def _read_users(path: Path) -> _Users:
    """Bucketised user features in lookup arrays indexed by user id."""
    rows = _read_rows(path, _USER_COLS)
    ids, ages, genders, occs, zips = [], [], [], [], []
    for lineno, (uid, age, gender, occ, zip_code) in rows:
        if not _is_id(uid) or not age.isdigit() or gender not in _GENDERS:
            raise _malformed(path, lineno, f"user_id={uid!r} age={age!r} gender={gender!r}")
        ids.append(int(uid))
        ages.append(int(age))
        genders.append(_GENDERS[gender])
        occs.append(occ)
        # Canadian postcodes (e.g. 'T8H1N') share one bucket rather than inventing a letter scheme.
        zips.append(int(zip_code[0]) + 1 if zip_code[:1].isdigit() else _NON_NUMERIC_ZIP)
    occ_ids = {name: i for i, name in enumerate(sorted(set(occs)), start=1)}
    ids, last = _distinct(ids)
    return _Users(
        ids=ids,
        age=np.searchsorted(_AGE_EDGES, np.asarray(ages)[last], side="right") + 1,
        gender=np.asarray(genders, np.int64)[last],
        occupation=np.asarray([occ_ids[o] for o in occs], np.int64)[last],
        zip=np.asarray(zips, np.int64)[last],
    )


def _read_items(path: Path) -> _Items:
    """Genre lists and year buckets in lookups indexed by item id."""
    rows = _read_rows(path, _ITEM_COLS)
    ids, years, genre_names = [], [], []
    for lineno, (iid, year, genres) in rows:
        if not _is_id(iid):
            raise _malformed(path, lineno, f"item_id={iid!r}")
        ids.append(int(iid))
        # The raw data spells a missing year as 'unkonwn'; any non-year counts as missing.
        years.append(int(year) if year.strip().isdigit() else None)
        genre_names.append(genres.split() or [_UNKNOWN_GENRE])
    genre_ids = {g: i for i, g in enumerate(sorted({g for gs in genre_names for g in gs}), start=1)}
    ids, last = _distinct(ids)
    genre_lists = [sorted({genre_ids[g] for g in genre_names[i]}) for i in last]
    items_of = np.bincount([g for gs in genre_lists for g in gs], minlength=len(genre_ids) + 1)
    rarest = np.asarray([min(gs, key=lambda g: (items_of[g], g)) for gs in genre_lists], np.int64)
    year_bucket = np.asarray([_YEAR_MISSING if y is None else min(max(y - _YEAR_BASE, 1), _YEAR_MAX) for y in years],
                             np.int64)
    return _Items(ids, pa.array(genre_lists, type=pa.list_(pa.int64())), rarest, year_bucket[last])


def _is_id(text: str) -> bool:
    """A decimal id that fits int64."""
    return text.isdigit() and int(text) <= _MAX_ID


def _distinct(ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ids, sorted, and for each the index of its last line (a later line
    overrides an earlier one, as before)."""
    ids = np.asarray(ids, np.int64)
    last = ids.size - 1 - np.unique(ids[::-1], return_index=True)[1]
    return ids[last], last


def _rows_of(ids: np.ndarray, known: np.ndarray, name: str, path: Path) -> np.ndarray:
    """The feature row of each rating's id; every rating must refer to an id >= 1 that has features."""
    rows = np.searchsorted(known, ids)
    bad = (ids < 1) | (np.r_[known, 0][rows] != ids)  # the 0 stands past the last id
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{path}: rating row {i + 1} has {name}={ids[i]} with no features")
    return rows


def _history(inter: _Inter, history_len: int, fields: dict[str, np.ndarray]) -> tuple[dict[str, pa.ListArray],
                                                                                      np.ndarray]:
    """Per rating: each of `fields` (a value per rating: its item, its time, its stars...) over the
    user's strictly earlier ratings (most recent last, truncated), aligned lists by name, and the
    full count of those ratings.

    Within a user's time-sorted ratings, the history of a row is a contiguous slice ending where its
    timestamp run starts, so it can be gathered without a Python loop.
    """
    n = inter.user.size
    order = np.lexsort((inter.item, inter.ts, inter.user))
    user, ts = inter.user[order], inter.ts[order]
    pos = np.arange(n)
    new_user = np.r_[True, user[1:] != user[:-1]]
    new_run = new_user | np.r_[True, ts[1:] != ts[:-1]]
    user_start = np.maximum.accumulate(np.where(new_user, pos, 0))
    run_start = np.maximum.accumulate(np.where(new_run, pos, 0))
    start = np.maximum(user_start, run_start - history_len)
    lengths = run_start - start
    offsets = np.r_[0, np.cumsum(lengths)]
    gather = np.repeat(start - offsets[:-1], lengths) + np.arange(offsets[-1])
    inverse = pa.array(np.argsort(order))
    lists = {name: pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values[order][gather]))
             for name, values in fields.items()}
    full = np.empty(n, np.float64)
    full[order] = run_start - user_start
    return {name: values.take(inverse) for name, values in lists.items()}, full


def _build_table(inter: _Inter, users: _Users, items: _Items, user_rows: np.ndarray, item_rows: np.ndarray,
                 history_len: int) -> pa.Table:
    """All output columns, in input row order; `user_rows` and `item_rows` are each rating's feature rows."""
    # each past rating with its time, its stars (whole, as ids: 0-5) and its item's genre
    hist, hist_len = _history(inter, history_len, {
        "hist_items": inter.item, "hist_timestamps": inter.ts,
        "hist_ratings": np.rint(inter.rating).astype(np.int64), "hist_genres": items.genre[item_rows]})
    days, seconds = np.divmod(inter.ts, 86_400)
    columns = {
        "user_id": inter.user,
        "user_age": users.age[user_rows],
        "user_gender": users.gender[user_rows],
        "user_occupation": users.occupation[user_rows],
        "user_zip": users.zip[user_rows],
        "item_id": inter.item,
        "item_genres": items.genres.take(pa.array(item_rows)),
        "item_genre": items.genre[item_rows],
        "item_year": items.year[item_rows],
        "hour": seconds // 3_600,
        "weekday": (days + 3) % 7,  # 1970-01-01 was a Thursday
        **hist,
        "hist_len": hist_len,
        "rating": inter.rating,
        "timestamp": inter.ts,
        "label": (inter.rating >= _POSITIVE_RATING).astype(np.int64),
    }
    arrays = [c if isinstance(c, pa.Array) else pa.array(c, f.type) for f, c in zip(SCHEMA, columns.values())]
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


def _write_split(table: pa.Table, folder: Path, parts: int, row_group_size: int) -> list[Path]:
    """Write ``parts`` time-contiguous files atomically, then drop stale parts from earlier runs."""
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, table.num_rows, parts + 1).astype(np.int64)
    written = []
    for i in range(parts):
        path = folder / f"part-{i:05d}.parquet"
        tmp = folder / f".{path.name}.tmp-{os.getpid()}"
        chunk = table.slice(int(bounds[i]), int(bounds[i + 1] - bounds[i]))
        try:
            pq.write_table(chunk, tmp, row_group_size=row_group_size)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(path)
    for stale in set(folder.glob("part-*.parquet")) - set(written):
        stale.unlink()
    return written


def _mean_label(table: pa.Table) -> float:
    return float(table.column("label").to_numpy().mean()) if table.num_rows else float("nan")
