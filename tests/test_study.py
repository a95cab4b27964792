"""`rankmix study`: the protocol's runs, paired differences against an independent
computation from the runs' own summaries, the verdicts, and the option errors."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest

import cli
from launch.study import PROTOCOL, Paired, Row, better_baseline, paired, study, table
from test_sweep import forked_runs  # noqa: F401 (a fixture: the runs forked, not fresh interpreters)

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")


@pytest.mark.parametrize("mean, std, verdict", [
    (0.002, 0.001, "ahead"), (-0.002, 0.001, "behind"), (0.001, 0.001, "level"), (-0.0005, 0.001, "level"),
    (0.0, 0.0, "level"), (0.001, 0.0, "ahead")])
def test_a_difference_counts_only_beyond_its_spread(mean, std, verdict):
    assert Paired("x", mean, std).verdict == verdict


def test_paired_difference_is_seed_by_seed():
    a = Row("rankmixer", "-", {0: {"auc": 0.71}, 1: {"auc": 0.75}, 2: {"auc": 0.70}})
    b = Row("dcnv2", "-", {0: {"auc": 0.70}, 1: {"auc": 0.74}, 2: {"auc": 0.69}})
    diff = paired(a, b)
    # unpaired, the seeds' spread (0.027) would swamp the 0.01 every seed shows
    assert diff.mean == pytest.approx(0.01) and diff.std == pytest.approx(0.0, abs=1e-12)
    assert diff.verdict == "ahead" and diff.against == "dcnv2 [-]"
    with pytest.raises(ValueError, match=r"rankmixer \[-\] and mlp \[-\] share no seed"):
        paired(a, Row("mlp", "-", {5: {"auc": 0.7}}))


def test_a_sparse_moe_row_reports_its_measured_inference_cost():
    def run(auc, **extra):
        return {"auc": auc, "uauc": auc, "logloss": 0.5, "ne": 0.9, "calibration": 1.0, "best/epochs": 2.0,
                "dense_params": 10, "flops_per_sample": 400, **extra}
    moe = Row("rankmixer_moe", "-", {0: run(0.72, **{"moe/inference_flops_per_sample": 90.0}),
                                     1: run(0.74, **{"moe/inference_flops_per_sample": 110.0})})
    dense, mlp, dcn = (Row(t, "-", {0: run(a), 1: run(a + 0.01)}) for t, a in
                       (("rankmixer", 0.71), ("mlp", 0.70), ("dcnv2", 0.715)))
    rows = [dense, moe, mlp, dcn]
    assert better_baseline(rows, ["mlp", "dcnv2"]) is dcn
    records = table(rows, dcn, dense)
    assert [r["inference_flops"] for r in records] == [400, 100, 400, 400]
    assert records[1]["vs_reference_mean"] == pytest.approx(0.015) and records[1]["vs_reference_verdict"] == "ahead"
    assert records[0]["vs_reference"] == "" and records[3]["vs_baseline"] == ""


@pytest.mark.slow
def test_tiny_study_pairs_every_run_with_the_better_baseline_and_the_reference(tmp_path, capsys, forked_runs):
    out = tmp_path / "study"
    argv = ["--config", DEBUG, "--out", str(out), "--tower", "rankmixer", "--tower", "mlp", "--tower", "logreg",
            "--tower-set", "rankmixer:train.calibrate=platt", "--seeds", "2", "--baseline", "mlp",
            "--baseline", "logreg", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.synth_rows=3000",
            "--set", "train.steps=4", "--set", "metrics.valid_every=2"]
    assert study(argv) == 0
    printed = capsys.readouterr().out
    assert "study: launched 6 run(s)" in printed
    records = list(csv.DictReader((out / "study.csv").open()))
    assert [(r["tower"], r["point"]) for r in records] == [("rankmixer", "-"), ("mlp", "-"), ("logreg", "-")]
    runs = {(r["tower"], r["point"]): [json.loads((out / r["tower"] / folder / f"seed-{s}" / "summary.json")
                                                  .read_text()) for s in (0, 1)]
            for r, folder in zip(records, ("base", "base", "base"))}
    # the model as trained: a calibrated run's uncalibrated/* figures
    auc = {k: np.array([s.get("uncalibrated/auc", s["auc"]) for s in v]) for k, v in runs.items()}
    better = max([("mlp", "-"), ("logreg", "-")], key=lambda k: auc[k].mean())
    reference = ("rankmixer", "-")
    for r in records:
        key = (r["tower"], r["point"])
        assert float(r["auc"]) == pytest.approx(auc[key].mean())
        assert float(r["auc_std"]) == pytest.approx(auc[key].std(ddof=1))
        before = np.mean([s.get("uncalibrated/calibration", s["calibration"]) for s in runs[key]])
        assert float(r["calibration"]) == pytest.approx(before)
        if r["tower"] == "rankmixer":
            assert float(r["calibrated/calibration"]) == pytest.approx(np.mean([s["calibration"] for s in runs[key]]))
            assert float(r["calibrated/ne"]) == pytest.approx(np.mean([s["ne"] for s in runs[key]]))
        else:
            assert np.isnan(float(r["calibrated/calibration"]))
        assert float(r["best/epochs"]) == pytest.approx(np.mean([s["best/epochs"] for s in runs[key]]))
        assert int(r["inference_flops"]) == int(r["flops"]) == runs[key][0]["flops_per_sample"]  # no MoE here
        for name, other in (("baseline", better), ("reference", reference)):
            if key == other:
                assert r[f"vs_{name}"] == ""
                continue
            diffs = auc[key] - auc[other]
            assert r[f"vs_{name}"] == f"{other[0]} [{other[1]}]"
            assert float(r[f"vs_{name}_mean"]) == pytest.approx(diffs.mean())
            assert float(r[f"vs_{name}_std"]) == pytest.approx(diffs.std(ddof=1))
    # the protocol reached every run, after it the user's --set
    point = json.loads((out / "mlp" / "base" / "seed-1" / "sweep_point.json").read_text())
    # (the user's metrics.valid_every takes the place of the protocol's valid_every_epochs)
    kept = [s for s in PROTOCOL if not s.startswith("metrics.valid_every_epochs=")]
    assert point["overrides"][:len(kept) + 1] == [f"--{s}" for s in kept] + [f"--data.cache_dir={tmp_path / 'cache'}"]
    table = (out / "study.md").read_text()
    assert f"AUC - better baseline ({better[0]} [{better[1]}])" in table and "| logreg | - |" in table
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # again: every run is reused
    assert study(argv) == 0 and "study: launched 0 run(s)" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--baseline", "dcnv2"], "--baseline 'dcnv2' is not among the --tower options ['rankmixer', 'mlp']"),
    (["--reference", "unimixer"], "--reference 'unimixer' is not among the --tower options ['rankmixer', 'mlp']"),
    (["--seeds", "0"], "--seeds must be at least 1"),
    (["--set", "model.moe.budget=0.5"], "model.moe.budget is set, but tower 'rankmixer' does not read it"),
])
def test_bad_options_are_clear_errors_before_any_training(tmp_path, extra, message):
    proc = cli.rankmix("study", "--config", DEBUG, "--out", str(tmp_path / "s"), "--tower", "rankmixer",
                       "--tower", "mlp", *extra)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "s").exists()
