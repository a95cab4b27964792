"""The reader's assignment of rows (trainer.data.assignment) on the paths the other reader tests
leave open, against row numbers worked out by hand: the held-out tail of every row group,
a rank left without rows, evaluation's step count, and the windows a rank reads at once.

Every file has its global row number in `user`, so every row read is traced to its source.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec
from trainer.data.encode import RowEncoder
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader


def write(path: Path, sizes: list[int], bad_row: int = -1) -> str:
    """One file with a row group of each size; `item` is -1 in row `bad_row`."""
    rows = np.arange(sum(sizes), dtype=np.int64)
    table = pa.table({"item": np.where(rows == bad_row, -1, rows % 7), "click": rows % 2, "user": rows})
    with pq.ParquetWriter(path, table.schema) as writer:
        start = 0
        for size in sizes:
            writer.write_table(table.slice(start, size))
            start += size
    return str(path)


def reader(path: str, **kw) -> ParquetReader:
    encoder = RowEncoder([FeatureSpec(name="item", num_embeddings=7)], [TaskSpec(name="click", label="click")], "user")
    return ParquetReader(path, encoder, ReaderOptions(**{"batch_size": 4, "shuffle": False, "drop_last": False, **kw}))


def rows_read(r: ParquetReader) -> list[int]:
    return [int(u) for b in r for u, w in zip(b.users, b.weights) if w]


# row groups of 10, 7, 1 and 5 rows: a quarter held out is 2, 1, 0 and 1 rows of each tail
SIZES = [10, 7, 1, 5]
HELD = [8, 9, 16, 22]


def test_a_holdout_is_the_tail_of_every_row_group(tmp_path):
    path = write(tmp_path / "d.parquet", SIZES, bad_row=22)
    held = reader(path, holdout_fraction=0.25, holdout=True)
    with pytest.raises(ValueError) as err:  # the held-out row 22 holds a bad id: named by its row
        rows_read(held)
    assert str(err.value) == f"{path}, row group 3 from row 4, column 'item': negative id -1 at row 0"
    assert [(g.index, g.first, g.num_rows) for g in held.row_groups] == [(0, 8, 2), (1, 6, 1), (3, 4, 1)]
    kept = reader(path, holdout_fraction=0.25)
    assert [(g.index, g.first, g.num_rows) for g in kept.row_groups] == [(0, 0, 8), (1, 0, 6), (2, 0, 1), (3, 0, 4)]
    assert rows_read(kept) == sorted(set(range(sum(SIZES))) - set(HELD))
    assert rows_read(reader(write(tmp_path / "ok.parquet", SIZES), holdout_fraction=0.25, holdout=True)) == HELD
    assert {g.path for g in held.row_groups + kept.row_groups} == {path}


@pytest.mark.parametrize("fraction,holdout,side", [(0.05, True, "held-out"), (1.0, False, "training")])
def test_a_holdout_that_leaves_one_side_empty_is_an_error(tmp_path, fraction, holdout, side):
    path = write(tmp_path / "d.parquet", SIZES)
    with pytest.raises(ValueError) as err:
        reader(path, holdout_fraction=fraction, holdout=holdout)
    assert str(err.value) == f"{path}: a holdout of {fraction} of every row group leaves no {side} rows"


def test_a_rank_without_rows_in_an_interleaved_epoch_is_an_error(tmp_path):
    # 6 rows, 2 ranks, batches of 8: rank 0 takes rows 0-5, rank 1 none
    path = write(tmp_path / "d.parquet", [6])
    r = reader(path, batch_size=8, drop_last=True, rank=0, world_size=2)
    with pytest.raises(ValueError) as err:
        next(iter(r))
    assert str(err.value) == (f"{path}: a rank gets only 0 rows in epoch 0, fewer than one batch of 8; "
                              "use a smaller batch or fewer ranks")


def test_evaluation_steps_are_the_largest_rank_share_in_whole_batches(tmp_path):
    path = write(tmp_path / "d.parquet", [45])
    r = reader(path, batch_size=8, world_size=2)  # shares of 22 and 23 rows: 3 batches each
    assert r.steps_in_epoch(0) == 3 and type(r.steps_in_epoch(0)) is int
    assert (r.epoch_rows(0).rows, r.epoch_rows(0).used) == (45, 45)


@pytest.mark.parametrize("sizes,buffer,windows", [
    ([10, 10, 10, 10], 20, [20, 20]),      # a window closes at exactly the buffer's rows
    ([10, 10, 10, 10], 21, [30, 10]),      # ... or at the first piece past it
    ([25, 10, 10, 10], 21, [25, 30]),      # every window counts from zero
    ([1, 1, 1, 1], 0, [1, 1, 1, 1]),       # no buffer: a piece a window
])
def test_windows_hold_the_fewest_pieces_that_reach_the_buffer(tmp_path, sizes, buffer, windows):
    r = reader(write(tmp_path / "d.parquet", sizes), shuffle_buffer=buffer)
    assert [sum(p.num_rows for p in w) for w in r.assignment.windows(r.assignment.pieces(0, 0))] == windows
    assert rows_read(r) == list(range(sum(sizes)))
    assert r.peak_buffered_rows == max(windows)  # one window decoded at a time
