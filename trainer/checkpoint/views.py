"""Saving and loading table shards without DCP's whole copies of them (docs/design.md §2.10).

FBGEMM keeps all the tables of a rank's fused kernel, and their optimizer state, in a few flat
buffers; each table shard in the state dict is a view of one of them (as is each tensor of an
async save's staged copy, which keeps storages shared). `torch.save` of a view writes its whole
storage, so DCP's FileSystemWriter clones every tensor whose storage is larger than itself
before writing it: a transient copy of the largest shard, on top of everything the rank holds.

`ViewSavePlanner` hands the writer each contiguous CPU view as a tensor over a slice of its
storage, holding exactly its bytes and sharing them (`own_bytes`): the writer then sees nothing
to clone, and the files hold the same bytes.

A load, in DCP's FileSystemReader, reads each saved tensor whole (`torch.load`), then narrows it
to the rows the rank needs and copies them into place: a transient copy of the largest saved
shard, larger than the rank's own when the checkpoint came from fewer ranks. `read_rows` reads
a saved tensor's pickle alone (on the meta device: no storage is read), then the bytes of the
rows needed, straight into the target (a target off the CPU, a GPU's, through a buffer of
LOAD_CHUNK_BYTES). It serves what row-wise and table-wise shards need, a range of the first dimension of a
contiguous tensor; anything else (a column-wise narrow, a transformed item) goes DCP's way.
"""

from __future__ import annotations

import io
import math
import sys
from typing import IO

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, LoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, WriteItem

LOAD_CHUNK_BYTES = 64 << 20
"""A load into a tensor off the CPU reads its rows through a host buffer of at most this size."""


def own_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, a contiguous CPU view of a larger storage, as a tensor whose storage is a slice
    of that storage holding its bytes alone (shared, not copied); any other tensor as it is."""
    storage = tensor.untyped_storage()
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or storage.nbytes() == tensor.nbytes:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    return torch.empty(0, dtype=tensor.dtype).set_(storage[start:start + tensor.nbytes], 0, tensor.shape,
                                                   tensor.stride())


class ViewSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, whose tensors reach the writer as `own_bytes` gives them."""

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        return own_bytes(data) if isinstance(data, torch.Tensor) else data


def read_rows(item: IO[bytes], length: int, req: ReadItem, planner: LoadPlanner) -> bool:
    """Read the rows `req` asks of the saved tensor in `item` (a view of its `length` bytes in the
    storage file) straight into its target, and commit it; False, having read no data, where the
    item is not a little-endian contiguous tensor narrowed along its first dimension alone."""
    if req.type != LoadItemType.TENSOR or sys.byteorder != "little":
        return False
    item.seek(0)
    saved = torch.load(item, map_location="meta", weights_only=True)  # the pickle alone: shape, dtype, record
    # torch.load's offset of the storage's record in the item (torch/serialization.py, meta map_location)
    record = getattr(saved.untyped_storage(), "_checkpoint_offset", None) if isinstance(saved, torch.Tensor) else None
    target = planner.resolve_tensor(req).detach()
    offsets, lengths = list(req.storage_offsets), list(req.lengths)
    if (record is None or saved.dim() == 0 or not saved.is_contiguous() or saved.dtype != target.dtype
            or list(target.shape) != lengths or offsets[0] + lengths[0] > saved.shape[0]
            or any(o != 0 or n != full for o, n, full in zip(offsets[1:], lengths[1:], saved.shape[1:]))):
        return False
    row = math.prod(saved.shape[1:]) * saved.element_size()
    start = record + saved.storage_offset() * saved.element_size() + offsets[0] * row
    nbytes = lengths[0] * row
    storage_end = record + saved.untyped_storage().nbytes()
    if storage_end > length or start + nbytes > storage_end:
        return False  # DCP's own read reports what is wrong with the item
    item.seek(start)
    if target.device.type == "cpu" and target.is_contiguous():
        _read_into(item, target, req)
    else:
        step = max(1, LOAD_CHUNK_BYTES // max(row, 1))
        buffer = torch.empty((min(step, lengths[0]), *target.shape[1:]), dtype=target.dtype)
        for first in range(0, lengths[0], step):
            part = buffer[:min(step, lengths[0] - first)]
            _read_into(item, part, req)
            target[first:first + len(part)].copy_(part)
    planner.commit_tensor(req, target)
    return True


def _read_into(item: IO[bytes], into: torch.Tensor, req: ReadItem) -> None:
    """Fill the contiguous CPU tensor `into` with the next bytes of `item`."""
    if not into.numel():
        return
    buffer = memoryview(into.reshape(-1).view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(buffer):
        got = item.readinto(buffer[done:])
        if not got:
            raise ValueError(f"storage item {req.storage_index.fqn!r} ends before its rows")
        done += got
