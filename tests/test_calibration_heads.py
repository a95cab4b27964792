"""train.calibrate's map set in the model (trainer/components/calibration.py `calibrate_heads`,
`reset_heads`, `task_heads`), in-process on a small model, so that `make test-mutation`
reaches it: each task fitted on its own histogram, the map in the heads under wrappers, the
mean prediction equal to the click rate, and a fit refused on logits already mapped."""

import numpy as np
import pytest
import torch
from torch import nn

from dense.heads import TaskHeads
from trainer.components.calibration import calibrate_heads, fit_affine, reset_heads, task_heads
from trainer.metrics.streaming import LOGIT_RANGE

BINS = 256


class _Wrapped(nn.Module):
    """A tower and heads under a wrapper, as DistributedModelParallel holds them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.module = nn.Sequential(nn.Linear(3, 4), nn.ModuleDict({"heads": TaskHeads(4, 2)}))

    def forward(self, x):
        return self.module[1]["heads"](self.module[0](x))


def _histogram(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """([2 tasks, negatives | positives, BINS], the bin centres): the first task's logits
    too high by 1, the second's too flat; labels drawn from the true model."""
    rng = np.random.default_rng(seed)
    centres = -LOGIT_RANGE + (np.arange(BINS) + 0.5) * 2 * LOGIT_RANGE / BINS
    hist = np.zeros((2, 2, BINS))
    for k, (a, b) in enumerate([(1.0, -1.0), (2.0, 0.3)]):
        rows = rng.integers(BINS // 2 - 20, BINS // 2 + 20, 3000)
        clicks = rng.random(3000) < 1 / (1 + np.exp(-(a * centres[rows] + b)))
        hist[k, 0] = np.bincount(rows[~clicks], minlength=BINS)
        hist[k, 1] = np.bincount(rows[clicks], minlength=BINS)
    return hist, centres


def test_task_heads_are_found_under_wrappers():
    model = _Wrapped()
    assert task_heads(model) is model.module[1]["heads"]


@pytest.mark.parametrize("kind", ["bias", "platt"])
def test_each_task_gets_the_map_fitted_on_its_own_histogram(kind):
    model = _Wrapped()
    heads = task_heads(model)
    hist, centres = _histogram(1)
    fitted = calibrate_heads(model, hist, kind)
    want = [fit_affine(hist[k, 0], hist[k, 1], kind) for k in range(2)]
    assert fitted == want and want[0] != want[1]
    assert (want[0][0] == 1.0) == (kind == "bias")
    assert heads.calibration_a.dtype == heads.calibration_b.dtype == torch.float32
    assert heads.calibration_a.tolist() == pytest.approx([a for a, _ in want], rel=1e-6)
    assert heads.calibration_b.tolist() == pytest.approx([b for _, b in want], rel=1e-6)
    # the fitted map makes the mean prediction the click rate (the likelihood's gradient in b)
    for k, (a, b) in enumerate(fitted):
        rows = hist[k, 0] + hist[k, 1]
        predicted = (rows / (1 + np.exp(-(a * centres + b)))).sum()
        assert predicted == pytest.approx(hist[k, 1].sum(), rel=1e-9)
    # in eval mode the heads map the raw logits; training sees them raw
    x = torch.randn(5, 3)
    model.train()
    raw = model(x)
    model.eval()
    assert torch.allclose(model(x), raw * heads.calibration_a + heads.calibration_b)


def test_a_fit_on_mapped_logits_is_refused_until_the_map_is_reset():
    model = _Wrapped()
    heads = task_heads(model)
    hist, _ = _histogram(2)
    for name, value in (("calibration_a", 1.5), ("calibration_b", 0.25)):
        getattr(heads, name)[1] = value
        with pytest.raises(AssertionError, match="^the histogram's logits must be the uncalibrated ones$"):
            calibrate_heads(model, hist, "platt")
        reset_heads(model)
        assert heads.calibration_a.tolist() == [1.0, 1.0] and heads.calibration_b.tolist() == [0.0, 0.0]
    calibrate_heads(model, hist, "platt")
