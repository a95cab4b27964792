"""[embeddings]: the sparse side's settings: the tables' fused optimizer and data type, and
how they are sharded (the plan, the sharding types the planner may choose, per-table overrides).

Standard library only: the config loads without torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

ShardingType = Literal["table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise"]
SPARSE_SHARDING_TYPES: tuple[str, ...] = get_args(ShardingType)
"""TorchRec sharding types the planner may choose from."""
SparseOptimizer = Literal["adagrad", "rowwise_adagrad"]
TableDataType = Literal["fp32", "fp16"]


@dataclass
class EmbeddingsConfig:
    """Sparse side: TorchRec tables, sharding and the fused optimizer."""

    optimizer: SparseOptimizer = "adagrad"
    """Fused sparse optimizer: adagrad | rowwise_adagrad."""
    lr: float = 0.1
    """Sparse learning rate."""
    eps: float = 1e-8
    """Adagrad epsilon."""
    weight_decay: float = 0.0
    ("""L2 penalty on each pooled embedding a batch looks up, in its gradient (embeddings/decay.py): a row """
     """is decayed as often as it is seen.""")
    data_type: TableDataType = "fp32"
    """Table weights: fp32 | fp16 (half the memory; the optimizer state stays fp32)."""
    plan: str = "auto"
    """Registered sharding plan builder (auto: TorchRec's planner)."""
    sharding_types: list[ShardingType] = field(default_factory=lambda: list(SPARSE_SHARDING_TYPES))
    """Sharding types the planner may choose; data_parallel would train tables densely, outside Adagrad."""
    table_sharding: dict[str, ShardingType] = field(default_factory=dict)
    """Per-table sharding type overriding the plan, e.g. {item = "row_wise"}."""
