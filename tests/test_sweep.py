"""`rankmix sweep`: grids, the power-law fit, validation before training, and a tiny real sweep."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli import rankmix
from launch import sweep as sweep_module
from launch.sweep import build_points, fit_power_law, parser, sweep
from trainer.config_loader import load_config

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")


class ForkedRuns:
    """`subprocess` for launch/sweep.py: `run_point`'s `python -m launch.cli train ...`, its
    environment and its log as the sweep gives them, run in a child forked from tests/cli.py's
    preloaded server instead of a fresh interpreter (seconds of imports a run)."""
    STDOUT = subprocess.STDOUT

    @staticmethod
    def run(command: list[str], stdout, stderr, env: dict[str, str]) -> subprocess.CompletedProcess:
        assert command[:4] == [sys.executable, "-m", "launch.cli", "train"] and stderr is subprocess.STDOUT, command
        proc = rankmix(*command[3:], cwd=os.getcwd(), env=env)
        stdout.write(proc.stdout + proc.stderr)
        return subprocess.CompletedProcess(command, proc.returncode)


@pytest.fixture
def forked_runs(monkeypatch) -> None:
    """The sweep's training runs forked (`ForkedRuns`)."""
    monkeypatch.setattr(sweep_module, "subprocess", ForkedRuns)


def test_power_law_fit_recovers_a_and_b():
    x = [1e3, 4e3, 3e4, 2e5, 1e6]
    fit = fit_power_law(x, [0.002 * v ** 0.31 for v in x])
    assert fit["a"] == pytest.approx(0.002, rel=1e-9)
    assert fit["b"] == pytest.approx(0.31, rel=1e-9)
    assert fit["r2"] == pytest.approx(1.0) and fit["n"] == 5
    noisy = fit_power_law(x, [0.002 * v ** 0.31 * f for v, f in zip(x, (1.1, 0.9, 1.05, 0.95, 1.0))])
    assert 0.25 < noisy["b"] < 0.37 and noisy["r2"] < 1.0
    with pytest.raises(ValueError, match="at least 3 distinct x"):
        fit_power_law([10, 10, 100], [0.1, 0.2, 0.3])  # two points: any line fits
    with pytest.raises(ValueError, match="sizes spanning at least 2.0x, got 536641 to 537217"):
        fit_power_law([536641, 536769, 537089, 537217], [0.01, 0.02, 0.012, 0.015])  # a grid at equal size


def test_grid_expansion_and_per_tower_grids(tmp_path):
    args = parser().parse_args([
        "--out", str(tmp_path), "--tower", "rankmixer", "--tower", "dcnv2", "--tower", "unimixer_lite",
        "--grid", "model.hidden_dim=32,64", "--grid", "model.num_layers=1,2",
        "--tower-grid", "dcnv2:model.mlp.hidden=[[64],[256,128]]", "--tower-grid", "dcnv2:model.dcnv2.cross_layers=2",
        "--set", "train.epochs=1", "--tower-set", "unimixer_lite:model.unimixer.num_basis=2"])
    points, baseline = build_points(args)
    by_tower = {t: [p for p in points if p.tower == t] for t in ("rankmixer", "dcnv2", "unimixer_lite")}
    # The shared grid is a product, first key slowest; dcnv2's own grid replaces it.
    assert [p.settings for p in by_tower["rankmixer"]] == [
        {"model.hidden_dim": h, "model.num_layers": n} for h in ("32", "64") for n in ("1", "2")]
    assert [p.settings for p in by_tower["dcnv2"]] == [
        {"model.mlp.hidden": "[64]", "model.dcnv2.cross_layers": "2"},
        {"model.mlp.hidden": "[256, 128]", "model.dcnv2.cross_layers": "2"}]
    assert by_tower["rankmixer"][1].overrides == [
        "--train.epochs=1", "--model.tower=rankmixer", "--model.hidden_dim=32", "--model.num_layers=2",
        f"--train.run_dir={tmp_path}/rankmixer/hidden_dim-32_num_layers-2"]
    assert by_tower["dcnv2"][1].run_dir == tmp_path / "dcnv2" / "mlp_hidden-256x128_dcnv2_cross_layers-2"
    assert all("--model.unimixer.num_basis=2" in p.overrides for p in by_tower["unimixer_lite"])
    assert not any("--model.unimixer.num_basis=2" in p.overrides for p in by_tower["rankmixer"] + by_tower["dcnv2"])
    # The overrides mean what they say to the config loader, list values included.
    cfg = load_config(DEBUG, by_tower["dcnv2"][1].overrides)
    assert (cfg.model.tower, cfg.model.mlp.hidden, cfg.model.dcnv2.cross_layers) == ("dcnv2", [256, 128], 2)
    # The baseline gets the shared overrides and no grid.
    assert baseline.overrides == ["--train.epochs=1", "--model.tower=logreg",
                                  f"--train.run_dir={tmp_path}/baseline/logreg"]
    seeded, _ = build_points(parser().parse_args(["--out", "o", "--tower", "mlp", "--seeds", "2"]))
    assert [p.run_dir for p in seeded] == [Path("o/mlp/base/seed-0"), Path("o/mlp/base/seed-1")]
    assert seeded[1].overrides[-2] == "--train.seed=1"


@pytest.fixture
def launches(monkeypatch) -> list:
    """Records every training run the sweep would start, and starts none."""
    calls = []
    monkeypatch.setattr(sweep_module, "run_point", lambda config, point, python: calls.append(point))
    return calls


@pytest.mark.parametrize("extra,message", [
    (["--grid", "model.hiden_dim=32,64"],
     "sweep point rankmixer [num_layers=1 hiden_dim=32]: unknown config key: model.hiden_dim"),
    (["--grid", "model.hidden_dim=32,ten"], "config key model.hidden_dim must be int, got 'ten'"),
    (["--grid", "model.hidden_dim=32,18"],
     "sweep point rankmixer [num_layers=1 hidden_dim=18]: RankMixer needs model.hidden_dim=18"),
    (["--tower-grid", "dcnv2:model.dcnv2.cross_layers=1"], "tower 'dcnv2' is not among the --tower options"),
    (["--grid", "model.hidden_dim"], "must look like section.key=v1,v2"),
    (["--baseline-tower", "nope"], "sweep point nope [-]: model.tower must be one of"),
])
def test_bad_grid_is_a_clear_error_before_any_training(tmp_path, launches, extra, message):
    out = tmp_path / "sweep"
    with pytest.raises(ValueError) as error:
        sweep(["--config", DEBUG, "--out", str(out), "--tower", "rankmixer", "--grid", "model.num_layers=1", *extra])
    assert message in str(error.value)
    assert launches == [] and not out.exists()


@pytest.mark.slow
def test_tiny_sweep_writes_table_fit_and_plot_then_resumes_without_training(tmp_path, monkeypatch, capsys,
                                                                            forked_runs):
    out = tmp_path / "sweep"
    argv = ["--config", DEBUG, "--out", str(out), "--tower", "rankmixer", "--grid", "model.hidden_dim=16,32",
            "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.synth_rows=2000",
            "--set", "train.steps=3", "--set", "metrics.progress=false", "--set", "metrics.tensorboard=false",
            "--set", "checkpoint.enabled=false", "--set", "data.valid_fraction=0.2", "--set", "metrics.valid_every=1"]
    assert sweep(argv) == 0
    printed = capsys.readouterr().out
    assert "launched 3 run(s)" in printed and "baseline AUC" in printed
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [r["point"] for r in rows] == ["hidden_dim=16", "hidden_dim=32"]
    baseline = json.loads((out / "baseline" / "logreg" / "summary.json").read_text())["auc"]
    for r in rows:
        summary = json.loads((out / "rankmixer" / r["point"].replace("=", "-") / "summary.json").read_text())
        assert float(r["auc"]) == pytest.approx(summary["auc"])
        assert float(r["dauc"]) == pytest.approx(summary["auc"] - baseline)
        assert float(r["epochs"]) == pytest.approx(summary["best/epochs"])
    assert int(rows[0]["params"]) < int(rows[1]["params"]) and int(rows[0]["flops"]) < int(rows[1]["flops"])
    fits = json.loads((out / "fit.json").read_text())
    assert fits["baseline_auc"] == pytest.approx(baseline) and set(fits["fits"]["rankmixer"]) == {"params", "flops"}
    assert (out / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # validation after each of the 3 steps: each point's curve, from its metrics.jsonl
    curves = json.loads((out / "curves.json").read_text())
    assert list(curves) == ["rankmixer hidden_dim=16", "rankmixer hidden_dim=32"]
    for name, curve in curves.items():
        run = out / "rankmixer" / name.split()[1].replace("=", "-")
        valid = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert curve == [[r["epochs"], r["auc"]] for r in valid if r["kind"] == "valid"] and len(curve) == 3
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Again: every summary exists, so nothing trains; a summary without the cost keys
    # (older trainers) gets them computed from the run's config, to the same numbers.
    summaries = sorted(out.rglob("summary.json"))
    mtimes = [p.stat().st_mtime_ns for p in summaries]
    first = out / "rankmixer" / "hidden_dim-16" / "summary.json"
    stripped = {k: v for k, v in json.loads(first.read_text()).items() if k not in ("dense_params", "flops_per_sample")}
    first.write_text(json.dumps(stripped))
    mtimes[summaries.index(first)] = first.stat().st_mtime_ns
    calls = []
    monkeypatch.setattr(sweep_module, "run_point", lambda config, point, python: calls.append(point))
    assert sweep(argv) == 0
    assert calls == [] and "launched 0 run(s)" in capsys.readouterr().out
    assert [p.stat().st_mtime_ns for p in summaries] == mtimes
    assert list(csv.DictReader((out / "sweep.csv").open())) == rows
    # Other settings into the same folder: an error naming the stale run, nothing trains.
    with pytest.raises(ValueError, match="holds a run trained with other settings"):
        sweep([a.replace("train.steps=3", "train.steps=4") for a in argv])
    assert calls == []


def test_counted_cost_of_towers_without_an_analytic_one():
    from torch import nn

    model = nn.Sequential(nn.Linear(10, 6), nn.ReLU(), nn.Linear(6, 1))
    assert sweep_module.counted_cost(model, 10) == (10 * 6 + 6 + 6 + 1, 2 * (10 * 6 + 6))


def test_fit_leaves_out_points_that_do_not_beat_the_baseline(capsys):
    rows = [{"tower": "t", "point": str(i), "params": p, "flops": 2 * p, "dauc": d}
            for i, (p, d) in enumerate([(100, -0.01), (1000, 0.01), (10000, 0.02), (100000, 0.04)])]
    fits = sweep_module.fits_of(rows)
    assert fits["t"]["params"]["n"] == 3
    assert fits["t"]["params"]["b"] == pytest.approx(np.polyfit(np.log([1e3, 1e4, 1e5]), np.log([.01, .02, .04]), 1)[0])
    rows[1]["dauc"] = 0.0  # two points left: no fit rather than a trivially perfect one
    assert sweep_module.fits_of(rows)["t"] == {"params": None, "flops": None}
    assert "1 point(s) with dAUC <= 0 left out" in capsys.readouterr().err
