"""Metrics of the model over a whole split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from embeddings.hooks import TrainingHooks
from trainer.config import Config
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader
from trainer.dist import DistEnv
from trainer.metrics.streaming import SplitMetrics


class Evaluator:
    """Scores whole splits: every rank reads its share of the rows into a `SplitMetrics`
    (fixed memory; UAUC's rows spill into the run folder), whose state is summed over the
    ranks at the end: whole-split figures, never an average of per-rank ones. The caller puts
    the model in eval mode. `histogram`: the last split's [K, 2, bins] logit histogram. Its
    readers retry a failing object store as [data] says (`ReaderOptions.from_config`)."""

    def __init__(self, model: nn.Module, encoder: RowEncoder, cfg: Config, env: DistEnv, hooks: TrainingHooks):
        self.model, self.encoder, self.cfg, self.env, self.hooks = model, encoder, cfg, env, hooks
        self.task_names = [t.name for t in cfg.model.tasks]
        self.histogram: np.ndarray | None = None

    @torch.no_grad()
    def __call__(self, path: str, **split) -> dict[str, float]:
        """Metrics over the files at `path` (`split`: ParquetReader's holdout arguments),
        the first metrics.eval_batches batches per rank when that is set."""
        data = self.cfg.data
        reader = ParquetReader(path, self.encoder, ReaderOptions.from_config(
            data, training=False, batch_size=data.eval_batch_size, rank=self.env.rank, world_size=self.env.world_size,
            **split))
        rows = reader.num_rows
        if self.cfg.metrics.eval_batches:
            rows = min(rows, self.cfg.metrics.eval_batches * data.eval_batch_size * self.env.world_size)
        spill = Path(self.cfg.train.run_dir) if data.user_column else None
        with SplitMetrics(self.task_names, self.env.device, spill, rows) as split_metrics:
            for i, batch in enumerate(reader):
                if self.cfg.metrics.eval_batches and i >= self.cfg.metrics.eval_batches:
                    break
                batch = batch.to(self.env.device)
                keep = batch.weights > 0
                split_metrics.add(self.model(batch).float()[keep], batch.labels[keep], batch.users[keep])
            metrics = split_metrics.compute()
            self.histogram = split_metrics.histogram
        for hook in self.hooks.metrics:
            metrics.update(hook("eval"))
        return metrics
