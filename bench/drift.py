"""The drift study (docs/continuous.md, "Drift study"): how well a model scores the next day of a
drifting log, trained continuously, frozen, or retrained from scratch; as one markdown table,
printed and written to --out.

On `rankmix data synth --days N --drift D` (configs/synth.toml's model, one rank), each day d >= 2
is scored by models that have not trained on it:

- continuous: trained in time order, day d evaluated before it is trained on
  (`metrics.eval_next_partition`); the run stops after day N/2 and is resumed on the rest, as
  when partitions land later;
- frozen: the continuous run's checkpoint after day N/2, scored on the later days by
  `rankmix score` (up to day N/2 + 1 it is the continuous model);
- from scratch: a new run each day, one shuffled epoch over days 1..d-1, evaluated on day d (in
  time order it would be the continuous model itself: the same rows in the same order);
- modulo, managed: continuous runs with the user and item tables cut to --table-rows rows,
  `hashing = "modulo"` against `hashing = "managed"` (TorchRec MCH, LFU eviction every
  --eviction-interval steps).

Each cell is the click AUC, then the seconds of training that model cost that day: the trainer's
own step timer (the updates alone: no start-up, evaluation or checkpoint), one day's steps for
a continuous run, days 1..d-1 for from scratch, none once frozen. The last row is the mean AUC
over days N/2 + 1..N and the total seconds. A run reads only its days: each day folder holds one
marker file per continuous run that may read it (`data.success_marker`).

    .venv/bin/python bench/drift.py [--small] [--days N] [--rows N] [--drift D] [--table-rows N] \
        [--eviction-interval N] [--threads N] [--out FILE.md] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import torch

from trainer.metrics.ranking import auc
from trainer.run_layout import RunFolder

REPO = Path(__file__).resolve().parents[1]
PRESETS = {"full": dict(days=8, rows=30_000, drift=0.3, table_rows=1000),
           "small": dict(days=4, rows=4_000, drift=0.3, table_rows=500)}
TABLE_FEATURES = ("user_id", "item_id", "hist_items")  # the user table and the item table's two features
MODELS = ("continuous", "frozen", "from scratch", "modulo", "managed")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/drift.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="4 days of 4,000 rows: about a minute on a quiet machine")
    p.add_argument("--days", type=int, help="days of the log (default 8; even)")
    p.add_argument("--rows", type=int, help="rows a day (default 30,000)")
    p.add_argument("--drift", type=float, help="rankmix data synth --drift (default 0.3)")
    p.add_argument("--table-rows", type=int, help="rows of the user and item tables of modulo and managed")
    p.add_argument("--eviction-interval", type=int, default=20, help="managed: steps between evictions")
    p.add_argument("--out", default="runs/drift.md", help="where the table is written")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each command: on a shared machine "
                   "more than one make the step times swing tenfold")
    p.add_argument("--keep", help="keep the log and the runs in this folder (default: a temporary one, deleted)")
    return p


def rankmix(*args: str) -> str:
    """Run `rankmix ARGS`; its stdout."""
    proc = subprocess.run([sys.executable, "-m", "launch.cli", *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"bench/drift.py: rankmix {args[0]} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def mark(log: Path, names: list[str], marker: str) -> str:
    """`marker` into the day folders `names`: the days a run with data.success_marker=marker reads."""
    for name in names:
        (log / name / marker).write_text("")
    return marker


def train(run: Path, eval_path: Path, *extra: str) -> list[dict]:
    """`rankmix train` of configs/synth.toml's model, every step logged; its metrics.jsonl records."""
    rankmix("train", "--config", "configs/synth.toml", "--data.dataset=parquet", f"--data.eval_path={eval_path}",
            f"--train.run_dir={run}", "--train.steps=0", "--metrics.log_every=1", "--metrics.progress=false",
            "--metrics.tensorboard=false", *extra)
    return [json.loads(line) for line in RunFolder(run).metrics.read_text().splitlines()]


def in_time_order(log: Path, marker: str) -> list[str]:
    """The options of a continuous run over the days of `log` that hold `marker`."""
    return ["--data.order=time", f"--data.train_path={log}", f"--data.success_marker={marker}",
            "--metrics.eval_next_partition=true"]


def seconds(records: list[dict], batch_rows: int) -> float:
    """Seconds of training of `records`' steps, from the step timer behind each `train` record
    (every step logged: metrics.log_every=1)."""
    return sum(batch_rows / r["examples_per_sec"] for r in records if r["kind"] == "train")


def continuous(records: list[dict], batch_rows: int) -> dict[str, tuple[float, float]]:
    """Day -> (AUC before training on it, seconds of training the day before) of one continuous run."""
    ends = [0] + [r["step"] for r in records if r["kind"] == "progressive"]  # ends[e + 1]: day e's last step
    out = {}
    for r in records:
        if r["kind"] == "next_partition":
            before = range(ends[r["epoch"] - 1] + 1, ends[r["epoch"]] + 1)  # the steps of the day before
            out[r["partition"]] = (r["auc"], seconds([t for t in records if t["step"] in before], batch_rows))
    return out


def frozen_aucs(log: Path, checkpoint: Path, days: list[str], out: Path) -> dict[str, float]:
    """The click AUC of `checkpoint` on each of `days`, from the predictions `rankmix score` writes."""
    rankmix("score", "--checkpoint", str(checkpoint), "--data", ",".join(str(log / d) for d in days),
            "--out", str(out))
    aucs = {}
    for day in days:
        table = pq.read_table(out / day, columns=["click", "pred_click"])
        aucs[day] = auc(torch.from_numpy(table["pred_click"].to_numpy()), torch.from_numpy(table["click"].to_numpy()))
    return aucs


def study(args: argparse.Namespace, tmp: Path) -> dict[str, dict[str, tuple[float, float]]]:
    """Model -> day -> (next-day AUC, seconds of training that day), for days 2..N."""
    log = tmp / "log"
    days = json.loads(rankmix("data", "synth", "--out", str(log), "--days", str(args.days), "--drift",
                              str(args.drift), "--rows", str(args.rows)))["partitions"]
    half, batch_rows = args.days // 2, 512  # configs/synth.toml's data.batch_size, at one rank
    results: dict[str, dict[str, tuple[float, float]]] = {}

    run = tmp / "continuous"  # stops after day N/2, then resumed as the other days land
    first = train(run, log / days[-1], *in_time_order(log, mark(log, days[:half], "_FIRST_HALF")))
    records = train(run, log / days[-1], *in_time_order(log, "_SUCCESS"), "--checkpoint.keep=0")
    results["continuous"] = continuous(records, batch_rows)
    freeze = max(r["step"] for r in first if r["kind"] == "progressive")
    later = frozen_aucs(log, RunFolder(run).step(freeze), days[half:], tmp / "frozen")
    results["frozen"] = {d: results["continuous"][d] if d not in later else (later[d], 0.0) for d in days[1:]}

    results["from scratch"] = {}
    for d in range(1, args.days):
        records = train(tmp / f"scratch-{d}", log / days[d], "--data.train_path=" + ",".join(
            str(log / day) for day in days[:d]), "--train.epochs=1", "--checkpoint.enabled=false")
        results["from scratch"][days[d]] = (next(r for r in records if r["kind"] == "eval")["auc"],
                                            seconds(records, batch_rows))

    for mode in ("modulo", "managed"):
        tables = [f"--features.{f}.{key}={value}" for f in TABLE_FEATURES
                  for key, value in (("num_embeddings", args.table_rows), ("hashing", mode))]
        if mode == "managed":
            tables += [f"--features.{f}.eviction_interval={args.eviction_interval}" for f in TABLE_FEATURES]
        records = train(tmp / mode, log / days[-1], *in_time_order(log, "_SUCCESS"), "--checkpoint.enabled=false",
                        *tables)
        results[mode] = continuous(records, batch_rows)
    return results


def table(args: argparse.Namespace, results: dict[str, dict[str, tuple[float, float]]]) -> str:
    """The markdown table: a row a day, then the mean AUC over the days after the freeze and the total seconds."""
    days = list(results["continuous"])
    header = ["day", "continuous", f"frozen after day {args.days // 2}", "from scratch",
              f"modulo, {args.table_rows:,} rows", f"managed, {args.table_rows:,} rows"]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for day in days:
        lines.append("| " + " | ".join([day, *(f"{results[m][day][0]:.4f} / {results[m][day][1]:.1f} s"
                                               for m in MODELS)]) + " |")
    after = days[args.days // 2 - 1:]
    lines.append("| " + " | ".join([f"mean AUC days {args.days // 2 + 1}-{args.days}, total s", *(
        f"{sum(results[m][d][0] for d in after) / len(after):.4f} / {sum(v[1] for v in results[m].values()):.1f} s"
        for m in MODELS)]) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parser().parse_args()
    for key, value in PRESETS["small" if args.small else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.days < 4 or args.days % 2:
        sys.exit("bench/drift.py: --days must be even and at least 4 (frozen after day N/2, scored on the rest)")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # every command's torch threads
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="rankmix-drift-"))
    try:
        results = study(args, tmp)
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    text = f"python bench/drift.py {' '.join(sys.argv[1:])}\n\n{table(args, results)}\n"
    print(text, end="")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    if not all(math.isfinite(v) for model in results.values() for cell in model.values() for v in cell):
        sys.exit("a figure is not a finite number")


if __name__ == "__main__":
    main()
