"""Model selection: a validation split carved from the training files, validation every
epoch, early stopping, the best weights restored, the test split measured on them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli import rankmix
from cli import rankmix_ranks as train_ranks
from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec
from test_lifecycle import signalled
from trainer.components.selection import BestPoint
from trainer.config_loader import load_config
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader


def test_best_point_follows_the_metric_direction_and_runs_out_of_patience():
    auc = BestPoint("auc", patience=2)
    assert [auc.update({"auc": v}, step, step / 10) for step, v in
            [(10, 0.6), (20, 0.7), (30, math.nan), (40, 0.65)]] == [True, True, False, False]
    assert (auc.step, auc.value, auc.epochs, auc.since, auc.exhausted) == (20, 0.7, 2.0, 2, True)
    loss = BestPoint("logloss", patience=0)
    assert [loss.update({"logloss": v}, s, 0.0) for s, v in [(1, 0.5), (2, 0.4), (3, 0.45)]] == [True, True, False]
    assert loss.step == 2 and not loss.exhausted  # patience 0 never stops
    again = BestPoint("auc", patience=2)
    again.load_state_dict(auc.state_dict())
    assert again == auc


def _files(folder: Path, sizes: list[int]) -> str:
    """One file per size, one row group each; `id` numbers the rows in order."""
    folder.mkdir()
    start = 0
    for i, n in enumerate(sizes):
        ids = np.arange(start, start + n)
        pq.write_table(pa.table({"id": ids, "click": ids % 2}), folder / f"part-{i}.parquet", row_group_size=n)
        start += n
    return str(folder)


@pytest.mark.parametrize("world", [1, 3])
def test_holdout_is_the_tail_of_every_row_group_and_disjoint_from_training(tmp_path, world):
    path = _files(tmp_path / "d", [100, 37, 64])
    encoder = RowEncoder([FeatureSpec(name="id", num_embeddings=1000, hashing="none")], [TaskSpec("click")], "")

    def rows(holdout: bool) -> list[int]:
        out = []
        for rank in range(world):
            reader = ParquetReader(path, encoder, ReaderOptions(batch_size=7, shuffle=False, drop_last=False, rank=rank,
                                                                world_size=world, holdout_fraction=0.25,
                                                                holdout=holdout))
            for batch in reader:
                ids = batch.sparse.to_dict()["id"].values()  # one id per row
                out += ids[batch.weights > 0].tolist()
        return sorted(out)

    with pytest.raises(ValueError, match=r"a holdout of 0.005 of every row group leaves no held-out rows"):
        # int(100 * 0.005) = 0
        ParquetReader(path, encoder, ReaderOptions(batch_size=7, holdout_fraction=0.005, holdout=True))
    held, trained = rows(True), rows(False)
    # int(n * 0.25) rows at the end of each row group: 25 of 100, 9 of 37, 16 of 64
    assert held == [*range(75, 100), *range(128, 137), *range(185, 201)]
    assert sorted(held + trained) == list(range(201))


def test_bad_holdout_settings_are_one_line_errors():
    with pytest.raises(ValueError, match=r"data.valid_fraction=1.0 must be a share of the rows in \[0, 1\)"):
        load_config(None, ["--data.valid_fraction=1.0"])
    with pytest.raises(ValueError, match="data.valid_path and data.valid_fraction are both set"):
        load_config(None, ["--data.valid_fraction=0.1", "--data.valid_path=x"])
    with pytest.raises(ValueError, match="train.early_stopping_patience needs a validation split"):
        load_config(None, ["--train.early_stopping_patience=2"])
    with pytest.raises(ValueError, match=r"train.select_metric must be one of \('auc', 'logloss'\), got 'ne'"):
        load_config(None, ["--train.select_metric=ne"])


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    """(run folder, summary, validation records) of a run that stops early: a learning rate
    high enough to overfit the small debug log within a few epochs."""
    run = tmp_path_factory.mktemp("selection") / "run"
    proc = rankmix("train", "--config", "configs/debug.toml", "--train.steps=0", "--train.epochs=8",
                   "--data.valid_fraction=0.1", "--train.early_stopping_patience=1", "--optim.lr=0.02",
                   "--embeddings.lr=0.5", f"--train.run_dir={run}", f"--data.cache_dir={run.parent / 'cache'}",
                   "--metrics.progress=false", "--metrics.tensorboard=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return run, summary, [r for r in records if r["kind"] == "valid"]


@pytest.mark.trained  # that the run overfits within 8 epochs: at this learning rate it does by epoch 3
def test_validation_every_epoch_stops_after_the_patience_and_keeps_the_best(stopped):
    run, summary, valid = stopped
    steps_per_epoch = valid[0]["step"]
    assert [r["step"] for r in valid] == [steps_per_epoch * (i + 1) for i in range(len(valid))]
    assert [r["epochs"] for r in valid] == [float(i + 1) for i in range(len(valid))]
    best = max(valid, key=lambda r: r["auc"])
    assert summary["stopped_early"] and len(valid) < 8
    # patience 1: training ends at the first validation that is not the best
    assert valid[-1]["auc"] < best["auc"] and valid[-2] is best
    assert summary["steps"] == valid[-1]["step"] and summary["epochs"] == len(valid)
    assert (summary["best/step"], summary["best/epochs"], summary["valid/auc"]) == \
        (best["step"], best["epochs"], best["auc"])
    for key in ("ne", "calibration", "click/ne", "like/calibration", "valid/ne"):
        assert math.isfinite(summary[key]), key


def test_the_test_metrics_are_those_of_the_best_weights(stopped, tmp_path):
    """`rankmix score` of the saved best weights on the test split gives the run's summary."""
    run, summary, _ = stopped
    assert summary["best/restored"]
    cache = run.parent / "cache"
    test_split = next(cache.glob("synth-*")) / "valid"
    proc = rankmix("score", "--checkpoint", str(run / "best"), "--data", str(test_split),
                   "--out", str(tmp_path / "scored"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("auc", "logloss", "ne", "calibration", "like/auc"):
        assert scored[key] == pytest.approx(summary[key], abs=1e-6), key


def test_a_resumed_run_keeps_its_best_point_and_ends_as_an_uninterrupted_one(tmp_path):
    """The best validation, its weights and the patience count survive a restart: the run
    stopped after epoch 1 and resumed ends bitwise where the uninterrupted one does."""
    def train(run, *extra):
        proc = rankmix("train", "--config", "configs/debug.toml", "--train.steps=0", "--train.epochs=3",
                       "--data.valid_fraction=0.1", "--train.early_stopping_patience=5", f"--train.run_dir={run}",
                       f"--data.cache_dir={tmp_path / 'cache'}", "--metrics.progress=false",
                       "--metrics.tensorboard=false", "--checkpoint.interval=63", *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((run / "summary.json").read_text())
    whole = train(tmp_path / "whole")
    assert whole["steps"] == 3 * 63  # 63 steps an epoch: the interval saves at each epoch's end
    train(tmp_path / "resumed", "--train.steps=63")  # stops after epoch 1, with a checkpoint and best/
    resumed = train(tmp_path / "resumed")
    keys = ("auc", "logloss", "best/step", "best/epochs", "best/restored", "valid/auc", "valid/logloss", "steps")
    assert {k: resumed[k] for k in keys} == {k: whole[k] for k in keys}


def test_validation_inside_the_epoch_resumes_between_two_validations_as_an_unbroken_run(tmp_path):
    """metrics.valid_every_epochs=0.25 validates every 16 of an epoch's 63 steps; a run stopped by
    SIGTERM after step 20, between two validations, and resumed validates, picks, stops early and
    restores bit for bit as the run never stopped (every loss and validation figure equal)."""
    args = ["--config", "configs/debug.toml", "--train.steps=0", "--train.epochs=2", "--data.valid_fraction=0.1",
            "--metrics.valid_every_epochs=0.25", "--train.early_stopping_patience=3",
            f"--data.cache_dir={tmp_path / 'cache'}", "--metrics.progress=false", "--metrics.log_every=1",
            "--metrics.tensorboard=false"]

    def records(run, kind):
        return [{k: v for k, v in r.items() if k != "time"}
                for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]

    def train(run):
        proc = rankmix("train", *args, f"--train.run_dir={run}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads((run / "summary.json").read_text())

    whole = train(tmp_path / "whole")
    stopped, logged = signalled(1, tmp_path / "resumed", [*args, f"--train.run_dir={tmp_path / 'resumed'}"],
                                after_step=20)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert 20 <= max(r["step"] for r in logged if r["kind"] == "train") < whole["steps"]
    resumed = train(tmp_path / "resumed")
    valid = records(tmp_path / "whole", "valid")
    assert [r["step"] for r in valid][:4] == [16, 32, 48, 64]
    assert records(tmp_path / "resumed", "valid") == valid
    losses = {r["step"]: r["loss"] for r in records(tmp_path / "whole", "train")}
    assert {r["step"]: r["loss"] for r in records(tmp_path / "resumed", "train")} == losses
    keys = ("auc", "logloss", "best/step", "best/epochs", "best/restored", "valid/auc", "steps")
    assert {k: resumed[k] for k in keys} == {k: whole[k] for k in keys}


@pytest.mark.parametrize(("overrides", "message"), [
    (["--metrics.valid_every_epochs=-0.5"], "metrics.valid_every_epochs=-0.5 must be a share of an epoch >= 0"),
    (["--metrics.valid_every_epochs=0.5", "--metrics.valid_every=10"],
     "metrics.valid_every and metrics.valid_every_epochs are both set: give the schedule one way"),
])
def test_a_validation_schedule_given_twice_or_negative_is_refused(overrides, message):
    with pytest.raises(ValueError) as e:
        load_config(None, overrides)
    assert str(e.value) == message


def test_two_ranks_validate_every_held_out_row_once_and_restore_the_best(tmp_path):
    run = tmp_path / "run"
    proc = train_ranks(2, "--config", "configs/debug.toml", "--train.steps=0", "--train.epochs=2",
                       "--data.valid_fraction=0.1", f"--train.run_dir={run}", f"--data.cache_dir={tmp_path / 'cache'}",
                       "--metrics.progress=false", "--metrics.tensorboard=false", "--checkpoint.enabled=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    valid = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "valid"]
    # every held-out row once per validation: int(n / 10) of each training row group of n rows
    groups = [g.num_rows for f in (next((tmp_path / "cache").glob("synth-*")) / "train").glob("*.parquet")
              for g in (pq.ParquetFile(f).metadata.row_group(i) for i in range(pq.ParquetFile(f).num_row_groups))]
    assert [r["examples"] for r in valid] == [sum(n // 10 for n in groups)] * 2
    summary = json.loads((run / "summary.json").read_text())
    best = max(valid, key=lambda r: r["auc"])
    assert summary["best/step"] == best["step"] and summary["valid/auc"] == best["auc"]
    assert summary["best/restored"] == (best is valid[0])


def test_a_validation_split_without_rows_is_an_error_before_training(tmp_path):
    proc = rankmix("train", "--config", "configs/debug.toml", "--data.valid_fraction=0.00001",
                   f"--train.run_dir={tmp_path / 'run'}", f"--data.cache_dir={tmp_path / 'cache'}",
                   "--metrics.progress=false")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "train: a holdout of 1e-05 of every row group leaves no held-out rows")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
