"""The unit a training step consumes, movable to a device as TorchRec pipelines expect."""

from __future__ import annotations

from dataclasses import dataclass

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
    """

    sparse: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    users: torch.Tensor
    weights: torch.Tensor

    def __len__(self) -> int:
        return self.labels.shape[0]

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        return Batch(
            sparse=self.sparse.to(device=device, non_blocking=non_blocking),
            dense=self.dense.to(device=device, non_blocking=non_blocking),
            labels=self.labels.to(device=device, non_blocking=non_blocking),
            users=self.users.to(device=device, non_blocking=non_blocking),
            weights=self.weights.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.sparse.record_stream(stream)
        for t in (self.dense, self.labels, self.users, self.weights):
            t.record_stream(stream)

    def pin_memory(self) -> "Batch":
        return Batch(self.sparse.pin_memory(), self.dense.pin_memory(), self.labels.pin_memory(),
                     self.users.pin_memory(), self.weights.pin_memory())
