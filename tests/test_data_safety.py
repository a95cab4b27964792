"""Safe by default (issue 27): the converters and `rankmix score` keep every input's rows,
redo an input whose options or contents changed, refuse numbers a float32 model cannot
take, and report bad input as one line naming the file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli import rankmix
from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec
from trainer.config_loader import dump_toml, load_config
from trainer.data.datasets import synth_features
from trainer.data.encode import RowEncoder
from trainer.offline.csvlog import stable_hash

REPO = Path(__file__).resolve().parents[1]


def _summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _one_line_error(proc: subprocess.CompletedProcess, message: str) -> None:
    """Exit 2, `message` exactly as the last line, no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == f"rankmix: error: {message}", proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def _rows_on_disk(folder: Path) -> int:
    return sum(pq.ParquetFile(p).metadata.num_rows for p in folder.rglob("*.parquet"))


def _input_rows(out: Path, report: dict) -> list[dict]:
    """The rows one input's parts hold, in order."""
    return pa.concat_tables([pq.read_table(out / p) for p in report["parts"]]).to_pylist()


def _csv(out: Path, *srcs: Path, options: tuple[str, ...] = ("--label", "y")) -> subprocess.CompletedProcess:
    return rankmix("data", "csv", "--src", *map(str, srcs), "--out", str(out), *options)


# ----------------------------------------------------------------------------- converter outputs


def test_a_stem_like_another_inputs_part_keeps_both_inputs(tmp_path):
    """`a-1.csv` next to `a.csv`: converting `a` deleted every `a-*.parquet`, `a-1`'s too."""
    a1, a = tmp_path / "a-1.csv", tmp_path / "a.csv"
    a1.write_text("y,s\n1,p\n0,q\n")
    a.write_text("y,s\n1,u\n0,v\n1,w\n")
    out = tmp_path / "o"
    summary = _summary(_csv(out, a1, a))
    assert summary["rows"] == 5 == _rows_on_disk(out)
    first, second = summary["files"]
    assert [r["s"] for r in _input_rows(out, first)] == [stable_hash(v) for v in "pq"]
    assert [r["s"] for r in _input_rows(out, second)] == [stable_hash(v) for v in "uvw"]
    again = _summary(_csv(out, a1, a))
    assert again["skipped_files"] == 2 and again["rows"] == 5 == _rows_on_disk(out)


def test_only_an_inputs_own_parts_are_removed(tmp_path):
    """Cleaning up `a`'s stale parts removed every `a-*.parquet`: here, another conversion's."""
    a, out = tmp_path / "a.csv", tmp_path / "o"
    a.write_text("y,s\n1,u\n0,v\n1,w\n")
    out.mkdir()
    other = out / "a-1-00000.parquet"
    pq.write_table(pa.table({"y": [1, 0]}), other)
    summary = _summary(_csv(out, a))
    assert summary["files"][0]["parts"] == ["a-00000.parquet"] and other.exists()
    assert _rows_on_disk(out) == 5


def _two_inputs_named_a(tmp_path):
    """x/a.csv (2 rows) and y/a.csv (3 rows): one stem, two inputs."""
    x, y = tmp_path / "x" / "a.csv", tmp_path / "y" / "a.csv"
    for path, text in ((x, "y,s\n1,p\n0,q\n"), (y, "y,s\n1,u\n0,v\n1,w\n")):
        path.parent.mkdir()
        path.write_text(text)
    return x, y


def test_inputs_of_one_name_in_one_run_both_convert(tmp_path):
    x, y = _two_inputs_named_a(tmp_path)
    out = tmp_path / "o"
    summary = _summary(_csv(out, x, y))
    assert summary["rows"] == 5 == _rows_on_disk(out)
    assert [len(_input_rows(out, r)) for r in summary["files"]] == [2, 3]
    parts = [r["parts"][0] for r in summary["files"]]
    assert parts[0] != parts[1] and all(re.fullmatch(r"a-h[0-9a-f]{8}-00000\.parquet", p) for p in parts)


def test_one_file_given_twice_is_refused(tmp_path):
    (tmp_path / "a.csv").write_text("y,s\n1,p\n")
    proc = rankmix("data", "csv", "--src", "a.csv", str(tmp_path / "a.csv"), "--out", "o", "--label", "y",
                   cwd=tmp_path)
    _one_line_error(proc, f"--src gives one file more than once: ['a.csv', '{tmp_path / 'a.csv'}']")


def test_an_input_of_an_earlier_runs_name_is_not_skipped(tmp_path):
    """The done-marker was keyed by the file name: `y/a.csv` was skipped as `x/a.csv`."""
    x, y = _two_inputs_named_a(tmp_path)
    out = tmp_path / "o"
    assert _summary(_csv(out, x))["rows"] == 2
    later = _summary(_csv(out, y))
    assert later["skipped_files"] == 0 and later["rows"] == 3
    assert _rows_on_disk(out) == 5
    both = _summary(_csv(out, x, y))  # each input keeps the name it was converted under
    assert both["skipped_files"] == 2 and _rows_on_disk(out) == 5


def test_changed_options_or_input_reconvert(tmp_path):
    src, out = tmp_path / "log.csv", tmp_path / "o"
    src.write_text("y,s,p\n1,u,2.5\n0,v,1\n1,w,3\n")
    _summary(_csv(out, src))
    assert pq.read_schema(out / "log-00000.parquet").field("p").type == pa.int64()  # hashed
    numeric = ("--label", "y", "--numeric", "p")
    redo = _summary(_csv(out, src, options=numeric))
    assert redo["skipped_files"] == 0
    assert [r["p"] for r in _input_rows(out, redo["files"][0])] == [2.5, 1.0, 3.0]
    assert _summary(_csv(out, src, options=numeric))["skipped_files"] == 1

    split = _summary(_csv(out, src, options=(*numeric, "--rows-per-file", "1")))
    assert split["skipped_files"] == 0 and len(split["files"][0]["parts"]) == 3 == len(list(out.glob("*.parquet")))
    whole = _summary(_csv(out, src, options=numeric))  # the three parts of the split are gone
    assert whole["files"][0]["parts"] == ["log-00000.parquet"] == [p.name for p in out.glob("*.parquet")]

    src.write_text("y,s,p\n1,u,2.5\n0,v,1\n1,w,3\n0,z,4\n")  # the input grew
    grown = _summary(_csv(out, src, options=numeric))
    assert grown["skipped_files"] == 0 and grown["rows"] == 4 == _rows_on_disk(out)


def test_a_failed_reconversion_keeps_the_old_output(tmp_path):
    src, out = tmp_path / "log.csv", tmp_path / "o"
    src.write_text("y,s\n1,u\n0,v\n")
    _summary(_csv(out, src))
    src.write_text("y,s\n1,u\n0,v\n7,w\n")
    proc = _csv(out, src, options=("--label", "y", "--strict"))
    _one_line_error(proc, f"{src}, line 4: malformed row (column y: bad value '7')")
    assert _rows_on_disk(out) == 2 and not list(out.glob("*.tmp"))
    assert _summary(_csv(out, src))["rows"] == 2  # not done: the changed input is converted now


def test_non_finite_numbers_are_bad_rows(tmp_path):
    src, out = tmp_path / "log.csv", tmp_path / "o"
    src.write_text("y,p\n1,1e999\n0,-1e999\n1,2.5\n0,inf\n1,nan\n0,1e308\n")
    summary = _summary(_csv(out, src, options=("--label", "y", "--numeric", "p")))
    report = summary["files"][0]
    assert (report["rows"], report["bad_rows"], report["bad_columns"]) == (2, 4, {"p": 4})
    assert (report["first_bad_line"], report["first_bad_reason"]) == (2, "column p: bad value '1e999'")
    assert [r["p"] for r in _input_rows(out, report)] == [2.5, 1e308]


def test_non_utf8_header_names_the_file(tmp_path):
    src = tmp_path / "latin.csv"
    src.write_bytes(b"y,caf\xe9\n1,a\n")
    proc = _csv(tmp_path / "o", src)
    _one_line_error(proc, f"{src}: the header is not UTF-8 (byte 0xe9 at column 6)")


# ----------------------------------------------------------------------------- MovieLens


def _movielens(folder: Path, timestamp: str) -> Path:
    """A three-file MovieLens set whose second rating has `timestamp`."""
    folder.mkdir()
    (folder / "ml-100k.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
                                          f"1\t1\t4\t100\n1\t1\t3\t{timestamp}\n")
    (folder / "ml-100k.user").write_text("user_id:token\tage:token\tgender:token\toccupation:token\t"
                                         "zip_code:token\n1\t30\tF\tartist\t12345\n")
    (folder / "ml-100k.item").write_text("item_id:token\tmovie_title:token_seq\trelease_year:token\t"
                                         "class:token_seq\n1\tX\t1995\tDrama\n")
    return folder


@pytest.mark.parametrize("timestamp", ["inf", "-inf", "1e999", "nan"])
def test_movielens_bad_timestamp_is_one_line(tmp_path, timestamp):
    src = _movielens(tmp_path / "ml", timestamp)
    proc = rankmix("data", "movielens", "--src", str(src), "--out", str(tmp_path / "o"))
    _one_line_error(proc, f"{src / 'ml-100k.inter'}:3: malformed line: '1' '1' '3' '{timestamp}'")


def test_movielens_non_utf8_names_the_file(tmp_path):
    src = _movielens(tmp_path / "ml", "200")
    (src / "ml-100k.item").write_bytes(b"item_id:token\tmovie_title:token_seq\trelease_year:token\t"
                                       b"class:token_seq\n1\tCaf\xe9\t1995\tDrama\n")
    proc = rankmix("data", "movielens", "--src", str(src), "--out", str(tmp_path / "o"))
    _one_line_error(proc, f"{src / 'ml-100k.item'}:2: not UTF-8 (byte 0xe9 at column 6)")


# ----------------------------------------------------------------------------- float32 and config


def train_on_a_changed_log(tmp_path: Path, column: str, row: int, value, feature_change) -> tuple[Path, object]:
    """(the training part, the process) of `rankmix train` for 2 steps on a 600-row synthetic log
    whose `column` holds `value` at `row` (the column's values cast to the value's NumPy type),
    under the synthetic schema changed by `feature_change(features)`."""
    data = tmp_path / "data"
    _summary(rankmix("data", "synth", "--out", str(data), "--rows", "600", "--files", "1"))
    part = data / "train" / "part-00000.parquet"
    table = pq.read_table(part)
    values = table.column(column).to_numpy().astype(np.asarray(value).dtype)
    values[row] = value
    pq.write_table(table.set_column(table.schema.get_field_index(column), column, pa.array(values)),
                   part, row_group_size=table.num_rows)
    cfg = load_config(str(REPO / "configs" / "debug.toml"), ["--data.dataset=parquet"])
    cfg.features = synth_features()
    feature_change(cfg.features)
    dump_toml(cfg, tmp_path / "config.toml")
    return part, rankmix("train", "--config", str(tmp_path / "config.toml"), f"--data.train_path={data / 'train'}",
                         f"--data.eval_path={data / 'valid'}", "--data.shuffle=false", "--train.steps=2",
                         f"--train.run_dir={tmp_path / 'run'}", "--metrics.progress=false",
                         "--metrics.tensorboard=false")


def test_a_number_beyond_float32_names_file_column_and_row(tmp_path):
    """1e39 is finite in float64, and was inf in the model: "non-finite loss", no file named."""
    def raw_price(features):  # the raw value reaches the cast
        next(f for f in features if f.name == "item_price").transform = []

    part, proc = train_on_a_changed_log(tmp_path, "item_price", 5, np.float64(1e39), raw_price)
    _one_line_error(proc, f"{part}, row group 0, column 'item_price': 1e+39 at row 5 is beyond float32's range")


@pytest.mark.parametrize("transform,value,message", [
    ([], -1e39, "-1e+39 at row 1 is beyond float32's range"),
    (["standardize"], 1e30, "1e+40 at row 1 is beyond float32's range (after standardize)"),  # 1e30 / 1e-10
])
def test_encoder_refuses_what_float32_cannot_hold(transform, value, message):
    f = FeatureSpec(name="x", kind="numeric", transform=transform, mean=0.0, std=1e-10)
    encoder = RowEncoder([f], [TaskSpec()])
    table = pa.table({"x": [1.0, value], "click": [0, 1]})
    with pytest.raises(ValueError) as e:
        encoder.encode(table, "f.parquet, row group 2")
    assert str(e.value) == f"f.parquet, row group 2, column 'x': {message}"
    assert np.isfinite(encoder.encode(table.slice(0, 1), "f.parquet, row group 2").dense).all()


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_retry_seconds_must_be_finite(tmp_path, value):
    proc = rankmix("train", "--config", "configs/debug.toml", f"--data.retry_seconds={value}",
                   f"--train.run_dir={tmp_path}", f"--data.cache_dir={tmp_path}")
    _one_line_error(proc, f"data.retry_seconds must be a finite number of seconds, got {value}")


# ----------------------------------------------------------------------------- score


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory) -> tuple[Path, Path]:
    """(a two-step run's folder, its synthetic data)."""
    root = tmp_path_factory.mktemp("safety")
    _summary(rankmix("train", "--config", "configs/debug.toml", "--train.steps=2", "--data.synth_rows=2000",
                     f"--train.run_dir={root}/run", f"--data.cache_dir={root}/data", "--metrics.progress=false",
                     "--metrics.tensorboard=false"))
    return root / "run", next((root / "data").glob("synth-*"))


def test_score_inputs_of_one_name_each_keep_their_output(scored_run, tmp_path):
    """`--data d1,d2`, each with a part-00000.parquet: the second output replaced the first."""
    run, data = scored_run
    parts = sorted((data / "train").glob("*.parquet"))[:2]
    for folder, part in zip(("d1", "d2"), parts):
        (tmp_path / folder).mkdir()
        shutil.copy(part, tmp_path / folder / "part-00000.parquet")
    out = tmp_path / "out"
    summary = _summary(rankmix("score", "--checkpoint", str(run), "--data", f"{tmp_path / 'd1'},{tmp_path / 'd2'}",
                               "--out", str(out)))
    expected = sum(pq.ParquetFile(p).metadata.num_rows for p in parts)
    assert summary["rows"] == expected == _rows_on_disk(out)
    for folder, part in zip(("d1", "d2"), parts):  # the inputs' paths, mirrored: row for row
        scored = pq.read_table(out / folder / "part-00000.parquet")
        assert scored.column("user_id").equals(pq.read_table(part).column("user_id"))
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["part-00000.parquet"] * 2  # no temp files


def test_score_refuses_an_input_listed_twice(scored_run, tmp_path):
    run, data = scored_run
    valid = data / "valid"
    proc = rankmix("score", "--checkpoint", str(run), "--data", f"{valid},{valid / 'part-00000.parquet'}",
                   "--out", str(tmp_path / "out"))
    _one_line_error(proc, f"--data lists {valid / 'part-00000.parquet'} twice")


def test_score_never_overwrites_an_input(scored_run, tmp_path):
    run, data = scored_run
    shutil.copytree(data / "valid", tmp_path / "valid")
    before = (tmp_path / "valid" / "part-00000.parquet").read_bytes()
    proc = rankmix("score", "--checkpoint", str(run), "--data", str(tmp_path / "valid"), "--out",
                   str(tmp_path / "valid"))
    _one_line_error(proc, f"--out {tmp_path / 'valid'} would overwrite the input "
                          f"{tmp_path / 'valid' / 'part-00000.parquet'}")
    assert (tmp_path / "valid" / "part-00000.parquet").read_bytes() == before
