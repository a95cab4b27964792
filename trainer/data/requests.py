"""A request's rows at the data boundary (`data.request_column`): a ranking request scores many
candidates for one user, and its rows carry the same history. The reader looks each request's
shared sequences (embeddings/features.py `shared_sequences`) up once a batch, not once a row.

Numbering (`RequestKeys.number`): each row group's rows get a number per request, unique over the
reader's life, so a request split over two row groups is two requests (each half checked on its
own). Every shared sequence, side field and time-gap list must be the same in all of a request's
rows after encoding (after the time drop and `max_len`): otherwise an error names the file, the
two rows and the column; the model reads one row's lists for all of them.

Grouping (`holders`): in a batch, each request's first row holds its sequences ("the holder"); the
other rows' shared lists are left empty, so TorchRec looks up, and sends between ranks, one
history a request, and the dense side pads and encodes it once (dense/sequence.py). The reader
shuffles requests, not rows (trainer/data/reader.py), so a request's rows stay in one batch.
"""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trainer.data.ids import _one_array, bag_positions


def request_columns(spec: str) -> list[str]:
    """The columns of data.request_column: one, or several joined by commas (a user and a request
    time, where the log names no request), whose values together name a request."""
    return [c.strip() for c in spec.split(",") if c.strip()]


def _request_type(typ: pa.DataType) -> bool:
    return pa.types.is_integer(typ) or pa.types.is_string(typ) or pa.types.is_large_string(typ)


class RequestKeys:
    """Request numbers of one reader's row groups, and the check that a request's rows agree."""

    def __init__(self, column: str, shared: list[tuple[str, str]]):
        self.column = column
        self.shared = shared  # (key in Rows, the source column it is encoded from), each checked
        self._next, self._lock = 0, threading.Lock()  # the encoder's thread and the filler's may number

    def expected_types(self):
        """(column, what it must hold, type check), as RowEncoder's."""
        for column in request_columns(self.column):
            yield column, "request ids, integers or strings (data.request_column)", _request_type

    def number(self, table: pa.Table, where: str, keys: list[str], offsets: list[np.ndarray | None],
               values: list[np.ndarray]) -> np.ndarray | None:
        """Each row's request number [rows] int64 (None without data.request_column), after checking
        that the rows of each request hold the same shared lists: sparse key `keys[s]`'s row i in
        `values[s]` by `offsets[s]` (trainer/data/batch.py `Rows`)."""
        if not self.column:
            return None
        local, first = request_rows(table, self.column, where)
        for key, column in self.shared:
            s = keys.index(key)
            check_shared(offsets[s], values[s], first, table, where, column, self.column)
        with self._lock:
            base, self._next = self._next, self._next + int(local.max(initial=-1)) + 1
        return base + local


def request_rows(table: pa.Table, spec: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(each row's request numbered from 0 [rows], its request's first row [rows]) of `table`'s
    request columns (data.request_column `spec`), which hold no null."""
    codes = []
    for column in request_columns(spec):
        ids = _one_array(table.column(column))
        if ids.null_count:
            row = int(np.flatnonzero(np.asarray(ids.is_null()))[0])
            raise ValueError(f"{where}, column {column!r}: null request id at row {row} (data.request_column)")
        codes.append(np.asarray(pc.dictionary_encode(ids).indices))  # by first appearance
    # the columns' values together: their codes' distinct tuples, in order of the first column's codes
    local = np.unique(np.stack(codes, axis=1), axis=0, return_inverse=True)[1].ravel()
    return local, np.unique(local, return_index=True)[1][local]


def check_shared(offsets: np.ndarray | None, values: np.ndarray, first: np.ndarray, table: pa.Table, where: str,
                 column: str, request_column: str) -> None:
    """ValueError naming the two rows and `column` where a row's list (`values` by `offsets`, None:
    one a row) differs from that of its request's first row `first` [rows]."""
    others = np.flatnonzero(first != np.arange(first.size))
    bad = _differing(offsets, values, others, first[others])
    if bad is not None:
        columns = request_columns(request_column)
        request = ", ".join(repr(_one_array(table.column(c))[bad].as_py()) for c in columns)
        named = f"column {columns[0]!r}" if len(columns) == 1 else f"columns {', '.join(map(repr, columns))}"
        raise ValueError(f"{where}, column {column!r}: rows {int(first[bad])} and {bad} are one request ({request} "
                         f"in {named}, data.request_column) but hold different lists: a request's rows must carry "
                         "one history")


def _differing(o: np.ndarray | None, values: np.ndarray, at: np.ndarray, holder: np.ndarray) -> int | None:
    """The first of rows `at` whose list differs from that of its row `holder`, or None."""
    if o is None:  # one id a row
        differ = values[at] != values[holder]
    else:
        ours, lengths = bag_positions(o, at)
        theirs, held = bag_positions(o, holder)
        differ = lengths != held
        if not differ.any():
            unequal = values[ours] != values[theirs]
            differ = np.bincount(np.repeat(np.arange(at.size), lengths)[unequal], minlength=at.size) > 0
    return int(at[differ.argmax()]) if differ.any() else None


def holders(requests: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch's request numbers [B] -> (is_holder [B] bool, holder rows [R] ascending, each row's
    request [B] in 0..R-1): a request's holder is its first row in the batch."""
    _, first, inverse = np.unique(requests, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    is_holder = np.zeros(requests.size, bool)
    is_holder[first] = True
    return is_holder, first[order], rank[inverse]


def keep_held(values: np.ndarray, lengths: np.ndarray, is_holder: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A list column's (values, lengths [rows]) with the lists of the holder rows (`is_holder` [rows])
    alone, every other row's left empty: a shared sequence as a batch or an artifact receives it."""
    return values[np.repeat(is_holder, lengths)], lengths * is_holder


def grouped_permutation(rng: np.random.Generator, requests: np.ndarray) -> np.ndarray:
    """A shuffle of rows that keeps each request's rows together, in their order: the requests in a
    random order, `rng`'s."""
    distinct, inverse = np.unique(requests, return_inverse=True)
    place = rng.permutation(distinct.size)[inverse]
    return np.argsort(place, kind="stable")
