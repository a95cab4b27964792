"""Every private member of TorchRec and FBGEMM that rankmix reads or overrides, and every
subclass of their classes, in one module (docs/design.md §4.25).

A TorchRec upgrade that renames one of them would break at run time, one path at a time.
`PRIVATE_MEMBERS` lists them with the reason the public API is not enough, and
`tests/test_torchrec_compat.py` checks that each still exists in the installed TorchRec and
that no other product module reaches past the public API. The rest of rankmix uses the
classes, accessors and names below.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.mc_embedding import (
    ManagedCollisionEmbeddingCollectionSharder,
    ShardedManagedCollisionEmbeddingCollection,
)
from torchrec.distributed.mc_embedding_modules import BaseShardedManagedCollisionEmbeddingCollection
from torchrec.distributed.mc_embeddingbag import (
    ManagedCollisionEmbeddingBagCollectionSharder,
    ShardedManagedCollisionEmbeddingBagCollection,
)
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingEnv
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import ManagedCollisionCollection, MCHManagedCollisionModule


class Private(NamedTuple):
    """A private member of a TorchRec class that rankmix relies on, and why."""

    owner: type
    name: str  # a name ending in "_" is the prefix of a family of buffers
    why: str


_MCH, _MC = MCHManagedCollisionModule, BaseManagedCollisionEmbeddingCollection
_SHARDED_MC = BaseShardedManagedCollisionEmbeddingCollection  # of bags and of unpooled tables alike

PRIVATE_MEMBERS: tuple[Private, ...] = (
    Private(_MCH, "_current_iter", "rankmix sets it at the first step after a resume, to keep evictions on multiples "
                                  "of the interval; MCH has no public setting for its schedule"),
    Private(_MCH, "_last_eviction_iter", "rankmix sets it with _current_iter, for the same reason"),
    Private(_MCH, "_current_iter_tensor", "rankmix reads the loaded iteration from it at that first step"),
    Private(_MCH, "_eviction_interval", "rankmix reads it to find the last multiple of the interval; only the "
                                       "constructor takes it"),
    Private(_MCH, "_output_global_offset", "rankmix reads it for the shard's miss row, to count miss-row lookups; "
                                          "no public accessor"),
    Private(_MCH, "_update_and_evict", "rankmix overrides it to count the rows an admission takes from other ids: "
                                      "the only step that sees the map before and after"),
    Private(_MCH, "_evicted", "rankmix asserts it is clear before an admission, so that each admission's rows are "
                             "counted once"),
    Private(_MCH, "_evicted_emb_indices", "rankmix reads the rows an admission handed out; the public evict() "
                                         "consumes them, and TorchRec's collection must get them"),
    Private(_MCH, "_name", "rankmix reads the table's name for its metric names; only the constructor takes it"),
    Private(_MCH, "_mch_sorted_raw_ids", "rankmix counts occupied slots in it, and reads it from checkpoints for the "
                                        "serving id map"),
    Private(_MCH, "_mch_remapped_ids_mapping", "rankmix reads each id's row from checkpoints for the serving id map"),
    Private(_MCH, "_output_segments_tensor", "rankmix reads each rank's row range from checkpoints for the serving "
                                            "id map's miss rows"),
    Private(_MCH, "_mch_", "rankmix plan counts the bytes of the per-slot buffers (id map, eviction metadata) by "
                          "this prefix"),
    Private(_MC, "_embedding_module", "rankmix reads the table configs for the row-wise plan, and the state-dict "
                                     "path of the weights; no public accessor"),
    Private(_MC, "_managed_collision_collection", "rankmix reaches the MCH modules and their state-dict path "
                                                 "through it; no public accessor"),
    Private(ManagedCollisionCollection, "_managed_collision_modules", "rankmix reads each table's MCH module; no "
                                                                      "public accessor"),
    Private(_SHARDED_MC, "_evict", "rankmix overrides it: TorchRec's reset has no CPU kernel and skips exact "
                                  "Adagrad (docs/design.md §4.24)"),
    Private(_SHARDED_MC, "_table_to_tbe_and_index", "rankmix reads each table's FBGEMM kernel and index, to zero the "
                                                   "freed rows' optimizer state"),
    Private(_SHARDED_MC, "_embedding_module", "rankmix reads the sharded tables, to re-initialise freed rows"),
    Private(ShardedEmbeddingBagCollection, "_embedding_shardings", "rankmix reads the order in which the input dist "
                                                                   "takes the features, and has the reader write a "
                                                                   "batch's keys in it: else TorchRec permutes every "
                                                                   "batch, reading its lengths back (a host sync)"),
    Private(ShardedEmbeddingBagCollection, "_table_name_to_config", "rankmix reads each table's init_fn, to "
                                                                    "re-initialise freed rows as TorchRec does"),
    Private(ShardedEmbeddingCollection, "_table_name_to_config", "the same, for a managed attended sequence's table"),
    Private(ManagedCollisionEmbeddingBagCollectionSharder, "_e_sharder", "rankmix's shard() passes it on, as "
                                                                         "TorchRec's does"),
    Private(ManagedCollisionEmbeddingBagCollectionSharder, "_mc_sharder", "rankmix's shard() passes it on, as "
                                                                          "TorchRec's does"),
    Private(ManagedCollisionEmbeddingCollectionSharder, "_e_sharder", "the same, for unpooled managed tables"),
    Private(ManagedCollisionEmbeddingCollectionSharder, "_mc_sharder", "the same, for unpooled managed tables"),
    Private(TrainPipelineSparseDist, "_backward", "rankmix overrides it to check the loss before the fused sparse "
                                                  "update (inside backward) and the gradients after; no public hook"),
)

FREE_SLOT = torch.iinfo(torch.int64).max  # MCH's mark of a free slot in its sorted ids

# State-dict paths inside a ManagedCollisionEmbeddingBagCollection (TorchRec's children are
# private attributes, and their names are the keys): its tables' weights, "<table>.weight"
# after MC_WEIGHTS (MC_SEQUENCE_WEIGHTS in a ManagedCollisionEmbeddingCollection); its MCH
# modules' buffers, "<table>.<buffer>" after MCH_BUFFERS (in either).
MC_WEIGHTS = "_embedding_module.embedding_bags."
MC_SEQUENCE_WEIGHTS = "_embedding_module.embeddings."
MCH_BUFFERS = "_managed_collision_collection._managed_collision_modules."
# The MCH buffers that make a table's id map: admitted ids (sorted, free slots last), each
# one's row, and the row ranges of the ranks that trained it ([0, end of rank 0's rows, ...], then -1s).
MCH_SORTED_IDS, MCH_ROWS, MCH_SEGMENTS = "_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_output_segments_tensor"


class CountingMCH(MCHManagedCollisionModule):
    """TorchRec's MCH module that counts the ids it looks up and those that fall on the miss
    row (ids not admitted yet), in training and in evaluation apart, and the rows it evicts
    (taken from one id for another; filling a free row is no eviction), and keeps its
    evictions on multiples of the interval after a resume. MCH exposes none of this, so it
    reads and overrides the private members listed in `PRIVATE_MEMBERS`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("_counts", torch.zeros(2, 3, dtype=torch.int64, device=self.device), persistent=False)

    @property
    def counts(self) -> torch.Tensor:
        """[train | eval] x [lookups, miss-row lookups, rows evicted] of this shard, on its device."""
        return self._counts

    @property
    def table_name(self) -> str:
        """The table's name (MCH takes it in its constructor only, and keeps it private)."""
        return self._name

    def occupied(self) -> torch.Tensor:
        """Slots holding an id, as a 0-d tensor on the module's device."""
        return (self._mch_sorted_raw_ids != FREE_SLOT).sum()

    def profile(self, features):
        if self.training and self._current_iter == -1:  # the first training step since the module was built
            # TorchRec restarts the eviction schedule at the loaded iteration, so after a resume from
            # between evictions no later checkpoint would fall on one. Keep the schedule on multiples
            # of the interval, where an uninterrupted run evicts.
            self._current_iter = int(self._current_iter_tensor.item())
            self._last_eviction_iter = self._current_iter - self._current_iter % self._eviction_interval
        return super().profile(features)

    def remap(self, features, mutate_miss_lengths=True, write_weights=None):
        out = super().remap(features, mutate_miss_lengths, write_weights)
        counts = self._counts[0 if self.training else 1]
        miss_row = self._output_global_offset + self.output_size() - 1  # the shard's last row
        for jagged in out.values():
            counts[0] += jagged.values().numel()
            counts[1] += (jagged.values() == miss_row).sum()
        return out

    def _update_and_evict(self, *args) -> None:
        """TorchRec's admission step, counting the rows taken from other ids: of the slots it
        hands out, those that were not free. Private, but the only step that sees the map
        before and after an admission; the public `evict()` would consume the slots, which
        TorchRec's collection must get to reset their rows."""
        assert not self._evicted, "TorchRec consumes each admission's evictions before the next admission"
        before = self.occupied()
        super()._update_and_evict(*args)
        self._counts[0, 2] += self._evicted_emb_indices.numel() - (self.occupied() - before)


class ResettingEvictions(BaseShardedManagedCollisionEmbeddingCollection):
    """TorchRec's sharded managed-collision tables (of bags, or unpooled: `bagged` says which),
    whose evictions reset the freed rows' optimizer state on every device. TorchRec's own reset
    (FBGEMM's reset_weight_momentum) has no CPU kernel, and it leaves exact Adagrad's
    accumulator alone: a reused row kept the old id's. Here the state is zeroed through the
    kernel's per-table views, in the private step TorchRec calls with each admission's freed
    rows (it has no public hook). A mixin before TorchRec's concrete class, whose context and
    input dist it keeps."""

    def _evict(self, evictions_per_table: dict[str, torch.Tensor | None]) -> None:
        tables = self._embedding_module.embedding_bags if self.bagged else self._embedding_module.embeddings
        for table, rows in evictions_per_table.items():
            if rows is None:
                continue
            rows = rows.long()
            tbe, index = self._table_to_tbe_and_index[table]
            with torch.no_grad():
                for state in tbe.split_optimizer_states()[int(index)]:
                    state[rows] = 0
                weight = tables.get_parameter(f"{table}.weight")
                init = self._embedding_module._table_name_to_config[table].init_fn
                weight.data[rows] = init(weight[rows])


class ResettingBagEvictions(ResettingEvictions, ShardedManagedCollisionEmbeddingBagCollection):
    """`ResettingEvictions` of managed tables of bags."""


class ResettingSequenceEvictions(ResettingEvictions, ShardedManagedCollisionEmbeddingCollection):
    """`ResettingEvictions` of managed attended sequences' tables (unpooled)."""


class ManagedTablesSharder(ManagedCollisionEmbeddingBagCollectionSharder):
    """Shards managed-collision tables of bags as `ResettingBagEvictions`."""

    def shard(self, module, params, env, device=None, module_fqn=None):
        # as TorchRec's own shard(), which builds its own class; the sharders it passes are private
        return ResettingBagEvictions(module, params, ebc_sharder=self._e_sharder, mc_sharder=self._mc_sharder,
                                     env=env, device=device or torch.device("cuda"))


class ManagedSequenceTablesSharder(ManagedCollisionEmbeddingCollectionSharder):
    """Shards managed attended sequences' tables (a ManagedCollisionEmbeddingCollection) as
    `ResettingSequenceEvictions`."""

    def shard(self, module, params, env, device=None, module_fqn=None):
        # as ManagedTablesSharder's
        return ResettingSequenceEvictions(module, params, ec_sharder=self._e_sharder, mc_sharder=self._mc_sharder,
                                          env=env, device=device or torch.device("cuda"))


def input_feature_order(ebc: torch.nn.Module) -> list[str] | None:
    """The feature names in the order the sharded collection `ebc`'s input dist takes them (its
    shardings' features, one sharding after the other); None for an unsharded collection."""
    if not isinstance(ebc, ShardedEmbeddingBagCollection):
        return None
    return [name for sharding in ebc._embedding_shardings for name in sharding.feature_names()]


def mc_table_configs(mc: BaseManagedCollisionEmbeddingCollection) -> list[EmbeddingBagConfig | EmbeddingConfig]:
    """The table configs of a managed-collision collection (whose EmbeddingBagCollection or
    EmbeddingCollection TorchRec keeps private)."""
    tables = mc._embedding_module
    return tables.embedding_bag_configs() if isinstance(tables, EmbeddingBagCollection) else tables.embedding_configs()


def mch_module(mc: BaseManagedCollisionEmbeddingCollection, table: str) -> MCHManagedCollisionModule:
    """The MCH module of one table of a managed-collision collection (TorchRec keeps them
    private)."""
    return mc._managed_collision_collection._managed_collision_modules[table]


def mch_bytes_per_slot(mch: MCHManagedCollisionModule) -> int:
    """Bytes of an MCH module's saved buffers per slot: the id map and the eviction metadata,
    which MCH names `_mch_*` (there is no public list of them)."""
    return sum(b.element_size() for name, b in mch.state_dict().items() if name.startswith("_mch_"))


class SparseDistPipelineWithBackwardHooks(TrainPipelineSparseDist):
    """TorchRec's TrainPipelineSparseDist that calls `before_backward(losses)` and
    `after_backward()` around each backward, where the fused sparse update happens."""

    def _backward(self, losses: torch.Tensor) -> None:
        # private, but the pipeline has no public hook around backward
        self.before_backward(losses)
        super()._backward(losses)
        self.after_backward()

    def before_backward(self, losses: torch.Tensor) -> None:
        """Runs before the backward of `losses`."""

    def after_backward(self) -> None:
        """Runs after the backward, before the optimizer step."""


class ReplicateAcrossRanks(DefaultDataParallelWrapper):
    """DDP for the dense side when there are ranks to replicate it on. In a world of one,
    DDP would only copy every gradient into its buckets and all-reduce them with itself
    (a tenth of a small model's CPU step); the state dict is the same either way."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        if env.world_size > 1:
            super().wrap(dmp, env, device)
        else:
            dmp.module.to(device)  # what DDP's wrapping does first
