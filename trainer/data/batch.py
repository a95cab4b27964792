"""The unit a training step consumes, movable to a device as TorchRec pipelines expect."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torchrec import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from trainer.data.ids import bag_positions
from trainer.data.requests import holders


@dataclass
class Batch(Pipelineable):
    """One batch of B rows.

    sparse: KeyedJaggedTensor, one key per id feature, B bags each.
    dense:  [B, F] float32 transformed numeric features (F may be 0).
    labels: [B, K] float32, one column per task.
    users:  [B] int64 user ids for UAUC (zeros when the dataset has no user column).
    weights: [B] float32, 0 for rows that only pad a rank's last evaluation batch.
    managed_ids: KeyedJaggedTensor of the features with managed tables (hashing = "managed"),
            or None: a second argument, so that TorchRec's pipeline can send each collection its own.
    sequence_ids: KeyedJaggedTensor of the features on attended sequences' unmanaged tables (looked
            up unpooled, embeddings/tables.py `build_sequence_tables`), or None.
    managed_sequence_ids: the same of attended sequences' managed tables (embeddings/managed.py
            `build_managed_sequences`), or None.
    sequence_max: per key of `sequence_ids`, then of `managed_sequence_ids`, its longest bag in this
            batch, a Python int computed by the reader on the host: sequences pad to it without
            reading the device.
    sequence_gaps: per attended sequence with timestamps (schema order), [N_f] int64 time-gap
            buckets aligned with its ids in `sequence_ids` or `managed_sequence_ids`
            (trainer/data/timestamps.py).
    request_holders: with data.request_column, [R] int64: the row that holds each of the batch's R
            requests' shared sequences (their other rows' lists are empty; trainer/data/requests.py),
            or None.
    request_index: [B] int64, each row's request in 0..R-1, or None.
    """

    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    users: torch.Tensor
    weights: torch.Tensor
    managed_ids: KeyedJaggedTensor | None = None
    sequence_ids: KeyedJaggedTensor | None = None
    sequence_max: tuple[int, ...] = ()
    sequence_gaps: tuple[torch.Tensor, ...] = ()
    managed_sequence_ids: KeyedJaggedTensor | None = None
    request_holders: torch.Tensor | None = None
    request_index: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            sparse=self.sparse.to(device=device, non_blocking=non_blocking),
            dense=self.dense.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            users=self.users.to(device=device, non_blocking=non_blocking),
            weights=self.weights.to(device=device, non_blocking=non_blocking),
            managed_ids=None if self.managed_ids is None else self.managed_ids.to(device=device,
                                                                                  non_blocking=non_blocking),
            sequence_ids=None if self.sequence_ids is None else self.sequence_ids.to(device=device,
                                                                                    non_blocking=non_blocking),
            sequence_max=self.sequence_max,
            sequence_gaps=tuple(g.to(device=device, non_blocking=non_blocking) for g in self.sequence_gaps),
            managed_sequence_ids=None if self.managed_sequence_ids is None else self.managed_sequence_ids.to(
                device=device, non_blocking=non_blocking),
            request_holders=None if self.request_holders is None else self.request_holders.to(
                device=device, non_blocking=non_blocking),
            request_index=None if self.request_index is None else self.request_index.to(
                device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.sparse.record_stream(stream)
        for kjt in (self.managed_ids, self.sequence_ids, self.managed_sequence_ids):
            if kjt is not None:
                kjt.record_stream(stream)
        for t in (self.dense, self.labels, self.users, self.weights, *self.sequence_gaps):
            t.record_stream(stream)
        for t in (self.request_holders, self.request_index):
            if t is not None:
                t.record_stream(stream)

    def pin_memory(self) -> Batch:
        return Batch(self.sparse.pin_memory(), self.dense.pin_memory(), self.labels.pin_memory(),
                     self.users.pin_memory(), self.weights.pin_memory(),
                     None if self.managed_ids is None else self.managed_ids.pin_memory(),
                     None if self.sequence_ids is None else self.sequence_ids.pin_memory(), self.sequence_max,
                     tuple(g.pin_memory() for g in self.sequence_gaps),
                     None if self.managed_sequence_ids is None else self.managed_sequence_ids.pin_memory(),
                     *(None if t is None else t.pin_memory() for t in (self.request_holders, self.request_index)))


@dataclass
class Rows:
    """Encoded rows, column-wise in numpy, from which batches are cut.

    A window of rows is encoded once; a batch is then a slice (views, no copy) and
    `to_batch` makes the one copy a batch needs. Sparse feature `s` holds row `i`'s ids
    in `values[s][offsets[s][i]:offsets[s][i + 1]]`; a slice keeps the full `values`
    array and a view of `offsets`, so offsets are absolute, not rebased to 0. A feature
    with exactly one id per row (most `id` features) has `offsets[s]` None and then
    `values[s]` is sliced like the other columns: no offsets to compute or gather.

    keys:    sparse feature names (the KeyedJaggedTensor keys); the last `num_managed` of them
             have managed tables of bags and go into the batch's `managed_ids`, the
             `num_managed_sequence` before those are on attended sequences' managed tables and go
             into its `managed_sequence_ids`, the `num_sequence` before those are on attended
             sequences' other tables and go into its `sequence_ids`; after all of them `num_gaps`
             columns of time-gap buckets (`sequence_gaps`), jagged like their ids.
    offsets: S arrays of N + 1 int64, or None for one id per row.
    values:  S arrays of int64 ids.
    dense:   [N, F] float32.   labels: [N, K] float32.   users: [N] int64, or None.
    requests: [N] int64 request numbers (data.request_column, trainer/data/requests.py), or None.
    shared:  the sparse keys (indices) a request's rows share: a batch looks them up for its first row only.
    """

    keys: list[str]
    offsets: list[np.ndarray | None]
    values: list[np.ndarray]
    dense: np.ndarray
    labels: np.ndarray
    users: np.ndarray | None
    num_managed: int = 0
    num_sequence: int = 0
    num_gaps: int = 0
    num_managed_sequence: int = 0
    requests: np.ndarray | None = None
    shared: tuple[int, ...] = ()

    @classmethod
    def build(cls, keys: list[str], values: list[np.ndarray], lengths: list[np.ndarray | None],
              dense: np.ndarray, labels: np.ndarray, users: np.ndarray | None, num_managed: int = 0,
              num_sequence: int = 0, num_gaps: int = 0, num_managed_sequence: int = 0) -> Rows:
        """Rows from per-feature ids and bag sizes (None: one id per row)."""
        return cls(keys, [None if n is None else _offsets(n) for n in lengths], list(values), dense, labels, users,
                   num_managed, num_sequence, num_gaps, num_managed_sequence)

    def counts(self) -> tuple[int, int, int, int]:
        """(num_managed, num_sequence, num_gaps, num_managed_sequence), which every copy keeps."""
        return self.num_managed, self.num_sequence, self.num_gaps, self.num_managed_sequence

    @property
    def num_rows(self) -> int:
        return self.labels.shape[0]

    def slice(self, start: int, stop: int | None = None) -> Rows:
        """Rows start..stop-1 as views of this object's arrays."""
        stop = self.num_rows if stop is None else min(stop, self.num_rows)
        start = min(start, stop)
        values = [v[start:stop] if o is None else v for v, o in zip(self.values, self.offsets)]
        offsets = [None if o is None else o[start:stop + 1] for o in self.offsets]
        return Rows(self.keys, offsets, values, self.dense[start:stop], self.labels[start:stop],
                    None if self.users is None else self.users[start:stop], *self.counts(),
                    None if self.requests is None else self.requests[start:stop], self.shared)

    def take(self, index: np.ndarray) -> Rows:
        """Rows `index` (any order, repeats allowed), copied."""
        index = np.asarray(index, np.int64)
        values, offsets = [], []
        for v, o in zip(self.values, self.offsets):
            if o is None:
                values.append(v[index])
                offsets.append(None)
            else:
                flat, lengths = bag_positions(o, index)
                values.append(v[flat])
                offsets.append(_offsets(lengths))
        return Rows(self.keys, offsets, values, self.dense[index], self.labels[index],
                    None if self.users is None else self.users[index], *self.counts(),
                    None if self.requests is None else self.requests[index], self.shared)

    @staticmethod
    def concat(parts: list[Rows]) -> Rows:
        """`parts` one after the other (the part itself when there is only one)."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        values, offsets = [], []
        for s in range(len(first.keys)):
            values.append(np.concatenate([p.own_values(s) for p in parts]))
            jagged = any(p.offsets[s] is not None for p in parts)
            offsets.append(_concat_offsets([p.offsets[s] for p in parts], [p.num_rows for p in parts])
                           if jagged else None)
        return Rows(first.keys, offsets, values, np.concatenate([p.dense for p in parts]),
                    np.concatenate([p.labels for p in parts]),
                    None if first.users is None else np.concatenate([p.users for p in parts]), *first.counts(),
                    None if first.requests is None else np.concatenate([p.requests for p in parts]), first.shared)

    def own_values(self, s: int) -> np.ndarray:
        """The ids of sparse feature `s` in these rows (a view)."""
        o = self.offsets[s]
        return self.values[s] if o is None else self.values[s][o[0]:o[-1]]

    def to_batch(self, weights: np.ndarray | None = None) -> Batch:
        """A Batch owning its memory (copies: a batch must not keep a whole window alive)."""
        return assemble([Part(self)], weights)


@dataclass(frozen=True)
class Part:
    """Rows `index` of `rows` (any order, repeats allowed), or all of them in order when
    `index` is None: a share of a batch, picked without copying. A shuffled window is one
    part, its permutation the index, so that a batch gathers its rows straight from the window."""

    rows: Rows
    index: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows if self.index is None else len(self.index)

    def slice(self, start: int, stop: int | None = None) -> Part:
        """Rows start..stop-1 of this part (views)."""
        if self.index is None:
            return Part(self.rows.slice(start, stop))
        return Part(self.rows, self.index[start:stop])

    def as_rows(self) -> Rows:
        """These rows as one Rows (a copy where an index picks them)."""
        return self.rows if self.index is None else self.rows.take(self.index)

    def pick(self, column: np.ndarray) -> np.ndarray:
        """This part's rows of one of its rows' per-row columns: a view where no index picks
        them, else gathered (a copy)."""
        return column if self.index is None else column[self.index]

    def ids(self, s: int, lengths: np.ndarray) -> np.ndarray:
        """The ids of sparse feature `s`, bag after bag (a view where they lie in one run, else
        gathered); its bag sizes into `lengths` (left as they are, ones, for one id per row)."""
        rows = self.rows
        o, values = rows.offsets[s], rows.values[s]
        if o is None:
            return self.pick(values)
        if self.index is None:
            np.subtract(o[1:], o[:-1], out=lengths)
            return values[o[0]:o[-1]]
        flat, lengths[...] = bag_positions(o, self.index)
        return values[flat]

    def held_ids(self, s: int, lengths: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """`ids` of the rows `keep` [rows] (bool) alone, every other row's bag left empty: a shared
        sequence gathered at its requests' holder rows only (data.request_column), not at every row."""
        o, values = self.rows.offsets[s], self.rows.values[s]
        assert o is not None, "a shared feature is a list column"
        flat, lengths[keep] = bag_positions(o, np.flatnonzero(keep) if self.index is None else self.index[keep])
        lengths[~keep] = 0
        return values[flat]


def assemble(parts: list[Part], weights: np.ndarray | None = None) -> Batch:
    """The rows of `parts`, one after the other, as a Batch owning its memory: every column is
    copied, or gathered, from the parts' rows once (a batch gathered from one part is not copied again)."""
    first = parts[0].rows
    n = sum(p.num_rows for p in parts)
    holding = None
    if first.requests is not None:
        is_holder, holder_rows, index = holders(np.concatenate([p.pick(p.rows.requests) for p in parts]))
        holding = (is_holder, set(first.shared))
    gaps = len(first.keys) - first.num_gaps
    managed = gaps - first.num_managed
    managed_sequence = managed - first.num_managed_sequence
    plain = managed_sequence - first.num_sequence
    unpooled, sequence_max = [], ()
    for features in (range(plain, managed_sequence), range(managed_sequence, managed)):
        kjt, lengths = _jagged(parts, features, holding) if len(features) else (None, None)
        unpooled.append(kjt)
        if kjt is not None:
            sequence_max += tuple(int(m) for m in lengths.max(axis=1)) if n else (0,) * len(features)
    return Batch(
        sparse=_jagged(parts, range(plain), holding)[0],
        managed_ids=_jagged(parts, range(managed, gaps), holding)[0] if first.num_managed else None,
        sequence_ids=unpooled[0], managed_sequence_ids=unpooled[1], sequence_max=sequence_max,
        sequence_gaps=tuple(_jagged(parts, range(s, s + 1), holding)[0].values()
                            for s in range(gaps, len(first.keys))),
        dense=_column(parts, lambda r: r.dense) if first.dense.shape[1] else torch.zeros(n, 0),
        labels=_column(parts, lambda r: r.labels) if first.labels.shape[1] else torch.zeros(n, 0),
        users=_column(parts, lambda r: r.users) if first.users is not None else torch.zeros(n, dtype=torch.int64),
        weights=torch.from_numpy(weights) if weights is not None else torch.ones(n),
        request_holders=None if holding is None else torch.from_numpy(holder_rows),
        request_index=None if holding is None else torch.from_numpy(index),
    )


def _column(parts: list[Part], column: Callable[[Rows], np.ndarray]) -> torch.Tensor:
    """One per-row column of `parts`' rows, one after the other, in memory of its own."""
    return torch.from_numpy(_owned([p.pick(column(p.rows)) for p in parts], parts))


def _owned(pieces: list[np.ndarray], parts: list[Part]) -> np.ndarray:
    """`pieces` (from `Part.pick` or `Part.ids` of `parts`) one after the other in an array of
    their own: the one gathered piece as it is, else a copy of them all."""
    if len(pieces) == 1 and parts[0].index is not None:
        return pieces[0]
    return np.concatenate(pieces)


def _jagged(parts: list[Part], features: range,
            holding: tuple[np.ndarray, set[int]] | None = None) -> tuple[KeyedJaggedTensor, np.ndarray]:
    """Sparse features `features` of `parts`' rows as one KeyedJaggedTensor (copies), and its
    lengths as [features, rows]. `holding`: (is_holder [rows], the shared features): a shared
    feature's lists are kept at the holder rows only, the others' left empty."""
    bounds = list(itertools.accumulate((p.num_rows for p in parts), initial=0))  # each part's first row
    lengths = np.ones((len(features), bounds[-1]), np.int64)
    ids = []  # feature after feature, part after part: the order of the values
    # The ids per key, counted here on the host: TorchRec would read them back from the device
    # (a host sync) to split the batch in the sharded tables' input dist. They are the sizes
    # of the feature's pieces of ids, not a sum over its lengths (a pass over the batch).
    per_key = []
    for row, s in zip(lengths, features):
        if holding is not None and s in holding[1]:
            pieces = [p.held_ids(s, row[start:stop], holding[0][start:stop])
                      for p, start, stop in zip(parts, bounds, bounds[1:])]
        else:
            pieces = [p.ids(s, row[start:stop]) for p, start, stop in zip(parts, bounds, bounds[1:])]
        ids += pieces
        per_key.append(sum(map(len, pieces)))
    # gathered ids are copied once more here, into one array: a second pass to size the values
    # first would cost more Python per batch than copying them
    values = np.concatenate(ids, dtype=np.int64) if ids else np.zeros(0, np.int64)
    return KeyedJaggedTensor(keys=[parts[0].rows.keys[s] for s in features], values=torch.from_numpy(values),
                             lengths=torch.from_numpy(lengths.reshape(-1)), length_per_key=per_key,
                             offset_per_key=[0, *itertools.accumulate(per_key)]), lengths


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _concat_offsets(offsets: list[np.ndarray | None], rows: list[int]) -> np.ndarray:
    """Offsets of bags laid end to end (None: one id per row)."""
    out = np.empty(sum(rows) + 1, np.int64)
    row = base = 0
    for o, n in zip(offsets, rows):
        if o is None:
            out[row:row + n] = np.arange(base, base + n)
            base += n
        else:
            out[row:row + n] = o[:-1] - (o[0] - base)
            base += int(o[-1] - o[0])
        row += n
    out[row] = base
    return out
