"""Metric edge cases against values worked out by hand: users with one class only, splits
with one class only, and no numpy warnings on the way (they would land in every training
log)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from trainer.metrics.ranking import normalized_entropy, task_metrics, uauc

# user 1: the positive outranks both negatives (AUC 1, 3 rows); user 4: a tie (AUC 1/2, 2 rows);
# user 2 has only negatives and user 3 only positives: both left out.
USERS = np.array([1, 2, 1, 3, 4, 1, 2, 3, 4])
SCORES = np.array([0.1, 0.9, 0.4, 0.2, 0.2, 0.35, 0.8, 0.7, 0.2])
LABELS = np.array([0, 0, 1, 1, 1, 0, 0, 1, 0])
UAUC = (1.0 * 3 + 0.5 * 2) / 5


def test_uauc_leaves_out_users_with_one_class_either_way():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert uauc(SCORES, LABELS, USERS) == pytest.approx(UAUC, abs=1e-15)


def test_uauc_without_a_user_of_both_classes_is_nan():
    assert math.isnan(uauc(np.array([0.1, 0.2, 0.3]), np.array([0, 0, 1]), np.array([5, 5, 6])))


def test_task_metrics_reports_uauc_of_every_task():
    logits = torch.tensor(np.stack([SCORES, -SCORES], axis=1))
    labels = torch.tensor(np.stack([LABELS, LABELS], axis=1), dtype=torch.float32)
    m = task_metrics(logits, labels, torch.tensor(USERS), ["click", "like"])
    # user 1 reversed: AUC 0; user 4: still a tie
    assert m["uauc"] == m["click/uauc"] == pytest.approx(UAUC, abs=1e-15)
    assert m["like/uauc"] == pytest.approx((0.0 * 3 + 0.5 * 2) / 5, abs=1e-15)


@pytest.mark.parametrize("label", [0.0, 1.0])
def test_normalized_entropy_of_a_one_class_split_is_nan_without_warnings(label):
    probs = torch.tensor([0.2, 0.7], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert math.isnan(normalized_entropy(probs, torch.full((2,), label, dtype=torch.float64)))
