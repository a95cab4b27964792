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
from trainer.config import Config

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


class ModelSelection:
    """What a validation split does for a run (docs/design.md §2.6): it tracks the best
    validation (`best`, a checkpoint part), keeps that validation's weights in `folder`
    (train.restore_best), and puts them back at the end."""

    def __init__(self, cfg: Config, run_dir: Path):
        t = cfg.train
        self.best = BestPoint(t.select_metric, t.early_stopping_patience)
        self.folder = run_dir / "best"
        self.keep_weights = t.restore_best
        self.restored = False

    def record(self, metrics: dict[str, float], step: int, epochs: float, weights: dict) -> bool:
        """A validation's metrics; the best so far has `weights` (checkpoint parts) saved (collective)."""
        improved = self.best.update({k: v for k, v in metrics.items() if "/" not in k}, step, epochs)
        if improved and self.keep_weights:
            manager.save_weights(self.folder, weights, step)
        return improved

    def restore(self, weights: dict, step: int) -> str | None:
        """Load the best validation's weights unless they are those of `step`; what was done."""
        if not self.keep_weights or self.best.step in (0, step):
            return None
        manager.load(self.folder, weights)
        self.restored = True
        return (f"restored the weights of step {self.best.step}, the best validation "
                f"({self.best.metric} {self.best.value:.5f})")

    def summary(self) -> dict:
        """The best point and its validation metrics, for summary.json."""
        return {"best/step": self.best.step, "best/epochs": self.best.epochs, "best/restored": self.restored,
                "stopped_early": self.best.exhausted,
                **{f"valid/{k}": v for k, v in self.best.metrics.items()}}
