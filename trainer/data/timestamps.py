"""Behaviour timestamps at the data boundary: `features.<name>.timestamps`, a list column aligned
with the sequence's ids, and the row's request time `data.time_column` -> each kept behaviour's
time-gap bucket (trainer/data/feature_ops.py `gap_buckets_numpy`), which the sequence module
embeds (dense/sequence.py).

Times are checked integers: every timestamp and request time must be 0 <= t < 2^62 (`TIME_LIMIT`;
seconds, or milli-, micro- or nanoseconds since 1970, which reach 2^62 in 2116), checked in the
column's own type, so that a uint64 2^64 - 1 is named as itself rather than wrapped to -1. Within
that range a gap, request time minus timestamp, cannot overflow int64.

A list whose length differs from its ids', or whose times are not oldest first (ties allowed),
is an error naming the file, row and column. A
behaviour after its request time is dropped from its sequence (its id, its timestamp and its
side fields' values; the list is shorter, and `max_len` keeps the last of what is left) and counted (`TimeGaps.dropped`;
one warning per file names the first): kept, it would show the model what happened after the
label. docs/data.md, "Sequences".
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embeddings.features import FeatureSpec, attended, side_fields
from trainer.data.feature_ops import gap_buckets_numpy
from trainer.data.ids import _keep_last, _one_array, _row_of
from trainer.data.side_fields import list_lengths, without

TIME_LIMIT = 2 ** 62  # times are 0 <= t < TIME_LIMIT
assert 2 * TIME_LIMIT - 1 <= np.iinfo(np.int64).max  # so any gap between two of them fits int64


class TimeGaps:
    """Gap buckets of the sequences with timestamps, one row group at a time."""

    def __init__(self, features: list[FeatureSpec], time_column: str, buckets: int):
        self.features = [f for f in features if attended(f) and f.timestamps]
        self.sides = {f.name: side_fields(f, features) for f in self.features}
        self.time_column, self.buckets = time_column, buckets
        self.dropped = 0  # behaviours after their row's request time, left out of their sequence
        self._named: set[str] = set()  # files whose first dropped behaviour a warning named
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
        """The checks of `encode` alone, nothing dropped or counted (a served model's inputs:
        trainer/serving/predict.py)."""
        if self.features:
            request_times(table.column(self.time_column), where, self.time_column)
            for f in self.features:
                _timestamps(table, f, where)

    def encode(self, table: pa.Table, where: str,
               lists: dict[str, pa.Array] | None = None) -> tuple[dict[str, pa.Array], list[np.ndarray]]:
        """Per feature with timestamps: the buckets [N_f] int64 of the ids it keeps (the last
        max_len of those not after the request time), and, by feature name, its id column and its
        side fields' with those after the request time left out, where it has any (the ids to
        encode in their place). `lists`: lists to read in place of the table's, by feature name
        and "<name>@timestamps" (a hard search's, `HardSearch`); returned with the rest."""
        lists = dict(lists or {})
        if not self.features:
            return lists, []
        now = request_times(table.column(self.time_column), where, self.time_column)
        ids, out = lists, []
        for f in self.features:
            stamps, lengths = _timestamps(table, f, where, lists)
            gaps = np.repeat(now, lengths) - stamps  # within (-2^62, 2^62): both are in [0, 2^62)
            future = gaps < 0
            if future.any():
                dropped, lengths = self._drop(table, f, future, lengths, where, lists)
                ids.update(dropped)
                gaps = gaps[~future]
            if f.max_len and lengths.size and lengths.max() > f.max_len:
                gaps, _ = _keep_last(gaps, lengths, f.max_len)
            out.append(gap_buckets_numpy(gaps, self.buckets))
        return ids, out

    def _drop(self, table: pa.Table, f: FeatureSpec, future: np.ndarray, lengths: np.ndarray,
              where: str, lists: dict[str, pa.Array]) -> tuple[dict[str, pa.Array], np.ndarray]:
        """By feature name, the lists of `f` and of its side fields (checked aligned) without the
        behaviours flagged `future` (flat, [sum(lengths)]), and the lists' new lengths; counted,
        and the first of a file named once."""
        at = np.flatnonzero(future)
        rows = np.searchsorted(np.cumsum(lengths), at, side="right")  # the row of each dropped behaviour
        kept = lengths - np.bincount(rows, minlength=lengths.size)
        self.dropped += at.size
        file = where.split(", row group ")[0]  # the reader's `where`: "<path>, row group <i>[ from row <r>]"
        if file not in self._named:
            self._named.add(file)
            print(f"rankmix: warning: {where}, column {f.timestamps!r}: {at.size} behaviour(s) after the request "
                  f"time ({self.time_column!r}) dropped from their sequence, the first at row {int(rows[0])}; "
                  "counted, each file named once", file=sys.stderr, flush=True)
        return {g.name: without(lists.get(g.name, table.column(g.column)), future, kept)
                for g in [f, *self.sides[f.name]]}, kept


def _timestamps(table: pa.Table, f: FeatureSpec, where: str,
                lists: dict[str, pa.Array] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Feature `f`'s timestamps, flat int64 [sum(lengths)], and their lists' lengths [rows],
    checked: one per id, no null, each within the range; `lists` as `TimeGaps.encode`'s."""
    lists = lists or {}
    stamps = _one_array(lists.get(f"{f.name}@timestamps", table.column(f.timestamps)))
    n_stamps, n_ids = list_lengths(stamps), list_lengths(lists.get(f.name, table.column(f.column)))
    if not np.array_equal(n_stamps, n_ids):
        row = int(np.flatnonzero(n_stamps != n_ids)[0])
        raise ValueError(f"{where}, column {f.timestamps!r}: row {row} has {n_stamps[row]} timestamps for "
                         f"{n_ids[row]} ids in column {f.column!r}")
    flat = pc.list_flatten(stamps)
    if flat.null_count:
        row = _row_of(int(np.flatnonzero(np.asarray(flat.is_null()))[0]), n_stamps)
        raise ValueError(f"{where}, column {f.timestamps!r}: null timestamp inside the list at row {row}")
    values = _in_range(flat.to_numpy(zero_copy_only=False), n_stamps, where, f.timestamps, "timestamp")
    _check_order(values, n_stamps, where, f.timestamps)
    return values, n_stamps


def _check_order(stamps: np.ndarray, lengths: np.ndarray, where: str, column: str) -> None:
    """Each row's timestamps oldest first (ties allowed): max_len keeps a list's last ids, the newest
    only in that order, and the transformer's recency positions count from its end."""
    later = np.diff(stamps) < 0  # stamps[i + 1] before stamps[i]
    if not later.any():
        return
    ends = np.cumsum(lengths)[:-1] - 1  # each row's last position: a drop from there is the next row's
    later[ends[(ends >= 0) & (ends < later.size)]] = False
    if later.any():
        i = int(np.flatnonzero(later)[0])
        raise ValueError(f"{where}, column {column!r}: row {_row_of(i + 1, lengths)} is not oldest first: "
                         f"timestamp {int(stamps[i + 1])} follows {int(stamps[i])}; sort each history by "
                         "time (docs/data.md, Sequences)")


def request_times(column: pa.ChunkedArray, where: str, name: str) -> np.ndarray:
    """The request times of `column` [rows] as int64, checked: no null, each within the range."""
    if column.null_count:
        row = int(np.flatnonzero(np.asarray(column.is_null()))[0])
        raise ValueError(f"{where}, column {name!r}: null request time at row {row}")
    return _in_range(column.to_numpy(), None, where, name, "request time")


def _in_range(values: np.ndarray, lengths: np.ndarray | None, where: str, column: str, what: str) -> np.ndarray:
    """Integer `values` as int64, each checked 0 <= t < TIME_LIMIT in its own type (a uint64 past
    int64 is refused as itself, not wrapped negative); `lengths` turns a flat position into a row."""
    # One pass for the common case, as the ids' hashing does: seen as unsigned, a negative value is at
    # least 2^(bits-1), so `max < bound` rules out both ends.
    bits = 8 * values.itemsize - (values.dtype.kind == "i")  # of the type's largest value
    bound = min(TIME_LIMIT, 1 << bits)
    if values.size and int(values.view(values.dtype.str.replace("i", "u")).max()) >= bound:
        wide = values.astype(np.uint64 if values.dtype.kind == "u" else np.int64)  # lossless
        outside = (wide >= TIME_LIMIT) if values.dtype.kind == "u" else (wide < 0) | (wide >= TIME_LIMIT)
        i = int(np.flatnonzero(outside)[0])  # the fast check above found one
        raise ValueError(f"{where}, column {column!r}: {what} {int(values[i])} at row {_row_of(i, lengths)} is "
                         "outside 0 <= t < 2^62 (docs/data.md, Sequences)")
    return values.astype(np.int64, copy=False)


def _is_int_list(typ: pa.DataType) -> bool:
    return (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_integer(typ.value_type)
