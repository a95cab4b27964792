"""Id validation and hashing at the data boundary.

FBGEMM clamps an out-of-range id silently (DESIGN.md 4), so every id is checked or
hashed here, before it can reach a kernel, and a bad one is reported with its location.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainer.config import FeatureSpec


def encode_ids(column: pa.ChunkedArray | pa.Array, spec: FeatureSpec, where: str) -> pa.ListArray:
    """One id column (scalar or list) -> list<int64> of valid table rows.

    A null scalar or null list is an empty bag; `id_list` / `sequence` keep their last
    `max_len` ids (the most recent, by the sequence convention). `where` prefixes errors.
    """
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
        flat = pc.list_flatten(arr)
    else:
        lengths = (~np.asarray(arr.is_null())).astype(np.int64)
        flat = arr.drop_null()
    if flat.null_count:
        row = _row_of(np.flatnonzero(np.asarray(flat.is_null()))[0], lengths)
        raise ValueError(f"{where}, column {spec.column!r}: null id inside the list at row {row}")
    values = _hash(flat.to_numpy(zero_copy_only=False), lengths, spec, where)
    if spec.max_len and spec.kind != "id":
        values, lengths = _keep_last(values, lengths, spec.max_len)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int64()))


def _hash(values: np.ndarray, lengths: np.ndarray, spec: FeatureSpec, where: str) -> np.ndarray:
    """Valid int64 rows; computed in the column's own integer type, so that uint64
    hashes above 2^63 are reduced rather than wrapped to negative numbers."""
    negative = np.flatnonzero(values < 0)
    if negative.size:
        i = negative[0]
        raise ValueError(f"{where}, column {spec.column!r}: negative id {values[i]} "
                         f"at row {_row_of(i, lengths)}")
    if spec.hashing == "modulo":
        return (values % values.dtype.type(spec.num_embeddings)).astype(np.int64)
    too_big = np.flatnonzero(values >= spec.num_embeddings)
    if too_big.size:
        i = too_big[0]
        raise ValueError(f"{where}, column {spec.column!r}: id {values[i]} at row "
                         f"{_row_of(i, lengths)} is out of range for num_embeddings="
                         f"{spec.num_embeddings} (features.{spec.name}.hashing is 'none')")
    return values.astype(np.int64, copy=False)


def _keep_last(values: np.ndarray, lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(lengths)
    kept = np.minimum(lengths, max_len)
    out_starts = np.cumsum(kept) - kept
    index = np.arange(kept.sum()) - np.repeat(out_starts - (ends - kept), kept)
    return values[index], kept


def _row_of(flat_index: int, lengths: np.ndarray) -> int:
    """Row holding the `flat_index`-th value of a ragged column."""
    return int(np.searchsorted(np.cumsum(lengths), flat_index, side="right"))
