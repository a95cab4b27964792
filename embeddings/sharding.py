"""Sharding plans chosen by name, per-table overrides, and the DistributedModelParallel wrapper.

`embeddings.plan = "auto"` runs TorchRec's planner over `embeddings.sharding_types`; the
other plans apply one sharding type to every table. `embeddings.table_sharding` then
overrides single tables. TorchRec's planner offers no row-wise sharding on CPU, so every
explicit type is built here with TorchRec's own constructors (`table_wise`, `row_wise`,
...), which work on both CPU (gloo) and CUDA (NCCL).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed import sharding_plan as sp
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.types import KernelConfig, PlannerError, TopologyFactory, TrainerConfig
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

from embeddings.managed import managed_modules, managed_plans, managed_sharders
from embeddings.registry import Registry
from embeddings.sparse_config import EmbeddingsConfig
from embeddings.tables import FUSED
from embeddings.torchrec_compat import ReplicateAcrossRanks


@dataclass(frozen=True)
class Cluster:
    """The hardware and batch TorchRec's planner plans for: training measures them
    (trainer/dist.py `job_cluster`), `rankmix plan` is told them; both plan through
    `plan_tables`."""

    world_size: int
    local_world_size: int
    device: str  # "cuda" or "cpu"
    batch_size: int  # rows per rank and step
    hbm_bytes: int | None  # per GPU (unused on CPU); None: TorchRec's default
    ddr_bytes: int | None  # host memory per rank; None: TorchRec's default

    def topology(self) -> Topology:
        """TorchRec's Topology of these facts (through its factory, which checks them)."""
        return TopologyFactory.create_topology(
            TrainerConfig(world_size=self.world_size, local_world_size=self.local_world_size,
                          hbm_cap_bytes=self.hbm_bytes, ddr_cap_bytes=self.ddr_bytes),
            kernel_config=KernelConfig(compute_device=self.device))


class NoPlanError(ValueError):
    """TorchRec's planner found no plan for `cluster`: one line naming the batch, which its
    memory estimate grows with; `details` is the planner's own account (`rankmix plan` prints it)."""

    def __init__(self, details: str, cluster: Cluster):
        super().__init__(f"TorchRec's planner found no plan for {cluster.world_size} x {cluster.device} with "
                         f"{cluster.batch_size} rows per rank and step (data.batch_size, or data.global_batch_size "
                         f"over the ranks): {details.splitlines()[0].strip()} `rankmix plan` shows the details")
        self.details = details


PLANS: Registry[Callable[[nn.Module, EmbeddingsConfig, Cluster], ShardingPlan]] = \
    Registry("embeddings.plan")


_EC_KINDS = {"table_row_wise": "row_wise", "table_column_wise": "column_wise"}
"""Sharding types TorchRec's EmbeddingCollection lacks -> the nearest it has (an attended
sequence's table under such a plan)."""


def table_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's collections of plain tables and their paths: its EmbeddingBagCollection (not
    those inside the managed-collision collections, which have plans of their own), then its
    EmbeddingCollection of attended sequences' tables; either may be absent."""
    inside = [name + "." for name, _ in managed_modules(model)]
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection))
             and not any(name.startswith(prefix) for prefix in inside)]
    found.sort(key=lambda nm: isinstance(nm[1], EmbeddingCollection))
    assert len(found) <= 2 and len({type(m) for _, m in found}) == len(found), \
        f"expected one collection of each kind, found {[type(m).__name__ for _, m in found]}"
    return found


def configs_of(module: nn.Module) -> list:
    """The table configs of an EmbeddingBagCollection or an EmbeddingCollection."""
    return module.embedding_bag_configs() if isinstance(module, EmbeddingBagCollection) else module.embedding_configs()


def _sharder(module: nn.Module):
    bags = isinstance(module, EmbeddingBagCollection)
    return EmbeddingBagCollectionSharder() if bags else EmbeddingCollectionSharder()


def _weight(module: nn.Module, table: str) -> torch.Tensor:
    tables = module.embedding_bags if isinstance(module, EmbeddingBagCollection) else module.embeddings
    return tables[table].weight


def _kind(module: nn.Module, kind: str) -> str:
    return kind if isinstance(module, EmbeddingBagCollection) else _EC_KINDS.get(kind, kind)


@PLANS.register("auto")
def planner_plan(model: nn.Module, cfg: EmbeddingsConfig, cluster: Cluster) -> ShardingPlan:
    """TorchRec's planner over the plain tables. It sees the model without its managed
    tables: those are row-wise on every rank whatever it would choose, and counted as whole
    tables they would crowd one rank out. The dense modules stay, since the planner reserves
    memory for them."""
    if not table_modules(model):
        return ShardingPlan({})
    unmanaged = nn.Module()
    for name, child in model.named_children():
        if not isinstance(child, BaseManagedCollisionEmbeddingCollection):
            unmanaged.add_module(name, child)
    return plan_tables(unmanaged, list(cfg.sharding_types), cluster)


def plan_tables(model: nn.Module, kinds: list[str], cluster: Cluster,
                callbacks: Sequence[Callable] = ()) -> ShardingPlan:
    """TorchRec's planner's plan of the model's table collections for `cluster`, with `kinds` of
    sharding (those an EmbeddingCollection has, for its tables) and the fused kernel: training's
    plan and `rankmix plan`'s. In a job it runs collectively, so that every rank gets the same
    plan; `callbacks` see the chosen sharding options."""
    constraints = {}
    for _, module in table_modules(model):
        allowed = list(dict.fromkeys(_kind(module, k) for k in kinds))
        constraints |= {t.name: ParameterConstraints(sharding_types=allowed, compute_kernels=[FUSED])
                        for t in configs_of(module)}
    planner = EmbeddingShardingPlanner(topology=cluster.topology(), batch_size=cluster.batch_size,
                                       constraints=constraints, callbacks=list(callbacks))
    plan = _plan_on_rank_0(planner, model, [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()], cluster)
    _whole_tables_as_table_wise(plan, model, cluster)
    return plan


def _plan_on_rank_0(planner: EmbeddingShardingPlanner, model: nn.Module, sharders: list,
                    cluster: Cluster) -> ShardingPlan:
    """`planner`'s plan, made on rank 0 and broadcast in a job, as its `collective_plan` does,
    except that rank 0 sends its failure too: TorchRec's leaves the other ranks waiting in the
    broadcast (until the job's timeout, or until rank 0's connection closes, in a traceback).
    Every rank then raises the same NoPlanError line; a planner bug is rank 0's traceback and
    one RuntimeError line on the others."""
    job = dist.is_initialized() and dist.get_world_size() > 1
    outcome: list = [None]  # [(plan, the planner's refusal, a bug's line)], one of the three set
    bug = None
    if not job or dist.get_rank() == 0:
        try:
            outcome = [(planner.plan(model, sharders), None, None)]
        except PlannerError as e:
            outcome = [(None, str(e).strip(), None)]
        except Exception as e:
            lines = str(e).strip().splitlines()
            bug, outcome = e, [(None, None, f"{type(e).__name__}: {lines[0] if lines else ''}")]
    if job:
        dist.broadcast_object_list(outcome, src=0)
    plan, refusal, bug_line = outcome[0]
    if bug is not None:
        raise bug
    if refusal is not None:
        raise NoPlanError(refusal, cluster)
    if bug_line is not None:
        raise RuntimeError(f"TorchRec's planner failed on rank 0 ({bug_line}); rank 0's output has its traceback")
    return plan


def _whole_tables_as_table_wise(plan: ShardingPlan, model: nn.Module, cluster: Cluster) -> None:
    """The planner may label a table kept whole on one rank column-wise or
    table-column-wise (one shard; the label varies between runs with cost ties). Call it
    table-wise, which it is: TorchRec's DTensor state dict (async checkpoints) fails on
    column-wise tables absent from some ranks."""
    for path, module in table_modules(model):
        for name, sharding in plan.plan[path].items():
            ranks = set(sharding.ranks or [])
            if sharding.sharding_type != "table_wise" and len(ranks) == 1:
                generator = sp.table_wise(rank=ranks.pop(), compute_kernel=FUSED)
                plan.plan[path][name] = generator(_weight(module, name), cluster.local_world_size,
                                                  cluster.world_size, cluster.device, _sharder(module))


def _explicit(kind: str) -> Callable[[nn.Module, EmbeddingsConfig, Cluster], ShardingPlan]:
    def build(model: nn.Module, cfg: EmbeddingsConfig, cluster: Cluster) -> ShardingPlan:
        return _construct(model, cluster, {t.name: kind for _, m in table_modules(model) for t in configs_of(m)})
    build.__doc__ = f"Every table {kind}."
    return build


for _kind_name in ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"):
    PLANS.register(_kind_name)(_explicit(_kind_name))


def _construct(model: nn.Module, cluster: Cluster, kinds: dict[str, str]) -> ShardingPlan:
    """A plan giving each named table its sharding type (table-wise ones balanced by size, over
    both collections); an EmbeddingCollection's table gets the nearest type it has (`_EC_KINDS`)."""
    world, local = cluster.world_size, cluster.local_world_size
    modules = table_modules(model)
    tables = {t.name: (t, module) for _, module in modules for t in configs_of(module)}
    load = [0] * world
    per_param: dict[int, dict] = {id(module): {} for _, module in modules}
    placed = 0
    for name in sorted(kinds, key=lambda n: -_size(tables[n][0])):  # biggest first, onto the lightest rank
        table, module = tables[name]
        kind = _kind(module, kinds[name])
        if kind == "table_wise":
            rank = min(range(world), key=load.__getitem__)
            load[rank] += _size(table)
            generator = sp.table_wise(rank=rank, compute_kernel=FUSED)
        elif kind == "row_wise":
            generator = sp.row_wise(compute_kernel=FUSED)
        elif kind == "column_wise":
            generator = sp.column_wise(ranks=list(range(world)), compute_kernel=FUSED)
        elif kind == "table_row_wise":
            generator = sp.table_row_wise(host_index=placed % (world // local))
        elif kind == "table_column_wise":
            host = placed % (world // local)
            generator = sp.column_wise(ranks=list(range(host * local, (host + 1) * local)), compute_kernel=FUSED)
        else:
            raise ValueError(f"unknown sharding type {kind!r} for table {name!r}")
        per_param[id(module)][name] = generator
        placed += 1
    return ShardingPlan({path: sp.construct_module_sharding_plan(
        module, per_param_sharding=per_param[id(module)], sharder=_sharder(module), local_size=local,
        world_size=world, device_type=cluster.device) for path, module in modules if per_param[id(module)]})


def build_plan(model: nn.Module, cfg: EmbeddingsConfig, cluster: Cluster) -> ShardingPlan:
    """The configured plan for `cluster` with `embeddings.table_sharding` applied on top."""
    plan = PLANS.get(cfg.plan)(model, cfg, cluster)
    if cfg.table_sharding:
        modules = table_modules(model)
        where = {t.name: path for path, m in modules for t in configs_of(m)}
        if unknown := set(cfg.table_sharding) - set(where):
            raise ValueError(f"embeddings.table_sharding names unknown tables {sorted(unknown)}; the tables are "
                             f"{sorted(where)}")
        # TorchRec's constructor wants every table; keep only the overridden ones' entries.
        kinds = {name: cfg.table_sharding.get(name, "table_wise") for name in where}
        overridden = _construct(model, cluster, kinds).plan
        for name in cfg.table_sharding:
            plan.plan[where[name]][name] = overridden[where[name]][name]
    return plan


def shard_model(model: nn.Module, cfg: EmbeddingsConfig, device: torch.device, cluster: Cluster | None = None,
                output_dtensor: bool = False) -> DistributedModelParallel:
    """Shard the embedding tables by the configured plan; the rest is replicated (DDP).

    `cluster` is what the planner plans for (training's is measured, trainer/dist.py
    `job_cluster`); without one, this job's ranks with TorchRec's default memory and batch.
    `output_dtensor` makes the state dict hold DTensors instead of ShardedTensors, which
    DCP's async_save needs (docs/design.md §4.8)."""
    cluster = cluster or Cluster(dist.get_world_size(), local_world_size(), device.type, BATCH_SIZE, None, None)
    plan = build_plan(model, cfg, cluster)
    plan.plan.update(managed_plans(model, device, cluster.local_world_size, cluster.world_size))
    env = ShardingEnv(dist.get_world_size(), dist.get_rank(), dist.GroupMember.WORLD, output_dtensor=output_dtensor)
    return DistributedModelParallel(model, env=env, device=device, plan=plan,
                                    sharders=[EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder(),
                                              *managed_sharders()],
                                    data_parallel_wrapper=ReplicateAcrossRanks())


def local_shards(value: torch.Tensor) -> list[tuple[torch.Tensor, tuple[int, int]]]:
    """(shard, (row offset, column offset)) for this rank's pieces of a table's weight,
    whether the state dict holds ShardedTensors, DTensors or plain tensors."""
    if isinstance(value, ShardedTensor):
        return [(s.tensor, tuple(s.metadata.shard_offsets)) for s in value.local_shards()]
    if isinstance(value, DTensor):
        local = value.to_local()
        if hasattr(local, "local_shards"):  # TorchRec's LocalShardsWrapper
            return [(t, tuple(o)) for t, o in zip(local.local_shards(), local.local_offsets())]
        raise AssertionError(f"unexpected DTensor layout {type(local).__name__}")
    return [(value, (0, 0))]


def _size(table) -> int:
    return table.num_embeddings * table.embedding_dim


def local_world_size() -> int:
    """Ranks on this host (torchrun's LOCAL_WORLD_SIZE; every rank where nothing says)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
