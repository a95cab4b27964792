"""`data.split = time`: one log cut in time, as a model is used: trained on the past, judged on
the future (docs/training.md, "Splits in time").

The rows of the training and test inputs (data.train_path and data.eval_path, or a built-in
dataset's two folders) are one log. `data.split_at` cuts it by `data.time_column`: a share of
the rows (0 < split_at < 1: the cut is the first time at or above that quantile, so rows of one
time stay on one side, the test side) or a time itself (split_at >= 1, in the column's
unit). Rows before the cut train, rows at or after it are the test split. With
`data.valid_fraction`, the validation split is the last share of the training rows in the same
way: the time just before the test split, not every row group's tail, which in a log sorted by
time would be slices of every period.

The three splits are written once, as Parquet, into `data.cache_dir/time-split-<key>/` (the key
digests the inputs' bytes, the column and both cuts), and a run reads them as it reads any
files. Each input file gives at most one file to each split, row group by row group (memory:
one row group, and the time column of every row: 8 bytes a row).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trainer.config import DataConfig
from trainer.data.identity import file_digest
from trainer.data.store import Store, reason, resolve
from trainer.data.timestamps import request_times
from trainer.offline.time_cut import time_cut

SPLITS = ("train", "valid", "test")
VERSION = "v1"  # of the files written: bump when they change, or runs read an older split from the cache


def cache_key(inputs: list[str], data: DataConfig) -> str:
    """What decides the split's files: the inputs' bytes (their digests, in order), the column, the cuts."""
    text = json.dumps([VERSION, inputs, data.time_column, data.split_at, data.valid_fraction])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def input_digests(spec: str, data: DataConfig) -> list[str]:
    """The digest of every file of `spec` (comma-separated paths, as data.train_path), in listing order."""
    store, infos = resolve(spec, data.retry_seconds, data.retry_attempts)
    return [file_digest(store.fs, info) for info in infos]


def write_time_split(out: Path, spec: str, data: DataConfig) -> dict:
    """The rows of `spec` cut as the module docstring says, into out/{train,valid,test}/; returns
    the summary kept beside them: the cuts and each split's rows."""
    store, infos = resolve(spec, data.retry_seconds, data.retry_attempts)
    times = [_times(store, info.path, data.time_column) for info in infos]
    every = np.concatenate(times)
    if data.split_at < 1:  # a share: time_cut refuses a cut that empties a side
        cut = time_cut(every, data.split_at, f"data.split_at={data.split_at:g}")
    else:
        cut = int(data.split_at)
        if not (every.size and every.min() < cut <= every.max()):
            span = f"{data.time_column} from {every.min()} to {every.max()}" if every.size else "no rows"
            raise ValueError(f"data.split_at={data.split_at:g} leaves a split empty: of {every.size} rows, "
                             f"{int((every < cut).sum())} are before it ({span})")
    before = every[every < cut]
    valid_cut = time_cut(before, 1 - data.valid_fraction, f"data.valid_fraction={data.valid_fraction:g}") \
        if data.valid_fraction else cut
    rows = dict.fromkeys(SPLITS, 0)
    for i, (info, t) in enumerate(zip(infos, times)):
        side = np.searchsorted([valid_cut, cut], t, side="right")  # 0 train, 1 valid, 2 test
        for split, n in _write_file(store, info.path, side, out, f"part-{i:05d}.parquet").items():
            rows[split] += n
    return {"time_column": data.time_column, "cut": cut, "valid_cut": valid_cut if data.valid_fraction else None,
            "rows": rows, "inputs": [info.path for info in infos]}


def _times(store: Store, path: str, column: str) -> np.ndarray:
    """The request times of one file [rows], checked as the reader checks them."""
    try:
        with store.fs.open_input_file(path) as f:
            parquet = pq.ParquetFile(f)
            if column not in parquet.schema_arrow.names:
                raise ValueError(f"{path}: no column {column!r} (data.time_column) to split by time")
            values = parquet.read(columns=[column]).column(column)
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{path}: cannot read column {column!r}: {reason(e)}") from None
    if not pa.types.is_integer(values.type):
        raise ValueError(f"{path}, column {column!r}: request times must be integers (seconds), got {values.type}")
    return request_times(values, path, column)


def _write_file(store: Store, path: str, side: np.ndarray, out: Path, name: str) -> dict[str, int]:
    """The rows of `path` to the split `side` [rows] gives each, row group by row group."""
    writers: dict[str, pq.ParquetWriter] = {}
    rows = dict.fromkeys(SPLITS, 0)
    start = 0
    with store.fs.open_input_file(path) as f:
        parquet = pq.ParquetFile(f)
        for g in range(parquet.num_row_groups):
            table = parquet.read_row_group(g)
            sides = side[start:start + table.num_rows]
            start += table.num_rows
            for code, split in enumerate(SPLITS):
                mask = sides == code
                if not mask.any():
                    continue
                if split not in writers:
                    (out / split).mkdir(parents=True, exist_ok=True)
                    writers[split] = pq.ParquetWriter(out / split / name, parquet.schema_arrow)
                writers[split].write_table(pc.filter(table, pa.array(mask)))
                rows[split] += int(mask.sum())
    for writer in writers.values():
        writer.close()
    return rows
