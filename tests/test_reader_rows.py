"""The column-wise encoding and batch assembly (trainer.data.ids.encode_ids, trainer.data.batch.Rows)
against plain per-row Python references, on random data with the edge cases: nulls, null
and empty lists, lists longer than max_len, uint64 ids above 2^63, narrow integer types,
ids at the table boundary, batches straddling windows, shuffled windows, padding."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec, validate_features
from trainer.data.batch import Rows
from trainer.data.encode import RowEncoder
from trainer.data.ids import encode_ids
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader


def ref_ids(values: list, spec: FeatureSpec) -> list[list[int]]:
    """Per row: the bag of valid ids, one Python int at a time."""
    out = []
    for v in values:
        bag = [] if v is None else (list(v) if isinstance(v, list) else [v])
        bag = [x % spec.num_embeddings if spec.hashing == "modulo" else x for x in bag]
        out.append(bag[-spec.max_len:] if spec.max_len and bag else bag)
    return out


def bags(values: np.ndarray, lengths: np.ndarray | None, n: int) -> list[list[int]]:
    lengths = np.ones(n, np.int64) if lengths is None else lengths
    assert lengths.dtype == np.int64 and values.dtype == np.int64 and len(lengths) == n
    ends = np.cumsum(lengths)
    return [values[e - k:e].tolist() for e, k in zip(ends, lengths)]


def random_column(rng, n: int, kind: str, typ: pa.DataType, high: int, null_p: float) -> pa.Array:
    nulls = rng.random(n) < null_p
    if kind == "id":
        raw = rng.integers(0, high, n, dtype=np.uint64 if typ == pa.uint64() else np.int64)
        return pa.array(raw, typ, mask=nulls if null_p else None)
    lens = rng.integers(0, 12, n)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lens, out=offsets[1:])
    flat = pa.array(rng.integers(0, high, offsets[-1], dtype=np.uint64 if typ == pa.uint64() else np.int64), typ)
    return pa.ListArray.from_arrays(pa.array(offsets), flat, mask=pa.array(nulls) if null_p else None)


CASES = [  # kind, value type, id range, num_embeddings, hashing, max_len, null probability
    ("id", pa.int64(), 50, 50, "none", 0, 0.0),
    ("id", pa.int64(), 50, 50, "none", 0, 0.3),
    ("id", pa.int32(), 1000, 37, "modulo", 0, 0.2),
    ("id", pa.uint64(), 2**64 - 1, 1_000_003, "modulo", 0, 0.1),
    ("id", pa.uint64(), 10, 11, "none", 0, 0.0),
    ("id", pa.int16(), 40, 41, "modulo", 0, 0.0),   # every id in range: the one-pass path
    ("id_list", pa.int64(), 100, 100, "none", 0, 0.0),
    ("id_list", pa.int64(), 10**12, 997, "modulo", 0, 0.25),
    ("sequence", pa.int64(), 30, 30, "none", 5, 0.1),
    ("sequence", pa.uint64(), 2**64 - 1, 2**40, "modulo", 3, 0.0),
    ("sequence", pa.int32(), 500, 500, "none", 11, 0.0),  # no list longer than max_len
]


@pytest.mark.parametrize("kind,typ,high,num,hashing,max_len,null_p", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_encode_ids_matches_per_row_reference(kind, typ, high, num, hashing, max_len, null_p, seed):
    rng = np.random.default_rng(seed)
    n = 700
    column = random_column(rng, n, kind, typ, high, null_p)
    spec = FeatureSpec(name="f", kind=kind, num_embeddings=num, hashing=hashing, max_len=max_len)
    chunked = pa.chunked_array([column.slice(0, 300), column.slice(300)])  # also several chunks
    for col in (column, chunked, pa.chunked_array([column])):
        values, lengths = encode_ids(col, spec, "w")
        assert bags(values, lengths, n) == ref_ids(column.to_pylist(), spec)


@pytest.mark.parametrize("typ", [pa.int64(), pa.int32(), pa.uint64()])
def test_range_check_at_the_boundary(typ):
    spec = FeatureSpec(name="f", num_embeddings=100, hashing="none")
    ok = pa.array([0, 99, 5], typ)
    assert encode_ids(ok, spec, "w")[0].tolist() == [0, 99, 5]
    with pytest.raises(ValueError, match="w, column 'f': id 100 at row 2 is out of range for num_embeddings=100"):
        encode_ids(pa.array([0, 99, 100, 3], typ), spec, "w")
    modulo = FeatureSpec(name="f", num_embeddings=100, hashing="modulo")
    assert encode_ids(pa.array([0, 99, 100, 250], typ), modulo, "w")[0].tolist() == [0, 99, 0, 50]


def test_negative_ids_are_errors_in_both_modes():
    for hashing in ("none", "modulo"):
        spec = FeatureSpec(name="f", num_embeddings=100, hashing=hashing)
        with pytest.raises(ValueError, match="w, column 'f': negative id -1 at row 1"):
            encode_ids(pa.array([3, -1, 200]), spec, "w")
        lst = pa.array([[1], [], [2, 3, -4]], pa.list_(pa.int64()))
        with pytest.raises(ValueError, match="w, column 'f': negative id -4 at row 2"):
            encode_ids(lst, FeatureSpec(name="f", kind="id_list", num_embeddings=100, hashing=hashing), "w")


def test_uint64_above_2_63_is_reduced_not_wrapped():
    spec = FeatureSpec(name="f", num_embeddings=1000, hashing="modulo")
    big = [2**64 - 1, 2**63, 2**63 + 999]
    assert encode_ids(pa.array(big, pa.uint64()), spec, "w")[0].tolist() == [x % 1000 for x in big]


# ----------------------------------------------------------------------------- Rows


def random_rows(rng, n: int, flat_null: bool = False) -> tuple[Rows, list[dict]]:
    """Rows with a flat feature, an (optionally) null-holding id feature and a jagged one,
    plus the same rows as Python dicts."""
    lens = rng.integers(0, 6, n)
    tags = [rng.integers(0, 100, k).tolist() for k in lens]
    item = rng.integers(0, 100, n)
    present = rng.random(n) > 0.3 if flat_null else np.ones(n, bool)
    dense = rng.random((n, 2)).astype(np.float32)
    labels = rng.integers(0, 2, (n, 1)).astype(np.float32)
    users = rng.integers(0, 10**6, n)
    rows = Rows.build(["item", "opt", "tags"],
                      [item, item[present] + 1, np.array(sum(tags, []), np.int64)],
                      [None, None if present.all() else present.astype(np.int64), lens.astype(np.int64)],
                      dense, labels, users)
    ref = [{"item": [int(item[i])], "opt": [int(item[i]) + 1] if present[i] else [], "tags": tags[i],
            "dense": dense[i].tolist(), "labels": labels[i].tolist(), "user": int(users[i])} for i in range(n)]
    return rows, ref


def assert_rows(rows: Rows, ref: list[dict]) -> None:
    """The batch of `rows` is what the per-feature, per-row reference assembles."""
    batch = rows.to_batch()
    kjt = batch.sparse
    assert kjt.keys() == ["item", "opt", "tags"]
    expect_lengths = [len(r[k]) for k in kjt.keys() for r in ref]
    expect_values = [v for k in kjt.keys() for r in ref for v in r[k]]
    assert kjt.lengths().tolist() == expect_lengths
    assert kjt.values().tolist() == expect_values
    assert batch.dense.tolist() == [r["dense"] for r in ref]
    assert batch.labels.tolist() == [r["labels"] for r in ref]
    assert batch.users.tolist() == [r["user"] for r in ref]
    assert batch.weights.tolist() == [1.0] * len(ref)
    for t in (kjt.values(), kjt.lengths(), batch.dense, batch.labels, batch.users):
        assert t.is_contiguous()


@pytest.mark.parametrize("flat_null", [False, True])
def test_rows_slice_take_concat_match_reference(flat_null):
    rng = np.random.default_rng(7)
    a, ref_a = random_rows(rng, 200, flat_null)
    b, ref_b = random_rows(rng, 150, not flat_null)
    assert_rows(a, ref_a)
    assert_rows(a.slice(17, 90), ref_a[17:90])
    assert_rows(a.slice(17, 90).slice(5, 40), ref_a[22:57])
    assert_rows(a.slice(190, 500), ref_a[190:])
    index = rng.permutation(200)[:120]
    assert_rows(a.take(index), [ref_a[i] for i in index])
    assert_rows(a.slice(50, 150).take([3, 3, 0, 99]), [ref_a[i] for i in (53, 53, 50, 149)])
    joined = Rows.concat([a.slice(150), b, a.slice(0, 10).take([9, 1])])
    assert_rows(joined, ref_a[150:] + ref_b + [ref_a[9], ref_a[1]])
    assert_rows(joined.slice(40, 70).take(np.arange(29, -1, -1)), (ref_a[150:] + ref_b)[40:70][::-1])


def test_batches_do_not_share_memory_with_the_window():
    rows, _ = random_rows(np.random.default_rng(0), 64)
    batch = rows.slice(0, 64).to_batch()
    batch.dense.zero_()
    batch.sparse.values().zero_()
    assert rows.dense.any() and rows.values[0].any()


# ----------------------------------------------------------------------------- the reader


def features() -> list[FeatureSpec]:
    fs = [FeatureSpec(name="item", num_embeddings=1000, hashing="none"),
          FeatureSpec(name="cat", num_embeddings=13, hashing="modulo"),
          FeatureSpec(name="hist", kind="sequence", num_embeddings=1000, hashing="none", max_len=4),
          FeatureSpec(name="price", kind="numeric")]
    validate_features(fs)
    return fs


def write(path, n: int, rg: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    hist = random_column(rng, n, "sequence", pa.int64(), 1000, 0.1)
    table = pa.table({"item": pa.array(np.arange(n) % 1000), "cat": random_column(rng, n, "id", pa.int64(), 99, 0.2),
                      "hist": hist, "price": pa.array(rng.random(n)), "click": pa.array(rng.integers(0, 2, n)),
                      "user": pa.array(np.arange(n) + seed * 10**6)})
    pq.write_table(table, path, row_group_size=rg)
    return table


def reference_epoch(tables: list[tuple[str, pa.Table, int]], reader: ParquetReader, epoch: int) -> list[dict]:
    """The reader's documented order, row by row: row groups permuted with (seed, epoch),
    windows of >= shuffle_buffer rows each permuted with (seed, epoch, rank, window)."""
    groups = [(t, i, rg) for _, t, rg in tables for i in range(-(-t.num_rows // rg))]
    order = np.random.default_rng([reader.options.seed, epoch]).permutation(len(groups))
    windows, size = [[]], 0
    for g in order:
        if windows[-1] and size >= reader.options.shuffle_buffer:
            windows.append([])
            size = 0
        t, i, rg = groups[g]
        windows[-1] += t.slice(i * rg, rg).to_pylist()
        size += min(rg, t.num_rows - i * rg)
    spec = {f.name: f for f in features()}
    rows = []
    for w, window in enumerate(windows):
        perm = np.random.default_rng([reader.options.seed, epoch, 0, w]).permutation(len(window))
        rows += [window[j] for j in perm]
    return [{"item": ref_ids([r["item"]], spec["item"])[0], "cat": ref_ids([r["cat"]], spec["cat"])[0],
             "hist": ref_ids([r["hist"]], spec["hist"])[0], "dense": [np.float32(r["price"])],
             "labels": [float(r["click"])], "user": r["user"]} for r in rows]


def test_shuffled_reader_matches_row_by_row_reference(tmp_path):
    tables = [(f"p{i}", write(tmp_path / f"p{i}.parquet", n, rg, i), rg)
              for i, (n, rg) in enumerate([(500, 64), (333, 100), (97, 97)])]
    encoder = RowEncoder(features(), [TaskSpec(name="click", label="click")], "user")
    batch = 70
    reader = ParquetReader(str(tmp_path), encoder,
                           ReaderOptions(batch_size=batch, shuffle_buffer=150, seed=5, num_epochs=2))
    got = list(reader)
    steps = 930 // batch
    assert len(got) == 2 * steps
    for epoch in range(2):
        ref = reference_epoch(tables, reader, epoch)
        for k in range(steps):
            b, rows = got[epoch * steps + k], ref[k * batch:(k + 1) * batch]
            kjt = b.sparse
            assert kjt.lengths().tolist() == [len(r[f]) for f in ("item", "cat", "hist") for r in rows]
            assert kjt.values().tolist() == [v for f in ("item", "cat", "hist") for r in rows for v in r[f]]
            assert b.dense.tolist() == [r["dense"] for r in rows]
            assert b.labels.tolist() == [r["labels"] for r in rows]
            assert b.users.tolist() == [r["user"] for r in rows]
