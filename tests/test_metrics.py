"""AUC, UAUC, logloss, NE and calibration against brute-force references."""

import itertools
import math

import numpy as np
import pytest
import torch

from trainer.metrics.ranking import auc, calibration, logloss, normalized_entropy, task_metrics, uauc


def _pairwise_auc(scores, labels):
    """Probability a random positive outranks a random negative, ties counting 1/2."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def _uauc_reference(scores, labels, users):
    total, weight = 0.0, 0
    for u in np.unique(users):
        m = users == u
        if labels[m].min() != labels[m].max():
            total += _pairwise_auc(scores[m], labels[m]) * m.sum()
            weight += m.sum()
    return total / weight


def test_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 20, 300).astype(np.float64)  # many ties
    labels = (rng.random(300) < 0.3).astype(np.float64)
    assert auc(torch.tensor(scores), torch.tensor(labels)) == pytest.approx(_pairwise_auc(scores, labels), abs=1e-6)


def test_auc_single_class_is_nan():
    assert np.isnan(auc(torch.rand(10), torch.zeros(10)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uauc_matches_per_user_reference(seed):
    rng = np.random.default_rng(seed)
    n = 2_000
    users = rng.integers(0, 60, n)
    scores = np.round(rng.normal(size=n), 1)  # ties within users
    labels = (rng.random(n) < 0.4).astype(np.float64)
    labels[users == 7] = 1.0  # a user with one class only is left out
    assert uauc(scores, labels, users) == pytest.approx(_uauc_reference(scores, labels, users), abs=1e-12)


def test_uauc_weights_users_by_impressions():
    users = np.array([1, 1, 2, 2, 2, 2])
    scores = np.array([0.9, 0.1, 0.1, 0.2, 0.3, 0.4])
    labels = np.array([1, 0, 1, 1, 0, 0])  # user 1: AUC 1 (2 rows); user 2: AUC 0 (4 rows)
    assert uauc(scores, labels, users) == pytest.approx((1.0 * 2 + 0.0 * 4) / 6)


def test_logloss_and_task_metrics():
    logits = torch.tensor([[2.0, -1.0], [-0.5, 0.5], [0.0, 3.0], [1.0, -2.0]])
    labels = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    users = torch.tensor([1, 1, 2, 2])
    m = task_metrics(logits, labels, users, ["click", "like"])
    p = torch.sigmoid(logits[:, 1].double())
    y = labels[:, 1].double()
    expected = float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())
    assert m["like/logloss"] == pytest.approx(expected)
    assert logloss(p, y) == pytest.approx(expected)
    assert m["auc"] == m["click/auc"] == pytest.approx(_pairwise_auc(logits[:, 0].tolist(), labels[:, 0].tolist()))
    assert set(m) >= {"auc", "uauc", "logloss", "like/auc", "like/uauc"}


def test_normalized_entropy_and_calibration_by_their_definitions():
    p = torch.tensor([0.9, 0.2, 0.6, 0.1, 0.3], dtype=torch.float64)
    y = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    loss = -sum(math.log(q) if t else math.log(1 - q) for q, t in zip(p.tolist(), y.tolist())) / 5
    base = -(0.4 * math.log(0.4) + 0.6 * math.log(0.6))  # 2 clicks in 5
    assert normalized_entropy(p, y) == pytest.approx(loss / base)
    assert calibration(p, y) == pytest.approx(2.1 / 2)
    # the base rate itself scores NE 1 and is calibrated
    rate = torch.full((5,), 0.4, dtype=torch.float64)
    assert normalized_entropy(rate, y) == pytest.approx(1.0) and calibration(rate, y) == pytest.approx(1.0)
    assert math.isnan(normalized_entropy(p, torch.zeros(5))) and math.isnan(calibration(p, torch.zeros(5)))
    m = task_metrics(torch.logit(p)[:, None], y[:, None], torch.zeros(5), ["click"], with_uauc=False)
    assert m["ne"] == m["click/ne"] == pytest.approx(loss / base)
    assert m["calibration"] == pytest.approx(2.1 / 2)
