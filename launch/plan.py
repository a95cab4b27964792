"""`rankmix plan`: does a config fit a cluster? Answered before anything is submitted.

TorchRec's planner shards the config's tables for `world_size` devices of the given memory,
on the meta device (no table is allocated), with the config's sharding types and fused
kernel. Per rank this reports the table bytes and the fused optimizer's state (Adagrad: one
accumulator per weight; row-wise Adagrad: one per row), TorchRec's own storage estimate
(tables, optimizer, input and output buffers), the replicated dense tower with its gradient
and RMSProp state, and the all-to-all bytes of one step.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.types import ShardingPlan

from dense.model import build_dense
from embeddings.managed import build_managed_bags, managed_plans
from embeddings.sharding import FUSED
from embeddings.tables import build_embedding_bags, table_configs
from embeddings.torchrec_compat import mch_bytes_per_slot, mch_module
from trainer.config import Config, EmbeddingsConfig
from trainer.train import per_rank_batch_size

GB = 2**30


@dataclass
class RankMemory:
    """One rank's bytes."""

    tables: int
    optimizer: int
    estimate: int  # TorchRec's storage estimate of the rank's planned shards (HBM + DDR), plus managed shards
    id_maps: int = 0  # managed tables' MCH buffers (sorted ids, rows, eviction metadata)


@dataclass
class ClusterPlan:
    """What `rankmix plan` prints (`text`), and the per-rank bytes behind it."""

    text: str
    memory: list[RankMemory]
    fits: bool


def plan_cluster(cfg: Config, world_size: int, device: str, hbm_gb: float, ddr_gb: float,
                 local_world_size: int) -> ClusterPlan:
    """The plan, per-rank memory, all-to-all traffic and the verdict."""
    if world_size < 1 or world_size % local_world_size:
        raise ValueError(f"--world-size {world_size} is not a multiple of --local-world-size {local_world_size}")
    if device == "cuda" and not hbm_gb:
        raise ValueError("--device cuda needs --hbm-gb (memory per GPU)")
    if not cfg.features:
        raise ValueError("features is empty: give the config's [[features]] schema")
    batch = per_rank_batch_size(cfg, world_size)
    plan, options = ShardingPlan({}), []
    ebc = build_embedding_bags(cfg.features, cfg.embeddings)  # meta device; None when every table is managed
    if ebc is not None:
        holder = nn.Module()
        holder.ebc = ebc
        kinds = list(cfg.embeddings.sharding_types) if cfg.embeddings.plan == "auto" else [cfg.embeddings.plan]
        constraints = {t.name: ParameterConstraints(sharding_types=kinds, compute_kernels=[FUSED])
                       for t in ebc.embedding_bag_configs()}
        try:
            with _quiet_torchrec():
                topology = Topology(world_size=world_size, compute_device=device, local_world_size=local_world_size,
                                    hbm_cap=int(hbm_gb * GB) if device == "cuda" else None, ddr_cap=int(ddr_gb * GB))
                # the callback keeps the chosen sharding options (per-shard sizes and storage), which the plan omits
                planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch, constraints=constraints,
                                                   callbacks=[_keeping(options)])
                plan = planner.plan(holder, [EmbeddingBagCollectionSharder()])
        except PlannerError as e:
            return ClusterPlan(f"fits: no (TorchRec's planner found no plan)\n{str(e).strip()}", [], False)
        for sharding in plan.plan["ebc"].values():
            # a table kept whole on one rank is table-wise, whatever label cost ties gave it
            if len(set(sharding.ranks or [])) == 1:
                sharding.sharding_type = "table_wise"
    memory = _rank_memory(options, world_size, cfg.embeddings)
    managed_text = _add_managed_tables(cfg, memory, device, local_world_size)
    layout, tower, heads = build_dense(cfg.model, cfg.features)
    dense_params = sum(p.numel() for m in (tower, heads) for p in m.parameters())
    # weights, gradients and RMSProp's square average (plus its momentum buffer when used), fp32
    dense = dense_params * 4 * (3 + (cfg.optim.momentum > 0))
    capacity = (hbm_gb if device == "cuda" else ddr_gb) * GB
    lines = [f"{world_size} x {device} ({local_world_size} per host), "
             + (f"HBM {hbm_gb:g} GB, " if device == "cuda" else "") + f"DDR {ddr_gb:g} GB each; "
             f"{batch} rows per rank and step", *(["", str(plan)] if plan.plan else []), *managed_text, "",
             f"{'rank':>4} {'tables GB':>10} {'optimizer GB':>13} {'id maps GB':>11} {'dense GB':>9} "
             f"{'estimate GB':>12} {'free GB':>8}"]
    for rank, m in enumerate(memory):
        lines.append(f"{rank:>4} {m.tables / GB:>10.3f} {m.optimizer / GB:>13.3f} {m.id_maps / GB:>11.3f} "
                     f"{dense / GB:>9.3f} {m.estimate / GB:>12.3f} {(capacity - m.estimate - dense) / GB:>8.2f}")
    pooled, ids = _all_to_all_bytes(table_configs(cfg.features), batch, world_size)
    lines += ["", f"all-to-all per rank and step: pooled embeddings {pooled / 2**20:.1f} MB forward and "
              f"{pooled / 2**20:.1f} MB backward; ids at least {ids / 2**20:.2f} MB",
              f"dense tower and heads: {dense_params:,} parameters, replicated"]
    worst = max(m.estimate for m in memory) + dense
    lines.append(f"fits: {'yes' if worst <= capacity else 'no'} (fullest rank {worst / GB:.2f} GB of "
                 f"{capacity / GB:g} GB)")
    return ClusterPlan("\n".join(lines), memory, worst <= capacity)


def _keeping(options: list) -> Callable[[list], list]:
    """A planner callback that copies the plan's sharding options into `options` and passes
    them on unchanged."""
    def keep(chosen: list) -> list:
        options.extend(chosen)
        return chosen
    return keep


def _rank_memory(options: list, world_size: int, cfg: EmbeddingsConfig) -> list[RankMemory]:
    """Bytes per rank from the planner's chosen sharding options."""
    memory = [RankMemory(0, 0, 0) for _ in range(world_size)]
    for option in options:
        for shard in option.shards:
            m = memory[shard.rank]
            tables, optimizer = _shard_bytes(*shard.size, cfg)
            m.tables, m.optimizer = m.tables + tables, m.optimizer + optimizer
            m.estimate += shard.storage.hbm + shard.storage.ddr
    return memory


def _shard_bytes(rows: int, cols: int, cfg: EmbeddingsConfig) -> tuple[int, int]:
    """(table, optimizer) bytes of a shard of rows x cols (the optimizer state is fp32)."""
    weight_bytes = {"fp32": 4, "fp16": 2}[cfg.data_type]
    return rows * cols * weight_bytes, rows * 4 * (1 if cfg.optimizer == "rowwise_adagrad" else cols)


def _add_managed_tables(cfg: Config, memory: list[RankMemory], device: str, local_world_size: int) -> list[str]:
    """Add the managed tables' shards to `memory` (TorchRec's planner does not plan them: they are
    row-wise, as training shards them, embeddings/managed.py) and return their lines of the plan.
    A shard's estimate is its weights, optimizer state and MCH map; MCH's id history (ids of
    one eviction interval, allocated at the first step) is not counted."""
    world_size = len(memory)
    collection = build_managed_bags(cfg.features, cfg.embeddings, buckets=world_size)  # meta device
    if collection is None:
        return []
    holder = nn.Module()
    holder.managed = collection
    plans = managed_plans(holder, torch.device(device), local_world_size, world_size)["managed"]
    lines = ["", "managed table | sharding type | rows per rank"]
    for table, sharding in plans.items():
        per_row = mch_bytes_per_slot(mch_module(collection, table))
        for shard in sharding.sharding_spec.shards:
            rows, cols = shard.shard_sizes
            m = memory[shard.placement.rank()]
            tables, optimizer = _shard_bytes(rows, cols, cfg.embeddings)
            m.tables, m.optimizer, m.id_maps = m.tables + tables, m.optimizer + optimizer, m.id_maps + rows * per_row
            m.estimate += tables + optimizer + rows * per_row
        sizes = [s.shard_sizes[0] for s in sharding.sharding_spec.shards]
        lines.append(f"{table} | row_wise | " + (f"{len(sizes)} x {sizes[0]:,}" if len(set(sizes)) == 1 else str(sizes)))
    return lines


def _all_to_all_bytes(tables: list, batch: int, world_size: int) -> tuple[int, int]:
    """(pooled-embedding bytes, id bytes) a rank exchanges per step: each of its rows needs every
    feature's pooled vector, of which the shards on other ranks hold (W-1)/W on balance."""
    remote = (world_size - 1) / world_size
    dims = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    id_features = sum(len(t.feature_names) for t in tables)
    return int(batch * dims * 4 * remote), int(batch * id_features * 8 * remote)


@contextlib.contextmanager
def _quiet_torchrec():
    """The planner's advice to its own developers (TopologyFactory, the storage reservation's
    dry-run caveats) is not the user's to act on; the training path silences it the same way."""
    logger = logging.getLogger("torchrec")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.setLevel(level)
