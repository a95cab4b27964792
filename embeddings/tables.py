"""TorchRec tables from the feature schema, with FBGEMM's fused Adagrad attached."""

from __future__ import annotations

import torch
from torchrec import (
    DataType,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from embeddings.features import FeatureSpec, attended, attended_tables, managed_tables
from embeddings.sparse_config import EmbeddingsConfig

FUSED = EmbeddingComputeKernel.FUSED.value  # tables updated by the optimizer fused into the backward pass
_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}
_DATA_TYPES = {"fp32": DataType.FP32, "fp16": DataType.FP16}
_OPTIMIZERS = {"adagrad": torch.optim.Adagrad, "rowwise_adagrad": RowWiseAdagrad}


def table_configs(features: list[FeatureSpec], serving: bool = False) -> list[EmbeddingBagConfig]:
    """One EmbeddingBagConfig per pooled table; features naming the same table share its rows.
    The tables of attended sequences are not here (`sequence_table_configs` holds them for
    training) unless `serving`: a served model looks their rows up through its one bag
    collection too, one id per bag (trainer/serving/served_model.py).

    TorchRec pools per table, so the multi-id features sharing a table must agree on
    pooling (a single id pools the same either way; an attended sequence is not pooled).
    """
    tables: dict[str, EmbeddingBagConfig] = {}
    pooled_by: dict[str, FeatureSpec] = {}
    unpooled = set() if serving else set(attended_tables(features))
    for f in features:
        if f.kind == "numeric" or f.table in unpooled:
            continue
        if f.table not in tables:
            tables[f.table] = EmbeddingBagConfig(
                name=f.table, num_embeddings=f.num_embeddings, embedding_dim=f.embedding_dim,
                feature_names=[], pooling=_POOLING[f.pooling])
        table = tables[f.table]
        table.feature_names.append(f.name)
        if f.kind == "id" or attended(f):
            continue
        first = pooled_by.setdefault(f.table, f)
        if first.pooling != f.pooling:
            raise ValueError(f"features.{f.name}.pooling={f.pooling!r} differs from features."
                             f"{first.name}.pooling={first.pooling!r}, which shares table {f.table!r}: "
                             "TorchRec pools per table")
        table.pooling = _POOLING[f.pooling]
    return list(tables.values())


def sequence_table_configs(features: list[FeatureSpec], cfg: EmbeddingsConfig | None = None,
                           managed: bool | None = None) -> list[EmbeddingConfig]:
    """One EmbeddingConfig per table of an attended sequence (features.<name>.sequence_module not
    pool), with every feature that names it: the item table exists once, and the candidate id is
    looked up through it too (docs/design.md, "Sequence module"). `cfg` sets the data type;
    `managed` keeps only the managed tables (True) or the others (False), None all."""
    tables: dict[str, EmbeddingConfig] = {}
    wanted = set(attended_tables(features))
    if managed is not None:
        held = set(managed_tables(features))
        wanted = {t for t in wanted if (t in held) == managed}
    for f in features:
        if f.kind == "numeric" or f.table not in wanted:
            continue
        if f.table not in tables:
            tables[f.table] = EmbeddingConfig(name=f.table, num_embeddings=f.num_embeddings,
                                              embedding_dim=f.embedding_dim, feature_names=[])
            if cfg is not None:
                tables[f.table].data_type = _DATA_TYPES[cfg.data_type]
        tables[f.table].feature_names.append(f.name)
    return list(tables.values())


def build_sequence_tables(features: list[FeatureSpec], cfg: EmbeddingsConfig,
                          managed: bool = False) -> EmbeddingCollection | None:
    """An EmbeddingCollection of the attended sequences' unmanaged tables, or of their `managed`
    ones (unpooled: one vector per id), on the meta device, fused like the bags; None when
    there are none."""
    tables = sequence_table_configs(features, cfg, managed)
    if not tables:
        return None
    ec = EmbeddingCollection(tables=tables, device=torch.device("meta"))
    fuse_optimizer(ec, cfg)
    return ec


def build_embedding_bags(features: list[FeatureSpec], cfg: EmbeddingsConfig) -> EmbeddingBagCollection | None:
    """An EmbeddingBagCollection of the tables that are not managed, on the meta device
    (DMP materialises only local shards), its parameters marked for the fused optimizer
    that runs inside the backward pass; None when every table is managed (TorchRec's
    collection needs a table)."""
    tables = tables_of(features, cfg, managed=False)
    if not tables:
        return None
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    fuse_optimizer(ebc, cfg)
    return ebc


def tables_of(features: list[FeatureSpec], cfg: EmbeddingsConfig, managed: bool) -> list[EmbeddingBagConfig]:
    """The managed tables (hashing = "managed") or the others, in the configured data type."""
    managed_names = managed_tables(features)
    tables = [t for t in table_configs(features) if (t.name in managed_names) == managed]
    for table in tables:
        table.data_type = _DATA_TYPES[cfg.data_type]
    return tables


def fuse_optimizer(ebc: EmbeddingBagCollection | EmbeddingCollection, cfg: EmbeddingsConfig) -> None:
    """Mark `ebc`'s tables for the sparse optimizer that runs fused inside the backward pass."""
    apply_optimizer_in_backward(_OPTIMIZERS[cfg.optimizer], ebc.parameters(), {"lr": cfg.lr, "eps": cfg.eps})
