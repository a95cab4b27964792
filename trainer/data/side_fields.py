"""Side fields at the data boundary (`features.<name>.side_of`): a list column with one value per
behaviour of its sequence (a past rating's stars, its genre), aligned with the sequence's ids.

A row whose side list is not as long as its sequence's is an error naming the file, row and both
columns: a value of one behaviour read as another's would pass every other check. The reader
drops a side field's values where it drops its sequence's behaviours (after the request time,
trainer/data/timestamps.py) and `max_len`, the sequence's, keeps the same newest ones.

`HardSearch` is SIM's hard search (`features.<name>.search_field`): of a row's behaviours, only
those whose side field equals the candidate's `search_query` are kept, with their side values and
timestamps, before anything else; `max_len` then keeps the newest of them. A log may hold
thousands of behaviours a row: the search runs here, on the host, so the step looks up and
attends to at most max_len. docs/data.md, "Sequences".
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from embeddings.features import FeatureSpec, attended, side_fields
from trainer.data.ids import _one_array, _row_of


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
    offsets = pa.array(np.concatenate([[0], np.cumsum(kept)]))  # int64: from_arrays casts to the list's own type
    values = pc.list_flatten(lists).filter(pa.array(~dropped))
    return (pa.LargeListArray if pa.types.is_large_list(lists.type) else pa.ListArray).from_arrays(offsets, values)


def _bits(ids: pa.Array) -> np.ndarray:
    """Integer ids without nulls as int64, uint64 ones by their bit pattern: how a search compares
    them, so that an id past 2^63 matches itself."""
    return ids.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


class HardSearch:
    """The searched sequences' lists, one row group at a time."""

    def __init__(self, features: list[FeatureSpec]):
        by_name = {f.name: f for f in features}
        self.searched = [(f, by_name[f.search_field], by_name[f.search_query], side_fields(f, features))
                         for f in features if f.kind == "sequence" and f.search_field]

    def apply(self, table: pa.Table, where: str) -> dict[str, pa.Array]:
        """By feature name, the lists of each searched sequence and of its side fields, and by
        "<name>@timestamps" its timestamps', holding only the behaviours that match the row's query
        (a null query matches none). Side fields must be aligned (`check_aligned`)."""
        out: dict[str, pa.Array] = {}
        for f, field, query, sides in self.searched:
            lengths = list_lengths(table.column(field.column))
            values = pc.list_flatten(_one_array(table.column(field.column)))
            if values.null_count:
                row = _row_of(int(np.flatnonzero(np.asarray(values.is_null()))[0]), lengths)
                raise ValueError(f"{where}, column {field.column!r}: null id inside the list at row {row}")
            asked = _one_array(table.column(query.column))
            present = ~np.asarray(asked.is_null())
            match = (_bits(values) == np.repeat(_bits(pc.fill_null(asked, 0)), lengths)) & np.repeat(present, lengths)
            kept = np.bincount(np.repeat(np.arange(lengths.size), lengths)[match], minlength=lengths.size)
            for g in (f, *sides):
                out[g.name] = without(table.column(g.column), ~match, kept)
            if f.timestamps and attended(f):  # a pooled sequence's are not read
                out[f"{f.name}@timestamps"] = without(table.column(f.timestamps), ~match, kept)
        return out
