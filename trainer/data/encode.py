"""Raw Parquet columns -> validated model inputs, one row group at a time.

Validation happens per row group, before rows are shuffled together, so that every error
can name the file, the column and the row group it came from.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torchrec import KeyedJaggedTensor

from embeddings.ids import encode_ids
from trainer.config import FeatureSpec, TaskSpec
from trainer.data.batch import Batch

USER = "__user__"
WEIGHT = "__weight__"


class RowEncoder:
    """Checks schemas, encodes row groups and assembles batches for one feature schema."""

    def __init__(self, features: list[FeatureSpec], tasks: list[TaskSpec], user_column: str = ""):
        self.sparse = [f for f in features if f.kind != "numeric"]
        self.numeric = [f for f in features if f.kind == "numeric"]
        self.tasks = tasks
        self.user_column = user_column

    @property
    def columns(self) -> list[str]:
        """Source columns read from each file, without duplicates."""
        cols = [f.column for f in self.sparse + self.numeric] + [t.label for t in self.tasks]
        if self.user_column:
            cols.append(self.user_column)
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

    def encode(self, table: pa.Table, where: str) -> pa.Table:
        """Validated columns: list<int64> per id feature, float32 per numeric and label."""
        cols: dict[str, pa.Array] = {}
        for f in self.sparse:
            cols[f.name] = encode_ids(table.column(f.column), f, where)
        for f in self.numeric:
            cols[f.name] = pa.array(_numeric(table.column(f.column), f, where))
        for t in self.tasks:
            cols[t.name] = pa.array(_labels(table.column(t.label), t, where))
        if self.user_column:
            users = table.column(self.user_column)
            if users.null_count:
                raise ValueError(f"{where}, column {self.user_column!r}: null user id")
            cols[USER] = users.combine_chunks().cast(pa.int64())
        return pa.table(cols)

    def to_batch(self, table: pa.Table, weights: np.ndarray | None = None) -> Batch:
        """Assemble a Batch from an encoded slice of B rows."""
        n = table.num_rows
        values, lengths = [], []
        for f in self.sparse:
            col = table.column(f.name).combine_chunks()
            if pa.types.is_list(col.type):
                lengths.append(pc.list_value_length(col).to_numpy())
                values.append(pc.list_flatten(col).to_numpy())
            elif col.null_count:  # one id per row; a null is an empty bag
                lengths.append((~np.asarray(col.is_null())).astype(np.int64))
                values.append(col.drop_null().to_numpy())
            else:
                lengths.append(np.ones(n, np.int64))
                values.append(col.to_numpy())
        sparse = KeyedJaggedTensor(
            keys=[f.name for f in self.sparse],
            values=torch.from_numpy(np.concatenate(values) if values else np.zeros(0, np.int64)),
            lengths=torch.from_numpy(np.concatenate(lengths).astype(np.int64) if lengths
                                     else np.zeros(0, np.int64)),
        )
        return Batch(
            sparse=sparse,
            dense=_stack(table, [f.name for f in self.numeric], n),
            labels=_stack(table, [t.name for t in self.tasks], n),
            users=torch.from_numpy(table.column(USER).to_numpy().copy()) if self.user_column
            else torch.zeros(n, dtype=torch.int64),
            weights=torch.from_numpy(weights) if weights is not None else torch.ones(n),
        )


def _stack(table: pa.Table, names: list[str], n: int) -> torch.Tensor:
    if not names:
        return torch.zeros(n, 0)
    return torch.from_numpy(np.stack([table.column(c).to_numpy() for c in names], axis=1))


def _is_int_list(typ: pa.DataType) -> bool:
    return (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_integer(typ.value_type)


def _is_number(typ: pa.DataType) -> bool:
    return pa.types.is_integer(typ) or pa.types.is_floating(typ)


def _numeric(column: pa.ChunkedArray, f: FeatureSpec, where: str) -> np.ndarray:
    values = column.to_numpy().astype(np.float64)  # nulls arrive as NaN
    nulls = np.asarray(column.is_null()) if column.null_count else np.zeros(len(values), bool)
    if nulls.any():
        if f.fill_null is None:
            raise ValueError(f"{where}, column {f.column!r}: null value at row {np.flatnonzero(nulls)[0]} "
                             f"(set features.{f.name}.fill_null to replace nulls)")
        values[nulls] = f.fill_null
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        raise ValueError(f"{where}, column {f.column!r}: non-finite value {values[bad[0]]} at row {bad[0]}")
    for op in f.transform:
        if op == "log1p":
            low = np.flatnonzero(values <= -1)
            if low.size:
                raise ValueError(f"{where}, column {f.column!r}: log1p needs values > -1, "
                                 f"got {values[low[0]]} at row {low[0]}")
            values = np.log1p(values)
        elif op == "clip":
            values = np.clip(values, f.clip_min, f.clip_max)
        elif op == "standardize":
            values = (values - f.mean) / f.std
    return values.astype(np.float32)


def _labels(column: pa.ChunkedArray, t: TaskSpec, where: str) -> np.ndarray:
    if column.null_count:
        row = int(np.flatnonzero(np.asarray(column.is_null()))[0])
        raise ValueError(f"{where}, column {t.label!r}: null label at row {row}")
    values = column.to_numpy().astype(np.float32)
    bad = np.flatnonzero((values != 0) & (values != 1))
    if bad.size:
        raise ValueError(f"{where}, column {t.label!r}: label must be 0 or 1, "
                         f"got {values[bad[0]]} at row {bad[0]}")
    return values
