"""Input that used to end in a traceback, or in an error that did not say what was wrong, is
one `rankmix: error:` line naming the option, the partition or the file (exit 2); a run stopped
by a bad partition goes on once it is moved away; a zero-row file scores to a zero-row file."""

import shutil
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli import rankmix
from test_serving import data, rankmixer  # noqa: F401  (fixtures: a short debug run, made once)
from trainer.data.partitions import PartitionedReader
from trainer.checkpoint.state import decode_state, encode_state


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The single line of a command refused with exit 2."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rankmix:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------- batch sizes

@pytest.mark.parametrize("command", [["train"], ["plan", "--world-size", "2", "--device", "cpu"]])
@pytest.mark.parametrize("key,value", [("data.batch_size", "99999999999999999999"),
                                       ("data.global_batch_size", "99999999999999999998"),
                                       ("data.eval_batch_size", str(2 ** 31))])
def test_a_batch_no_kernel_can_run_is_refused_naming_the_option(command, key, value, tmp_path):
    proc = rankmix(*command, "--config", "configs/synth.toml", f"--train.run_dir={tmp_path}/run", f"--{key}={value}")
    assert one_line(proc) == (f"rankmix: error: {key}={value} is more rows than a batch can hold: at most "
                              "2147483647 (FBGEMM's embedding kernels count them in 32 bits); `rankmix plan` "
                              "shows what fits")
    assert not (tmp_path / "run").exists()


def test_a_batch_the_planner_cannot_place_is_one_line_naming_the_batch(tmp_path):
    """Under the bound, but terabytes of input buffers: TorchRec's planner refuses it."""
    proc = rankmix("train", "--config", "configs/debug.toml", f"--train.run_dir={tmp_path}/run",
                   f"--data.cache_dir={tmp_path}/data", "--data.batch_size=1000000000")
    assert one_line(proc) == (
        "rankmix: error: TorchRec's planner found no plan for 1 x cpu with 1000000000 rows per rank and step "
        "(data.batch_size, or data.global_batch_size over the ranks): Unable to find a plan for this model "
        "because of insufficient storage. `rankmix plan` shows the details")


def test_a_score_batch_no_kernel_can_run_is_refused(rankmixer, tmp_path):
    run, _, valid = rankmixer
    proc = rankmix("score", "--checkpoint", str(run), "--data", str(valid), "--out", str(tmp_path / "out"),
                   "--batch-size", "99999999999999999999")
    assert one_line(proc) == ("rankmix: error: --batch-size 99999999999999999999 is more rows than a batch can hold: "
                              "at most 2147483647")


# ----------------------------------------------------------------------------- partitions

class OnePass:
    """A partition's stand-in for its ParquetReader: one batch (the partition's name)."""

    def __init__(self, uri: str, name: str):
        self.name, self.step = name, 0
        self.input_files = [[str(p), p.stat().st_size, [1]] for p in sorted(Path(uri).glob("*.parquet"))]

    def steps_in_epoch(self, epoch: int) -> int:
        return 1

    def __iter__(self):
        self.step = 1
        yield self.name


def land(root: Path, name: str, complete: bool = True) -> None:
    (root / name).mkdir(parents=True)
    pq.write_table(pa.table({"x": [1]}), root / name / "part-0.parquet")
    if complete:
        (root / name / "_SUCCESS").write_text("")


def resumed(root: Path, state: dict) -> PartitionedReader:
    """A new run on the same folder, from the checkpoint's reader state."""
    reader = PartitionedReader(str(root), OnePass, marker="_SUCCESS")
    reader.load_state_dict(state)
    return reader


def trained(root: Path, *names: str) -> tuple[PartitionedReader, dict]:
    """A reader that trained the partitions `names`, and its state as a checkpoint keeps it."""
    for name in names:
        land(root, name)
    reader = PartitionedReader(str(root), OnePass, marker="_SUCCESS")
    assert list(reader) == list(names)
    return reader, decode_state(encode_state(reader.state_dict()), "reader state")


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
    with pytest.raises(ValueError) as refused:  # a run that follows the folder
        following.refresh()
    assert str(refused.value) == message
    with pytest.raises(ValueError) as refused:  # `rankmix train` again
        resumed(root, state)
    assert str(refused.value) == message
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


def test_keys_trained_as_strings_stay_strings_when_the_listing_is_all_integers(tmp_path):
    root = tmp_path / "logs"
    _, state = trained(root, "hour=1", "hour=x")  # "1" < "x": string order
    shutil.rmtree(root / "hour=x")  # retention
    land(root, "hour=2")
    with pytest.raises(ValueError) as refused:
        resumed(root, state)
    assert str(refused.value) == ("data reader state: partition hour=2 is new but sorts before the last trained "
                                  "partition hour=x: time order cannot train it")


# ----------------------------------------------------------------------------- score

def score(run: Path, data: Path, out: Path) -> subprocess.CompletedProcess:
    return rankmix("score", "--checkpoint", str(run), "--data", str(data), "--out", str(out))


def test_score_names_an_empty_parquet_file(rankmixer, tmp_path):
    run, _, _ = rankmixer
    (tmp_path / "in").mkdir()
    empty = tmp_path / "in" / "empty.parquet"
    empty.write_bytes(b"")
    assert one_line(score(run, empty, tmp_path / "out")) == \
        f"rankmix: error: cannot read Parquet file {empty}: Parquet file size is 0 bytes"


@pytest.mark.parametrize("damage", ["truncated", "page"])
def test_score_names_a_damaged_parquet_file_before_writing_anything(rankmixer, tmp_path, damage):
    run, _, valid = rankmixer
    source = next(valid.glob("*.parquet"))
    good, bad = tmp_path / "in" / "a.parquet", tmp_path / "in" / "b.parquet"
    good.parent.mkdir()
    shutil.copy(source, good)
    content = bytearray(source.read_bytes())
    if damage == "truncated":  # a copy cut short: no footer
        content = content[:len(content) // 2]
    else:  # the footer intact, a page header garbled
        start = pq.ParquetFile(source).metadata.row_group(0).column(0).data_page_offset
        content[start:start + 40] = b"\xff" * 40
    bad.write_bytes(bytes(content))
    line = one_line(score(run, good.parent, tmp_path / "out"))
    assert line.startswith(f"rankmix: error: cannot read Parquet file {bad}: "), line
    if damage == "truncated":  # refused from its footer, before any output
        assert not (tmp_path / "out").exists()
    else:  # the file before it is scored; of this one nothing is left, not even a temporary file
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["a.parquet"]


def test_score_writes_a_zero_row_file_for_a_zero_row_input(rankmixer, tmp_path):
    run, _, valid = rankmixer
    table = pq.read_table(next(valid.glob("*.parquet")))
    (tmp_path / "in").mkdir()
    pq.write_table(table.slice(0, 10), tmp_path / "in" / "rows.parquet")
    pq.write_table(table.slice(0, 0), tmp_path / "in" / "none.parquet")
    proc = score(run, tmp_path / "in", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, none = (pq.read_table(tmp_path / "out" / name) for name in ("rows.parquet", "none.parquet"))
    assert rows.num_rows == 10 and none.num_rows == 0
    assert none.column_names == ["click", "like", "user_id", "pred_click", "pred_like"]
    assert none.schema.equals(rows.schema)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["none.parquet", "rows.parquet"]
