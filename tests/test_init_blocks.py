"""Embedding init block by block: the values of the former whole-shard init on every kind of
shard, with one block of host memory besides the shard instead of a second copy of it."""

import math
import os
import zlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from cli import rendezvous_port, spawn

BLOCK_ROWS = 16_384
# rows not a multiple of the block: row-wise shards at 2 ranks start and end inside blocks
TABLES = {"big": (2 * BLOCK_ROWS + 4_001, 8), "small": (5, 8)}


def reference_rows(seed: int, table: str, shape: tuple[int, int], start: int, count: int) -> torch.Tensor:
    """The former `_rows` (commit 52d25ef): every block of the rows, concatenated, then cut."""
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


def _init_worker(rank: int, world: int, port: int, plan: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    from embeddings.init import BLOCK_ROWS as block_rows
    from embeddings.init import init_embeddings
    from embeddings.sharding import local_shards, shard_model
    from embeddings.sparse_config import EmbeddingsConfig
    from embeddings.tables import fuse_optimizer

    assert block_rows == BLOCK_ROWS
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = EmbeddingsConfig(plan=plan)
    model = nn.Module()
    model.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=name, num_embeddings=rows, embedding_dim=dim,
                                                                  feature_names=[name])
                                               for name, (rows, dim) in TABLES.items()], device=torch.device("meta"))
    fuse_optimizer(model.ebc, cfg)
    sharded = shard_model(model, cfg, torch.device("cpu"))
    init_embeddings(sharded, seed=11)
    seen = []
    for key, value in sharded.state_dict().items():
        name = key.split(".")[-2]
        for shard, (row0, col0) in local_shards(value):
            n, m = shard.shape
            expected = reference_rows(11, name, TABLES[name], row0, n)[:, col0:col0 + m]
            assert torch.equal(shard, expected), (key, row0, col0)
            seen.append((name, row0, col0, n, m))
    all_seen: list = [None] * world
    dist.all_gather_object(all_seen, seen)
    if rank == 0:
        torch.save(sorted(s for shards in all_seen for s in shards), out)
    dist.destroy_process_group()


@pytest.mark.parametrize("plan", ["row_wise", "column_wise", "table_wise"])
def test_block_init_gives_the_former_values_on_every_kind_of_shard(plan, tmp_path):
    spawn(_init_worker, (2, rendezvous_port(), plan, str(tmp_path / "shards.pt")), 2)
    shards = torch.load(tmp_path / "shards.pt")
    big = TABLES["big"]
    # the shards checked on both ranks cover each table exactly once, cut as the plan says
    expected = {
        "row_wise": [("big", 0, 0, (big[0] + 1) // 2, 8), ("big", (big[0] + 1) // 2, 0, big[0] // 2, 8),
                     ("small", 0, 0, 3, 8), ("small", 3, 0, 2, 8)],
        "column_wise": [("big", 0, 0, big[0], 4), ("big", 0, 4, big[0], 4),
                        ("small", 0, 0, 5, 4), ("small", 0, 4, 5, 4)],
        "table_wise": [("big", 0, 0, big[0], 8), ("small", 0, 0, 5, 8)],
    }[plan]
    assert shards == expected


CHILD_ROWS, CHILD_DIM = 1 << 20, 64  # a 256 MB shard


def _peak_worker(rank: int, out: str) -> None:
    """Peak RSS growth of init_embeddings over one whole 256 MB table held by this process."""
    from embeddings.init import init_embeddings

    model = nn.Module()
    model.ebc = nn.Module()
    model.ebc.embedding_bags = nn.ModuleDict({"t": nn.EmbeddingBag(CHILD_ROWS, CHILD_DIM, _weight=torch.zeros(
        CHILD_ROWS, CHILD_DIM))})
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    init_embeddings(model, seed=3)
    grown = _status_kb("VmHWM") - before
    weight = model.ebc.embedding_bags["t"].weight.detach()
    assert torch.equal(weight[-3:], reference_rows(3, "t", (CHILD_ROWS, CHILD_DIM), CHILD_ROWS - 3, 3))
    torch.save(grown, out)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_init_holds_about_one_block_besides_the_shard(tmp_path):
    spawn(_peak_worker, (str(tmp_path / "grown.pt"),), 1)
    grown_mb = torch.load(tmp_path / "grown.pt") / 1024
    shard_mb = CHILD_ROWS * CHILD_DIM * 4 / 2**20
    block_mb = BLOCK_ROWS * CHILD_DIM * 4 / 2**20
    # A block and the temporaries of its uniform transform (4 MB each): 10-33 MB measured, the
    # allocator's slack varying with the machine's load; the former init held the shard twice
    # more (its blocks, then their concatenation): 512 MB.
    assert grown_mb < 16 * block_mb == shard_mb / 4, grown_mb
