"""Model selection on a validation split: which validation was best, and when to stop.

The protocol of CTR benchmarks (BARS, FuxiCTR): validate every epoch (or every N steps),
keep the weights of the best validation, stop once `patience` validations in a row brought
no improvement, and report the test split measured on the best weights. A fixed number of
epochs would compare towers at different points of their learning curves.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from trainer.checkpoint import manager
from trainer.components.base import Loop, LoopComponent
from trainer.config import Config
from trainer.run_layout import RunFolder

HIGHER_IS_BETTER = {"auc": True, "logloss": False}


@dataclass
class BestPoint:
    """The best validation so far and the validations since (a checkpoint part)."""

    metric: str
    """The validation metric compared: a key of HIGHER_IS_BETTER."""
    patience: int
    """Validations without improvement that end training (0: never)."""
    step: int = 0
    """The step of the best validation."""
    epochs: float = 0.0
    """Epochs trained at the best validation."""
    since: int = 0
    """Validations since the best one."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Every metric of the best validation."""

    @property
    def value(self) -> float:
        """The best validation's metric (NaN before the first)."""
        return self.metrics.get(self.metric, math.nan)

    def update(self, metrics: dict[str, float], step: int, epochs: float) -> bool:
        """Record a validation's metrics; True when it is the best so far (NaN never is)."""
        value = metrics[self.metric]
        better = value > self.value if HIGHER_IS_BETTER[self.metric] else value < self.value
        if math.isnan(self.value) and not math.isnan(value) or better:
            self.metrics, self.step, self.epochs, self.since = dict(metrics), step, epochs, 0
            return True
        self.since += 1
        return False

    @property
    def exhausted(self) -> bool:
        """Patience ran out: stop training."""
        return self.patience > 0 and self.since >= self.patience

    def state_dict(self) -> dict:
        """What was seen (the metric and patience come from this run's config). The metrics
        travel as one JSON text: DCP loads only the keys its template has, and a fresh
        run's template cannot know which metrics the saved run had."""
        return {"step": self.step, "epochs": self.epochs, "since": self.since, "metrics": json.dumps(self.metrics)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.epochs, self.since = int(state["step"]), float(state["epochs"]), int(state["since"])
        self.metrics = json.loads(state["metrics"])


class ModelSelection(LoopComponent):
    """What a validation split does for a run (docs/design.md §2.6), a component of the training
    loop: it validates on schedule (metrics.valid_every or valid_every_epochs, else at every epoch's end, and after the
    last step), tracks the best validation (`best`, the checkpoint part "best"), keeps that
    validation's weights in `folder` (train.restore_best), and puts them back after training.
    Once `patience` validations brought no improvement, it asks the loop to stop.
    `split`: (files, ParquetReader's holdout arguments) of the validation split, None without one."""

    def __init__(self, cfg: Config, run_dir: Path, train_path: str, valid_path: str):
        t, d = cfg.train, cfg.data
        self.split = ((valid_path, {}) if valid_path else  # its own files, or every training row group's tail
                      (train_path, {"holdout_fraction": d.row_group_holdout, "holdout": True})
                      if d.row_group_holdout else None)
        self.every = cfg.metrics.valid_every
        self.every_epochs = cfg.metrics.valid_every_epochs  # turned into steps once the epoch's are known
        self.best = BestPoint(t.select_metric, t.early_stopping_patience)
        self.checkpoint_part = "best" if self.split else None
        self.folder = RunFolder(run_dir).best
        self.keep_weights = t.restore_best
        self.restored = False

    def after_restore(self, loop: Loop) -> None:
        """metrics.valid_every_epochs as steps (at least one); a run restored after its patience ran
        out trains no further."""
        if self.every_epochs:
            self.every = max(1, round(self.every_epochs * loop.steps_in_epoch()))
        if self.best.exhausted:
            loop.stop_requested = True

    def after_step(self, loop: Loop) -> None:
        if self.split and ((loop.due(self.every) if self.every else loop.epoch_ended())
                           or loop.step == loop.total_steps):
            self.validate(loop)

    def validate(self, loop: Loop) -> dict[str, float]:
        """Metrics over the validation split, logged as `valid`; the best so far has its weights
        saved (collective); the loop asked to stop once patience runs out."""
        loop.check()  # before the best weights are saved
        path, split = self.split
        metrics = loop.metrics_on(path, **split)
        epochs = loop.epochs_trained()
        loop.logger.log(loop.step, "valid", {**metrics, "epochs": epochs})
        loop.wait_for_save()  # one save at a time
        self.record(metrics, loop.step, epochs, loop.weights())
        if self.best.exhausted:
            loop.stop_requested = True
        return metrics

    def record(self, metrics: dict[str, float], step: int, epochs: float, weights: dict) -> bool:
        """A validation's metrics; the best so far has `weights` (checkpoint parts) saved (collective)."""
        improved = self.best.update({k: v for k, v in metrics.items() if "/" not in k}, step, epochs)
        if improved and self.keep_weights:
            manager.save_weights(self.folder, weights, step)
        return improved

    def after_training(self, loop: Loop) -> dict[str, float]:
        """End on the best validation's weights, unless they are the last."""
        if self.split and self.keep_weights and self.best.step not in (0, loop.step):
            manager.load(self.folder, {"model": loop.weights()["model"]})
            self.restored = True
            loop.logger.write(f"restored the weights of step {self.best.step}, the best validation "
                              f"({self.best.metric} {self.best.value:.5f})")
            loop.after_restore(self.best.step)  # the weights' own step (UniMixer's temperature)
        return {}

    def summary(self) -> dict:
        """The best point and its validation metrics, for summary.json (empty without a validation split)."""
        if not self.split:
            return {}
        return {"best/step": self.best.step, "best/epochs": self.best.epochs, "best/restored": self.restored,
                "stopped_early": self.best.exhausted,
                **{f"valid/{k}": v for k, v in self.best.metrics.items()}}

    def state_dict(self) -> dict:
        return self.best.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.best.load_state_dict(state)
