"""Managed-collision tables (`hashing = "managed"`): TorchRec's MCH behind every such
table, sharded row-wise, evictions that reset the freed rows' optimizer state, and the
per-table figures the logs report (miss rate, occupancy, rows evicted).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.distributed import sharding_plan as sp
from torchrec.distributed.mc_embeddingbag import (ManagedCollisionEmbeddingBagCollectionSharder,
                                                   ShardedManagedCollisionEmbeddingBagCollection)
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (DistanceLFU_EvictionPolicy, LRU_EvictionPolicy, ManagedCollisionCollection,
                                         MCHManagedCollisionModule)

from dense.hooks import HookProvider, TrainingHooks
from embeddings.tables import FUSED, fuse_optimizer, tables_of
from trainer.config import EmbeddingsConfig, FeatureSpec
from trainer.data.ids import MANAGED_ID_RANGE

EMPTY = torch.iinfo(torch.int64).max  # MCH's mark of a free slot


def build_managed_bags(features: list[FeatureSpec], cfg: EmbeddingsConfig,
                       buckets: int) -> ManagedCollisionEmbeddingBagCollection | None:
    """The managed tables (hashing = "managed"), each behind TorchRec's managed-collision
    module (MCH: a sorted raw-id -> row map with eviction), or None when there are none.
    `buckets` is the world size: MCH splits its id range into that many parts, one per rank."""
    tables = tables_of(features, cfg, managed=True)
    if not tables:
        return None
    spec = {f.table: f for f in features if f.hashing == "managed"}
    for t in tables:
        parts = row_wise_rows(t.num_embeddings, buckets)
        if min(parts) < 2:
            raise ValueError(f"features.{spec[t.name].name}.num_embeddings={t.num_embeddings} is too few rows for a "
                             f"managed table on {buckets} ranks: row-wise, its parts have {parts} rows, and each "
                             "needs 2 at least (a miss row, and a row for ids); 2 x the world size is enough")
    policies = {"lfu": DistanceLFU_EvictionPolicy, "lru": LRU_EvictionPolicy}
    modules = {t.name: TrackedMCH(
        zch_size=t.num_embeddings, device=torch.device("meta"),
        eviction_policy=policies[spec[t.name].eviction_policy](), eviction_interval=spec[t.name].eviction_interval,
        input_hash_size=MANAGED_ID_RANGE, buckets=buckets, name=t.name) for t in tables}
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    fuse_optimizer(ebc, cfg)
    return ManagedCollisionEmbeddingBagCollection(ebc, ManagedCollisionCollection(modules, tables),
                                                  return_remapped_features=False)


def row_wise_rows(rows: int, ranks: int) -> list[int]:
    """Each rank's rows of a table TorchRec shards row-wise: blocks of ceil(rows / ranks)."""
    block = -(-rows // ranks)
    return [max(0, min(block, rows - rank * block)) for rank in range(ranks)]


class TrackedMCH(MCHManagedCollisionModule, HookProvider):
    """TorchRec's MCH module that also counts the ids it looks up and those that fall on the
    miss row (ids not admitted yet), in training and in evaluation apart, and the rows it
    evicts (taken from one id for another; filling a free row is no eviction); each shard
    keeps its own counts, summed over ranks when logged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # [train | eval] x [lookups, miss-row lookups, rows evicted]
        self.register_buffer("_counts", torch.zeros(2, 3, dtype=torch.int64, device=self.device), persistent=False)
        self._logged = torch.zeros(2, 3, dtype=torch.int64)  # counts at the last log of each kind

    def profile(self, features):
        if self.training and self._current_iter == -1:  # the first training step since the module was built
            # TorchRec restarts the eviction schedule at the loaded iteration, so after a resume from
            # between evictions no later checkpoint would fall on one. Keep the schedule on multiples
            # of the interval, where an uninterrupted run evicts.
            self._current_iter = int(self._current_iter_tensor.item())
            self._last_eviction_iter = self._current_iter - self._current_iter % self._eviction_interval
        return super().profile(features)

    def remap(self, features, mutate_miss_lengths=True, write_weights=None):
        out = super().remap(features, mutate_miss_lengths, write_weights)
        counts = self._counts[0 if self.training else 1]
        miss_row = self._output_global_offset + self._zch_size - 1
        for jagged in out.values():
            counts[0] += jagged.values().numel()
            counts[1] += (jagged.values() == miss_row).sum()
        return out

    def _update_and_evict(self, *args) -> None:
        """TorchRec's admission step, counting the rows taken from other ids: of the slots it
        hands out, those that were not free."""
        assert not self._evicted, "TorchRec consumes each admission's evictions before the next admission"
        before = self._occupied()
        super()._update_and_evict(*args)
        self._counts[0, 2] += self._evicted_emb_indices.numel() - (self._occupied() - before)

    def _occupied(self) -> torch.Tensor:
        return (self._mch_sorted_raw_ids != EMPTY).sum()

    def register_hooks(self, hooks: TrainingHooks) -> None:
        hooks.metrics.append(self.log_values)

    def log_values(self, kind: str) -> dict[str, float]:
        """`managed/<table>.miss_rate` of the lookups since the last log of this kind (`train`
        steps, or `eval` batches: an evaluation's, or what `rankmix score` scored), `.evicted`
        since the last training log (for an evaluation: since this process began), `.occupancy` now:
        each a sum over ranks (collective)."""
        occupied = self._occupied().reshape(1)
        totals = torch.cat([self._counts.flatten(), occupied,
                            torch.tensor([self._zch_size - 1], device=occupied.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
        totals = totals.cpu()
        counts, (occupied, rows) = totals[:6].view(2, 3), totals[6:]
        row = 0 if kind == "train" else 1
        since = counts[row] - self._logged[row]
        self._logged[row] = counts[row]
        evicted = since[2] if kind == "train" else counts[0, 2]
        table = self._name
        return {f"managed/{table}.miss_rate": float(since[1] / max(int(since[0]), 1)),
                f"managed/{table}.evicted": float(evicted),
                f"managed/{table}.occupancy": float(occupied / rows)}


def managed_modules(model: nn.Module) -> list[tuple[str, ManagedCollisionEmbeddingBagCollection]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, ManagedCollisionEmbeddingBagCollection)]


class ResettingEvictions(ShardedManagedCollisionEmbeddingBagCollection):
    """TorchRec's sharded managed-collision tables, whose evictions reset the freed rows'
    optimizer state on every device. TorchRec's own reset (FBGEMM's reset_weight_momentum)
    has no CPU kernel, and it leaves exact Adagrad's accumulator alone: a reused row kept
    the old id's. Here the state is zeroed through the kernel's per-table views."""

    def _evict(self, evictions_per_table: dict[str, torch.Tensor | None]) -> None:
        for table, rows in evictions_per_table.items():
            if rows is None:
                continue
            rows = rows.long()
            tbe, index = self._table_to_tbe_and_index[table]
            with torch.no_grad():
                for state in tbe.split_optimizer_states()[int(index)]:
                    state[rows] = 0
                weight = self._embedding_module.embedding_bags.get_parameter(f"{table}.weight")
                init = self._embedding_module._table_name_to_config[table].init_fn
                weight.data[rows] = init(weight[rows])


class ManagedTablesSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """Shards managed-collision tables as `ResettingEvictions`."""

    def shard(self, module, params, env, device=None, module_fqn=None):
        return ResettingEvictions(module, params, ebc_sharder=self._e_sharder, mc_sharder=self._mc_sharder,
                                  env=env, device=device or torch.device("cuda"))


def managed_plans(model: nn.Module, device: torch.device, local: int, world: int) -> dict:
    """Row-wise plans of the managed tables on `world` ranks, `local` per host: MCH splits its id
    range across ranks, and TorchRec shards it row-wise only."""
    return {path: sp.construct_module_sharding_plan(
        mc, per_param_sharding={t.name: sp.row_wise(compute_kernel=FUSED)
                                for t in mc._embedding_module.embedding_bag_configs()},
        sharder=ManagedTablesSharder(), local_size=local, world_size=world, device_type=device.type)
        for path, mc in managed_modules(model)}


_MCH = "managed._managed_collision_collection._managed_collision_modules."


def served_tables(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """A RankingModel's whole-tensor state (`checkpoint.model_tensors`) -> (the same state with
    the managed tables' weights beside the plain ones, under `ebc.embedding_bags.`; each managed
    table's id map). An id map is what MCH's evaluation remap reads, whatever the world size
    that trained it:

        keys      [M] int64  the mapped (spread) ids, ascending
        rows      [M] int64  their rows in the whole table
        miss_rows [W] int64  the miss row of each rank's range, W the ranks that trained it
    """
    weights = "managed._embedding_module.embedding_bags."
    plain = {("ebc.embedding_bags." + k[len(weights):] if k.startswith(weights) else k): v
             for k, v in state.items() if not k.startswith(_MCH)}
    maps = {}
    for table in sorted({k[len(_MCH):].split(".")[0] for k in state if k.startswith(_MCH)}):
        ids, rows = state[f"{_MCH}{table}._mch_sorted_raw_ids"], state[f"{_MCH}{table}._mch_remapped_ids_mapping"]
        segments = state[f"{_MCH}{table}._output_segments_tensor"]  # [0, end of rank 0's rows, ...], then -1s
        segments = segments[segments >= 0]
        held = ids != EMPTY
        order = torch.argsort(ids[held])  # each rank's part is sorted, and the parts' id ranges ascend
        maps[table] = (ids[held][order], rows[held][order], segments[1:] - 1)
    return plain, maps
