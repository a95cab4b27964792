"""data.split = time (trainer/data/time_split.py): one log cut by its time column into training,
validation (the latest training rows) and test (the rows at and after the cut), on real Parquet
files, against a split computed here with numpy; and a two-rank run that trains on it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli import rankmix_ranks
from test_lifecycle import signalled
from trainer.config import DataConfig
from trainer.config_loader import load_config
from trainer.data.time_split import cache_key, input_digests, write_time_split
from trainer.offline.time_cut import time_cut

REPO = Path(__file__).resolve().parents[1]


def _log(folder: Path, times: list[np.ndarray], row_group_size: int = 7) -> str:
    """One file per array of `times`, each row's id its place in the whole log; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for i, t in enumerate(times):
        ids = np.arange(start, start + t.size)
        start += t.size
        path = folder / f"part-{i}.parquet"
        pq.write_table(pa.table({"row": ids, "ts": t, "x": ids * 0.5}), path, row_group_size=row_group_size)
        paths.append(str(path))
    return ",".join(paths)


def _split_rows(out: Path, split: str) -> np.ndarray:
    files = sorted((out / split).glob("*.parquet"))
    return np.concatenate([pq.read_table(f).column("row").to_numpy() for f in files]) if files else np.array([], int)


def _reference(times: np.ndarray, share: float) -> int:
    """The cut as the docstring says it, by a sort and a scan: the first time at or above the quantile."""
    q = np.quantile(times, share)
    return int(min(t for t in times if t >= q))


@pytest.mark.parametrize("valid_fraction", [0.0, 0.25])
def test_a_cut_by_share_puts_the_past_in_training_the_latest_of_it_in_validation_the_future_in_test(
        tmp_path, valid_fraction):
    rng = np.random.default_rng(0)
    # two files whose times interleave (a log is not sorted across files), with ties at many times
    times = [rng.integers(1_000, 1_060, 53), rng.integers(1_000, 1_060, 41)]
    every = np.concatenate(times)
    data = DataConfig(time_column="ts", split="time", split_at=0.7, valid_fraction=valid_fraction)
    summary = write_time_split(tmp_path / "out", _log(tmp_path / "log", times), data)

    cut = _reference(every, 0.7)
    before = every[every < cut]
    valid_cut = _reference(before, 1 - valid_fraction) if valid_fraction else cut
    expected = {"train": np.flatnonzero(every < valid_cut),
                "valid": np.flatnonzero((every >= valid_cut) & (every < cut)), "test": np.flatnonzero(every >= cut)}
    for split, rows in expected.items():
        assert sorted(_split_rows(tmp_path / "out", split)) == rows.tolist(), split
        assert summary["rows"][split] == rows.size
    assert summary["cut"] == cut and summary["valid_cut"] == (valid_cut if valid_fraction else None)
    assert summary["time_column"] == "ts" and summary["inputs"] == [str(tmp_path / "log" / f"part-{i}.parquet")
                                                                     for i in range(2)]
    assert (tmp_path / "out" / "valid").exists() == bool(valid_fraction)
    # every column of a row travels with it
    table = pq.read_table(tmp_path / "out" / "test")
    assert table.column("x").to_numpy().tolist() == (table.column("row").to_numpy() * 0.5).tolist()
    assert table.column("ts").to_numpy().min() == cut > before.max()


def test_a_cut_at_a_time_keeps_that_time_on_the_test_side(tmp_path):
    times = [np.array([5, 6, 7, 7, 8, 9, 10])]
    data = DataConfig(time_column="ts", split="time", split_at=7)
    summary = write_time_split(tmp_path / "out", _log(tmp_path / "log", times, row_group_size=3), data)
    assert summary["rows"] == {"train": 2, "valid": 0, "test": 5} and summary["cut"] == 7
    assert _split_rows(tmp_path / "out", "test").tolist() == [2, 3, 4, 5, 6]


def test_a_cut_at_the_last_time_leaves_its_rows_alone_to_test(tmp_path):
    data = DataConfig(time_column="ts", split="time", split_at=9)
    summary = write_time_split(tmp_path / "out", _log(tmp_path / "log", [np.array([9, 5, 9, 7])]), data)
    assert summary["rows"] == {"train": 2, "valid": 0, "test": 2}
    assert _split_rows(tmp_path / "out", "test").tolist() == [0, 2]


def test_a_cut_at_the_first_second_is_a_time_not_a_share(tmp_path):
    data = DataConfig(time_column="ts", split="time", split_at=1)
    summary = write_time_split(tmp_path / "out", _log(tmp_path / "log", [np.array([0, 1, 2])]), data)
    assert summary["cut"] == 1 and summary["rows"] == {"train": 1, "valid": 0, "test": 2}


def test_the_cache_key_follows_the_bytes_the_column_and_the_cuts(tmp_path):
    paths = _log(tmp_path / "log", [np.arange(10)])
    data = DataConfig(time_column="ts", split="time", split_at=0.5)
    key = cache_key(input_digests(paths, data), data)
    assert key == cache_key(input_digests(paths, data), data)
    assert len(key) == 16 and int(key, 16) >= 0  # 64 bits of the digest name the folder
    assert key != cache_key(input_digests(paths, data), DataConfig(time_column="ts", split="time", split_at=0.6))
    assert key != cache_key(input_digests(paths, data), DataConfig(time_column="ts", split="time", split_at=0.5,
                                                                   valid_fraction=0.1))
    _log(tmp_path / "log", [np.arange(1, 11)])  # the same size and name, other bytes
    assert key != cache_key(input_digests(paths, data), data)


@pytest.mark.parametrize(("times", "data", "message"), [
    ([np.array([3, 3, 3, 9])], DataConfig(time_column="ts", split="time", split_at=0.5),
     "data.split_at=0.5 leaves a split empty: 4 rows, 2 distinct times"),
    ([np.array([], np.int64)], DataConfig(time_column="ts", split="time", split_at=0.5),
     "data.split_at=0.5 leaves a split empty: 0 rows, 0 distinct times"),
    ([np.array([3, 4, 5])], DataConfig(time_column="ts", split="time", split_at=100),
     "data.split_at=100 leaves a split empty: of 3 rows, 3 are before it (ts from 3 to 5)"),
    ([np.array([3, 4, 5])], DataConfig(time_column="ts", split="time", split_at=3),
     "data.split_at=3 leaves a split empty: of 3 rows, 0 are before it (ts from 3 to 5)"),
    ([np.array([], np.int64)], DataConfig(time_column="ts", split="time", split_at=3),
     "data.split_at=3 leaves a split empty: of 0 rows, 0 are before it (no rows)"),
    ([np.array([2, 2, 2, 5])], DataConfig(time_column="ts", split="time", split_at=0.9, valid_fraction=0.2),
     "data.valid_fraction=0.2 leaves a split empty: 3 rows, 1 distinct times"),
])
def test_a_cut_that_empties_a_split_is_refused_naming_the_option(tmp_path, times, data, message):
    with pytest.raises(ValueError) as e:
        write_time_split(tmp_path / "out", _log(tmp_path / "log", times), data)
    assert str(e.value) == message
    assert not (tmp_path / "out").exists()


def test_times_are_checked_as_the_reader_checks_them(tmp_path):
    data = DataConfig(time_column="ts", split="time", split_at=0.5)
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"ts": pa.array([1, None, 3], pa.int64())}), path)
    with pytest.raises(ValueError) as e:
        write_time_split(tmp_path / "out", str(path), data)
    assert str(e.value) == f"{path}, column 'ts': null request time at row 1"
    pq.write_table(pa.table({"ts": [1.0, 2.0]}), path)
    with pytest.raises(ValueError) as e:
        write_time_split(tmp_path / "out", str(path), data)
    assert str(e.value) == f"{path}, column 'ts': request times must be integers (seconds), got double"
    pq.write_table(pa.table({"when": [1, 2]}), path)
    with pytest.raises(ValueError) as e:
        write_time_split(tmp_path / "out", str(path), data)
    assert str(e.value) == f"{path}: no column 'ts' (data.time_column) to split by time"
    path.write_bytes(b"not a parquet file")
    with pytest.raises(ValueError) as e:
        write_time_split(tmp_path / "out", str(path), data)
    assert str(e.value) == (f"{path}: cannot read column 'ts': Parquet magic bytes not found in footer. Either "
                            "the file is corrupted or this is not a parquet file.")
    pq.write_table(pa.table({"ts": pa.array([1, -4], pa.int64())}), path)
    with pytest.raises(ValueError) as e:
        write_time_split(tmp_path / "out", str(path), data)
    assert str(e.value) == (f"{path}, column 'ts': request time -4 at row 1 is outside 0 <= t < 2^62 "
                            "(docs/data.md, Sequences)")


def test_time_cut_rounds_up_to_a_time_of_the_log():
    times = np.array([1, 2, 2, 2, 9])
    assert time_cut(times, 0.5, "x=1") == 2 == _reference(times, 0.5)
    assert time_cut(times, 0.9, "x=1") == 9 == _reference(times, 0.9)


@pytest.mark.parametrize(("overrides", "message"), [
    (["--data.split=time"], "data.split=time cuts the log by data.time_column, which is empty: name the column "
                            "of each row's time (integer seconds)"),
    (["--data.split=time", "--data.time_column=t", "--data.split_at=1.5"],
     "data.split_at=1.5 must be a share of the rows (0 < x < 1) or a whole time in the column's unit (>= 1)"),
    (["--data.split=time", "--data.time_column=t", "--data.split_at=0"],
     "data.split_at=0 must be a share of the rows (0 < x < 1) or a whole time in the column's unit (>= 1)"),
    (["--data.split=time", "--data.time_column=t", "--data.split_at=nan"],
     "data.split_at=nan must be a share of the rows (0 < x < 1) or a whole time in the column's unit (>= 1)"),
    (["--data.split=time", "--data.time_column=t", "--data.valid_path=v"],
     "data.split=time makes the validation split from the log (data.valid_fraction): data.valid_path must be "
     "empty"),
    (["--data.split=time", "--data.time_column=t", "--data.order=time"],
     "data.split=time judges a model on the future of its log; data.order=time trains on the log as it arrives "
     "and evaluates on each next partition (metrics.eval_next_partition): choose one"),
    (["--data.split=weekly"], None),
])
def test_split_options_are_checked_naming_them(overrides, message):
    with pytest.raises(ValueError) as e:
        load_config(None, overrides)
    if message is None:  # the Literal's own message names the choices
        assert "data.split" in str(e.value) and "'given'" in str(e.value) and "'time'" in str(e.value)
    else:
        assert str(e.value) == message
    assert load_config(None, ["--data.split=time", "--data.time_column=t", "--data.split_at=1700000000"])


def test_two_ranks_train_on_the_past_validate_on_its_latest_rows_and_test_on_the_future(tmp_path):
    run = tmp_path / "run"
    args = [f"--config={REPO / 'configs' / 'sequence.toml'}", "--data.synth_rows=4000", "--data.split=time",
            "--data.split_at=0.75", "--data.valid_fraction=0.2", f"--data.cache_dir={tmp_path / 'cache'}",
            f"--train.run_dir={run}", "--train.epochs=1", "--metrics.progress=false",
            "--metrics.tensorboard=false", "--checkpoint.enabled=false"]
    done = rankmix_ranks(2, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    folder, = (tmp_path / "cache").glob("time-split-*")
    made = json.loads((folder / "_SUCCESS").read_text())
    rows = made["rows"]
    assert rows["train"] + rows["valid"] + rows["test"] == 4000 and min(rows.values()) > 0
    assert done.stdout.count("data.split=time: cut at request_time=") == 1  # rank 0 says it once
    assert (f"data.split=time: cut at request_time={made['cut']}: {rows['train']} training, {rows['valid']} "
            f"validation, {rows['test']} test rows ({folder})") in done.stdout
    summary = json.loads((run / "summary.json").read_text())
    # training read the whole training split: no row group's tail held out again for validation
    assert summary["data/rows"] == rows["train"]


def test_a_run_stopped_and_resumed_on_a_split_made_again_trains_as_an_unbroken_one(tmp_path):
    """A second run reads the split the first made; the split's folder is then deleted between
    the stop and the resume: the split is made again from the same log, byte for byte (the resume
    checks every training file's sha256), and the resumed run's losses and validations equal the
    unbroken run's."""
    args = [f"--config={REPO / 'configs' / 'sequence.toml'}", "--data.synth_rows=4000", "--data.split=time",
            "--data.valid_fraction=0.2", f"--data.cache_dir={tmp_path / 'cache'}", "--train.epochs=1",
            "--data.batch_size=64", "--metrics.valid_every=10", "--metrics.progress=false", "--metrics.log_every=1",
            "--metrics.tensorboard=false", "--checkpoint.interval=5"]

    def records(run, kind):
        return [{k: v for k, v in r.items() if k != "time"}
                for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]

    whole = rankmix_ranks(1, *args, f"--train.run_dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-3000:]
    folder, = (tmp_path / "cache").glob("time-split-*")
    digests = {p.name: p.read_bytes() for p in folder.rglob("*.parquet")}
    mtimes = sorted(p.stat().st_mtime_ns for p in folder.rglob("*.parquet"))
    stopped, _ = signalled(1, tmp_path / "resumed", [*args, f"--train.run_dir={tmp_path / 'resumed'}"], after_step=23)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    # the second run read the split made: no second folder, the same files untouched
    assert [folder] == list((tmp_path / "cache").glob("time-split-*"))
    assert mtimes == sorted(p.stat().st_mtime_ns for p in folder.rglob("*.parquet"))
    shutil.rmtree(folder)
    resumed = rankmix_ranks(1, *args, f"--train.run_dir={tmp_path / 'resumed'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in folder.rglob("*.parquet")} == digests
    assert records(tmp_path / "resumed", "valid") == records(tmp_path / "whole", "valid")
    losses = {r["step"]: r["loss"] for r in records(tmp_path / "whole", "train")}
    assert {r["step"]: r["loss"] for r in records(tmp_path / "resumed", "train")} == losses
    assert [r["step"] for r in records(tmp_path / "whole", "valid")][:4] == [10, 20, 30, 40]
