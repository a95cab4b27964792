"""TorchRec tables from the feature schema, with FBGEMM's fused Adagrad attached."""

from __future__ import annotations

import torch
from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (DistanceLFU_EvictionPolicy, LRU_EvictionPolicy, ManagedCollisionCollection,
                                         MCHManagedCollisionModule)
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from trainer.config import EmbeddingsConfig, FeatureSpec
from trainer.data.ids import MANAGED_ID_RANGE

_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
_DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16}


def table_configs(features: list[FeatureSpec]) -> list[EmbeddingBagConfig]:
    """One EmbeddingBagConfig per table; features naming the same table share its rows.

    TorchRec pools per table, so the multi-id features sharing a table must agree on
    pooling (a single id pools the same either way).
    """
    tables: dict[str, EmbeddingBagConfig] = {}
    pooled_by: dict[str, FeatureSpec] = {}
    for f in features:
        if f.kind == "numeric":
            continue
        if f.table not in tables:
            tables[f.table] = EmbeddingBagConfig(
                name=f.table, num_embeddings=f.num_embeddings, embedding_dim=f.embedding_dim,
                feature_names=[], pooling=_POOLING[f.pooling])
        table = tables[f.table]
        table.feature_names.append(f.name)
        if f.kind == "id":
            continue
        first = pooled_by.setdefault(f.table, f)
        if first.pooling != f.pooling:
            raise ValueError(f"features.{f.name}.pooling={f.pooling!r} differs from features."
                             f"{first.name}.pooling={first.pooling!r}, which shares table {f.table!r}: "
                             "TorchRec pools per table")
        table.pooling = _POOLING[f.pooling]
    return list(tables.values())


def build_embedding_bags(features: list[FeatureSpec], cfg: EmbeddingsConfig) -> EmbeddingBagCollection:
    """An EmbeddingBagCollection of the tables that are not managed, on the meta device
    (DMP materialises only local shards), its parameters marked for the fused optimizer
    that runs inside the backward pass."""
    ebc = EmbeddingBagCollection(tables=_tables(features, cfg, managed=False), device=torch.device("meta"))
    _fuse_optimizer(ebc, cfg)
    return ebc


def build_managed_bags(features: list[FeatureSpec], cfg: EmbeddingsConfig,
                       buckets: int) -> ManagedCollisionEmbeddingBagCollection | None:
    """The managed tables (hashing = "managed"), each behind TorchRec's managed-collision
    module (MCH: a sorted raw-id -> row map with eviction), or None when there are none.
    `buckets` is the world size: MCH splits its id range into that many parts, one per rank."""
    tables = _tables(features, cfg, managed=True)
    if not tables:
        return None
    spec = {f.table: f for f in features if f.hashing == "managed"}
    policies = {"lfu": DistanceLFU_EvictionPolicy, "lru": LRU_EvictionPolicy}
    modules = {t.name: MCHManagedCollisionModule(
        zch_size=t.num_embeddings, device=torch.device("meta"),
        eviction_policy=policies[spec[t.name].eviction_policy](), eviction_interval=spec[t.name].eviction_interval,
        input_hash_size=MANAGED_ID_RANGE, buckets=buckets) for t in tables}
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    _fuse_optimizer(ebc, cfg)
    return ManagedCollisionEmbeddingBagCollection(ebc, ManagedCollisionCollection(modules, tables),
                                                  return_remapped_features=False)


def _tables(features: list[FeatureSpec], cfg: EmbeddingsConfig, managed: bool) -> list[EmbeddingBagConfig]:
    tables = [t for t in table_configs(features)
              if (t.name in {f.table for f in features if f.hashing == "managed"}) == managed]
    for table in tables:
        table.data_type = _DATA_TYPES[cfg.data_type]
    return tables


def _fuse_optimizer(ebc: EmbeddingBagCollection, cfg: EmbeddingsConfig) -> None:
    optimizer = {"adagrad": torch.optim.Adagrad, "rowwise_adagrad": RowWiseAdagrad}[cfg.optimizer]
    apply_optimizer_in_backward(optimizer, ebc.parameters(), {"lr": cfg.lr, "eps": cfg.eps})
