"""Serving speed and size: the exported artifact against eager `rankmix score`, in one run.

For each table type (fp32, fp16, int8, int4 by default) it exports the checkpoint
(`rankmix export`), loads the artifact as a server does, and times one call per batch from
an Arrow slice of real rows to probabilities: the artifact's raw inputs and forward, and
eager scoring's (`rankmix score --checkpoint`: RowEncoder, Batch, the TorchRec model). Batch
sizes 1, 64 and 1024 by default, timed in turns so that the machine's drift hits both.

    .venv/bin/python bench/serve.py --checkpoint RUN --data PARQUET [--format pt2|torchscript] \
        [--tables fp32,fp16,int8] [--batches 1,64,1024] [--seconds S]

One line per table type and batch size, plus the eager lines:

    TABLES batch B p50_ms X p99_ms Y rows/s R size_mb S tables_mb T vs eager: p50 x rows/s x
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from trainer.checkpoint import manager
from trainer.config_loader import load_config
from trainer.data.encode import RowEncoder
from trainer.data.store import resolve_files
from trainer.dist import shutdown
from trainer.run_layout import find_config, resolve_checkpoint
from trainer.score import CheckpointModel
from trainer.serving.export import TABLES, export, load
from trainer.serving.predict import raw_inputs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/serve.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a run folder or one of its step folders")
    p.add_argument("--data", required=True, help="Parquet rows to score (the first file, 1024 rows or more)")
    p.add_argument("--format", default="pt2", choices=("pt2", "torchscript"))
    p.add_argument("--tables", default="fp32,fp16,int8,int4")
    p.add_argument("--batches", default="1,64,1024")
    p.add_argument("--seconds", type=float, default=2.0, help="timing per (model, batch size), at least 5 calls")
    return p


def latencies(fns: dict[str, Callable[[], object]], seconds: float) -> dict[str, np.ndarray]:
    """Seconds per call of each of `fns`, called in turns (after two warm-up calls each)
    until each has run for `seconds` and at least 5 times."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(), fn()
    while min(sum(t) for t in times.values()) < seconds or min(len(t) for t in times.values()) < 5:
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: np.array(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    tables = [t for t in args.tables.split(",") if t]
    unknown = [t for t in tables if t not in TABLES]
    if unknown:
        raise SystemExit(f"bench/serve.py: --tables: unknown {unknown}; known: {list(TABLES)}")
    batches = [int(b) for b in args.batches.split(",")]
    cfg = load_config(str(find_config(args.checkpoint)), allow_redacted=True)
    fs, files = resolve_files(args.data)
    rows = pq.ParquetFile(files[0], filesystem=fs).read()
    if rows.num_rows < max(batches):
        raise SystemExit(f"bench/serve.py: {files[0]} has {rows.num_rows} rows, fewer than batch {max(batches)}")
    encoder = RowEncoder(cfg.features, [])
    eager = CheckpointModel(cfg, args.checkpoint)
    models, sizes, table_mb = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in tables:
            folder = Path(tmp) / kind
            manifest = export(cfg, args.checkpoint, str(folder), args.format, kind)
            models[kind] = load(folder)[0]
            sizes[kind] = (folder / manifest["file"]).stat().st_size / 2 ** 20
            table_mb[kind] = manifest["table_bytes"] / 2 ** 20
    state = manager.model_tensors(resolve_checkpoint(args.checkpoint, "--checkpoint"))
    eager_mb = sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t)) / 2 ** 20
    print(f"{cfg.model.tower} tower, {len(cfg.features)} features, format {args.format}, "
          f"{torch.get_num_threads()} threads; eager = rankmix score --checkpoint (TorchRec model)")
    with torch.no_grad():
        for b in batches:
            part = rows.slice(0, b)
            fns = {"eager": lambda p=part: eager.predict(p, encoder, "bench")}
            fns.update({k: (lambda p=part, m=m: m(*raw_inputs(p, cfg.features, "bench"))) for k, m in models.items()})
            times = latencies(fns, args.seconds)
            base = times["eager"]
            for name, t in times.items():
                line = (f"{name:6s} batch {b:5d} p50_ms {np.median(t) * 1e3:8.3f} p99_ms "
                        f"{np.percentile(t, 99) * 1e3:8.3f} rows/s {b / np.median(t):11,.0f}")
                if name == "eager":
                    line += f" size_mb {eager_mb:7.2f} (the checkpoint's model weights)"
                else:
                    line += (f" size_mb {sizes[name]:7.2f} tables_mb {table_mb[name]:7.2f}"
                             f" vs eager: p50 {np.median(t) / np.median(base):.2f}x"
                             f" rows/s {np.median(base) / np.median(t):.2f}x")
                print(line, flush=True)
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
