"""Criteo 1TB click logs (`day_0` ... `day_23`, optionally .gz) -> Parquet.

Each line: label, 13 integer features (may be empty or negative), 26 categorical features
(8-hex-digit hashes, may be empty), tab-separated, no header. Output columns: `label`
int64, `I1..I13` float64 (null when empty), `C1..C26` int64 (the hash as an unsigned
32-bit value; null when empty). A row whose label is not 0/1, whose integer feature is
not a number, whose categorical is not hex, or with a field count other than 40 is
malformed: left out, counted and reported (trainer/offline/csvlog.py has the streaming,
parallel and resumable machinery).
"""

from __future__ import annotations

import pyarrow as pa

from trainer.offline.csvlog import (
    DEFAULT_BLOCK,
    DEFAULT_ROW_GROUP,
    Checked,
    convert_files,
    hex_column,
    label_column,
    number_column,
)

__all__ = ["INT_COLUMNS", "CAT_COLUMNS", "SCHEMA", "CriteoLayout", "convert_criteo"]

INT_COLUMNS = [f"I{i}" for i in range(1, 14)]
CAT_COLUMNS = [f"C{i}" for i in range(1, 27)]
SCHEMA = pa.schema([("label", pa.int64())] + [(c, pa.float64()) for c in INT_COLUMNS]
                   + [(c, pa.int64()) for c in CAT_COLUMNS])


class CriteoLayout:
    """The Criteo 1TB day file layout, for `csvlog.convert_file`."""

    header = False
    delimiter = "\t"
    column_names = ["label", *INT_COLUMNS, *CAT_COLUMNS]
    schema = SCHEMA

    def convert(self, batch: pa.RecordBatch) -> Checked:
        cols, checks = {}, []
        raw = batch.column("label")
        ok, cols["label"] = label_column(raw)
        checks.append(("label", ok, raw))
        for c in INT_COLUMNS:
            raw = batch.column(c)
            ok, cols[c] = number_column(raw)
            checks.append((c, ok, raw))
        for c in CAT_COLUMNS:
            raw = batch.column(c)
            ok, cols[c] = hex_column(raw)
            checks.append((c, ok, raw))
        return Checked(cols, checks)


def convert_criteo(srcs: list[str], out_dir: str, *, workers: int = 1, strict: bool = False,
                   rows_per_file: int = 0, row_group_size: int = DEFAULT_ROW_GROUP,
                   block_size: int = DEFAULT_BLOCK) -> dict:
    """Convert day files into `out_dir` (parts `<day>-NNNNN.parquet`); returns the summary."""
    return convert_files(srcs, out_dir, CriteoLayout(), workers=workers, strict=strict,
                         rows_per_file=rows_per_file, row_group_size=row_group_size, block_size=block_size)
