"""The unit a training step consumes, movable to a device as TorchRec pipelines expect."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torchrec import KeyedJaggedTensor
from torchrec.streamable import Pipelineable


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
    """

    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    users: torch.Tensor
    weights: torch.Tensor
    managed_ids: KeyedJaggedTensor | None = None

    def __len__(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(
            sparse=self.sparse.to(device=device, non_blocking=non_blocking),
            dense=self.dense.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            users=self.users.to(device=device, non_blocking=non_blocking),
            weights=self.weights.to(device=device, non_blocking=non_blocking),
            managed_ids=None if self.managed_ids is None else self.managed_ids.to(device=device,
                                                                                  non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.sparse.record_stream(stream)
        if self.managed_ids is not None:
            self.managed_ids.record_stream(stream)
        for t in (self.dense, self.labels, self.users, self.weights):
            t.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(self.sparse.pin_memory(), self.dense.pin_memory(), self.labels.pin_memory(),
                     self.users.pin_memory(), self.weights.pin_memory(),
                     None if self.managed_ids is None else self.managed_ids.pin_memory())


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
             have managed tables and go into the batch's second KeyedJaggedTensor.
    offsets: S arrays of N + 1 int64, or None for one id per row.
    values:  S arrays of int64 ids.
    dense:   [N, F] float32.   labels: [N, K] float32.   users: [N] int64, or None.
    """

    keys: list[str]
    offsets: list[np.ndarray | None]
    values: list[np.ndarray]
    dense: np.ndarray
    labels: np.ndarray
    users: np.ndarray | None
    num_managed: int = 0

    @classmethod
    def build(cls, keys: list[str], values: list[np.ndarray], lengths: list[np.ndarray | None],
              dense: np.ndarray, labels: np.ndarray, users: np.ndarray | None, num_managed: int = 0) -> "Rows":
        """Rows from per-feature ids and bag sizes (None: one id per row)."""
        return cls(keys, [None if n is None else _offsets(n) for n in lengths], list(values), dense, labels, users,
                   num_managed)

    @property
    def num_rows(self) -> int:
        return self.labels.shape[0]

    def slice(self, start: int, stop: int | None = None) -> "Rows":
        """Rows start..stop-1 as views of this object's arrays."""
        stop = self.num_rows if stop is None else min(stop, self.num_rows)
        start = min(start, stop)
        values = [v[start:stop] if o is None else v for v, o in zip(self.values, self.offsets)]
        offsets = [None if o is None else o[start:stop + 1] for o in self.offsets]
        return Rows(self.keys, offsets, values, self.dense[start:stop], self.labels[start:stop],
                    None if self.users is None else self.users[start:stop], self.num_managed)

    def take(self, index: np.ndarray) -> "Rows":
        """Rows `index` (any order, repeats allowed), copied."""
        index = np.asarray(index, np.int64)
        values, offsets = [], []
        for v, o in zip(self.values, self.offsets):
            v, o = (v[index], None) if o is None else _gather(v, o, index)
            values.append(v)
            offsets.append(o)
        return Rows(self.keys, offsets, values, self.dense[index], self.labels[index],
                    None if self.users is None else self.users[index], self.num_managed)

    @staticmethod
    def concat(parts: list["Rows"]) -> "Rows":
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
                    None if first.users is None else np.concatenate([p.users for p in parts]), first.num_managed)

    def own_values(self, s: int) -> np.ndarray:
        """The ids of sparse feature `s` in these rows (a view)."""
        o = self.offsets[s]
        return self.values[s] if o is None else self.values[s][o[0]:o[-1]]

    def to_batch(self, weights: np.ndarray | None = None) -> Batch:
        """A Batch owning its memory (copies: a batch must not keep a whole window alive)."""
        n = self.num_rows
        plain = len(self.keys) - self.num_managed
        return Batch(
            sparse=self._jagged(range(plain)),
            managed_ids=self._jagged(range(plain, len(self.keys))) if self.num_managed else None,
            dense=torch.from_numpy(self.dense.copy()) if self.dense.shape[1] else torch.zeros(n, 0),
            labels=torch.from_numpy(self.labels.copy()) if self.labels.shape[1] else torch.zeros(n, 0),
            users=torch.from_numpy(self.users.copy()) if self.users is not None
            else torch.zeros(n, dtype=torch.int64),
            weights=torch.from_numpy(weights) if weights is not None else torch.ones(n),
        )

    def _jagged(self, features: range) -> KeyedJaggedTensor:
        """Sparse features `features` of these rows as one KeyedJaggedTensor (copies)."""
        n = self.num_rows
        values = np.concatenate([self.own_values(s) for s in features]) if len(features) else np.zeros(0, np.int64)
        lengths = np.ones((len(features), n), np.int64)
        for row, s in zip(lengths, features):
            if self.offsets[s] is not None:
                np.subtract(self.offsets[s][1:], self.offsets[s][:-1], out=row)
        return KeyedJaggedTensor(keys=[self.keys[s] for s in features], values=torch.from_numpy(values),
                                 lengths=torch.from_numpy(lengths.reshape(-1)))


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


def _gather(values: np.ndarray, offsets: np.ndarray, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bags `index` of one jagged feature: their ids and offsets into them. Arrow's
    list `take` does this in one pass, about twice as fast as building a flat index."""
    bags = pa.LargeListArray.from_arrays(offsets, values).take(index)  # from_arrays: zero-copy views
    return bags.values.to_numpy(), bags.offsets.to_numpy()
