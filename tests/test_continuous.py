"""Continuous training (docs/continuous.md): what was read is part of the checkpoint, in
shuffled and time order alike."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cli import rankmix
from cli import rankmix_ranks as train
from test_checkpoint import REPO, ok, tensors, train_args
from trainer.checkpoint.manager import complete_steps
from trainer.checkpoint.state import decode_state
from trainer.config_loader import dump_toml, load_config
from trainer.data.datasets import synth_features
from trainer.metrics.ranking import auc, calibration, logloss, normalized_entropy
from trainer.offline.synth import day_teachers, teacher_click_logit, write_days


def resume_error(proc) -> str:
    """The one `rankmix: error:` line of a refused resume (exit 2, no traceback)."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stderr.strip().splitlines()[-1]


def described(path: Path) -> str:
    """A file as the reader's messages describe it, from its footer."""
    meta = pq.ParquetFile(path).metadata
    rows = sum(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
    return f"{path.stat().st_size} bytes in {meta.num_row_groups} row group(s) of {rows} rows"


def test_shuffled_resume_refuses_a_replaced_or_added_file(tmp_path):
    cache, run = tmp_path / "cache", tmp_path / "run"
    ok(train(1, *train_args(run, cache, 3)))
    part = next((cache).glob("synth-*/train")) / "part-00003.parquet"
    table, original = pq.read_table(part), part.read_bytes()
    before = described(part)
    pq.write_table(table, part, compression="zstd")  # the same rows and row groups, other bytes
    message = resume_error(train(1, *train_args(run, cache, 6)))
    saved = f"rankmix: error: {run / 'checkpoints' / 'step-3'} data reader state was saved over other files"
    assert message == (f"{saved}: {part} changed from {before} "
                       f"to {described(part)}; the saved position cannot be honoured (a run's input must not "
                       "change; see docs/continuous.md)")
    part.write_bytes(original)  # the same rows rewritten by another writer would be another file
    pq.write_table(table, part.with_name("part-00004.parquet"))
    message = resume_error(train(1, *train_args(run, cache, 6)))
    assert message == (f"{saved}: {part.with_name('part-00004.parquet')} was added; the saved position cannot be "
                       "honoured (a run's input must not change; see docs/continuous.md)")


# ----------------------------------------------------------------------------- time order

ROWS_PER_DAY = 2_000  # 7 steps of 256 rows at 1 rank, 3 at 2 ranks


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """configs/debug.toml on user files with the synthetic schema."""
    path = tmp_path_factory.mktemp("config") / "config.toml"
    cfg = load_config(str(REPO / "configs" / "debug.toml"), ["--data.dataset=parquet"])
    cfg.features = synth_features()
    dump_toml(cfg, path)
    return path


def days(folder: Path, n: int, complete: int | None = None) -> list[str]:
    """`n` drifting days in `folder`, the first `complete` of them (all by default) with _SUCCESS."""
    names = write_days(folder, days=n, drift=0.2, rows=ROWS_PER_DAY, files=2)["partitions"]
    for name in names[n if complete is None else complete:]:
        (folder / name / "_SUCCESS").unlink()
    return names


def time_args(config: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return ["--config", str(config), "--data.order=time", f"--data.train_path={data}",
            f"--data.eval_path={data}/date=2026-01-01", f"--train.run_dir={run}", "--train.steps=0",
            "--metrics.progress=false", "--metrics.tensorboard=false", "--metrics.log_every=1", *extra]


def records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def consumed(run: Path, tmp: Path) -> list[str]:
    """The partitions the newest checkpoint of `run` records as trained (rank 0's)."""
    step = run / "checkpoints" / f"step-{complete_steps(run / 'checkpoints')[-1]}"
    reader = decode_state(tensors(step, tmp)["ranks"], str(step))[0]["reader"]
    return [c["partition"] for c in reader["consumed"]]


@pytest.mark.slow
def test_time_order_trains_each_complete_partition_once_in_key_order(config, tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    names = days(data, 4, complete=2)  # days 3 and 4 are still being written
    ok(train(1, *time_args(config, data, run)))
    assert [(r["step"], r["partition"]) for r in records(run, "progressive")] == [(7, names[0]), (14, names[1])]
    assert [(r["partition"], r["rows"], r["rows_trained"]) for r in records(run, "data")] == \
        [(names[0], ROWS_PER_DAY, 7 * 256), (names[1], ROWS_PER_DAY, 7 * 256)]
    assert consumed(run, tmp_path) == names[:2]
    (data / names[2] / "_SUCCESS").write_text("")
    (data / names[3] / "_SUCCESS").write_text("")
    again = ok(train(1, *time_args(config, data, run)))
    assert "at step 14" in again.stdout
    assert [(r["step"], r["partition"]) for r in records(run, "progressive")][2:] == [(21, names[2]), (28, names[3])]
    assert consumed(run, tmp_path) == names
    nothing = ok(train(1, *time_args(config, data, run)))
    assert f"no new complete partition after {names[3]}" in nothing.stdout
    assert len(records(run, "progressive")) == 4


def test_time_order_refuses_a_changed_trained_partition_or_a_late_one(config, tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    names = days(data, 3, complete=2)
    ok(train(1, *time_args(config, data, run)))
    part = data / names[1] / "part-00001.parquet"
    extra = part.with_name("part-00002.parquet")
    shutil.copy(part, extra)
    saved = f"rankmix: error: {run / 'checkpoints' / 'step-14'} data reader state"
    assert resume_error(train(1, *time_args(config, data, run))) == (
        f"{saved}: partition {names[1]} was trained, but {extra} was added since; a trained partition must not "
        "change (write a new partition instead)")
    extra.unlink()
    late = data / "date=2025-12-31"
    shutil.copytree(data / names[0], late)
    assert resume_error(train(1, *time_args(config, data, run))) == (
        f"{saved}: partition date=2025-12-31 is new but sorts before the last trained partition {names[1]}: "
        "time order cannot train it")


@pytest.mark.slow
def test_time_order_resumed_at_another_world_size_trains_only_the_new_partitions(config, tmp_path):
    """Partitions end on epoch boundaries, so a world-size change between them keeps the
    record of what was trained: 2 ranks train days 1-2, 1 rank then trains day 3 alone."""
    data, run = tmp_path / "data", tmp_path / "run"
    names = days(data, 3, complete=2)
    ok(train(2, *time_args(config, data, run)))
    (data / names[2] / "_SUCCESS").write_text("")
    again = ok(train(1, *time_args(config, data, run)))
    assert "at step 6" in again.stdout  # 3 steps a day at 2 ranks
    assert [r["partition"] for r in records(run, "progressive")] == names
    assert consumed(run, tmp_path) == names


def land(staging: Path, data: Path, name: str) -> None:
    """Partition `name` arrives in `data` as a writer publishes it: files first, _SUCCESS last."""
    shutil.copytree(staging / name, data / name, ignore=shutil.ignore_patterns("_SUCCESS"))
    (data / name / "_SUCCESS").write_text("")


def wait_for(run: Path, proc: subprocess.Popen, partition: str, timeout: float = 180) -> None:
    """Until `run`'s metrics.jsonl has the progressive metrics of `partition`."""
    deadline = time.monotonic() + timeout
    while not ((run / "metrics.jsonl").exists() and any(r["partition"] == partition
                                                        for r in records(run, "progressive"))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)


@pytest.mark.slow
def test_two_ranks_follow_new_partitions_and_stop_on_sigterm(config, tmp_path):
    staging, data, run = tmp_path / "staging", tmp_path / "data", tmp_path / "run"
    names = days(staging, 3)
    data.mkdir()
    land(staging, data, names[0])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "launch", "--nproc-per-node", "2",
                             *time_args(config, data, run, "--data.follow=true", "--data.poll_seconds=0.2")],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**env, "PYTHONWARNINGS": "ignore"})
    try:
        wait_for(run, proc, names[0])
        land(staging, data, names[1])  # while the run waits
        wait_for(run, proc, names[1])
        proc.send_signal(signal.SIGTERM)  # to torchrun's agent, which passes it on to the ranks
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "rankmix: stopped: stopped by SIGTERM after step 6; resume from" in err  # 3 steps a day at 2 ranks
    assert consumed(run, tmp_path) == names[:2]
    land(staging, data, names[2])
    ok(train(2, *time_args(config, data, run)))
    assert [(r["step"], r["partition"]) for r in records(run, "progressive")] == \
        [(3, names[0]), (6, names[1]), (9, names[2])]
    assert consumed(run, tmp_path) == names


def scored(checkpoint: Path, data: Path, out: Path) -> dict[str, float]:
    """Exact AUC, NE, calibration and logloss of each task of `checkpoint` over the files in
    `data`, from the probabilities `rankmix score` writes (trainer/metrics/ranking.py)."""
    ok(rankmix("score", "--checkpoint", str(checkpoint), "--data", str(data), "--out", str(out)))
    table = pa.concat_tables(pq.read_table(f) for f in sorted(out.rglob("*.parquet")))
    figures = {}
    for task in ("click", "like"):
        probs = torch.from_numpy(table[f"pred_{task}"].to_numpy()).double()
        labels = torch.from_numpy(table[task].to_numpy()).double()
        figures |= {f"{task}/auc": auc(probs, labels), f"{task}/ne": normalized_entropy(probs, labels),
                    f"{task}/calibration": calibration(probs, labels), f"{task}/logloss": logloss(probs, labels)}
    return figures


@pytest.mark.slow
def test_two_ranks_evaluate_each_partition_before_training_it(config, tmp_path):
    """metrics.eval_next_partition: day d >= 2 scored by the model of the step before its first,
    equal to `rankmix score` of that step's checkpoint over the day's files."""
    data, run = tmp_path / "data", tmp_path / "run"
    names = days(data, 3)
    ok(train(2, *time_args(config, data, run, "--metrics.eval_next_partition=true", "--checkpoint.interval=3",
                           "--checkpoint.keep=0", "--metrics.tensorboard=true")))
    found = records(run, "next_partition")
    assert [(r["step"], r["partition"], r["epoch"], r["examples"]) for r in found] == \
        [(3, names[1], 1, ROWS_PER_DAY), (6, names[2], 2, ROWS_PER_DAY)]  # 3 steps a day at 2 ranks
    for record in found:
        reference = scored(run / "checkpoints" / f"step-{record['step']}", data / record["partition"],
                           tmp_path / f"scored-{record['step']}")
        for key, value in reference.items():
            assert record[key] == pytest.approx(value, abs=1e-4), key
        assert record["auc"] == record["click/auc"]
    board = EventAccumulator(str(run / "tb"))
    board.Reload()
    assert [e.step for e in board.Scalars("next_partition/click/auc")] == [3, 6]


def test_next_partition_evaluation_in_shuffled_order_is_one_clear_error(config, tmp_path):
    proc = rankmix("train", "--config", str(config), f"--train.run_dir={tmp_path}",
                   "--metrics.eval_next_partition=true")
    assert resume_error(proc) == ("rankmix: error: metrics.eval_next_partition is set, but data.order='shuffled' "
                                  "does not read it; remove it")


# ----------------------------------------------------------------------------- the drifting log


def teacher_auc(teacher, table) -> float:
    return auc(torch.from_numpy(teacher_click_logit(teacher, table)), torch.from_numpy(table["click"].to_numpy()))


def test_synth_days_drift_away_from_the_first_days_teacher(tmp_path):
    """The first day's teacher scores the last day's rows visibly worse under drift (0.81 ->
    0.62 at drift 0.3 over 6 days), and as well as the last day's own teacher without it; the
    spread of these AUCs over days without drift is about 0.01."""
    summaries = {}
    for drift in (0.0, 0.3):
        out = tmp_path / str(drift)
        cli = rankmix("data", "synth", "--out", str(out), "--days", "6", "--drift", str(drift), "--rows", "20000")
        assert cli.returncode == 0, cli.stderr[-3000:]
        summaries[drift] = json.loads(cli.stdout)
        names = summaries[drift]["partitions"]
        assert names == [f"date=2026-01-0{d}" for d in range(1, 7)]
        assert all((out / name / "_SUCCESS").exists() for name in names)
        teachers = day_teachers(0, 6, drift)
        first, last = pq.read_table(out / names[0]), pq.read_table(out / names[-1])
        assert teacher_auc(teachers[0], first) > 0.8
        assert teacher_auc(teachers[-1], last) > 0.8
        if drift:
            assert teacher_auc(teachers[0], last) < teacher_auc(teachers[-1], last) - 0.1
        else:
            assert teacher_auc(teachers[0], last) == teacher_auc(teachers[-1], last)
        users = [set(pq.read_table(out / name, columns=["user_id"])["user_id"].to_pylist()) for name in names]
        assert len(users[-1] - set().union(*users[:-1])) > 100  # users born on the last days


def test_synth_drift_without_days_is_one_clear_error(tmp_path):
    cli = rankmix("data", "synth", "--out", str(tmp_path), "--drift", "0.2")
    assert cli.returncode == 2 and "Traceback" not in cli.stderr
    assert cli.stderr.strip() == "rankmix: error: --drift needs --days: a single log does not drift"
