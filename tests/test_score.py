"""`rankmix score`: predictions written row for row, the same metrics as the trainer's
evaluation, the MoE's inference router, and clear errors."""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from cli import rankmix

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict, Path]:
    """(run folder, its summary, the held-out split) of a short MoE run."""
    root = tmp_path_factory.mktemp("score")
    proc = rankmix("train", "--config", "configs/debug.toml", "--model.tower=rankmixer_moe", "--train.steps=30",
                   f"--train.run_dir={root}/run", f"--data.cache_dir={root}/data", "--metrics.progress=false",
                   "--metrics.tensorboard=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    valid = next((root / "data").glob("*/valid"))
    return root / "run", json.loads(proc.stdout.splitlines()[-1]), valid


@pytest.mark.trained
def test_scores_match_the_trainers_evaluation_row_for_row(run, tmp_path):
    run_dir, summary, valid = run
    proc = rankmix("score", "--checkpoint", str(run_dir), "--data", str(valid), "--out", str(tmp_path),
                   "--keep", "item_id")
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = json.loads(proc.stdout.splitlines()[-1])
    source = pq.read_table(valid)
    out = pq.read_table(tmp_path)
    assert out.column_names == ["click", "like", "user_id", "item_id", "pred_click", "pred_like"]
    assert out.num_rows == source.num_rows == scored["rows"]
    for column in ("click", "user_id", "item_id"):  # same rows, same order
        assert out.column(column).equals(source.column(column))
    assert 0 < min(out.column("pred_click").to_pylist()) and max(out.column("pred_click").to_pylist()) < 1
    # The trainer's final evaluation ran the same model (sparse inference) on the same split.
    for key in ("auc", "uauc", "logloss", "like/auc"):
        assert scored[key] == pytest.approx(summary[key], abs=1e-6), key
    # Per-batch means: the trainer's batches are other sizes (and padded), so only close.
    assert scored["moe/active_ratio"] == pytest.approx(summary["moe/active_ratio"], abs=0.01)
    assert scored["moe/active_ratio"] < 0.9


@pytest.mark.trained
def test_dense_inference_is_a_different_router(run, tmp_path):
    run_dir, summary, valid = run
    scored = {}
    for router in ("sparse", "dense"):
        proc = rankmix("score", "--checkpoint", str(run_dir), "--data", str(valid), "--out", str(tmp_path / router),
                       f"--model.moe.inference={router}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        scored[router] = json.loads(proc.stdout.splitlines()[-1])
    assert "moe/active_ratio" not in scored["dense"]  # every expert ran
    sparse, dense = (pq.read_table(tmp_path / router).column("pred_click").to_numpy() for router in ("sparse", "dense"))
    # Measured, the two routers' predictions of a row differ by 0.008 on average (up to 0.05);
    # the same router summing its experts in another order differs by rounding, about 1e-7.
    # The AUCs differ by 4e-5 only: they cannot tell the routers apart.
    assert np.abs(dense - sparse).mean() > 0.001, np.abs(dense - sparse).mean()
    assert abs(scored["dense"]["auc"] - summary["auc"]) < 0.05


@pytest.mark.parametrize("args,message", [
    (["--keep", "nope"], "--keep names missing columns ['nope']"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--model.moe.inference=maybe"], "model.moe.inference"),
])
def test_bad_options_are_one_line_errors(run, tmp_path, args, message):
    run_dir, _, valid = run
    proc = rankmix("score", "--checkpoint", str(run_dir), "--data", str(valid), "--out", str(tmp_path), *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_checkpoint_outside_a_run_folder_needs_a_config(tmp_path):
    proc = rankmix("score", "--checkpoint", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert f"no config.toml in {tmp_path} or the two folders above it; pass --config" in proc.stderr
