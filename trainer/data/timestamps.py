"""Behaviour timestamps at the data boundary: `features.<name>.timestamps`, a list column aligned
with the sequence's ids, and the row's request time `data.time_column` -> each kept behaviour's
time-gap bucket (trainer/data/feature_ops.py `gap_buckets_numpy`), which the sequence module
embeds (dense/sequence.py).

A list whose length differs from its ids' is an error naming the file, row and column. A
timestamp after the request time is clamped to a gap of 0 and counted (`TimeGaps.clamped`;
one warning per reader names the first): logs join events from clocks that drift by seconds,
and refusing a whole file for that would lose it. docs/data.md, "Sequences".
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embeddings.features import FeatureSpec, attended
from trainer.data.feature_ops import gap_buckets_numpy
from trainer.data.ids import _keep_last, _one_array, _row_of


class TimeGaps:
    """Gap buckets of the sequences with timestamps, one row group at a time."""

    def __init__(self, features: list[FeatureSpec], time_column: str, buckets: int):
        self.features = [f for f in features if attended(f) and f.timestamps]
        self.time_column, self.buckets = time_column, buckets
        self.clamped = 0  # timestamps after their row's request time, clamped to a gap of 0
        if self.features and not time_column:
            raise ValueError(f"features.{self.features[0].name}.timestamps needs data.time_column, the column of "
                             "each row's request time")

    @property
    def columns(self) -> list[str]:
        """The timestamp columns and the request time's."""
        return [f.timestamps for f in self.features] + ([self.time_column] if self.features else [])

    def expected_types(self):
        """(column, what it must hold, type check) of each column read."""
        for f in self.features:
            yield f.timestamps, f"a list of integer timestamps for feature {f.name!r}", _is_int_list
        if self.features:
            yield self.time_column, "integer request times (data.time_column)", pa.types.is_integer

    def check(self, table: pa.Table, where: str) -> None:
        """The checks of `encode` alone (a served model's inputs: trainer/serving/predict.py)."""
        self.encode(table, where)

    def encode(self, table: pa.Table, where: str) -> list[np.ndarray]:
        """Per feature with timestamps: the buckets [N_f] int64 of the ids it keeps (the last max_len)."""
        if not self.features:
            return []
        now = _ints(table.column(self.time_column), where, self.time_column)
        out = []
        for f in self.features:
            stamps = _one_array(table.column(f.timestamps))
            ids = _one_array(table.column(f.column))
            n_stamps = pc.fill_null(pc.list_value_length(stamps), 0).to_numpy().astype(np.int64)
            n_ids = pc.fill_null(pc.list_value_length(ids), 0).to_numpy().astype(np.int64)
            if not np.array_equal(n_stamps, n_ids):
                row = int(np.flatnonzero(n_stamps != n_ids)[0])
                raise ValueError(f"{where}, column {f.timestamps!r}: row {row} has {n_stamps[row]} timestamps for "
                                 f"{n_ids[row]} ids in column {f.column!r}")
            flat = pc.list_flatten(stamps)
            if flat.null_count:
                row = _row_of(int(np.flatnonzero(np.asarray(flat.is_null()))[0]), n_stamps)
                raise ValueError(f"{where}, column {f.timestamps!r}: null timestamp inside the list at row {row}")
            gaps = np.repeat(now, n_stamps) - flat.to_numpy(zero_copy_only=False).astype(np.int64)
            future = gaps < 0
            if future.any():
                if not self.clamped:
                    row = _row_of(int(np.flatnonzero(future)[0]), n_stamps)
                    print(f"rankmix: warning: {where}, column {f.timestamps!r}: a timestamp after the request time "
                          f"({self.time_column!r}) at row {row}; such gaps are clamped to 0 and counted",
                          file=sys.stderr, flush=True)
                self.clamped += int(future.sum())
                gaps = np.maximum(gaps, 0)
            if f.max_len and n_stamps.size and n_stamps.max() > f.max_len:
                gaps, _ = _keep_last(gaps, n_stamps, f.max_len)
            out.append(gap_buckets_numpy(gaps, self.buckets))
        return out


def _ints(column: pa.ChunkedArray, where: str, name: str) -> np.ndarray:
    if column.null_count:
        row = int(np.flatnonzero(np.asarray(column.is_null()))[0])
        raise ValueError(f"{where}, column {name!r}: null request time at row {row}")
    return column.to_numpy().astype(np.int64)


def _is_int_list(typ: pa.DataType) -> bool:
    return (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_integer(typ.value_type)
