"""Modulo against managed tables at the same table size, on the synthetic log (Zipf users
and items, configs/synth.toml) with more distinct ids than rows.

For each seed it trains the config twice, user and item tables cut to --rows rows: once with
`hashing = "modulo"` (unrelated ids share rows), once with `hashing = "managed"` (TorchRec
MCH: each admitted id its own row, the rest on a miss row until the next eviction). It
prints, per mode and averaged over seeds:

    collision: share of the test split's id lookups whose row other ids of the log share too
               (modulo; computed from the log) | miss: share of the test split's lookups on
               the miss row (managed; the run's final evaluation), and rows evicted in training
    auc        test AUC (mean and spread over seeds)
    ex/s       training examples per second, and its ratio to modulo's in the same seed

    .venv/bin/python bench/managed.py [--rows 1000] [--seeds 3] [--synth-rows 200000] [--epochs 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds

REPO = Path(__file__).resolve().parents[1]
TABLES = {"user_id": ["user_id"], "item": ["item_id", "hist_items"]}  # table -> its features


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/managed.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1000, help="rows of the user and the item table")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--synth-rows", type=int, default=200_000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--eviction-interval", type=int, default=20)
    return p


def train(run: Path, cache: Path, seed: int, mode: str, args) -> dict:
    features = [f for fs in TABLES.values() for f in fs]
    overrides = [f"--features.{f}.{key}={value}" for f in features
                 for key, value in (("num_embeddings", args.rows), ("hashing", mode))]
    if mode == "managed":
        overrides += [f"--features.{f}.eviction_interval={args.eviction_interval}" for f in features]
    command = [sys.executable, "-m", "launch.cli", "train", "--config", "configs/synth.toml",
               f"--data.synth_rows={args.synth_rows}", f"--train.epochs={args.epochs}", "--train.steps=0",
               f"--train.seed={seed}", f"--train.run_dir={run}", f"--data.cache_dir={cache}",
               "--metrics.progress=false", "--metrics.tensorboard=false", "--checkpoint.enabled=false", *overrides]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bench/managed.py: training failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def collision_share(log: Path, rows: int) -> float:
    """Share of the test split's lookups (all features of the user and item tables) whose row
    `id % rows` is also the row of another id in the log (both splits), as managed tables'
    miss rate is measured on the test split."""
    columns = [f for fs in TABLES.values() for f in fs]
    test, whole = (ds.dataset(path).to_table(columns=columns) for path in (log / "valid", log))
    shares = []
    for features in TABLES.values():
        ids = np.concatenate([_flat(test.column(f)) for f in features])
        distinct = np.unique(np.concatenate([_flat(whole.column(f)) for f in features]))
        per_row = np.bincount(distinct % rows, minlength=rows)
        shares.append((per_row[ids % rows] > 1).mean())
    return float(np.mean(shares))


def _flat(column) -> np.ndarray:
    arr = column.combine_chunks()
    if hasattr(arr, "flatten"):
        arr = arr.flatten()
    return arr.to_numpy(zero_copy_only=False).astype(np.int64)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    results = {"modulo": [], "managed": []}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "data"
        for seed in range(args.seeds):
            for mode in results:
                results[mode].append(train(Path(tmp) / f"{mode}-{seed}", cache, seed, mode, args))
        collision = [collision_share(next(cache.glob(f"synth-*-seed{seed}")), args.rows)
                     for seed in range(args.seeds)]
    print(f"synthetic log, {args.synth_rows} rows x {args.epochs} epochs, user and item tables of {args.rows} rows, "
          f"{args.seeds} seeds")
    base = [r["examples_per_sec"] for r in results["modulo"]]
    for mode, runs in results.items():
        auc = np.array([r["auc"] for r in runs])
        speed = np.array([r["examples_per_sec"] for r in runs])
        if mode == "modulo":
            lost = f"collision {np.mean(collision):.3f}"
        else:
            miss = np.mean([np.mean([r[f"managed/{t}.miss_rate"] for t in TABLES]) for r in runs])
            evicted = np.mean([sum(r[f"managed/{t}.evicted"] for t in TABLES) for r in runs])
            lost = f"miss {miss:.3f} evicted {evicted:,.0f}"
        print(f"{mode:8s} {lost:32s} auc {auc.mean():.4f} +- {auc.std():.4f} ex/s {speed.mean():,.0f} "
              f"({np.mean(speed / np.array(base)):.2f}x modulo)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
