"""Calibration of the task heads on the validation split (train.calibrate, docs/training.md).

Early stopping picks the weights of the best validation AUC, and those can predict too
many or too few clicks: AUC ranks, it does not count. The standard fix is an affine map of
each task's logit, fitted after training by maximum likelihood on the validation split:
`bias` fits b in sigmoid(z + b), `platt` fits a and b in sigmoid(a z + b) (Platt scaling;
a is an inverse temperature). Either makes the mean prediction equal the validation click
rate (the likelihood's gradient in b is sum(p) - positives), and with a > 0 neither changes
an AUC. The map lives in the heads (dense/heads.py TaskHeads.calibration_a, _b), so checkpoints,
scoring and serving artifacts carry it.

The fit reads the validation split's logit histogram (trainer/metrics/streaming.py: 2^20
bins of 3e-5 over +-16), not its rows: fixed memory at any split size, and at that bin width
the bin centres stand in for the logits to well under 1e-4 of the log loss.

`Calibration` is the training loop's component (trainer/components/base.py): after training, on
the weights the run ends on, it fits the maps and keeps them with model selection's best weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from dense.heads import TaskHeads
from trainer.checkpoint import manager
from trainer.components.base import Loop, LoopComponent
from trainer.metrics.streaming import LOGIT_RANGE

if TYPE_CHECKING:
    from trainer.components.selection import ModelSelection
    from trainer.metrics.evaluation import Evaluator

NEWTON_STEPS = 50
"""Newton steps at most; the log loss is convex in (a, b), and 10-20 reach float64 precision."""


def fit_affine(neg: np.ndarray, pos: np.ndarray, kind: str) -> tuple[float, float]:
    """(a, b) minimising the log loss of sigmoid(a z + b) over one task's validation logits,
    given as negatives and positives per bin of the histogram's grid; `kind` bias fixes a = 1.
    (1, 0) when a class is absent: there is nothing to fit."""
    assert kind in ("bias", "platt"), kind
    if neg.sum() == 0 or pos.sum() == 0:
        return 1.0, 0.0
    used = np.flatnonzero(neg + pos)
    width = 2 * LOGIT_RANGE / len(neg)
    z = -LOGIT_RANGE + (used + 0.5) * width
    n, y = neg[used] + pos[used], pos[used]
    x = np.stack([z, np.ones_like(z)]) if kind == "platt" else np.ones_like(z)[None]
    theta = np.array([1.0, 0.0]) if kind == "platt" else np.array([0.0])
    offset = np.zeros_like(z) if kind == "platt" else z  # bias: z + b, the slope held at 1
    for _ in range(NEWTON_STEPS):
        p = 1 / (1 + np.exp(-(theta @ x + offset)))
        grad = x @ (n * p - y)
        hess = (x * (n * p * (1 - p))) @ x.T
        step = np.linalg.solve(hess + 1e-12 * np.eye(len(theta)), grad)
        theta -= step
        if np.abs(step).max() < 1e-12:
            break
    return (float(theta[0]), float(theta[1])) if kind == "platt" else (1.0, float(theta[0]))


def task_heads(model: nn.Module) -> TaskHeads:
    """The model's TaskHeads, under whatever wrappers (DistributedModelParallel, DDP) hold it."""
    return next(m for m in model.modules() if isinstance(m, TaskHeads))


def reset_heads(model: nn.Module) -> None:
    """Put the model's TaskHeads map back to the identity (weights loaded from a calibrated
    run carry its map; a new fit starts from the raw logits)."""
    heads = task_heads(model)
    heads.calibration_a.fill_(1.0)
    heads.calibration_b.fill_(0.0)


def calibrate_heads(model: nn.Module, histogram: np.ndarray, kind: str) -> list[tuple[float, float]]:
    """Fit each task's (a, b) on its `histogram` [K, 2, bins] (negatives, positives per logit
    bin, logits taken uncalibrated) and set them in the model's TaskHeads; returns them."""
    heads = task_heads(model)
    assert bool((heads.calibration_a == 1).all() and (heads.calibration_b == 0).all()), \
        "the histogram's logits must be the uncalibrated ones"
    fitted = [fit_affine(task[0], task[1], kind) for task in histogram]
    a, b = torch.tensor(fitted, dtype=heads.calibration_a.dtype).T
    heads.calibration_a.copy_(a)
    heads.calibration_b.copy_(b)
    return fitted


class Calibration(LoopComponent):
    """train.calibrate: after training, fit the heads' logit maps on the validation split for the
    weights the run ends on, and keep them with the best weights. `fitted`: each task's (a, b).
    `selection` gives the validation split and the best weights; `evaluator` the histogram of the
    logits of the last split `metrics_on` measured; `eval_path` is the test split."""

    def __init__(self, kind: str, task_names: list[str], selection: ModelSelection, model: nn.Module,
                 evaluator: Evaluator, eval_path: str):
        self.kind, self.task_names = kind, task_names
        self.selection, self.model, self.evaluator, self.eval_path = selection, model, evaluator, eval_path
        self.fitted: list[tuple[float, float]] = []

    def after_training(self, loop: Loop) -> dict[str, float]:
        """The test metrics before the fit as uncalibrated/*, and the maps (empty when off)."""
        best = self.selection
        if self.kind == "none" or not best.split:
            return {}
        reset_heads(self.model)  # the raw logits, whatever map the initial weights brought
        before = loop.metrics_on(self.eval_path)
        path, split = best.split
        loop.metrics_on(path, **split)  # its histogram: the logits before any map
        self.fitted = calibrate_heads(self.model, self.evaluator.histogram, self.kind)
        loop.logger.write("calibrated on the validation split: "
                          + ", ".join(f"{t} {a:.4f} z {b:+.4f}" for t, (a, b) in zip(self.task_names, self.fitted)))
        if best.keep_weights and best.best.step:  # the run ends on the best weights
            manager.save_weights(best.folder, loop.weights(best.best.step), best.best.step, tag=".calibrated")
        return {**{f"uncalibrated/{k}": before[k]
                   for k in ("auc", "uauc", "logloss", "ne", "calibration") if k in before},
                **{f"{t}/calibration_{name}": v for t, ab in zip(self.task_names, self.fitted)
                   for name, v in zip("ab", ab)}}

    def state_dict(self) -> dict:
        return {"fitted": list(self.fitted)}

    def load_state_dict(self, state: dict) -> None:
        self.fitted = [tuple(ab) for ab in state["fitted"]]
