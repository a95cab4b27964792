"""Property-based tests (Hypothesis) of the two doors data comes in by: the Parquet reader
(`ParquetReader` with a `RowEncoder` over random feature specs) and the CSV converter
(`convert_csv`). Random schemas, column types and values (NaN, inf, 2^64-1, floats past
float32's range, empty lists, nulls, huge strings) and truncated files: every case either
reads or converts, with each value equal to an independent reference computed here from
what was written, or ends in one ValueError of one line that names the file. Never another
exception, a hang or a changed value.

Derandomized, so CI sees the same cases on every run. The seed corpus: the `@example`s of
each property, and a `test_seed_*` for each failure the fuzzing found (now fixed), so that
each keeps being tried whatever the generators draw. An exception Python could only print
as ignored (a traceback on stderr, as from pyarrow's invalid-row callback) fails a test.
"""

from __future__ import annotations

import gzip
import hashlib
import math
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec, validate_features
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader
from trainer.offline.csvlog import convert_csv

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")

FUZZ = settings(max_examples=500, deadline=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
U64 = 2 ** 64 - 1


class Refused(Exception):
    """The reference's verdict: the input must be refused (for a CSV row: the row is bad)."""


# ------------------------------------------------------------------------ reader: cases


INT_TYPES = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]
FLOAT_TYPES = [pa.float32(), pa.float64()]


def _int_range(typ: pa.DataType) -> tuple[int, int]:
    bits = typ.bit_width
    return (0, 2 ** bits - 1) if pa.types.is_unsigned_integer(typ) else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)


def ints(typ: pa.DataType, dirty: bool) -> st.SearchStrategy[int]:
    """Ids of `typ`: from 0 to the type's maximum (2^64-1 for uint64), any value of the type
    (negative ones too) when `dirty`."""
    lo, hi = _int_range(typ)
    clean = st.one_of(st.integers(0, min(hi, 60)), st.sampled_from([0, 1, hi]), st.integers(0, hi))
    return st.one_of(clean, st.sampled_from([lo, -1 if lo else hi]), st.integers(lo, hi)) if dirty else clean


def floats(typ: pa.DataType, dirty: bool) -> st.SearchStrategy[float]:
    """Finite numbers of `typ`; when `dirty` also NaN, infinities and float64's beyond float32."""
    width = 32 if typ == pa.float32() else 64
    clean = st.one_of(st.floats(-0.5, 1e6, width=width), st.sampled_from([0.0, 3.4e38, 1e-45]),
                      st.floats(width=width, allow_nan=False, allow_infinity=False))
    edges = [math.nan, math.inf, -math.inf, -1.0] + ([1e39, -1e39, 1.7e308, float(U64)] if width == 64 else [])
    return st.one_of(clean, st.sampled_from(edges), st.floats(width=width)) if dirty else clean


def rows_of(values: st.SearchStrategy, rows: int, nulls: bool) -> st.SearchStrategy[list]:
    return st.lists(st.one_of(values, values, values, st.none()) if nulls else values, min_size=rows, max_size=rows)


@st.composite
def column(draw, kind: str, rows: int) -> pa.Array:
    """A column for a feature of `kind` (or "label", "user"). Most are clean: a type the
    encoder takes and valid values. A dirty one may hold anything of its type (nulls, NaN,
    negative ids, ...) or be of a type the encoder refuses (strings, huge or not; floats for ids)."""
    # Rare draws at the high end: Hypothesis favours (and shrinks to) the low one.
    dirty = draw(st.integers(0, 3)) == 3
    nulls = dirty or draw(st.integers(0, 7)) == 7
    if dirty and draw(st.integers(0, 3)) == 3:
        text = st.one_of(st.text(max_size=5), st.builds(lambda c, n: c * n, st.characters(), st.integers(1, 70_000)))
        return pa.array(draw(rows_of(text, rows, nulls)), pa.string())
    if kind in ("id_list", "sequence"):
        typ = draw(st.sampled_from(INT_TYPES))
        items = st.one_of(ints(typ, dirty), ints(typ, dirty), st.none()) if dirty else ints(typ, dirty)
        outer = draw(st.sampled_from([pa.list_, pa.large_list]))
        return pa.array(draw(rows_of(st.lists(items, max_size=4), rows, nulls)), outer(typ))
    if kind == "label":
        typ, values = draw(st.sampled_from([(pa.bool_(), st.booleans()), (pa.int64(), st.sampled_from([0, 1])),
                                            (pa.float32(), st.sampled_from([0.0, 1.0])),
                                            (pa.uint8(), st.sampled_from([0, 1]))]))
        if dirty:
            values = st.one_of(values, floats(typ, dirty) if pa.types.is_floating(typ) else
                               ints(typ, dirty) if pa.types.is_integer(typ) else values)
        return pa.array(draw(rows_of(values, rows, nulls)), typ)
    if kind == "numeric":
        typ = draw(st.sampled_from(INT_TYPES + FLOAT_TYPES * 4))
    else:
        typ = draw(st.sampled_from(INT_TYPES + (FLOAT_TYPES if dirty else [])))
    values = floats(typ, dirty) if pa.types.is_floating(typ) else ints(typ, dirty)
    return pa.array(draw(rows_of(values, rows, nulls)), typ)


@st.composite
def specs(draw, name: str) -> FeatureSpec:
    kind = draw(st.sampled_from(["id", "id_list", "sequence", "numeric"]))
    if kind == "numeric":
        transform = draw(st.lists(st.sampled_from(["log1p", "clip", "standardize"]), max_size=3))
        low = draw(st.floats(-10, 10))
        return FeatureSpec(name=name, kind="numeric", transform=transform, clip_min=low,
                           clip_max=low + draw(st.floats(0, 20)), mean=draw(st.floats(-5, 5)),
                           std=draw(st.sampled_from([1.0, 0.5, 1e-30, 3.0])),
                           fill_null=draw(st.one_of(st.none(), st.floats(-3, 3))))
    return FeatureSpec(name=name, kind=kind, num_embeddings=draw(st.sampled_from([1, 7, 50, 1000, 2 ** 40])),
                       hashing=draw(st.sampled_from(["modulo", "none", "managed"])),
                       max_len=draw(st.integers(0, 3)) if kind != "id" else 0)


@dataclass
class ReaderCase:
    features: list[FeatureSpec]
    table: pa.Table
    user: bool
    row_group_size: int
    batch_size: int
    keep: float | None = None
    """The share of the file's bytes kept (a truncated file), or None for the whole file."""


@st.composite
def reader_cases(draw) -> ReaderCase:
    rows = 0 if draw(st.integers(0, 30)) == 30 else draw(st.integers(1, 25))
    features = [draw(specs(f"f{i}")) for i in range(draw(st.integers(1, 3)))]
    validate_features(features)
    columns = {f.column: draw(column(f.kind, rows)) for f in features}
    columns["click"] = draw(column("label", rows))
    user = draw(st.booleans())
    if user:
        columns["user"] = draw(column("user", rows))
    truncated = draw(st.integers(0, 7)) == 7
    return ReaderCase(features, pa.table(columns), user, draw(st.integers(1, 30)), draw(st.integers(1, 30)),
                      draw(st.floats(0, 0.999)) if truncated else None)


# -------------------------------------------------------------------- reader: reference


def _spread(value: int) -> int:
    """splitmix64's finaliser over 64-bit words, reduced to 62 bits (trainer/data/ids.py spread)."""
    mask = 2 ** 64 - 1
    z = value & mask
    z ^= z >> 30
    z = z * 0xBF58476D1CE4E5B9 & mask
    z ^= z >> 27
    z = z * 0x94D049BB133111EB & mask
    z ^= z >> 31
    return z % 2 ** 62


def _table_row(value: int | None, f: FeatureSpec) -> int:
    if value is None:
        raise Refused("null inside a list")
    if value < 0:
        raise Refused("negative id")
    if f.hashing == "managed":
        return _spread(value)
    if f.hashing == "none" and value >= f.num_embeddings:
        raise Refused("out of range")
    return value % f.num_embeddings


def expected_bag(value, f: FeatureSpec) -> list[int]:
    """The table rows the reader must give a row's value of id feature `f`."""
    if value is None:
        return []
    if f.kind == "id":
        return [_table_row(value, f)]
    bag = [_table_row(v, f) for v in value]
    return bag[-f.max_len:] if f.max_len else bag


def expected_number(value, f: FeatureSpec) -> np.float32:
    if value is None:
        if f.fill_null is None:
            raise Refused("null")
        x = float(f.fill_null)
    else:
        x = float(value)
        if not math.isfinite(x):
            raise Refused("not finite")
    for op in f.transform:
        if op == "log1p":
            if x <= -1:
                raise Refused("log1p of <= -1")
            x = float(np.log1p(x))
        elif op == "clip":
            x = min(max(x, f.clip_min), f.clip_max)
        else:
            x = (x - f.mean) / f.std
    with np.errstate(over="ignore"):
        out = np.float32(x)
    if not np.isfinite(out):
        raise Refused("beyond float32")
    return out


def expected_label(value) -> float:
    if value is None or value not in (0, 1):  # True == 1, NaN is neither
        raise Refused("label")
    return float(value)


def expected_user(value) -> int:
    """A user id as int64; a uint64 one past int64 by its bit pattern (distinct keys for UAUC)."""
    if value is None:
        raise Refused("user id")
    return value - 2 ** 64 if value >= 2 ** 63 else value


def _accepts(typ: pa.DataType, kind: str) -> bool:
    if kind in ("id", "user"):
        return pa.types.is_integer(typ)
    if kind in ("id_list", "sequence"):
        return (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_integer(typ.value_type)
    if kind == "label":
        return pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)
    return pa.types.is_integer(typ) or pa.types.is_floating(typ)


def reference(case: ReaderCase) -> dict[str, list]:
    """Per feature (and label, user) the decoded value of every row; Refused if the reader
    must refuse the file."""
    table = case.table
    if case.keep is not None or table.num_rows == 0:
        raise Refused("truncated or empty")
    kinds = {f.column: f.kind for f in case.features} | {"click": "label", "user": "user"}
    if not all(_accepts(table.schema.field(c).type, k) for c, k in kinds.items() if c in table.column_names):
        raise Refused("type")
    out = {}
    for f in case.features:
        values = table.column(f.column).to_pylist()
        out[f.name] = [expected_number(v, f) if f.kind == "numeric" else expected_bag(v, f) for v in values]
    out["click"] = [expected_label(v) for v in table.column("click").to_pylist()]
    if case.user:
        out["user"] = [expected_user(v) for v in table.column("user").to_pylist()]
    return out


# ---------------------------------------------------------------------------- reader: run


def decoded(reader: ParquetReader, features: list[FeatureSpec], user: bool) -> dict[str, list]:
    """Every real row's decoded values, by feature, in file order (an unshuffled epoch)."""
    out: dict[str, list] = {f.name: [] for f in features} | {"click": []} | ({"user": []} if user else {})
    numeric = [f.name for f in features if f.kind == "numeric"]
    for batch in reader:
        real = int((batch.weights > 0).sum())
        jagged = batch.sparse.to_dict() | (batch.managed_ids.to_dict() if batch.managed_ids is not None else {})
        for f in features:
            if f.kind == "numeric":
                out[f.name] += list(batch.dense[:real, numeric.index(f.name)].numpy())
            else:
                bags = jagged[f.name]
                out[f.name] += [b.tolist() for b in bags.to_dense()[:real]]
        out["click"] += batch.labels[:real, 0].tolist()
        if user:
            out["user"] += batch.users[:real].tolist()
    return out


def check_reader(case: ReaderCase) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "part-0.parquet"
        pq.write_table(case.table, path, row_group_size=case.row_group_size)
        if case.keep is not None:
            data = path.read_bytes()
            path.write_bytes(data[:int(len(data) * case.keep)])
        encoder = RowEncoder(case.features, [TaskSpec(name="click")], "user" if case.user else "")
        try:
            want = reference(case)
        except Refused:
            want = None
        try:
            options = ReaderOptions(batch_size=case.batch_size, shuffle=False, drop_last=False)
            reader = ParquetReader(str(path), encoder, options)
            got = decoded(reader, case.features, case.user)
        except ValueError as e:
            message = str(e)
            assert str(path) in message and "\n" not in message, message
            assert want is None, f"refused a valid file: {message}"
            return
        assert want is not None, f"read a file it must refuse: {got}"
        assert got.keys() == want.keys()
        for key, values in want.items():
            assert got[key] == values, key


def case_of(columns: dict[str, pa.Array], *features: FeatureSpec, **kw) -> ReaderCase:
    """A reader case by hand: `columns` holds the features' and the label's ("click")."""
    return ReaderCase(list(features), pa.table(columns), **{"user": "user" in columns, "row_group_size": 2,
                                                             "batch_size": 3, **kw})


ID = FeatureSpec(name="f0", num_embeddings=7)
TAGS = FeatureSpec(name="f0", kind="id_list", num_embeddings=50, max_len=2)
PRICE = FeatureSpec(name="f0", kind="numeric", transform=["log1p"])
CLICKS = pa.array([0, 1, 1], pa.int64())


@settings(FUZZ)
@given(reader_cases())
@example(case_of({"f0": pa.array([U64, 2 ** 63, 6], pa.uint64()), "click": CLICKS}, ID))  # 2^64-1 % 7 = 1
@example(case_of({"f0": pa.array([U64, 0, None], pa.uint64()), "click": CLICKS},
                 FeatureSpec(name="f0", num_embeddings=2 ** 40, hashing="managed")))
@example(case_of({"f0": pa.array([[], None, [1, 2, 3]], pa.list_(pa.int64())), "click": CLICKS}, TAGS))
@example(case_of({"f0": pa.array([1.0, 1e39, 2.0]), "click": CLICKS}, PRICE))  # beyond float32
@example(case_of({"f0": pa.array([1.0, 3.4e38, -0.5], pa.float32()), "click": CLICKS}, PRICE))
@example(case_of({"f0": pa.array([1, 2, 3]), "click": pa.array([0.0, math.nan, 1.0])}, ID))
@example(case_of({"f0": pa.array(["x" * 70_000, "", None]), "click": CLICKS}, ID))
@example(case_of({"f0": pa.array([1, 2, 3]), "click": CLICKS}, ID, keep=0.5))
def test_reader_reads_exactly_or_refuses_in_one_line(case):
    check_reader(case)


def test_seed_reader_reads_a_user_id_past_int64_by_its_bit_pattern():
    """Was pyarrow's 'Integer value ... not in range' from an int64 cast: no file, column or row."""
    check_reader(case_of({"f0": pa.array([1, 2, 3]), "click": CLICKS, "user": pa.array([1, U64, 2], pa.uint64())},
                         ID))


@pytest.mark.parametrize("column,feature", [
    (pa.array([[-128], [1], []], pa.list_(pa.int8())), FeatureSpec(name="f0", kind="id_list", num_embeddings=1000)),
    (pa.array([1, -5, 2], pa.int32()), FeatureSpec(name="f0", num_embeddings=2 ** 40, hashing="none")),
])
def test_seed_reader_refuses_negative_ids_of_narrow_types(column, feature):
    """Seen as unsigned (-128 as 128) they were below num_embeddings: negative rows for the model."""
    check_reader(case_of({"f0": column, "click": CLICKS}, feature))


# ------------------------------------------------------------------------ CSV: cases


@dataclass
class CsvCase:
    data: bytes
    """The input file's bytes (gzip-compressed for a .gz name)."""
    name: str
    delimiter: str
    label: str
    categorical: list[str]
    numeric: list[str]
    drop: list[str]
    block_size: int


LABELS = ["0", "1", "0", "1", "0", "1", "2", "", "true", " 1", "1.0"]
NUMBERS = ["0", "1.5", "-2e3", "", ".5", "7.", "+3", "1e308", "18446744073709551615", "-0.0", "4.9e-324",
           "nan", "inf", "-inf", "1e999", "-1e999", "abc", "0x10", " 1", "1 ", "\u0661", "1e", "--1"]


def _chars(delimiter: str) -> st.SearchStrategy[str]:
    """Any character but the delimiter and line breaks (the converter reads no quotes)."""
    return st.characters(blacklist_categories=("Cs",), blacklist_characters=[delimiter, "\n", "\r"])


def _text(delimiter: str) -> st.SearchStrategy[str]:
    """A cell: short text, now and then a huge one."""
    chars = _chars(delimiter)
    return st.one_of(st.text(chars, max_size=6), st.text(chars, max_size=6),
                     st.builds(lambda c, n: c * n, chars, st.integers(1, 20_000)))


@st.composite
def csv_cases(draw) -> CsvCase:
    delimiter = draw(st.sampled_from([",", "\t", ";", "|"]))
    roles = draw(st.lists(st.sampled_from(["categorical", "numeric", "drop"]), max_size=4))
    names = draw(st.lists(st.text(_chars(delimiter), max_size=8), min_size=len(roles) + 1, max_size=len(roles) + 1,
                          unique=True))
    label, columns = names[0], names[1:]
    header = draw(st.permutations(names))
    cells = {"numeric": st.sampled_from(NUMBERS), "categorical": _text(delimiter), "drop": _text(delimiter),
             "label": st.sampled_from(LABELS)}
    role = dict(zip(columns, roles)) | {label: "label"}
    lines = []
    for _ in range(draw(st.integers(0, 12))):
        row = [draw(cells[role[c]]) for c in header]
        shape = draw(st.integers(0, 15))  # the high end, rarely: a field too many or too few, an empty line
        row = row + ["x"] if shape == 15 else row[:-1] if shape == 14 else [] if shape == 13 else row
        lines.append(delimiter.join(row))
    text = "\n".join([delimiter.join(header), *lines]) + ("\n" if draw(st.booleans()) else "")
    data = text.encode()
    if draw(st.integers(0, 15)) == 15:  # a byte that is no UTF-8, somewhere
        at = draw(st.integers(0, len(data)))
        data = data[:at] + b"\xff" + data[at:]
    gz = draw(st.integers(0, 3)) == 3
    if gz:
        data = gzip.compress(data)
    if draw(st.integers(0, 7)) == 7:
        data = data[:draw(st.integers(0, max(len(data) - 1, 0)))]
    explicit = draw(st.booleans())
    return CsvCase(data, "log.csv.gz" if gz else "log.csv", delimiter, label,
                   [c for c in columns if role[c] == "categorical"] if explicit else [],
                   [c for c in columns if role[c] == "numeric"],
                   [c for c in columns if role[c] == "drop"],
                   draw(st.sampled_from([1 << 10, 1 << 16, 1 << 23])))


# ---------------------------------------------------------------------- CSV: reference


def _number(cell: str) -> float | None:
    """A numeric cell's value: None for an empty cell; Refused (a bad row) if it is no finite decimal."""
    if cell == "":
        return None
    if not re.fullmatch(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?", cell) or not math.isfinite(float(cell)):
        raise Refused(cell)
    return float(cell)


def _hashed(cell: str) -> int | None:
    """A categorical cell's id: 63 bits of its blake2b digest (csvlog's stable_hash), None if empty."""
    return int.from_bytes(hashlib.blake2b(cell.encode(), digest_size=8).digest(), "little") >> 1 if cell else None


def csv_reference(case: CsvCase) -> tuple[dict[str, list], int]:
    """The converted columns and the count of bad rows; Refused if the input must be refused."""
    data = case.data
    if case.name.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise Refused(f"gzip: {e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused("not UTF-8") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    if not lines:
        raise Refused("no header")
    header = lines[0].split(case.delimiter)
    named = [case.label, *case.categorical, *case.numeric, *case.drop]
    if any(c not in header for c in named) or len(set(header)) < len(header):
        raise Refused("header")
    if case.categorical and set(header) - set(named):
        raise Refused("unnamed columns")
    categorical = case.categorical or [c for c in header if c not in named]
    out = {c: [] for c in [case.label, *categorical, *case.numeric]}
    bad = 0
    for line in lines[1:]:
        fields = line.split(case.delimiter)
        if len(fields) != len(header):
            bad += 1
            continue
        row = dict(zip(header, fields))
        try:
            if row[case.label] not in ("0", "1"):
                raise Refused(row[case.label])
            values = {c: _number(row[c]) for c in case.numeric}
        except Refused:
            bad += 1
            continue
        out[case.label].append(int(row[case.label]))
        for c in categorical:
            out[c].append(_hashed(row[c]))
        for c, v in values.items():
            out[c].append(v)
    return out, bad


# ---------------------------------------------------------------------------- CSV: run


def check_csv(case: CsvCase) -> None:
    with tempfile.TemporaryDirectory() as folder:
        src, out = Path(folder) / case.name, Path(folder) / "out"
        src.write_bytes(case.data)
        try:
            want, bad = csv_reference(case)
        except Refused:
            want = None
        try:
            summary = convert_csv([str(src)], str(out), label=case.label, categorical=case.categorical,
                                  numeric=case.numeric, drop=case.drop, delimiter=case.delimiter,
                                  block_size=case.block_size)
        except ValueError as e:
            message = str(e)
            assert str(src) in message and "\n" not in message, message
            return
        assert want is not None, f"converted an input it must refuse: {summary}"
        parts = sorted(out.glob("*.parquet"))
        got = pa.concat_tables([pq.read_table(p) for p in parts]).to_pydict() if parts else {c: [] for c in want}
        assert (summary["rows"], summary["bad_rows"]) == (len(want[case.label]), bad)
        assert list(got) == list(want)
        for column, values in want.items():
            assert got[column] == values, column


def csv_case(data: bytes, name: str = "log.csv", **kw) -> CsvCase:
    """A CSV case by hand: label y, numeric n, every other column categorical."""
    return CsvCase(data, name, **{"delimiter": ",", "label": "y", "categorical": [], "numeric": ["n"], "drop": [],
                                  "block_size": 1 << 20, **kw})


@settings(FUZZ)
@given(csv_cases())
@example(csv_case(b"y,n,c\n1,1e999,a\n0,18446744073709551615,\n 1,2,b\n1,nan,c\n0,,d\n1,2,e,f\n\n1,.5,g"))
@example(csv_case(b"y,n\n" + b"1,2\n" * 600 + b"0,\xff\n", block_size=1 << 10))  # bad UTF-8 in a later block
@example(csv_case(b"y,n\n1,2\n", numeric=["n", "m"]))  # a named column missing
def test_csv_converter_converts_exactly_or_refuses_in_one_line(case):
    check_csv(case)


@pytest.mark.parametrize("case", [
    csv_case(b"y", numeric=[]),
    csv_case(b"y,n\n1,\xff\n", numeric=[]),
    csv_case(b"", label="", numeric=[]),
    csv_case(b"y,n\n1," + b"7" * 3000 + b"\n", block_size=1 << 10),
    csv_case(b"y,n\n1,2\n1,\xff,3\n"),
    csv_case(b"y,n\n" + b"1,2\n" * 600 + b"1,\xff,3\n", block_size=1 << 10),
], ids=["header without newline", "not UTF-8", "empty, label ''", "row straddling blocks",
        "malformed and not UTF-8", "malformed and not UTF-8, later block"])
def test_seed_csv_read_errors_name_the_file(case):
    """The first block's errors were pyarrow's messages without the file's name; a malformed row
    that is not UTF-8 also printed pyarrow's ignored UnicodeDecodeError, a traceback, on stderr."""
    check_csv(case)


@pytest.mark.parametrize("data", [gzip.compress(b"y,n\n1,2\n" * 100)[:30],
                                  gzip.compress(b"y,n\n" + b"1,2\n" * 100_000)[:-10], b"y,n\n1,2\n"],
                         ids=["truncated in the header", "truncated later", "no gzip"])
def test_seed_csv_corrupt_gzip_is_a_value_error(data):
    """Was pyarrow's OSError 'Truncated compressed stream': exit 1 with a traceback."""
    check_csv(csv_case(data, "log.csv.gz", block_size=1 << 10))
