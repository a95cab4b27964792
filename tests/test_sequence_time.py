"""Behaviour timestamps (trainer/data/timestamps.py): the log-scale gap buckets in both forms,
truncation with the ids, the checked range, and the errors and the dropped future behaviours at the
data boundary."""

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


def test_a_history_is_oldest_first_and_max_len_keeps_the_newest():
    """Most recent last (docs/data.md, Sequences): of five behaviours max_len 3 keeps the three
    newest, with their gaps, the smallest last; a tie is in order."""
    stamps = [0, 590, 596, 598, 599]  # at request time 600: gaps of 600, 10, 4, 2, 1 seconds
    rows = encoder(max_len=3).encode(table([[10, 11, 12, 13, 14], [14, 13]], [stamps, [7, 7]], [600, 600]),
                                     "f.parquet").to_batch()
    assert rows.sequence_ids["hist"].values().tolist() == [12, 13, 14, 14, 13]
    assert rows.sequence_gaps[0].tolist() == [reference_bucket(g, 32) for g in (4, 2, 1, 593, 593)]


@pytest.mark.parametrize("stamps,row,message", [
    ([[1, 2], [0, 5, 3]], 1, "timestamp 3 follows 5"),  # a drop across rows is no disorder
    ([[], [9, 9, 8], [1]], 1, "timestamp 8 follows 9"),
    ([[4, 3], []], 0, "timestamp 3 follows 4"),
    ([[1], [], [2, 7, 12, 8]], 2, "timestamp 8 follows 12"),  # 12 is after the request: out of order all the same
    ([[9], [1, 2], [6, 4]], 2, "timestamp 4 follows 6"),  # from row 0's only time to row 1's first: no disorder
])
def test_a_history_not_oldest_first_is_refused_naming_its_row(stamps, row, message):
    """Neither reordered nor read as it is: max_len would keep the wrong end and the recency
    positions run backwards. The served model's inputs pass the same check (test_sequence_serving)."""
    hist = [[100 + k for k in range(len(s))] for s in stamps]
    with pytest.raises(ValueError) as e:
        encoder().encode(table(hist, stamps, [10] * len(stamps)), "day=1/part-0.parquet")
    assert str(e.value) == (f"day=1/part-0.parquet, column 'hist_ts': row {row} is not oldest first: {message}; "
                            "sort each history by time (docs/data.md, Sequences)")


def test_lengths_that_differ_name_the_file_row_and_column():
    with pytest.raises(ValueError) as e:
        encoder().encode(table([[1, 2], [3, 4, 5]], [[1, 2], [3, 4]], [10, 10]), "day=1/part-0.parquet")
    assert str(e.value) == ("day=1/part-0.parquet, column 'hist_ts': row 1 has 2 timestamps for 3 ids in "
                            "column 'hist'")


def test_a_behaviour_after_its_request_time_is_dropped_with_its_id_and_counted(capsys):
    """Not clamped to a gap of 0 (it would show the model what came after the label): the id and
    its timestamp leave the list, then max_len keeps the last of what is left."""
    enc = encoder(max_len=2)
    rows = enc.encode(table([[1, 3, 2], [4]], [[5, 8, 12], [30]], [10, 20]), "day=1/part-0.parquet, row group 2")
    batch = rows.to_batch()
    assert batch.sequence_ids["hist"].values().tolist() == [1, 3]
    assert batch.sequence_ids["hist"].lengths().tolist() == [2, 0]
    assert batch.sequence_gaps[0].tolist() == [reference_bucket(5, 32), reference_bucket(2, 32)]
    assert enc.gaps.dropped == 2
    assert capsys.readouterr().err.strip() == (
        "rankmix: warning: day=1/part-0.parquet, row group 2, column 'hist_ts': 2 behaviour(s) after the request "
        "time ('now') dropped from their sequence, the first at row 0; counted, each file named once")
    enc.encode(table([[1]], [[11]], [10]), "day=1/part-0.parquet, row group 3 from row 8")  # the same file
    enc.encode(table([[7, 8]], [[9, 11]], [10]), "day=2/part-0.parquet, row group 0")
    assert enc.gaps.dropped == 4
    assert capsys.readouterr().err.splitlines() == [
        "rankmix: warning: day=2/part-0.parquet, row group 0, column 'hist_ts': 1 behaviour(s) after the request "
        "time ('now') dropped from their sequence, the first at row 0; counted, each file named once"]


def reference_rows(hist, stamps, now, max_len, buckets):
    """Per row, in Python: the (id, gap bucket) pairs kept, and the behaviours dropped."""
    kept, dropped = [], 0
    for ids, times, t in zip(hist, stamps, now):
        pairs = [(i, reference_bucket(t - s, buckets)) for i, s in zip(ids or [], times or []) if s <= t]
        dropped += len(ids or []) - len(pairs)
        kept.append(pairs[-max_len:])
    return kept, dropped


@pytest.mark.parametrize("list_type", [pa.list_, pa.large_list])
def test_the_behaviours_kept_and_their_gaps_match_a_per_row_reference(list_type):
    rng = np.random.default_rng(55)
    n = 300
    now = rng.integers(0, 2**62, n).tolist()
    now[:3] = [0, 2**62 - 1, 5]  # the range's two ends: no gap overflows, nothing at 0 is clamped
    hist, stamps = [], []
    for t in now:
        length = int(rng.integers(0, 9))
        hist.append(rng.integers(0, 100, length).tolist())
        drift = rng.integers(-2**20, 2**20, length)  # about half after the request time
        stamps.append(sorted(int(min(max(t - d, 0), 2**62 - 1)) for d in drift))  # oldest first
    stamps[0], hist[0] = [0, 2**62 - 1], [2, 1]  # at request time 0: one kept at gap 0, one dropped
    stamps[1], hist[1] = [0], [3]  # gap 2^62 - 1, the widest
    hist[5], stamps[5] = None, None  # a null list: an empty sequence
    enc = encoder(max_len=4)
    t = pa.table({"item": [1] * n, "hist": pa.array(hist, list_type(pa.int64())),
                  "hist_ts": pa.array(stamps, list_type(pa.int64())), "now": now, "click": [0] * n})
    batch = enc.encode(t, "f.parquet").to_batch()
    kept, dropped = reference_rows(hist, stamps, now, 4, 32)
    assert batch.sequence_ids["hist"].lengths().tolist() == [len(k) for k in kept]
    assert batch.sequence_ids["hist"].values().tolist() == [i for k in kept for i, _ in k]
    assert batch.sequence_gaps[0].tolist() == [g for k in kept for _, g in k]
    assert dropped > n and enc.gaps.dropped == dropped
    assert kept[0] == [(2, 1)] and kept[1] == [(3, 31)]


def test_a_uint64_time_past_int64_is_refused_as_itself_not_wrapped():
    u64 = pa.list_(pa.uint64())
    with pytest.raises(ValueError) as e:
        encoder().encode(pa.table({"item": [1, 1], "hist": pa.array([[1], [2]], pa.list_(pa.int64())),
                                   "hist_ts": pa.array([[3], [2**64 - 1]], u64), "now": [10, 10], "click": [0, 0]}),
                         "f.parquet, row group 0")
    assert str(e.value) == ("f.parquet, row group 0, column 'hist_ts': timestamp 18446744073709551615 at row 1 "
                            "is outside 0 <= t < 2^62 (docs/data.md, Sequences)")
    with pytest.raises(ValueError) as e:
        encoder().encode(pa.table({"item": [1], "hist": pa.array([[1]], pa.list_(pa.int64())),
                                   "hist_ts": pa.array([[3]], u64), "now": pa.array([2**63], pa.uint64()),
                                   "click": [0]}), "f.parquet")
    assert str(e.value) == ("f.parquet, column 'now': request time 9223372036854775808 at row 0 is outside "
                            "0 <= t < 2^62 (docs/data.md, Sequences)")


def test_times_whose_gap_would_overflow_int64_are_refused_not_clamped():
    """Request time 2^63 - 1 less a timestamp of -2^62 wraps int64 to a negative gap."""
    with pytest.raises(ValueError) as e:
        encoder().encode(table([[1]], [[-2**62]], [2**63 - 1]), "f.parquet")
    assert str(e.value) == ("f.parquet, column 'now': request time 9223372036854775807 at row 0 is outside "
                            "0 <= t < 2^62 (docs/data.md, Sequences)")
    with pytest.raises(ValueError) as e:
        encoder().encode(table([[1, 2]], [[5, -2**62]], [2**62 - 1]), "f.parquet")
    assert str(e.value) == ("f.parquet, column 'hist_ts': timestamp -4611686018427387904 at row 0 is outside "
                            "0 <= t < 2^62 (docs/data.md, Sequences)")


def test_negative_times_are_refused_in_every_integer_type():
    for typ in (pa.int8(), pa.int32(), pa.int64()):
        with pytest.raises(ValueError) as e:
            encoder().encode(pa.table({"item": [1, 1], "hist": pa.array([[1], [2, 3]], pa.list_(pa.int64())),
                                       "hist_ts": pa.array([[3], [4, -1]], pa.list_(typ)), "now": [10, 10],
                                       "click": [0, 0]}), "f.parquet")
        assert str(e.value) == ("f.parquet, column 'hist_ts': timestamp -1 at row 1 is outside 0 <= t < 2^62 "
                                "(docs/data.md, Sequences)")
    with pytest.raises(ValueError) as e:
        encoder().encode(table([[1]], [[3]], pa.array([10, -5][1:], pa.int16())), "f.parquet")
    assert str(e.value) == "f.parquet, column 'now': request time -5 at row 0 is outside 0 <= t < 2^62 " \
                           "(docs/data.md, Sequences)"


def test_a_served_models_inputs_are_checked_alike_and_nothing_is_dropped_or_counted(capsys):
    from trainer.serving.predict import raw_inputs

    features = encoder().gaps.features + [FeatureSpec(name="item", table="t", num_embeddings=100, embedding_dim=4)]
    rows = table([[1, 2]], [[5, 12]], [10])
    *_, stamps, now = raw_inputs(rows, features, "f.parquet", "now")
    assert stamps.tolist() == [5, 12] and now.tolist() == [10] and capsys.readouterr().err == ""
    with pytest.raises(ValueError, match=r"^f.parquet, column 'hist_ts': timestamp -1 at row 0 is outside"):
        raw_inputs(table([[1]], [[-1]], [10]), features, "f.parquet", "now")


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


def test_each_limit_is_refused_at_it_and_a_valid_time_before_a_bad_one_is_not_named():
    """2^62 itself is outside, in int64 and uint64; int8's -128 (seen unsigned: 128, the fast
    check's bound) too; 0 and 2^62 - 1 ahead of the bad value in its list are not what the error names."""
    cases = [(pa.int64(), 2**62, [[1], [2**62]]), (pa.uint64(), 2**62, [[1], [2**62]]),
             (pa.int8(), -128, [[1], [-128]]), (pa.int64(), -1, [[1], [0, 2**62 - 1, -1]])]
    for typ, bad, stamps in cases:
        hist = [[5] * len(s) for s in stamps]
        with pytest.raises(ValueError) as e:
            encoder().encode(pa.table({"item": [1, 1], "hist": pa.array(hist, pa.list_(pa.int64())),
                                       "hist_ts": pa.array(stamps, pa.list_(typ)), "now": [10, 10],
                                       "click": [0, 0]}), "f.parquet")
        assert str(e.value) == (f"f.parquet, column 'hist_ts': timestamp {bad} at row 1 is outside 0 <= t < 2^62 "
                                "(docs/data.md, Sequences)"), typ
    with pytest.raises(ValueError) as e:
        encoder().encode(table([[1]], [[3]], pa.array([2**62], pa.uint64())), "f.parquet")
    assert str(e.value) == ("f.parquet, column 'now': request time 4611686018427387904 at row 0 is outside "
                            "0 <= t < 2^62 (docs/data.md, Sequences)")


def test_a_null_time_names_its_row():
    with pytest.raises(ValueError) as e:
        encoder().encode(table([[1], [2]], [[3], [4]], pa.array([10, None], pa.int64())), "f.parquet")
    assert str(e.value) == "f.parquet, column 'now': null request time at row 1"
    with pytest.raises(ValueError) as e:
        encoder().encode(table([[1, 2], [3, 4, 5]], [[1, 2], [3, None, 5]], [10, 10]), "f.parquet")
    assert str(e.value) == "f.parquet, column 'hist_ts': null timestamp inside the list at row 1"


@pytest.mark.parametrize("list_type", [pa.list_, pa.large_list])
def test_a_behaviour_dropped_from_one_row_leaves_the_other_rows_whole(list_type, capsys):
    """Only the first of three rows has a behaviour after its request time: the others keep all of
    theirs; the id column that replaces the file's keeps its list type."""
    enc = encoder(max_len=5)
    t = pa.table({"item": [1, 1, 1], "hist": pa.array([[1, 2], [3, 4], [5]], list_type(pa.int64())),
                  "hist_ts": pa.array([[5, 50], [6, 7], [8]], list_type(pa.int64())), "now": [10, 10, 10],
                  "click": [0, 0, 0]})
    ids, [gaps] = enc.gaps.encode(t, "f.parquet")
    assert ids["hist"].type == t.column("hist").type
    assert ids["hist"].to_pylist() == [[1], [3, 4], [5]]
    assert gaps.tolist() == [reference_bucket(g, 32) for g in (5, 4, 3, 2)]
    assert enc.gaps.dropped == 1


def test_each_file_is_named_once_even_in_a_folder_whose_name_has_spaces(capsys):
    enc = encoder()
    for part in ("part-0", "part-0", "part-1"):
        enc.encode(table([[1]], [[11]], [10]), f"my logs/{part}.parquet, row group 0")
    assert [line.split(",")[0] for line in capsys.readouterr().err.splitlines()] == [
        "rankmix: warning: my logs/part-0.parquet", "rankmix: warning: my logs/part-1.parquet"]


def test_a_served_models_request_times_are_checked_too():
    """`check` (a served model's inputs) refuses a request time out of range or null, naming the column."""
    gaps = encoder().gaps
    gaps.check(table([[1]], [[3]], [10]), "request")
    with pytest.raises(ValueError) as e:
        gaps.check(table([[1]], [[3]], [-4]), "request")
    assert str(e.value) == ("request, column 'now': request time -4 at row 0 is outside 0 <= t < 2^62 "
                            "(docs/data.md, Sequences)")
    with pytest.raises(ValueError) as e:
        gaps.check(table([[1]], [[3]], pa.array([None], pa.int64())), "request")
    assert str(e.value) == "request, column 'now': null request time at row 0"


def test_only_attended_sequences_timestamps_are_read_and_each_column_is_typed():
    from trainer.data.timestamps import TimeGaps

    f = FeatureSpec
    pooled = f(name="seen", kind="sequence", table="t", num_embeddings=100, embedding_dim=4, max_len=3,
               timestamps="seen_ts")
    assert TimeGaps([pooled], "", 32).columns == []  # pool reads no time: not even a request time is needed
    features = encoder().gaps.features
    with pytest.raises(ValueError) as e:
        TimeGaps(features, "", 32)
    assert str(e.value) == "features.hist.timestamps needs data.time_column, the column of each row's request time"
    gaps = TimeGaps([pooled, *features], "now", 32)
    assert gaps.columns == ["hist_ts", "now"]
    checks = list(gaps.expected_types())
    assert [(c, need) for c, need, _ in checks] == [("hist_ts", "a list of integer timestamps for feature 'hist'"),
                                                    ("now", "integer request times (data.time_column)")]
    stamps, now = checks[0][2], checks[1][2]
    assert stamps(pa.list_(pa.int64())) and stamps(pa.large_list(pa.uint32()))
    assert not stamps(pa.list_(pa.string())) and not stamps(pa.list_(pa.float64()))
    assert now(pa.uint64()) and not now(pa.float64())
    encoder().check_schema(pa.schema([("item", pa.int64()), ("hist", pa.list_(pa.int64())),
                                      ("hist_ts", pa.large_list(pa.int32())), ("now", pa.int32()),
                                      ("click", pa.int64())]), "f.parquet")


def test_an_empty_row_group_gives_no_gaps():
    ids, [gaps] = encoder().gaps.encode(table([], [], pa.array([], pa.int64())), "f.parquet")
    assert ids == {} and gaps.dtype == np.int64 and gaps.size == 0
