"""train.calibrate: the affine fit against an independent maximum-likelihood fit on the raw
logits, and a real run whose map is fitted, reported beside the uncalibrated metrics, and
kept with the best weights."""

import json

import numpy as np
import pytest
import torch

from cli import rankmix
from trainer.checkpoint import manager
from trainer.components.calibration import fit_affine
from trainer.metrics.streaming import LIFETIME_BINS, LOGIT_RANGE


def histogram(z: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Negatives and positives per bin of the evaluation histogram's grid."""
    cell = np.clip(((z + LOGIT_RANGE) / (2 * LOGIT_RANGE / LIFETIME_BINS)).astype(np.int64), 0, LIFETIME_BINS - 1)
    return (np.bincount(cell[~y], minlength=LIFETIME_BINS).astype(float),
            np.bincount(cell[y], minlength=LIFETIME_BINS).astype(float))


def reference_fit(z: np.ndarray, y: np.ndarray, slope: bool) -> tuple[float, float]:
    """Maximum likelihood by L-BFGS on every raw logit (no histogram), float64."""
    z_t, y_t = torch.tensor(z), torch.tensor(y, dtype=torch.float64)
    a = torch.ones((), dtype=torch.float64, requires_grad=slope)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([a, b] if slope else [b], lr=1, max_iter=200, tolerance_grad=1e-12,
                            tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def loss():
        opt.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(a * z_t + b, y_t, reduction="sum")
        value.backward()
        return value

    opt.step(loss)
    return float(a), float(b)


@pytest.mark.parametrize("kind", ["platt", "bias"])
@pytest.mark.parametrize("seed", [0, 1])
def test_fit_matches_maximum_likelihood_on_the_raw_logits(kind, seed):
    rng = np.random.default_rng(seed)
    z = rng.normal(0.3, 2.0, 50_000)
    truth = 1 / (1 + np.exp(-(0.6 * z - 0.8)))  # overconfident and too high: both a and b are off
    y = rng.random(len(z)) < truth
    a, b = fit_affine(*histogram(z, y), kind)
    ref_a, ref_b = reference_fit(z, y, slope=kind == "platt")
    assert a == pytest.approx(ref_a, abs=2e-4) and b == pytest.approx(ref_b, abs=2e-4)
    if kind == "bias":
        assert a == 1.0
    # at the optimum the mean prediction is the click rate: calibration exactly 1
    p = 1 / (1 + np.exp(-(a * z + b)))
    assert p.sum() / y.sum() == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("kind", ["platt", "bias"])
def test_logits_at_the_bin_centres_fit_exactly(kind):
    # Where every logit sits on its bin's centre the histogram loses nothing: the fit must
    # be the raw-logit fit to the optimiser's precision (a half-bin offset is 3e-5 off).
    rng = np.random.default_rng(2)
    width = 2 * LOGIT_RANGE / LIFETIME_BINS
    z = -LOGIT_RANGE + (rng.integers(LIFETIME_BINS // 2 - 80_000, LIFETIME_BINS // 2 + 80_000, 20_000) + 0.5) * width
    y = rng.random(len(z)) < 1 / (1 + np.exp(-(1.7 * z + 0.5)))
    a, b = fit_affine(*histogram(z, y), kind)
    ref_a, ref_b = reference_fit(z, y, slope=kind == "platt")
    assert a == pytest.approx(ref_a, abs=1e-7) and b == pytest.approx(ref_b, abs=1e-7)


def test_one_negative_is_enough_to_fit_a_bias():
    z = np.array([0.0] * 9 + [0.0])
    y = np.array([True] * 9 + [False])
    a, b = fit_affine(*histogram(z, y), "bias")
    assert a == 1.0 and b == pytest.approx(np.log(9), abs=1e-4)  # sigmoid(b) = 9/10, the rate


def test_nothing_to_fit_without_both_classes():
    neg = np.zeros(LIFETIME_BINS)
    neg[10] = 5
    assert fit_affine(neg, np.zeros(LIFETIME_BINS), "platt") == (1.0, 0.0)


def test_a_run_fits_on_the_validation_split_and_keeps_the_map_with_the_best_weights(tmp_path):
    run = tmp_path / "run"
    common = ["train", "--config", "configs/debug.toml", f"--data.cache_dir={tmp_path / 'cache'}",
              "--data.synth_rows=6000", "--train.steps=30", "--metrics.valid_every=10", "--metrics.progress=false",
              "--metrics.tensorboard=false", "--checkpoint.enabled=false"]
    # The validation split is the test split itself, so the fitted map must calibrate the test metrics.
    test_split = tmp_path / "cache" / "synth-v2-6000-seed0" / "valid"
    assert rankmix(*common, f"--train.run_dir={tmp_path / 'prep'}", "--train.steps=1").returncode == 0
    proc = rankmix(*common, f"--data.valid_path={test_split}", "--train.calibrate=platt", f"--train.run_dir={run}")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    for task in ("click", "like"):
        assert summary[f"{task}/calibration"] == pytest.approx(1.0, abs=1e-3)
    assert abs(summary["uncalibrated/calibration"] - 1) > 1e-3  # there was something to fix
    assert summary["logloss"] < summary["uncalibrated/logloss"]
    assert summary["auc"] == pytest.approx(summary["uncalibrated/auc"], abs=1e-4)  # a monotone map
    fitted = [[summary[f"{t}/calibration_{ab}"] for t in ("click", "like")] for ab in "ab"]
    assert "calibrated on the validation split: click" in proc.stdout
    best = manager.model_tensors(run / "best")
    saved = torch.stack([best["heads.calibration_a"], best["heads.calibration_b"]]).double()
    assert torch.allclose(saved, torch.tensor(fitted, dtype=torch.float64))
    assert (run / "best").resolve().name == f"best.step-{summary['best/step']}.calibrated"
    # Weights from a calibrated run bring its map along; a new fit starts again from the raw logits.
    again = tmp_path / "again"
    proc = rankmix(*common, f"--data.valid_path={test_split}", "--train.calibrate=bias", f"--train.run_dir={again}",
                   f"--checkpoint.load_path={run / 'best'}", "--checkpoint.load_mode=weights", "--train.steps=1")
    assert proc.returncode == 0, proc.stderr
    refit = json.loads((again / "summary.json").read_text())
    assert refit["click/calibration"] == pytest.approx(1.0, abs=1e-3) and refit["click/calibration_a"] == 1.0


def test_calibrate_needs_a_validation_split(tmp_path):
    proc = rankmix("train", "--config", "configs/debug.toml", "--train.calibrate=bias",
                   f"--train.run_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("rankmix: error: train.calibrate is set, but it fits on the validation split, "
                                   "and there is none (data.valid_fraction or data.valid_path); remove it")
