"""`rankmix study`: the project's comparison protocol as one command. Every tower (and grid
point) trains with seeds 0..N-1 under early stopping; each run is then paired with the
same seed's run of the better baseline and of a reference tower, so that the spread
between seeds (a synthetic log is drawn anew for each) cancels out of the comparison.

    rankmix study [--config F.toml] --out DIR --tower rankmixer --tower mlp --tower dcnv2 \\
        [--tower-set TOWER:section.key=value] [--tower-grid TOWER:section.key=v1,v2] \\
        [--set section.key=value] [--seeds 3] [--baseline mlp --baseline dcnv2] [--reference rankmixer]

The protocol (PROTOCOL): 10% of the training rows validate, validation four times an epoch,
early stopping after an epoch without a better validation, at most 15 epochs, and the test split scored with the
best validation's weights. `--set` entries come after it, so they can change it:
`--set data.split=time` judges every run on a cut in time (docs/training.md, "Splits in time").

Every run is a `rankmix sweep` point (launch/sweep.py): a finished run is reused and an
interrupted study continues where it stopped. Writes OUT/study.csv, OUT/study.md (the
table) and the validation curves, OUT/curves.json and OUT/curves.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from launch import sweep as sweeps
from trainer.files import write_atomic

PROTOCOL = ("data.valid_fraction=0.1", "metrics.valid_every_epochs=0.25", "train.early_stopping_patience=4",
            "train.epochs=15", "metrics.progress=false", "metrics.tensorboard=false", "checkpoint.enabled=false")
"""The study's --set entries before the user's: the early-stopping protocol, quiet runs. Four
validations an epoch: towers peak inside their first or second epoch (issue 59), which a
validation per epoch finds late or misses; a patience of 4 is an epoch without a better one."""
RIVALS = {"metrics.valid_every": "metrics.valid_every_epochs", "metrics.valid_every_epochs": "metrics.valid_every"}
"""Keys of which a run takes one: a user's --set of one leaves the protocol's other out."""


def protocol(user_sets: list[str]) -> list[str]:
    """PROTOCOL without the entries whose rival key the user's --set entries give."""
    given = {entry.partition("=")[0].strip() for entry in user_sets}
    return [entry for entry in PROTOCOL if RIVALS.get(entry.partition("=")[0]) not in given]
METRICS = ("auc", "uauc", "logloss", "ne", "calibration", "best/epochs")
"""Summary keys the table reports, mean ± sample std over seeds: the model as trained (a
train.calibrate run's uncalibrated/* figures)."""
CALIBRATED = ("logloss", "ne", "calibration")
"""Summary keys reported again after train.calibrate's map, for the runs that fitted one."""


@dataclass
class Row:
    """One (tower, grid point) of the study, its runs by seed."""

    tower: str
    point: str
    runs: dict[int, dict]
    """Seed -> the run's summary.json (with dense_params and flops_per_sample)."""

    @property
    def calibrated(self) -> bool:
        """Whether its runs fitted a map (train.calibrate): their plain metrics are after it."""
        return all("uncalibrated/auc" in run for run in self.runs.values())

    def values(self, key: str, calibrated: bool = False) -> np.ndarray:
        """`key` by seed: a metric of the model as trained (a train.calibrate run's
        uncalibrated/* figure), or after its calibration map when `calibrated`."""
        names = (key,) if calibrated else (f"uncalibrated/{key}", key)
        return np.array([next((run[n] for n in names if n in run), np.nan)
                         for run in (self.runs[s] for s in sorted(self.runs))], dtype=float)

    def mean_std(self, key: str, calibrated: bool = False) -> tuple[float, float]:
        v = self.values(key, calibrated)
        return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0


@dataclass
class Paired:
    """AUC of a row minus another row's, seed by seed."""

    against: str
    mean: float
    std: float

    @property
    def verdict(self) -> str:
        """ahead or behind when the mean difference exceeds its spread over seeds, else level."""
        if abs(self.mean) <= self.std or self.mean == 0:
            return "level"
        return "ahead" if self.mean > 0 else "behind"


def paired(row: Row, other: Row) -> Paired:
    """row's AUC minus other's, over the seeds both ran."""
    seeds = sorted(set(row.runs) & set(other.runs))
    if not seeds:
        raise ValueError(f"{row.tower} [{row.point}] and {other.tower} [{other.point}] share no seed")
    mine, theirs = (dict(zip(sorted(r.runs), r.values("auc"))) for r in (row, other))
    diffs = np.array([mine[s] - theirs[s] for s in seeds])
    std = float(diffs.std(ddof=1)) if len(diffs) > 1 else 0.0
    return Paired(f"{other.tower} [{other.point}]", float(diffs.mean()), std)


def rows_of(points: list[sweeps.Point]) -> list[Row]:
    """The study's rows in the order of the points, each with its runs' summaries."""
    rows: dict[tuple[str, str], Row] = {}
    for p in points:
        row = rows.setdefault((p.tower, p.label), Row(p.tower, p.label, {}))
        row.runs[0 if p.seed is None else p.seed] = sweeps.result_of(p)
    return list(rows.values())


def better_baseline(rows: list[Row], baselines: list[str]) -> Row | None:
    """The baseline row of highest mean test AUC (the harder one to beat)."""
    mine = [r for r in rows if r.tower in baselines]
    return max(mine, key=lambda r: r.mean_std("auc")[0]) if mine else None


def table(rows: list[Row], baseline: Row | None, reference: Row | None) -> list[dict]:
    """One record per row: means, spreads, and its paired differences."""
    records = []
    for r in rows:
        record = {"tower": r.tower, "point": r.point, "seeds": len(r.runs),
                  "params": int(r.values("dense_params")[0]), "flops": int(r.values("flops_per_sample")[0])}
        # A sparse MoE serves with its active experts only: its measured inference cost.
        served = r.values("moe/inference_flops_per_sample")
        record["inference_flops"] = record["flops"] if np.isnan(served).all() else int(np.nanmean(served))
        for key in METRICS:
            record[key], record[f"{key}_std"] = r.mean_std(key)
        for key in CALIBRATED:
            record[f"calibrated/{key}"], record[f"calibrated/{key}_std"] = \
                r.mean_std(key, calibrated=True) if r.calibrated else (np.nan, np.nan)
        for name, other in (("baseline", baseline), ("reference", reference)):
            diff = paired(r, other) if other is not None and other is not r else None
            record[f"vs_{name}"] = "" if diff is None else diff.against
            record[f"vs_{name}_mean"] = np.nan if diff is None else diff.mean
            record[f"vs_{name}_std"] = np.nan if diff is None else diff.std
            record[f"vs_{name}_verdict"] = "" if diff is None else diff.verdict
        records.append(record)
    return records


def markdown(records: list[dict], baseline: Row | None, reference: Row | None) -> str:
    """The study table in Markdown: mean ± sample std over seeds."""
    def pm(r: dict, key: str, digits: int = 4) -> str:
        return f"{r[key]:.{digits}f} ± {r[key + '_std']:.{digits}f}"

    def diff(r: dict, name: str) -> str:
        if not r[f"vs_{name}"]:
            return "-"
        return f"{r[f'vs_{name}_mean']:+.4f} ± {r[f'vs_{name}_std']:.4f} ({r[f'vs_{name}_verdict']})"

    head = ["tower", "point", "dense params", "FLOPs/sample (training)", "FLOPs/sample (inference)", "test AUC",
            "test UAUC", "logloss", "NE", "calibration", "NE, calibrated", "calibration, calibrated", "epochs to best",
            f"AUC - better baseline ({baseline.tower} [{baseline.point}])" if baseline else "AUC - better baseline",
            f"AUC - {reference.tower} [{reference.point}]" if reference else "AUC - reference"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        cells = [r["tower"], r["point"], f"{r['params']:,}", f"{r['flops']:,}", f"{r['inference_flops']:,}",
                 pm(r, "auc"), pm(r, "uauc"), pm(r, "logloss"), pm(r, "ne"), pm(r, "calibration"),
                 *(pm(r, f"calibrated/{k}") if r[f"calibrated/{k}"] == r[f"calibrated/{k}"] else "-"
                   for k in ("ne", "calibration")), pm(r, "best/epochs", 1),
                 diff(r, "baseline"), diff(r, "reference")]
        lines.append("| " + " | ".join(cells) + " |")
    seeds = max((r["seeds"] for r in records), default=0)
    lines.append(f"\nMean ± sample standard deviation over {seeds} seed(s); a paired difference is ahead "
                 "or behind when its mean exceeds its standard deviation, else level. Logloss, NE and "
                 "calibration are the model's as trained; 'calibrated' after train.calibrate's map, where fitted.")
    return "\n".join(lines)


def write_csv(records: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rankmix study", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML config every run starts from")
    p.add_argument("--out", required=True, help="study folder: one run folder per tower, point and seed")
    p.add_argument("--tower", action="append", required=True, help="a model.tower to compare (repeatable)")
    p.add_argument("--tower-set", action="append", default=[], metavar="TOWER:KEY=VALUE",
                   help="override for one tower's runs, e.g. its size (repeatable)")
    p.add_argument("--tower-grid", action="append", default=[], metavar="TOWER:KEY=V1,V2",
                   help="variants of one tower, one row each (repeatable)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every run, after the protocol's (repeatable)")
    p.add_argument("--seeds", type=int, default=3, help="runs per row, train.seed 0..N-1 (default 3)")
    p.add_argument("--baseline", action="append", metavar="TOWER",
                   help="a tower that counts as a baseline (repeatable; default: mlp and dcnv2 where studied)")
    p.add_argument("--reference", metavar="TOWER",
                   help="the tower whose first row every row is also paired with (default: the first --tower)")
    p.add_argument("--dry-run", action="store_true", help="check and list the runs, train nothing")
    p.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    return p


def study(argv: list[str]) -> int:
    """`rankmix study`: 0 when every run trained, 1 when some failed (the rest is still
    reported); a ValueError for bad options or config, before anything trains."""
    args = parser().parse_args(argv)
    if args.seeds < 1:
        raise ValueError("--seeds must be at least 1")
    baselines = args.baseline or [t for t in ("mlp", "dcnv2") if t in args.tower]
    reference = args.reference or args.tower[0]
    for option, towers in (("--baseline", baselines), ("--reference", [reference])):
        for tower in towers:
            if tower not in args.tower:
                raise ValueError(f"{option} {tower!r} is not among the --tower options {args.tower}")
    grid = argparse.Namespace(out=args.out, set=[*protocol(args.set), *args.set], tower_set=args.tower_set,
                              seeds=args.seeds, tower=args.tower, grid=[], tower_grid=args.tower_grid,
                              baseline_auc=0.5, baseline_tower=None)
    points, _ = sweeps.build_points(grid)
    costs = sweeps.check_points(args.config, points)
    if args.dry_run:
        sweeps.print_points(points, costs)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launched, failures = sweeps.run_all(args.config, points, args.python)
    print(f"study: launched {launched} run(s)", flush=True)
    done = [p for p in points if str(p.run_dir) not in failures]
    rows = rows_of(done)
    if not rows:
        return 1
    baseline = better_baseline(rows, baselines)
    ref = next((r for r in rows if r.tower == reference), None)
    records = table(rows, baseline, ref)
    write_csv(records, out / "study.csv")
    text = markdown(records, baseline, ref)
    write_atomic(out / "study.md", text + "\n")
    curves = sweeps.validation_curves(done)
    if curves:
        write_atomic(out / "curves.json", json.dumps(curves, indent=1))
        sweeps.plot_curves(curves, out / "curves.png")
    print(text)
    print(f"wrote {out / 'study.csv'}, {out / 'study.md'}"
          + (f", {out / 'curves.json'}, {out / 'curves.png'}" if curves else ""))
    return 1 if failures else 0


if __name__ == "__main__":  # `python -m launch.study` works as `rankmix study` does
    sys.exit(study(sys.argv[1:]))
