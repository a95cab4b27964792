"""Progressive metrics of training in time order (data.order = "time", docs/continuous.md)."""

from __future__ import annotations

import torch
from torch import nn

from trainer.metrics.streaming import SplitMetrics


class ProgressiveMetrics:
    """AUC, NE and calibration of a partition's training rows, each scored by the training
    forward before its update (online training's "progressive" metrics: no extra forward). A
    forward hook on `model` (training mode) feeds a whole-split `SplitMetrics`; `compute` reads
    it (collective) and starts the next partition afresh. After a resume inside a partition it
    covers the rows trained since."""

    def __init__(self, model: nn.Module, task_names: list[str], device: torch.device):
        self.task_names, self.device = task_names, device
        self.split = SplitMetrics(task_names, device)
        model.register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: tuple, logits: torch.Tensor) -> None:
        if module.training:
            self.split.add(logits.detach(), args[0].labels, args[0].users)

    def compute(self) -> dict[str, float]:
        """'auc', 'ne', 'calibration' per task ('<task>/auc', ...; the first task's also bare) and 'examples'."""
        figures = self.split.compute()
        self.split = SplitMetrics(self.task_names, self.device)
        return {k: v for k, v in figures.items() if k == "examples" or k.split("/")[-1] in ("auc", "ne", "calibration")}
