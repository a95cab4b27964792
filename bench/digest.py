"""The training files' digest (trainer/data/identity.py) against an epoch's raw read (not a test).

Writes the scale rehearsal's log (bench/scale.py `make_data`: its schema, files and row groups;
`--rows` and `--files` scale it down), or takes one it kept (`--data`), then times, alternating
in one process, for `--rounds` rounds:

- raw read: pyarrow's `iter_batches` over every training file, every column, batch 2048,
  pyarrow's pool on both cores (bench/scale.py's "raw pyarrow" pass);
- digest: `shared_digests` over the same files, as a training reader computes them at start
  (sha256 of every byte, DIGEST_BLOCK reads, DIGEST_THREADS files at once, one rank).

and prints each round's seconds and ratio (digest / raw read), then the median ratio. Both
passes read through the page cache: a log that fits in free memory is read from memory by both,
a larger one partly from disk by both. On a shared machine compare the ratios, not the seconds.

    python bench/digest.py [--rows N] [--files N] [--rounds N] [--data DIR] [--tmp DIR] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from scale import GB, PRESETS, make_data  # noqa: E402

from trainer.data.identity import file_digest, shared_digests  # noqa: E402


def raw_read(files: list[str]) -> int:
    """Rows of one raw pass over `files`, as bench/scale.py's "raw pyarrow" pass reads them."""
    return sum(b.num_rows for f in files for b in pq.ParquetFile(f).iter_batches(batch_size=2048))


def digests(files: list[str]) -> list[str]:
    """Every file's digest, as one training reader computes them (world size 1)."""
    fs = pafs.LocalFileSystem()
    infos = fs.get_file_info(files)
    return shared_digests(infos, lambda info: file_digest(fs, info), "bench", 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=PRESETS["full"]["rows"], help="default: the rehearsal's")
    p.add_argument("--files", type=int, default=PRESETS["full"]["files"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", help="a log bench/scale.py kept (its train/ and eval/): not written again")
    p.add_argument("--tmp", help="folder for the log (default: a new temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the log")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rankmix-digest-", dir=args.tmp))
    try:
        data = Path(args.data) if args.data else tmp / "data"
        if not args.data:
            made = make_data(data, args.rows, args.files)
            print(f"log: {made['rows']:,} rows, {made['bytes'] / GB:.2f} GB in {made['files']} files, "
                  f"written in {made['seconds']:.0f} s", flush=True)
        files = sorted(str(f) for f in (data / "train").glob("*.parquet"))
        size = sum(Path(f).stat().st_size for f in files)
        print(f"training files: {len(files)}, {size / GB:.2f} GB", flush=True)
        print("| round | raw read s | digest s | digest GB/s | ratio |\n|---|---:|---:|---:|---:|", flush=True)
        ratios = []
        for r in range(args.rounds):
            t = time.perf_counter()
            raw_read(files)
            raw = time.perf_counter() - t
            t = time.perf_counter()
            digests(files)
            digest = time.perf_counter() - t
            ratios.append(digest / raw)
            print(f"| {r} | {raw:.2f} | {digest:.2f} | {size / GB / digest:.2f} | {ratios[-1]:.3f} |", flush=True)
        print(f"median ratio (digest / one epoch's raw read): {statistics.median(ratios):.3f} "
              f"(range {min(ratios):.3f}-{max(ratios):.3f})")
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
