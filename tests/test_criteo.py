"""Criteo 1TB and generic CSV converters, checked against an independent plain-Python parse
of the raw sample lines; the Criteo 1TB config; two training epochs on converted data."""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli import rankmix
from test_train import assert_loss_falls
from trainer.config_loader import load_config
from trainer.offline.criteo import CAT_COLUMNS, INT_COLUMNS, SCHEMA, convert_criteo
from trainer.offline.csvlog import convert_csv

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "data" / "samples"
CRITEO = SAMPLES / "criteo_day_sample.tsv"
AVAZU = SAMPLES / "avazu_sample.txt"
if not CRITEO.is_file():
    pytest.skip(f"Criteo sample not found at {CRITEO}", allow_module_level=True)

MLPERF_CAPS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
               2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]


def _expected(line: str) -> dict:
    """One raw line parsed with plain Python (no pyarrow), as the converter should output it."""
    f = line.rstrip("\n").split("\t")
    assert len(f) == 40
    row = {"label": int(f[0])}
    row.update({c: (float(v) if v else None) for c, v in zip(INT_COLUMNS, f[1:14])})
    row.update({c: (int(v, 16) if v else None) for c, v in zip(CAT_COLUMNS, f[14:])})
    return row


def _lines() -> list[str]:
    return CRITEO.read_text().splitlines()


def _read(folder: Path) -> pa.Table:
    parts = sorted(folder.glob("*.parquet"))
    return pa.concat_tables([pq.read_table(p) for p in parts])


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("criteo")
    summary = convert_criteo([str(CRITEO)], str(out), row_group_size=64)
    return out, summary


def test_sample_converts_with_types_and_values(converted):
    out, summary = converted
    assert summary["rows"] == 200 and summary["bad_rows"] == 0
    table = _read(out)
    assert table.schema == SCHEMA
    assert table.num_rows == 200
    rows = table.to_pylist()
    lines = _lines()
    for i in (0, 1, 2, 57, 123, 199):  # every field of these rows
        assert rows[i] == _expected(lines[i]), f"row {i}"
    # the whole file, column by column
    assert rows == [_expected(line) for line in lines]
    # row groups sized for the reader
    meta = pq.ParquetFile(out / summary["files"][0]["parts"][0]).metadata
    assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == [64, 64, 64, 8]


def test_empty_fields_become_null(converted):
    out, _ = converted
    table = _read(out)
    fields = [line.split("\t") for line in _lines()]
    names = ["label", *INT_COLUMNS, *CAT_COLUMNS]
    empties = {c: sum(1 for f in fields if f[j] == "") for j, c in enumerate(names)}
    assert sum(empties.values()) > 0
    negative = sum(1 for f in fields for v in f[1:14] if v.startswith("-"))
    assert negative > 0  # the sample exercises negative integer features
    for c in names:
        assert table.column(c).null_count == empties[c], c


def _bad_file(tmp_path: Path, name: str, wrong_count: int | None, non_hex: int | None) -> Path:
    lines = _lines()[:8]
    if wrong_count:
        lines[wrong_count - 1] = "\t".join(lines[wrong_count - 1].split("\t")[:-1])
    if non_hex:
        f = lines[non_hex - 1].split("\t")
        f[14 + 4] = "zz12"  # C5
        lines[non_hex - 1] = "\t".join(f)
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_rows_counted_with_first_line(tmp_path):
    src = _bad_file(tmp_path, "bad.tsv", wrong_count=3, non_hex=5)
    summary = convert_criteo([str(src)], str(tmp_path / "out"))
    rep = summary["files"][0]
    assert (summary["rows"], summary["bad_rows"]) == (6, 2)
    assert rep["first_bad_line"] == 3 and "40 fields" in rep["first_bad_reason"]
    assert rep["bad_field_count"] == 1 and rep["bad_columns"] == {"C5": 1}
    kept = _read(tmp_path / "out").to_pylist()
    lines = _lines()[:8]
    assert kept == [_expected(lines[i]) for i in (0, 1, 3, 5, 6, 7)]

    only_hex = _bad_file(tmp_path, "hex.tsv", wrong_count=None, non_hex=5)
    rep = convert_criteo([str(only_hex)], str(tmp_path / "out2"))["files"][0]
    assert rep["first_bad_line"] == 5 and "C5" in rep["first_bad_reason"] and "zz12" in rep["first_bad_reason"]


def test_other_malformed_values(tmp_path):
    lines = _lines()[:4]
    f = lines[1].split("\t")
    f[0] = "2"  # label not 0/1
    lines[1] = "\t".join(f)
    f = lines[3].split("\t")
    f[2] = "x7"  # non-numeric integer feature I2
    lines[3] = "\t".join(f)
    src = tmp_path / "vals.tsv"
    src.write_text("\n".join(lines) + "\n")
    rep = convert_criteo([str(src)], str(tmp_path / "out"))["files"][0]
    assert (rep["rows"], rep["bad_rows"], rep["first_bad_line"]) == (2, 2, 2)
    assert rep["bad_columns"] == {"label": 1, "I2": 1}


def test_strict_raises_naming_file_and_line(tmp_path):
    src = _bad_file(tmp_path, "bad.tsv", wrong_count=None, non_hex=5)
    with pytest.raises(ValueError, match=r"bad\.tsv, line 5: .*C5"):
        convert_criteo([str(src)], str(tmp_path / "out"), strict=True)
    assert not list((tmp_path / "out" / ".rankmix-done").glob("*.json"))


def test_gzip_and_resume(tmp_path):
    gz = tmp_path / "day_0.gz"
    gz.write_bytes(gzip.compress(CRITEO.read_bytes()))
    out = tmp_path / "out"
    first = convert_criteo([str(gz)], str(out))
    assert first["rows"] == 200 and first["skipped_files"] == 0
    assert _read(out).to_pylist() == [_expected(line) for line in _lines()]
    part = out / first["files"][0]["parts"][0]
    assert part.name == "day_0-00000.parquet"
    mtime = part.stat().st_mtime_ns
    time.sleep(0.01)
    again = convert_criteo([str(gz)], str(out))
    assert again["skipped_files"] == 1 and again["files"][0]["skipped"]
    assert again["rows"] == 200  # the earlier report is reused
    assert part.stat().st_mtime_ns == mtime
    # an interrupted run (tmp part, no marker) is redone from scratch
    (out / ".rankmix-done" / "day_0.json").unlink()
    (out / "day_0-00001.parquet.tmp").write_bytes(b"partial")
    redo = convert_criteo([str(gz)], str(out))
    assert redo["skipped_files"] == 0 and not list(out.glob("*.tmp"))


def test_rows_per_file_splits_parts(tmp_path):
    summary = convert_criteo([str(CRITEO)], str(tmp_path), rows_per_file=128, row_group_size=64)
    parts = summary["files"][0]["parts"]
    assert parts == ["criteo_day_sample-00000.parquet", "criteo_day_sample-00001.parquet"]
    assert [pq.ParquetFile(tmp_path / p).metadata.num_rows for p in parts] == [128, 72]
    assert _read(tmp_path).to_pylist() == [_expected(line) for line in _lines()]


def test_parallel_equals_sequential(tmp_path):
    lines = _lines()
    srcs = []
    for i, chunk in enumerate((lines[:100], lines[100:])):
        p = tmp_path / f"day_{i}"
        p.write_text("\n".join(chunk) + "\n")
        srcs.append(str(p))
    seq = convert_criteo(srcs, str(tmp_path / "seq"), workers=1)
    par = convert_criteo(srcs, str(tmp_path / "par"), workers=2)
    assert [f["rows"] for f in par["files"]] == [100, 100]
    assert {**par, "out": None} == {**seq, "out": None}  # the same summary, but for the output folder
    for name in ("day_0-00000.parquet", "day_1-00000.parquet"):
        assert pq.read_table(tmp_path / "par" / name).equals(pq.read_table(tmp_path / "seq" / name))
    assert _read(tmp_path / "par").to_pylist() == [_expected(line) for line in lines]


@pytest.mark.skipif(not AVAZU.is_file(), reason="Avazu sample missing")
def test_csv_avazu(tmp_path):
    def blake2b_id(value: str) -> int:  # stable_hash's docstring: 63 bits of blake2b
        return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little") >> 1

    summary = convert_csv([str(AVAZU)], str(tmp_path), label="click", drop=["id"])
    table = _read(tmp_path)
    raw = AVAZU.read_text().splitlines()
    header = raw[0].split(",")
    assert summary["rows"] == len(raw) - 1 == table.num_rows
    assert "id" not in table.column_names and table.schema.field("click").type == pa.int64()
    assert table.column_names == [c for c in header if c != "id"]
    for i in (0, 1, 50, len(raw) - 2):
        values = dict(zip(header, raw[i + 1].split(",")))
        row = table.slice(i, 1).to_pylist()[0]
        assert row["click"] == int(values["click"])
        for c in header:
            if c not in ("id", "click"):
                assert row[c] == blake2b_id(values[c]), (i, c)
    # ids pinned outside the code: they must never change (every table would be re-keyed)
    first = table.slice(0, 1).to_pylist()[0]
    assert (first["C1"], first["site_id"]) == (3896340314065735090, 5505107423011293770)  # "1005", "1fbe01fe"


def test_csv_numeric_and_malformed(tmp_path):
    src = tmp_path / "log.csv"
    src.write_text("y,site,price,junk\n1,a,2.5,x\n0,,,y\n1,b,abc,z\n0,c\n2,d,1,w\n")
    summary = convert_csv([str(src)], str(tmp_path / "out"), label="y", categorical=["site"],
                          numeric=["price"], drop=["junk"])
    rep = summary["files"][0]
    assert (rep["rows"], rep["bad_rows"], rep["first_bad_line"]) == (2, 3, 4)
    assert rep["bad_field_count"] == 1 and rep["bad_columns"] == {"price": 1, "y": 1}
    assert _read(tmp_path / "out").to_pylist() == [
        {"y": 1, "site": 1702698405120146464, "price": 2.5},  # "a": 63 bits of its blake2b, pinned
        {"y": 0, "site": None, "price": None}]
    with pytest.raises(ValueError, match=r"log\.csv, line 4"):
        convert_csv([str(src)], str(tmp_path / "strict"), label="y", categorical=["site"],
                    numeric=["price"], drop=["junk"], strict=True)


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return rankmix(*args, cwd=ROOT, timeout=timeout)


def test_cli_subcommands(tmp_path):
    r = _cli("data", "criteo", "--src", str(CRITEO), "--out", str(tmp_path / "c"), "--workers", "1",
             "--row-group-size", "100")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 200 and summary["files"][0]["bad_rows"] == 0
    bad = _bad_file(tmp_path, "bad.tsv", wrong_count=3, non_hex=None)
    r = _cli("data", "criteo", "--src", str(bad), "--out", str(tmp_path / "b"), "--strict")
    assert r.returncode == 2 and "bad.tsv, line 3" in r.stderr


@pytest.mark.skipif(not AVAZU.is_file(), reason="Avazu sample missing")
def test_cli_csv_subcommand(tmp_path):
    r = _cli("data", "csv", "--src", str(AVAZU), "--out", str(tmp_path), "--label", "click", "--drop", "id")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["rows"] == 100


def test_criteo_1tb_config():
    cfg = load_config(ROOT / "configs" / "criteo_1tb.toml")
    sparse = [f for f in cfg.features if f.kind != "numeric"]
    numeric = [f for f in cfg.features if f.kind == "numeric"]
    assert [f.name for f in sparse] == CAT_COLUMNS and [f.name for f in numeric] == INT_COLUMNS
    assert [f.num_embeddings for f in sparse] == MLPERF_CAPS
    assert {f.embedding_dim for f in sparse} == {128} and {f.hashing for f in sparse} == {"modulo"}
    for f in numeric:
        assert f.transform == ["clip", "log1p"] and f.clip_min == 0 and f.fill_null == 0
    assert cfg.data.dataset == "parquet" and cfg.model.tower == "rankmixer"
    assert [(t.name, t.label) for t in cfg.model.tasks] == [("click", "label")]


BIG_TABLES = [f"C{i}" for i, cap in enumerate(MLPERF_CAPS, 1) if cap > 100_000]


@pytest.mark.trained
def test_train_two_epochs_on_converted_sample(converted, tmp_path):
    """Unshuffled, the second epoch's 12 batches are the first's: its loss is lower."""
    out, _ = converted
    shrink = [f"--features.{c}.num_embeddings=1000" for c in BIG_TABLES]
    r = _cli("train", "--config", "configs/criteo_1tb.toml", f"--data.train_path={out}",
             f"--data.eval_path={out}", "--data.batch_size=16", "--data.eval_batch_size=64",
             "--data.shuffle=false", "--train.epochs=2", "--model.hidden_dim=16", "--model.num_tokens=4",
             "--optim.warmup_steps=0", f"--train.run_dir={tmp_path / 'run'}", "--checkpoint.enabled=false",
             "--metrics.tensorboard=false", "--metrics.progress=false", "--metrics.log_every=1",
             "--train.device=cpu", *shrink)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 24 and 0.0 <= summary["auc"] <= 1.0
    assert_loss_falls(tmp_path / "run")


def test_hex_column_matches_python_parse():
    """The vectorised hex parse against int(s, 16), on random and awkward strings."""
    import random

    from trainer.offline.csvlog import hex_column

    rnd = random.Random(3)
    digits = "0123456789abcdefABCDEF"
    strings = ["", "0", "ff", "FFFFFFFF", "ffffffff", "00000000", "123456789", "-1", "+1", " 1", "0x1f",
               "g", "1g", "ffffffg", "é", "12 4", "1.5"]
    strings += ["".join(rnd.choice(digits) for _ in range(rnd.randint(1, 8))) for _ in range(500)]
    strings += ["".join(rnd.choice(digits + "xyz-") for _ in range(rnd.randint(0, 9))) for _ in range(500)]

    def parse(s: str) -> int | None:
        ok = 0 < len(s) <= 8 and all(c in digits for c in s)
        return int(s, 16) if ok else None

    ok, values = hex_column(pa.array(strings))
    assert ok.tolist() == [s == "" or parse(s) is not None for s in strings]
    assert values.to_pylist() == [parse(s) for s in strings]
    assert values.type == pa.int64()


def test_number_column_matches_python_parse():
    """Which strings number_column accepts, and their values, against Python's reading."""
    import math
    import random
    import re

    from trainer.offline.csvlog import number_column

    rnd = random.Random(5)
    strings = ["", "0", "-0", "17", "-1", "007", "99999999999999999999", "0.0", "19.0", "-.5", "3.", "-0.0",
               "-", "--1", "+1", "1.5", "-.5", "5.", "1e5", "1E-3", " 1", "1 ", "inf", "nan", "0x10",
               "\u0663", "1_000", "e5", "."]
    strings += ["".join(rnd.choice("0123456789-+.eE ") for _ in range(rnd.randint(0, 5))) for _ in range(400)]
    strings += [str(rnd.randint(-10**6, 10**6)) for _ in range(400)] + [""] * 50
    rnd.shuffle(strings)
    number = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")

    ok, values = number_column(pa.array(strings))
    assert ok.tolist() == [s == "" or bool(number.fullmatch(s)) for s in strings]
    expected = [float(s) if s and number.fullmatch(s) else None for s in strings]
    got = values.to_pylist()
    assert all((a is None and b is None) or (a == b and math.copysign(1, a) == math.copysign(1, b))
               for a, b in zip(got, expected)), [(s, a, b) for s, a, b in zip(strings, got, expected) if a != b]


@pytest.mark.parametrize("workers", [1, 2])
def test_csv_files_of_different_columns_each_keep_their_own(tmp_path, workers):
    """`--categorical` left empty means every other column of *that* file: the first file's
    columns must not carry over to the second (they did with one worker)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.csv").write_text("click,site,app\n1,s1,a1\n0,s2,a2\n")
    (src / "b.csv").write_text("click,device\n0,d1\n1,d2\n")
    out = tmp_path / "out"
    convert_csv([str(src / "a.csv"), str(src / "b.csv")], str(out), label="click", workers=workers)
    schemas = {p.name.split("-")[0]: pq.read_schema(p).names for p in sorted(out.glob("*.parquet"))}
    assert schemas == {"a": ["click", "site", "app"], "b": ["click", "device"]}
