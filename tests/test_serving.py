"""`rankmix export` and `rankmix score --model` on trained checkpoints: the artifact scores
Parquet as the checkpoint does (fp32 to 1e-5, quantized tables within their AUC budgets,
the MoE's sparse and dense inference, tables trained row-wise on 2 ranks), it loads in a
bare interpreter as its README says, and bad options are one-line errors."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli import rankmix, rankmix_ranks

TRAIN = ["--config", "configs/debug.toml", "--metrics.progress=false", "--metrics.tensorboard=false"]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def last_json(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(ok(proc).stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def data(made_once) -> Path:
    return made_once("serving-data", lambda folder: None)


def trained(made_once, data: Path, name: str, *args: str, ranks: int = 1) -> tuple[Path, dict, Path]:
    """(run folder, training summary, held-out split) of a short debug-config run, made once."""
    def make(folder: Path) -> None:  # ranks forked as torchrun starts them: what `rankmix launch` does is test_launch's
        proc = ok(rankmix_ranks(ranks, *TRAIN, f"--train.run_dir={folder}/run", f"--data.cache_dir={data}", *args))
        (folder / "summary.json").write_text(proc.stdout.splitlines()[-1])
    folder = made_once(f"serving-{name}", make)
    return folder / "run", json.loads((folder / "summary.json").read_text()), next(data.glob("*/valid"))


@pytest.fixture(scope="module")
def rankmixer(made_once, data):
    return trained(made_once, data, "rankmixer", "--train.steps=30")


def export(run: Path, out: Path, *args: str) -> dict:
    return last_json(rankmix("export", "--checkpoint", str(run), "--out", str(out), *args))


def score(source: str, path: Path, valid: Path, out: Path, *args: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(summary, predictions by task) of `rankmix score --checkpoint|--model path`."""
    summary = last_json(rankmix("score", source, str(path), "--data", str(valid), "--out", str(out), *args))
    scored = pq.read_table(out)
    return summary, {c: scored.column(c).to_numpy() for c in scored.column_names if c.startswith("pred_")}


@pytest.mark.parametrize("fmt", ["pt2", "torchscript"])
def test_an_fp32_artifact_scores_as_its_checkpoint(rankmixer, tmp_path, fmt):
    run, _, valid = rankmixer
    manifest = export(run, tmp_path / "model", "--format", fmt)
    assert manifest["step"] == 30 and manifest["tasks"] == ["click", "like"] and manifest["tables"] == "fp32"
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == sorted(
        ["README.md", "config.toml", "manifest.json", manifest["file"], "example_inputs.pt", "example_outputs.pt"])
    expected, by_checkpoint = score("--checkpoint", run, valid, tmp_path / "a")
    got, by_model = score("--model", tmp_path / "model", valid, tmp_path / "b")
    for task in ("pred_click", "pred_like"):
        np.testing.assert_allclose(by_model[task], by_checkpoint[task], atol=1e-5, rtol=0)
    for key in ("auc", "uauc", "like/auc"):
        assert got[key] == pytest.approx(expected[key], abs=1e-5), key
    assert pq.read_table(tmp_path / "b").column_names == pq.read_table(tmp_path / "a").column_names


@pytest.mark.parametrize("tables,budget", [("fp16", 0.0005), ("int8", 0.001)])
def test_quantized_tables_stay_within_their_auc_budget(rankmixer, tmp_path, tables, budget):
    run, _, valid = rankmixer
    assert export(run, tmp_path / "model", "--tables", tables)["needs_fbgemm"]
    expected, by_checkpoint = score("--checkpoint", run, valid, tmp_path / "a")
    got, by_model = score("--model", tmp_path / "model", valid, tmp_path / "b")
    assert not np.array_equal(by_model["pred_click"], by_checkpoint["pred_click"])  # quantized indeed
    for key in ("click/auc", "like/auc"):
        assert abs(got[key] - expected[key]) <= budget, (key, got[key], expected[key])


def readme_code(folder: Path) -> str:
    return re.search(r"```python\n(.*?)```", (folder / "README.md").read_text(), re.S).group(1)


@pytest.mark.parametrize("fmt,tables,fbgemm", [("pt2", "fp32", False), ("pt2", "int8", True),
                                               ("torchscript", "fp32", True)])
def test_the_readme_loads_the_artifact_in_a_bare_interpreter(rankmixer, tmp_path, fmt, tables, fbgemm):
    run, _, _ = rankmixer
    assert export(run, tmp_path / "export", "--format", fmt, "--tables", tables)["needs_fbgemm"] == fbgemm
    folder = shutil.copytree(tmp_path / "export", tmp_path / "elsewhere" / "model")  # nothing of the repository
    probe = readme_code(folder) + (
        "import sys\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'trainer', 'dense', 'embeddings', 'launch', 'torchrec', 'fbgemm_gpu', 'rankmix'}))\n")
    proc = subprocess.run([sys.executable, "-I", "-c", probe], cwd=folder, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == str(["fbgemm_gpu"] if fbgemm else [])


@pytest.mark.slow
def test_moe_artifacts_route_as_the_checkpoint_does(made_once, data, tmp_path):
    run, _, valid = trained(made_once, data, "moe", "--model.tower=rankmixer_moe", "--train.steps=30")
    export(run, tmp_path / "sparse")
    export(run, tmp_path / "dense", "--moe", "dense")
    _, sparse = score("--checkpoint", run, valid, tmp_path / "a")
    _, dense = score("--checkpoint", run, valid, tmp_path / "b", "--model.moe.inference=dense")
    _, sparse_model = score("--model", tmp_path / "sparse", valid, tmp_path / "c")
    _, dense_model = score("--model", tmp_path / "dense", valid, tmp_path / "d")
    np.testing.assert_allclose(sparse_model["pred_click"], sparse["pred_click"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(dense_model["pred_click"], dense["pred_click"], atol=1e-5, rtol=0)
    assert np.abs(sparse["pred_click"] - dense["pred_click"]).max() > 1e-3  # two different routers


@pytest.mark.slow
def test_row_wise_tables_of_two_ranks_export_whole(made_once, data, tmp_path):
    run, _, valid = trained(made_once, data, "row-wise", "--embeddings.plan=row_wise", "--train.steps=10",
                            ranks=2)
    assert "row_wise" in (run / "plan.txt").read_text()
    export(run, tmp_path / "model")
    _, one_rank = score("--checkpoint", run, valid, tmp_path / "a")  # the same weights, loaded into one rank
    _, by_model = score("--model", tmp_path / "model", valid, tmp_path / "b")
    np.testing.assert_allclose(by_model["pred_click"], one_rank["pred_click"], atol=1e-5, rtol=0)


@pytest.mark.trained  # that the best validation comes before the last: at this learning rate it overfits
def test_a_unimixer_is_scored_and_served_at_the_temperature_of_its_weights(made_once, data, tmp_path):
    # The temperature anneals over 1000 steps, so it differs at every step; the run stops
    # early and ends on its best validation's weights, saved in <run>/best.
    run, summary, valid = trained(made_once, data, "unimixer", "--model.tower=unimixer",
                                  "--model.unimixer.tau_anneal_steps=1000", "--train.steps=0", "--train.epochs=8",
                                  "--data.valid_fraction=0.1", "--train.early_stopping_patience=1",
                                  "--optim.lr=0.02", "--embeddings.lr=0.5")
    assert summary["best/restored"] and summary["best/step"] < summary["steps"]
    scored, by_checkpoint = score("--checkpoint", run / "best", valid, tmp_path / "a")
    assert scored["auc"] == pytest.approx(summary["auc"], abs=1e-6)  # the trainer's test metrics
    export(run / "best", tmp_path / "model", "--format", "torchscript")
    _, by_model = score("--model", tmp_path / "model", valid, tmp_path / "b")
    np.testing.assert_allclose(by_model["pred_click"], by_checkpoint["pred_click"], atol=1e-5, rtol=0)


def test_rows_the_artifact_refuses_are_named(rankmixer, tmp_path):
    run, _, valid = rankmixer
    export(run, tmp_path / "model")
    rows = pq.read_table(valid)
    activity = rows.column("user_activity").to_numpy().astype(np.float64)
    activity[2] = -2.0  # outside log1p's domain; the reader's own checks pass it on
    pq.write_table(rows.set_column(rows.column_names.index("user_activity"), "user_activity", pa.array(activity)),
                   tmp_path / "bad.parquet")
    proc = rankmix("score", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "bad.parquet"),
                   "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (f"{tmp_path / 'bad.parquet'}, batch 0: the model {tmp_path / 'model'} refused the rows: "
            "numeric feature 'user_activity': log1p needs values > -1") in proc.stderr


@pytest.mark.parametrize("args,message", [
    (["--format", "onnx"], "--format must be one of pt2|torchscript|weights, got 'onnx'"),
    (["--tables", "int2"], "--tables must be one of fp32|fp16|int8|int4, got 'int2'"),
    (["--moe", "half"], "--moe must be one of sparse|dense, got 'half'"),
    (["--model.num_layers=3"], "does not fit this config's tower: missing ['blocks.2."),
    (["--model.hidden_dim=48"], "does not fit this config's tower: size mismatch for"),
    (["--tables", "int4", "--features.hour.embedding_dim=6"],
     "--tables int4 needs every table's embedding_dim divisible by 4: features.hour.embedding_dim=6"),
    (["--format", "weights", "--tables", "int8"],
     "--format weights writes the checkpoint's tensors as they are; it takes no ['--tables']"),
])
def test_bad_export_options_are_one_line_errors(rankmixer, tmp_path, args, message):
    proc = rankmix("export", "--checkpoint", str(rankmixer[0]), "--out", str(tmp_path / "m"), *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("files", [{"notes.txt": "mine"},
                                   {"manifest.json": '{"name": "my-app"}', "src.py": "code"},
                                   {"manifest.json": '{"file": "model.pt2"}', "src.py": "code"}])
def test_export_keeps_out_of_folders_it_did_not_write(rankmixer, tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    proc = rankmix("export", "--checkpoint", str(rankmixer[0]), "--out", str(tmp_path))
    assert proc.returncode == 2 and {p.name: p.read_text() for p in tmp_path.iterdir()} == files
    assert f"--out {tmp_path} holds files that are not a rankmix export" in proc.stderr


def test_an_artifact_is_readable_by_others_and_replaced_by_the_next_export(rankmixer, tmp_path):
    os.umask(umask := os.umask(0o022))
    try:
        export(rankmixer[0], tmp_path / "model", "--format", "torchscript")
        assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == 0o755
        manifest = export(rankmixer[0], tmp_path / "model")  # over the earlier export
    finally:
        os.umask(umask)
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == sorted(
        ["README.md", "config.toml", "manifest.json", "model.pt2", "example_inputs.pt", "example_outputs.pt"])
    assert manifest["checkpoint"] == str((rankmixer[0] / "checkpoints" / "step-30").resolve())


def test_an_out_that_is_a_file_is_refused_before_any_work(rankmixer, tmp_path):
    (tmp_path / "model.pt2").write_text("mine")
    proc = rankmix("export", "--checkpoint", str(rankmixer[0]), "--out", str(tmp_path / "model.pt2"))
    assert proc.returncode == 2 and f"--out {tmp_path / 'model.pt2'} is a file; give a folder" in proc.stderr


@pytest.mark.parametrize("args", [["--config", "configs/debug.toml"], ["--model.moe.inference=dense"],
                                  ["--features.user_id.column=user_age"]])
def test_score_keeps_to_the_artifacts_own_config(rankmixer, tmp_path, args):
    run, _, valid = rankmixer
    export(run, tmp_path / "model")
    proc = rankmix("score", "--model", str(tmp_path / "model"), "--data", str(valid), "--out",
                   str(tmp_path / "out"), *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"--model {tmp_path / 'model'} carries its own features, tasks and model; only --data.*/--metrics.* "
            "options apply to it") in proc.stderr


@pytest.mark.parametrize("command,message", [
    (["export", "--checkpoint", "nope", "--out", "m"], "--checkpoint nope: no such folder"),
    (["export", "--checkpoint", ".", "--config", "RUN/config.toml", "--out", "m"],
     "--checkpoint=.: no complete checkpoint there"),
    (["export", "--checkpoint", "RUN", "--format", "weights", "--out", "."],
     "--out . is a folder; --format weights writes one file"),
])
def test_bad_checkpoints_and_outs_are_named(rankmixer, tmp_path, command, message):
    command = [a.replace("RUN", str(rankmixer[0])) for a in command]
    proc = rankmix(*command, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "m").exists()


def test_a_damaged_artifact_is_a_one_line_error(rankmixer, tmp_path):
    run, _, valid = rankmixer
    export(run, tmp_path / "model")
    (tmp_path / "model" / "model.pt2").write_text("not a zip")
    proc = rankmix("score", "--model", str(tmp_path / "model"), "--data", str(valid), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"--model {tmp_path / 'model'}: cannot load the artifact (" in proc.stderr


def test_score_needs_an_artifact_folder(tmp_path):
    proc = rankmix("score", "--model", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert f"--model {tmp_path}: no config.toml there (not a `rankmix export` folder)" in proc.stderr


@pytest.mark.bench
def test_the_serving_bench_times_every_table_type_against_eager_scoring(rankmixer):
    run, _, valid = rankmixer
    proc = subprocess.run([sys.executable, "bench/serve.py", "--checkpoint", str(run), "--data", str(valid),
                           "--tables", "fp32,int8", "--batches", "1,16", "--seconds", "0.02"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["eager"], ["fp32"], ["int8"])]
    assert [(line[0], line[2]) for line in lines] == [(m, b) for b in ("1", "16") for m in ("eager", "fp32", "int8")]
    for line in lines:
        assert line[3:8:2] == ["p50_ms", "p99_ms", "rows/s"] and float(line[4]) <= float(line[6])
    sizes = {line[0]: float(line[line.index("tables_mb") + 1]) for line in lines if "tables_mb" in line}
    assert 0 < sizes["int8"] < sizes["fp32"]
