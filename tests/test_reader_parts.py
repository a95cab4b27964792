"""Batches assembled from parts of windows (trainer.data.batch.Part, assemble): gathered by a
permutation or copied from slices, one part or several, they equal the rows picked one by one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from dense.model_config import TaskSpec
from tests.test_reader_rows import assert_rows, random_rows
from trainer.data.batch import Part, Rows, assemble
from trainer.data.datasets import synth_features
from trainer.data.encode import RowEncoder


def test_a_part_picked_by_an_index_is_those_rows():
    rng = np.random.default_rng(3)
    rows, ref = random_rows(rng, 300, flat_null=True)
    order = rng.permutation(300)
    part = Part(rows, order)
    assert_rows(part.slice(40, 140).as_rows(), [ref[i] for i in order[40:140]])
    assert part.slice(290).num_rows == 10


@pytest.mark.parametrize("flat_null", [False, True])
def test_a_batch_across_parts_equals_the_reference(flat_null):
    rng = np.random.default_rng(11)
    a, ref_a = random_rows(rng, 200, flat_null)
    b, ref_b = random_rows(rng, 120, not flat_null)
    order = rng.permutation(200)
    parts = [Part(a, order[150:]), Part(b.slice(0, 30)), Part(b, np.array([7, 7, 0]))]
    batch = assemble(parts)
    expected = [ref_a[i] for i in order[150:]] + ref_b[:30] + [ref_b[7], ref_b[7], ref_b[0]]
    assert_rows(Rows.concat([p.as_rows() for p in parts]), expected)
    got = Rows.concat([p.as_rows() for p in parts]).to_batch()
    for x, y in ((batch.sparse.values(), got.sparse.values()), (batch.sparse.lengths(), got.sparse.lengths()),
                 (batch.dense, got.dense), (batch.labels, got.labels), (batch.users, got.users)):
        assert x.dtype == y.dtype and x.tolist() == y.tolist()
    assert len(batch) == len(expected) == 83


def test_a_gathered_batch_shares_no_memory_with_the_window():
    rows, _ = random_rows(np.random.default_rng(0), 64)
    batch = assemble([Part(rows, np.arange(63, -1, -1))])
    batch.dense.zero_()
    batch.sparse.values().zero_()
    assert rows.dense.any() and rows.values[0].any()


class _Reads(TorchFunctionMode):
    """Counts values read back from tensors (`tolist`, `item`): host syncs on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += func in (torch.Tensor.tolist, torch.Tensor.item)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("gathered", [False, True])
def test_a_batch_knows_its_ids_per_key_without_reading_them_back(gathered):
    rows, _ = random_rows(np.random.default_rng(5), 90)
    parts = [Part(rows, np.arange(89, 9, -1)) if gathered else Part(rows.slice(10)), Part(rows.slice(0, 7))]
    sparse = assemble(parts).sparse
    per_key = sparse.lengths().reshape(len(sparse.keys()), -1).sum(dim=1).tolist()
    with _Reads() as reads:
        got = sparse.length_per_key(), sparse.offset_per_key()
        sparse.split([1, len(sparse.keys()) - 1])  # as TorchRec's input dist splits a batch by sharding
    assert reads.reads == 0
    assert got == (per_key, [0, *np.cumsum(per_key).tolist()])


def test_the_encoder_writes_the_pooled_features_in_the_order_it_is_given():
    """Only the pooled features move: the attended sequence and its candidate (an
    EmbeddingCollection's keys) and the managed table (a collection of its own) stay last."""
    features = synth_features()
    features[1] = dataclasses.replace(features[1], hashing="managed")  # user_age
    features = [dataclasses.replace(f, sequence_module="target_attention") if f.name == "hist_items" else f
                for f in features]
    encoder = RowEncoder(features, [TaskSpec(name="click", label="click")])
    names = [f.name for f in encoder.sparse]
    pooled, rest = names[:-3], ["item_id", "hist_items", "user_age"]
    assert names[-3:] == rest and encoder.num_sequence == 2
    encoder.order_pooled(pooled[::-1])
    assert [f.name for f in encoder.sparse] == [*pooled[::-1], *rest]
    encoder.order_pooled(pooled[:-1])  # not the same features: left as it was
    assert [f.name for f in encoder.sparse] == [*pooled[::-1], *rest]


def test_attended_sequences_on_plain_and_managed_tables_ride_in_two_keyed_jagged_tensors():
    """Each kind of sparse feature in its own KeyedJaggedTensor: plain bags, attended tables
    (an EmbeddingCollection's), attended managed tables (a ManagedCollisionEmbeddingCollection's,
    ids spread as every managed id) and managed bags; `sequence_max` per key in the order
    SequenceInputs reads them."""
    import pyarrow as pa

    from dense.sequence import SequenceInputs
    from dense.sequence_modules import SequenceConfig
    from embeddings.features import FeatureSpec
    from trainer.data.feature_ops import spread

    f = FeatureSpec
    attend = dict(kind="sequence", sequence_module="target_attention", embedding_dim=4)
    features = [f(name="u", num_embeddings=10, hashing="managed"), f(name="plain", num_embeddings=5),
                f(name="item", table="cat", num_embeddings=10, embedding_dim=4, hashing="managed"),
                f(name="hist", table="cat", num_embeddings=10, hashing="managed", max_len=3, timestamps="hist_ts",
                  **attend),
                f(name="shop", table="shops", num_embeddings=10, embedding_dim=4),
                f(name="shist", table="shops", num_embeddings=10, max_len=2, timestamps="shist_ts", **attend)]
    table = pa.table({"u": [1, 2, 3], "plain": [0, 1, 2], "item": [7, 8, 2 ** 40], "shop": [1, 2, 3],
                      "hist": [[1, 2, 3, 4], [], [2 ** 40]], "shist": [[1], [2, 3, 4], []], "click": [0, 1, 0],
                      "hist_ts": [[1, 2, 3, 4], [], [5]], "shist_ts": [[9], [9, 9, 9], []], "now": [10, 10, 10]})
    encoder = RowEncoder(features, [TaskSpec(name="click", label="click")], time_column="now")
    assert [g.name for g in encoder.sparse] == ["plain", "shop", "shist", "item", "hist", "u"]
    batch = encoder.encode(table, "t").to_batch()
    assert batch.sparse.keys() == ["plain"] and batch.managed_ids.keys() == ["u"]
    assert batch.sequence_ids.keys() == ["shop", "shist"] and batch.managed_sequence_ids.keys() == ["item", "hist"]
    assert batch.sequence_ids["shist"].values().tolist() == [1, 3, 4]  # the last max_len, raw
    assert batch.managed_sequence_ids["hist"].values().tolist() == spread(np.array([2, 3, 4, 2 ** 40])).tolist()
    inputs = SequenceInputs(features, SequenceConfig())
    assert inputs.keys == ["shop", "shist", "item", "hist"] and batch.sequence_max == (1, 2, 1, 3)
    # the gaps in schema order, whichever collection the sequence is in: hist's 4 kept ids, then shist's 3
    assert inputs.timed == ["hist", "shist"] and [g.numel() for g in batch.sequence_gaps] == [4, 3]
    assert batch.sequence_gaps[1].tolist() == [batch.sequence_gaps[1][0].item()] * 3  # gap 1 each
    moved = batch.to(torch.device("cpu"))  # as the pipeline moves a batch
    assert moved.sequence_max == batch.sequence_max
    assert moved.managed_sequence_ids["item"].values().tolist() == spread(np.array([7, 8, 2 ** 40])).tolist()


def test_the_pooled_features_move_before_a_managed_sequence_and_its_candidate():
    """The same with the sequence's table managed: its two unpooled features are counted once, as
    managed sequence features, and stay last with the managed table."""
    features = [dataclasses.replace(f, sequence_module="target_attention") if f.name == "hist_items" else f
                for f in synth_features()]
    features = [dataclasses.replace(f, hashing="managed") if f.name in ("item_id", "hist_items", "user_age") else f
                for f in features]
    encoder = RowEncoder(features, [TaskSpec(name="click", label="click")])
    names = [f.name for f in encoder.sparse]
    pooled, rest = names[:-3], names[-3:]
    assert sorted(rest) == ["hist_items", "item_id", "user_age"]
    assert (encoder.num_sequence, encoder.num_managed_sequence) == (0, 2)
    encoder.order_pooled(pooled[::-1])
    assert [f.name for f in encoder.sparse] == [*pooled[::-1], *rest]
