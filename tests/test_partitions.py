"""Time-ordered partitions (trainer/data/partitions.py, docs/continuous.md), in-process: which
partitions are complete, their order (integer, string and nested keys), every error the listing
and a resume give, word for word, and the progressive metrics' values against an independent
computation. Each partition's ParquetReader is a stand-in (`OnePass`) that yields its name."""

import logging
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from trainer.checkpoint.state import decode_state, encode_state
from trainer.data.partitions import Partition, PartitionedReader, list_partitions
from trainer.data.reader import EpochRows
from trainer.errors import DataUnavailableError
from trainer.metrics.progressive import ProgressiveMetrics


class OnePass:
    """A partition's stand-in for its ParquetReader: `steps` batches, each the partition's name."""

    steps = 1
    resumed = None  # a ParquetReader's epoch resumed at another world size

    def __init__(self, uri: str, name: str):
        self.name, self.step, self.loaded = name, 0, None
        self.input_files = [[str(p), p.stat().st_size, [1]] for p in sorted(Path(uri).glob("*.parquet"))]

    def steps_in_epoch(self, epoch: int) -> int:
        # a partition's reader has one epoch, 0 (which a resume at another world size may have cut
        # short), so any other is nonsense here
        return self.steps if epoch == 0 else 10**9

    def epoch_rows(self, epoch: int) -> EpochRows:
        return EpochRows(10 * len(self.input_files), self.steps) if epoch == 0 else EpochRows(0, 0)

    def __iter__(self):
        while self.step < self.steps:
            self.step += 1
            yield self.name

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.loaded, self.step = state, state["step"]


class TwoSteps(OnePass):
    steps = 2


class NoSteps(OnePass):
    """A partition of fewer rows than one batch per rank."""

    steps = 0


def land(root: Path, name: str, complete: bool = True, marker: str = "_SUCCESS", files: int = 1) -> None:
    (root / name).mkdir(parents=True)
    for i in range(files):
        pq.write_table(pa.table({"x": [1]}), root / name / f"part-{i}.parquet")
    if complete:
        (root / name / marker).write_text("")


def resumed(root: Path, state: dict, stand_in: type = OnePass) -> PartitionedReader:
    """A new run on the same folder, from the checkpoint's reader state."""
    reader = PartitionedReader(str(root), stand_in, marker="_SUCCESS")
    reader.load_state_dict(state)
    return reader


def saved(reader: PartitionedReader) -> dict:
    """The reader's state as a checkpoint keeps it."""
    return decode_state(encode_state(reader.state_dict()), "reader state")


def trained(root: Path, *names: str) -> tuple[PartitionedReader, dict]:
    """A reader that trained the partitions `names`, and its state as a checkpoint keeps it."""
    for name in names:
        land(root, name)
    reader = PartitionedReader(str(root), OnePass, marker="_SUCCESS")
    assert list(reader) == list(names)
    return reader, saved(reader)


def listed(root: Path, marker: str = "_SUCCESS") -> list[tuple[str, tuple]]:
    return [(p.name, p.key) for p in list_partitions(str(root), marker)]


def refused(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        call(*args, **kwargs)
    return str(error.value)


# ----------------------------------------------------------------------------- order

def test_integer_values_order_as_integers(tmp_path):
    for name in ("hour=10", "hour=9", "hour=-1", "hour=2"):
        land(tmp_path, name)
    assert listed(tmp_path) == [("hour=-1", (-1,)), ("hour=2", (2,)), ("hour=9", (9,)), ("hour=10", (10,))]
    reader = PartitionedReader(str(tmp_path), OnePass, marker="_SUCCESS")
    assert list(reader) == ["hour=-1", "hour=2", "hour=9", "hour=10"]


def test_a_key_with_one_value_that_is_no_integer_orders_as_strings(tmp_path):
    for name in ("hour=9", "hour=10", "hour=X"):
        land(tmp_path, name)
    assert listed(tmp_path) == [("hour=10", ("10",)), ("hour=9", ("9",)), ("hour=X", ("X",))]


def test_iso_dates_order_as_dates(tmp_path):
    for name in ("date=2026-12-01", "date=2025-12-31", "date=2026-11-30"):
        land(tmp_path, name)
    assert [name for name, _ in listed(tmp_path)] == ["date=2025-12-31", "date=2026-11-30", "date=2026-12-01"]


def test_nested_keys_order_key_by_key_each_of_its_own_kind(tmp_path):
    for name in ("date=2026-11-30/hour=10", "date=2026-12-01/hour=0", "date=2026-11-30/hour=9",
                 "date=2026-11-29/hour=23"):
        land(tmp_path, name)
    assert listed(tmp_path) == [("date=2026-11-29/hour=23", ("2026-11-29", 23)),
                                ("date=2026-11-30/hour=9", ("2026-11-30", 9)),
                                ("date=2026-11-30/hour=10", ("2026-11-30", 10)),
                                ("date=2026-12-01/hour=0", ("2026-12-01", 0))]
    reader = PartitionedReader(str(tmp_path), OnePass, marker="_SUCCESS")
    assert [reader.uri(e) for e in range(4)] == [f"{tmp_path}/{name}" for name, _ in listed(tmp_path)]
    assert list(reader) == [name for name, _ in listed(tmp_path)]


def test_values_order_url_decoded(tmp_path):
    """'a%7E' is 'a~', which sorts after 'a+' (though '%' sorts before '+'); a second '=' is the value's."""
    for name in ("k=a%7E", "k=a+", "k=b%20c", "k=a=b"):
        land(tmp_path, name)
    assert listed(tmp_path) == [("k=a+", ("a+",)), ("k=a=b", ("a=b",)), ("k=a%7E", ("a~",)), ("k=b%20c", ("b c",))]


def test_a_partitions_files_are_its_parquet_files_by_path_and_bytes(tmp_path):
    land(tmp_path, "day=1", files=2)
    (tmp_path / "day=1" / "notes.txt").write_text("not data")
    parts = [tmp_path / "day=1" / f"part-{i}.parquet" for i in range(2)]
    assert list_partitions(str(tmp_path), "_SUCCESS") == [
        Partition("day=1", (1,), tuple((str(p), p.stat().st_size) for p in parts))]


def test_a_uri_keeps_its_options_below_the_root(tmp_path):
    land(tmp_path, "day=1")
    reader = PartitionedReader(f"{tmp_path}/", OnePass, marker="_SUCCESS")
    assert reader.uri(0) == f"{tmp_path}/day=1"
    reader.root = "s3://bucket/LOGX/?endpoint_override=localhost:9000&scheme=http"
    assert reader.uri(0) == "s3://bucket/LOGX/day=1?endpoint_override=localhost:9000&scheme=http"


def test_an_unreachable_store_is_named_once_its_retries_are_spent():
    """Nothing listens on port 1 of the loopback: refused at once, by one attempt of a budget of 0 s."""
    with pytest.raises(DataUnavailableError) as error:
        PartitionedReader("s3://key:secret@bucket/logs?endpoint_override=127.0.0.1:1&scheme=http", OnePass,
                          marker="_SUCCESS", retry_seconds=0, retry_attempts=1)
    assert re.fullmatch(r"s3 endpoint 127\.0\.0\.1:1, bucket/logs: unreachable for 0\.\d s \(retry budget 0 s\): "
                        r"AWS Error NETWORK_CONNECTION during ListObjectsV2 operation: .*",
                        str(error.value)), error.value


# ----------------------------------------------------------------------------- markers

def test_only_partitions_holding_the_marker_are_complete(tmp_path):
    land(tmp_path, "hour=1")
    land(tmp_path, "hour=2", complete=False)
    land(tmp_path, "hour=3", marker="_DONE")
    land(tmp_path, "hour=4", complete=False)
    (tmp_path / "hour=4" / "_SUCCESS").mkdir()  # a folder of the marker's name is no marker
    assert [name for name, _ in listed(tmp_path)] == ["hour=1"]
    assert [name for name, _ in listed(tmp_path, "_DONE")] == ["hour=3"]


def test_an_empty_marker_takes_every_partition_as_complete(tmp_path):
    land(tmp_path, "hour=10")
    land(tmp_path, "hour=9", complete=False)
    land(tmp_path, "hour=8", marker="_DONE")
    assert listed(tmp_path, "") == [("hour=8", (8,)), ("hour=9", (9,)), ("hour=10", (10,))]
    assert list(PartitionedReader(str(tmp_path), OnePass, marker="")) == ["hour=8", "hour=9", "hour=10"]


def test_an_incomplete_partition_decides_no_key_kind(tmp_path):
    land(tmp_path, "hour=10")
    land(tmp_path, "hour=9")
    land(tmp_path, "hour=late", complete=False)
    assert listed(tmp_path) == [("hour=9", (9,)), ("hour=10", (10,))]


def test_a_marker_above_the_partitions_marks_none_of_them(tmp_path):
    """Spark writes _SUCCESS at the top of the folder it writes, a day's above its hours."""
    land(tmp_path, "day=2/hour=1")
    land(tmp_path, "day=2/hour=0", complete=False)
    (tmp_path / "day=2" / "_SUCCESS").write_text("")
    (tmp_path / "_SUCCESS").write_text("")
    assert listed(tmp_path) == [("day=2/hour=1", (2, 1))]


# ----------------------------------------------------------------------------- listing errors

@pytest.mark.parametrize("folder", [".", "misc", "=v", "k=", "day=1/misc", "day=1/=v"])
def test_a_parquet_file_outside_the_partition_folders_is_named(tmp_path, folder):
    land(tmp_path, "day=2")
    (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    stray = (tmp_path / folder / "stray.parquet").resolve()
    pq.write_table(pa.table({"x": [1]}), stray)
    assert refused(list_partitions, str(tmp_path), "_SUCCESS") == (
        f"{tmp_path}: {stray} lies outside the KEY=VALUE partition folders that data.order=time reads")


def test_a_folder_of_no_partitions_is_named(tmp_path):
    (tmp_path / "day=1").mkdir()
    (tmp_path / "day=1" / "_SUCCESS").write_text("")
    for root in (tmp_path, tmp_path / "missing"):
        assert refused(list_partitions, str(root), "_SUCCESS") == (
            f"{root}: no KEY=VALUE partition folders with Parquet files (data.order=time)")


@pytest.mark.parametrize("one,other", [("date=1", "hour=2"), ("date=1/hour=2", "hour=3/date=1"),
                                       ("date=1", "date=2/hour=3")])
def test_partitions_of_other_keys_are_named(tmp_path, one, other):
    land(tmp_path, one)
    land(tmp_path, other, complete=False)  # incomplete, yet its keys must agree

    def message(a: str, b: str) -> str:
        keys = "/".join(part.split("=")[0] for part in a.split("/"))
        return (f"{tmp_path}: partition {b} does not have the keys {keys} of {a}: every partition needs the same "
                "keys, in the same order")
    # In the listing's order, which the file system decides.
    assert refused(list_partitions, str(tmp_path), "_SUCCESS") in (message(one, other), message(other, one))


def test_a_partition_of_other_keys_than_the_ones_taken_up_is_named(tmp_path):
    following, state = trained(tmp_path, "date=1")
    shutil.rmtree(tmp_path / "date=1")  # retention: the listing alone agrees with itself
    land(tmp_path, "hour=2")
    message = (f"{tmp_path}: partition hour=2 does not have the keys date of date=1: every partition needs the same "
               "keys, in the same order")
    assert refused(following.refresh) == message
    assert refused(resumed, tmp_path, state) == message


def test_hives_null_value_is_named_in_a_fresh_listing(tmp_path):
    land(tmp_path, "day=1/hour=2")
    land(tmp_path, "day=1/hour=__HIVE_DEFAULT_PARTITION__")
    assert refused(list_partitions, str(tmp_path), "_SUCCESS") == (
        f"{tmp_path}: partition day=1/hour=__HIVE_DEFAULT_PARTITION__: its hour is Hive's null value, which has no "
        "place in time order; move the folder out of data.train_path")


@pytest.mark.parametrize("bad,why", [
    ("hour=late", "its hour 'late' is not an integer, but the partitions taken up before it (hour=10) order hour "
                  "as integers; move the folder out of data.train_path, and the run goes on after them"),
    ("hour=__HIVE_DEFAULT_PARTITION__", "its hour is Hive's null value, which has no place in time order; move "
                                        "the folder out of data.train_path"),
])
def test_a_partition_key_that_changes_kind_is_one_line_and_the_run_goes_on(tmp_path, bad, why):
    root = tmp_path / "logs"
    following, state = trained(root, "hour=1", "hour=2", "hour=10")
    land(root, bad)
    message = f"{root}: partition {bad}: {why}"
    assert refused(following.refresh) == message  # a run that follows the folder
    assert refused(resumed, root, state) == message  # `rankmix train` again
    shutil.move(root / bad, tmp_path / bad)
    land(root, "hour=11")
    assert [p.name for p in following.refresh()] == ["hour=11"] and list(following) == ["hour=11"]
    assert list(resumed(root, state)) == ["hour=11"]


def test_a_partition_still_being_written_decides_no_key_kind(tmp_path):
    root = tmp_path / "logs"
    following, state = trained(root, "hour=2", "hour=10")
    land(root, "hour=late", complete=False)
    land(root, "hour=11")
    assert [p.name for p in following.refresh()] == ["hour=11"]
    assert list(resumed(root, state)) == ["hour=11"]


# ----------------------------------------------------------------------------- following

def test_refresh_takes_up_the_partitions_completed_since(tmp_path):
    land(tmp_path, "hour=9")
    land(tmp_path, "hour=10", complete=False)
    reader = PartitionedReader(str(tmp_path), OnePass, marker="_SUCCESS")
    assert reader.partition == "hour=9" and list(reader) == ["hour=9"] and reader.partition == ""
    assert reader.refresh() == [] and list(reader) == []
    (tmp_path / "hour=10" / "_SUCCESS").write_text("")
    land(tmp_path, "hour=11")
    assert [p.name for p in reader.refresh()] == ["hour=10", "hour=11"]
    assert reader.refresh() == []
    assert list(reader) == ["hour=10", "hour=11"] and reader.epoch == 3


@pytest.mark.parametrize("late", ["hour=5", "hour=010"])  # 010: the last one's key, as an integer
def test_a_partition_completed_after_a_later_one_was_taken_up_is_named(tmp_path, late):
    land(tmp_path, "hour=2")
    land(tmp_path, "hour=10")
    reader = PartitionedReader(str(tmp_path), OnePass, marker="_SUCCESS")
    land(tmp_path, late)
    assert refused(reader.refresh) == (
        f"{tmp_path}: partition {late} completed after hour=10 was taken up but sorts before it: time order cannot "
        "train it")


def test_a_partition_shorter_than_a_batch_is_skipped_with_a_warning(tmp_path, caplog):
    land(tmp_path, "hour=1")
    reader = PartitionedReader(str(tmp_path), NoSteps, marker="_SUCCESS")
    with caplog.at_level(logging.WARNING, logger="rankmix.data"):
        assert list(reader) == []
    assert [r.getMessage() for r in caplog.records] == [
        "partition hour=1: fewer rows than one batch per rank; skipped"]
    assert reader.epoch == 1 and [c["partition"] for c in reader.consumed] == ["hour=1"]


def test_a_partitions_reader_is_opened_once_and_let_go_after_the_next_one(tmp_path):
    """The trainer still asks about the partition just done (its data record), not the one before."""
    for name in ("hour=1", "hour=2", "hour=3"):
        land(tmp_path, name)
    opened = []

    def open_partition(uri: str, name: str) -> OnePass:
        opened.append(name)
        return OnePass(uri, name)
    reader = PartitionedReader(str(tmp_path), open_partition, marker="_SUCCESS")
    batches = iter(reader)
    assert [next(batches), next(batches)] == ["hour=1", "hour=2"]
    reader.steps_in_epoch(0), reader.steps_in_epoch(1)
    assert opened == ["hour=1", "hour=2"]
    assert next(batches) == "hour=3"
    reader.steps_in_epoch(1), reader.steps_in_epoch(2)
    assert opened == ["hour=1", "hour=2", "hour=3"]
    reader.steps_in_epoch(0)
    assert opened == ["hour=1", "hour=2", "hour=3", "hour=1"]


# ----------------------------------------------------------------------------- state

def test_the_state_records_each_partition_once_its_last_batch_is_out(tmp_path):
    for name in ("hour=9", "hour=10"):
        land(tmp_path, name)
    reader = PartitionedReader(str(tmp_path), TwoSteps, marker="_SUCCESS")
    files = {name: [[str(p), p.stat().st_size, [1]] for p in sorted((tmp_path / name).glob("*.parquet"))]
             for name in ("hour=9", "hour=10")}
    assert reader.state_dict() == {"epoch": 0, "step": 0, "partition": "hour=9", "done": False, "consumed": (),
                                   "reader": None}
    assert reader.steps_left() == 4
    assert [reader.epoch_rows(e) for e in (0, 1)] == [EpochRows(10, 2)] * 2
    batches = iter(reader)
    next(batches)
    assert reader.steps_left() == 3
    assert reader.state_dict() == {"epoch": 0, "step": 1, "partition": "hour=9", "done": False, "consumed": (),
                                   "reader": {"step": 1}}
    next(batches)  # the last batch of hour=9: an epoch boundary, done
    nine = {"partition": "hour=9", "key": [9], "files": files["hour=9"]}
    assert reader.state_dict() == {"epoch": 0, "step": 2, "partition": "hour=9", "done": True, "consumed": (nine,),
                                   "reader": None}
    assert reader.steps_left() == 2
    assert list(batches) == ["hour=10", "hour=10"]
    ten = {"partition": "hour=10", "key": [10], "files": files["hour=10"]}
    assert reader.state_dict() == {"epoch": 2, "step": 0, "partition": "", "done": False, "consumed": (nine, ten),
                                   "reader": None}
    assert reader.steps_left() == 0


def test_a_resume_inside_a_partition_reads_the_rest_of_it_then_the_new_ones(tmp_path):
    for name in ("hour=9", "hour=10"):
        land(tmp_path, name)
    reader = PartitionedReader(str(tmp_path), TwoSteps, marker="_SUCCESS")
    batches = iter(reader)
    next(batches), next(batches), next(batches)  # hour=9, and the first batch of hour=10
    state = saved(reader)
    land(tmp_path, "hour=11")
    again = resumed(tmp_path, state, TwoSteps)
    assert again.epoch == 1 and again.partition == "hour=10" and again.reader(1).loaded == {"step": 1}
    assert again.steps_left() == 3
    assert list(again) == ["hour=10", "hour=11", "hour=11"]


def test_a_partitions_rows_left_at_another_world_size_go_to_its_reader_and_into_the_next_state(tmp_path):
    """TrainedPosition.load_resized hands the rows a partition had left (`resumed`) over: its
    reader takes them up at step 0, and the state keeps them until the first step is out."""
    for name in ("hour=9", "hour=10"):
        land(tmp_path, name)
    rows = {"epoch": 0, "units": [[0, 3, 9]], "rows": 6}
    state = {"epoch": 0, "step": 0, "partition": "hour=9", "done": False, "consumed": (), "reader": None,
             "resumed": rows}
    reader = PartitionedReader(str(tmp_path), TwoSteps, marker="_SUCCESS")
    reader.load_state_dict(state)
    assert reader.epoch == 0 and reader.reader(0).loaded == {"step": 0, "resumed": rows}
    reader.reader(0).resumed = rows  # as a ParquetReader's load_state_dict sets it
    assert reader.state_dict()["reader"] == {"step": 0}  # inside the partition, before its first step
    assert list(reader) == ["hour=9", "hour=9", "hour=10", "hour=10"]
    with pytest.raises(ValueError) as e:
        PartitionedReader(str(tmp_path), TwoSteps, marker="_SUCCESS").load_state_dict({**state, "partition": "hour=8"})
    assert str(e.value) == ("data reader state: partition hour=8 was being trained, but it is no longer complete "
                            "under data.train_path")


def test_a_resume_after_the_last_batch_of_a_partition_starts_the_next(tmp_path):
    for name in ("hour=9", "hour=10"):
        land(tmp_path, name)
    reader = PartitionedReader(str(tmp_path), TwoSteps, marker="_SUCCESS")
    batches = iter(reader)
    next(batches), next(batches)
    assert list(resumed(tmp_path, saved(reader), TwoSteps)) == ["hour=10", "hour=10"]


def test_a_partition_being_trained_that_is_no_longer_complete_is_named(tmp_path):
    for name in ("hour=9", "hour=10"):
        land(tmp_path, name)
    reader = PartitionedReader(str(tmp_path), TwoSteps, marker="_SUCCESS")
    batches = iter(reader)
    next(batches), next(batches), next(batches)
    state = saved(reader)
    (tmp_path / "hour=10" / "_SUCCESS").unlink()
    assert refused(resumed, tmp_path, state, TwoSteps) == (
        "data reader state: partition hour=10 was being trained, but it is no longer complete under "
        "data.train_path")


def test_a_trained_partition_that_changed_is_named_and_one_that_is_gone_is_not(tmp_path):
    _, state = trained(tmp_path, "hour=1", "hour=2")
    shutil.rmtree(tmp_path / "hour=1")  # retention
    idle = resumed(tmp_path, state)
    assert idle.refresh() == [] and list(idle) == []  # hour=2, trained, is not late
    land(tmp_path, "hour=3")
    assert [p.name for p in idle.refresh()] == ["hour=3"] and list(idle) == ["hour=3"]
    assert list(resumed(tmp_path, state)) == ["hour=3"]
    added = tmp_path / "hour=2" / "part-1.parquet"
    pq.write_table(pa.table({"x": [1]}), added)
    assert refused(resumed, tmp_path, state) == (
        f"data reader state: partition hour=2 was trained, but {added} was added since; a trained partition must "
        "not change (write a new partition instead)")
    added.unlink()
    part = tmp_path / "hour=2" / "part-0.parquet"
    before = part.stat().st_size
    pq.write_table(pa.table({"x": [1, 2]}), part)
    assert refused(resumed, tmp_path, state) == (
        f"data reader state: partition hour=2 was trained, but {part} changed from {before} to "
        f"{part.stat().st_size} bytes since; a trained partition must not change (write a new partition instead)")


@pytest.mark.parametrize("late", ["hour=5", "hour=020"])  # 020: the last one's key, as an integer
def test_a_new_partition_that_sorts_before_the_last_trained_one_is_named(tmp_path, late):
    _, state = trained(tmp_path, "hour=2", "hour=10", "hour=20")
    land(tmp_path, late)
    assert refused(resumed, tmp_path, state) == (
        f"data reader state: partition {late} is new but sorts before the last trained partition hour=20: time order "
        "cannot train it")


def test_keys_trained_as_strings_stay_strings_when_the_listing_is_all_integers(tmp_path):
    root = tmp_path / "logs"
    _, state = trained(root, "hour=1", "hour=x")  # "1" < "x": string order
    shutil.rmtree(root / "hour=x")  # retention
    land(root, "hour=2")
    assert refused(resumed, root, state) == ("data reader state: partition hour=2 is new but sorts before the last "
                                             "trained partition hour=x: time order cannot train it")


def test_keys_trained_as_integers_stay_integers_on_resume(tmp_path):
    """hour=9 and hour=10 trained; hour=11 lands and hour=9 goes: as strings "11" would sort before "10"."""
    _, state = trained(tmp_path, "hour=9", "hour=10")
    shutil.rmtree(tmp_path / "hour=9")
    land(tmp_path, "hour=11")
    land(tmp_path, "hour=100")
    again = resumed(tmp_path, state)
    assert list(again) == ["hour=11", "hour=100"]
    assert [c["key"] for c in saved(again)["consumed"]] == [[9], [10], [11], [100]]


# ----------------------------------------------------------------------------- progressive metrics

class Scores(nn.Module):
    """A model whose logits are given with the batch."""

    def forward(self, batch):
        return batch.logits * 1.0


class Rows:
    def __init__(self, logits: np.ndarray, labels: np.ndarray):
        self.logits, self.labels = torch.from_numpy(logits).float(), torch.from_numpy(labels).float()
        self.users = torch.from_numpy(np.arange(len(logits)))


def reference(logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """AUC (every positive-negative pair), NE and calibration of one task, from scratch in float64."""
    p = 1 / (1 + np.exp(-logits.astype(np.float32).astype(np.float64)))
    pos, neg = logits[labels == 1], logits[labels == 0]
    pairs = (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])
    rate = labels.mean()
    logloss = -np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    entropy = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    return {"auc": pairs.mean(), "ne": logloss / entropy, "calibration": p.sum() / labels.sum()}


def rows(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits at least 1e-3 apart (the histogram's bins are 3e-5 wide: its AUC is exact), labels of two tasks."""
    logits = rng.permutation(np.linspace(-4, 4, 2 * n)).reshape(n, 2)
    labels = (rng.random((n, 2)) < 1 / (1 + np.exp(-logits))).astype(np.float64)
    return logits, labels


def test_progressive_metrics_are_each_partitions_training_rows_and_nothing_else(tmp_path):
    rng = np.random.default_rng(0)
    model = Scores()
    with torch.device("meta"):  # torch's default device: the metrics keep to the one they are given
        progressive = ProgressiveMetrics(model, ["click", "like"], torch.device("cpu"))
        figures = [partition_figures(rng, model, progressive) for _ in range(2)]
    for logits, labels, got in figures:
        assert got.keys() == {"examples", "auc", "ne", "calibration",
                               *(f"{t}/{m}" for t in ("click", "like") for m in ("auc", "ne", "calibration"))}
        assert got["examples"] == 300
        for k, task in enumerate(("click", "like")):
            for metric, value in reference(logits[:, k], labels[:, k]).items():
                assert got[f"{task}/{metric}"] == pytest.approx(value, rel=1e-9, abs=1e-12), (task, metric)
        assert (got["auc"], got["ne"], got["calibration"]) == (got["click/auc"], got["click/ne"],
                                                               got["click/calibration"])


def partition_figures(rng: np.random.Generator, model: nn.Module, progressive: ProgressiveMetrics) -> tuple:
    """(logits, labels, the progressive metrics) of a partition of three training batches and an evaluation."""
    logits, labels = rows(rng, 300)
    for lo in range(0, 300, 100):
        model(Rows(logits[lo:lo + 100], labels[lo:lo + 100]))
    model.eval()
    model(Rows(*rows(rng, 50)))  # not a training row
    model.train()
    return logits, labels, progressive.compute()


# ----------------------------------------------------------------------------- shuffled order

def test_shuffled_orders_listing_names_an_unreachable_store_once_its_retries_are_spent():
    from trainer.data.partitions import complete_partitions

    with pytest.raises(DataUnavailableError) as error:
        complete_partitions("s3://key:secret@bucket/logs?endpoint_override=127.0.0.1:1&scheme=http", "_SUCCESS",
                            retry_seconds=0, retry_attempts=1)
    assert re.fullmatch(r"s3 endpoint 127\.0\.0\.1:1, bucket/logs: unreachable for 0\.\d s \(retry budget 0 s\): "
                        r"AWS Error NETWORK_CONNECTION during .*", str(error.value)), error.value


def test_shuffled_order_reads_only_the_complete_partitions(tmp_path):
    from test_reader import make_encoder, make_table
    from trainer.data.partitions import complete_partitions

    tmp_path = tmp_path / "LogX"  # an X: not a glob character
    tmp_path.mkdir()
    from trainer.data.options import ReaderOptions
    from trainer.data.reader import ParquetReader

    for i, (name, complete) in enumerate([("day=1", True), ("day=2", False), ("day=10", True)]):
        (tmp_path / name).mkdir()
        pq.write_table(make_table(100 * i, 100), tmp_path / name / "part-0.parquet")
        if complete:
            (tmp_path / name / "_SUCCESS").write_text("")
    spec = complete_partitions(str(tmp_path), "_SUCCESS")
    assert spec == f"{tmp_path}/day=1,{tmp_path}/day=10"
    reader = ParquetReader(spec, make_encoder(), ReaderOptions(batch_size=10, num_epochs=1))
    rows = sorted(int(u) for batch in reader for u in batch.users)
    assert rows == [*range(0, 100), *range(200, 300)]  # not day=2's 100..199
    assert complete_partitions(str(tmp_path), "").count(",") == 2  # every folder complete
    assert complete_partitions(str(tmp_path / "day=1"), "_SUCCESS") == str(tmp_path / "day=1")  # files only
    listed = f"{tmp_path}/day=1,{tmp_path}/day=2"
    assert complete_partitions(listed, "_SUCCESS") == listed
    for spec in (f"{tmp_path}/day=*", f"{tmp_path}/day=[12]", f"{tmp_path}/day=1/part-0.parquet"):
        assert complete_partitions(spec, "_SUCCESS") == spec  # a glob, and a file, name their own files
    (tmp_path / "plain").mkdir()
    assert complete_partitions(str(tmp_path / "plain"), "_SUCCESS") == str(tmp_path / "plain")
    (tmp_path / "plain" / "sub").mkdir()  # a folder below, but no KEY=VALUE one
    (tmp_path / "plain" / "a=b.parquet").write_bytes(b"")  # nor is a file named like one
    assert complete_partitions(str(tmp_path / "plain"), "_SUCCESS") == str(tmp_path / "plain")
    shutil.rmtree(tmp_path / "plain")  # out of the way of the listing below
    (tmp_path / "day=10" / "_SUCCESS").unlink()
    (tmp_path / "day=1" / "_SUCCESS").unlink()
    assert refused(complete_partitions, str(tmp_path), "_SUCCESS") == (
        f"{tmp_path}: none of its KEY=VALUE partitions is complete (holds _SUCCESS)")


# ----------------------------------------------------------------------------- tables


class TableFiles(OnePass):
    """A table partition's stand-in: its files are the comma-separated `uri`."""

    def __init__(self, uri: str, name: str):
        self.name, self.step, self.loaded, self.uri = name, 0, None, uri
        self.input_files = [[p, Path(p).stat().st_size, [1]] for p in uri.split(",")]


def test_a_delta_tables_partitions_are_its_appends_in_order_and_a_resume_takes_up_the_new_ones(tmp_path):
    from deltalake import DeltaTable, write_deltalake

    table = str(tmp_path / "clicks")
    for rows in ([1, 2], [3], [4]):
        write_deltalake(table, pa.table({"x": rows}), mode="append")
    DeltaTable(table).optimize.compact()  # version 3: no partition
    reader = PartitionedReader(f"delta:{table}", TableFiles, marker="_SUCCESS")
    assert list(reader) == ["version=0", "version=1", "version=2"]
    assert [len(reader.uri(e).split(",")) for e in range(3)] == [1, 1, 1]
    assert {reader.uri(e) for e in range(3)} == set(DeltaTable(table, version=2).file_uris())
    state = saved(reader)

    write_deltalake(table, pa.table({"x": [5, 6]}), mode="append")
    again = PartitionedReader(f"delta:{table}", TableFiles, marker="_SUCCESS")
    again.load_state_dict(state)
    new = sorted(set(DeltaTable(table).file_uris()) - set(DeltaTable(table, version=3).file_uris()))
    assert again.uri(3) == ",".join(new)
    assert list(again) == ["version=4"]
    write_deltalake(table, pa.table({"x": [7]}), mode="append")
    assert [p.name for p in again.refresh()] == ["version=5"]
    assert list(again) == ["version=5"]


def iceberg_table(folder: Path):
    """([data.catalog] of a SQLite catalog in `folder`, its table logs.clicks after two appends)."""
    from pyiceberg.catalog import load_catalog

    catalog = {"name": "lake", "uri": f"sqlite:///{folder}/catalog.db", "warehouse": f"file://{folder}"}
    writer = load_catalog("lake", type="sql", **{k: v for k, v in catalog.items() if k != "name"})
    writer.create_namespace("logs")
    table = writer.create_table("logs.clicks", schema=pa.schema([("x", pa.int64())]))
    for rows in ([1, 2], [3]):
        table.append(pa.table({"x": pa.array(rows, pa.int64())}))
    return catalog, table


def test_an_iceberg_tables_partitions_come_through_its_catalog(tmp_path):
    catalog, table = iceberg_table(tmp_path)
    reader = PartitionedReader("iceberg:logs.clicks", TableFiles, marker="_SUCCESS", catalog=catalog)
    assert list(reader) == [f"snapshot={s.snapshot_id}" for s in table.snapshots()]
    assert [p.key for p in reader.sequence] == [(s.sequence_number, s.timestamp_ms) for s in table.snapshots()]
    assert [p.key[0] for p in reader.sequence] == [1, 2]
    table.append(pa.table({"x": pa.array([4], pa.int64())}))
    assert [p.name for p in reader.refresh()] == [f"snapshot={table.snapshots()[-1].snapshot_id}"]


def test_a_table_rolled_back_past_the_last_trained_snapshot_is_refused(tmp_path):
    catalog, table = iceberg_table(tmp_path)
    reader = PartitionedReader("iceberg:logs.clicks", TableFiles, marker="_SUCCESS", catalog=catalog)
    assert len(list(reader)) == 2
    state = saved(reader)
    first, last = (s.snapshot_id for s in table.snapshots())
    table.manage_snapshots().rollback_to_snapshot(first).commit()
    again = PartitionedReader("iceberg:logs.clicks", TableFiles, marker="_SUCCESS", catalog=catalog)
    assert refused(again.load_state_dict, state) == (
        f"data reader state: iceberg:logs.clicks: snapshot={last} was trained last, but the table's history no "
        "longer holds it (snapshots expired, or rolled back): the commits after it cannot be told; start a new "
        "run folder from this one's weights (checkpoint.load_path)")
