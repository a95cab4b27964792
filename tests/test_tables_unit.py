"""embeddings/tables.py and embeddings/managed.py in this process (issue 56), for mutation testing:
which tables a schema makes and with which features, pooling and data type; the fused optimizer
marked on them; the managed tables' MCH modules, their row-wise parts and plans, the figures they
log, and the id maps a served model reads (`served_tables`). Training, evictions and resumes of
managed tables are test_managed.py's and test_managed_sequence.py's runs."""

import pytest
import torch
from torch import nn
from torchrec import DataType, EmbeddingBagCollection, EmbeddingCollection, PoolingType
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, LRU_EvictionPolicy
from torchrec.optim import RowWiseAdagrad

from embeddings.features import MANAGED_ID_RANGE, FeatureSpec
from embeddings.hooks import TrainingHooks
from embeddings.managed import (
    TrackedMCH,
    build_managed_bags,
    build_managed_sequences,
    managed_modules,
    managed_plans,
    managed_sharders,
    row_wise_rows,
    served_tables,
)
from embeddings.sparse_config import EmbeddingsConfig
from embeddings.tables import (
    build_embedding_bags,
    build_sequence_tables,
    sequence_table_configs,
    table_configs,
    tables_of,
)
from embeddings.torchrec_compat import ManagedSequenceTablesSharder, ManagedTablesSharder, mc_table_configs, mch_module

FREE = torch.iinfo(torch.int64).max


def schema() -> list[FeatureSpec]:
    """Pooled tables shared by an id and an id list, a pooled sequence on the item table, an
    attended sequence on a table of its own with its candidate, numerics between them; two
    managed tables (one pooled, one attended)."""
    f = FeatureSpec
    return [
        f(name="user", num_embeddings=50, embedding_dim=8),
        f(name="num_a", kind="numeric"),
        f(name="item", table="item_rows", num_embeddings=30, embedding_dim=4, pooling="mean"),
        f(name="tags", kind="id_list", num_embeddings=20, embedding_dim=4, pooling="mean"),
        f(name="clicked", kind="sequence", table="item_rows", num_embeddings=30, embedding_dim=4, pooling="sum"),
        f(name="more_tags", kind="id_list", table="tags", num_embeddings=20, embedding_dim=4, pooling="mean"),
        f(name="ad", table="ads", num_embeddings=40, embedding_dim=8, hashing="managed", eviction_policy="lru",
          eviction_interval=7),
        f(name="shop", num_embeddings=12, embedding_dim=8),
        f(name="shop_hist", kind="sequence", table="shop", num_embeddings=12, embedding_dim=8,
          sequence_module="target_attention"),
        f(name="song", num_embeddings=16, embedding_dim=8, hashing="managed"),
        f(name="num_b", kind="numeric"),
        f(name="songs", kind="sequence", table="song", num_embeddings=16, embedding_dim=8, hashing="managed",
          sequence_module="transformer", pooling="mean"),
    ]


def described(tables) -> list[tuple]:
    return [(t.name, t.num_embeddings, t.embedding_dim, t.feature_names) for t in tables]


def test_pooled_tables_group_their_features_in_schema_order():
    tables = table_configs(schema())
    assert described(tables) == [("user", 50, 8, ["user"]), ("item_rows", 30, 4, ["item", "clicked"]),
                                 ("tags", 20, 4, ["tags", "more_tags"]), ("ads", 40, 8, ["ad"])]
    # an id's pooling is no constraint (one id pools alike); the first multi-id feature sets the table's
    assert [t.pooling for t in tables] == [PoolingType.SUM, PoolingType.SUM, PoolingType.MEAN, PoolingType.SUM]


def test_a_served_model_looks_the_attended_tables_up_as_bags_too():
    tables = table_configs(schema(), serving=True)
    assert described(tables)[4:] == [("shop", 12, 8, ["shop", "shop_hist"]), ("song", 16, 8, ["song", "songs"])]
    assert tables[5].pooling == PoolingType.SUM  # the attended sequence's own pooling is not read


def test_an_id_first_on_a_table_leaves_the_pooling_to_the_lists():
    f = FeatureSpec
    tables = table_configs([f(name="a", table="t", num_embeddings=5, pooling="mean"),
                            f(name="b", kind="id_list", table="t", num_embeddings=5, pooling="sum")])
    assert tables[0].pooling == PoolingType.SUM
    tables = table_configs([f(name="b", kind="id_list", table="t", num_embeddings=5, pooling="mean"),
                            f(name="a", table="t", num_embeddings=5, pooling="sum")])
    assert tables[0].pooling == PoolingType.MEAN


def test_lists_sharing_a_table_must_agree_on_pooling():
    f = FeatureSpec
    features = [f(name="a", kind="id_list", table="t", num_embeddings=5, pooling="sum"),
                f(name="x", table="t", num_embeddings=5, pooling="mean"),
                f(name="b", kind="sequence", table="t", num_embeddings=5, pooling="mean")]
    with pytest.raises(ValueError) as e:
        table_configs(features)
    assert str(e.value) == ("features.b.pooling='mean' differs from features.a.pooling='sum', which shares "
                            "table 't': TorchRec pools per table")


def test_sequence_tables_are_the_attended_ones_managed_or_not():
    features = schema()
    assert described(sequence_table_configs(features)) == [("shop", 12, 8, ["shop", "shop_hist"]),
                                                           ("song", 16, 8, ["song", "songs"])]
    assert described(sequence_table_configs(features, managed=True)) == [("song", 16, 8, ["song", "songs"])]
    assert described(sequence_table_configs(features, managed=False)) == [("shop", 12, 8, ["shop", "shop_hist"])]
    assert [t.data_type for t in sequence_table_configs(features)] == [DataType.FP32] * 2
    half = sequence_table_configs(features, EmbeddingsConfig(data_type="fp16"))
    assert [t.data_type for t in half] == [DataType.FP16] * 2
    assert sequence_table_configs(features[:4]) == []


def fused(module: nn.Module) -> list[tuple]:
    """Each parameter's optimizer marked for the backward pass (apply_optimizer_in_backward's marks)."""
    return [(p._optimizer_classes, p._optimizer_kwargs) for p in module.parameters()]


@pytest.mark.parametrize("optimizer,cls", [("adagrad", torch.optim.Adagrad), ("rowwise_adagrad", RowWiseAdagrad)])
def test_collections_are_on_the_meta_device_with_the_fused_optimizer(optimizer, cls):
    cfg = EmbeddingsConfig(optimizer=optimizer, lr=0.3, eps=1e-6, data_type="fp16")
    features = schema()
    ebc = build_embedding_bags(features, cfg)
    assert isinstance(ebc, EmbeddingBagCollection)
    assert described(ebc.embedding_bag_configs()) == described(table_configs(features))[:3]  # not the managed one
    assert {t.data_type for t in ebc.embedding_bag_configs()} == {DataType.FP16}
    assert all(p.device.type == "meta" for p in ebc.parameters())
    assert fused(ebc) == [([cls], [{"lr": 0.3, "eps": 1e-6}])] * 3
    ec = build_sequence_tables(features, cfg)
    assert isinstance(ec, EmbeddingCollection) and described(ec.embedding_configs()) == [
        ("shop", 12, 8, ["shop", "shop_hist"])]
    assert all(p.device.type == "meta" for p in ec.parameters())
    assert [t.data_type for t in ec.embedding_configs()] == [DataType.FP16]
    assert fused(ec) == [([cls], [{"lr": 0.3, "eps": 1e-6}])]
    managed_ec = build_sequence_tables(features, cfg, managed=True)
    assert described(managed_ec.embedding_configs()) == [("song", 16, 8, ["song", "songs"])]


def test_no_collection_without_tables():
    f = FeatureSpec
    cfg = EmbeddingsConfig()
    only_managed = [f(name="a", num_embeddings=8, hashing="managed"), f(name="n", kind="numeric")]
    assert build_embedding_bags(only_managed, cfg) is None
    assert build_sequence_tables(only_managed, cfg) is None
    assert build_managed_sequences(only_managed, cfg, buckets=1) is None
    assert build_managed_bags([f(name="b", num_embeddings=8)], cfg, buckets=1) is None


def test_tables_of_splits_managed_from_plain_in_the_data_type():
    features, cfg = schema(), EmbeddingsConfig(data_type="fp16")
    assert [t.name for t in tables_of(features, cfg, managed=True)] == ["ads"]
    assert [t.name for t in tables_of(features, cfg, managed=False)] == ["user", "item_rows", "tags"]
    assert {t.data_type for t in tables_of(features, cfg, managed=False)} == {DataType.FP16}
    assert {t.data_type for t in tables_of(features, EmbeddingsConfig(), managed=True)} == {DataType.FP32}


def test_managed_tables_get_an_mch_module_each_as_their_features_configure():
    features, cfg = schema(), EmbeddingsConfig(lr=0.2)
    bags = build_managed_bags(features, cfg, buckets=4)
    assert isinstance(bags, ManagedCollisionEmbeddingBagCollection) and not bags._return_remapped_features
    assert {p.device.type for p in bags.parameters()} == {"meta"}  # DMP materialises only the local shards
    assert described(mc_table_configs(bags)) == [("ads", 40, 8, ["ad"])]
    assert fused(bags._embedding_module) == [([torch.optim.Adagrad], [{"lr": 0.2, "eps": 1e-8}])]
    mch = mch_module(bags, "ads")
    assert isinstance(mch, TrackedMCH) and mch.table_name == "ads"
    assert (mch._zch_size, mch._eviction_interval, mch._input_hash_size, mch.buckets()) == (40, 7, MANAGED_ID_RANGE, 4)
    assert isinstance(mch._eviction_policy, LRU_EvictionPolicy) and mch.device.type == "meta"
    sequences = build_managed_sequences(features, cfg, buckets=2)
    assert isinstance(sequences, ManagedCollisionEmbeddingCollection) and not sequences._return_remapped_features
    assert described(mc_table_configs(sequences)) == [("song", 16, 8, ["song", "songs"])]
    song = mch_module(sequences, "song")
    assert (song._zch_size, song._eviction_interval, song.buckets(), song.table_name) == (16, 100, 2, "song")
    assert isinstance(song._eviction_policy, DistanceLFU_EvictionPolicy)


def test_a_managed_table_needs_two_rows_on_every_rank():
    features = [FeatureSpec(name="ad", table="ads", num_embeddings=5, hashing="managed")]
    with pytest.raises(ValueError) as e:
        build_managed_bags(features, EmbeddingsConfig(), buckets=3)
    assert str(e.value) == ("features.ad.num_embeddings=5 is too few rows for a managed table on 3 ranks: row-wise, "
                            "its parts have [2, 2, 1] rows, and each needs 2 at least (a miss row, and a row for ids); "
                            "2 x the world size is enough")
    features[0].num_embeddings = 6
    assert build_managed_bags(features, EmbeddingsConfig(), buckets=3) is not None


@pytest.mark.parametrize("rows,ranks,parts", [(10, 3, [4, 4, 2]), (8, 4, [2, 2, 2, 2]), (3, 2, [2, 1]),
                                              (2, 4, [1, 1, 0, 0]), (9, 1, [9]), (7, 3, [3, 3, 1])])
def test_row_wise_parts_are_blocks_of_the_rounded_up_share(rows, ranks, parts):
    assert row_wise_rows(rows, ranks) == parts


def tracked(rows: int = 6) -> TrackedMCH:
    return TrackedMCH(zch_size=rows, device=torch.device("cpu"), eviction_policy=DistanceLFU_EvictionPolicy(),
                      eviction_interval=5, input_hash_size=MANAGED_ID_RANGE, buckets=1, name="ads")


def test_the_logged_figures_are_since_the_last_log_of_their_kind():
    mch = tracked()
    hooks = TrainingHooks.of(mch)
    assert hooks.metrics == [mch.log_values]
    mch._mch_sorted_raw_ids[:2] = torch.tensor([3, 9])  # two of the five id rows held (the sixth: the miss row)
    mch.counts.copy_(torch.tensor([[10, 4, 2], [6, 3, 0]]))
    assert mch.log_values("train") == pytest.approx({"managed/ads.miss_rate": 0.4, "managed/ads.evicted": 2.0,
                                                     "managed/ads.occupancy": 0.4})
    mch.counts.copy_(torch.tensor([[15, 5, 3], [6, 3, 0]]))
    assert mch.log_values("train") == pytest.approx({"managed/ads.miss_rate": 0.2, "managed/ads.evicted": 1.0,
                                                     "managed/ads.occupancy": 0.4})
    # an evaluation's: its own lookups since its last log, the evictions since this process began
    assert mch.log_values("eval") == pytest.approx({"managed/ads.miss_rate": 0.5, "managed/ads.evicted": 3.0,
                                                    "managed/ads.occupancy": 0.4})
    mch.counts.copy_(torch.tensor([[15, 5, 3], [10, 4, 0]]))
    assert mch.log_values("eval")["managed/ads.miss_rate"] == pytest.approx(0.25)
    assert mch.log_values("train") == pytest.approx({"managed/ads.miss_rate": 0.0, "managed/ads.evicted": 0.0,
                                                     "managed/ads.occupancy": 0.4})  # no lookups: no NaN
    mch.counts.copy_(torch.tensor([[16, 6, 3], [10, 4, 0]]))
    assert mch.log_values("train")["managed/ads.miss_rate"] == 1.0  # one lookup, on the miss row


def test_the_logged_counts_stay_exact_past_float32s_integers():
    """A long run looks up more than 2^24 ids: the counts since the last log are exact integers."""
    mch = tracked()
    big = 2 ** 24 + 1
    mch.counts.copy_(torch.tensor([[big, big, big], [0, 0, 0]]))
    assert mch.log_values("train")["managed/ads.evicted"] == big
    mch.counts[0] += torch.tensor([2, 1, 0])
    assert mch.log_values("train") == {"managed/ads.miss_rate": 0.5, "managed/ads.evicted": 0.0,
                                       "managed/ads.occupancy": 0.0}


def test_managed_modules_sharders_and_row_wise_plans(monkeypatch):
    import torchrec.distributed.sharding_plan as plan_module

    # a GPU host, where TorchRec's own guess of the device would be CUDA: a CPU run's plans stay the CPU's
    monkeypatch.setattr(plan_module, "get_device_type", lambda: "cuda")
    features, cfg = schema(), EmbeddingsConfig()
    holder = nn.Module()
    holder.plain = build_embedding_bags(features, cfg)
    holder.managed_tables = build_managed_bags(features, cfg, buckets=2)
    holder.managed_sequence_tables = build_managed_sequences(features, cfg, buckets=2)
    assert [name for name, _ in managed_modules(holder)] == ["managed_tables", "managed_sequence_tables"]
    assert [type(s) for s in managed_sharders()] == [ManagedTablesSharder, ManagedSequenceTablesSharder]
    plans = managed_plans(holder, torch.device("cpu"), local=2, world=2)
    assert sorted(plans) == ["managed_sequence_tables", "managed_tables"]
    for path, table, rows in (("managed_tables", "ads", 40), ("managed_sequence_tables", "song", 16)):
        [(name, shard)] = plans[path].items()
        assert (name, shard.sharding_type, shard.compute_kernel, shard.ranks) == (table, "row_wise", "fused", [0, 1])
        assert [s.shard_sizes[0] for s in shard.sharding_spec.shards] == [rows // 2] * 2
        assert [str(s.placement) for s in shard.sharding_spec.shards] == ["rank:0/cpu", "rank:1/cpu"]


def test_served_tables_move_every_table_into_the_bags_and_read_each_id_map():
    mch = "_managed_collision_collection._managed_collision_modules."
    ads, song = "managed_tables." + mch + "ads.", "managed_sequence_tables." + mch + "song."
    weight = torch.arange(6.0)
    state = {
        "ebc.embedding_bags.user.weight": weight, "tower.w": weight + 1,
        "sequence_tables.embeddings.shop.weight": weight + 2,
        "managed_tables._embedding_module.embedding_bags.ads.weight": weight + 3,
        "managed_sequence_tables._embedding_module.embeddings.song.weight": weight + 4,
        # two ranks' parts of ads, each sorted, free slots last: rows 0-4 rank 0's (4 its miss row), 5-9 rank 1's
        ads + "_mch_sorted_raw_ids": torch.tensor([7, 2 ** 61 - 1, FREE, FREE, FREE, 2 ** 61 + 5, 2 ** 62 - 1, FREE,
                                                  FREE, FREE]),
        ads + "_mch_remapped_ids_mapping": torch.tensor([3, 1, 0, 2, 4, 8, 5, 6, 7, 9]),
        ads + "_output_segments_tensor": torch.tensor([0, 5, 10, -1, -1]),
        ads + "_current_iter_tensor": torch.tensor([12]),
        song + "_mch_sorted_raw_ids": torch.tensor([4, FREE, FREE]),
        song + "_mch_remapped_ids_mapping": torch.tensor([1, 0, 2]),
        song + "_output_segments_tensor": torch.tensor([0, 3, -1]),
    }
    plain, maps = served_tables(state)
    assert sorted(plain) == ["ebc.embedding_bags.ads.weight", "ebc.embedding_bags.shop.weight",
                             "ebc.embedding_bags.song.weight", "ebc.embedding_bags.user.weight", "tower.w"]
    for key, offset in (("user", 0), ("shop", 2), ("ads", 3), ("song", 4)):
        assert torch.equal(plain[f"ebc.embedding_bags.{key}.weight"], weight + offset)
    assert sorted(maps) == ["ads", "song"]
    keys, rows, miss = maps["ads"]
    assert keys.tolist() == [7, 2 ** 61 - 1, 2 ** 61 + 5, 2 ** 62 - 1] and rows.tolist() == [3, 1, 8, 5]
    assert miss.tolist() == [4, 9]
    assert [t.tolist() for t in maps["song"]] == [[4], [1], [2]]


def test_served_tables_sort_the_ids_of_ranks_parts_out_of_order():
    """A rank's part sorted, the parts' ranges ascending, but a map read whole is sorted again:
    what a served model's binary search needs whatever order the slots were saved in."""
    prefix = "managed_tables._managed_collision_collection._managed_collision_modules.t."
    state = {prefix + "_mch_sorted_raw_ids": torch.tensor([9, 3, FREE, 5]),
             prefix + "_mch_remapped_ids_mapping": torch.tensor([0, 1, 2, 3]),
             prefix + "_output_segments_tensor": torch.tensor([0, 4, -1])}
    plain, maps = served_tables(state)
    assert plain == {}
    assert [t.tolist() for t in maps["t"]] == [[3, 5, 9], [1, 3, 0], [3]]
