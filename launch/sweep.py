"""`rankmix sweep`: scaling curves. Trains a grid of model sizes for one or more towers on
the same data, fits dAUC = a * x^b (the UniMixer paper's form, section 5.2) per tower for
x = dense parameters and x = forward FLOPs per sample, and writes a table and a plot.

    rankmix sweep --config configs/movielens.toml --out runs/sweep \\
        --tower rankmixer --tower dcnv2 --grid model.hidden_dim=32,64,128 --grid model.num_layers=1,2 \\
        --tower-grid 'dcnv2:model.mlp.hidden=[[64],[256,128],[1024,512]]' [--seeds N] \\
        [--set section.key=value ...] [--baseline-tower logreg | --baseline-auc X]

Every point is a real `rankmix train` run in OUT/<tower>/<point>; its result is that run's
summary.json, and a point whose summary exists is not trained again, so an interrupted
sweep continues where it stopped. dAUC is AUC minus a baseline: a `logreg` tower trained
by the sweep on the same data (OUT/baseline/<tower>), or a number. Outputs: OUT/sweep.csv,
OUT/fit.json, OUT/sweep.png, and where the runs validate (data.valid_fraction or
data.valid_path), their validation curves in OUT/curves.json and OUT/curves.png. With
early stopping a run's AUC is the test split's at its best validation (trainer/checkpoint/selection.py).
A sweep sets each point's size itself: where the config's recipe is `auto`, which would narrow a
point's token width for few training rows (trainer/auto_width.py), its runs take `rankmix`'s.

Credentials in URIs (`--set data.train_path=s3://KEY:SECRET@...`) never reach a run's
command line, which any user of the host can read (`ps`): a run gets its URIs without the
user-info, and the key and secret in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, which only
its owner can read (trainer/credentials.py `to_environment`). Everything the sweep writes or
prints (folder names, labels, train.log's command line, sweep_point.json, the table) shows
them redacted.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainer.config_loader import load_config
from trainer.credentials import redact_config, redact_uri, to_environment
from trainer.files import write_atomic
from trainer.run_layout import RunFolder

REPO = Path(__file__).resolve().parents[1]
AXES = ("params", "flops")
MIN_FIT_POINTS = 3  # fit.json keys: x = dense parameters, x = forward FLOPs per sample
MIN_FIT_SPAN = 2.0  # the largest x over the smallest a fit needs


@dataclass
class Point:
    """One training run of the sweep."""

    tower: str
    settings: dict[str, str]
    """Grid key -> value text, in grid order (the point's own overrides)."""
    seed: int | None
    """train.seed when the sweep has several seeds, else the config's."""
    run_dir: Path
    overrides: list[str] = field(default_factory=list)
    """Every override `rankmix train` gets, run_dir included."""

    @property
    def label(self) -> str:
        """The point's settings for tables and messages (URI credentials redacted)."""
        return redact_uri(" ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in self.settings.items())) or "-"


# ------------------------------------------------------------------------------ grids


def parse_values(text: str) -> list[str]:
    """`32,64,128` -> ['32', '64', '128']; a TOML array of values (needed for list-valued
    keys) -> each element as TOML text: `[[64],[256,128]]` -> ['[64]', '[256, 128]']."""
    text = text.strip()
    if text.startswith("["):
        try:
            values = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"grid values {text!r} are not a TOML array: {e}") from None
        return [toml_text(v) for v in values]
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values:
        raise ValueError(f"grid values {text!r}: none given")
    return values


def toml_text(value) -> str:
    """A value as the text an override takes (strings bare: the config parses them by type)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(json.dumps(v) if isinstance(v, str) else toml_text(v) for v in value) + "]"
    return str(value)


def parse_grid(items: list[str], where: str) -> dict[str, list[str]]:
    """`section.key=v1,v2` items -> {'section.key': [v1, v2]} in order."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key:
            raise ValueError(f"{where} {item!r} must look like section.key=v1,v2,...")
        if key in grid:
            raise ValueError(f"{where}: {key} is given twice")
        grid[key] = parse_values(values)
    return grid


def split_tower(item: str, option: str) -> tuple[str, str]:
    """`tower:rest` -> (tower, rest)."""
    tower, sep, rest = item.partition(":")
    if not sep or not tower or not rest:
        raise ValueError(f"{option} {item!r} must look like TOWER:section.key=...")
    return tower.strip(), rest


def tower_grids(towers: list[str], grid: list[str], tower_grid: list[str]) -> dict[str, dict[str, list[str]]]:
    """Each tower's grid: its own --tower-grid entries when it has any (they replace the
    shared --grid, whose keys may mean nothing to it), else the shared --grid."""
    shared = parse_grid(grid, "--grid")
    own: dict[str, list[str]] = {}
    for item in tower_grid:
        tower, rest = split_tower(item, "--tower-grid")
        if tower not in towers:
            raise ValueError(f"--tower-grid {item!r}: tower {tower!r} is not among the --tower options {towers}")
        own.setdefault(tower, []).append(rest)
    return {t: parse_grid(own[t], f"--tower-grid {t}") if t in own else shared for t in towers}


def expand(grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every combination of the grid's values, the first key varying slowest."""
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def point_name(settings: dict[str, str]) -> str:
    """A folder name for a point: `hidden_dim-64_num_layers-2`, `mlp_hidden-256x128` (for
    model.mlp.hidden); 'base' for no settings."""
    parts = [f"{k.split('.', 1)[-1].replace('.', '_')}-{_slug(redact_uri(v))}" for k, v in settings.items()]
    return "_".join(parts) or "base"


def _slug(value: str) -> str:
    value = re.sub(r"\s*,\s*", "x", value.replace("[", "").replace("]", ""))
    return re.sub(r"[^A-Za-z0-9.x-]+", "_", value)


def build_points(args: argparse.Namespace) -> tuple[list[Point], Point | None]:
    """The sweep's points and the baseline's run (None when --baseline-auc is given)."""
    out = Path(args.out)
    common = [f"--{s.removeprefix('--')}" for s in args.set]
    per_tower: dict[str, list[str]] = {}
    for item in args.tower_set:
        tower, rest = split_tower(item, "--tower-set")
        per_tower.setdefault(tower, []).append(f"--{rest.removeprefix('--')}")
    seeds = list(range(args.seeds)) if args.seeds > 1 else [None]

    def point(tower: str, settings: dict[str, str], seed: int | None, folder: Path) -> Point:
        run_dir = folder if seed is None else folder / f"seed-{seed}"
        grid = [f"--{k}={v}" for k, v in settings.items()]
        seeded = [] if seed is None else [f"--train.seed={seed}"]
        return Point(tower, settings, seed, run_dir, [*common, *per_tower.get(tower, []), f"--model.tower={tower}",
                                                     *grid, *seeded, f"--train.run_dir={run_dir}"])

    points = []
    for tower, grid in tower_grids(args.tower, args.grid, args.tower_grid).items():
        for settings in expand(grid):
            for seed in seeds:
                points.append(point(tower, settings, seed, out / tower / point_name(settings)))
    baseline = None
    if args.baseline_auc is None:
        baseline = point(args.baseline_tower, {}, None, out / "baseline" / args.baseline_tower)
    return points, baseline


# ------------------------------------------------------------------------- validation


def check_points(config: str | None, points: list[Point]) -> list[tuple[int, int] | None]:
    """Resolve every point's config and build its dense tower before anything trains: an
    unknown key, a wrong type or an impossible shape is a ValueError naming the point.
    Returns each point's (dense parameters, FLOPs per sample) where the schema is known."""
    costs = []
    for p in points:
        try:
            to_environment(p.overrides)
            costs.append(cost_of_config(load_config(config, p.overrides)))
        except ValueError as e:
            raise ValueError(f"sweep point {p.tower} [{p.label}]: {e}") from None
    return costs


def fixed_width(config: str | None, sets: list[str]) -> list[str]:
    """`model.recipe=rankmix` where the config's recipe is `auto`: a point's width is the one it
    names, not one narrowed for the data (its cost is computed from the config)."""
    try:
        recipe = load_config(config, [f"--{s.removeprefix('--')}" for s in sets]).model.recipe
    except ValueError as e:
        raise ValueError(f"sweep: {e}") from None
    return ["model.recipe=rankmix"] if recipe == "auto" else []


def cost_of_config(cfg) -> tuple[int, int] | None:
    """(dense parameters, forward FLOPs per sample) of the tower and heads the config builds.
    Needs the feature schema: the config's own, or a built-in dataset's (synth); returns
    None when neither is known without preparing the data (the tower's name is still checked)."""
    # on use: torch, which `rankmix sweep --help` and the grid's errors do without (0.3 s, not 4)
    from torch import nn

    # on use, as torch above
    from dense.heads import build_dense
    from dense.tower_registry import TOWERS
    from trainer.data.datasets import SYNTH_TEACHERS

    features = cfg.features
    if not features and cfg.data.dataset == "synth":
        features = SYNTH_TEACHERS[cfg.data.synth_teacher].features()
    if not features:
        TOWERS.get(cfg.model.tower)
        return None
    layout, tower, heads = build_dense(cfg.model, features)
    if hasattr(tower, "cost") and hasattr(heads, "cost"):
        (tp, tf), (hp, hf) = tower.cost(), heads.cost()
        return tp + hp, tf + hf
    return counted_cost(nn.Sequential(tower, heads), layout.width)


def counted_cost(model, width: int) -> tuple[int, int]:
    """(parameters, forward FLOPs per sample) counted on the module itself, for a tower
    registered without an analytic cost()."""
    # on use: torch, as in cost_of_config
    import torch

    # on use, as torch above
    from dense.cost import flops_per_sample

    return sum(p.numel() for p in model.parameters()), flops_per_sample(model, width, torch.device("cpu"))


def print_points(points: list[Point], costs: list[tuple[int, int] | None]) -> None:
    """--dry-run: one line per run, its dense parameters and FLOPs where known."""
    for p, cost in zip(points, costs):
        size = "" if cost is None else f"{cost[0]:>12,}{cost[1]:>14,}"
        print(f"{p.tower:<17}{p.label:<34}{size}  {p.run_dir}")


# ---------------------------------------------------------------------------- running


def run_point(config: str | None, point: Point, python: str) -> None:
    """`rankmix train` for one point, its output logged to <run_dir>/train.log (the command
    line there as the point has it, URI credentials redacted; the run gets them in its
    environment)."""
    point.run_dir.mkdir(parents=True, exist_ok=True)
    overrides, credentials = to_environment(point.overrides)
    command = [python, "-m", "launch.cli", "train", *(["--config", config] if config else [])]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    if credentials:  # a session token of other credentials would spoil the key pair
        env.pop("AWS_SESSION_TOKEN", None)
    env.update(credentials)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    log = point.run_dir / "train.log"
    with log.open("w") as f:
        f.write(redact_uri(" ".join(command + point.overrides)) + "\n")
        f.flush()
        proc = subprocess.run(command + overrides, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0 or not RunFolder(point.run_dir).summary.exists():
        tail = redact_uri("".join(log.read_text().splitlines(keepends=True)[-15:]))
        raise RuntimeError(f"{point.tower} [{point.label}] failed (exit {proc.returncode}), see {log}:\n{tail}")


def result_of(point: Point) -> dict:
    """The run's summary plus its dense parameters and FLOPs (from summary.json when the
    trainer wrote them, else computed from the run's resolved config.toml, whose redacted
    data paths are never opened)."""
    summary = json.loads(RunFolder(point.run_dir).summary.read_text())
    if "dense_params" not in summary or "flops_per_sample" not in summary:
        cost = cost_of_config(load_config(str(RunFolder(point.run_dir).config), [], allow_redacted=True))
        summary["dense_params"], summary["flops_per_sample"] = cost
    return summary


def run_all(config: str | None, points: list[Point], python: str) -> tuple[int, list[str]]:
    """Train the points that have no summary yet; (runs launched, failures)."""
    launched, failures = 0, []
    todo = [p for p in points if not reusable(config, p)]
    print(f"sweep: {len(points)} runs, {len(points) - len(todo)} already done, {len(todo)} to train", flush=True)
    for i, p in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {p.tower} {p.label}" + ("" if p.seed is None else f" seed {p.seed}")
              + f" -> {p.run_dir}", flush=True)
        launched += 1
        try:
            (p.run_dir / POINT_FILE).unlink(missing_ok=True)
            run_point(config, p, python)
            write_atomic(p.run_dir / POINT_FILE, json.dumps(fingerprint(config, p), indent=1))
        except RuntimeError as e:
            print(f"sweep: {e}", file=sys.stderr, flush=True)
            failures.append(str(p.run_dir))
    return launched, failures


POINT_FILE = "sweep_point.json"


def fingerprint(config: str | None, point: Point) -> dict:
    """What a finished run was trained from, to tell a reusable result from a stale one
    (credentials redacted: they change how the data is reached, not the result)."""
    return redact_config({"config": config, "overrides": point.overrides})


def reusable(config: str | None, point: Point) -> bool:
    """The run has a summary, trained from this same config and overrides; a summary from
    other settings (the sweep re-run with another --set into the same --out) is an error
    rather than a silently mixed table."""
    if not RunFolder(point.run_dir).summary.exists():
        return False
    record = point.run_dir / POINT_FILE
    if record.exists() and redact_config(json.loads(record.read_text())) != fingerprint(config, point):
        raise ValueError(f"{point.run_dir} holds a run trained with other settings ({record}); "
                         "sweep into another --out, or delete that folder to retrain it")
    return True


# ------------------------------------------------------------------------ fit and rows


def fit_power_law(x: list[float], y: list[float]) -> dict[str, float]:
    """Least squares of log y = log a + b log x: {'a', 'b', 'r2', 'n'} (r2 in log space)."""
    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    if len(np.unique(lx)) < MIN_FIT_POINTS:  # through two points any line fits, r^2 = 1
        raise ValueError(f"a power law needs at least {MIN_FIT_POINTS} distinct x values, got {list(x)}")
    if lx.max() - lx.min() < np.log(MIN_FIT_SPAN):  # a slope over sizes this close is noise, and overflows
        raise ValueError(f"a power law needs sizes spanning at least {MIN_FIT_SPAN}x, got {min(x)} to {max(x)}")
    b, log_a = np.polyfit(lx, ly, 1)
    residual = ly - (log_a + b * lx)
    total = float(((ly - ly.mean()) ** 2).sum())
    r2 = 1.0 - float((residual ** 2).sum()) / total if total > 0 else 1.0
    return {"a": float(math.exp(log_a)), "b": float(b), "r2": r2, "n": int(len(lx))}


def rows_of(points: list[Point], baseline_auc: float) -> list[dict]:
    """One row per (tower, grid point): seeds averaged."""
    groups: dict[tuple[str, str], list[tuple[Point, dict]]] = {}
    for p in points:
        groups.setdefault((p.tower, p.label), []).append((p, result_of(p)))
    rows = []
    for (tower, label), runs in groups.items():
        aucs = [r["auc"] for _, r in runs]
        uaucs = [r.get("uauc", float("nan")) for _, r in runs]
        # Epochs to the point whose weights were tested: the best validation's, or the end.
        epochs = [r.get("best/epochs", r.get("epochs", float("nan"))) for _, r in runs]
        auc, uauc = float(np.mean(aucs)), float(np.mean(uaucs))
        # Spread over seeds: the sample standard deviation (0 for one seed).
        auc_std, uauc_std = (float(np.std(v, ddof=1)) if len(v) > 1 else 0.0 for v in (aucs, uaucs))
        first = runs[0][1]
        rows.append({"tower": tower, "point": label, "params": int(first["dense_params"]),
                     "flops": int(first["flops_per_sample"]), "auc": auc, "uauc": uauc,
                     "auc_std": auc_std, "uauc_std": uauc_std, "dauc": auc - baseline_auc, "seeds": len(runs),
                     "epochs": float(np.mean(epochs)),
                     "logloss": float(np.mean([r.get("logloss", float("nan")) for _, r in runs])),
                     "overrides": redact_uri(" ".join(f"--{k}={v}" for k, v in runs[0][0].settings.items()))})
    return rows


def fits_of(rows: list[dict]) -> dict[str, dict[str, dict[str, float] | None]]:
    """Per tower and axis, the power-law fit over the points with dAUC > 0."""
    fits: dict[str, dict] = {}
    for tower in dict.fromkeys(r["tower"] for r in rows):
        mine = [r for r in rows if r["tower"] == tower]
        kept = [r for r in mine if r["dauc"] > 0]
        if len(kept) < len(mine):
            print(f"sweep: warning: {tower}: {len(mine) - len(kept)} point(s) with dAUC <= 0 left out of the fit: "
                  + ", ".join(r["point"] for r in mine if r["dauc"] <= 0), file=sys.stderr)
        fits[tower] = {}
        for axis in AXES:
            try:
                fits[tower][axis] = fit_power_law([r[axis] for r in kept], [r["dauc"] for r in kept])
            except ValueError as e:
                print(f"sweep: warning: {tower} {axis}: no fit: {e}", file=sys.stderr)
                fits[tower][axis] = None
    return fits


# --------------------------------------------------------------------------- outputs


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, ["tower", "point", "overrides", "params", "flops", "auc", "auc_std", "uauc",
                                    "uauc_std", "logloss", "dauc", "epochs", "seeds"])
        writer.writeheader()
        writer.writerows(rows)


def format_table(rows: list[dict], fits: dict, baseline_auc: float, baseline_name: str) -> str:
    lines = [f"baseline AUC {baseline_auc:.4f} ({baseline_name})",
             f"{'tower':<17}{'point':<34}{'params':>11}{'FLOPs':>12}{'AUC':>17}{'UAUC':>17}{'dAUC':>9}{'epochs':>8}"
             "  (mean ± sample std over seeds)"]
    for r in rows:
        lines.append(f"{r['tower']:<17}{r['point']:<34}{r['params']:>11,}{r['flops']:>12,}"
                     f"{r['auc']:>8.4f} ± {r['auc_std']:.4f}{r['uauc']:>8.4f} ± {r['uauc_std']:.4f}{r['dauc']:>9.4f}"
                     f"{r['epochs']:>8.2f}")
    lines.append(f"\n{'tower':<17}{'x':<8}{'a':>11}{'b':>9}{'r^2':>7}{'n':>4}   dAUC = a * x^b")
    for tower, by_axis in fits.items():
        for axis, fit in by_axis.items():
            lines.append(f"{tower:<17}{axis:<8}" + ("   (no fit)" if fit is None else
                         f"{fit['a']:>11.4g}{fit['b']:>9.4f}{fit['r2']:>7.3f}{fit['n']:>4}"))
    return "\n".join(lines)


def validation_curves(points: list[Point]) -> dict[str, list[tuple[float, float]]]:
    """Per (tower, point): validation AUC by epochs trained, averaged over the seeds that
    reached each validation (from the runs' metrics.jsonl); runs without validation add nothing."""
    curves: dict[str, dict[float, list[float]]] = {}
    for p in points:
        log = RunFolder(p.run_dir).metrics
        records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        for r in records:
            if r.get("kind") == "valid":
                curves.setdefault(f"{p.tower} {p.label}", {}).setdefault(r["epochs"], []).append(r["auc"])
    return {name: sorted((e, float(np.mean(v))) for e, v in by_epoch.items()) for name, by_epoch in curves.items()}


def plot_curves(curves: dict[str, list[tuple[float, float]]], path: Path) -> None:
    """Validation AUC against epochs, one line per (tower, point)."""
    import matplotlib  # when plotting only: pyplot takes 0.35 s to import, and the backend is process-wide

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use(): pyplot takes its backend when imported

    fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
    for name, curve in curves.items():
        ax.plot([e for e, _ in curve], [a for _, a in curve], "o-", markersize=3, label=name)
    ax.set_xlabel("epochs")
    ax.set_ylabel("validation AUC (mean over seeds)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best", framealpha=0.6)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(rows: list[dict], fits: dict, baseline_auc: float, path: Path, title: str = "") -> None:
    """Two panels, AUC against dense parameters and against forward FLOPs per sample (log
    x), one series per tower with its fitted curve AUC = baseline + a x^b."""
    import matplotlib  # when plotting only: pyplot takes 0.35 s to import, and the backend is process-wide

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt  # after use(): pyplot takes its backend when imported

    fig, panels = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, axis, name in zip(panels, AXES, ("dense parameters", "forward FLOPs per sample")):
        for i, tower in enumerate(dict.fromkeys(r["tower"] for r in rows)):
            mine = sorted((r for r in rows if r["tower"] == tower), key=lambda r: r[axis])
            colour = colours[i % len(colours)]
            ax.plot([r[axis] for r in mine], [r["auc"] for r in mine], "o", color=colour, label=tower)
            fit = fits.get(tower, {}).get(axis)
            kept = [r[axis] for r in mine if r["dauc"] > 0]
            if fit is not None:  # over the points it was fitted to, no extrapolation
                x = np.geomspace(kept[0], kept[-1], 100)
                ax.plot(x, baseline_auc + fit["a"] * x ** fit["b"], "-", color=colour, alpha=0.7,
                        label=f"  fit b={fit['b']:.3f}, r²={fit['r2']:.2f}")
        ax.axhline(baseline_auc, color="grey", linestyle="--", linewidth=1, label="baseline")
        ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("AUC")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="best", framealpha=0.6)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ entry


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rankmix sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML config every point starts from")
    p.add_argument("--out", required=True, help="sweep folder: one run folder per point, csv, json, png")
    p.add_argument("--tower", action="append", required=True, help="a model.tower to sweep (repeatable)")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="values of one config key for every tower (repeatable; the grid is their product); "
                        "list values as a TOML array: model.mlp.hidden=[[64],[256,128]]")
    p.add_argument("--tower-grid", action="append", default=[], metavar="TOWER:KEY=V1,V2",
                   help="a grid key for one tower; a tower with any replaces --grid with its own")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override for every run, the baseline's too (repeatable)")
    p.add_argument("--tower-set", action="append", default=[], metavar="TOWER:KEY=VALUE",
                   help="override for one tower's runs (repeatable)")
    p.add_argument("--seeds", type=int, default=1, help="runs per point with train.seed 0..N-1, AUC averaged")
    base = p.add_mutually_exclusive_group()
    base.add_argument("--baseline-tower", default="logreg", help="tower trained as the dAUC baseline")
    base.add_argument("--baseline-auc", type=float, help="the baseline AUC as a number (nothing trained)")
    p.add_argument("--dry-run", action="store_true", help="check and list the runs, train nothing")
    p.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    return p


def sweep(argv: list[str]) -> int:
    """`rankmix sweep`: 0 when every point trained, 1 when some failed (the rest is still
    reported); a ValueError for a bad grid or config, before anything trains."""
    args = parser().parse_args(argv)
    if args.seeds < 1:
        raise ValueError("--seeds must be at least 1")
    args.set = [*fixed_width(args.config, args.set), *args.set]
    points, baseline = build_points(args)
    runs = points + ([baseline] if baseline else [])
    costs = check_points(args.config, runs)
    if args.dry_run:
        print_points(runs, costs)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launched, failures = run_all(args.config, ([baseline] if baseline else []) + points, args.python)
    print(f"sweep: launched {launched} run(s)", flush=True)
    if baseline is not None and str(baseline.run_dir) in failures:
        print("sweep: the baseline failed: no dAUC", file=sys.stderr)
        return 1
    baseline_auc = args.baseline_auc if baseline is None else result_of(baseline)["auc"]
    done = [p for p in points if str(p.run_dir) not in failures]
    rows = rows_of(done, baseline_auc)
    fits = fits_of(rows)
    write_csv(rows, out / "sweep.csv")
    baseline_name = "given" if baseline is None else f"{baseline.tower}, {baseline.run_dir}"
    write_atomic(out / "fit.json", json.dumps(
        {"baseline_auc": baseline_auc, "baseline": baseline_name, "form": "dAUC = a * x^b", "fits": fits},
        indent=1))
    if rows:
        plot(rows, fits, baseline_auc, out / "sweep.png",
             title=f"{Path(args.config).name if args.config else 'defaults'}: AUC against size, 1 point per run")
    curves = validation_curves(done)
    if curves:
        write_atomic(out / "curves.json", json.dumps(curves, indent=1))
        plot_curves(curves, out / "curves.png")
    print(format_table(rows, fits, baseline_auc, baseline_name))
    print(f"wrote {out / 'sweep.csv'}, {out / 'fit.json'}, {out / 'sweep.png'}"
          + (f", {out / 'curves.json'}, {out / 'curves.png'}" if curves else ""))
    return 1 if failures else 0


if __name__ == "__main__":  # `python -m launch.sweep` works as `rankmix sweep` does
    sys.exit(sweep(sys.argv[1:]))
