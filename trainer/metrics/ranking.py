"""Ranking metrics over a whole evaluation split, per task: AUC, UAUC, logloss, normalized
entropy (NE) and calibration."""

from __future__ import annotations

import numpy as np
import torch


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve; NaN when only one class is present."""
    if labels.min() == labels.max():
        return float("nan")
    # On use: torchmetrics pulls in matplotlib, a second of every rank's start-up, and training
    # reads only this module's sums (a split's AUC is streaming.py's)
    from torchmetrics.functional.classification import binary_auroc

    return float(binary_auroc(scores, labels.long()))


def logloss(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of probabilities."""
    return float(torch.nn.functional.binary_cross_entropy(probs.double(), labels.double()))


def normalized_entropy(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Logloss over the entropy of the split's base rate (He et al., 2014): below 1 means
    the model knows more than the click rate; NaN when only one class is present."""
    rate = float(labels.double().mean())
    if rate in (0.0, 1.0):
        return float("nan")
    return logloss(probs, labels) / base_rate_entropy(rate)


def base_rate_entropy(rate: float) -> float:
    """Entropy in nats of a label that is 1 with probability `rate` (0 < rate < 1)."""
    return -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))


def calibration(probs: torch.Tensor, labels: torch.Tensor) -> float:
    """Predicted over observed positive rate: 1 is calibrated, above 1 over-predicts."""
    positives = float(labels.double().sum())
    return float(probs.double().sum()) / positives if positives else float("nan")


def uauc(scores: np.ndarray, labels: np.ndarray, users: np.ndarray) -> float:
    """Per-user AUC averaged over users with both classes, weighted by their impressions."""
    total, weight = uauc_sums(scores, labels, users)
    if not weight:
        return float("nan")
    return total / weight


def uauc_sums(scores: np.ndarray, labels: np.ndarray, users: np.ndarray) -> tuple[float, float]:
    """(sum of per-user AUC x impressions, impressions) over users with both classes, so that
    disjoint sets of users add up (trainer/metrics/streaming.py).

    Vectorised rank-sum (Mann-Whitney) form with tied scores given their average rank,
    so it scales to millions of users.
    """
    order = np.lexsort((scores, users))
    u, s, y = users[order], scores[order], labels[order].astype(np.float64)
    n = len(u)
    user_start = np.r_[True, u[1:] != u[:-1]]
    uid = np.cumsum(user_start) - 1
    first = np.flatnonzero(user_start)
    rank = np.arange(n) - first[uid] + 1.0
    tie_start = user_start | np.r_[True, s[1:] != s[:-1]]
    tie = np.cumsum(tie_start) - 1
    rank = (np.bincount(tie, rank) / np.bincount(tie))[tie]
    count = np.bincount(uid).astype(np.float64)
    pos = np.bincount(uid, y)
    neg = count - pos
    both = (pos > 0) & (neg > 0)
    rank_sum = np.bincount(uid, rank * y)[both]
    per_user = (rank_sum - pos[both] * (pos[both] + 1) / 2) / (pos[both] * neg[both])
    return float((per_user * count[both]).sum()), float(count[both].sum())


def task_metrics(logits: torch.Tensor, labels: torch.Tensor, users: torch.Tensor,
                 task_names: list[str], with_uauc: bool = True) -> dict[str, float]:
    """logits, labels: [N, K]; users: [N] -> {'auc', 'uauc', 'logloss', 'ne', 'calibration'}
    of the first task plus '<task>/<metric>' for every task."""
    out: dict[str, float] = {}
    probs = torch.sigmoid(logits.double())
    for k, name in enumerate(task_names):
        y = labels[:, k]
        out[f"{name}/auc"] = auc(logits[:, k].double(), y)
        out[f"{name}/logloss"] = logloss(probs[:, k], y)
        out[f"{name}/ne"] = normalized_entropy(probs[:, k], y)
        out[f"{name}/calibration"] = calibration(probs[:, k], y)
        if with_uauc:
            out[f"{name}/uauc"] = uauc(logits[:, k].double().numpy(), y.numpy(), users.numpy())
    first = task_names[0]
    for metric in ("auc", "uauc", "logloss", "ne", "calibration"):
        if f"{first}/{metric}" in out:
            out[metric] = out[f"{first}/{metric}"]
    return out
