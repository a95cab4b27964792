"""Raw Parquet columns -> validated model inputs (`Rows`), one row group at a time.

Validation happens per row group, before rows are shuffled together, so that every error
can name the file, the column and the row group it came from.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec, shared_sequences, unpooled_features
from trainer.data.batch import Rows
from trainer.data.feature_ops import TRANSFORMS
from trainer.data.ids import encode_ids
from trainer.data.requests import RequestKeys, request_columns
from trainer.data.side_fields import HardSearch, check_aligned
from trainer.data.timestamps import TimeGaps


class RowEncoder:
    """Checks schemas, encodes row groups and assembles batches for one feature schema."""

    def __init__(self, features: list[FeatureSpec], tasks: list[TaskSpec], user_column: str = "",
                 time_column: str = "", time_buckets: int = 32, request_column: str = ""):
        # Attended sequences' tables' features (unmanaged, then managed), then the managed bags'
        # features last: the batch carries each kind in a KeyedJaggedTensor of its own.
        sparse = [f for f in features if f.kind != "numeric"]
        unpooled = unpooled_features(features)
        on_unpooled = {f.name for f in unpooled}
        managed = [f for f in sparse if f.hashing == "managed" and f.name not in on_unpooled]
        self.sparse = ([f for f in sparse if f.hashing != "managed" and f.name not in on_unpooled]
                       + unpooled + managed)
        self.num_managed_sequence = sum(f.hashing == "managed" for f in unpooled)
        self.num_sequence = len(unpooled) - self.num_managed_sequence
        self.num_managed = len(managed)
        self.gaps = TimeGaps(features, time_column, time_buckets)  # model.sequence.time_buckets
        self.search = HardSearch(features)
        self.numeric = [f for f in features if f.kind == "numeric"]
        self.tasks = tasks
        self.user_column = user_column
        # a request's rows share their sequences, side fields and those sequences' time gaps
        shared = shared_sequences(features)
        timed = {f.name for f in self.gaps.features}
        self.requests = RequestKeys(request_column, [(f.name, f.column) for f in shared] + [
            (f"{f.name}@gaps", f.timestamps) for f in shared if f.name in timed])

    def order_pooled(self, names: list[str]) -> None:
        """Write the pooled features (a batch's `sparse` keys) in the order of `names`, where they
        are the same features: the sharded tables' input order, so that TorchRec's input dist does
        not permute every batch (embeddings/torchrec_compat.py `input_feature_order`)."""
        pooled = len(self.sparse) - self.num_sequence - self.num_managed_sequence - self.num_managed
        by_name = {f.name: f for f in self.sparse[:pooled]}
        if sorted(by_name) == sorted(names):
            self.sparse[:pooled] = [by_name[name] for name in names]

    @property
    def columns(self) -> list[str]:
        """Source columns read from each file, without duplicates."""
        cols = [f.column for f in self.sparse + self.numeric] + [t.label for t in self.tasks] + self.gaps.columns
        if self.user_column:
            cols.append(self.user_column)
        cols += request_columns(self.requests.column)
        return list(dict.fromkeys(cols))

    def check_schema(self, schema: pa.Schema, path: str) -> None:
        """Raise ValueError naming the file and column for a missing column or a wrong type."""
        for col, need, check in self._expected_types():
            if col not in schema.names:
                raise ValueError(f"{path}: missing column {col!r} ({need})")
            typ = schema.field(col).type
            if not check(typ):
                raise ValueError(f"{path}: column {col!r} has type {typ}, expected {need}")

    def _expected_types(self):
        for f in self.sparse:
            if f.kind == "id":
                yield f.column, f"integer ids for feature {f.name!r}", pa.types.is_integer
            else:
                yield f.column, f"a list of integer ids for feature {f.name!r}", _is_int_list
        for f in self.numeric:
            yield f.column, f"numbers for feature {f.name!r}", _is_number
        for t in self.tasks:
            yield t.label, f"0/1 labels for task {t.name!r}", lambda typ: _is_number(typ) or pa.types.is_boolean(typ)
        if self.user_column:
            yield self.user_column, "integer user ids (data.user_column)", pa.types.is_integer
        yield from self.gaps.expected_types()
        yield from self.requests.expected_types()

    def encode(self, table: pa.Table, where: str) -> Rows:
        """Validated rows: ids and bag sizes per sparse feature, float32 numeric features
        and labels, int64 users (uint64 ones by their bit pattern); computed a whole column at a time."""
        # First the side fields' alignment, the hard searches' matches, then the timed sequences'
        # behaviours after their request time, so that ids, side fields and gaps leave out the same
        # ones before max_len keeps the last (trainer/data/side_fields.py, timestamps.py).
        check_aligned(table, self.sparse, where)
        lists, gaps = self.gaps.encode(table, where, self.search.apply(table, where))
        ids, lengths = [], []
        for f in self.sparse:
            v, n = encode_ids(lists.get(f.name, table.column(f.column)), f, where)
            ids.append(v)
            lengths.append(n)
        rows = table.num_rows
        dense = _columns([_numeric(table.column(f.column), f, where) for f in self.numeric], rows)
        labels = _columns([_labels(table.column(t.label), t, where) for t in self.tasks], rows)
        users = None
        if self.user_column:
            column = table.column(self.user_column)
            if column.null_count:
                raise ValueError(f"{where}, column {self.user_column!r}: null user id")
            # User ids only group rows for UAUC: a uint64 one past int64 keeps its bit
            # pattern, which keeps ids distinct (a cast would overflow).
            users = column.to_numpy().astype(np.int64, copy=False)
        keys = [f.name for f in self.sparse]
        timed = [keys.index(f.name) for f in self.gaps.features]
        keys += [f"{f.name}@gaps" for f in self.gaps.features]
        encoded = Rows.build(keys, ids + gaps, lengths + [lengths[i] for i in timed], dense, labels, users,
                             num_managed=self.num_managed, num_sequence=self.num_sequence, num_gaps=len(gaps),
                             num_managed_sequence=self.num_managed_sequence)
        encoded.requests = self.requests.number(table, where, keys, encoded.offsets, encoded.values)
        encoded.shared = tuple(keys.index(key) for key, _ in self.requests.shared)
        return encoded


def _columns(columns: list[np.ndarray], rows: int) -> np.ndarray:
    """[rows, len(columns)] float32, row-major so that a slice of rows is contiguous."""
    return np.stack(columns, axis=1) if columns else np.zeros((rows, 0), np.float32)


def _is_int_list(typ: pa.DataType) -> bool:
    return (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_integer(typ.value_type)


def _is_number(typ: pa.DataType) -> bool:
    return pa.types.is_integer(typ) or pa.types.is_floating(typ)


def raw_numeric(column: pa.ChunkedArray, f: FeatureSpec, where: str) -> np.ndarray:
    """A numeric column as float64 with NaN for its nulls, checked: a null needs
    features.<name>.fill_null, every other value must be finite. A float64 column without
    nulls comes back as a read-only view of its Arrow buffer."""
    values = column.to_numpy().astype(np.float64, copy=False)  # nulls arrive as NaN
    if column.null_count:
        nulls = np.asarray(column.is_null())
        if f.fill_null is None:
            raise ValueError(f"{where}, column {f.column!r}: null value at row {np.flatnonzero(nulls)[0]} "
                             f"(set features.{f.name}.fill_null to replace nulls)")
        finite = np.isfinite(values) | nulls
    else:
        finite = np.isfinite(values)
    if not finite.all():  # the rows are only looked for when there is an error
        bad = np.flatnonzero(~finite)[0]
        raise ValueError(f"{where}, column {f.column!r}: non-finite value {values[bad]} at row {bad}")
    return values


def _numeric(column: pa.ChunkedArray, f: FeatureSpec, where: str) -> np.ndarray:
    values = raw_numeric(column, f, where)
    if column.null_count:  # raw_numeric refused every other NaN: a NaN is a null here
        values = np.where(np.isnan(values), f.fill_null, values)
    for op in f.transform:
        transform = TRANSFORMS[op]
        if transform.valid is not None:
            valid = transform.valid(values)
            if not valid.all():
                outside = np.flatnonzero(~valid)[0]
                raise ValueError(f"{where}, column {f.column!r}: {op} needs {transform.needs}, "
                                 f"got {values[outside]} at row {outside}")
        values = transform.numpy(values, f)
    # A value finite in float64 may not be in float32 (1e39): the model would see inf. The
    # cast's overflow warning is the check below, as an error naming the row.
    with np.errstate(over="ignore"):
        out = values.astype(np.float32)
    finite = np.isfinite(out)
    if not finite.all():
        bad = np.flatnonzero(~finite)[0]
        after = f" (after {', '.join(f.transform)})" if f.transform else ""
        raise ValueError(f"{where}, column {f.column!r}: {values[bad]:g} at row {bad} is beyond "
                         f"float32's range{after}")
    return out


def _labels(column: pa.ChunkedArray, t: TaskSpec, where: str) -> np.ndarray:
    if column.null_count:
        row = int(np.flatnonzero(np.asarray(column.is_null()))[0])
        raise ValueError(f"{where}, column {t.label!r}: null label at row {row}")
    values = column.to_numpy().astype(np.float32)
    binary = (values == 0) | (values == 1)
    if not binary.all():
        bad = np.flatnonzero(~binary)[0]
        raise ValueError(f"{where}, column {t.label!r}: label must be 0 or 1, "
                         f"got {values[bad]} at row {bad}")
    return values
