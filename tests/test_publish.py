"""Publishing while training (`[publish]`, trainer/serving/publish.py): every publish is a full
serving artifact, every publish after the first has a delta, and `rankmix publish apply` of a
base and the delta after it serves the next full artifact's predictions bit for bit, at 1 and
2 ranks, with plain tables sharded row-wise and managed tables that admit and evict ids."""

import json
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from cli import rankmix
from cli import rankmix_ranks as train
from embeddings.managed import served_tables
from trainer.checkpoint.manager import model_tensors
from trainer.config_loader import dump_toml, load_config
from trainer.data.datasets import synth_features
from trainer.serving.export import load
from trainer.serving.predict import raw_inputs
from trainer.serving.publish import split_tables

# Managed user and item tables with fewer rows than the log has ids (they evict), publishing
# every 7 steps: step-7 (full only), step-14 and step-21 (each with a delta).
RUN = ["--config", "configs/synth.toml", "--data.synth_rows=20000", "--metrics.progress=false",
       "--metrics.tensorboard=false", "--metrics.log_every=7", "--train.steps=21", "--publish.every_steps=7",
       *(f"--features.{f}.{key}={value}" for f, rows in (("user_id", 600), ("item_id", 400), ("hist_items", 400))
         for key, value in (("hashing", "managed"), ("num_embeddings", rows), ("eviction_interval", 1)))]


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def published(made_once, world: int) -> tuple[Path, Path]:
    """(the publish folder, the data cache) of the run above on `world` ranks, made once."""
    cache = made_once("publish-cache", lambda folder: None)

    def make(folder: Path) -> None:
        plan = ["--embeddings.plan=row_wise"] if world > 1 else []
        ok(train(world, *RUN, *plan, f"--train.run_dir={folder}/run", f"--data.cache_dir={cache}"))
    return made_once(f"publish-{world}", make) / "run" / "publish", cache


def predictions(folder: Path, valid: Path) -> torch.Tensor:
    """The artifact's probabilities of the first 2000 held-out rows, as a server gets them."""
    features = load_config(str(folder / "config.toml"), [], allow_redacted=True).features
    table = pq.read_table(sorted(valid.glob("*.parquet"))[0]).slice(0, 2000)
    model, _ = load(folder)
    with torch.no_grad():
        return model(*raw_inputs(table, features, "valid"))


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def id_maps(folder: Path) -> dict[str, set[int]]:
    maps = torch.load(folder / "tables.pt", weights_only=True)["id_maps"]
    return {t: set(m["keys"].tolist()) for t, m in maps.items()}


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_a_delta_applied_to_its_base_serves_the_full_artifacts_predictions(world, made_once, tmp_path):
    publish, cache = published(made_once, world)
    valid = next(cache.glob("*/valid"))
    assert sorted(p.name for p in publish.iterdir()) == ["step-14", "step-21", "step-7"]
    assert manifest(publish / "step-7")["publish"]["delta"] is None  # nothing to be a delta against
    base = publish / "step-7"
    for step in (14, 21):
        full = publish / f"step-{step}"
        info = manifest(full)["publish"]
        assert info["delta"]["base_step"] == step - 7 and info["step"] == step
        assert info["delta_bytes"] == (full / "delta.pt").stat().st_size
        assert info["full_bytes"] == (full / "model.pt2").stat().st_size
        assert 0 < info["delta_over_full"] < 1 and "train" in info["metrics"]
        rows = info["delta"]["rows"]
        assert 0 < rows["item_category"] and rows["user_age"] <= 8  # only the rows that changed
        before, after = id_maps(base), id_maps(full)
        assert after["user_id"] - before["user_id"] and before["user_id"] - after["user_id"]  # admitted, evicted
        out = tmp_path / f"applied-{step}"
        applied = json.loads(ok(rankmix("publish", "apply", "--base", str(base), "--delta", str(full),
                                        "--out", str(out))).stdout.splitlines()[-1])
        assert applied["step"] == step
        assert torch.equal(predictions(out, valid), predictions(full, valid))
        ours, theirs = (torch.load(f / "tables.pt", weights_only=True) for f in (out, full))
        for table, weight in theirs["tables"].items():
            assert torch.equal(ours["tables"][table], weight), table
        base = out  # the next delta applies to the artifact just built


@pytest.mark.slow
def test_on_two_ranks_the_publish_holds_the_model_of_its_checkpoint_bit_for_bit(made_once):
    """Rank 0 alone reads the staged weights to publish them (DCP's load without a collective):
    the 2-rank run's step-21 tables, dense weights and id maps are those of its step-21 checkpoint."""
    publish, _ = published(made_once, 2)
    state, maps = served_tables(model_tensors(publish.parent / "checkpoints" / "step-21"))
    tables, dense = split_tables(state)
    saved = torch.load(publish / "step-21" / "tables.pt", weights_only=True)
    assert saved["tables"].keys() == tables.keys() and len(tables) > 5
    for table, weight in tables.items():
        assert torch.equal(saved["tables"][table], weight), table
    for table, held in saved["id_maps"].items():
        assert torch.equal(held["keys"], maps[table][0]), table
    delta = torch.load(publish / "step-21" / "delta.pt", weights_only=True)
    assert delta["dense"].keys() == dense.keys()
    for name, weight in dense.items():
        assert torch.equal(delta["dense"][name], weight), name


@pytest.mark.slow
def test_the_last_publish_scores_like_the_checkpoint_of_its_step(made_once, tmp_path):
    """The run's final checkpoint and its last publish are of step 21: `score --checkpoint`
    (the training model, evaluating) and the artifact give the same probabilities."""
    publish, cache = published(made_once, 1)
    valid = next(cache.glob("*/valid"))
    (tmp_path / "in").mkdir()
    pq.write_table(pq.read_table(sorted(valid.glob("*.parquet"))[0]).slice(0, 2000), tmp_path / "in" / "rows.parquet")
    checkpoint = publish.parent / "checkpoints" / "step-21"
    assert manifest(publish / "step-21")["step"] == 21
    ok(rankmix("score", "--checkpoint", str(checkpoint), "--data", str(tmp_path / "in"),
               "--out", str(tmp_path / "out")))
    scored = pq.read_table(tmp_path / "out" / "rows.parquet")
    tasks = manifest(publish / "step-21")["tasks"]
    expected = torch.stack([torch.from_numpy(scored[f"pred_{t}"].to_numpy()) for t in tasks], dim=1)
    torch.testing.assert_close(predictions(publish / "step-21", valid), expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_apply_refuses_a_delta_of_another_base_and_folders_that_are_not_published(made_once, tmp_path):
    publish, _ = published(made_once, 1)
    cases = [
        (publish / "step-7", publish / "step-21",
         f"--delta {publish}/step-21 applies to the publish of step 14, but --base {publish}/step-7 is of step 7"),
        (tmp_path, publish / "step-14", f"--base {tmp_path}: no tables.pt at {tmp_path}"),
        (publish / "step-7", publish / "step-7", f"--delta {publish}/step-7: no delta.pt at {publish}/step-7"),
    ]
    for base, delta, message in cases:
        proc = rankmix("publish", "apply", "--base", str(base), "--delta", str(delta), "--out", str(tmp_path / "B"))
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == f"rankmix: error: {message}", \
            proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "B").exists()


@pytest.mark.slow
def test_time_ordered_partitions_are_published_by_name_each_with_a_delta_after_the_first(tmp_path):
    from test_continuous import days, time_args  # the partitioned days and the run's options

    config = tmp_path / "config.toml"
    cfg = load_config("configs/debug.toml", ["--data.dataset=parquet"])
    cfg.features = synth_features()
    dump_toml(cfg, config)
    data, run = tmp_path / "data", tmp_path / "run"
    names = days(data, 3)
    ok(train(2, *time_args(config, data, run, "--publish.every_partition=true")))
    publish = run / "publish"
    assert sorted(p.name for p in publish.iterdir()) == names
    infos = [manifest(publish / name)["publish"] for name in names]
    assert [(i["partition"], i["step"]) for i in infos] == [(n, 3 * (k + 1)) for k, n in enumerate(names)]
    assert infos[0]["delta"] is None and [i["delta"]["base"] for i in infos[1:]] == names[:2]
    assert "progressive" in infos[1]["metrics"]
    out = tmp_path / "applied"
    ok(rankmix("publish", "apply", "--base", str(publish / names[0]), "--delta", str(publish / names[1] / "delta.pt"),
               "--out", str(out)))
    valid = data / names[2]
    assert torch.equal(predictions(out, valid), predictions(publish / names[1], valid))
