"""Tests for the streaming Parquet reader (trainer.data.reader) and row encoding (trainer.data.encode).

Every file written here has a unique row id in `user` (and the same value in the numeric
feature `price`), so batches can be traced back to the rows they came from.
"""

from __future__ import annotations

import gc
import itertools
import json
import math
import re
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec, validate_features
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader
from trainer.data.store import resolve_files

NUM_ITEMS = 1000
NUM_TAGS = 100


# ----------------------------------------------------------------------------- helpers


def assignment(reader: ParquetReader, epoch: int) -> list[list]:
    """Every rank's pieces of `epoch`, as `reader` computes each rank's."""
    return [reader.assignment.pieces(epoch, r) for r in range(reader.options.world_size)]


def make_table(start: int, n: int) -> pa.Table:
    """Rows start..start+n-1: item = id % NUM_ITEMS, tags a ragged list, price = user = id."""
    ids = np.arange(start, start + n, dtype=np.int64)
    rng = np.random.default_rng(start + 1)
    lens = rng.integers(0, 4, n)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lens, out=offsets[1:])
    tags = pa.ListArray.from_arrays(pa.array(offsets),
                                    pa.array(rng.integers(0, NUM_TAGS, offsets[-1]), pa.int64()))
    return pa.table({
        "item": pa.array(ids % NUM_ITEMS, pa.int64()),
        "tags": tags,
        "price": pa.array(ids.astype(np.float64)),
        "click": pa.array(ids % 2, pa.int64()),
        "user": pa.array(ids, pa.int64()),
    })


def write_files(directory: Path, sizes: list[int], row_group_size: int | list[int]) -> list[Path]:
    """One file per size, consecutive row ids across files."""
    directory.mkdir(parents=True, exist_ok=True)
    rgs = row_group_size if isinstance(row_group_size, list) else [row_group_size] * len(sizes)
    paths, start = [], 0
    for i, (n, rg) in enumerate(zip(sizes, rgs)):
        path = directory / f"part-{i:03d}.parquet"
        pq.write_table(make_table(start, n), path, row_group_size=rg)
        paths.append(path)
        start += n
    return paths


def make_features(**changes: dict) -> list[FeatureSpec]:
    specs = {
        "item": dict(name="item", kind="id", num_embeddings=NUM_ITEMS),
        "tags": dict(name="tags", kind="id_list", num_embeddings=NUM_TAGS),
        "price": dict(name="price", kind="numeric"),
    }
    for name, change in changes.items():
        specs[name].update(change)
    features = [FeatureSpec(**s) for s in specs.values()]
    validate_features(features)
    return features


def make_encoder(user: str = "user", **changes: dict) -> RowEncoder:
    return RowEncoder(make_features(**changes), [TaskSpec(name="click", label="click")], user)


def snap(batch) -> dict[str, np.ndarray]:
    kjt = batch.sparse
    out = {
        "values": kjt.values().numpy().copy(),
        "lengths": kjt.lengths().numpy().copy(),
        "dense": batch.dense.numpy().copy(),
        "labels": batch.labels.numpy().copy(),
        "users": batch.users.numpy().copy(),
        "weights": batch.weights.numpy().copy(),
    }
    out["keys"] = np.array(kjt.keys())
    return out


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=f"batch {i}, {key}")


def users_of(batches: list[dict], real_only: bool = False) -> np.ndarray:
    if not batches:
        return np.zeros(0, np.int64)
    if real_only:
        return np.concatenate([b["users"][b["weights"] == 1] for b in batches])
    return np.concatenate([b["users"] for b in batches])


def err(text: str) -> str:
    return re.escape(text)


# ----------------------------------------------------------------------------- exact resume

RESUME_SIZES = [700, 1300, 500]  # 2500 rows
RESUME_BATCH = 96                # straddles the 400-row windows
RESUME_BUFFER = 350              # windows of 4 row groups of 90-100 rows
RESUME_EPOCHS = 3


def resume_reader(path: Path, **kw) -> ParquetReader:
    args = dict(batch_size=RESUME_BATCH, shuffle_buffer=RESUME_BUFFER, seed=11, num_epochs=RESUME_EPOCHS)
    args.update(kw)
    return ParquetReader(str(path), make_encoder(), ReaderOptions(**args))


@pytest.fixture(scope="module")
def resume_data(tmp_path_factory) -> tuple[Path, list[dict], int]:
    path = tmp_path_factory.mktemp("resume")
    write_files(path, RESUME_SIZES, 90)
    reader = resume_reader(path)
    steps = reader.steps_in_epoch(0)
    batches = [snap(b) for b in reader]
    return path, batches, steps


def test_resume_fixture_is_meaningful(resume_data):
    path, batches, steps = resume_data
    reader = resume_reader(path)
    assert steps == sum(RESUME_SIZES) // RESUME_BATCH == 26
    assert len(batches) == RESUME_EPOCHS * steps
    assert all(len(b["users"]) == RESUME_BATCH for b in batches)
    list(itertools.islice(iter(reader), steps))
    # several windows per epoch, each well below the data
    assert RESUME_BUFFER <= reader.peak_buffered_rows < sum(RESUME_SIZES) / 3
    # the same data is not replayed identically in each epoch
    assert not np.array_equal(users_of(batches[:steps]), users_of(batches[steps:2 * steps]))


@pytest.mark.parametrize("where", ["first", "mid_epoch0", "end_epoch0", "start_epoch1", "mid_epoch1",
                                   "end_epoch1", "last"])
def test_exact_resume(resume_data, where):
    path, reference, steps = resume_data
    k = {"first": 1, "mid_epoch0": steps // 2 + 1, "end_epoch0": steps, "start_epoch1": steps + 1,
         "mid_epoch1": steps + 7, "end_epoch1": 2 * steps, "last": 3 * steps - 1}[where]
    first = resume_reader(path)
    it = iter(first)
    head = [snap(b) for b in itertools.islice(it, k)]
    assert_same(head, reference[:k])
    state = json.loads(json.dumps(first.state_dict()))  # plain, serialisable values
    # the interrupted reader itself goes on unchanged
    assert_same([snap(b) for b in it], reference[k:])

    fresh = resume_reader(path)
    fresh.load_state_dict(state)
    assert_same([snap(b) for b in fresh], reference[k:])


def test_resume_of_an_endless_reader(resume_data):
    path, reference, steps = resume_data
    first = resume_reader(path, num_epochs=0)
    it = iter(first)
    assert_same([snap(b) for b in itertools.islice(it, steps)], reference[:steps])
    state = first.state_dict()
    fresh = resume_reader(path, num_epochs=0)
    fresh.load_state_dict(state)
    assert_same([snap(b) for b in itertools.islice(iter(fresh), 2 * steps)], reference[steps:])


def test_resume_twice_in_a_row(resume_data):
    path, reference, steps = resume_data
    reader, done = resume_reader(path), []
    for k in (5, steps - 3, steps + 10):
        it = iter(reader)
        done += [snap(b) for b in itertools.islice(it, k - len(done))]
        state = reader.state_dict()
        reader = resume_reader(path)
        reader.load_state_dict(state)
    done += [snap(b) for b in reader]
    assert_same(done, reference)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("k", [1, 5, 9, 10])
def test_resume_in_evaluation_keeps_real_rows(tmp_path, rank, k):
    # 1281 rows in row groups 3 x 100 and 3 x 250 + 231: rank 0 reads 640 rows (10 batches of 64),
    # rank 1 641 (11), so rank 0's 11th batch (k=10) is all padding and resuming lands inside it
    write_files(tmp_path, [300, 981], [100, 250])
    kw = dict(batch_size=64, shuffle=False, drop_last=False, rank=rank, world_size=2)
    reference = [snap(b) for b in ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(**kw))]
    assert len(reference) == 11
    first = ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(**kw))
    list(itertools.islice(iter(first), k))
    fresh = ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(**kw))
    fresh.load_state_dict(first.state_dict())
    rest = [snap(b) for b in fresh]
    assert len(rest) == len(reference) - k
    for got, want in zip(rest, reference[k:]):
        assert len(got["users"]) == 64
        np.testing.assert_array_equal(got["weights"], want["weights"])
        real = want["weights"] == 1
        for key in ("users", "dense", "labels"):
            np.testing.assert_array_equal(got[key][real], want[key][real])
    if rank == 0:
        assert (reference[10]["weights"] == 0).all()


@pytest.mark.parametrize("where", ["early", "end_epoch0", "start_epoch1", "late"])
def test_exact_resume_on_second_rank(tmp_path, where):
    write_files(tmp_path, [600, 1800], [150, 700])
    kw = dict(batch_size=50, shuffle_buffer=300, seed=2, num_epochs=2, rank=1, world_size=2)
    reference = [snap(b) for b in ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(**kw))]
    first = ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(**kw))
    steps = first.steps_in_epoch(0)
    assert len(reference) == steps + first.steps_in_epoch(1)
    k = {"early": 3, "end_epoch0": steps, "start_epoch1": steps + 1, "late": len(reference) - 2}[where]
    list(itertools.islice(iter(first), k))
    fresh = ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(**kw))
    fresh.load_state_dict(first.state_dict())
    assert_same([snap(b) for b in fresh], reference[k:])


def test_load_state_dict_with_other_world_size(resume_data):
    path = resume_data[0]
    saved = resume_reader(path, rank=0, world_size=2).state_dict()
    here = resume_reader(path)
    with pytest.raises(ValueError, match=err("saved with world_size=2 but this run has world_size=1")):
        here.load_state_dict(saved)


@pytest.mark.parametrize("key, value", [("seed", 12), ("batch_size", 32), ("shuffle_buffer", 100),
                                        ("row_groups", 5), ("rows", 2499), ("rank", 1), ("shuffle", False)])
def test_load_state_dict_with_other_setting(resume_data, key, value):
    path = resume_data[0]
    state = resume_reader(path).state_dict()
    state[key] = value
    with pytest.raises(ValueError, match=err(f"saved with {key}={value} but this run has {key}=")):
        resume_reader(path).load_state_dict(state)


# ----------------------------------------------------------------------------- coverage, shuffling


@pytest.fixture(scope="module")
def even_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("even")
    write_files(path, [700, 1300, 500], 100)  # 25 row groups of 100 rows
    return path


def epochs_of(path: Path, epochs: int = 2, **kw) -> list[np.ndarray]:
    args = dict(batch_size=125, shuffle_buffer=350, seed=3, num_epochs=epochs)
    args.update(kw)
    reader = ParquetReader(str(path), make_encoder(), ReaderOptions(**args))
    steps = reader.steps_in_epoch(0)
    users = users_of([snap(b) for b in reader])
    assert len(users) == epochs * steps * args["batch_size"]
    return np.split(users, epochs)


def test_every_row_once_per_epoch(even_data):
    for users in epochs_of(even_data, epochs=3):
        np.testing.assert_array_equal(np.sort(users), np.arange(2500))


def test_columns_stay_aligned_through_shuffling(even_data):
    source = pa.concat_tables(pq.read_table(p) for p in sorted(even_data.glob("*.parquet")))
    tags = source.column("tags").to_pylist()
    reader = ParquetReader(str(even_data), make_encoder(), ReaderOptions(batch_size=125, shuffle_buffer=350, seed=5,
                                                                         num_epochs=1))
    seen = 0
    for batch in reader:
        users = batch.users.numpy()
        np.testing.assert_array_equal(batch.dense[:, 0].numpy(), users.astype(np.float32))
        np.testing.assert_array_equal(batch.labels[:, 0].numpy(), (users % 2).astype(np.float32))
        assert batch.dense.dtype == batch.labels.dtype == batch.weights.dtype == torch.float32
        assert batch.users.dtype == batch.sparse.values().dtype == torch.int64
        kjt = batch.sparse.to_dict()
        np.testing.assert_array_equal(kjt["item"].values().numpy(), users % NUM_ITEMS)
        np.testing.assert_array_equal(kjt["item"].lengths().numpy(), np.ones(len(users)))
        assert [t.tolist() for t in kjt["tags"].to_dense()] == [tags[u] for u in users]
        seen += len(users)
    assert seen == 2500


def test_shuffling(even_data):
    e0, e1 = epochs_of(even_data, seed=3)
    file_order = np.arange(2500)
    assert not np.array_equal(e0, file_order)
    assert not np.array_equal(e0, e1)
    # rows are shuffled inside windows, not just row groups reordered
    assert np.mean(np.diff(e0) == 1) < 0.1
    # rows of one window come from several row groups
    assert len(np.unique(e0[:125] // 100)) > 1
    same0, same1 = epochs_of(even_data, seed=3)
    np.testing.assert_array_equal(e0, same0)
    np.testing.assert_array_equal(e1, same1)
    other0, _ = epochs_of(even_data, seed=4)
    assert not np.array_equal(e0, other0)


def test_rows_are_reshuffled_each_epoch_within_one_row_group(tmp_path):
    """One row group, one window: only the window permutation can change the order."""
    write_files(tmp_path, [500], 500)
    e0, e1 = epochs_of(tmp_path, batch_size=100, shuffle_buffer=1000)
    for users in (e0, e1):
        np.testing.assert_array_equal(np.sort(users), np.arange(500))
        assert not np.array_equal(users, np.arange(500))
    assert not np.array_equal(e0, e1)


def test_no_shuffle_reads_file_order(even_data):
    (users,) = epochs_of(even_data, epochs=1, shuffle=False)
    np.testing.assert_array_equal(users, np.arange(2500))


def test_zero_shuffle_buffer_keeps_rows_of_a_row_group_in_order(even_data):
    e0, e1 = epochs_of(even_data, shuffle_buffer=0)
    for users in (e0, e1):
        np.testing.assert_array_equal(np.sort(users), np.arange(2500))
        groups = users.reshape(-1, 100)  # each run of 100 rows is one whole 100-row row group
        assert (np.diff(groups, axis=1) == 1).all()


# ----------------------------------------------------------------------------- memory


def test_bounded_memory(tmp_path):
    rows_per_file, files, rg, buffer = 100_000, 4, 5_000, 20_000
    write_files(tmp_path, [rows_per_file] * files, [rg, rg, 3_000, rg])
    gc.collect()
    baseline = pa.total_allocated_bytes()
    reader = ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(batch_size=4096, shuffle_buffer=buffer, seed=1,
                                                                        num_epochs=1))
    samples, rows = [], 0
    for batch in reader:
        samples.append(pa.total_allocated_bytes() - baseline)
        rows += len(batch)
    assert rows == (files * rows_per_file) // 4096 * 4096
    assert buffer <= reader.peak_buffered_rows <= buffer + rg
    data_bytes = sum(pq.ParquetFile(p).read().nbytes for p in sorted(tmp_path.glob("*.parquet")))
    assert data_bytes > 15_000_000
    # Arrow holds at most the window being encoded (buffer + rg rows, 6.25% of the data: its
    # pieces' id columns are views of Arrow's buffers until the window is concatenated) and the
    # row group decoded ahead of the encoder (DECODE_AHEAD); measured, 4.0 to 5.9 row groups of
    # 5,000 rows (5% to 7.3%). The bound, 8.75%, allows one more row group; a buffer of a whole
    # 100,000-row file holds 25% (measured: 36% to 54%), a read-ahead of 10 row groups 19% to
    # 32%, and the bound of half the data let both through.
    row_bytes = data_bytes / (files * rows_per_file)
    assert max(samples) < (buffer + 3 * rg) * row_bytes, (max(samples), row_bytes)


# ----------------------------------------------------------------------------- several ranks


def rank_epochs(path: Path, world_size: int, **kw) -> list[list[dict]]:
    return [[snap(b) for b in ParquetReader(str(path), make_encoder(),
                                            ReaderOptions(rank=r, world_size=world_size, **kw))]
            for r in range(world_size)]


def test_ranks_read_disjoint_row_groups(tmp_path):
    path = tmp_path
    write_files(path, [800, 1200, 400], 100)  # 24 row groups of 100 rows: 12 per rank
    kw = dict(batch_size=100, shuffle_buffer=250, seed=9, num_epochs=2)
    per_rank = rank_epochs(path, 2, **kw)
    assert len(per_rank[0]) == len(per_rank[1]) == 2 * 12
    for epoch in range(2):
        users = [users_of(b[epoch * 12:(epoch + 1) * 12]) for b in per_rank]
        groups = [set(u // 100) for u in users]
        assert len(groups[0]) == len(groups[1]) == 12
        assert not groups[0] & groups[1]
        np.testing.assert_array_equal(np.sort(np.concatenate(users)), np.arange(2400))
    # the assignment changes between epochs
    assert set(users_of(per_rank[0][:12]) // 100) != set(users_of(per_rank[0][12:]) // 100)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_uneven_files_same_number_of_batches(tmp_path, seed):
    write_files(tmp_path, [600, 1800], [150, 700])  # 4 x 150 rows and 700, 700, 400
    kw = dict(batch_size=50, shuffle_buffer=300, seed=seed, num_epochs=2)
    probe = ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(world_size=2, **kw))
    per_rank = rank_epochs(tmp_path, 2, **kw)
    rows = [[sum(p.num_rows for p in pieces) for pieces in assignment(probe, e)] for e in range(2)]
    assert rows == [[1200, 1200]] * 2  # row ranges, not whole row groups: the ranks are balanced
    steps = [min(r) // 50 for r in rows]
    assert steps == [probe.steps_in_epoch(e) for e in range(2)] == [24, 24]
    assert len(per_rank[0]) == len(per_rank[1]) == sum(steps)
    assert all(len(b["users"]) == 50 for r in per_rank for b in r)
    for epoch, (lo, hi) in enumerate([(0, steps[0]), (steps[0], sum(steps))]):
        users = [users_of(r[lo:hi]) for r in per_rank]
        for rank, u in enumerate(users):
            # every row of the rank's pieces once, and no other row
            mine = np.concatenate([uneven_piece_users(p) for p in assignment(probe, epoch)[rank]])
            np.testing.assert_array_equal(np.sort(u), np.sort(mine))
        np.testing.assert_array_equal(np.sort(np.concatenate(users)), np.arange(2400))


def uneven_piece_users(piece) -> np.ndarray:
    """Row ids of a piece of write_files(..., [600, 1800], [150, 700])."""
    g = piece.group
    first = g.index * 150 if Path(g.path).name == "part-000.parquet" else 600 + g.index * 700
    return first + np.arange(piece.start, piece.stop)


def test_uneven_row_groups_are_cut_into_pieces(tmp_path):
    """Guards the test above: for its seeds the rank boundary falls inside a row group,
    which one rank reads the front of and the other the back."""
    write_files(tmp_path, [600, 1800], [150, 700])
    cut = 0
    for seed in range(4):
        probe = ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(world_size=2, batch_size=50, seed=seed))
        for epoch in range(2):
            first, second = assignment(probe, epoch)
            if first[-1].stop < first[-1].group.num_rows:
                assert second[0].group == first[-1].group and second[0].start == first[-1].stop
                cut += 1
    assert cut >= 4


@pytest.mark.parametrize("batch_size", [64, 100, 1200])
def test_evaluation_over_two_ranks(tmp_path, batch_size):
    write_files(tmp_path, [601, 1800], [150, 700])  # 2401 rows: ranks get 1200 and 1201
    per_rank = rank_epochs(tmp_path, 2, batch_size=batch_size, shuffle=False, drop_last=False)
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    for batches in per_rank:
        for b in batches:
            assert len(b["users"]) == len(b["weights"]) == len(b["labels"]) == len(b["dense"]) == batch_size
            assert len(b["lengths"]) == 2 * batch_size
            assert set(np.unique(b["weights"])) <= {0.0, 1.0}
        weights = np.concatenate([b["weights"] for b in batches])
        real = int(weights.sum())
        np.testing.assert_array_equal(weights, np.r_[np.ones(real), np.zeros(len(weights) - real)])
    real = [users_of(b, real_only=True) for b in per_rank]
    np.testing.assert_array_equal(np.sort(np.concatenate(real)), np.arange(2401))
    assert [len(r) for r in real] == [1200, 1201]
    # padding rows copy real rows, so they carry valid inputs
    padded = [b for r in per_rank for b in r if (b["weights"] == 0).any()]
    assert padded
    for b in padded:
        assert set(b["users"][b["weights"] == 0]) <= set(np.concatenate(real))


def test_evaluation_one_rank_no_padding_needed(even_data):
    batches = [snap(b) for b in ParquetReader(str(even_data), make_encoder(),
                                              ReaderOptions(batch_size=500, shuffle=False, drop_last=False))]
    assert len(batches) == 5
    assert all((b["weights"] == 1).all() for b in batches)
    np.testing.assert_array_equal(users_of(batches), np.arange(2500))


def test_reader_with_fewer_rows_than_a_batch_raises_instead_of_spinning(tmp_path):
    write_files(tmp_path, [30], 10)

    def on_alarm(*_):
        raise TimeoutError("the reader spins without yielding a batch")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        reader = ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(batch_size=64, num_epochs=0))
        with pytest.raises(ValueError, match=err(f"{tmp_path}: a rank gets only 30 rows in epoch 0, "
                                                 "fewer than one batch of 64")):
            next(iter(reader))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_fewer_row_groups_than_ranks(tmp_path):
    """One row group is shared by the ranks, each reading its own row range of it."""
    write_files(tmp_path, [100], 1000)
    per_rank = rank_epochs(tmp_path, 2, batch_size=10, num_epochs=1)
    assert len(per_rank[0]) == len(per_rank[1]) == 5
    users = [users_of(r) for r in per_rank]
    np.testing.assert_array_equal(np.sort(np.concatenate(users)), np.arange(100))
    assert set(users[0]) == set(range(50))  # contiguous halves of the shuffled row group order
    # the only limit left: a rank needs one batch of rows (100 rows over 3 ranks: 33, 33, 34)
    reader = ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(batch_size=34, rank=2, world_size=3))
    with pytest.raises(ValueError, match=err(f"{tmp_path}: a rank gets only 33 rows in epoch 0, "
                                             "fewer than one batch of 34")):
        next(iter(reader))


# ----------------------------------------------------------------------------- bad input

RG = 10      # rows per row group in the files below
BAD_ROW = 3  # row inside row group 1 that carries the bad value


def write_bad(tmp_path: Path, column: str, value, type_: pa.DataType | None = None) -> Path:
    """A 3-row-group file whose `column` has `value` at row BAD_ROW of row group 1."""
    table = make_table(0, 3 * RG)
    values = table.column(column).to_pylist()
    values[RG + BAD_ROW] = value
    col = pa.array(values, type_ or table.schema.field(column).type)
    table = table.set_column(table.schema.get_field_index(column), column, col)
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path, row_group_size=RG)
    return path


def read_all(path: Path, encoder: RowEncoder | None = None) -> list[dict]:
    reader = ParquetReader(str(path), encoder or make_encoder(), ReaderOptions(batch_size=3 * RG, shuffle=False,
                                                                               num_epochs=1))
    return [snap(b) for b in reader]


def where(path: Path, column: str) -> str:
    return f"{path}, row group 1, column {column!r}: "


def test_missing_column(tmp_path):
    path = tmp_path / "f.parquet"
    pq.write_table(make_table(0, 30).drop_columns(["price"]), path)
    with pytest.raises(ValueError, match=err(f"{path}: missing column 'price' (numbers for feature 'price')")):
        read_all(path)


def test_missing_column_in_second_file(tmp_path):
    write_files(tmp_path, [30], 10)
    path = tmp_path / "z.parquet"
    pq.write_table(make_table(30, 30).drop_columns(["user"]), path)
    with pytest.raises(ValueError, match=err(f"{path}: missing column 'user' (integer user ids")):
        read_all(tmp_path)


@pytest.mark.parametrize("column, type_, message", [
    ("item", pa.string(), "column 'item' has type string, expected integer ids for feature 'item'"),
    ("tags", pa.list_(pa.float64()), "column 'tags' has type list<"),
    ("tags", pa.list_(pa.float64()), "expected a list of integer ids for feature 'tags'"),
    ("price", pa.string(), "column 'price' has type string, expected numbers for feature 'price'"),
    ("click", pa.string(), "column 'click' has type string, expected 0/1 labels for task 'click'"),
    ("user", pa.float64(), "column 'user' has type double, expected integer user ids"),
])
def test_wrong_column_type(tmp_path, column, type_, message):
    table = make_table(0, 30)
    values = table.column(column).to_pylist()
    if pa.types.is_string(type_):
        values = [str(v) for v in values]
    col = pa.array(values, type_) if not pa.types.is_list(type_) else pa.array(
        [[float(x) for x in v] for v in values], type_)
    table = table.set_column(table.schema.get_field_index(column), column, col)
    path = tmp_path / "f.parquet"
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=err(f"{path}: ") + ".*" + err(message)):
        read_all(path)


@pytest.mark.parametrize("column, value, message", [
    ("click", None, f"null label at row {BAD_ROW}"),
    ("click", 2, f"label must be 0 or 1, got 2.0 at row {BAD_ROW}"),
    ("click", -1, f"label must be 0 or 1, got -1.0 at row {BAD_ROW}"),
    ("item", -5, f"negative id -5 at row {BAD_ROW}"),
    ("tags", [1, -7], f"negative id -7 at row {BAD_ROW}"),
    ("tags", [1, None], f"null id inside the list at row {BAD_ROW}"),
    ("price", math.nan, f"non-finite value nan at row {BAD_ROW}"),
    ("price", math.inf, f"non-finite value inf at row {BAD_ROW}"),
    ("price", -math.inf, f"non-finite value -inf at row {BAD_ROW}"),
    ("price", None, f"null value at row {BAD_ROW} (set features.price.fill_null to replace nulls)"),
    ("user", None, "null user id"),
])
def test_bad_values_name_file_row_group_column_and_row(tmp_path, column, value, message):
    path = write_bad(tmp_path, column, value)
    with pytest.raises(ValueError, match=err(where(path, column) + message)):
        read_all(path)


def test_bad_row_after_nulls_and_ragged_rows(tmp_path):
    """Row numbers count null ids and empty lists that precede the bad value."""
    table = make_table(0, 30)
    items = table.column("item").to_pylist()
    items[10], items[11], items[14] = None, None, -1
    tags = [[1, 2, 3], None, [], [4], [5, -2, 6]] + [[7]] * 25
    table = table.set_column(0, "item", pa.array(items, pa.int64()))
    path = tmp_path / "f.parquet"
    pq.write_table(table, path, row_group_size=10)
    with pytest.raises(ValueError, match=err(f"{path}, row group 1, column 'item': negative id -1 at row 4")):
        read_all(path)
    table = make_table(0, 30).set_column(1, "tags", pa.array(tags, pa.list_(pa.int64())))
    pq.write_table(table, path, row_group_size=10)
    with pytest.raises(ValueError, match=err(f"{path}, row group 0, column 'tags': negative id -2 at row 4")):
        read_all(path)


def test_id_out_of_range_without_hashing(tmp_path):
    path = write_bad(tmp_path, "item", NUM_ITEMS + 3)
    encoder = make_encoder(item=dict(hashing="none"))
    message = (f"id {NUM_ITEMS + 3} at row {BAD_ROW} is out of range for num_embeddings={NUM_ITEMS} "
               "(features.item.hashing is 'none')")
    with pytest.raises(ValueError, match=err(where(path, "item") + message)):
        read_all(path, encoder)
    # exactly num_embeddings is already out of range; num_embeddings - 1 is fine
    path = write_bad(tmp_path, "item", NUM_ITEMS)
    with pytest.raises(ValueError, match=err(where(path, "item") + f"id {NUM_ITEMS} at row {BAD_ROW}")):
        read_all(path, encoder)
    path = write_bad(tmp_path, "item", NUM_ITEMS - 1)
    (batch,) = read_all(path, encoder)
    assert batch["values"][RG + BAD_ROW] == NUM_ITEMS - 1


def test_id_out_of_range_is_reduced_with_modulo_hashing(tmp_path):
    path = write_bad(tmp_path, "item", 7 * NUM_ITEMS + 3)
    (batch,) = read_all(path, make_encoder(item=dict(hashing="modulo")))
    items = batch["values"][:3 * RG]  # the first key's values: one id per row
    assert items[RG + BAD_ROW] == 3
    np.testing.assert_array_equal(np.delete(items, RG + BAD_ROW), np.delete(np.arange(3 * RG), RG + BAD_ROW))
    path = write_bad(tmp_path, "tags", [NUM_TAGS, 2 * NUM_TAGS + 5, 1])
    (batch,) = read_all(path, make_encoder(tags=dict(hashing="modulo")))
    kjt_lengths = batch["lengths"][3 * RG:]
    start = 3 * RG + kjt_lengths[:RG + BAD_ROW].sum()
    assert kjt_lengths[RG + BAD_ROW] == 3
    assert batch["values"][start:start + 3].tolist() == [0, 5, 1]


def test_uint64_ids_above_int64_range_are_hashed(tmp_path):
    big = 2**63 + 5
    table = make_table(0, 3 * RG)
    table = table.set_column(0, "item", pa.array([big] + list(range(1, 3 * RG)), pa.uint64()))
    path = tmp_path / "f.parquet"
    pq.write_table(table, path, row_group_size=RG)
    (batch,) = read_all(path, make_encoder(item=dict(hashing="modulo")))
    assert batch["values"][0] == big % NUM_ITEMS


def test_null_numeric_accepted_with_fill_null(tmp_path):
    path = write_bad(tmp_path, "price", None)
    (batch,) = read_all(path, make_encoder(price=dict(fill_null=-1.5)))
    dense = batch["dense"][:, 0]
    assert dense[RG + BAD_ROW] == -1.5
    expected = np.arange(3 * RG, dtype=np.float32)
    expected[RG + BAD_ROW] = -1.5
    np.testing.assert_array_equal(dense, expected)


def test_null_in_integer_numeric_column(tmp_path):
    counts = pa.array([None if i == RG + BAD_ROW else i for i in range(3 * RG)], pa.int64())
    path = tmp_path / "f.parquet"
    pq.write_table(make_table(0, 3 * RG).append_column("count", counts), path, row_group_size=RG)
    features = [FeatureSpec(name="count", kind="numeric")]
    validate_features(features)
    encoder = RowEncoder(features, [TaskSpec(name="click", label="click")])
    with pytest.raises(ValueError, match=err(where(path, "count") + f"null value at row {BAD_ROW}")):
        read_all(path, encoder)
    features[0].fill_null = 0.5
    (batch,) = read_all(path, encoder)
    expected = np.arange(3 * RG, dtype=np.float32)
    expected[RG + BAD_ROW] = 0.5
    np.testing.assert_array_equal(batch["dense"][:, 0], expected)


def test_log1p_of_value_below_minus_one(tmp_path):
    path = write_bad(tmp_path, "price", -2.0)
    with pytest.raises(ValueError, match=err(where(path, "price") + f"log1p needs values > -1, got -2.0 "
                                                                   f"at row {BAD_ROW}")):
        read_all(path, make_encoder(price=dict(transform=["log1p"])))
    path = write_bad(tmp_path, "price", -1.0)
    with pytest.raises(ValueError, match=err(where(path, "price") + "log1p needs values > -1, got -1.0")):
        read_all(path, make_encoder(price=dict(transform=["log1p"])))


def test_numeric_transforms_in_order(tmp_path):
    path = tmp_path / "f.parquet"
    pq.write_table(make_table(0, 30), path, row_group_size=RG)
    (batch,) = read_all(path, make_encoder(price=dict(transform=["log1p", "clip", "standardize"],
                                                      clip_min=0.5, clip_max=3.0, mean=1.0, std=2.0)))
    x = np.arange(30, dtype=np.float64)
    expected = ((np.clip(np.log1p(x), 0.5, 3.0) - 1.0) / 2.0).astype(np.float32)
    np.testing.assert_allclose(batch["dense"][:, 0], expected, rtol=1e-6)


def test_truncated_parquet_file(tmp_path):
    write_files(tmp_path, [30], 10)
    path = tmp_path / "part-000.parquet"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=err(f"cannot read Parquet file {path}")):
        read_all(tmp_path)


def test_not_a_parquet_file(tmp_path):
    write_files(tmp_path, [30], 10)
    path = tmp_path / "part-001.parquet"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match=err(f"cannot read Parquet file {path}")):
        read_all(tmp_path)


def test_of_two_unreadable_files_the_first_is_named(tmp_path):
    write_files(tmp_path, [30, 30, 30, 30], 10)  # footers are read concurrently: the error is still the first's
    for name in ("part-001.parquet", "part-003.parquet"):
        (tmp_path / name).write_bytes(b"not parquet" * 100)
    with pytest.raises(ValueError, match=err(f"cannot read Parquet file {tmp_path / 'part-001.parquet'}")):
        read_all(tmp_path)


def test_corrupted_row_group(tmp_path):
    path = tmp_path / "f.parquet"
    pq.write_table(make_table(0, 30), path, row_group_size=RG)
    rg = pq.ParquetFile(path).metadata.row_group(1)
    columns = [rg.column(i) for i in range(rg.num_columns)]
    start = min(c.data_page_offset for c in columns)
    end = max(c.data_page_offset + c.total_compressed_size for c in columns)
    data = bytearray(path.read_bytes())
    data[start:end] = b"\xff" * (end - start)
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=err(f"cannot read {path}, row group 1: ")):
        read_all(path)


def test_path_not_found(tmp_path):
    missing = tmp_path / "nothing-here"
    with pytest.raises(ValueError, match=err(f"data path not found: {missing}")):
        read_all(missing)
    write_files(tmp_path, [30], 10)
    spec = f"{tmp_path / 'part-000.parquet'},{missing}"
    with pytest.raises(ValueError, match=err(f"data path not found: {missing}")):
        ParquetReader(spec, make_encoder(), ReaderOptions(batch_size=10))


def test_max_len_keeps_the_last_ids_and_null_lists_are_empty(tmp_path):
    tags = [[1, 2, 3, 4, 5], [6], [], None, [7, 8, 9], [10, 11]]
    table = make_table(0, 6).set_column(1, "tags", pa.array(tags, pa.list_(pa.int64())))
    items = table.column("item").to_pylist()
    items[2] = None
    table = table.set_column(0, "item", pa.array(items, pa.int64()))
    path = tmp_path / "f.parquet"
    pq.write_table(table, path, row_group_size=3)
    for kind in ("id_list", "sequence"):
        reader = ParquetReader(str(path), make_encoder(tags=dict(kind=kind, max_len=2)),
                               ReaderOptions(batch_size=6, shuffle=False, num_epochs=1))
        (batch,) = list(reader)
        kjt = batch.sparse.to_dict()
        assert kjt["tags"].lengths().tolist() == [2, 1, 0, 0, 2, 2]
        assert kjt["tags"].values().tolist() == [4, 5, 6, 8, 9, 10, 11]
        assert kjt["item"].lengths().tolist() == [1, 1, 0, 1, 1, 1]  # a null id is an empty bag
        assert kjt["item"].values().tolist() == [0, 1, 3, 4, 5]
    (batch,) = list(ParquetReader(str(path), make_encoder(), ReaderOptions(batch_size=6, shuffle=False, num_epochs=1)))
    kjt = batch.sparse.to_dict()
    assert kjt["tags"].lengths().tolist() == [5, 1, 0, 0, 3, 2]  # max_len 0 keeps all
    assert kjt["tags"].values().tolist() == list(range(1, 12))


def test_boolean_labels_and_no_user_column(tmp_path):
    table = make_table(0, 30)
    table = table.set_column(3, "click", pa.array([i % 3 == 0 for i in range(30)]))
    path = tmp_path / "f.parquet"
    pq.write_table(table.drop_columns(["user"]), path, row_group_size=10)
    (batch,) = read_all(path.parent, make_encoder(user=""))
    assert batch["labels"][:, 0].tolist() == [float(i % 3 == 0) for i in range(30)]
    assert (batch["users"] == 0).all()


# ----------------------------------------------------------------------------- resolve_files


def test_resolve_directory_recursive_and_sorted(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "deep").mkdir(parents=True)
    for rel in ["z.parquet", "b/y.parquet", "a/deep/x.parquet", "a/w.parquet"]:
        pq.write_table(make_table(0, 5), tmp_path / rel)
    (tmp_path / "notes.txt").write_text("not data")
    (tmp_path / "a" / "x.parquet.tmp").write_text("not data")
    fs, files = resolve_files(str(tmp_path))
    assert fs.type_name == "local"
    expected = sorted(str(tmp_path / rel) for rel in ["z.parquet", "b/y.parquet", "a/deep/x.parquet",
                                                      "a/w.parquet"])
    assert files == expected
    reader = ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(batch_size=5))
    assert reader.num_rows == 20


def test_resolve_glob(tmp_path):
    for name in ["part-2.parquet", "part-1.parquet", "other.parquet"]:
        pq.write_table(make_table(0, 5), tmp_path / name)
    _, files = resolve_files(str(tmp_path / "part-*.parquet"))
    assert files == [str(tmp_path / "part-1.parquet"), str(tmp_path / "part-2.parquet")]
    _, files = resolve_files(str(tmp_path / "*.parquet"))
    assert len(files) == 3
    with pytest.raises(ValueError, match=err("no Parquet files found at")):
        resolve_files(str(tmp_path / "nomatch-*.parquet"))


def test_resolve_comma_separated_list(tmp_path):
    (tmp_path / "d").mkdir()
    for name in ["a.parquet", "b.parquet", "d/c.parquet", "d/e.parquet"]:
        pq.write_table(make_table(0, 5), tmp_path / name)
    spec = f"{tmp_path / 'b.parquet'}, {tmp_path / 'd'} ,{tmp_path / 'a.parquet'},"
    _, files = resolve_files(spec)
    assert files == [str(tmp_path / n) for n in ["b.parquet", "d/c.parquet", "d/e.parquet", "a.parquet"]]


def test_resolve_relative_path(tmp_path, monkeypatch):
    pq.write_table(make_table(0, 5), tmp_path / "a.parquet")
    monkeypatch.chdir(tmp_path)
    _, files = resolve_files("a.parquet")
    assert files == [str(tmp_path / "a.parquet")]


def test_resolve_empty(tmp_path):
    with pytest.raises(ValueError, match=err(f"no Parquet files found at {str(tmp_path)!r}")):
        resolve_files(str(tmp_path))
    with pytest.raises(ValueError, match=err("no Parquet files found at ''")):
        resolve_files("")
