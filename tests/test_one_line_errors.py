"""Input that used to end in a traceback, or in an error that did not say what was wrong, is
one `rankmix: error:` line naming the option or the file (exit 2); a zero-row file scores to a
zero-row file. (A bad partition's errors: tests/test_partitions.py.)"""

import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cli import rankmix
from test_serving import data, rankmixer  # noqa: F401  (fixtures: a short debug run, made once)


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
