"""Synthetic ranking logs with a hidden feature-cross teacher, written as Parquet.

Labels come from a fixed "teacher" whose click logit is dominated by crosses
(user x item latent dot product, user preferred category x item category,
hour bucket x device, behaviour history x item category), so a model that learns
interactions clearly beats a first-order logistic regression on the same features.

Rows are generated in fixed-size chunks, each from its own generator seeded with
``[seed, 1, chunk_index]``; the row stream therefore depends only on ``seed``,
``num_users`` and ``num_items`` (and the teacher only on those), never on how the
rows are split into files or row groups. Row i's ``request_time`` is FIRST_SECOND + i (one
request a second), so ``data.split=time`` can cut the log; its rows are drawn alike throughout,
so a cut in time is a cut in row order here.

``write_days`` writes a drifting log instead: one Hive partition ``date=YYYY-MM-DD/`` a day,
each with a ``_SUCCESS`` marker, from a teacher that moves day by day (``day_teachers``): users
and items are born over the days (70% of each exist on the first day, all on the last), and
each day a share ``drift`` of the users' and items' latent vectors and biases is drawn anew,
the hour x device cross moves by that share, and that share of the item popularity ranks swap
places. Day d's rows come from generators seeded with ``[seed, 3, d, file]``; their
``request_time`` spreads them over that day's seconds.
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

__all__ = ["SCHEMA", "write_synthetic", "write_days", "day_teachers", "teacher_click_logit"]

SCHEMA = pa.schema(
    [
        ("user_id", pa.int64()),
        ("user_age", pa.int64()),
        ("user_gender", pa.int64()),
        ("user_activity", pa.float64()),
        ("item_id", pa.int64()),
        ("item_category", pa.int64()),
        ("item_tags", pa.list_(pa.int64())),
        ("item_price", pa.float64()),
        ("hour", pa.int64()),
        ("weekday", pa.int64()),
        ("device", pa.int64()),
        ("hist_items", pa.list_(pa.int64())),
        ("click", pa.int64()),
        ("like", pa.int64()),
        ("request_time", pa.int64()),
    ]
)

NUM_USERS = 5_000
NUM_ITEMS = 2_000
NUM_AGES = 8
NUM_GENDERS = 2
NUM_CATEGORIES = 32
NUM_TAGS = 200
MAX_TAGS = 4
NUM_DEVICES = 4
MAX_HIST = 30
NUM_HOURS = 24
NUM_WEEKDAYS = 7
LATENT_DIM = 8
ZIPF_EXPONENT = 1.1

# Large enough to amortise numpy call overhead, small enough that transient
# per-row intermediates (latent gathers, history draws) stay a few tens of MB.
_CHUNK_ROWS = 32_768
# Items shown because the recommender already targeted a preferred category.
_PREF_IMPRESSION_RATE = 0.35
# Share of behaviour-history items taken from the user's preferred categories.
_PREF_HISTORY_RATE = 0.8
_HOUR_BUCKETS = 6

# Teacher weights, tuned so CTR ~ 0.25 and the teacher AUC is ~0.8 at the defaults.
_CLICK_BIAS = -2.2
_CLICK_LATENT = 1.15
_CLICK_PREF = 1.1
_CLICK_HOUR_DEVICE = 0.6
_CLICK_HIST = 1.5
_CLICK_NOISE = 0.3
_LIKE_BIAS = -1.0
_LIKE_AGE_CATEGORY = 1.0
_LIKE_GENDER_PRICE = 0.6
_LIKE_LATENT = 0.4


@dataclass(frozen=True)
class _Teacher:
    """Hidden per-user / per-item state; arrays are indexed by id (index 0 unused)."""

    user_rank_ids: np.ndarray
    user_cdf: np.ndarray
    user_age: np.ndarray
    user_gender: np.ndarray
    user_activity: np.ndarray
    user_bias: np.ndarray
    user_vec: np.ndarray
    user_like_vec: np.ndarray
    user_prefs: np.ndarray  # (U+1, 3) categories; only the first user_npref are real
    user_npref: np.ndarray
    user_pref_mask: np.ndarray  # (U+1, NUM_CATEGORIES+1) bool
    item_rank_ids: np.ndarray
    item_cdf: np.ndarray
    item_category: np.ndarray
    item_price: np.ndarray
    item_log_price_z: np.ndarray
    item_bias: np.ndarray
    item_vec: np.ndarray
    item_like_vec: np.ndarray
    item_tag_values: np.ndarray
    item_tag_offsets: np.ndarray
    category_keys: np.ndarray  # sorted "category - 1 + within-category cdf"
    category_items: np.ndarray  # item ids in the same order as category_keys
    hour_device: np.ndarray  # (_HOUR_BUCKETS, NUM_DEVICES), double-centred
    age_category: np.ndarray  # (NUM_AGES+1, NUM_CATEGORIES+1), double-centred


def write_synthetic(
    out_dir: str | os.PathLike,
    *,
    rows: int = 200_000,
    valid_fraction: float = 0.1,
    files: int = 4,
    row_group_size: int = 8_192,
    seed: int = 0,
    num_users: int = NUM_USERS,
    num_items: int = NUM_ITEMS,
) -> dict:
    """Write train/ and valid/ Parquet parts under out_dir and return a summary dict.

    The summary is ``{"train_rows", "valid_rows", "files", "ctr", "like_rate"}``;
    ``ctr`` and ``like_rate`` are clicks and likes per row over both splits.
    Stale ``part-*.parquet`` files left in the split folders by earlier calls are removed.
    """
    _validate(rows, valid_fraction, files, row_group_size, seed, num_users, num_items)
    valid_rows = min(rows - 1, max(1, round(rows * valid_fraction)))
    train_rows = rows - valid_rows
    teacher = _build_teacher(seed, num_users, num_items)
    out = Path(out_dir)
    splits = [
        ("train", 0, train_rows, files),
        ("valid", train_rows, rows, max(1, files // 4)),
    ]
    paths: list[str] = []
    clicks = likes = 0
    for name, start, stop, nfiles in splits:
        written, split_clicks, split_likes = _write_split(
            teacher, seed, out / name, start, stop, nfiles, row_group_size
        )
        paths.extend(written)
        clicks += split_clicks
        likes += split_likes
    return {
        "train_rows": train_rows,
        "valid_rows": valid_rows,
        "files": paths,
        "ctr": clicks / rows,
        "like_rate": likes / rows,
    }


def _write_split(
    teacher: _Teacher, seed: int, split_dir: Path, start: int, stop: int, nfiles: int, row_group_size: int
) -> tuple[list[str], int, int]:
    """Write global rows [start, stop) as nfiles contiguous parts; return paths, clicks, likes."""
    split_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    clicks = likes = 0
    for i in range(nfiles):
        lo = start + (stop - start) * i // nfiles
        hi = start + (stop - start) * (i + 1) // nfiles
        table = _rows_table(teacher, seed, lo, hi)
        path = split_dir / f"part-{i:05d}.parquet"
        _write_atomic(table, path, row_group_size)
        clicks += pc.sum(table["click"]).as_py() or 0  # None for an empty part
        likes += pc.sum(table["like"]).as_py() or 0
        written.append(path)
    _remove_stale_parts(split_dir, written)
    return [str(p) for p in written], clicks, likes


def _validate(
    rows: int,
    valid_fraction: float,
    files: int,
    row_group_size: int,
    seed: int,
    num_users: int,
    num_items: int,
) -> None:
    """Raise ValueError naming the first bad option."""
    for name, value in [
        ("rows", rows),
        ("files", files),
        ("row_group_size", row_group_size),
        ("num_users", num_users),
        ("num_items", num_items),
        ("seed", seed),
    ]:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if name == "seed":
            if value < 0:  # SeedSequence rejects negative entropy
                raise ValueError(f"seed must be non-negative, got {value}")
        elif value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if rows < 2:
        raise ValueError(f"rows must be at least 2 (one train and one valid row), got {rows}")
    if isinstance(valid_fraction, bool) or not isinstance(valid_fraction, (int, float, np.floating)):
        raise ValueError(f"valid_fraction must be a number, got {valid_fraction!r}")
    if not 0.0 < valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}")


# --------------------------------------------------------------------------- teacher


def _build_teacher(seed: int, num_users: int, num_items: int) -> _Teacher:
    """Draw the hidden teacher; depends only on (seed, num_users, num_items)."""
    rng = np.random.default_rng(seed)
    users = _user_state(rng, num_users)
    items = _item_state(rng, num_items)
    return _Teacher(
        **users,
        **items,
        hour_device=_double_centred(rng.normal(size=(_HOUR_BUCKETS, NUM_DEVICES))),
        age_category=_pad_table(_double_centred(rng.normal(size=(NUM_AGES, NUM_CATEGORIES)))),
    )


def _user_state(rng: np.random.Generator, num_users: int) -> dict[str, np.ndarray]:
    """Per-user popularity, attributes, biases, latent vectors and preferred categories."""
    rank_ids, cdf = _zipf(rng, num_users)
    prefs, npref, pref_mask = _user_preferences(rng, num_users)
    activity = rng.lognormal(0.0, 0.9, num_users)
    # Active users click a little more: the numeric feature carries first-order signal.
    bias = rng.normal(0.0, 0.4, num_users) + 0.15 * np.log(activity)
    return {
        "user_rank_ids": rank_ids,
        "user_cdf": cdf,
        "user_age": _with_pad(rng.integers(1, NUM_AGES + 1, num_users)),
        "user_gender": _with_pad(rng.integers(1, NUM_GENDERS + 1, num_users)),
        "user_activity": _with_pad(activity),
        "user_bias": _with_pad(bias),
        "user_vec": _with_pad(rng.normal(size=(num_users, LATENT_DIM))),
        "user_like_vec": _with_pad(rng.normal(size=(num_users, LATENT_DIM))),
        "user_prefs": prefs,
        "user_npref": npref,
        "user_pref_mask": pref_mask,
    }


def _item_state(rng: np.random.Generator, num_items: int) -> dict[str, np.ndarray]:
    """Per-item popularity, category, tags, price, biases and latent vectors."""
    rank_ids, cdf = _zipf(rng, num_items)
    category = _item_categories(rng, num_items)
    log_price = rng.normal(3.0, 0.8, num_items) + 0.03 * category[1:]
    tag_values, tag_offsets = _item_tags(rng, category)
    keys, cat_items = _category_index(category, rank_ids, cdf)
    # Items share a category direction so user x category structure is learnable
    # from fewer rows than a free user x item matrix would need.
    category_vec = rng.normal(size=(NUM_CATEGORIES + 1, LATENT_DIM))
    item_vec = 0.6 * category_vec[category] + 0.8 * rng.normal(size=(num_items + 1, LATENT_DIM))
    return {
        "item_rank_ids": rank_ids,
        "item_cdf": cdf,
        "item_category": category,
        "item_price": _with_pad(np.exp(log_price)),
        "item_log_price_z": _with_pad((log_price - log_price.mean()) / (log_price.std() + 1e-9)),
        "item_bias": _with_pad(rng.normal(0.0, 0.4, num_items)),
        "item_vec": item_vec,
        "item_like_vec": _with_pad(rng.normal(size=(num_items, LATENT_DIM))),
        "item_tag_values": tag_values,
        "item_tag_offsets": tag_offsets,
        "category_keys": keys,
        "category_items": cat_items,
    }


def _with_pad(values: np.ndarray) -> np.ndarray:
    """Prepend a zero row so arrays can be indexed directly by 1-based id."""
    return np.concatenate([np.zeros((1, *values.shape[1:]), dtype=values.dtype), values])


def _pad_table(table: np.ndarray) -> np.ndarray:
    """Add a zero row and column so a table is indexed by 1-based ids on both axes."""
    return np.pad(table, ((1, 0), (1, 0)))


def _double_centred(table: np.ndarray) -> np.ndarray:
    """Remove row and column means so the table is a pure interaction, not main effects."""
    table = table - table.mean(axis=0, keepdims=True)
    return table - table.mean(axis=1, keepdims=True)


def _zipf(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Return ids in popularity-rank order and the cdf of rank^-ZIPF_EXPONENT."""
    return rng.permutation(n).astype(np.int64) + 1, _zipf_cdf(n)


def _draw(rank_ids: np.ndarray, cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Map uniforms in [0, 1) to ids through a popularity cdf."""
    idx = np.searchsorted(cdf, u, side="right")
    return rank_ids[np.minimum(idx, len(rank_ids) - 1)]


def _user_preferences(rng: np.random.Generator, num_users: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Give each user 2-3 distinct preferred categories (plus a lookup mask)."""
    prefs = np.argsort(rng.random((num_users, NUM_CATEGORIES)), axis=1)[:, :3] + 1
    npref = rng.integers(2, 4, num_users)
    mask = np.zeros((num_users + 1, NUM_CATEGORIES + 1), dtype=bool)
    rows = np.repeat(np.arange(1, num_users + 1), 3)
    real = (np.arange(3)[None, :] < npref[:, None]).ravel()
    mask[rows[real], prefs.ravel()[real]] = True
    return _with_pad(prefs), _with_pad(npref), mask


def _item_categories(rng: np.random.Generator, num_items: int) -> np.ndarray:
    """Skewed category per item; every category gets an item when there are enough items."""
    probs = rng.dirichlet(np.full(NUM_CATEGORIES, 2.0))
    cats = rng.choice(NUM_CATEGORIES, size=num_items, p=probs) + 1
    if num_items >= NUM_CATEGORIES:
        # Empty categories would silently redirect "preferred category" draws.
        cats[rng.choice(num_items, NUM_CATEGORIES, replace=False)] = np.arange(1, NUM_CATEGORIES + 1)
    return _with_pad(cats.astype(np.int64))


def _item_tags(rng: np.random.Generator, item_category: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return CSR (values, offsets by item id) of 1-4 distinct tags per item."""
    n = len(item_category) - 1
    block = NUM_TAGS // NUM_CATEGORIES
    # One tag from the category's own block makes tags informative about the category.
    home = (item_category[1:] - 1) * block + rng.integers(0, block, n) + 1
    cand = np.column_stack([home, rng.integers(1, NUM_TAGS + 1, (n, MAX_TAGS - 1))])
    want = rng.integers(1, MAX_TAGS + 1, n)
    cand.sort(axis=1)
    fresh = np.ones_like(cand, dtype=bool)
    fresh[:, 1:] = cand[:, 1:] != cand[:, :-1]
    keep = fresh & (np.cumsum(fresh, axis=1) <= want[:, None])
    counts = np.concatenate([[0, 0], keep.sum(axis=1)])  # id 0 is an empty list
    return cand[keep].astype(np.int64), np.cumsum(counts)


def _category_index(
    item_category: np.ndarray, rank_ids: np.ndarray, cdf: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Build sorted keys so one searchsorted draws a popular item from any category."""
    pop = np.zeros(len(item_category))  # items not yet born (write_days) stay at 0
    pop[rank_ids] = np.diff(cdf, prepend=0.0)
    ids = np.argsort(item_category[1:], kind="stable") + 1
    cats = item_category[ids]
    cum = np.cumsum(pop[ids])
    starts = np.searchsorted(cats, cats, side="left")
    ends = np.searchsorted(cats, cats, side="right") - 1
    before = np.where(starts > 0, cum[starts - 1], 0.0)
    within = (cum - before) / (cum[ends] - before)
    within[np.arange(len(ids)) == ends] = 1.0  # exact segment ends despite rounding
    return (cats - 1) + within, ids


def _draw_in_category(teacher: _Teacher, cats: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Draw items by popularity within the given categories (next category if empty)."""
    idx = np.searchsorted(teacher.category_keys, (cats - 1) + u, side="right")
    return teacher.category_items[np.minimum(idx, len(teacher.category_items) - 1)]


def _draw_preferred(teacher: _Teacher, rng: np.random.Generator, users: np.ndarray) -> np.ndarray:
    """Draw one item per entry from a random preferred category of that user."""
    slot = (rng.random(len(users)) * teacher.user_npref[users]).astype(np.int64)
    cats = teacher.user_prefs[users, slot]
    return _draw_in_category(teacher, cats, rng.random(len(users)))


# --------------------------------------------------------------------------- rows


def _rows_table(teacher: _Teacher, seed: int, lo: int, hi: int) -> pa.Table:
    """Return global rows [lo, hi) as one table, generated chunk by chunk."""
    if hi <= lo:
        return SCHEMA.empty_table()
    parts = []
    for chunk in range(lo // _CHUNK_ROWS, (hi - 1) // _CHUNK_ROWS + 1):
        base = chunk * _CHUNK_ROWS
        # Chunks straddling a file boundary are regenerated; cheaper than caching them.
        times = FIRST_SECOND + base + np.arange(_CHUNK_ROWS)  # one request a second, in row order
        table = _chunk_table(teacher, np.random.default_rng([seed, 1, chunk]), times)
        start, stop = max(lo, base) - base, min(hi, base + _CHUNK_ROWS) - base
        parts.append(table.slice(start, stop - start))
    return pa.concat_tables(parts)


def _chunk_table(teacher: _Teacher, rng: np.random.Generator, times: np.ndarray) -> pa.Table:
    """Generate one impression a time of `times` (seconds, the `request_time` column) with features
    and teacher labels; the times draw nothing from `rng`."""
    n = len(times)
    users = _draw(teacher.user_rank_ids, teacher.user_cdf, rng.random(n))
    popular = _draw(teacher.item_rank_ids, teacher.item_cdf, rng.random(n))
    items = np.where(rng.random(n) < _PREF_IMPRESSION_RATE, _draw_preferred(teacher, rng, users), popular)
    hour = rng.choice(NUM_HOURS, size=n, p=_hour_probs())
    weekday = rng.integers(0, NUM_WEEKDAYS, n)
    device = rng.choice(NUM_DEVICES, size=n, p=[0.55, 0.3, 0.1, 0.05]) + 1
    hist_values, hist_offsets = _history(teacher, rng, users)
    hist_frac = _history_match(teacher, items, hist_values, hist_offsets)
    click_logit = _click_logit(teacher, users, items, hour, device, hist_frac)
    click_logit += rng.normal(0.0, _CLICK_NOISE, n)
    click = rng.random(n) < _sigmoid(click_logit)
    like = click & (rng.random(n) < _sigmoid(_like_logit(teacher, users, items)))
    tag_values, tag_offsets = _gather_lists(teacher.item_tag_values, teacher.item_tag_offsets, items)
    columns = [
        users,
        teacher.user_age[users],
        teacher.user_gender[users],
        teacher.user_activity[users],
        items,
        teacher.item_category[items],
        _list_array(tag_values, tag_offsets),
        teacher.item_price[items],
        hour.astype(np.int64),
        weekday.astype(np.int64),
        device.astype(np.int64),
        _list_array(hist_values, hist_offsets),
        click.astype(np.int64),
        like.astype(np.int64),
        times.astype(np.int64),
    ]
    return pa.Table.from_arrays([pa.array(c) if isinstance(c, np.ndarray) else c for c in columns], schema=SCHEMA)


def _hour_probs() -> np.ndarray:
    """Diurnal traffic: quiet at night, peaking in the evening."""
    hours = np.arange(24)
    weights = 1.1 + np.sin(2 * np.pi * (hours - 14) / 24) + 0.4 * np.exp(-((hours - 21) ** 2) / 4)
    return weights / weights.sum()


def _history(teacher: _Teacher, rng: np.random.Generator, users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Draw each row's behaviour sequence as CSR (values, offsets), mostly preferred categories."""
    lengths = np.minimum(rng.poisson(6.0 * teacher.user_activity[users]), MAX_HIST)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    owner = np.repeat(users, lengths)
    preferred = _draw_preferred(teacher, rng, owner)
    popular = _draw(teacher.item_rank_ids, teacher.item_cdf, rng.random(len(owner)))
    values = np.where(rng.random(len(owner)) < _PREF_HISTORY_RATE, preferred, popular)
    return values, offsets


def _history_match(teacher: _Teacher, items: np.ndarray, values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Fraction of each row's history sharing the impressed item's category (0 if empty)."""
    lengths = np.diff(offsets)
    row = np.repeat(np.arange(len(items)), lengths)
    same = teacher.item_category[values] == teacher.item_category[items][row]
    hits = np.bincount(row, weights=same, minlength=len(items))
    return hits / np.maximum(lengths, 1)


def _click_logit(
    teacher: _Teacher,
    users: np.ndarray,
    items: np.ndarray,
    hour: np.ndarray,
    device: np.ndarray,
    hist_frac: np.ndarray,
) -> np.ndarray:
    """Noise-free click logit: first-order biases plus four crosses."""
    latent = np.einsum("ij,ij->i", teacher.user_vec[users], teacher.item_vec[items]) / np.sqrt(LATENT_DIM)
    pref = teacher.user_pref_mask[users, teacher.item_category[items]]
    return (
        _CLICK_BIAS
        + teacher.user_bias[users]
        + teacher.item_bias[items]
        + _CLICK_LATENT * latent
        + _CLICK_PREF * pref
        + _CLICK_HOUR_DEVICE * teacher.hour_device[hour * _HOUR_BUCKETS // 24, device - 1]
        + _CLICK_HIST * hist_frac
    )


def _like_logit(teacher: _Teacher, users: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Like logit among clicks: age x category, gender x price and a second latent cross."""
    gender_sign = 2.0 * teacher.user_gender[users] - 3.0  # 1 -> -1, 2 -> +1
    latent = np.einsum("ij,ij->i", teacher.user_like_vec[users], teacher.item_like_vec[items])
    return (
        _LIKE_BIAS
        + _LIKE_AGE_CATEGORY * teacher.age_category[teacher.user_age[users], teacher.item_category[items]]
        + _LIKE_GENDER_PRICE * gender_sign * teacher.item_log_price_z[items]
        + _LIKE_LATENT * latent / np.sqrt(LATENT_DIM)
    )


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function, clipped so exp never overflows."""
    return 1.0 / (1.0 + np.exp(-np.clip(x, -30.0, 30.0)))


def _gather_lists(values: np.ndarray, offsets: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gather per-id CSR lists for each row into one CSR (values, offsets) without a loop."""
    starts = offsets[ids]
    lengths = offsets[ids + 1] - starts
    row_offsets = np.concatenate([[0], np.cumsum(lengths)])
    shift = np.repeat(starts - row_offsets[:-1], lengths)
    return values[np.arange(row_offsets[-1]) + shift], row_offsets


def _list_array(values: np.ndarray, offsets: np.ndarray) -> pa.ListArray:
    """Build a list<int64> column from CSR arrays."""
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values.astype(np.int64)))


# --------------------------------------------------------------------------- files


def _write_atomic(table: pa.Table, path: Path, row_group_size: int) -> None:
    """Write via a temp file and rename so readers never see a partial part."""
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp, row_group_size=row_group_size)
    os.replace(tmp, path)


def _remove_stale_parts(split_dir: Path, written: list[Path]) -> None:
    """Delete parts from an earlier call with more files, which would otherwise be read too."""
    keep = {p.name for p in written}
    for stale in split_dir.glob("part-*.parquet"):
        if stale.name not in keep:
            stale.unlink()


# --------------------------------------------------------------------------- drifting days

FIRST_DAY = datetime.date(2026, 1, 1)
FIRST_SECOND = int(datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC).timestamp())
"""`request_time` of the first row (Unix seconds, FIRST_DAY's midnight UTC): write_synthetic's
rows come one a second from it, write_days' spread over their day."""
_BORN_FIRST_DAY = 0.7  # share of users and items that exist on the first day; all exist on the last


def write_days(
    out_dir: str | os.PathLike,
    *,
    days: int,
    drift: float,
    rows: int = 20_000,
    files: int = 2,
    row_group_size: int = 8_192,
    seed: int = 0,
    num_users: int = NUM_USERS,
    num_items: int = NUM_ITEMS,
) -> dict:
    """Write `days` partitions ``date=YYYY-MM-DD/`` of `rows` rows each (module docstring) and
    return a summary; each partition's ``_SUCCESS`` is written last."""
    _validate(rows, 0.5, files, row_group_size, seed, num_users, num_items)
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ValueError(f"days must be a positive integer, got {days!r}")
    if not 0.0 <= drift <= 1.0:
        raise ValueError(f"drift must be in [0, 1], got {drift}")
    partitions, clicks = [], 0
    for day, teacher in enumerate(day_teachers(seed, days, drift, num_users, num_items)):
        folder = Path(out_dir) / f"date={FIRST_DAY + datetime.timedelta(days=day)}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "_SUCCESS").unlink(missing_ok=True)  # incomplete while it is rewritten
        written, day_clicks = [], 0
        for i in range(files):
            first, stop = rows * i // files, rows * (i + 1) // files
            # the day's rows spread over its 86,400 seconds, in file order
            times = FIRST_SECOND + day * 86_400 + np.arange(first, stop) * 86_400 // rows
            table = _chunk_table(teacher, np.random.default_rng([seed, 3, day, i]), times)
            path = folder / f"part-{i:05d}.parquet"
            _write_atomic(table, path, row_group_size)
            day_clicks += pc.sum(table["click"]).as_py() or 0
            written.append(path)
        _remove_stale_parts(folder, written)
        (folder / "_SUCCESS").write_text(json.dumps({"rows": rows, "ctr": day_clicks / rows}))
        partitions.append(folder.name)
        clicks += day_clicks
    return {"partitions": partitions, "rows": rows * days, "drift": drift, "ctr": clicks / (rows * days)}


def day_teachers(seed: int, days: int, drift: float, num_users: int = NUM_USERS,
                 num_items: int = NUM_ITEMS) -> list[_Teacher]:
    """The teacher of every day of `write_days` (module docstring)."""
    base = _build_teacher(seed, num_users, num_items)
    rng = np.random.default_rng([seed, 2])
    user_birth = rng.permutation(num_users) + 1
    # one item of every category is born first: draws within a category always find one
    cats = base.item_category[1:]
    first = np.array([1 + np.flatnonzero(cats == c)[0] for c in np.unique(cats)])
    rest = rng.permutation(np.setdiff1d(np.arange(1, num_items + 1), first))
    item_birth = np.concatenate([first, rest])
    teachers, teacher = [], base
    for day in range(days):
        if day:
            teacher = _drifted(teacher, np.random.default_rng([seed, 2, day]), drift)
        born = _BORN_FIRST_DAY + (1 - _BORN_FIRST_DAY) * (day / (days - 1) if days > 1 else 1.0)
        teachers.append(_born(teacher, user_birth[:round(born * num_users)], item_birth[:round(born * num_items)]))
    return teachers


def _drifted(teacher: _Teacher, rng: np.random.Generator, drift: float) -> _Teacher:
    """The next day's teacher: a share `drift` of users' and items' vectors and biases drawn
    anew, the hour x device cross moved by `drift`, that share of popularity ranks swapped."""
    def moved(values: np.ndarray, scale: float) -> np.ndarray:
        out = values.copy()
        rows = np.flatnonzero(rng.random(len(values) - 1) < drift) + 1  # row 0 is padding
        out[rows] = rng.normal(0.0, scale, (len(rows), *values.shape[1:]))
        return out
    ranks = teacher.item_rank_ids.copy()
    swapped = np.flatnonzero(rng.random(len(ranks)) < drift)
    ranks[swapped] = ranks[rng.permutation(swapped)]
    fresh = _double_centred(rng.normal(size=teacher.hour_device.shape))
    return replace(teacher, user_vec=moved(teacher.user_vec, 1.0), user_bias=moved(teacher.user_bias, 0.4),
                   item_vec=moved(teacher.item_vec, 1.0), item_bias=moved(teacher.item_bias, 0.4),
                   item_rank_ids=ranks, hour_device=(1 - drift) * teacher.hour_device + drift * fresh)


def _born(teacher: _Teacher, users: np.ndarray, items: np.ndarray) -> _Teacher:
    """`teacher` drawing only the users and items born so far, by their popularity ranks."""
    user_ranks = teacher.user_rank_ids[np.isin(teacher.user_rank_ids, users)]
    item_ranks = teacher.item_rank_ids[np.isin(teacher.item_rank_ids, items)]
    item_cdf = _zipf_cdf(len(item_ranks))
    keys, cat_items = _category_index(teacher.item_category, item_ranks, item_cdf)
    return replace(teacher, user_rank_ids=user_ranks, user_cdf=_zipf_cdf(len(user_ranks)), item_rank_ids=item_ranks,
                   item_cdf=item_cdf, category_keys=keys, category_items=cat_items)


def _zipf_cdf(n: int) -> np.ndarray:
    """The cdf of rank^-ZIPF_EXPONENT over n ranks, as `_zipf` draws them."""
    cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -ZIPF_EXPONENT)
    cdf /= cdf[-1]
    cdf[-1] = 1.0
    return cdf


def teacher_click_logit(teacher: _Teacher, table: pa.Table) -> np.ndarray:
    """`teacher`'s noise-free click logit of the rows of `table` (SCHEMA's columns)."""
    users, items = table["user_id"].to_numpy(), table["item_id"].to_numpy()
    hist = table["hist_items"].combine_chunks()
    hist_frac = _history_match(teacher, items, hist.values.to_numpy(), hist.offsets.to_numpy())
    return _click_logit(teacher, users, items, table["hour"].to_numpy(), table["device"].to_numpy(), hist_frac)
