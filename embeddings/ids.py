"""Id validation and hashing at the data boundary.

FBGEMM clamps an out-of-range id silently (DESIGN.md 4), so every id is checked or
hashed here, before it can reach a kernel, and a bad one is reported with its location.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainer.config import FeatureSpec


def encode_ids(column: pa.ChunkedArray | pa.Array, spec: FeatureSpec, where: str) -> pa.Array:
    """One id column -> valid table rows: an int64 column for `id` features (one id per
    row, kept flat because that is cheap; a null stays null and is an empty bag) and
    list<int64> for `id_list` / `sequence`, which keep their last `max_len` ids (the most
    recent, by the sequence convention; a null list is an empty bag). `where` prefixes errors.
    """
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        nulls = np.asarray(arr.is_null()) if arr.null_count else None
        values = pc.fill_null(arr, 0).to_numpy(zero_copy_only=False) if arr.null_count else \
            arr.to_numpy(zero_copy_only=False)
        return pa.array(_hash(values, np.ones(len(values), np.int64), spec, where), type=pa.int64(), mask=nulls)
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
    flat = pc.list_flatten(arr)
    if flat.null_count:
        row = _row_of(np.flatnonzero(np.asarray(flat.is_null()))[0], lengths)
        raise ValueError(f"{where}, column {spec.column!r}: null id inside the list at row {row}")
    values = _hash(flat.to_numpy(zero_copy_only=False), lengths, spec, where)
    if spec.max_len:
        values, lengths = _keep_last(values, lengths, spec.max_len)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int64()))


def _hash(values: np.ndarray, lengths: np.ndarray, spec: FeatureSpec, where: str) -> np.ndarray:
    """Valid int64 rows; computed in the column's own integer type, so that uint64
    hashes above 2^63 are reduced rather than wrapped to negative numbers."""
    if values.dtype.kind == "i" and values.size and values.min() < 0:
        i = np.flatnonzero(values < 0)[0]
        raise ValueError(f"{where}, column {spec.column!r}: negative id {values[i]} "
                         f"at row {_row_of(i, lengths)}")
    if spec.hashing == "modulo":
        return (values % values.dtype.type(spec.num_embeddings)).astype(np.int64)
    if values.size and values.max() >= spec.num_embeddings:
        i = np.flatnonzero(values >= spec.num_embeddings)[0]
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
