"""Saving views of a larger buffer without DCP's copy of each (docs/design.md §2.10).

FBGEMM keeps all the tables of a rank's fused kernel, and their optimizer state, in a few flat
buffers; each table shard in the state dict is a view of one of them (as is each tensor of an
async save's staged copy, which keeps storages shared). `torch.save` of a view writes its whole
storage, so DCP's FileSystemWriter clones every tensor whose storage is larger than itself
before writing it: a transient copy of the largest shard, on top of everything the rank holds.

`ViewSavePlanner` hands the writer each contiguous CPU view as a tensor over a slice of its
storage, holding exactly its bytes and sharing them (`own_bytes`): the writer then sees nothing
to clone, and the files hold the same bytes.
"""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem


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
