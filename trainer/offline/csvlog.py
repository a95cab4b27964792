"""Delimited text logs (CSV / TSV, optionally compressed) -> Parquet, streaming and resumable.

The machinery shared by the converters (`rankmix data csv`, `rankmix data criteo`):

- **Streaming, bounded memory**: an input is read with pyarrow's streaming CSV reader
  (every column as a string, `block_size` bytes at a time), each block is validated and
  converted column-wise, and rows go to a Parquet writer in row groups of exactly
  `row_group_size` rows. Memory is about one block plus one row group, whatever the
  file size. Inputs ending in .gz / .bz2 / .zst / .lz4 are decompressed on the fly.
- **Parallel**: one input file per worker process (`workers`).
- **One name per input**: an input's parts are `<name>-NNNNN.parquet`, its name being its
  stem (`day_0` of `day_0.gz`), plus a hash of its full path where that stem is another
  input's name or reads as one's part (`a-1` next to `a`). An input keeps the name an
  earlier run gave it, and only files of exactly its own part pattern are ever removed.
- **Resumable per input, whatever the crash**: parts are written as `*.parquet.tmp`. Once
  the whole input is done, its marker `.rankmix-done/<name>.json` (a hidden folder: no
  input's parts can be read as a marker, no reader of `*.parquet` sees it) is rewritten to
  hold only the input's path, which says "being replaced" and keeps the name claimed; then
  the parts are renamed into place, the earlier run's extra parts removed, and only then
  the marker gets a digest of the options its output depends on and of the input's size
  and mtime, and its report. Every marker is written through a temp file. A rerun skips
  every input whose marker holds a matching digest and reports it as `skipped`; any other
  input (one cut short at any step above included) is converted again, under its name.
- **Malformed rows are counted, never silently dropped**: a row with the wrong number of
  fields or a value that does not parse is left out of the output and counted; the
  per-file report gives the count, the first offending line number (1-based, physical
  line of the input, header included) and why. With `strict` the first such row raises
  `ValueError` naming the file and the line. An input that cannot be read on (a corrupt or
  truncated compressed stream, text that is not UTF-8, a line longer than `block_size`)
  raises `ValueError` naming the file, and the row where pyarrow gives it.

A *layout* (`CsvLayout` here, `CriteoLayout` in criteo.py) says how the string columns of
one block become typed output columns plus, per checked column, which rows are valid.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import glob
import hashlib
import json
import multiprocessing
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from trainer.files import write_atomic

__all__ = ["CsvLayout", "FileReport", "convert_files", "convert_csv", "stable_hash"]

DEFAULT_ROW_GROUP = 65_536
DEFAULT_BLOCK = 8 << 20
_COMPRESSED = (".gz", ".bz2", ".zst", ".lz4")
_DATA_EXT = (".tsv", ".csv", ".txt")
_NUMBER = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?$"


@dataclass
class Checked:
    """One block converted: output columns, and per checked column the valid rows."""

    columns: dict[str, pa.Array]
    checks: list[tuple[str, np.ndarray, pa.Array]]  # (column, valid mask, raw strings)


@dataclass
class FileReport:
    """What happened to one input file (one entry of the summary JSON)."""

    src: str
    rows: int = 0
    """Rows written."""
    bad_rows: int = 0
    """Rows left out because they are malformed."""
    first_bad_line: int | None = None
    """1-based line number of the first malformed row (None: none)."""
    first_bad_reason: str = ""
    bad_field_count: int = 0
    """Malformed rows with the wrong number of fields."""
    bad_columns: dict[str, int] = field(default_factory=dict)
    """Malformed rows per column whose value does not parse (a row may count in several)."""
    parts: list[str] = field(default_factory=list)
    skipped: bool = False
    """True when a previous run had completed this input (its report is reused)."""


class CsvLayout:
    """A generic log: a label column, categorical columns (strings hashed to int64 with
    `stable_hash`, empty -> null), numeric columns (float64, empty -> null); columns in
    `drop` are ignored. With `categorical` empty, every other column is categorical."""

    header = True

    def __init__(self, label: str, categorical: list[str] = (), numeric: list[str] = (),
                 drop: list[str] = (), delimiter: str = ","):
        self.label, self.delimiter = label, delimiter
        self.categorical, self.numeric, self.drop = list(categorical), list(numeric), list(drop)
        self.column_names: list[str] | None = None  # set from the header

    def bind(self, header: list[str], src: str) -> CsvLayout:
        """This layout checked against one file's header, as a new layout: the layout the
        user gave is shared by every input file, and one file's columns must not become
        the next file's (an empty `categorical` means "every other column of this file")."""
        named = [self.label, *self.categorical, *self.numeric, *self.drop]
        missing = [c for c in named if c not in header]
        if missing:
            raise ValueError(f"{src}: columns {missing} not in the header {header}")
        rest = [c for c in header if c not in set(named)]
        if rest and self.categorical:
            raise ValueError(f"{src}: columns {rest} are not named in --label, --categorical, "
                             "--numeric or --drop")
        bound = copy.copy(self)
        bound.categorical = self.categorical or rest
        bound.column_names = header
        return bound

    @property
    def schema(self) -> pa.Schema:
        return pa.schema([(self.label, pa.int64())] + [(c, pa.int64()) for c in self.categorical]
                         + [(c, pa.float64()) for c in self.numeric])

    def convert(self, batch: pa.RecordBatch) -> Checked:
        cols, checks = {}, []
        raw = batch.column(self.label)
        ok, cols[self.label] = label_column(raw)
        checks.append((self.label, ok, raw))
        for c in self.categorical:
            cols[c] = hashed_column(batch.column(c))
        for c in self.numeric:
            raw = batch.column(c)
            ok, cols[c] = number_column(raw)
            checks.append((c, ok, raw))
        return Checked(cols, checks)


# ----------------------------------------------------------------------------- columns


def label_column(raw: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """'0' / '1' -> int64; anything else is invalid."""
    ok = pc.is_in(raw, value_set=pa.array(["0", "1"])).to_numpy(zero_copy_only=False)
    return ok, pc.cast(pc.equal(raw, "1"), pa.int64())


def number_column(raw: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Decimal numbers -> float64, empty -> null; anything else is invalid, a number beyond
    float64's range (1e999, read as inf) too."""
    empty = pc.equal(pc.utf8_length(raw), 0)
    ok = pc.or_(empty, pc.match_substring_regex(raw, _NUMBER))
    good = pc.and_(ok, pc.invert(empty))
    values = pc.cast(pc.if_else(good, raw, pa.scalar(None, pa.string())), pa.float64())
    finite = np.isfinite(values.to_numpy(zero_copy_only=False))  # a null is NaN here
    empty = empty.to_numpy(zero_copy_only=False)
    return ok.to_numpy(zero_copy_only=False) & (empty | finite), values


_HEX = np.full(256, 255, np.uint8)
for _i, _ch in enumerate(b"0123456789abcdef"):
    _HEX[_ch] = _i
for _i, _ch in enumerate(b"ABCDEF"):
    _HEX[_ch] = 10 + _i
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)


def hex_column(raw: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Up to 8 hex digits -> their unsigned 32-bit value as int64, empty -> null."""
    n = len(raw)
    length = pc.binary_length(raw).to_numpy(zero_copy_only=False)
    # A non-ASCII value is no hex, and would be padded to 8 characters but more bytes,
    # shifting every later row off the 8-byte grid read below.
    fits = (length <= 8) & pc.string_is_ascii(raw).to_numpy(zero_copy_only=False)
    safe = raw if fits.all() else pc.if_else(pa.array(fits), raw, pa.scalar("0"))
    padded = pc.utf8_lpad(safe, 8, "0")
    if isinstance(padded, pa.ChunkedArray):
        padded = padded.combine_chunks()
    offsets = np.frombuffer(padded.buffers()[1], np.int32)[padded.offset:padded.offset + n + 1]
    data = np.frombuffer(padded.buffers()[2], np.uint8)[offsets[0]:offsets[0] + 8 * n].reshape(n, 8)
    nibbles = np.take(_HEX, data)  # ~3x faster than _HEX[data] for a uint8 index
    # Per row at once, as 8 bytes: a valid nibble is < 16, the 255 of a non-hex digit is not.
    ok = fits & ((nibbles.view(np.uint64).reshape(n) & _HIGH_NIBBLES) == 0)
    # Two nibbles per byte, the 4 bytes read as one big-endian uint32: no integer matmul.
    packed = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]
    values = np.where(ok, packed.view(">u4").reshape(n), 0).astype(np.int64)
    return ok, pa.array(values, mask=(length == 0) | ~ok)


def stable_hash(value: str) -> int:
    """A categorical string's id: 63 bits of blake2b, the same in every process and run."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little") >> 1


def hashed_column(raw: pa.Array) -> pa.Array:
    """Strings -> `stable_hash` int64 (hashing each distinct value once), empty -> null."""
    enc = pc.dictionary_encode(raw)
    ids = np.array([stable_hash(v) for v in enc.dictionary.to_pylist()], np.int64)
    values = ids[enc.indices.to_numpy(zero_copy_only=False)] if len(ids) else np.zeros(len(raw), np.int64)
    return pa.array(values, mask=pc.equal(pc.utf8_length(raw), 0).to_numpy(zero_copy_only=False))


# ----------------------------------------------------------------------------- one file


def _stem(name: str) -> str:
    for ext in _COMPRESSED:
        if name.endswith(ext):
            name = name[: -len(ext)]
    for ext in _DATA_EXT:
        if name.endswith(ext):
            name = name[: -len(ext)]
    return name


def _name_hash(path: str) -> str:
    """8 hex digits of an input's full path, told apart from its stem."""
    return hashlib.blake2b(path.encode(), digest_size=4).hexdigest()


def _part_of(name: str) -> str | None:
    """The name whose part `name` reads as (`a` for `a-1`), if any."""
    found = re.fullmatch(r"(.*)-\d+", name)
    return found[1] if found else None


def _parts_of(out: Path, name: str, suffix: str = "") -> list[Path]:
    """The files of exactly `name`'s part pattern, `name-NNNNN.parquet` + `suffix`: none of
    another name's, even one that starts as `name` does."""
    exact = re.compile(re.escape(name) + r"-\d{5,}\.parquet" + re.escape(suffix))
    return [p for p in out.glob(glob.escape(name) + "-*") if exact.fullmatch(p.name)]


class _PartWriter:
    """Rows -> `<name>-NNNNN.parquet.tmp` parts of exactly `row_group_size`-row row groups."""

    def __init__(self, out: Path, name: str, schema: pa.Schema, row_group_size: int, rows_per_file: int):
        self.out, self.name, self.schema = out, name, schema
        self.rg, self.per_file = row_group_size, rows_per_file
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.writer: pq.ParquetWriter | None = None
        self.in_part = 0
        self.parts: list[Path] = []

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.pending_rows += table.num_rows
        if self.pending_rows >= self.rg:
            self._drain(final=False)

    def _drain(self, final: bool) -> None:
        table = pa.concat_tables(self.pending) if self.pending else self.schema.empty_table()
        start = 0
        while table.num_rows - start >= self.rg or (final and start < table.num_rows):
            if self.writer is None:
                path = self.out / f"{self.name}-{len(self.parts):05d}.parquet.tmp"
                self.parts.append(path)
                self.writer = pq.ParquetWriter(path, self.schema)
                self.in_part = 0
            take = min(self.rg, table.num_rows - start)
            if self.per_file:
                take = min(take, self.per_file - self.in_part)
            self.writer.write_table(table.slice(start, take), row_group_size=take)
            start += take
            self.in_part += take
            if self.per_file and self.in_part >= self.per_file:
                self.writer.close()
                self.writer = None
        rest = table.slice(start)
        self.pending, self.pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def finish(self) -> list[str]:
        """Every part complete, then in place of the earlier run's parts; returns their names."""
        self._drain(final=True)
        if self.writer is not None:
            self.writer.close()
        final = []
        for tmp in self.parts:
            dest = tmp.with_name(tmp.name[: -len(".tmp")])
            os.replace(tmp, dest)
            final.append(dest.name)
        for stale in _parts_of(self.out, self.name):  # parts of an earlier, longer split
            if stale.name not in final:
                stale.unlink()
        return final


def _header(src: str, delimiter: str) -> list[str]:
    """The first line's fields."""
    head = b""
    try:
        with pa.input_stream(src) as f:
            while b"\n" not in head and (chunk := f.read(1 << 16)):
                head += chunk
    except OSError as e:  # a corrupt or truncated compressed input
        raise ValueError(f"{src}: cannot read: {e}") from None
    line = head.split(b"\n", 1)[0]
    try:
        return line.decode("utf-8").rstrip("\r").split(delimiter)
    except UnicodeDecodeError as e:
        raise ValueError(f"{src}: the header is not UTF-8 ({_bad_byte(e)})") from None


def _bad_byte(e: UnicodeDecodeError) -> str:
    """Where a line is not UTF-8."""
    return f"byte {e.object[e.start]:#04x} at column {e.start + 1}"


def _line_of(row: int, header_lines: int, skipped: list[int]) -> int:
    """Physical 1-based line of the `row`-th (0-based) parsed row, given the lines skipped
    as malformed (sorted)."""
    line = row + 1 + header_lines
    for s in skipped:
        if s <= line:
            line += 1
        else:
            break
    return line


class _BadRows:
    """Malformed rows of one input as they are found: counted into the report, the first
    one (smallest line) kept with its reason, and `strict` raising on the first."""

    def __init__(self, src: str, report: FileReport, strict: bool):
        self.src, self.report, self.strict = src, report, strict
        self.field_count: list[tuple[int, str]] = []  # filled by the CSV reader's handler
        self.first: list[tuple[int, str]] = []
        self.skipped_lines: list[int] = []  # sorted: where parsed rows stop matching lines

    def on_invalid(self, row) -> str:
        """pyarrow's invalid-row handler: a row with the wrong number of fields is skipped."""
        number = row.number if row.number is not None else -1
        self.field_count.append((number, f"expected {row.expected_columns} fields, got {row.actual_columns}"))
        return "skip"

    def flush_field_count(self) -> None:
        """Count the rows the CSV reader skipped since the last call."""
        if self.field_count:
            self.skipped_lines = sorted(self.skipped_lines + [n for n, _ in self.field_count])
            self.report.bad_rows += len(self.field_count)
            self.report.bad_field_count += len(self.field_count)
            self.first.append(min(self.field_count))
            self.field_count.clear()

    def values(self, checked: Checked, parsed: int, header_lines: int) -> np.ndarray:
        """Rows of a converted batch with a value that does not parse, as a mask; counted."""
        bad = np.zeros(len(checked.checks[0][1]), bool)
        for col, ok, _ in checked.checks:
            if not ok.all():
                self.report.bad_columns[col] = self.report.bad_columns.get(col, 0) + int((~ok).sum())
                bad |= ~ok
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            col, _, raw = next(c for c in checked.checks if not c[1][i])
            self.first.append((_line_of(parsed + i, header_lines, self.skipped_lines),
                               f"column {col}: bad value {raw[i].as_py()!r}"))
            self.report.bad_rows += int(bad.sum())
        self.check()
        return bad

    def check(self) -> None:
        """With `strict`, stop at the first malformed row found so far (by line)."""
        if self.strict and self.first:
            line, why = min(self.first)
            raise ValueError(f"{self.src}, line {line}: malformed row ({why})")

    def finish(self) -> None:
        if self.first:
            self.report.first_bad_line, self.report.first_bad_reason = min(self.first)


def _bind(src: str, layout) -> tuple[object, int]:
    """(the layout bound to the file, its header lines)."""
    if not layout.header:
        return layout, 0
    return layout.bind(_header(src, layout.delimiter), src), 1


def _read_csv(src: str, layout, block_size: int, on_invalid) -> Iterator[pa.RecordBatch]:
    """The file's rows as batches of string columns. What stops the read (a row pyarrow can
    neither parse nor skip, from the first block on; a corrupt or truncated compressed
    input) is one ValueError naming the file, and the row where pyarrow gives it."""
    read_opts = dict(use_threads=False, block_size=block_size)
    if not layout.header:
        read_opts["column_names"] = layout.column_names
    with _not_utf8_rows(on_invalid) as not_utf8:
        try:
            with pa.input_stream(src) as stream:
                yield from pcsv.open_csv(
                    stream,
                    read_options=pcsv.ReadOptions(**read_opts),
                    parse_options=pcsv.ParseOptions(delimiter=layout.delimiter, quote_char=False,
                                                    ignore_empty_lines=False, invalid_row_handler=on_invalid),
                    convert_options=pcsv.ConvertOptions(column_types={c: pa.string() for c in layout.column_names},
                                                        strings_can_be_null=False,
                                                        quoted_strings_can_be_null=False))
        except pa.ArrowInvalid as e:
            why = f" (not UTF-8: {_bad_byte(not_utf8[0])})" if not_utf8 else ""
            raise ValueError(f"{src}: cannot parse: {e}{why}") from None
        except OSError as e:  # a corrupt or truncated compressed input
            raise ValueError(f"{src}: cannot read: {e}") from None


@contextlib.contextmanager
def _not_utf8_rows(on_invalid) -> Iterator[list[UnicodeDecodeError]]:
    """Collects the malformed rows that pyarrow could not decode to call `on_invalid` with."""
    # pyarrow decodes a row of the wrong field count before it calls the handler, in its own
    # callback: a row that is not UTF-8 fails there and stops the read, and Python prints the
    # UnicodeDecodeError as ignored, a traceback on stderr. Taken here instead, it tells the
    # read's error why the row could not be skipped.
    found, previous = [], sys.unraisablehook

    def hook(unraisable) -> None:
        if unraisable.object == on_invalid and isinstance(unraisable.exc_value, UnicodeDecodeError):
            found.append(unraisable.exc_value)
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield found
    finally:
        sys.unraisablehook = previous


_DONE_DIR = ".rankmix-done"
_LEGACY_MARKER = "_DONE_"  # converters before this one: `<out>/_DONE_<name>`, beside the parts


def _marker(out: Path, name: str) -> Path:
    return out / _DONE_DIR / f"{name}.json"


def _markers(out: Path) -> Iterator[tuple[str, Path]]:
    """(name, marker) of every marker in `out` (never a marker's temporary file)."""
    folder = out / _DONE_DIR
    if folder.is_dir():
        for marker in sorted(folder.iterdir()):
            if marker.name.endswith(".json"):
                yield marker.name[: -len(".json")], marker


def _digest(src: str, layout, rows_per_file: int, row_group_size: int) -> str:
    """What an input's output depends on: the layout the user gave (its instance fields),
    the part options, and the input's size and mtime."""
    stat = os.stat(src)
    key = {"layout": type(layout).__name__, **vars(layout), "rows_per_file": rows_per_file,
           "row_group_size": row_group_size, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _read_marker(marker: Path) -> dict | None:
    """A marker's contents: {"path"} while its input's parts are being replaced, with "digest"
    and "report" once they all are; None for one of an old converter without a path."""
    try:
        done = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{marker}: unreadable done-marker ({e}); delete it to convert its input again") from None
    return done if isinstance(done, dict) and isinstance(done.get("path"), str) else None


def _adopt_legacy_markers(out: Path) -> None:
    """An old converter's markers moved into the marker folder, so that their inputs keep their
    names and stay done. A `_DONE_*` file that is not such a marker is an input's part: data."""
    for old in out.glob(f"{_LEGACY_MARKER}*"):
        if old.is_symlink() or not old.is_file() or old.stat().st_size > 1 << 20:
            continue
        try:
            done = json.loads(old.read_bytes())
        except ValueError:
            continue
        if isinstance(done, dict) and isinstance(done.get("path"), str) and {"digest", "report"} <= done.keys():
            new = _marker(out, old.name[len(_LEGACY_MARKER):])
            if new.exists():
                old.unlink()  # superseded by a later run's marker
            else:
                os.replace(old, new)


def convert_file(src: str, name: str, out_dir: str, layout, *, strict: bool = False,
                 rows_per_file: int = 0, row_group_size: int = DEFAULT_ROW_GROUP,
                 block_size: int = DEFAULT_BLOCK) -> FileReport:
    """Convert one input file into parts called `name` (see the module docstring); returns its report."""
    out = Path(out_dir)
    if not os.path.isfile(src):
        raise ValueError(f"input not found: {src}")
    path, digest = os.path.abspath(src), _digest(src, layout, rows_per_file, row_group_size)
    marker = _marker(out, name)
    done = _read_marker(marker) if marker.exists() else None
    if done and (done["path"], done.get("digest")) == (path, digest):  # converted by an earlier run
        return FileReport(**{**done["report"], "skipped": True})
    for tmp in _parts_of(out, name, ".tmp"):
        tmp.unlink()
    report = FileReport(src=src)
    bad_rows = _BadRows(src, report, strict)
    layout, header_lines = _bind(src, layout)
    writer = _PartWriter(out, name, layout.schema, row_group_size, rows_per_file)
    parsed = 0
    with contextlib.closing(_read_csv(src, layout, block_size, bad_rows.on_invalid)) as batches:
        for batch in batches:
            bad_rows.flush_field_count()
            checked = layout.convert(batch)
            bad = bad_rows.values(checked, parsed, header_lines)
            table = pa.table(checked.columns, schema=layout.schema)
            if bad.any():
                table = table.filter(pa.array(~bad))
            parsed += batch.num_rows
            report.rows += table.num_rows
            writer.add(table)
    bad_rows.flush_field_count()  # rows skipped in the last block, after the last batch
    bad_rows.check()
    bad_rows.finish()
    # A kill between the renames leaves a mix of this run's parts and an earlier run's: the
    # marker must say "not done" before the first rename (else a rerun with the earlier
    # options skips the mix), and keep the name claimed (else a rerun among other inputs may
    # name this one otherwise, and never replace the parts left).
    marker.parent.mkdir(exist_ok=True)
    write_atomic(marker, json.dumps({"path": path}))
    report.parts = writer.finish()
    write_atomic(marker, json.dumps({"path": path, "digest": digest, "report": asdict(report)}))
    return report


# ----------------------------------------------------------------------------- many files


def _names(srcs: list[str], out: Path) -> list[str]:
    """Each input's output name: the one an earlier run's marker gives its path, else its
    stem, plus a hash of its path where that stem is confusable with another input's name."""
    paths = [os.path.abspath(s) for s in srcs]
    counts = collections.Counter(paths)
    twice = [s for s, p in zip(srcs, paths) if counts[p] > 1]
    if twice:
        raise ValueError(f"--src gives one file more than once: {twice}")
    earlier = {}
    for name, marker in _markers(out):
        done = _read_marker(marker)
        if done:
            earlier[done["path"]] = name
    claims = {**earlier, **{p: earlier.get(p, _stem(os.path.basename(p))) for p in paths}}
    taken = collections.Counter(claims.values())
    parents = collections.Counter(_part_of(n) for n in claims.values())
    names = []
    for p in paths:
        name = claims[p]
        # another input's name, or one of the two of `a` and `a-1` (read as a part of `a`)
        clash = p not in earlier and (taken[name] > 1 or _part_of(name) in taken or parents[name] > 0)
        names.append(f"{name}-h{_name_hash(p)}" if clash else name)
    return names


def convert_files(srcs: list[str], out_dir: str, layout, *, workers: int = 1, strict: bool = False,
                  rows_per_file: int = 0, row_group_size: int = DEFAULT_ROW_GROUP,
                  block_size: int = DEFAULT_BLOCK) -> dict:
    """Convert every input (one per worker process); returns the summary dict."""
    if not srcs:
        raise ValueError("no input files")
    if row_group_size <= 0 or rows_per_file < 0 or workers < 1:
        raise ValueError("--row-group-size and --workers must be positive, --rows-per-file >= 0")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done_dir = out / _DONE_DIR
    if done_dir.is_symlink() or done_dir.exists() and not done_dir.is_dir():
        raise ValueError(f"{done_dir}: a link or a file, not a folder; the converter keeps its done-markers there")
    done_dir.mkdir(exist_ok=True)
    _adopt_legacy_markers(out)
    names = _names(srcs, out)
    job = functools.partial(convert_file, out_dir=out_dir, layout=layout, strict=strict,
                            rows_per_file=rows_per_file, row_group_size=row_group_size, block_size=block_size)
    workers = min(workers, len(srcs))
    if workers == 1:
        reports = [job(s, n) for s, n in zip(srcs, names)]
    else:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            reports = pool.starmap(job, zip(srcs, names), chunksize=1)
    return {"out": str(out_dir), "rows": sum(r.rows for r in reports),
            "bad_rows": sum(r.bad_rows for r in reports),
            "skipped_files": sum(r.skipped for r in reports),
            "files": [asdict(r) for r in reports]}


def convert_csv(srcs: list[str], out_dir: str, *, label: str, categorical: list[str] = (),
                numeric: list[str] = (), drop: list[str] = (), delimiter: str = ",", **kw) -> dict:
    """Generic CSV logs with a header (Avazu's layout, for one) -> Parquet; see CsvLayout."""
    return convert_files(srcs, out_dir, CsvLayout(label, categorical, numeric, drop, delimiter), **kw)
