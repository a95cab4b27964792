"""`rankmix plan`: does a config fit a cluster? Answered before anything is submitted.

TorchRec's planner shards the config's tables for `world_size` devices of the given memory,
on the meta device (no table is allocated), with the config's sharding types and fused
kernel; an explicit `embeddings.plan` or `embeddings.table_sharding` gets training's own
constructed plan (`build_plan`) instead. Per rank this reports the table bytes and the fused
optimizer's state (Adagrad: one accumulator per weight; row-wise Adagrad: one per row),
TorchRec's own storage estimate (tables, optimizer, input and output buffers; a constructed
plan's is its weights and optimizer state), the replicated dense tower with its gradient and
RMSProp state, and the all-to-all bytes of one step.

Host memory. Per rank it also counts what the host holds besides the planned shards
(`host_memory`): the runtime (torch and TorchRec loaded), the init's row blocks
(embeddings/init.py), the training reader's buffers (trainer/data/reader.py, Memory),
evaluation's fixed state and its reader (trainer/metrics/streaming.py), with
`checkpoint.async_save` DCP's staged copy of the rank's state, and a resume's load: it reads
rows straight into a CPU rank's tensors and through a buffer of up to 64 MiB into a GPU's
(trainer/checkpoint/views.py `read_rows`; a checkpoint whose shards split the columns
otherwise than this plan's is read a saved shard at a time, whole, which is not counted). A
save makes no copy of its own: DCP's writer would clone every table shard, all views of
FBGEMM's fused buffers, but is handed them as tensors of their own bytes (`ViewSavePlanner`).
On a CPU rank the shards and the dense state live on the host too, and so do the dense model's
activations (`dense_activations`: training's at the rank's batch, or RMSProp's temporaries, or
evaluation's at its own batch, whichever is larger; training trims its kept heap every fifth
step, and evaluation hands it back and runs in a malloc arena of its own, trainer/dist.py
`trim_heap`, `memory_returned` and `on_own_arena`); a GPU rank's are counted in its HBM. The sum is an upper bound
(the init's blocks are freed before the first read); a node fits when its ranks' sums fit in
local_world_size x --ddr-gb.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torchrec.distributed.types import ShardingPlan

from dense.cost import activation_bytes
from dense.heads import build_dense
from embeddings.init import BLOCK_ROWS
from embeddings.managed import build_managed_bags, build_managed_sequences, managed_plans
from embeddings.sharding import Cluster, NoPlanError, build_plan, plan_tables
from embeddings.sparse_config import EmbeddingsConfig
from embeddings.tables import build_embedding_bags, build_sequence_tables, sequence_table_configs, table_configs
from embeddings.torchrec_compat import mch_bytes_per_slot, mch_module
from trainer.checkpoint.views import LOAD_CHUNK_BYTES
from trainer.config import Config, per_rank_batch_size
from trainer.data.assignment import SLICE_ROWS
from trainer.data.datasets import declared_features
from trainer.data.encode import RowEncoder
from trainer.data.reader import DECODE_AHEAD, PREFETCH_BATCHES, READ_BUFFER
from trainer.metrics.streaming import BUCKET_ROWS, LIFETIME_BINS
from trainer.precision import autocast_dtype

GB = 2**30
RUNTIME_BYTES = 2**29
"""A rank's interpreter with torch, TorchRec and FBGEMM loaded: 0.41 GB RSS measured on the CPU stack,
plus gloo's buffers and the model's Python objects."""


@dataclass
class RankMemory:
    """One rank's bytes."""

    tables: int
    optimizer: int
    estimate: int  # TorchRec's storage estimate of the rank's planned shards (HBM + DDR), plus managed shards
    id_maps: int = 0  # managed tables' MCH buffers (sorted ids, rows, eviction metadata)
    largest: int = 0  # the rank's largest shard tensor: a table shard's weights or its optimizer state


@dataclass
class HostMemory:
    """One rank's bytes of host memory (`host_memory`)."""

    resident: int  # the planned shards and the dense state, on a CPU rank; 0 on a GPU rank
    init: int
    reader: int
    evaluation: int
    async_save: int
    load: int = 0  # a resume's transient copy: a GPU rank's load buffer
    activations: int = 0  # the dense model's activations at its larger phase, on a CPU rank

    @property
    def total(self) -> int:
        return (RUNTIME_BYTES + self.resident + self.init + self.reader + self.evaluation + self.async_save
                + self.load + self.activations)


@dataclass
class ClusterPlan:
    """What `rankmix plan` prints (`text`), and the plan and per-rank bytes behind it."""

    text: str
    memory: list[RankMemory]
    fits: bool
    plan: ShardingPlan
    host: list[HostMemory] = field(default_factory=list)


def given_cluster(cfg: Config, world_size: int, device: str, hbm_gb: float, ddr_gb: float,
                  local_world_size: int) -> Cluster:
    """The Cluster of `rankmix plan`'s options: what training measures, told instead."""
    if world_size < 1 or world_size % local_world_size:
        raise ValueError(f"--world-size {world_size} is not a multiple of --local-world-size {local_world_size}")
    if device == "cuda" and not hbm_gb:
        raise ValueError("--device cuda needs --hbm-gb (memory per GPU)")
    return Cluster(world_size, local_world_size, device, per_rank_batch_size(cfg, world_size),
                   int(hbm_gb * GB) if device == "cuda" else 0, int(ddr_gb * GB))


def plan_cluster(cfg: Config, world_size: int, device: str, hbm_gb: float, ddr_gb: float,
                 local_world_size: int) -> ClusterPlan:
    """The plan, per-rank memory, all-to-all traffic and the verdict."""
    cluster = given_cluster(cfg, world_size, device, hbm_gb, ddr_gb, local_world_size)
    cfg = replace(cfg, features=declared_features(cfg))  # the caller's config unchanged
    if not cfg.features:
        raise ValueError("features is empty: give the config's [[features]] schema")
    batch = cluster.batch_size
    plan, options = ShardingPlan({}), []
    ebc = build_embedding_bags(cfg.features, cfg.embeddings)  # meta device; None when every table is managed
    ec = build_sequence_tables(cfg.features, cfg.embeddings)  # attended sequences' tables, unpooled
    if ebc is not None or ec is not None:
        holder = nn.Module()
        holder.ebc = ebc
        holder.sequence_tables = ec  # training's attribute names: the plan's module paths
        try:
            with _quiet_torchrec():
                if cfg.embeddings.plan == "auto" and not cfg.embeddings.table_sharding:
                    # the callback keeps the chosen sharding options (per-shard sizes and storage), which the plan omits
                    plan = plan_tables(holder, list(cfg.embeddings.sharding_types), cluster, [_keeping(options)])
                else:  # training's own plan: TorchRec's constructors, which the planner lacks on CPU (row-wise)
                    plan = build_plan(holder, cfg.embeddings, cluster)
        except NoPlanError as e:
            return ClusterPlan(f"fits: no (TorchRec's planner found no plan)\n{e.details}", [], False, plan)
    memory = _rank_memory(options, world_size, cfg.embeddings)
    if not options:
        for path in ("ebc", "sequence_tables"):
            for sharding in plan.plan.get(path, {}).values():
                _add_shards(memory, sharding.sharding_spec.shards, cfg.embeddings)
    managed_text = _add_managed_tables(cfg, memory, device, local_world_size)
    layout, tower, heads = build_dense(cfg.model, cfg.features)
    dense_params = sum(p.numel() for m in (tower, heads) for p in m.parameters())
    # weights, gradients and RMSProp's square average (plus its momentum buffer when used), fp32
    dense = dense_params * 4 * (3 + (cfg.optim.momentum > 0))
    capacity = (hbm_gb if device == "cuda" else ddr_gb) * GB
    lines = [f"{world_size} x {device} ({local_world_size} per host), "
             + (f"HBM {hbm_gb:g} GB, " if device == "cuda" else "") + f"DDR {ddr_gb:g} GB each; "
             f"{batch} rows per rank and step", *(["", str(plan)] if plan.plan else []), *managed_text, "",
             f"{'rank':>4} {'tables GB':>10} {'optimizer GB':>13} {'id maps GB':>11} {'dense GB':>9} "
             f"{'estimate GB':>12} {'free GB':>8}"]
    for rank, m in enumerate(memory):
        lines.append(f"{rank:>4} {m.tables / GB:>10.3f} {m.optimizer / GB:>13.3f} {m.id_maps / GB:>11.3f} "
                     f"{dense / GB:>9.3f} {m.estimate / GB:>12.3f} {(capacity - m.estimate - dense) / GB:>8.2f}")
    pooled, ids = _all_to_all_bytes(table_configs(cfg.features), batch, world_size)
    unpooled = _unpooled_bytes(cfg, batch, world_size)
    lines += ["", f"all-to-all per rank and step: pooled embeddings {pooled / 2**20:.1f} MB forward and "
              f"{pooled / 2**20:.1f} MB backward; ids at least {ids / 2**20:.2f} MB"
              + (f"; attended sequences' rows at most {unpooled / 2**20:.1f} MB each way" if unpooled else ""),
              f"dense tower and heads: {dense_params:,} parameters, replicated"]
    largest_dense = max((p.numel() * 4 for m in (tower, heads) for p in m.parameters()), default=0)
    training, evaluation = dense_activations(cfg, nn.Sequential(tower, heads), layout.width, batch, device)
    activations = max(training, evaluation)  # the phases take turns; their peaks do not add
    lines.append(f"dense activations per rank: training {training / GB:.3f} GB at {batch} rows, evaluation "
                 f"{evaluation / GB:.3f} GB at {cfg.data.eval_batch_size} rows (the larger is counted)")
    host = host_memory(cfg, memory, dense, dense_params, device, batch, largest_dense,
                       activations if device == "cpu" else 0)
    lines += ["", *_host_lines(host)]
    worst = max(m.estimate for m in memory) + dense + activations
    node, node_bytes = _fullest_node(host, local_world_size)
    node_capacity = local_world_size * ddr_gb * GB
    fits = worst <= capacity and node_bytes <= node_capacity
    if worst > capacity:
        lines.append(f"fits: no (fullest rank {worst / GB:.2f} GB of {capacity / GB:g} GB)")
    elif node_bytes > node_capacity:
        lines.append(f"fits: no (host memory: node {node}'s {local_world_size} ranks need {node_bytes / GB:.2f} GB "
                     f"of {local_world_size} x {ddr_gb:g} GB)")
    else:
        lines.append(f"fits: yes (fullest rank {worst / GB:.2f} GB of {capacity / GB:g} GB; host memory: fullest "
                     f"node {node_bytes / GB:.2f} GB of {node_capacity / GB:g} GB)")
    return ClusterPlan("\n".join(lines), memory, fits, plan, host)


def dense_activations(cfg: Config, model: nn.Module, width: int, batch: int, device: str) -> tuple[int, int]:
    """(training, evaluation) bytes of the dense model's activations on a rank: forward and
    backward at the rank's batch, the forward alone at data.eval_batch_size, each in the step's
    precision on `device` (dense/cost.py `activation_bytes`: measured on fake tensors). Training's
    are at least RMSProp's temporaries, which its step makes once the activations are gone."""
    precision = autocast_dtype(cfg.train.mixed_precision, torch.device(device))
    return (max(activation_bytes(model, width, batch, True, precision), rmsprop_temporaries(cfg, model)),
            activation_bytes(model, width, cfg.data.eval_batch_size, False, precision))


def rmsprop_temporaries(cfg: Config, model: nn.Module) -> int:
    """Bytes of the parameter-sized tensors torch's foreach RMSProp makes within its step: the
    square average's root, and the gradient plus the decayed weight when a weight decay is set
    (optim.weight_decay or a part's: counted for every parameter, an upper bound)."""
    params = sum(p.numel() for p in model.parameters()) * 4
    o = cfg.optim
    return params * (1 + (max(o.weight_decay, o.tokenizer_weight_decay, o.sequence_weight_decay) > 0))


def host_memory(cfg: Config, memory: list[RankMemory], dense: int, dense_params: int, device: str,
                batch: int, largest_dense: int = 0, activations: int = 0) -> list[HostMemory]:
    """Each rank's host bytes besides the runtime (module docstring, Host memory); `dense`: the
    dense state's bytes, gradients included; `largest_dense`: the largest dense parameter's;
    `activations`: the dense model's at its larger phase, on a CPU rank (a GPU's are in HBM)."""
    row = row_bytes(cfg)
    widest = max((f.embedding_dim for f in cfg.features if f.kind != "numeric"), default=0)
    init = 2 * BLOCK_ROWS * widest * 4  # a block's fp32 draw and its scaled copy (embeddings/init.py `_block`)
    # the window being consumed, the next one and its encoded pieces while they are concatenated,
    # the slice being encoded and DECODE_AHEAD decoded after it, the batch being assembled (and
    # PREFETCH_BATCHES pinned ones on a GPU rank), a read buffer per column
    window = cfg.data.shuffle_buffer + SLICE_ROWS
    batches = 1 + (PREFETCH_BATCHES if device == "cuda" else 0)
    columns = RowEncoder(cfg.features, cfg.model.tasks, cfg.data.user_column, cfg.data.time_column,
                         request_column=cfg.data.request_column).columns
    reader = (3 * window + (1 + DECODE_AHEAD) * SLICE_ROWS + batches * batch) * row + READ_BUFFER * len(columns)
    evaluation = evaluation_bytes(cfg, batch, row)
    out = []
    for m in memory:
        resident = m.estimate + dense if device == "cpu" else 0
        # a checkpoint holds no gradients
        staged = m.tables + m.optimizer + m.id_maps + dense - dense_params * 4 if cfg.checkpoint.async_save else 0
        # a load reads rows straight into a CPU rank's tensors; a GPU rank's go through a buffer
        buffer = min(max(m.largest, largest_dense), LOAD_CHUNK_BYTES) if device == "cuda" else 0
        out.append(HostMemory(resident, init, reader, evaluation, staged, buffer, activations))
    return out


def row_bytes(cfg: Config) -> int:
    """Bytes of one encoded row (trainer/data/batch.py `Rows`): an int64 id per `id` feature,
    max_len int64 ids and an int64 offset per list feature (one id when max_len is 0: the plan
    cannot know the data's lengths), float32 numeric features and labels, an int64 user."""
    ids = sum(8 if f.kind == "id" else 8 * max(f.max_len, 1) + 8 for f in cfg.features if f.kind != "numeric")
    numeric = 4 * sum(f.kind == "numeric" for f in cfg.features)
    return ids + numeric + 4 * len(cfg.model.tasks) + (8 if cfg.data.user_column else 0)


def evaluation_bytes(cfg: Config, batch: int, row: int) -> int:
    """Evaluation's fixed state: `SplitMetrics`' float64 histograms, UAUC's bucket of rows with
    the sort's copies, the training window's histogram codes, and the evaluation reader
    (unshuffled: windows of one slice; the window, the next one, the slice being encoded and
    DECODE_AHEAD decoded after it)."""
    tasks = len(cfg.model.tasks)
    histograms = tasks * 2 * LIFETIME_BINS * 8
    uauc = 3 * BUCKET_ROWS * (8 + 8 * tasks) if cfg.data.user_column else 0
    window = cfg.metrics.window_batches * batch * tasks * 8
    return histograms + uauc + window + ((3 + DECODE_AHEAD) * SLICE_ROWS + cfg.data.eval_batch_size) * row


def _host_lines(host: list[HostMemory]) -> list[str]:
    """The per-rank table of host memory."""
    lines = [f"host memory per rank (host GB: the sum, with the runtime's {RUNTIME_BYTES / GB:.3f} GB of torch "
             "and TorchRec)",
             f"{'rank':>4} {'resident GB':>12} {'init GB':>8} {'reader GB':>10} {'eval GB':>8} "
             f"{'async save GB':>14} {'load GB':>8} {'activations GB':>15} {'host GB':>8}"]
    for rank, h in enumerate(host):
        lines.append(f"{rank:>4} {h.resident / GB:>12.3f} {h.init / GB:>8.3f} {h.reader / GB:>10.3f} "
                     f"{h.evaluation / GB:>8.3f} {h.async_save / GB:>14.3f} {h.load / GB:>8.3f} "
                     f"{h.activations / GB:>15.3f} {h.total / GB:>8.3f}")
    return lines


def _fullest_node(host: list[HostMemory], local_world_size: int) -> tuple[int, int]:
    """(node, bytes) of the node whose ranks (local_world_size consecutive ones) need the most host memory."""
    nodes = [sum(h.total for h in host[i:i + local_world_size]) for i in range(0, len(host), local_world_size)]
    node = max(range(len(nodes)), key=nodes.__getitem__)
    return node, nodes[node]


def _keeping(options: list) -> Callable[[list], list]:
    """A planner callback that copies the plan's sharding options into `options` and passes
    them on unchanged."""
    def keep(chosen: list) -> list:
        options.extend(chosen)
        return chosen
    return keep


def _rank_memory(options: list, world_size: int, cfg: EmbeddingsConfig) -> list[RankMemory]:
    """Bytes per rank from the planner's chosen sharding options."""
    memory = [RankMemory(0, 0, 0) for _ in range(world_size)]
    for option in options:
        for shard in option.shards:
            m = memory[shard.rank]
            tables, optimizer = _shard_bytes(*shard.size, cfg)
            m.tables, m.optimizer = m.tables + tables, m.optimizer + optimizer
            m.largest = max(m.largest, tables, optimizer)
            m.estimate += shard.storage.hbm + shard.storage.ddr
    return memory


def _shard_bytes(rows: int, cols: int, cfg: EmbeddingsConfig) -> tuple[int, int]:
    """(table, optimizer) bytes of a shard of rows x cols (the optimizer state is fp32)."""
    weight_bytes = {"fp32": 4, "fp16": 2}[cfg.data_type]
    return rows * cols * weight_bytes, rows * 4 * (1 if cfg.optimizer == "rowwise_adagrad" else cols)


def _add_managed_tables(cfg: Config, memory: list[RankMemory], device: str, local_world_size: int) -> list[str]:
    """Add the managed tables' shards to `memory` (TorchRec's planner does not plan them: they are
    row-wise, as training shards them, embeddings/managed.py) and return their lines of the plan.
    A shard's estimate is its weights, optimizer state and MCH map; MCH's id history (ids of
    one eviction interval, allocated at the first step) is not counted."""
    world_size = len(memory)
    holder = nn.Module()  # training's attribute names: the plan's module paths; meta device
    holder.managed_tables = build_managed_bags(cfg.features, cfg.embeddings, buckets=world_size)
    holder.managed_sequence_tables = build_managed_sequences(cfg.features, cfg.embeddings, buckets=world_size)
    plans = managed_plans(holder, torch.device(device), local_world_size, world_size)
    if not plans:
        return []
    lines = ["", "managed table | sharding type | rows per rank"]
    for path, table, sharding in [(path, t, s) for path, tables in plans.items() for t, s in tables.items()]:
        per_row = mch_bytes_per_slot(mch_module(getattr(holder, path), table))
        _add_shards(memory, sharding.sharding_spec.shards, cfg.embeddings, per_row)
        sizes = [s.shard_sizes[0] for s in sharding.sharding_spec.shards]
        lines.append(f"{table} | row_wise | "
                     + (f"{len(sizes)} x {sizes[0]:,}" if len(set(sizes)) == 1 else str(sizes)))
    return lines


def _add_shards(memory: list[RankMemory], shards: list, cfg: EmbeddingsConfig, id_map_row: int = 0) -> None:
    """Add shards of a constructed plan (TorchRec's ShardMetadata) to `memory`: their weights,
    optimizer state and, for a managed table, `id_map_row` bytes of MCH map a row."""
    for shard in shards:
        rows, cols = shard.shard_sizes
        m = memory[shard.placement.rank()]
        tables, optimizer = _shard_bytes(rows, cols, cfg)
        m.tables, m.optimizer, m.id_maps = m.tables + tables, m.optimizer + optimizer, m.id_maps + rows * id_map_row
        m.largest = max(m.largest, tables, optimizer)
        m.estimate += tables + optimizer + rows * id_map_row


def _all_to_all_bytes(tables: list, batch: int, world_size: int) -> tuple[int, int]:
    """(pooled-embedding bytes, id bytes) a rank exchanges per step: each of its rows needs every
    feature's pooled vector, of which the shards on other ranks hold (W-1)/W on balance."""
    remote = (world_size - 1) / world_size
    dims = sum(t.embedding_dim * len(t.feature_names) for t in tables)
    id_features = sum(len(t.feature_names) for t in tables)
    return int(batch * dims * 4 * remote), int(batch * id_features * 8 * remote)


def _unpooled_bytes(cfg: Config, batch: int, world_size: int) -> int:
    """Bytes of the rows an EmbeddingCollection returns per step at most (every bag at max_len): one
    vector per id of each feature on an attended sequence's table (embeddings/tables.py)."""
    remote = (world_size - 1) / world_size
    return int(sum(batch * max(f.max_len, 1) * f.embedding_dim * 4 * remote
                   for t in sequence_table_configs(cfg.features) for f in cfg.features if f.name in t.feature_names))


@contextlib.contextmanager
def _quiet_torchrec():
    """The planner's advice to its own developers (the storage reservation's dry-run caveats)
    is not the user's to act on; the training path silences it the same way."""
    logger = logging.getLogger("torchrec")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        logger.setLevel(level)
