"""Data-path benchmarks that print ratios (not tests).

(a) ParquetReader rows/s (decode + validate + encode + shuffle + batch assembly) against
    pyarrow's bare `ParquetFile.iter_batches` decode of the same files and columns, in the
    same run, on synthetic data (`write_synthetic`). Targets: >= 0.8 unshuffled, >= 0.5 with the
    65,536-row shuffle buffer. `ratio` is by wall time (rows/s), each side with the threads it
    has: the reader its decoding and encoding threads beside the consumer, pyarrow its pool
    (OMP_NUM_THREADS of them, else one a core); `cpu_ratio` is by the CPU seconds of all threads,
    the work each side does for a row. The reader's passes run in a process whose malloc is
    tuned as in every process that reads for training (trainer/dist.py `tune_malloc`, called by
    `init_distributed`); untuned, each window's arrays above 128 KiB are mapped afresh and
    page-faulted in (`--no-malloc-tuning` measures that).
(b) The Criteo converter's MB/s in one process against plain reading of the same TSV
    (bytes read and lines counted; and pyarrow's CSV parse of every field as a string),
    on a TSV made by repeating the sample day file's rows (bench/convert.py, which also
    runs alone).
(c) --memory: the converter's peak RSS (a fresh process per size) for two input sizes,
    which should be about equal (streaming, bounded memory). The reader's own peak RSS
    over 1 GB and 5 GB of Parquet is bench/reader_memory.py.

Each figure is the best of --repeat interleaved runs (the machine may be shared).

    python bench/reader.py [--rows 1000000] [--repeat 7; 3 converting] [--shuffle-buffers 0,65536] [--reader-only]
                           [--batch-size 4096] [--row-group-size 16384] [--no-malloc-tuning]
                           [--tsv-mb 200] [--memory 200,1000] [--tmp DIR]
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
sys.path.insert(0, str(ROOT / "bench"))

from convert import SAMPLE, bench_converter, make_tsv  # noqa: E402  (bench/convert.py)


def bench_reader(tmp: Path, rows: int, batch_size: int, repeat: int = 3,
                 shuffle_buffers: tuple[int, ...] = (0, 65_536), row_group_size: int = 16_384) -> dict:
    import pyarrow.parquet as pq

    from dense.model_config import TaskSpec
    from trainer.data.datasets import synth_features
    from trainer.data.encode import RowEncoder
    from trainer.data.options import ReaderOptions
    from trainer.data.reader import ParquetReader
    from trainer.offline.synth import write_synthetic

    t0 = time.perf_counter()
    write_synthetic(tmp / "synth", rows=rows, valid_fraction=0.01, files=4, row_group_size=row_group_size)
    gen_s = time.perf_counter() - t0
    train = tmp / "synth" / "train"
    encoder = RowEncoder(synth_features(), [TaskSpec(name="click")], user_column="user_id")
    files = sorted(str(p) for p in train.glob("*.parquet"))

    def timed(rows_of) -> tuple[int, float, float]:
        """Rows, wall seconds and CPU seconds (every thread of this process) of a pass."""
        t, c = time.perf_counter(), time.process_time()
        n = rows_of()
        return n, time.perf_counter() - t, time.process_time() - c

    def raw() -> tuple[int, float, float]:
        return timed(lambda: sum(b.num_rows for f in files for b in
                                 pq.ParquetFile(f).iter_batches(batch_size=batch_size, columns=encoder.columns)))

    def reader(shuffle_buffer: int) -> tuple[int, float, float]:
        r = ParquetReader(str(train), encoder, ReaderOptions(batch_size=batch_size, shuffle=bool(shuffle_buffer),
                                                             shuffle_buffer=shuffle_buffer, num_epochs=1, seed=0))
        return timed(lambda: sum(len(b) for b in r))

    raw()  # warm the page cache
    out = {"rows": rows, "row_group_size": row_group_size, "generate_s": round(gen_s, 1), "batch_size": batch_size,
           "repeat": repeat}
    # Best of `repeat` interleaved runs: a busy neighbour then slows every contender alike.
    # CPU seconds are reported too: on a shared machine they vary far less than wall time.
    rows_in: dict[str, int] = {}  # the reader drops the last partial batch
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for _ in range(repeat):
        for name, buf in (("raw", None), *((f"shuffle{b}", b) for b in shuffle_buffers)):
            rows_in[name], w, c = raw() if buf is None else reader(buf)
            wall[name], cpu[name] = min(wall.get(name, w), w), min(cpu.get(name, c), c)
    out["raw_iter_batches_rows_per_s"] = round(rows_in["raw"] / wall["raw"])
    for buf in shuffle_buffers:
        name = f"shuffle{buf}"
        out[f"reader_{name}_rows_per_s"] = round(rows_in[name] / wall[name])
        out[f"ratio_{name}"] = round(out[f"reader_{name}_rows_per_s"] / out["raw_iter_batches_rows_per_s"], 3)
        out[f"cpu_ratio_{name}"] = round((rows_in[name] / cpu[name]) / (rows_in["raw"] / cpu["raw"]), 3)
    return out


def peak_memory(tmp: Path, sizes: list[int]) -> dict:
    out = {}
    for mb in sizes:
        src = tmp / f"mem_{mb}.tsv"
        make_tsv(src, mb)
        code = (f"import json,resource,sys; sys.path.insert(0, {str(ROOT)!r}); "
                "from trainer.offline.criteo import convert_criteo;"
                f"convert_criteo([{str(src)!r}], {str(tmp / f'mem_out_{mb}')!r}); "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
        rss_kb = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                    text=True).stdout.split()[-1])
        out[f"peak_rss_mb_{mb}mb_input"] = round(rss_kb / 1024)
        src.unlink()
    return out


def bench_conversion(tmp: Path, args: argparse.Namespace) -> None:
    """(b) and (c), printed; skipped without the sample day file."""
    if not SAMPLE.is_file():
        print(f"converter benchmark skipped: {SAMPLE} not found")
        return
    print(json.dumps(bench_converter(tmp, args.tsv_mb, args.repeat or 3)), flush=True)
    if args.memory:
        print(json.dumps(peak_memory(tmp, [int(s) for s in args.memory.split(",")])), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--row-group-size", type=int, default=16_384,
                   help="rows per row group of the generated files (the rehearsal's: 262144, read in slices)")
    p.add_argument("--repeat", type=int, default=None,
                   help="interleaved runs of each; the best counts (default: 7 of the reader's short passes, "
                        "3 of the converter's)")
    p.add_argument("--shuffle-buffers", default="0,65536",
                   help="comma-separated shuffle buffers of the reader's runs (0: unshuffled)")
    p.add_argument("--reader-only", action="store_true", help="skip the converter's benchmarks")
    p.add_argument("--tsv-mb", type=int, default=200)
    p.add_argument("--memory", default="", help="comma-separated input sizes in MB, e.g. 1000,5000")
    p.add_argument("--tmp", default=None)
    p.add_argument("--no-malloc-tuning", action="store_true",
                   help="run the reader's passes with glibc's malloc as it starts, not tuned as in training")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        tmp = Path(d)
        # The converter first: `rankmix convert` runs with malloc as it starts, and the tuning
        # below cannot be undone.
        if not args.reader_only:
            bench_conversion(tmp, args)
        if not args.no_malloc_tuning:
            from trainer.dist import tune_malloc
            print(f"reader: {tune_malloc()}, as in every process that reads for training", flush=True)
        buffers = tuple(int(b) for b in args.shuffle_buffers.split(","))
        print(json.dumps(bench_reader(tmp, args.rows, args.batch_size, args.repeat or 7, buffers,
                                      args.row_group_size)), flush=True)


if __name__ == "__main__":
    main()
