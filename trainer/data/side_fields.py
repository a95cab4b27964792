"""Side fields at the data boundary (`features.<name>.side_of`): a list column with one value per
behaviour of its sequence (a past rating's stars, its genre), aligned with the sequence's ids.

A row whose side list is not as long as its sequence's is an error naming the file, row and both
columns: a value of one behaviour read as another's would pass every other check. The reader
drops a side field's values where it drops its sequence's behaviours (after the request time,
trainer/data/timestamps.py) and `max_len`, the sequence's, keeps the same newest ones.
docs/data.md, "Sequences".
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embeddings.features import FeatureSpec
from trainer.data.ids import _one_array


def list_lengths(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """Each row's list length [rows] int64, a null list 0."""
    return pc.fill_null(pc.list_value_length(_one_array(column)), 0).to_numpy().astype(np.int64)


def check_aligned(table: pa.Table, features: list[FeatureSpec], where: str) -> None:
    """ValueError naming the file, row and columns for a side field whose list at some row is not
    as long as its sequence's there."""
    by_name = {f.name: f for f in features}
    for side in features:
        if not side.side_of:
            continue
        seq = by_name[side.side_of]
        n_side, n_seq = list_lengths(table.column(side.column)), list_lengths(table.column(seq.column))
        if not np.array_equal(n_side, n_seq):
            row = int(np.flatnonzero(n_side != n_seq)[0])
            raise ValueError(f"{where}, column {side.column!r}: row {row} has {n_side[row]} values for "
                             f"{n_seq[row]} ids in column {seq.column!r} (features.{side.name}.side_of="
                             f"{seq.name!r}: one value per behaviour)")


def without(column: pa.ChunkedArray | pa.Array, dropped: np.ndarray, kept: np.ndarray) -> pa.Array:
    """List `column` without the values flagged `dropped` (flat, [sum of its lengths]), its lists
    then `kept` long [rows]."""
    lists = _one_array(column)
    offsets = np.zeros(kept.size + 1, np.int64 if pa.types.is_large_list(lists.type) else np.int32)
    np.cumsum(kept, out=offsets[1:])
    values = pc.list_flatten(lists).filter(pa.array(~dropped))
    cls = pa.LargeListArray if pa.types.is_large_list(lists.type) else pa.ListArray
    return cls.from_arrays(pa.array(offsets), values)
