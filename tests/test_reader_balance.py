"""Any dataset on any number of ranks (trainer.data.assignment): row groups of any sizes, fewer
row groups than ranks, are cut into row ranges so that ranks read disjoint rows, get equal
step counts, lose fewer than world_size * batch_size rows an epoch and resume exactly.

The files have a unique row id in `user` (equal to `price`), and rows are numbered
across files in file order, so every batch row can be traced to its source row.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec, validate_features
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader

# 7 + 1000 + 33 rows; row groups 3,3,1 | 10 x 97 + 30 | 10,10,10,3: odd, very uneven sizes
SIZES, ROW_GROUPS = [7, 1000, 33], [3, 97, 10]
ROWS = sum(SIZES)
BATCH = 32


def write(directory: Path, sizes: list[int], row_groups: list[int]) -> Path:
    start = 0
    for i, (n, rg) in enumerate(zip(sizes, row_groups)):
        ids = np.arange(start, start + n, dtype=np.int64)
        table = pa.table({"item": ids % 50, "price": ids.astype(np.float64), "click": ids % 2, "user": ids})
        pq.write_table(table, directory / f"part-{i}.parquet", row_group_size=rg)
        start += n
    return directory


def encoder() -> RowEncoder:
    features = [FeatureSpec(name="item", kind="id", num_embeddings=50), FeatureSpec(name="price", kind="numeric")]
    validate_features(features)
    return RowEncoder(features, [TaskSpec(name="click", label="click")], "user")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write(tmp_path_factory.mktemp("uneven"), SIZES, ROW_GROUPS)


def reader(path: Path, **kw) -> ParquetReader:
    args = dict(batch_size=BATCH, shuffle_buffer=100, seed=4, num_epochs=2)
    args.update(kw)
    return ParquetReader(str(path), encoder(), ReaderOptions(**args))


def users(batches) -> list[np.ndarray]:
    return [b.users.numpy().copy() for b in batches]


def run(path: Path, world: int, **kw) -> list[list[np.ndarray]]:
    """Per rank, the user ids of each batch of a whole run."""
    return [users(reader(path, rank=r, world_size=world, **kw)) for r in range(world)]


MODES = [dict(shuffle=True), dict(shuffle=True, shuffle_buffer=0), dict(shuffle=False)]


@pytest.mark.parametrize("mode", MODES, ids=["shuffled", "no_buffer", "unshuffled"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_training_rows_are_disjoint_balanced_and_lose_less_than_a_batch_per_rank(data, world, mode):
    per_rank = run(data, world, **mode)
    probe = reader(data, world_size=world, **mode)
    steps = probe.steps_in_epoch(0)
    assert [len(r) for r in per_rank] == [2 * steps] * world  # equal step counts, from the footers alone
    for epoch in range(2):
        rows = np.concatenate([np.concatenate(r[epoch * steps:(epoch + 1) * steps]) for r in per_rank])
        assert len(np.unique(rows)) == len(rows) == steps * BATCH * world  # no row twice: disjoint ranks
        assert set(rows) <= set(range(ROWS))
        assert len(rows) >= ROWS - world * BATCH  # the documented bound on data loss
        counts = probe.epoch_rows(epoch)
        assert (counts.rows, counts.used, counts.dropped) == (ROWS, len(rows), ROWS - len(rows))
    interleaved = world > 1 and not mode["shuffle"]
    assert steps == (ROWS // (world * BATCH) if interleaved else (ROWS // world) // BATCH)


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_loss_bound_is_tight(tmp_path, shuffle):
    """287 rows over 3 ranks: contiguous slices of 95, 96, 96 rows give 2 batches of 32 each,
    and interleaving 2 full rounds of 96 and a partial one: 95 = 3 * 32 - 1 rows left out."""
    write(tmp_path, [287], [40])
    probe = reader(tmp_path, world_size=3, shuffle=shuffle)
    assert probe.epoch_rows(0).dropped == 3 * BATCH - 1
    per_rank = run(tmp_path, 3, shuffle=shuffle, num_epochs=1)
    rows = np.concatenate([np.concatenate(r) for r in per_rank])
    assert len(np.unique(rows)) == len(rows) == 287 - (3 * BATCH - 1)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_contiguous_slices_match_an_independent_reference(data, world):
    """Without a shuffle buffer a rank's rows are exactly its slice [r*N/W, (r+1)*N/W) of the
    row groups laid end to end in the epoch's order, as computed here from the files."""
    groups = []  # (first row id, rows) of every row group, in file order
    start = 0
    for n, rg in zip(SIZES, ROW_GROUPS):
        groups += [(start + k, min(rg, n - k)) for k in range(0, n, rg)]
        start += n
    per_rank = run(data, world, shuffle=True, shuffle_buffer=0)
    steps = len(per_rank[0]) // 2
    for epoch in range(2):
        order = np.random.default_rng([4, epoch]).permutation(len(groups))
        laid = np.concatenate([np.arange(groups[i][0], groups[i][0] + groups[i][1]) for i in order])
        for rank in range(world):
            mine = laid[rank * ROWS // world:(rank + 1) * ROWS // world]
            got = np.concatenate(per_rank[rank][epoch * steps:(epoch + 1) * steps])
            np.testing.assert_array_equal(got, mine[:steps * BATCH])


@pytest.mark.parametrize("world", [2, 3])
def test_unshuffled_global_batches_equal_one_rank_with_world_times_the_batch(data, world):
    """Interleaving at batch granularity: global step k is rows [k*W*B, (k+1)*W*B) in file order."""
    many = run(data, world, shuffle=False)
    one = users(reader(data, shuffle=False, batch_size=world * BATCH))
    assert len(one) == len(many[0]) > 0
    for k, batch in enumerate(one):
        np.testing.assert_array_equal(np.concatenate([r[k] for r in many]), batch)
    np.testing.assert_array_equal(one[0], np.arange(world * BATCH))


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("batch", [32, 45, 400])
def test_evaluation_reads_every_row_exactly_once(data, world, batch):
    per_rank = [list(reader(data, rank=r, world_size=world, batch_size=batch, shuffle=False, drop_last=False))
                for r in range(world)]
    assert len({len(r) for r in per_rank}) == 1
    real = [np.concatenate([b.users.numpy()[b.weights.numpy() == 1] for b in r]) for r in per_rank]
    np.testing.assert_array_equal(np.sort(np.concatenate(real)), np.arange(ROWS))
    assert max(map(len, real)) - min(map(len, real)) <= 1  # balanced to one row
    assert reader(data, world_size=world, drop_last=False).epoch_rows(0).dropped == 0


# a shuffle buffer over a rank's whole share (1040 / world rows) makes one window an epoch
@pytest.mark.parametrize("mode", [*MODES, dict(shuffle=True, shuffle_buffer=ROWS)],
                         ids=["shuffled", "no_buffer", "unshuffled", "buffer_over_a_share"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_resume_mid_epoch_matches_an_uninterrupted_run(data, world, mode):
    reference = run(data, world, **mode)
    steps = len(reference[0]) // 2
    for rank in range(world):
        for k in (steps // 2, steps + steps // 3):
            first = reader(data, rank=rank, world_size=world, **mode)
            head = users(itertools.islice(iter(first), k))
            fresh = reader(data, rank=rank, world_size=world, **mode)
            fresh.load_state_dict(first.state_dict())
            for got, want in zip(head + users(fresh), reference[rank], strict=True):
                np.testing.assert_array_equal(got, want)


def test_more_ranks_than_row_groups(tmp_path):
    write(tmp_path, [90], [90])  # one row group, 4 ranks
    per_rank = run(tmp_path, 4, batch_size=10, num_epochs=1)
    assert [len(r) for r in per_rank] == [2] * 4
    rows = np.concatenate([np.concatenate(r) for r in per_rank])
    assert len(np.unique(rows)) == 80
    evaluation = [np.concatenate([b.users.numpy()[b.weights.numpy() == 1] for b in
                                  reader(tmp_path, rank=r, world_size=4, batch_size=10, drop_last=False)])
                  for r in range(4)]
    np.testing.assert_array_equal(np.sort(np.concatenate(evaluation)), np.arange(90))


def test_bad_value_in_a_shared_row_group_names_the_piece(tmp_path):
    """The encoder numbers rows from the first row of the piece it is given."""
    ids = np.arange(30, dtype=np.int64)
    price = ids.astype(np.float64)
    price[20] = np.nan
    path = tmp_path / "f.parquet"
    pq.write_table(pa.table({"item": ids, "price": price, "click": ids % 2, "user": ids}), path, row_group_size=30)
    # rank 1 of 2 reads rows 15..29 of the only row group
    bad = reader(tmp_path, batch_size=5, rank=1, world_size=2, shuffle=False, drop_last=False)
    with pytest.raises(ValueError, match=re.escape(f"{path}, row group 0 from row 15, column 'price': "
                                                   "non-finite value nan at row 5")):
        list(bad)
    assert len(list(reader(tmp_path, batch_size=5, rank=0, world_size=2, shuffle=False, drop_last=False))) == 3


def test_a_changed_dataset_with_as_many_row_groups_is_detected(tmp_path):
    write(tmp_path, [100, 100], [50, 50])
    state = reader(tmp_path).state_dict()
    write(tmp_path, [100, 90], [50, 50])  # same 4 row groups, 10 rows fewer
    with pytest.raises(ValueError) as error:
        reader(tmp_path).load_state_dict(state)
    assert re.fullmatch(r"data reader state was saved over other files: \S+/part-1\.parquet changed from \d+ bytes "
                        r"in 2 row group\(s\) of 100 rows to \d+ bytes in 2 row group\(s\) of 90 rows; the saved "
                        r"position cannot be honoured \(a run's input must not change; see docs/continuous\.md\)",
                        str(error.value)), str(error.value)
