"""Sharding plans chosen by name, and the DistributedModelParallel wrapper."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec import EmbeddingBagCollection
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingPlan

from trainer.config import EmbeddingsConfig
from trainer.registry import Registry

PLANS: Registry[Callable[[nn.Module, EmbeddingsConfig, torch.device], ShardingPlan]] = \
    Registry("embeddings.plan")


@PLANS.register("auto")
def planner_plan(model: nn.Module, cfg: EmbeddingsConfig, device: torch.device) -> ShardingPlan:
    """TorchRec's planner, run collectively so that every rank gets the same plan."""
    topology = Topology(world_size=dist.get_world_size(), compute_device=device.type)
    constraints = {
        table.name: ParameterConstraints(sharding_types=list(cfg.sharding_types),
                                         compute_kernels=[EmbeddingComputeKernel.FUSED.value])
        for table in _tables(model)}
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    return planner.collective_plan(model, None, dist.GroupMember.WORLD)


def _tables(model: nn.Module) -> list:
    return [t for m in model.modules() if isinstance(m, EmbeddingBagCollection)
            for t in m.embedding_bag_configs()]


def shard_model(model: nn.Module, cfg: EmbeddingsConfig, device: torch.device) -> DistributedModelParallel:
    """Shard the embedding tables by the configured plan; the rest is replicated (DDP)."""
    plan = PLANS.get(cfg.plan)(model, cfg, device)
    return DistributedModelParallel(model, device=device, plan=plan)
