"""The whole ranking model: sparse lookup -> e_input -> tower -> one logit per task.

It sits above both of its halves, on the floor that composes them (docs/design.md §2): the
tables (`embeddings/`) and the dense side (`dense/`, which reads the feature schema below it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection

from dense.cost import DenseCost, measure_cost
from dense.heads import TaskHeads, build_dense
from dense.layout import InputLayout
from dense.sequence import SequenceInputs, build_sequences
from embeddings.decay import decay_lookups
from embeddings.features import FeatureSpec, shared_sequences, unpooled_features
from embeddings.init import init_embeddings
from embeddings.managed import build_managed_bags, build_managed_sequences
from embeddings.sharding import shard_model
from embeddings.tables import build_embedding_bags, build_sequence_tables
from trainer.config import Config
from trainer.data.batch import Batch
from trainer.dist import job_cluster, reduce_gradients_in_fixed_order


class RankingModel(nn.Module):
    """Batch -> logits [B, K]. `ebc`, the plain tables, and `managed_tables`, the managed-collision
    tables fed by `batch.managed_ids` (each None when there are none), are sharded by DMP; the
    rest is replicated (DDP).

    `sequence_tables`, the attended sequences' tables (an EmbeddingCollection fed by
    `batch.sequence_ids`, also sharded by DMP), and `managed_sequence_tables`, those of them that
    are managed (a ManagedCollisionEmbeddingCollection fed by `batch.managed_sequence_ids`), feed
    `sequences` (dense/sequence.py), which pads them to the batch's longest and runs each sequence
    module (each None when there are none).

    `autocast_dtype` runs the tower and heads under autocast (weights stay fp32) for
    `autocast_device`, the type of the device the model runs on. `embedding_decay`
    (embeddings.weight_decay) puts an L2 penalty on the pooled lookups' gradient (embeddings/decay.py).
    `shared_bags`: the pooled sequences a request's rows share (data.request_column), read from
    its holder row (`Batch.request_holders`).
    """

    def __init__(self, ebc: EmbeddingBagCollection | None, layout: InputLayout, tower: nn.Module, heads: TaskHeads,
                 autocast_dtype: torch.dtype | None = None, autocast_device: str = "cpu",
                 managed_tables: nn.Module | None = None, sequence_tables: nn.Module | None = None,
                 sequences: SequenceInputs | None = None, managed_sequence_tables: nn.Module | None = None,
                 embedding_decay: float = 0.0, shared_bags: tuple[str, ...] = ()):
        super().__init__()
        self.shared_bags = shared_bags
        self.embedding_decay = embedding_decay
        self.ebc = ebc
        self.managed_tables = managed_tables
        self.sequence_tables = sequence_tables
        self.managed_sequence_tables = managed_sequence_tables
        self.sequences = sequences
        self.layout = layout
        self.tower = tower
        self.heads = heads
        self.autocast_dtype = autocast_dtype
        self.autocast_device = autocast_device

    def forward(self, batch: Batch) -> torch.Tensor:
        pooled = self.pooled(batch)
        if self.autocast_dtype is None:
            return self.heads(self.tower(self.e_input(pooled, batch)))
        # The device type given at construction rather than e_input.device: TorchRec's
        # pipeline traces this forward symbolically, where e_input is a proxy.
        with torch.autocast(self.autocast_device, dtype=self.autocast_dtype):
            return self.heads(self.tower(self.e_input(pooled, batch))).float()

    def e_input(self, pooled: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
        """[B, E]: the bags' vectors, the sequence modules' (under autocast, where they run) and
        the numeric features."""
        request = None if batch.request_holders is None else (batch.request_holders, batch.request_index)
        if request is not None and self.shared_bags:  # the bags of a request's sequences: at its holder row
            rows = request[0].index_select(0, request[1])
            pooled.update({name: pooled[name].index_select(0, rows) for name in self.shared_bags})  # traced: in place
        if self.sequences is not None:
            pooled.update(self.sequences(pooled, self.unpooled(batch), batch.sequence_max, batch.sequence_gaps,
                                         request))
        return self.layout.assemble(pooled, batch.dense)

    def unpooled(self, batch: Batch) -> dict:
        """The attended sequences' tables' lookups by feature name (JaggedTensors of [N_f, D] rows),
        from the plain and the managed collection. Merged in place, as `pooled`'s."""
        if self.managed_sequence_tables is None:
            return self.sequence_tables(batch.sequence_ids)
        managed = self.managed_sequence_tables(batch.managed_sequence_ids)[0]
        if self.sequence_tables is None:
            return managed
        looked_up = self.sequence_tables(batch.sequence_ids)
        looked_up.update(managed)
        return looked_up

    def pooled(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Every sparse feature's pooled embedding [B, D_f] by name (the key order is the plan's),
        from the plain and the managed tables. Merged in place: TorchRec's pipeline traces
        forward, and a traced dict cannot be unpacked."""
        pooled = {} if self.ebc is None else decay_lookups(self.ebc(batch.sparse), self.embedding_decay).to_dict()
        if self.managed_tables is not None:
            managed = decay_lookups(self.managed_tables(batch.managed_ids)[0], self.embedding_decay).to_dict()
            if self.ebc is None:
                pooled = managed
            else:
                pooled.update(managed)
        return pooled


def shared_bags(features: list[FeatureSpec]) -> tuple[str, ...]:
    """The pooled sequences (bags of the EmbeddingBagCollection, managed or not) a request's rows share:
    read from the holder row where a batch has requests (data.request_column)."""
    unpooled = {f.name for f in unpooled_features(features)}
    return tuple(f.name for f in shared_sequences(features) if f.name not in unpooled)


def build_model(cfg: Config, autocast_dtype: torch.dtype | None = None, device_type: str = "cpu") -> RankingModel:
    """The unsharded model of `cfg`: embedding tables on the meta device, tower, heads; it
    will run on a device of `device_type` (autocast's)."""
    layout, tower, heads = build_dense(cfg.model, cfg.features)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return RankingModel(build_embedding_bags(cfg.features, cfg.embeddings), layout, tower, heads,
                        autocast_dtype=autocast_dtype, autocast_device=device_type,
                        managed_tables=build_managed_bags(cfg.features, cfg.embeddings, buckets=world),
                        sequence_tables=build_sequence_tables(cfg.features, cfg.embeddings),
                        sequences=build_sequences(cfg.features, cfg.model.sequence),
                        managed_sequence_tables=build_managed_sequences(cfg.features, cfg.embeddings, buckets=world),
                        embedding_decay=cfg.embeddings.weight_decay,
                        shared_bags=shared_bags(cfg.features))


def build_sharded_model(cfg: Config, device: torch.device, batch_size: int,
                        autocast_dtype: torch.dtype | None) -> tuple[nn.Module, DenseCost]:
    """The training model of `cfg` on `device`: built, its dense cost measured (on the CPU, before
    it moves), sharded for this job's cluster (collective), its tables filled plan-independently,
    and its gradients reduced in a fixed order."""
    model = build_model(cfg, autocast_dtype, device.type)
    cost = measure_cost(model.tower, model.heads, model.layout.width, torch.device("cpu"))
    sharded = shard_model(model, cfg.embeddings, device, job_cluster(device, batch_size),
                          output_dtensor=cfg.checkpoint.async_save)
    init_embeddings(sharded, cfg.train.seed)
    reduce_gradients_in_fixed_order(sharded)
    return sharded, cost
