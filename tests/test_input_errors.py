"""Safe by default (issue 27), the inputs tests/test_fuzz.py found: negative ids of narrow
integer types, uint64 user ids past int64, and the CSV converter's read errors (the first
block's, a row pyarrow cannot skip, a corrupt compressed input) all end in one line naming
the file, or read exactly."""

from __future__ import annotations

import gzip
import subprocess

import numpy as np
import pyarrow as pa
import pytest

from cli import rankmix
from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec
from test_data_safety import train_on_a_changed_log
from trainer.data.encode import RowEncoder

WHERE = "f.parquet, row group 0"


def _one_line_error(proc: subprocess.CompletedProcess, message: str) -> None:
    """Exit 2, `message` exactly as the last line, no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == f"rankmix: error: {message}", proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------- reader


@pytest.mark.parametrize("typ", [pa.int8(), pa.int16(), pa.int32(), pa.int64()])
@pytest.mark.parametrize("hashing", ["modulo", "none", "managed"])
def test_a_negative_id_of_any_width_is_refused(typ, hashing):
    """int8 -128 read as uint8 is 128, below num_embeddings: it reached the model."""
    f = FeatureSpec(name="f0", num_embeddings=2 ** 40, hashing=hashing)
    table = pa.table({"f0": pa.array([3, -128], typ), "click": [0, 1]})
    with pytest.raises(ValueError) as e:
        RowEncoder([f], [TaskSpec()]).encode(table, WHERE)
    assert str(e.value) == f"{WHERE}, column 'f0': negative id -128 at row 1"


@pytest.mark.parametrize("typ", [pa.int8(), pa.int32()])
def test_a_negative_id_in_a_list_of_a_narrow_type_is_refused(typ):
    f = FeatureSpec(name="f0", kind="id_list", num_embeddings=2 ** 40, hashing="none")
    table = pa.table({"f0": pa.array([[1], [], [2, -5]], pa.list_(typ)), "click": [0, 1, 0]})
    with pytest.raises(ValueError) as e:
        RowEncoder([f], [TaskSpec()]).encode(table, WHERE)
    assert str(e.value) == f"{WHERE}, column 'f0': negative id -5 at row 2"


@pytest.mark.parametrize("typ", [pa.int8(), pa.int16(), pa.uint8()])
@pytest.mark.parametrize("num_embeddings,rows", [(1000, [0, 127, 5]), (50, [0, 27, 5])])
def test_valid_narrow_ids_read_as_before(typ, num_embeddings, rows):
    """The same table rows as the ids of an int64 column: the fast path still takes them."""
    f = FeatureSpec(name="f0", num_embeddings=num_embeddings)
    encoded = RowEncoder([f], [TaskSpec()]).encode(pa.table({"f0": pa.array([0, 127, 5], typ),
                                                             "click": [0, 1, 0]}), WHERE)
    assert encoded.values[0].dtype == np.int64 and encoded.values[0].tolist() == rows


def test_uint64_user_ids_past_int64_stay_distinct():
    """User ids only group rows for UAUC: a uint64 id is read as its int64 bit pattern."""
    users = pa.array([1, 2 ** 64 - 1, 2 ** 63, 2 ** 63 - 1], pa.uint64())
    table = pa.table({"f0": [1, 2, 3, 4], "click": [0, 1, 0, 1], "user": users})
    encoded = RowEncoder([FeatureSpec(name="f0", num_embeddings=7)], [TaskSpec()], "user").encode(table, WHERE)
    assert encoded.users.dtype == np.int64
    assert encoded.users.tolist() == [1, -1, -2 ** 63, 2 ** 63 - 1]


def test_training_on_a_negative_int8_id_names_file_column_and_row(tmp_path):
    def wide_device_table(features):  # above 128: -128 seen as uint8 would pass the fast path
        next(f for f in features if f.name == "device").num_embeddings = 1000

    part, proc = train_on_a_changed_log(tmp_path, "device", 7, np.int8(-128), wide_device_table)
    _one_line_error(proc, f"{part}, row group 0, column 'device': negative id -128 at row 7")


# ----------------------------------------------------------------------------- CSV converter


@pytest.mark.parametrize("data,label,why", [
    (b"y", "y", "cannot parse: CSV parse error: Empty CSV file or block: cannot infer number of columns"),
    (b"y,n\n1,\xff\n", "y", "cannot parse: In CSV column #1: Row #2: CSV conversion error to string: "
                            "invalid UTF8 data"),
    (b"", "", "cannot parse: Empty CSV file"),
    # pyarrow cannot hand a malformed row that is not UTF-8 to the handler that skips malformed rows
    (b"y,n\n1,2\n1,\xff,3\n", "y", "cannot parse: CSV parse error: Row #3: Expected 2 columns, got 3: "
                                   "1,\ufffd,3 (not UTF-8: byte 0xff at column 3)"),
], ids=["header without newline", "not UTF-8", "empty, no label", "malformed and not UTF-8"])
def test_csv_read_errors_are_one_line_naming_the_file(tmp_path, data, label, why):
    src = tmp_path / "log.csv"
    src.write_bytes(data)
    proc = rankmix("data", "csv", "--src", str(src), "--out", str(tmp_path / "o"), "--label", label)
    _one_line_error(proc, f"{src}: {why}")


@pytest.mark.parametrize("data,why", [
    (gzip.compress(b"y,n\n1,2\n" * 100)[:30], "Truncated compressed stream"),  # in the header
    (gzip.compress(b"y,n\n" + b"1,2\n" * 100_000)[:-10], "Truncated compressed stream"),  # past the first block
    (b"y,n\n1,2\n", "zlib inflate failed: incorrect header check"),  # no gzip at all
], ids=["header", "later block", "not gzip"])
def test_a_corrupt_gzip_input_is_one_line_naming_the_file(tmp_path, data, why):
    src = tmp_path / "log.csv.gz"
    src.write_bytes(data)
    proc = rankmix("data", "csv", "--src", str(src), "--out", str(tmp_path / "o"), "--label", "y")
    _one_line_error(proc, f"{src}: cannot read: {why}")
