"""Metrics of the model over a whole split."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trainer.hooks import TrainingHooks
from trainer.config import Config
from trainer.data.encode import RowEncoder
from trainer.data.reader import ParquetReader
from trainer.dist import DistEnv
from trainer.metrics import task_metrics


class Evaluator:
    """Scores whole splits: every rank reads its share of the rows, the logits, labels,
    users and weights of all ranks are gathered, and `task_metrics` runs over all of them
    (never an average of per-rank figures). The caller puts the model in eval mode.
    `retries`: the readers' object-store retry arguments, as the trainer's own reader has them."""

    def __init__(self, model: nn.Module, encoder: RowEncoder, cfg: Config, env: DistEnv, hooks: TrainingHooks,
                 retries: dict):
        self.model, self.encoder, self.cfg, self.env, self.hooks = model, encoder, cfg, env, hooks
        self.retries = retries
        self.task_names = [t.name for t in cfg.model.tasks]

    @torch.no_grad()
    def __call__(self, path: str, **split) -> dict[str, float]:
        """Metrics over the files at `path` (`split`: ParquetReader's holdout arguments),
        the first metrics.eval_batches batches per rank when that is set."""
        data = self.cfg.data
        reader = ParquetReader(path, self.encoder, batch_size=data.eval_batch_size, shuffle=False, drop_last=False,
                               rank=self.env.rank, world_size=self.env.world_size, **self.retries, **split)
        logits, labels, users, weights = [], [], [], []
        for i, batch in enumerate(reader):
            if self.cfg.metrics.eval_batches and i >= self.cfg.metrics.eval_batches:
                break
            batch = batch.to(self.env.device)
            logits.append(self.model(batch).float())
            labels.append(batch.labels)
            users.append(batch.users)
            weights.append(batch.weights)
        gathered = [_gather(torch.cat(t)) for t in (logits, labels, users, weights)]
        keep = gathered[3] > 0
        metrics = task_metrics(gathered[0][keep], gathered[1][keep], gathered[2][keep], self.task_names,
                               with_uauc=bool(data.user_column))
        metrics["examples"] = int(keep.sum())
        for hook in self.hooks.metrics:
            metrics.update(hook("eval"))
        return metrics


def _gather(t: torch.Tensor) -> torch.Tensor:
    """Concatenate `t` from every rank on the CPU (every rank holds equally many rows)."""
    if dist.get_world_size() == 1:
        return t.cpu()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out).cpu()
