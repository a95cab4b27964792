"""One topology: training's sharding plan and `rankmix plan`'s come from the same Cluster
facts (GPU memory, host memory per rank, the per-rank batch) through the same planner call."""

import json
import os
from dataclasses import asdict
from pathlib import Path

from torch import nn

from cli import rendezvous_port, spawn
from launch.plan import GB, given_cluster, plan_cluster
from trainer.config import per_rank_batch_size
from trainer.config_loader import load_config
from trainer.data.datasets import synth_features
from trainer.dist import node_memory_bytes

REPO = Path(__file__).resolve().parents[1]


def topology_fields(topology) -> dict:
    """Everything TorchRec's planner reads from a Topology."""
    return {"world_size": topology.world_size, "local_world_size": topology.local_world_size,
            "compute_device": topology.compute_device, "intra_group_size": topology.intra_group_size,
            "devices": [[d.rank, d.storage.hbm, d.storage.ddr, d.storage.ssd] for d in topology.devices],
            "bandwidths": [topology.intra_host_bw, topology.inter_host_bw, topology.hbm_mem_bw,
                           topology.ddr_mem_bw, topology.hbm_to_ddr_mem_bw]}


def table_placement(plan) -> dict:
    """table -> [sharding type, ranks] of a ShardingPlan's one EmbeddingBagCollection."""
    (tables,) = plan.plan.values()
    return {name: [s.sharding_type, sorted(s.ranks)] for name, s in tables.items()}


def debug_config():
    cfg = load_config(str(REPO / "configs" / "debug.toml"))
    cfg.features = synth_features()
    return cfg


def _training_side(rank: int, port: int, out: str) -> None:
    """The Cluster, Topology and plan that training builds on this gloo rank."""
    import torch
    import torch.distributed as dist

    from embeddings.sharding import build_plan
    from trainer.dist import job_cluster
    from trainer.ranking_model import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = debug_config()
    cluster = job_cluster(torch.device("cpu"), per_rank_batch_size(cfg, 2))
    plan = build_plan(build_model(cfg), cfg.embeddings, cluster)
    Path(out, f"{rank}.json").write_text(json.dumps({"cluster": asdict(cluster), "plan": table_placement(plan),
                                                     "topology": topology_fields(cluster.topology())}))
    dist.destroy_process_group()


def test_training_and_rankmix_plan_build_the_same_topology_and_plan(tmp_path):
    spawn(_training_side, (rendezvous_port(), str(tmp_path)), 2)
    trained = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    cfg = debug_config()
    ddr_gb = node_memory_bytes() // 2 / GB  # the node's memory, shared by its two ranks
    cluster = given_cluster(cfg, 2, "cpu", 0.0, ddr_gb, 2)
    assert trained[0] == trained[1]
    assert trained[0]["cluster"] == asdict(cluster)
    assert trained[0]["cluster"]["batch_size"] == 256  # data.batch_size rows per rank, not TorchRec's 512
    assert trained[0]["topology"] == json.loads(json.dumps(topology_fields(cluster.topology())))
    assert trained[0]["plan"] == table_placement(plan_cluster(cfg, 2, "cpu", 0.0, ddr_gb, 2).plan)


def test_criteo_1tb_with_adagrad_plans_on_8_gpus_as_training_would():
    """Before one builder, training's planner assumed 32 GB GPUs and 512 rows: it split the
    40M-row tables table-row-wise, where `rankmix plan --hbm-gb 80` kept each whole."""
    from embeddings.sharding import build_plan
    from embeddings.tables import build_embedding_bags

    cfg = load_config(str(REPO / "configs" / "criteo_1tb.toml"), ["--embeddings.optimizer=adagrad"])
    printed = plan_cluster(cfg, 8, "cuda", 80.0, 512.0, 8)
    holder = nn.Module()
    holder.ebc = build_embedding_bags(cfg.features, cfg.embeddings)  # meta device, as training's planner sees it
    trained = build_plan(holder, cfg.embeddings, given_cluster(cfg, 8, "cuda", 80.0, 512.0, 8))
    assert table_placement(trained) == table_placement(printed.plan)
    assert table_placement(trained)["C1"][0] == "table_wise"
