"""Id hashing and spreading pinned to values computed outside the code: a change to either
re-keys every embedding table of every trained model, so it must show as a failure.

- `spread` is splitmix64's finaliser reduced to 62 bits. The outputs below are those of
  `next()` in Vigna's reference splitmix64.c, compiled with gcc: seeded with 0 its first
  four (0xe220a8397b1dcdaf, ... the generator's well-known sequence), the finaliser of the
  states k * 0x9E3779B97F4A7C15, k = 1..4; seeded with -0x9E3779B97F4A7C15 and
  1 - 0x9E3779B97F4A7C15, its first, the finaliser of 0 and of 1.
- `stable_hash` is 64-bit BLAKE2b read little-endian and halved: the digests below are
  `printf %s STRING | b2sum -l 64` (GNU coreutils).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from embeddings.features import MANAGED_ID_RANGE, FeatureSpec
from trainer.data.feature_ops import spread, spread_ids
from trainer.data.ids import encode_ids
from trainer.offline.csvlog import hashed_column, stable_hash

GOLDEN = 0x9E3779B97F4A7C15
STATES = [GOLDEN * k % 2 ** 64 for k in range(1, 5)] + [0, 1]
OUTPUTS = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC, 0, 0x5692161D100B05E5]
SPREAD = [word % MANAGED_ID_RANGE for word in OUTPUTS]

# b2sum -l 64 of each string: the digest's bytes as printed.
BLAKE2B_64 = {"a": "40f89e395b66422f", "b": "8472c2e34d854f75", "hello": "a7b6eda801e5347d",
              "68fd1e64": "11f5e52e6bb929e0"}


def test_managed_id_range_is_2_to_the_62():
    assert MANAGED_ID_RANGE == 4611686018427387904


@pytest.mark.parametrize("dtype", [np.uint64, np.int64])
def test_spread_is_splitmix64s_finaliser_reduced_to_62_bits(dtype):
    words = np.array(STATES, np.uint64).view(np.int64).astype(dtype)  # int64: the same bit patterns
    out = spread(words)
    assert out.dtype == np.int64
    assert out.tolist() == SPREAD
    assert words.tolist() == np.array(STATES, np.uint64).view(np.int64).astype(dtype).tolist()  # input kept


def test_spread_of_narrow_integers_is_that_of_their_value():
    assert spread(np.array([0, 1], np.int32)).tolist() == [0, SPREAD[-1]]
    assert spread(np.array([1], np.uint8)).tolist() == [SPREAD[-1]]


def test_spread_ids_in_tensor_ops_gives_the_same_pinned_values():
    words = torch.from_numpy(np.array(STATES, np.uint64).view(np.int64))
    assert spread_ids(words).tolist() == SPREAD


def test_stable_hash_is_b2sum_64_little_endian_halved():
    for text, digest in BLAKE2B_64.items():
        assert stable_hash(text) == int.from_bytes(bytes.fromhex(digest), "little") >> 1
    assert stable_hash("a") == 1702698405120146464  # the same, written out


def test_hashed_column_hashes_each_string_and_nulls_the_empty_ones():
    raw = pa.array(["a", "", "hello", "a", "b"])
    out = hashed_column(raw)
    assert out.type == pa.int64()
    assert out.to_pylist() == [stable_hash("a"), None, stable_hash("hello"), stable_hash("a"), stable_hash("b")]
    assert hashed_column(pa.array([""] * 3)).to_pylist() == [None] * 3
    empty = hashed_column(pa.array([], pa.string()))
    assert empty.type == pa.int64() and len(empty) == 0


# ----------------------------------------------------------------------------- encode_ids
# The paths the per-row reference of tests/test_reader_rows.py does not reach: managed
# tables, the serving artifact's raw ids (reduce=False), and where errors point.


INT64 = pa.int64()


def _list(rows: list, typ: pa.DataType = INT64) -> pa.Array:
    return pa.array(rows, pa.list_(typ))


def test_managed_ids_are_spread_in_every_layout():
    spec = FeatureSpec(name="f", num_embeddings=10, hashing="managed")
    words = np.array(STATES, np.uint64)
    assert encode_ids(pa.array(words), spec, "w")[0].tolist() == SPREAD
    values, present = encode_ids(pa.array([*STATES[:2], None], pa.uint64()), spec, "w")
    assert values.tolist() == SPREAD[:2] and present.tolist() == [1, 1, 0]
    values, lengths = encode_ids(_list([[STATES[0]], [], [STATES[1], STATES[2]]], pa.uint64()),
                                 FeatureSpec(name="f", kind="id_list", num_embeddings=10, hashing="managed"), "w")
    assert values.tolist() == SPREAD[:3] and lengths.tolist() == [1, 0, 2]
    # ids that are all below num_embeddings are spread too: a managed table's rows are not its ids
    assert encode_ids(pa.array([1, 1], pa.int64()), spec, "w")[0].tolist() == [SPREAD[-1]] * 2


def test_managed_negative_ids_are_errors_naming_the_row():
    spec = FeatureSpec(name="f", kind="id_list", num_embeddings=10, hashing="managed")
    with pytest.raises(ValueError) as err:
        encode_ids(_list([[1, 2], [3, 0, -7]]), spec, "file.parquet, row group 3")
    assert str(err.value) == "file.parquet, row group 3, column 'f': negative id -7 at row 1"


def test_raw_ids_for_serving_are_checked_but_neither_reduced_nor_cut():
    big = [2 ** 63 + 5, 3]
    for hashing in ("modulo", "managed"):
        spec = FeatureSpec(name="f", num_embeddings=10, hashing=hashing)
        values, _ = encode_ids(pa.array(big, pa.uint64()), spec, "w", reduce=False)
        assert values.dtype == np.int64 and values.tolist() == [5 - 2 ** 63, 3]  # the bit pattern
        values, _ = encode_ids(pa.array([12, 3], pa.int32()), spec, "w", reduce=False)
        assert values.dtype == np.int64 and values.tolist() == [12, 3]
        values, present = encode_ids(pa.array([12, None, 3], pa.int32()), spec, "w", reduce=False)
        assert values.tolist() == [12, 3] and present.tolist() == [1, 0, 1]
        seq = FeatureSpec(name="f", kind="sequence", num_embeddings=10, hashing=hashing, max_len=2)
        values, lengths = encode_ids(_list([[11, 12, 13], [4]]), seq, "w", reduce=False)
        assert values.tolist() == [11, 12, 13, 4] and lengths.tolist() == [3, 1]
        with pytest.raises(ValueError, match="^w, column 'f': negative id -1 at row 1$"):
            encode_ids(pa.array([12, -1]), spec, "w", reduce=False)


def test_a_null_id_is_hashed_as_a_valid_id_and_dropped():
    # num_embeddings=1: only id 0 is valid, so the nulls must not be hashed as anything else
    spec = FeatureSpec(name="f", num_embeddings=1, hashing="none")
    values, present = encode_ids(pa.array([0, None, 0]), spec, "w")
    assert values.tolist() == [0, 0] and present.tolist() == [1, 0, 1]


def test_errors_in_a_column_with_nulls_name_the_row_of_the_table():
    spec = FeatureSpec(name="f", num_embeddings=5, hashing="modulo")
    with pytest.raises(ValueError) as err:
        encode_ids(pa.array([1, None, 0, -2]), spec, "w")
    assert str(err.value) == "w, column 'f': negative id -2 at row 3"


@pytest.mark.parametrize("hashing", ["none", "modulo"])
def test_negative_id_after_a_zero_is_the_one_named(hashing):
    spec = FeatureSpec(name="f", num_embeddings=5, hashing=hashing)
    with pytest.raises(ValueError) as err:
        encode_ids(pa.array([3, 0, 7, -1]), spec, "w")
    assert str(err.value) == "w, column 'f': negative id -1 at row 3"


def test_list_errors_name_the_row_not_the_position_in_the_flat_ids():
    spec = FeatureSpec(name="f", kind="id_list", num_embeddings=100, hashing="none")
    with pytest.raises(ValueError) as err:  # flat position 3, the first id of row 2 (after an empty row)
        encode_ids(_list([[1, 2, 3], [], [100, 5]]), spec, "w")
    assert str(err.value) == ("w, column 'f': id 100 at row 2 is out of range for num_embeddings=100 "
                              "(features.f.hashing is 'none')")
    with pytest.raises(ValueError) as err:
        encode_ids(_list([[1, 2], [3, None], [None]]), spec, "w")
    assert str(err.value) == "w, column 'f': null id inside the list at row 1"


@pytest.mark.parametrize("hashing", ["none", "modulo"])
def test_narrow_integer_columns_keep_their_largest_value_and_refuse_their_most_negative(hashing):
    spec = FeatureSpec(name="f", num_embeddings=1000, hashing=hashing)
    assert encode_ids(pa.array([127, 3], pa.int8()), spec, "w")[0].tolist() == [127, 3]
    assert encode_ids(pa.array([255, 0], pa.uint8()), spec, "w")[0].tolist() == [255, 0]
    with pytest.raises(ValueError) as err:  # -128 read as unsigned is 128, below num_embeddings
        encode_ids(pa.array([5, -128], pa.int8()), spec, "w")
    assert str(err.value) == "w, column 'f': negative id -128 at row 1"


def test_log2_buckets_every_value_even_those_below_the_tables_rows():
    """hashing = "log2": each value v >= 0 -> min(bit_length(v), num_embeddings - 1), a value below
    num_embeddings bucketed too (0, 1, 2-3, 4-7, ...); a negative one refused by its row."""
    spec = FeatureSpec(name="dwell", kind="id_list", hashing="log2", num_embeddings=4, embedding_dim=8)
    values, lengths = encode_ids(pa.array([[0, 1, 2, 3], [5, 100]], pa.list_(pa.int64())), spec, "f.parquet")
    assert values.tolist() == [0, 1, 2, 2, 3, 3] and lengths.tolist() == [4, 2]
    small, _ = encode_ids(pa.array([[0, 1, 2, 3]], pa.list_(pa.int64())), spec, "f.parquet")
    assert small.tolist() == [0, 1, 2, 2]  # every value a row already: bucketed all the same
    raw, _ = encode_ids(pa.array([[0, 1, 2, 3], [5, 100]], pa.list_(pa.int64())), spec, "f.parquet", reduce=False)
    assert raw.tolist() == [0, 1, 2, 3, 5, 100]  # the artifact buckets them itself
    with pytest.raises(ValueError) as e:
        encode_ids(pa.array([[3], [1, -2]], pa.list_(pa.int64())), spec, "f.parquet")
    assert str(e.value) == "f.parquet, column 'dwell': negative id -2 at row 1"
