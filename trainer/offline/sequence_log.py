"""Synthetic logs where the order and the time of a behaviour sequence matter
(`rankmix data synth --teacher sequence|recency`, `data.synth_teacher = "sequence"|"recency"`). It is NOT real
data: every label comes from the hidden teacher below.

Columns: `user_id` (NUM_USERS), the candidate `item_id` (NUM_ITEMS) and its `item_category`
(NUM_CATEGORIES), `hist_items`, the user's last 10 to MAX_HIST items (most recent last), their
times `hist_ts` (seconds) and the row's `request_time`. Labels: `click`.

Teacher. A behaviour is `age` seconds old, log-uniform in [AGE_MIN, AGE_MAX], sorted so that
the most recent is last. A user has two interest categories and a row a session category: a
behaviour younger than SESSION is of the session's category with probability RECENT_SHARE, an
older one of an interest with probability INTEREST_SHARE, the rest of any; the candidate is of
the session, of an interest or of any category, a third each. The click logit is

    BIAS + ITEM_STD * bias[item] + MATCH * sum_m [category(h_m) == category(item)] * exp(-age_m / TAU)
         + SHARE * (share of the behaviours of the item's category - 1 / NUM_CATEGORIES)

so the click depends on the behaviours that resemble the candidate, weighted by recency (and a
little on how many resemble it, which a pooled sequence does see). A
mean of the behaviours' vectors keeps how many match, not when: the summary's `order_free_auc`
(the expected logit given the match count alone) is what a perfect reader of the pooled
sequence reaches along that line, against the teacher's own `teacher_auc`.

The `recency` teacher (`data.synth_teacher = "recency"`) writes the same columns; its label is
exactly "the candidate's own behaviour is less than a day (RECENT) old": the candidate is one
of the row's own behaviours, drawn uniformly; the behaviours are any items, and half of them
are younger than a day. Which items they are says nothing: only the time of the candidate's
own behaviour does. A scorer that finds the match but sums its vector alone, the same
whatever its age, learns little (`order_free_auc`: the chance that one of the candidate's
matches is recent, from their count alone).

Rows come in chunks of CHUNK_ROWS from generators seeded with (seed, 3, chunk): rows do not
depend on the number of files.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embeddings.features import FeatureSpec
from trainer.offline.capacity import check_split_sizes

NUM_USERS, NUM_ITEMS, NUM_CATEGORIES = 500, 300, 10
MIN_HIST, MAX_HIST = 10, 40
AGE_MIN, AGE_MAX = 1e2, 1e8  # seconds: a minute and a half to three years
TAU = 3_600.0  # an hour: the weight of a behaviour is exp(-age / TAU)
SESSION = 3 * TAU  # behaviours younger than this follow the row's session category...
RECENT_SHARE, INTEREST_SHARE = 0.7, 0.6  # ...with this probability; older ones the user's two interests
MATCH, SHARE, ITEM_STD, BIAS = 3.0, 2.0, 0.5, -1.5
RECENT = 86_400  # the recency teacher: a day, in seconds
NOW = 1_700_000_000
CHUNK_ROWS = 65_536


def sequence_features() -> list[FeatureSpec]:
    """The schema of the columns (configs/sequence.toml repeats it); the sequence pooled by default."""
    f = FeatureSpec
    return [f(name="user_id", num_embeddings=NUM_USERS + 1, embedding_dim=16, hashing="none", group="user"),
            f(name="item_id", table="item", num_embeddings=NUM_ITEMS + 1, embedding_dim=16, hashing="none",
              group="item"),
            f(name="item_category", num_embeddings=NUM_CATEGORIES + 1, embedding_dim=8, hashing="none", group="item"),
            f(name="hist_items", kind="sequence", table="item", num_embeddings=NUM_ITEMS + 1, embedding_dim=16,
              hashing="none", pooling="mean", max_len=MAX_HIST, timestamps="hist_ts", group="behaviour")]


def _teacher(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, 1])
    return {"category": np.r_[0, rng.integers(1, NUM_CATEGORIES + 1, NUM_ITEMS)],
            "bias": np.r_[0.0, rng.normal(0, 1, NUM_ITEMS)],
            "interests": rng.integers(1, NUM_CATEGORIES + 1, (NUM_USERS + 1, 2))}


def _items(teacher: dict, rng: np.random.Generator, categories: np.ndarray, picked: np.ndarray) -> np.ndarray:
    """One item per entry: of `categories` where `picked`, else any item."""
    by_category = [np.flatnonzero(teacher["category"] == c) for c in range(NUM_CATEGORIES + 1)]
    items = rng.integers(1, NUM_ITEMS + 1, len(categories))
    for c in np.unique(categories[picked]):
        where = np.flatnonzero(picked & (categories == c))
        items[where] = rng.choice(by_category[c], len(where))
    return items


def _histories(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n rows' history lengths [n], each behaviour's row [N] and its age in seconds [N], log-uniform
    in [AGE_MIN, AGE_MAX], each row's ages descending: the most recent last."""
    lengths = rng.integers(MIN_HIST, MAX_HIST + 1, n)
    owner = np.repeat(np.arange(n), lengths)
    ages = np.exp(rng.uniform(np.log(AGE_MIN), np.log(AGE_MAX), len(owner)))
    return lengths, owner, np.rint(ages[np.lexsort((-ages, owner))]).astype(np.int64)


def _rows(teacher: dict, users: np.ndarray, item: np.ndarray, lengths: np.ndarray, hist: np.ndarray,
          stamps: np.ndarray, now: np.ndarray, click: np.ndarray) -> pa.Table:
    """The log's columns (the module docstring's): the histories' items and times as lists."""
    offsets = pa.array(np.r_[0, np.cumsum(lengths)].astype(np.int32))
    return pa.table({"user_id": users, "item_id": item, "item_category": teacher["category"][item],
                     "hist_items": pa.ListArray.from_arrays(offsets, pa.array(hist)),
                     "hist_ts": pa.ListArray.from_arrays(offsets, pa.array(stamps)),
                     "request_time": now, "click": click})


def _chunk(teacher: dict, seed: int, index: int, n: int) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """Chunk `index`: (rows, teacher logit, the order-free logit: the matches counted, not weighted)."""
    rng = np.random.default_rng([seed, 3, index])
    users = rng.integers(1, NUM_USERS + 1, n)
    interest = teacher["interests"][users, rng.integers(0, 2, n)]
    session = rng.integers(1, NUM_CATEGORIES + 1, n)  # what the user browses now
    pick = rng.integers(0, 3, n)  # the candidate: of the session, of an interest, or any
    item = _items(teacher, rng, np.where(pick == 0, session, interest), pick < 2)
    lengths, owner, ages = _histories(rng, n)
    recent = ages < SESSION
    old_interest = teacher["interests"][users[owner], rng.integers(0, 2, len(owner))]
    hist = _items(teacher, rng, np.where(recent, session[owner], old_interest),
                  rng.random(len(owner)) < np.where(recent, RECENT_SHARE, INTEREST_SHARE))
    now = NOW + rng.integers(0, 86_400 * 30, n)
    match = teacher["category"][hist] == teacher["category"][item][owner]
    recency = np.bincount(owner, weights=match * np.exp(-ages / TAU), minlength=n)
    share = np.bincount(owner, weights=match, minlength=n) / lengths
    logit = BIAS + ITEM_STD * teacher["bias"][item] + MATCH * recency + SHARE * (share - 1 / NUM_CATEGORIES)
    click = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    table = _rows(teacher, users, item, lengths, hist, now[owner] - ages, now, click)
    # The expected logit given the match count alone, had the ages been drawn apart from the items.
    order_free = ITEM_STD * teacher["bias"][item] + MATCH * np.exp(-ages / TAU).mean() * share * lengths + SHARE * share
    return table, logit, order_free


def _recency_chunk(teacher: dict, seed: int, index: int, n: int) -> tuple[pa.Table, np.ndarray, np.ndarray]:
    """Chunk `index` of the recency teacher: (rows, the label itself as the teacher's logit, the
    order-free score: the chance that one of the candidate's matches is under a day old)."""
    rng = np.random.default_rng([seed, 4, index])
    users = rng.integers(1, NUM_USERS + 1, n)
    lengths, owner, ages = _histories(rng, n)
    hist = rng.integers(1, NUM_ITEMS + 1, len(owner))
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    item = hist[starts + (rng.random(n) * lengths).astype(np.int64)]  # one of the row's behaviours, uniformly
    now = NOW + rng.integers(0, 86_400 * 30, n)
    match = hist == item[owner]
    click = (np.bincount(owner, weights=match & (ages < RECENT), minlength=n) > 0).astype(np.int64)
    table = _rows(teacher, users, item, lengths, hist, now[owner] - ages, now, click)
    recent_share = np.log(RECENT / AGE_MIN) / np.log(AGE_MAX / AGE_MIN)  # of the log-uniform ages
    order_free = 1 - (1 - recent_share) ** np.bincount(owner, weights=match, minlength=n)
    return table, click.astype(np.float64), order_free


def write_sequence_log(out_dir: str | os.PathLike, *, rows: int = 200_000, valid_fraction: float = 0.1,
                       files: int = 2, row_group_size: int = 65_536, seed: int = 0, recency: bool = False) -> dict:
    """Write train/ and valid/ Parquet parts under out_dir; return a summary with the rows, the
    click rate and, on the valid split, the AUC of the teacher's logit and of the item bias plus
    the matches counted without their times (what the order-free sequence says). `recency`:
    the recency teacher's rows."""
    check_split_sizes(rows, valid_fraction, files, row_group_size)
    teacher = _teacher(seed)
    chunk = _recency_chunk if recency else _chunk
    chunks = [chunk(teacher, seed, i, min(CHUNK_ROWS, rows - i * CHUNK_ROWS)) for i in range(-(-rows // CHUNK_ROWS))]
    table = pa.concat_tables([c[0] for c in chunks])
    logit, order_free = np.concatenate([c[1] for c in chunks]), np.concatenate([c[2] for c in chunks])
    valid_rows = min(rows - 1, max(1, round(rows * valid_fraction)))
    for split, part, nfiles in (("train", table.slice(0, rows - valid_rows), files),
                                ("valid", table.slice(rows - valid_rows), max(1, files // 4))):
        folder = Path(out_dir) / split
        folder.mkdir(parents=True, exist_ok=True)
        bounds = np.linspace(0, part.num_rows, nfiles + 1).astype(np.int64)
        for i in range(nfiles):
            pq.write_table(part.slice(bounds[i], bounds[i + 1] - bounds[i]), folder / f"part-{i:05d}.parquet",
                           row_group_size=row_group_size)
    labels = table.column("click").to_numpy()[rows - valid_rows:]
    return {"train_rows": rows - valid_rows, "valid_rows": valid_rows,
            "ctr": float(table.column("click").to_numpy().mean()),
            "teacher_auc": _auc(logit[rows - valid_rows:], labels),
            "order_free_auc": _auc(order_free[rows - valid_rows:], labels)}


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    # on use: torch and torchmetrics load slowly, and datasets.py reads this module's schema only
    import torch

    # on use, as torch above
    from trainer.metrics.ranking import auc

    return auc(torch.tensor(scores), torch.tensor(labels))  # copies: the labels are a read-only Arrow view
