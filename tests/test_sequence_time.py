"""Behaviour timestamps (trainer/data/timestamps.py): the log-scale gap buckets in both forms,
truncation with the ids, and the errors and the clamp at the data boundary."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec
from trainer.data.encode import RowEncoder
from trainer.data.feature_ops import gap_buckets_numpy, gap_buckets_torch


def reference_bucket(gap: int, buckets: int) -> int:
    """1 + floor(log2(gap + 1)) in exact integers, capped at buckets - 1."""
    return min((gap + 1).bit_length(), buckets - 1)


def test_gap_buckets_are_log2_of_the_gap_plus_one_in_both_forms():
    # every bit length of gap + 1 from 1 to 63, each at its lowest and highest value (every branch of the search)
    gaps = sorted({g for bits in range(63) for g in (2**bits - 1, 2**(bits + 1) - 2)} | {59, 3600, 86_400})
    for buckets in (2, 8, 32, 64, 65):
        expected = [reference_bucket(g, buckets) for g in gaps]
        numpy_form = gap_buckets_numpy(np.array(gaps, np.int64), buckets)
        assert numpy_form.dtype == np.int64 and numpy_form.tolist() == expected
        assert gap_buckets_torch(torch.tensor(gaps), buckets).tolist() == expected
    assert gap_buckets_numpy(np.array([0, 1, 2, 3, 7], np.int64), 32).tolist() == [1, 2, 2, 3, 4]


def encoder(max_len: int = 3) -> RowEncoder:
    f = FeatureSpec
    features = [f(name="item", table="t", num_embeddings=100, embedding_dim=4),
                f(name="hist", kind="sequence", table="t", num_embeddings=100, embedding_dim=4, max_len=max_len,
                  sequence_module="target_attention", timestamps="hist_ts")]
    return RowEncoder(features, [TaskSpec()], "", time_column="now", time_buckets=32)


def table(hist, stamps, now) -> pa.Table:
    return pa.table({"item": [1] * len(now), "hist": pa.array(hist, pa.list_(pa.int64())),
                     "hist_ts": pa.array(stamps, pa.list_(pa.int64())), "now": now, "click": [0] * len(now)})


def test_the_gaps_of_the_kept_behaviours_reach_the_batch_aligned_with_their_ids():
    """max_len 3 keeps the last three ids and their times; an empty history has no gaps."""
    rows = encoder().encode(table([[5, 6, 7, 8], [], [9]], [[0, 40, 90, 99], [], [100]], [100, 50, 100]), "f.parquet")
    batch = rows.to_batch()
    assert batch.sequence_ids.keys() == ["item", "hist"] and batch.sequence_max == (1, 3)
    assert batch.sequence_ids["hist"].values().tolist() == [6, 7, 8, 9]
    [gaps] = batch.sequence_gaps
    assert gaps.tolist() == [reference_bucket(g, 32) for g in (60, 10, 1, 0)]
    picked = rows.take(np.array([2, 0])).to_batch()  # shuffled rows carry their gaps with them
    assert picked.sequence_gaps[0].tolist() == [1, 6, 4, 2]


def test_lengths_that_differ_name_the_file_row_and_column():
    with pytest.raises(ValueError) as e:
        encoder().encode(table([[1, 2], [3, 4, 5]], [[1, 2], [3, 4]], [10, 10]), "day=1/part-0.parquet")
    assert str(e.value) == ("day=1/part-0.parquet, column 'hist_ts': row 1 has 2 timestamps for 3 ids in "
                            "column 'hist'")


def test_a_timestamp_after_the_request_time_is_clamped_to_a_gap_of_zero_and_counted(capsys):
    enc = encoder()
    rows = enc.encode(table([[1, 2], [3]], [[5, 12], [30]], [10, 20]), "f.parquet")
    assert rows.to_batch().sequence_gaps[0].tolist() == [reference_bucket(5, 32), 1, 1]
    assert enc.gaps.clamped == 2
    assert capsys.readouterr().err.strip() == (
        "rankmix: warning: f.parquet, column 'hist_ts': a timestamp after the request time ('now') at row 0; "
        "such gaps are clamped to 0 and counted")


def test_timestamps_need_a_request_time_column():
    from trainer.config import Config
    from trainer.config_loader import validate

    cfg = Config()
    cfg.features = encoder().gaps.features + [FeatureSpec(name="item", table="t", num_embeddings=100, embedding_dim=4)]
    with pytest.raises(ValueError) as e:
        validate(cfg)
    assert str(e.value) == "features.hist.timestamps needs data.time_column, the column of each row's request time"


def test_the_encoders_defaults_are_the_configs():
    """Without a request time a sequence's timestamps are refused; the buckets default to
    model.sequence.time_buckets's."""
    from dense.sequence_modules import SequenceFields

    features = encoder().gaps.features
    with pytest.raises(ValueError, match=r"^features.hist.timestamps needs data.time_column"):
        RowEncoder(features, [TaskSpec()], "")
    assert RowEncoder(features, [TaskSpec()], "", time_column="now").gaps.buckets == SequenceFields().time_buckets
