"""The dense side of the model: e_input [B, E] -> tower -> task heads -> logits [B, K].

The whole model, tables included, is `trainer/ranking_model.py::RankingModel`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dense.layout import InputLayout
from dense.tower_registry import TOWERS

if TYPE_CHECKING:
    from dense.model_config import ModelConfig
    from embeddings.features import FeatureSpec


class TaskHeads(nn.Module):
    """One head per task: [B, in] -> logits [B, K]; linear, or a small MLP when hidden > 0.
    In eval mode (evaluation, scoring, exports) `calibration_a`, `calibration_b` [K] map each
    task's logit z to a z + b: the identity until trainer/components/calibration.py fits them on the
    validation split (train.calibrate). Training sees the raw logits."""

    def __init__(self, in_dim: int, num_tasks: int, hidden: int = 0):
        super().__init__()
        if hidden:
            self.heads = nn.ModuleList(
                nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
                for _ in range(num_tasks))
        else:  # K linear heads are one [in, K] matrix
            self.heads = nn.ModuleList([nn.Linear(in_dim, num_tasks)])
        # Buffers, not parameters: fitted once after training, never by the optimizer. Two 1-D
        # buffers rather than rows of one: indexing a CUDA tensor by row is not traceable on
        # a CPU build (tests/test_fake_cuda.py).
        self.register_buffer("calibration_a", torch.ones(num_tasks))
        self.register_buffer("calibration_b", torch.zeros(num_tasks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = torch.cat([h(x) for h in self.heads], dim=1)
        # A post-hoc map of the served predictions: kept off the train step, and out of the
        # gradients of a run that warm-starts from calibrated weights.
        return logits if self.training else logits * self.calibration_a + self.calibration_b

    def cost(self) -> tuple[int, int]:
        """(parameters, forward matmul FLOPs per sample)."""
        linears = [m for m in self.modules() if isinstance(m, nn.Linear)]
        return (sum(p.numel() for m in linears for p in m.parameters()),
                sum(2 * m.in_features * m.out_features for m in linears))


def build_tower(cfg: ModelConfig, layout: InputLayout) -> nn.Module:
    """The tower named by `model.tower`, from the token fields and the tables it declares; it
    exposes `out_dim`. A ModelConfig exists once dense/tower_configs/ has registered every tower."""
    spec = TOWERS.get(cfg.tower)
    return spec.build(cfg, layout, *(getattr(cfg, key) for key in spec.tables))


def build_dense(model: ModelConfig, features: list[FeatureSpec]) -> tuple[InputLayout, nn.Module, TaskHeads]:
    """The dense side of a config (layout of e_input, tower, heads): the one place that
    assembles it, for training, scoring, the sweep's cost and the tests."""
    layout = InputLayout(features)
    tower = build_tower(model, layout)
    return layout, tower, TaskHeads(tower.out_dim, len(model.tasks), model.head_hidden)
