"""Peak memory of one reader pass over ~1 GB and ~5 GB of Parquet (not a test).

The reader streams windows of row groups, so its peak RSS should not depend on how much
data one pass covers: the figure printed is each pass's peak RSS (ru_maxrss of a fresh
child process per size) and their ratio, which should be about 1 (within ~10%).

The data: `write_synthetic` writes one block of rows, which is then copied file by file
to reach each size (real files on disk, read in full; generating 5 GB row by row would
take far longer than reading it). The files are deleted afterwards.

    python bench/reader_memory.py [--sizes-mb 1000,5000] [--shuffle-buffer 65536] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK_ROWS = 1_000_000

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from trainer.config import TaskSpec
from trainer.data.datasets import synth_features
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader
encoder = RowEncoder(synth_features(), [TaskSpec(name="click")], user_column="user_id")
reader = ParquetReader({path!r}, encoder, ReaderOptions(batch_size={batch}, shuffle={shuffle}, shuffle_buffer={buffer},
                                                       num_epochs=1, seed=0))
t = time.perf_counter()
rows = sum(len(b) for b in reader)
print(json.dumps({{"rows": rows, "seconds": time.perf_counter() - t,
                  "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "peak_buffered_rows": reader.peak_buffered_rows}}))
"""


def make_block(tmp: Path) -> list[Path]:
    from trainer.offline.synth import write_synthetic

    write_synthetic(tmp / "block", rows=BLOCK_ROWS, valid_fraction=0.001, files=4, row_group_size=16_384)
    return sorted((tmp / "block" / "train").glob("*.parquet"))


def fill(folder: Path, block: list[Path], mb: int) -> int:
    """Copies of the block's files in `folder` until they hold `mb` MB; returns the bytes."""
    folder.mkdir()
    size = copies = 0
    while size < mb << 20:
        for f in block:
            dest = folder / f"c{copies:04d}-{f.name}"
            shutil.copyfile(f, dest)
            size += dest.stat().st_size
        copies += 1
    return size


def one_pass(path: Path, batch: int, buffer: int) -> dict:
    code = CHILD.format(root=str(ROOT), path=str(path), batch=batch, shuffle=bool(buffer), buffer=buffer)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="1000,5000")
    p.add_argument("--batch-size", type=int, default=4096)
    p.add_argument("--shuffle-buffer", type=int, default=65_536)
    p.add_argument("--tmp", default=None)
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        tmp = Path(d)
        block = make_block(tmp)
        results = []
        for mb in sizes:
            folder = tmp / f"data_{mb}mb"
            t = time.perf_counter()
            size = fill(folder, block, mb)
            made_s = time.perf_counter() - t
            res = one_pass(folder, args.batch_size, args.shuffle_buffer)
            res.update(parquet_mb=round(size / 2**20), copy_s=round(made_s, 1),
                       peak_rss_mb=round(res["peak_rss_kb"] / 1024, 1), seconds=round(res["seconds"], 1))
            results.append(res)
            print(json.dumps(res), flush=True)
            shutil.rmtree(folder)
        first, last = results[0], results[-1]
        print(json.dumps({"peak_rss_ratio": round(last["peak_rss_kb"] / first["peak_rss_kb"], 3),
                          "sizes_mb": [r["parquet_mb"] for r in results],
                          "rows": [r["rows"] for r in results]}), flush=True)


if __name__ == "__main__":
    main()
