"""Criteo converter throughput against plain reading of the same TSV (not a test).

`rankmix data criteo` with one worker process (MB/s of input) against, in the same run and
on the same file: (1) plain reading, the bytes read in 8 MB chunks and their lines
counted; (2) pyarrow's streaming CSV parse of every field as a string, which is where
the converter starts. The TSV is made by repeating the rows of the sample day file
(/work/shared/data/samples/criteo_day_sample.tsv); without it the benchmark is skipped.

    python bench/convert.py [--tsv-mb 300] [--repeat 3] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SAMPLE = ROOT.parent / "shared" / "data" / "samples" / "criteo_day_sample.tsv"


def make_tsv(path: Path, mb: int) -> int:
    """`path` holding the sample's rows repeated to about `mb` MB; returns its size."""
    block = SAMPLE.read_bytes()
    if not block.endswith(b"\n"):
        block += b"\n"
    reps = max(1, (mb << 20) // len(block))
    with open(path, "wb") as f:
        chunk = block * 64
        for _ in range(reps // 64):
            f.write(chunk)
        f.write(block * (reps % 64))
    return path.stat().st_size


def plain_read(src: Path) -> tuple[int, float]:
    t = time.perf_counter()
    lines = 0
    with open(src, "rb") as f:
        while chunk := f.read(8 << 20):
            lines += chunk.count(b"\n")
    return lines, time.perf_counter() - t


def arrow_strings(src: Path) -> tuple[int, float]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    from trainer.offline.criteo import CriteoLayout

    t = time.perf_counter()
    names = CriteoLayout.column_names
    reader = pcsv.open_csv(src, read_options=pcsv.ReadOptions(use_threads=False, column_names=names,
                                                              block_size=8 << 20),
                           parse_options=pcsv.ParseOptions(delimiter="\t", quote_char=False),
                           convert_options=pcsv.ConvertOptions(column_types={c: pa.string() for c in names}))
    rows = sum(b.num_rows for b in reader)
    return rows, time.perf_counter() - t


def convert(src: Path, out: Path) -> tuple[int, float]:
    from trainer.offline.criteo import convert_criteo

    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    summary = convert_criteo([str(src)], str(out), workers=1)
    return summary["rows"], time.perf_counter() - t


def bench_converter(tmp: Path, mb: int, repeat: int = 1) -> dict:
    """Best of `repeat` interleaved runs of each, so that a noisy neighbour hurts all alike."""
    src = tmp / "day_bench.tsv"
    size = make_tsv(src, mb)
    plain_read(src)  # warm the page cache
    best: dict[str, float] = {}
    counts = set()
    for _ in range(repeat):
        for name, fn in (("plain", lambda: plain_read(src)), ("arrow", lambda: arrow_strings(src)),
                         ("convert", lambda: convert(src, tmp / "criteo_out"))):
            rows, s = fn()
            counts.add(rows)
            best[name] = min(best.get(name, s), s)
    assert len(counts) == 1, f"row counts differ: {counts}"
    src.unlink()
    mbs = size / 2**20
    return {"tsv_mb": round(mbs), "rows": counts.pop(),
            "plain_read_mb_per_s": round(mbs / best["plain"]),
            "arrow_csv_strings_mb_per_s": round(mbs / best["arrow"]),
            "converter_mb_per_s": round(mbs / best["convert"], 1),
            "converter_vs_plain_read": round(best["plain"] / best["convert"], 3),
            "converter_vs_arrow_csv": round(best["arrow"] / best["convert"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tsv-mb", type=int, default=300)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tmp", default=None)
    args = p.parse_args()
    if not SAMPLE.is_file():
        print(f"converter benchmark skipped: {SAMPLE} not found")
        return
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        print(json.dumps(bench_converter(Path(d), args.tsv_mb, args.repeat)), flush=True)


if __name__ == "__main__":
    main()
