"""`rankmix plan`: TorchRec's planner on the meta device, checked against the bytes that real
sharded tables, their fused optimizer state and managed tables' id maps take on two gloo ranks."""

import json
import os
from pathlib import Path

import pytest

from cli import rankmix, rendezvous_port, spawn
from launch.plan import GB, plan_cluster
from trainer.config_loader import load_config
from trainer.data.datasets import synth_features

REPO = Path(__file__).resolve().parents[1]
def small_config(optimizer: str, data_type: str = "fp32", managed: bool = False):
    """The synthetic schema with two tables big enough that the planner's input and output
    buffers (batch x dims) are a small part of its estimate; `managed`: the user table managed."""
    cfg = load_config(None, [f"--embeddings.optimizer={optimizer}", f"--embeddings.data_type={data_type}",
                             "--data.batch_size=32"])
    cfg.features = synth_features()
    for feature in cfg.features:
        if feature.table in ("user_id", "item"):
            feature.num_embeddings = 200_000
        if managed and feature.table == "user_id":
            feature.hashing = "managed"
    return cfg


def _measure(rank: int, port: int, optimizer: str, data_type: str, managed: bool, out: str) -> None:
    """This rank's bytes of sharded tables, of the fused optimizer's state and of MCH's maps."""
    import torch
    import torch.distributed as dist

    from embeddings.sharding import local_shards, shard_model
    from trainer.ranking_model import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = small_config(optimizer, data_type, managed)
    model = shard_model(build_model(cfg), cfg.embeddings, torch.device("cpu"))
    tables = sum(t.numel() * t.element_size() for key, value in model.state_dict().items()
                 if ".embedding_bags." in key for t, _ in local_shards(value))
    state = model.fused_optimizer.state_dict()["state"]
    optim = sum(t.numel() * t.element_size() for per_param in state.values() for value in per_param.values()
                for t, _ in local_shards(value))
    maps = sum(t.numel() * t.element_size() for key, value in model.state_dict().items()
               if "._mch_" in key for t, _ in local_shards(value))
    Path(f"{out}/{rank}.json").write_text(json.dumps({"tables": tables, "optimizer": optim, "maps": maps}))
    dist.destroy_process_group()


@pytest.mark.parametrize("optimizer,data_type,managed", [("adagrad", "fp32", False), ("rowwise_adagrad", "fp32", False),
                                                         ("rowwise_adagrad", "fp16", False), ("adagrad", "fp32", True)])
def test_estimates_are_within_20_percent_of_the_measured_bytes(optimizer, data_type, managed, tmp_path):
    spawn(_measure, (rendezvous_port(), optimizer, data_type, managed, str(tmp_path)), 2)
    measured = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    tables, optim = (sum(m[k] for m in measured) for k in ("tables", "optimizer"))
    plan = plan_cluster(small_config(optimizer, data_type, managed), 2, "cpu", 0.0, 24.0, 2)
    assert sum(m.tables for m in plan.memory) == tables
    assert sum(m.optimizer for m in plan.memory) == optim
    assert [m.id_maps for m in plan.memory] == [m["maps"] for m in measured]
    assert ("user_id | row_wise | 2 x 100,000" in plan.text) == managed, plan.text
    estimate = sum(m.estimate for m in plan.memory)
    stored = tables + optim + sum(m["maps"] for m in measured)
    assert abs(estimate - stored) <= 0.2 * stored, (estimate, tables, optim)


@pytest.mark.parametrize("gpus", [8, 64])
def test_criteo_1tb_fits_on_80_gb_gpus(gpus):
    cfg = load_config(str(REPO / "configs" / "criteo_1tb.toml"))
    plan = plan_cluster(cfg, gpus, "cuda", 80.0, 512.0, 8)
    assert plan.fits and len(plan.memory) == gpus
    assert "fits: yes" in plan.text and "rank:0/cuda:0" in plan.text
    # six 40M x 128 tables of fp32 weights, and row-wise Adagrad's one value per row
    assert sum(m.tables for m in plan.memory) / GB == pytest.approx(
        sum(f.num_embeddings for f in cfg.features if f.kind != "numeric") * 128 * 4 / GB)
    assert sum(m.optimizer for m in plan.memory) * 128 == sum(m.tables for m in plan.memory)


def test_a_config_that_does_not_fit_says_so_and_exits_1():
    proc = rankmix("plan", "--config", "configs/criteo_1tb.toml", "--world-size", "2", "--device", "cuda",
                   "--hbm-gb", "16")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stdout.startswith("fits: no (TorchRec's planner found no plan)")


def test_a_synthetic_config_is_planned_with_its_teachers_schema():
    """configs/debug.toml gives no [[features]]: training reads the synthetic teacher's, and so
    does the plan, which names every table of it."""
    proc = rankmix("plan", "--config", "configs/debug.toml", "--world-size", "2", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-2000:]
    tables = {f.table or f.name for f in synth_features() if f.kind != "numeric"}
    planned = {line.split("|")[0].strip() for line in proc.stdout.splitlines() if line.count("|") == 3}
    assert tables <= planned, proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("fits: yes")


def all_managed(min_rows: int):
    cfg = load_config(None, ["--embeddings.optimizer=rowwise_adagrad"])
    cfg.features = synth_features()
    for feature in cfg.features:
        if feature.kind != "numeric":
            feature.hashing = "managed"
            feature.num_embeddings = max(feature.num_embeddings, min_rows)
    return cfg


def test_a_config_whose_tables_are_all_managed_is_sized_without_the_planner():
    cfg = all_managed(min_rows=4)
    plan = plan_cluster(cfg, 2, "cpu", 0.0, 24.0, 2)
    tables = {f.table: (f.num_embeddings, f.embedding_dim) for f in cfg.features if f.kind != "numeric"}
    assert sum(m.tables for m in plan.memory) == sum(rows * dim * 4 for rows, dim in tables.values())
    assert sum(m.optimizer for m in plan.memory) == sum(rows * 4 for rows, _ in tables.values())
    assert sum(m.id_maps for m in plan.memory) == sum(rows * 32 for rows, _ in tables.values())  # LFU: 4 int64
    assert "user_id | row_wise | [2501, 2500]" in plan.text and plan.fits


def test_a_managed_table_needs_two_rows_on_every_rank():
    with pytest.raises(ValueError, match=r"features.user_gender.num_embeddings=3 is too few rows for a managed table "
                                         r"on 2 ranks: row-wise, its parts have \[2, 1\] rows"):
        plan_cluster(all_managed(min_rows=0), 2, "cpu", 0.0, 24.0, 2)
