"""`rankmix plan`: TorchRec's planner on the meta device, checked against the bytes that real
sharded tables and their fused optimizer state take on two gloo ranks."""

import json
import os
from pathlib import Path

import pytest

from launch.plan import GB, plan_cluster
from cli import rankmix, spawn
from test_distributed import free_port
from trainer.config_loader import load_config
from trainer.data.datasets import synth_features

REPO = Path(__file__).resolve().parents[1]
def small_config(optimizer: str, data_type: str = "fp32"):
    """The synthetic schema with two tables big enough that the planner's input and output
    buffers (batch x dims) are a small part of its estimate."""
    cfg = load_config(None, [f"--embeddings.optimizer={optimizer}", f"--embeddings.data_type={data_type}",
                             "--data.batch_size=32"])
    cfg.features = synth_features()
    for feature in cfg.features:
        if feature.table in ("user_id", "item"):
            feature.num_embeddings = 200_000
    return cfg


def _measure(rank: int, port: int, optimizer: str, data_type: str, out: str) -> None:
    """This rank's bytes of sharded tables and of the fused optimizer's state."""
    import torch
    import torch.distributed as dist

    from dense.model import build_model
    from embeddings.sharding import local_shards, shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = small_config(optimizer, data_type)
    model = shard_model(build_model(cfg), cfg.embeddings, torch.device("cpu"))
    tables = sum(t.numel() * t.element_size() for key, value in model.state_dict().items()
                 if ".embedding_bags." in key for t, _ in local_shards(value))
    state = model.fused_optimizer.state_dict()["state"]
    optim = sum(t.numel() * t.element_size() for per_param in state.values() for value in per_param.values()
                for t, _ in local_shards(value))
    Path(f"{out}/{rank}.json").write_text(json.dumps({"tables": tables, "optimizer": optim}))
    dist.destroy_process_group()


@pytest.mark.parametrize("optimizer,data_type", [("adagrad", "fp32"), ("rowwise_adagrad", "fp32"),
                                                 ("rowwise_adagrad", "fp16")])
def test_estimates_are_within_20_percent_of_the_measured_bytes(optimizer, data_type, tmp_path):
    spawn(_measure, (free_port(), optimizer, data_type, str(tmp_path)), 2)
    measured = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    tables, optim = (sum(m[k] for m in measured) for k in ("tables", "optimizer"))
    plan = plan_cluster(small_config(optimizer, data_type), 2, "cpu", 0.0, 24.0, 2)
    assert sum(m.tables for m in plan.memory) == tables
    assert sum(m.optimizer for m in plan.memory) == optim
    estimate = sum(m.estimate for m in plan.memory)
    assert abs(estimate - (tables + optim)) <= 0.2 * (tables + optim), (estimate, tables, optim)


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
