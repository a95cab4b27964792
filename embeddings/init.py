"""Embedding initialisation that does not depend on the sharding plan or world size.

DMP initialises each shard with the random state of the rank that owns it, so the same
seed gives different tables under different plans. Here every row block is drawn from a
generator seeded by (seed, table, block), and each rank fills only the rows and columns
of its own shards: one model, whatever the plan, and no rank ever builds a whole table.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from embeddings.sharding import local_shards


BLOCK_ROWS = 16_384


def init_embeddings(model: nn.Module, seed: int) -> None:
    """Refill every local embedding shard of the sharded `model` deterministically:
    uniform(-1/sqrt(num_embeddings), 1/sqrt(num_embeddings)), TorchRec's default range."""
    for key, value in model.state_dict().items():
        table = _table_of(key)
        if table is None:
            continue
        shape = tuple(value.size())
        for shard, (row0, col0) in local_shards(value):
            n, m = shard.shape
            shard.copy_(_rows(seed, table, shape, row0, n)[:, col0:col0 + m])


def _table_of(key: str) -> str | None:
    """'<path>.embedding_bags.<table>.weight' -> table."""
    head, sep, tail = key.rpartition(".embedding_bags.")
    if sep and tail.endswith(".weight") and "." not in tail[:-len(".weight")]:
        return tail[:-len(".weight")]
    return None


def _rows(seed: int, table: str, shape: tuple[int, int], start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of the table's full-width initial values."""
    num_embeddings, dim = shape
    bound = 1 / math.sqrt(num_embeddings)
    first, last = start // BLOCK_ROWS, (start + count - 1) // BLOCK_ROWS
    blocks = []
    for block in range(first, last + 1):
        g = torch.Generator().manual_seed(((seed * 1_000_003 + zlib.crc32(table.encode())) * 1_000_003 + block)
                                          % 2**63)
        n = min(BLOCK_ROWS, num_embeddings - block * BLOCK_ROWS)
        blocks.append(torch.rand(n, dim, generator=g) * 2 * bound - bound)
    offset = start - first * BLOCK_ROWS
    return torch.cat(blocks)[offset:offset + count]
