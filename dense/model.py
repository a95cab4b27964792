"""The whole ranking model: sparse lookup -> e_input -> tower -> one logit per task."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torchrec import EmbeddingBagCollection

from dense.layout import InputLayout

if TYPE_CHECKING:  # the batch is the trainer's; the model only reads its fields
    from trainer.config import Config, FeatureSpec, ModelConfig
    from trainer.data.batch import Batch


class TaskHeads(nn.Module):
    """One head per task: [B, in] -> logits [B, K]; linear, or a small MLP when hidden > 0."""

    def __init__(self, in_dim: int, num_tasks: int, hidden: int = 0):
        super().__init__()
        if hidden:
            self.heads = nn.ModuleList(
                nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
                for _ in range(num_tasks))
        else:  # K linear heads are one [in, K] matrix
            self.heads = nn.ModuleList([nn.Linear(in_dim, num_tasks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([h(x) for h in self.heads], dim=1)

    def cost(self) -> tuple[int, int]:
        """(parameters, forward matmul FLOPs per sample)."""
        linears = [m for m in self.modules() if isinstance(m, nn.Linear)]
        return (sum(p.numel() for m in linears for p in m.parameters()),
                sum(2 * m.in_features * m.out_features for m in linears))


class RankingModel(nn.Module):
    """Batch -> logits [B, K]. `ebc`, the plain tables, and `managed`, the managed-collision
    tables fed by `batch.managed` (each None when there are none), are sharded by DMP; the
    rest is replicated (DDP).

    `autocast_dtype` runs the tower and heads under autocast (weights stay fp32).
    """

    def __init__(self, ebc: EmbeddingBagCollection | None, layout: InputLayout, tower: nn.Module, heads: TaskHeads,
                 autocast_dtype: torch.dtype | None = None, autocast_device: str = "cuda",
                 managed: nn.Module | None = None):
        super().__init__()
        self.ebc = ebc
        self.managed = managed
        self.layout = layout
        self.tower = tower
        self.heads = heads
        self.autocast_dtype = autocast_dtype
        self.autocast_device = autocast_device

    def forward(self, batch: Batch) -> torch.Tensor:
        e_input = self.layout.assemble(self.pooled(batch), batch.dense)
        if self.autocast_dtype is None:
            return self.heads(self.tower(e_input))
        # A fixed device type rather than e_input.device: TorchRec's pipeline traces this
        # forward symbolically, where e_input is a proxy.
        with torch.autocast(self.autocast_device, dtype=self.autocast_dtype):
            return self.heads(self.tower(e_input)).float()

    def pooled(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Every sparse feature's pooled embedding [B, D_f] by name (the key order is the plan's),
        from the plain and the managed tables. Merged in place: TorchRec's pipeline traces
        forward, and a traced dict cannot be unpacked."""
        pooled = {} if self.ebc is None else self.ebc(batch.sparse).to_dict()
        if self.managed is not None:
            managed = self.managed(batch.managed)[0].to_dict()
            if self.ebc is None:
                pooled = managed
            else:
                pooled.update(managed)
        return pooled


def build_dense(model: ModelConfig, features: list[FeatureSpec]) -> tuple[InputLayout, nn.Module, TaskHeads]:
    """The dense side of a config (layout of e_input, tower, heads): the one place that
    assembles it, for training, scoring, the sweep's cost and the tests."""
    from dense.towers import build_tower  # the registry imports every tower module

    layout = InputLayout(features)
    tower = build_tower(model, layout)
    return layout, tower, TaskHeads(tower.out_dim, len(model.tasks), model.head_hidden)


def build_model(cfg: Config, autocast_dtype: torch.dtype | None = None) -> RankingModel:
    """The unsharded model of `cfg`: embedding tables on the meta device, tower, heads."""
    import torch.distributed as dist

    from embeddings.managed import build_managed_bags
    from embeddings.tables import build_embedding_bags

    layout, tower, heads = build_dense(cfg.model, cfg.features)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return RankingModel(build_embedding_bags(cfg.features, cfg.embeddings), layout, tower, heads,
                        autocast_dtype=autocast_dtype,
                        managed=build_managed_bags(cfg.features, cfg.embeddings, buckets=world))
