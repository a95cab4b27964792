"""Data-path benchmarks that print ratios (not tests).

(a) ParquetReader rows/s (decode + validate + encode + shuffle + batch assembly) against
    pyarrow's bare `ParquetFile.iter_batches` decode of the same files and columns, in the
    same run, on synthetic data (`write_synthetic`). Target ratio >= 0.5.
(b) The Criteo converter's MB/s in one process against plain reading of the same TSV
    (bytes read and lines counted; and pyarrow's CSV parse of every field as a string),
    on a TSV made by repeating the sample day file's rows.
(c) --memory: the converter's peak RSS (a fresh process per size) for two input sizes,
    which should be about equal (streaming, bounded memory).

    python bench/reader.py [--rows 1000000] [--tsv-mb 200] [--memory 200,1000] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SAMPLE = ROOT.parent / "shared" / "data" / "samples" / "criteo_day_sample.tsv"


def bench_reader(tmp: Path, rows: int, batch_size: int) -> dict:
    import pyarrow.parquet as pq

    from trainer.config import TaskSpec
    from trainer.data.datasets import synth_features
    from trainer.data.encode import RowEncoder
    from trainer.data.reader import ParquetReader
    from trainer.data.synth import write_synthetic

    t0 = time.perf_counter()
    write_synthetic(tmp / "synth", rows=rows, valid_fraction=0.01, files=4, row_group_size=16_384)
    gen_s = time.perf_counter() - t0
    train = tmp / "synth" / "train"
    encoder = RowEncoder(synth_features(), [TaskSpec(name="click")], user_column="user_id")
    files = sorted(str(p) for p in train.glob("*.parquet"))

    def raw() -> tuple[int, float]:
        t = time.perf_counter()
        n = 0
        for f in files:
            for b in pq.ParquetFile(f).iter_batches(batch_size=batch_size, columns=encoder.columns):
                n += b.num_rows
        return n, time.perf_counter() - t

    def reader(shuffle_buffer: int) -> tuple[int, float]:
        r = ParquetReader(str(train), encoder, batch_size=batch_size, shuffle=bool(shuffle_buffer),
                          shuffle_buffer=shuffle_buffer, num_epochs=1, seed=0)
        t = time.perf_counter()
        n = sum(b.labels.shape[0] for b in r)
        return n, time.perf_counter() - t

    raw()  # warm the page cache
    out = {"rows": rows, "generate_s": round(gen_s, 1), "batch_size": batch_size}
    n_raw, s_raw = raw()
    out["raw_iter_batches_rows_per_s"] = round(n_raw / s_raw)
    for buf in (0, 65_536):
        n, s = reader(buf)
        out[f"reader_shuffle{buf}_rows_per_s"] = round(n / s)
        out[f"ratio_shuffle{buf}"] = round((n / s) / (n_raw / s_raw), 3)
    return out


def make_tsv(path: Path, mb: int) -> int:
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


def bench_converter(tmp: Path, mb: int) -> dict:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    from trainer.data.criteo import CriteoLayout, convert_criteo

    src = tmp / "day_bench.tsv"
    size = make_tsv(src, mb)
    with open(src, "rb") as f:  # warm the page cache
        while f.read(8 << 20):
            pass
    t = time.perf_counter()
    lines = 0
    with open(src, "rb") as f:
        while chunk := f.read(8 << 20):
            lines += chunk.count(b"\n")
    s_read = time.perf_counter() - t

    t = time.perf_counter()
    names = CriteoLayout.column_names
    reader = pcsv.open_csv(src, read_options=pcsv.ReadOptions(use_threads=False, column_names=names, block_size=8 << 20),
                           parse_options=pcsv.ParseOptions(delimiter="\t", quote_char=False),
                           convert_options=pcsv.ConvertOptions(column_types={c: pa.string() for c in names}))
    parsed = sum(b.num_rows for b in reader)
    s_parse = time.perf_counter() - t

    t = time.perf_counter()
    summary = convert_criteo([str(src)], str(tmp / "criteo_out"), workers=1)
    s_conv = time.perf_counter() - t
    assert summary["rows"] == lines == parsed, (summary["rows"], lines, parsed)
    mbs = size / 2**20
    return {"tsv_mb": round(mbs), "rows": lines,
            "plain_read_mb_per_s": round(mbs / s_read), "arrow_csv_strings_mb_per_s": round(mbs / s_parse),
            "converter_mb_per_s": round(mbs / s_conv, 1),
            "converter_vs_plain_read": round(s_read / s_conv, 3),
            "converter_vs_arrow_csv": round(s_parse / s_conv, 3)}


def peak_memory(tmp: Path, sizes: list[int]) -> dict:
    out = {}
    for mb in sizes:
        src = tmp / f"mem_{mb}.tsv"
        make_tsv(src, mb)
        code = ("import json,resource,sys; sys.path.insert(0, %r); from trainer.data.criteo import convert_criteo;"
                "convert_criteo([%r], %r); print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
                % (str(ROOT), str(src), str(tmp / f"mem_out_{mb}")))
        rss_kb = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                    text=True).stdout.split()[-1])
        out[f"peak_rss_mb_{mb}mb_input"] = round(rss_kb / 1024)
        src.unlink()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--tsv-mb", type=int, default=200)
    p.add_argument("--memory", default="", help="comma-separated input sizes in MB, e.g. 1000,5000")
    p.add_argument("--tmp", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        tmp = Path(d)
        res = {"reader": bench_reader(tmp, args.rows, args.batch_size)}
        print(json.dumps(res["reader"]), flush=True)
        if SAMPLE.is_file():
            res["converter"] = bench_converter(tmp, args.tsv_mb)
            print(json.dumps(res["converter"]), flush=True)
            if args.memory:
                res["memory"] = peak_memory(tmp, [int(s) for s in args.memory.split(",")])
                print(json.dumps(res["memory"]), flush=True)
        else:
            print(f"converter benchmark skipped: {SAMPLE} not found")



if __name__ == "__main__":
    main()
