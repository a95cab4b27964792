"""A calibrated model's map (train.calibrate, trainer/components/calibration.py) is carried through
`rankmix score --checkpoint`, `rankmix export` (pt2 and TorchScript) and `rankmix score
--model` (issue 39): every score is sigmoid(a z + b) of the raw logit z of the same weights,
with the (a, b) the run fitted, and far from the identity map's sigmoid(z).

The raw logits come from the run's own last checkpoint: with a single validation at the last
step the best weights are the last ones, saved before the fit, so `checkpoints/step-N` holds
the weights of `best` with the identity map (asserted)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from cli import rankmix
from test_serving import export, ok, score
from trainer.checkpoint import manager

STEPS = 20
TASKS = ("click", "like")


@pytest.fixture(scope="module")
def calibrated(made_once) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """(run folder, held-out split, the identity map's probabilities by task over it) of a
    short debug-config run fitted with train.calibrate=platt, made once."""
    def make(folder: Path) -> None:
        ok(rankmix("train", "--config", "configs/debug.toml", "--data.synth_rows=6000", "--data.valid_fraction=0.2",
                   f"--train.steps={STEPS}", f"--metrics.valid_every={STEPS}", "--train.calibrate=platt",
                   "--metrics.progress=false", "--metrics.tensorboard=false", f"--train.run_dir={folder / 'run'}",
                   f"--data.cache_dir={folder / 'data'}"))
    folder = made_once("calibration-carried", make)
    run, valid = folder / "run", next((folder / "data").glob("*/valid"))
    _, raw = score("--checkpoint", run / "checkpoints" / f"step-{STEPS}", valid, folder / "raw.parquet")
    return run, valid, raw


def _expected(run: Path, raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """sigmoid(a z + b) of the raw logits, with the map the run's `best` holds, after checking
    that `best` is the last step's weights plus a map that is not the identity."""
    best, last = manager.model_tensors(run / "best"), manager.model_tensors(
        run / "checkpoints" / f"step-{STEPS}")
    a, b = best.pop("heads.calibration_a").double(), best.pop("heads.calibration_b").double()
    assert torch.equal(last.pop("heads.calibration_a"), torch.ones(2))
    assert torch.equal(last.pop("heads.calibration_b"), torch.zeros(2))
    assert best.keys() == last.keys() and all(torch.equal(best[k], last[k]) for k in best)
    assert (a - 1).abs().min() > 0.01 and b.abs().min() > 0.01, (a, b)
    z = {task: torch.logit(torch.tensor(raw[f"pred_{task}"], dtype=torch.float64)) for task in TASKS}
    return {f"pred_{task}": torch.sigmoid(a[k] * z[task] + b[k]).numpy() for k, task in enumerate(TASKS)}


def _assert_calibrated(got: dict[str, np.ndarray], expected: dict[str, np.ndarray],
                       raw: dict[str, np.ndarray]) -> None:
    for column, want in expected.items():
        np.testing.assert_allclose(got[column], want, atol=1e-5, rtol=0)
        assert np.abs(got[column] - raw[column]).max() > 0.01, column  # not the identity map's


def test_scoring_a_checkpoint_applies_its_map(calibrated, tmp_path):
    run, valid, raw = calibrated
    _, got = score("--checkpoint", run / "best", valid, tmp_path / "scored.parquet")
    _assert_calibrated(got, _expected(run, raw), raw)


@pytest.mark.parametrize("fmt", ["pt2", "torchscript"])
def test_an_exported_artifact_serves_the_map(calibrated, tmp_path, fmt):
    run, valid, raw = calibrated
    export(run / "best", tmp_path / "model", "--format", fmt)
    _, got = score("--model", tmp_path / "model", valid, tmp_path / "scored.parquet")
    _assert_calibrated(got, _expected(run, raw), raw)
