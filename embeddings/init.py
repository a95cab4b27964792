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
from embeddings.torchrec_compat import MC_SEQUENCE_WEIGHTS

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
            _fill(shard, seed, table, shape, row0, col0)


def _table_of(key: str) -> str | None:
    """'<path>.embedding_bags.<table>.weight' (a bag collection's) or
    'sequence_tables.embeddings.<table>.weight' (the attended sequences' collection, or inside the
    managed one) -> table: a table draws the same values in any."""
    for marker in (".embedding_bags.", "sequence_tables.embeddings.", "sequence_tables." + MC_SEQUENCE_WEIGHTS):
        head, sep, tail = key.rpartition(marker)
        if sep and tail.endswith(".weight") and "." not in tail[:-len(".weight")]:
            return tail[:-len(".weight")]
    return None


def _fill(shard: torch.Tensor, seed: int, table: str, shape: tuple[int, int], row0: int, col0: int) -> None:
    """Fill `shard`, the table's rows and columns from (row0, col0), block by block: besides the
    shard only one block is held, never a second copy of a shard of many GB."""
    n, m = shard.shape
    for block in range(row0 // BLOCK_ROWS, -(-(row0 + n) // BLOCK_ROWS)):
        first = block * BLOCK_ROWS
        lo, hi = max(row0, first), min(row0 + n, first + BLOCK_ROWS)
        shard[lo - row0:hi - row0].copy_(_block(seed, table, shape, block)[lo - first:hi - first, col0:col0 + m])


def _block(seed: int, table: str, shape: tuple[int, int], block: int) -> torch.Tensor:
    """Row block `block` of the table's full-width initial values."""
    num_embeddings, dim = shape
    bound = 1 / math.sqrt(num_embeddings)
    g = torch.Generator().manual_seed(((seed * 1_000_003 + zlib.crc32(table.encode())) * 1_000_003 + block) % 2**63)
    n = min(BLOCK_ROWS, num_embeddings - block * BLOCK_ROWS)
    return torch.rand(n, dim, generator=g) * 2 * bound - bound
