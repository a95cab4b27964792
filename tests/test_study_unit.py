"""`rankmix study`'s comparison of runs (launch/study.py), in-process and from summaries
written here, so that `make test-mutation` reaches it: which figure a row reads, the paired
differences, the better baseline, the records and the Markdown table. tests/test_study.py
runs the whole protocol."""

import json
import math

import numpy as np
import pytest

from launch.study import PROTOCOL, Row, better_baseline, markdown, paired, protocol, rows_of, table
from launch.sweep import Point


def _run(auc: float, **extra) -> dict:
    return {"auc": auc, "uauc": auc - 0.05, "logloss": 0.5, "ne": 0.9, "calibration": 1.1, "best/epochs": 3.0,
            "dense_params": 1000, "flops_per_sample": 4000, **extra}


def test_a_rows_figures_by_seed_are_those_of_the_model_as_trained():
    row = Row("mlp", "-", {2: {"auc": 0.7, "uncalibrated/auc": 0.6}, 0: {"auc": 0.8}, 1: {"ne": 0.9}})
    trained = row.values("auc")
    assert trained.tolist()[::2] == [0.8, 0.6] and math.isnan(trained[1])
    calibrated = row.values("auc", calibrated=True)
    assert calibrated.dtype == np.float64 and calibrated.tolist()[::2] == [0.8, 0.7]
    assert math.isnan(calibrated[1])


def test_a_rows_mean_and_sample_spread():
    row = Row("mlp", "-", {0: _run(0.70), 1: _run(0.74), 2: _run(0.75, **{"uncalibrated/auc": 0.72})})
    mean, std = row.mean_std("auc")
    assert mean == pytest.approx(0.72, abs=1e-12) and std == pytest.approx(0.02, abs=1e-12)
    assert isinstance(mean, float) and isinstance(std, float)
    assert row.mean_std("auc", calibrated=True)[0] == pytest.approx((0.70 + 0.74 + 0.75) / 3, abs=1e-12)
    assert Row("mlp", "-", {4: _run(0.7)}).mean_std("auc") == (0.7, 0.0)


def test_a_paired_difference_over_the_seeds_both_ran():
    a = Row("rankmixer", "big", {0: {"auc": 0.72}, 1: {"auc": 0.70, "uncalibrated/auc": 0.76}, 3: {"auc": 0.9}})
    b = Row("mlp", "-", {0: {"auc": 0.70}, 1: {"auc": 0.73}, 2: {"auc": 0.1}})
    diff = paired(a, b)  # seeds 0 and 1: 0.02 and 0.03, rankmixer's as trained
    assert diff.against == "mlp [-]"
    assert diff.mean == pytest.approx(0.025, abs=1e-15) and diff.std == pytest.approx(math.sqrt(5e-5), abs=1e-15)
    assert isinstance(diff.mean, float) and isinstance(diff.std, float)
    one = paired(a, Row("dcnv2", "x", {1: {"auc": 0.5}}))
    assert (one.mean, one.std, one.against) == (pytest.approx(0.26, abs=1e-15), 0.0, "dcnv2 [x]")
    with pytest.raises(ValueError) as error:
        paired(a, Row("logreg", "-", {7: {"auc": 0.5}}))
    assert str(error.value) == "rankmixer [big] and logreg [-] share no seed"


def test_the_better_baseline_has_the_highest_mean_auc():
    # mlp: mean 0.73, spread 0.007; dcnv2: mean 0.725, spread 0.035
    rows = [Row("rankmixer", "-", {0: _run(0.9)}), Row("logreg", "-", {0: _run(0.6)}),
            Row("dcnv2", "-", {0: _run(0.70), 1: _run(0.75)}), Row("mlp", "-", {0: _run(0.725), 1: _run(0.735)})]
    assert better_baseline(rows, ["mlp", "dcnv2", "logreg"]) is rows[3]
    assert better_baseline(rows, ["logreg", "dcnv2"]) is rows[2]
    assert better_baseline(rows, ["unimixer"]) is None and better_baseline(rows, []) is None


def test_rows_of_groups_the_points_by_tower_and_settings(tmp_path):
    points = []
    for tower, settings, seed, auc in [("mlp", {}, 0, 0.7), ("rankmixer", {"model.hidden_dim": "64"}, 0, 0.8),
                                       ("mlp", {}, 1, 0.72), ("rankmixer", {"model.hidden_dim": "64"}, 1, 0.81),
                                       ("dcnv2", {}, None, 0.75)]:
        folder = tmp_path / f"{tower}-{seed}"
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps(_run(auc)))
        points.append(Point(tower, settings, seed, folder))
    rows = rows_of(points)
    assert [(r.tower, r.point, sorted(r.runs)) for r in rows] == [
        ("mlp", "-", [0, 1]), ("rankmixer", "hidden_dim=64", [0, 1]), ("dcnv2", "-", [0])]
    assert rows[0].runs[1]["auc"] == 0.72 and rows[1].runs[0]["auc"] == 0.8 and rows[2].runs[0]["auc"] == 0.75


def _rows() -> list[Row]:
    calibrated = {s: _run(0.75 + s / 100, **{"uncalibrated/auc": 0.74 + s / 100, "uncalibrated/ne": 0.95,
                                               "uncalibrated/calibration": 1.3 + s / 10, "ne": 0.93 - s / 100,
                                               "moe/inference_flops_per_sample": 1000.0 + 500 * s})
                  for s in (0, 1)}
    return [Row("rankmixer_moe", "-", calibrated), Row("mlp", "-", {0: _run(0.70), 1: _run(0.72)}),
            Row("dcnv2", "-", {0: _run(0.71, dense_params=77), 1: _run(0.7106)})]


def test_the_records_pair_each_row_with_the_baseline_and_the_reference():
    rows = _rows()
    moe, mlp, dcn = rows
    records = table(rows, mlp, moe)
    assert [(r["tower"], r["point"], r["seeds"], r["params"], r["flops"], r["inference_flops"]) for r in records] == [
        ("rankmixer_moe", "-", 2, 1000, 4000, 1250), ("mlp", "-", 2, 1000, 4000, 4000),
        ("dcnv2", "-", 2, 77, 4000, 4000)]
    first = records[0]
    assert first["auc"] == pytest.approx(0.745) and first["auc_std"] == pytest.approx(0.01 / math.sqrt(2))
    assert first["ne"] == 0.95 and first["ne_std"] == 0.0
    assert first["calibration"] == pytest.approx(1.35) and first["uauc"] == pytest.approx(0.705)
    assert first["calibrated/ne"] == pytest.approx(0.925) and first["calibrated/ne_std"] == pytest.approx(
        0.01 / math.sqrt(2))
    assert first["calibrated/calibration"] == 1.1 and first["calibrated/logloss"] == 0.5
    assert (first["best/epochs"], first["best/epochs_std"]) == (3.0, 0.0)
    assert all(math.isnan(r[f"calibrated/{k}{s}"]) for r in records[1:] for k in ("ne", "calibration", "logloss")
               for s in ("", "_std"))
    # the MoE's as trained (0.74, 0.75) against mlp (0.70, 0.72): +0.04 and +0.03
    assert (first["vs_baseline"], first["vs_baseline_verdict"]) == ("mlp [-]", "ahead")
    assert first["vs_baseline_mean"] == pytest.approx(0.035) and first["vs_baseline_std"] == pytest.approx(
        0.01 / math.sqrt(2))
    assert first["vs_reference"] == "" and math.isnan(first["vs_reference_mean"])
    assert math.isnan(first["vs_reference_std"]) and first["vs_reference_verdict"] == ""
    assert records[1]["vs_baseline"] == "" and records[1]["vs_reference_verdict"] == "behind"
    assert (records[2]["vs_baseline_mean"], records[2]["vs_baseline_verdict"]) == (pytest.approx(0.0003), "level")
    assert set(records[0]) == set(records[2]) and len(records[0]) == 32
    assert [r["vs_baseline"] for r in table(rows, None, None)] == [""] * 3
    assert table([Row("mlp", "-", {3: _run(0.7)})], None, None)[0]["flops"] == 4000  # one seed


def test_the_markdown_table():
    rows = _rows()
    text = markdown(table(rows, rows[1], rows[0]), rows[1], rows[0])
    assert text.splitlines() == [
        "| tower | point | dense params | FLOPs/sample (training) | FLOPs/sample (inference) | test AUC | test UAUC "
        "| logloss | NE | calibration | NE, calibrated | calibration, calibrated | epochs to best "
        "| AUC - better baseline (mlp [-]) | AUC - rankmixer_moe [-] |",
        "|" + "---|" * 15,
        "| rankmixer_moe | - | 1,000 | 4,000 | 1,250 | 0.7450 ± 0.0071 | 0.7050 ± 0.0071 | 0.5000 ± 0.0000 "
        "| 0.9500 ± 0.0000 | 1.3500 ± 0.0707 | 0.9250 ± 0.0071 | 1.1000 ± 0.0000 | 3.0 ± 0.0 "
        "| +0.0350 ± 0.0071 (ahead) | - |",
        "| mlp | - | 1,000 | 4,000 | 4,000 | 0.7100 ± 0.0141 | 0.6600 ± 0.0141 | 0.5000 ± 0.0000 "
        "| 0.9000 ± 0.0000 | 1.1000 ± 0.0000 | - | - | 3.0 ± 0.0 | - | -0.0350 ± 0.0071 (behind) |",
        "| dcnv2 | - | 77 | 4,000 | 4,000 | 0.7103 ± 0.0004 | 0.6603 ± 0.0004 | 0.5000 ± 0.0000 "
        "| 0.9000 ± 0.0000 | 1.1000 ± 0.0000 | - | - | 3.0 ± 0.0 | +0.0003 ± 0.0137 (level) "
        "| -0.0347 ± 0.0066 (behind) |",
        "",
        "Mean ± sample standard deviation over 2 seed(s); a paired difference is ahead or behind when its mean "
        "exceeds its standard deviation, else level. Logloss, NE and calibration are the model's as trained; "
        "'calibrated' after train.calibrate's map, where fitted."]


def test_the_markdown_table_without_a_baseline_or_reference():
    rows = _rows()[1:2]
    lines = markdown(table(rows, None, None), None, None).splitlines()
    assert lines[0].endswith("| epochs to best | AUC - better baseline | AUC - reference |")
    assert lines[2].endswith("| 3.0 ± 0.0 | - | - |")
    assert markdown([], None, None).splitlines()[-1].startswith("Mean ± sample standard deviation over 0 seed(s);")


def test_the_protocol_validates_four_times_an_epoch_unless_the_user_sets_the_schedule():
    assert protocol([]) == list(PROTOCOL)
    assert "metrics.valid_every_epochs=0.25" in PROTOCOL and "train.early_stopping_patience=4" in PROTOCOL
    # the user's steps replace the protocol's share of an epoch (a run takes one of the two), and the other way
    assert protocol(["metrics.valid_every=50"]) == [p for p in PROTOCOL if not p.startswith("metrics.valid_every_")]
    assert protocol([" metrics.valid_every_epochs = 0.5"]) == list(PROTOCOL)  # the same key: later wins
    assert protocol(["train.epochs=3", "data.split=time"]) == list(PROTOCOL)
    # the key is what comes before the first '=' (a value may hold more)
    assert "metrics.valid_every_epochs=0.25" not in protocol(["metrics.valid_every=x=y"])
