"""Managed-collision tables (`hashing = "managed"`): TorchRec's MCH behind every such
table (pooled ones in a ManagedCollisionEmbeddingBagCollection, those of attended sequences
in a ManagedCollisionEmbeddingCollection), sharded row-wise, evictions that reset the freed
rows' optimizer state, and the per-table figures the logs report (miss rate, occupancy, rows
evicted). What reaches into TorchRec (the counting MCH module, the resetting sharders) is in
`embeddings/torchrec_compat.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig
from torchrec.distributed import sharding_plan as sp
from torchrec.modules.mc_embedding_modules import (
    BaseManagedCollisionEmbeddingCollection,
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, LRU_EvictionPolicy, ManagedCollisionCollection

from embeddings.features import MANAGED_ID_RANGE, FeatureSpec
from embeddings.hooks import HookProvider, TrainingHooks
from embeddings.sparse_config import EmbeddingsConfig
from embeddings.tables import FUSED, build_sequence_tables, fuse_optimizer, tables_of
from embeddings.torchrec_compat import (
    FREE_SLOT,
    MC_SEQUENCE_WEIGHTS,
    MC_WEIGHTS,
    MCH_BUFFERS,
    MCH_ROWS,
    MCH_SEGMENTS,
    MCH_SORTED_IDS,
    CountingMCH,
    ManagedSequenceTablesSharder,
    ManagedTablesSharder,
    mc_table_configs,
)

SEQUENCE_WEIGHTS = "sequence_tables.embeddings."  # the attended sequences' tables (embeddings/tables.py)
EVICTION_POLICIES = {"lfu": DistanceLFU_EvictionPolicy, "lru": LRU_EvictionPolicy}  # features.*.eviction_policy
# RankingModel's managed collections: (attribute, path of their weights inside, sharder type)
MANAGED_COLLECTIONS = (("managed_tables", MC_WEIGHTS, ManagedTablesSharder),
                       ("managed_sequence_tables", MC_SEQUENCE_WEIGHTS, ManagedSequenceTablesSharder))


def build_managed_bags(features: list[FeatureSpec], cfg: EmbeddingsConfig,
                       buckets: int) -> ManagedCollisionEmbeddingBagCollection | None:
    """The managed tables (hashing = "managed") of bags, each behind TorchRec's managed-collision
    module (MCH: a sorted raw-id -> row map with eviction), or None when there are none.
    `buckets` is the world size: MCH splits its id range into that many parts, one per rank."""
    tables = tables_of(features, cfg, managed=True)
    if not tables:
        return None
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    fuse_optimizer(ebc, cfg)
    return ManagedCollisionEmbeddingBagCollection(ebc, _managed_collisions(features, tables, buckets),
                                                  return_remapped_features=False)


def build_managed_sequences(features: list[FeatureSpec], cfg: EmbeddingsConfig,
                            buckets: int) -> ManagedCollisionEmbeddingCollection | None:
    """The managed tables of attended sequences, looked up unpooled (one vector per id) behind
    their MCH modules as `build_managed_bags`' are, with every feature that names them: the
    candidate and the sequence share one table and so one remapping. None when there are none."""
    ec = build_sequence_tables(features, cfg, managed=True)  # fused, on the meta device
    if ec is None:
        return None
    return ManagedCollisionEmbeddingCollection(ec, _managed_collisions(features, ec.embedding_configs(), buckets),
                                               return_remapped_features=False)


def _managed_collisions(features: list[FeatureSpec], tables: list[EmbeddingBagConfig | EmbeddingConfig],
                        buckets: int) -> ManagedCollisionCollection:
    """A `TrackedMCH` per table of `tables` (zch size = its rows, ids in [0, MANAGED_ID_RANGE)
    split into `buckets` parts), after checking that each rank's part has rows enough."""
    spec = {f.table: f for f in features if f.hashing == "managed"}
    for t in tables:
        parts = row_wise_rows(t.num_embeddings, buckets)
        if min(parts) < 2:
            raise ValueError(f"features.{spec[t.name].name}.num_embeddings={t.num_embeddings} is too few rows for a "
                             f"managed table on {buckets} ranks: row-wise, its parts have {parts} rows, and each "
                             "needs 2 at least (a miss row, and a row for ids); 2 x the world size is enough")
    modules = {t.name: TrackedMCH(
        zch_size=t.num_embeddings, device=torch.device("meta"),
        eviction_policy=EVICTION_POLICIES[spec[t.name].eviction_policy](),
        eviction_interval=spec[t.name].eviction_interval,
        input_hash_size=MANAGED_ID_RANGE, buckets=buckets, name=t.name) for t in tables}
    return ManagedCollisionCollection(modules, tables)


def row_wise_rows(rows: int, ranks: int) -> list[int]:
    """Each rank's rows of a table TorchRec shards row-wise: blocks of ceil(rows / ranks)."""
    block = -(-rows // ranks)
    return [max(0, min(block, rows - rank * block)) for rank in range(ranks)]


class TrackedMCH(CountingMCH, HookProvider):
    """TorchRec's MCH module with its lookups, miss-row lookups and evictions counted
    (`CountingMCH`), logged as metrics; each shard keeps its own counts, summed over ranks
    when logged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._logged = torch.zeros(2, 3, dtype=torch.int64)  # counts at the last log of each kind

    def register_hooks(self, hooks: TrainingHooks) -> None:
        hooks.metrics.append(self.log_values)

    def log_values(self, kind: str) -> dict[str, float]:
        """`managed/<table>.miss_rate` of the lookups since the last log of this kind (`train`
        steps, or `eval` batches: an evaluation's, or what `rankmix score` scored), `.evicted`
        since the last training log (for an evaluation: since this process began), `.occupancy` now:
        each a sum over ranks (collective)."""
        occupied = self.occupied().reshape(1)
        totals = torch.cat([self.counts.flatten(), occupied,
                            torch.tensor([self.output_size() - 1], device=occupied.device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
        totals = totals.cpu()
        counts, (occupied, rows) = totals[:6].view(2, 3), totals[6:]
        row = 0 if kind == "train" else 1
        since = counts[row] - self._logged[row]
        self._logged[row] = counts[row]
        evicted = since[2] if kind == "train" else counts[0, 2]
        table = self.table_name
        return {f"managed/{table}.miss_rate": float(since[1] / max(int(since[0]), 1)),
                f"managed/{table}.evicted": float(evicted),
                f"managed/{table}.occupancy": float(occupied / rows)}


def managed_modules(model: nn.Module) -> list[tuple[str, BaseManagedCollisionEmbeddingCollection]]:
    """The managed-collision collections in `model` (of bags, and of attended sequences' tables) by path."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, BaseManagedCollisionEmbeddingCollection)]


def managed_sharders() -> list:
    """A sharder for each kind of managed-collision collection (DMP picks each module's by its type)."""
    return [sharder() for _, _, sharder in MANAGED_COLLECTIONS]


def managed_plans(model: nn.Module, device: torch.device, local: int, world: int) -> dict:
    """Row-wise plans of the managed tables on `world` ranks, `local` per host: MCH splits its id
    range across ranks, and TorchRec shards it row-wise only."""
    sharders = {s.module_type: s for s in managed_sharders()}
    return {path: sp.construct_module_sharding_plan(
        mc, per_param_sharding={t.name: sp.row_wise(compute_kernel=FUSED) for t in mc_table_configs(mc)},
        sharder=sharders[type(mc)], local_size=local, world_size=world, device_type=device.type)
        for path, mc in managed_modules(model)}


def served_tables(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """A RankingModel's whole-tensor state (`manager.model_tensors`) -> (the same state with
    the managed tables' and the attended sequences' tables' weights (managed or not) beside the
    plain ones, under `ebc.embedding_bags.` (a served model has one bag collection); each managed
    table's id map, of bags or of an attended sequence alike). An id map is what MCH's evaluation
    remap reads, whatever the world size that trained it:

        keys      [M] int64  the mapped (spread) ids, ascending
        rows      [M] int64  their rows in the whole table
        miss_rows [W] int64  the miss row of each rank's range, W the ranks that trained it
    """
    weights = [SEQUENCE_WEIGHTS] + [path + "." + inside for path, inside, _ in MANAGED_COLLECTIONS]
    buffers = tuple(path + "." + MCH_BUFFERS for path, _, _ in MANAGED_COLLECTIONS)

    def served_name(key: str) -> str:
        for prefix in weights:
            if key.startswith(prefix):
                return "ebc.embedding_bags." + key[len(prefix):]
        return key
    plain = {served_name(k): v for k, v in state.items() if not k.startswith(buffers)}
    mch = {}  # table -> the prefix of its MCH buffers
    for key in state:
        for prefix in buffers:
            if key.startswith(prefix):
                mch[key[len(prefix):].split(".")[0]] = prefix
    maps = {}
    for table, prefix in sorted(mch.items()):
        ids, rows = state[f"{prefix}{table}.{MCH_SORTED_IDS}"], state[f"{prefix}{table}.{MCH_ROWS}"]
        segments = state[f"{prefix}{table}.{MCH_SEGMENTS}"]  # [0, end of rank 0's rows, ...], then -1s
        segments = segments[segments >= 0]
        held = ids != FREE_SLOT
        order = torch.argsort(ids[held])  # each rank's part is sorted, and the parts' id ranges ascend
        maps[table] = (ids[held][order], rows[held][order], segments[1:] - 1)
    return plain, maps
