"""Elastic resume inside an epoch (trainer/data/elastic.py): a position saved by 4 ranks in the
middle of an epoch resumes on 2, whose position resumes on 3, and every row id of the epoch is
trained once, apart from the half-read shuffle windows the checkpoints declare; unshuffled, the
global batches stay those of file order; inside the resumed epoch a resume at the same world
size is exact. The ranks are real gloo processes, and their positions
go through the checkpoint's own per-rank part (PerRankState: gathered, JSON, taken up)."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

from cli import rendezvous_port, spawn
from test_reader import make_encoder, write_files
from trainer.data.elastic import resumed_epoch, shared_units, units_left

SIZES = [700, 1300, 500]  # 2500 rows, ids 0..2499 in file order
GLOBAL_BATCH = 96          # 24 rows per rank at 4 ranks, 48 at 2, 32 at 3
BUFFER = 150               # windows of two 90-row row groups


# ----------------------------------------------------------------------------- the arithmetic

def test_rows_read_in_order_are_cut_at_the_exact_row():
    slices = [(0, 4, 0, 10), (10, 7, 30, 35), (15, 2, 0, 8)]
    assert units_left(slices, None, 0) == (slices, 0)
    assert units_left(slices, None, 12) == ([(12, 7, 32, 35), (15, 2, 0, 8)], 0)
    assert units_left(slices, None, 15) == ([(15, 2, 0, 8)], 0)
    assert units_left(slices, None, 22) == ([(22, 2, 7, 8)], 0)
    assert units_left(slices, None, 23) == ([], 0)


def test_a_half_read_window_is_left_whole_and_its_read_rows_counted():
    slices = [(0, 4, 0, 10), (10, 7, 30, 35), (15, 2, 0, 8)]  # windows of 15 and 8 rows
    windows = [2, 1]
    assert units_left(slices, windows, 0) == (slices, 0)
    assert units_left(slices, windows, 14) == (slices, 14)
    assert units_left(slices, windows, 15) == (slices[2:], 0)
    assert units_left(slices, windows, 16) == (slices[2:], 1)
    assert units_left(slices, windows, 23) == ([], 0)


def test_units_of_all_ranks_join_in_the_epochs_order_and_adjacent_ranges_merge():
    rank0 = [(40, 3, 5, 9), (44, 1, 0, 6)]
    rank1 = [(2, 3, 0, 5), (100, 1, 6, 20)]
    # sorted by position: 3[0:5], 3[5:9] (merged), 1[0:6], 1[6:20] (merged)
    assert shared_units([rank0, rank1]) == ([[3, 0, 9], [1, 0, 20]], 29)
    assert shared_units([[(0, 2, 0, 4)], [(9, 2, 5, 7)]]) == ([[2, 0, 4], [2, 5, 7]], 6)  # a gap stays


def test_units_from_a_checkpoint_are_checked():
    saved = [{"epoch": 1, "left": [[0, 2, 0, 4]], "half_read": 3}, {"epoch": 1, "left": [[9, 2, "5", 7]],
                                                                     "half_read": 0}]
    for bad in ([9, 2, "5", 7], [9, 2, 5]):
        saved[1]["left"] = [bad]
        with pytest.raises(ValueError) as e:
            resumed_epoch(saved)
        assert str(e.value) == ("data reader state: the units its ranks had left are not row ranges "
                                "(a unit is not 4 integers)")
    assert resumed_epoch([{"epoch": 1, "step": 3}]) is None  # an older rankmix recorded none
    assert resumed_epoch([{"epoch": 1, "left": []}]) is None and resumed_epoch([{"epoch": 1, "half_read": 0}]) is None
    assert resumed_epoch([{"epoch": 2, "left": [[0, 1, 0, 3]], "half_read": 1}]) == (
        {"epoch": 2, "units": [[1, 0, 3]], "rows": 3}, 1)  # one saved rank
    saved[1]["left"] = [[9, 2, 5, 7]]
    assert resumed_epoch(saved) == ({"epoch": 1, "units": [[2, 0, 4], [2, 5, 7]], "rows": 6}, 3)


# ----------------------------------------------------------------------------- one process, every rank

def rank_readers(data: Path, world: int, shuffle: bool = True) -> list:
    from trainer.data.options import ReaderOptions
    from trainer.data.reader import ParquetReader

    return [ParquetReader(str(data), make_encoder(), ReaderOptions(
        batch_size=GLOBAL_BATCH // world, shuffle=shuffle, shuffle_buffer=BUFFER, seed=5, rank=r, world_size=world,
        num_epochs=1)) for r in range(world)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_units_left_by_four_readers_are_read_once_by_three(tmp_path, shuffle):
    """What TrainedPosition does across a checkpoint, on readers of every rank in one process."""
    data = tmp_path / "data"
    write_files(data, SIZES, 90)
    four, trained = rank_readers(data, 4, shuffle), []
    states = []
    for reader in four:
        it = iter(reader)
        trained += [u for batch in itertools.islice(it, 11) for u in batch.users.tolist()]
        states.append(reader.with_units_left(json.loads(json.dumps(reader.state_dict()))))
        it.close()
    assert [s["step"] for s in states] == [11] * 4
    resumed, reread = resumed_epoch(states)
    assert resumed["rows"] == sum(SIZES) - 4 * 11 * 24 + reread and resumed["epoch"] == 0
    assert (reread > 0) == shuffle
    if not shuffle:  # the units in the epoch's order, file order: the 11 x 96 rows consumed, then the rest
        firsts = list(itertools.accumulate((g.num_rows for g in four[0].row_groups), initial=0))
        assert [i for g, a, b in resumed["units"] for i in range(firsts[g] + a, firsts[g] + b)] == \
            list(range(11 * GLOBAL_BATCH, sum(SIZES)))
    three = rank_readers(data, 3, shuffle)
    for reader in three:
        reader.load_state_dict({**reader.state_dict(), "resumed": resumed})
        # the resumed epoch goes into the state, so that a resume at the same world size reads it again
        assert reader.epoch_rows(0).rows == resumed["rows"] and reader.state_dict()["resumed"] == resumed
        it = iter(reader)
        trained += [u for batch in itertools.islice(it, reader.steps_in_epoch(0)) for u in batch.users.tolist()]
        # at the resumed epoch's end nothing is left of it, though the whole split has more steps
        assert reader.with_units_left(reader.state_dict())["left"] == [] and reader.step < reader.steps_in_epoch(1)
        trained += [u for batch in it for u in batch.users.tolist()]
    counts = Counter(trained)
    twice = sum(c == 2 for c in counts.values())
    missing = set(range(sum(SIZES))) - counts.keys()
    dropped = three[0].epoch_rows(0).dropped
    assert set(counts.values()) <= {1, 2} and twice + (dropped - len(missing)) == reread
    assert len(missing) <= dropped < GLOBAL_BATCH
    assert "resumed" not in three[0].state_dict()  # the next epoch is the whole split again


def test_a_resumed_epoch_whose_units_are_not_of_this_input_is_refused(tmp_path):
    data = tmp_path / "data"
    write_files(data, SIZES, 90)
    reader = rank_readers(data, 2)[0]
    groups = len(reader.row_groups)
    message = f"data reader state: its resumed epoch's units are not row ranges of this input's {groups} row groups"
    for units, rows in (([[groups, 0, 10]], 10), ([[0, 5, 91]], 86), ([[0, 5, 5]], 0), ([[0, 0, 10]], 11),
                        ([[0, 0, "9"]], 9), ([[0, 0]], 0)):
        with pytest.raises(ValueError) as e:
            reader.load_state_dict({**reader.state_dict(), "resumed": {"epoch": 0, "units": units, "rows": rows}})
        assert str(e.value) == message
    with pytest.raises(ValueError, match="^data reader state: its resumed epoch's units are not row ranges"):
        reader.load_state_dict({**reader.state_dict(), "resumed": [[0, 5, 90]]})
    reader.load_state_dict({**reader.state_dict(), "resumed": {"epoch": 0, "units": [[0, 5, 90]], "rows": 85}})
    assert reader.steps_in_epoch(0) == 85 // 2 // 48 == 0 and reader.steps_in_epoch(1) == 2500 // 2 // 48


# ----------------------------------------------------------------------------- 4 -> 2 -> 3 ranks

def _phase(rank: int, port: int, world: int, data: str, shuffle: bool, steps: int | None, load: str, save: str,
           out: str, more: int) -> None:
    """One job of `world` ranks: take up the position in `load` (if any), train on `steps` batches
    (None: to the epoch's end), save the position to `save`, write what each rank trained to `out`,
    and the `more` batches that come after the save (`after`)."""
    import torch.distributed as dist

    from trainer.checkpoint.state import PerRankState, TrainedPosition
    from trainer.data.options import ReaderOptions
    from trainer.data.reader import ParquetReader

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    reader = ParquetReader(data, make_encoder(), ReaderOptions(
        batch_size=GLOBAL_BATCH // world, shuffle=shuffle, shuffle_buffer=BUFFER, seed=5, rank=rank, world_size=world,
        num_epochs=1))
    position = TrainedPosition(reader, "exact")
    ranks = PerRankState({"reader": position})
    if load:
        ranks.load_state_dict(Path(load).read_text())
    epoch, trained = position.epoch, []
    for batch in itertools.islice(position.track(iter(reader)), steps):
        trained.append(batch.users.tolist())
        position.advance()
    text = ranks.state_dict()  # collective
    if rank == 0 and save:
        Path(save).write_text(text)
    after = [batch.users.tolist() for batch in itertools.islice(position.track(iter(reader)), more)]
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "trained": trained, "rows_reread": position.rows_reread, "steps": reader.steps_in_epoch(epoch),
        "dropped": reader.epoch_rows(epoch).dropped, "after": after}))
    dist.destroy_process_group()


def run_phase(tmp: Path, name: str, world: int, data: Path, shuffle: bool, steps: int | None,
              load: str = "", more: int = 0) -> tuple[list[dict], str]:
    out = tmp / name
    out.mkdir()
    save = str(tmp / f"{name}.state")
    spawn(_phase, (rendezvous_port(), world, str(data), shuffle, steps, load, save, str(out), more), world)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)], save


def global_batches(ranks: list[dict]) -> list[list[int]]:
    """Step k's rows over all ranks."""
    return [sum(batch, []) for batch in zip(*(r["trained"] for r in ranks), strict=True)]


@pytest.mark.parametrize("shuffle", [True, False])
def test_four_ranks_stopped_mid_epoch_resume_on_two_then_three_and_train_every_row_once(tmp_path, shuffle):
    data = tmp_path / "data"
    write_files(data, SIZES, 90)
    four, saved4 = run_phase(tmp_path, "four", 4, data, shuffle, 9)
    assert [r["steps"] for r in four] == [26] * 4  # 625 rows a rank
    two, saved2 = run_phase(tmp_path, "two", 2, data, shuffle, 7, load=saved4, more=3)
    # inside the resumed epoch, a resume at its own world size is exact, as any
    again, _ = run_phase(tmp_path, "two_again", 2, data, shuffle, 3, load=saved2)
    assert [r["trained"] for r in again] == [r["after"] for r in two]
    three, _ = run_phase(tmp_path, "three", 3, data, shuffle, None, load=saved2)
    batches = [*global_batches(four), *global_batches(two), *global_batches(three)]
    assert all(len(b) == GLOBAL_BATCH for b in batches)
    counts = Counter(itertools.chain.from_iterable(batches))
    reread = three[0]["rows_reread"]
    assert {r["rows_reread"] for r in three} == {reread}
    if shuffle:
        # 9 x 24 rows = 216 a rank stop inside a window of 150-270 rows (cut row groups of 90), and
        # 7 x 48 = 336 a rank at 2 ranks again: both resumes read rows twice
        assert 0 < two[0]["rows_reread"] < reread
    else:  # read in order: cut at the row, and each step is the next GLOBAL_BATCH rows of file order
        assert reread == 0
        assert [sorted(b) for b in batches] == [list(range(k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH))
                                                for k in range(len(batches))]
    # Every row once, the declared re-reads twice, except the rows of the resumed epoch's drop_last
    # share (fewer than a global batch): rows never trained, or declared re-reads trained once.
    twice = sum(c == 2 for c in counts.values())
    missing = set(range(sum(SIZES))) - counts.keys()
    dropped = three[0]["dropped"]
    assert set(counts.values()) <= {1, 2} and twice + (dropped - len(missing)) == reread
    assert len(missing) <= dropped < GLOBAL_BATCH
    assert len(batches) * GLOBAL_BATCH == sum(SIZES) - len(missing) + twice


# ----------------------------------------------------------------------------- a partition (data.order=time)

PARTITIONS = {"hour=1": (0, 1100), "hour=2": (1100, 700)}  # first row id, rows


def _partitions_phase(rank: int, port: int, world: int, root: str, steps: int | None, load: str, save: str,
                      out: str) -> None:
    """`_phase` over the partitions under `root`, read one after the other (PartitionedReader)."""
    import torch.distributed as dist

    from trainer.checkpoint.state import PerRankState, TrainedPosition
    from trainer.data.options import ReaderOptions
    from trainer.data.partitions import PartitionedReader
    from trainer.data.reader import ParquetReader

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    reader = PartitionedReader(root, lambda uri, name: ParquetReader(
        uri, make_encoder(), ReaderOptions(batch_size=GLOBAL_BATCH // world, shuffle_buffer=BUFFER, seed=5, rank=rank,
                                           world_size=world, num_epochs=1)), marker="_SUCCESS")
    position = TrainedPosition(reader, "exact")
    ranks = PerRankState({"reader": position})
    if load:
        ranks.load_state_dict(Path(load).read_text())
    dropped = {position.epoch: reader.epoch_rows(position.epoch).dropped}
    trained = []
    for batch in itertools.islice(position.track(iter(reader)), steps):
        trained.append(batch.users.tolist())
        position.advance()
        dropped[position.epoch] = reader.epoch_rows(position.epoch).dropped
    text = ranks.state_dict()
    if rank == 0 and save:
        Path(save).write_text(text)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "trained": trained, "rows_reread": position.rows_reread, "dropped": sum(dropped.values())}))
    dist.destroy_process_group()


def test_a_partition_stopped_at_four_ranks_resumes_on_two_and_the_next_follows(tmp_path):
    import pyarrow.parquet as pq

    from test_reader import make_table

    root = tmp_path / "log"
    for name, (first, rows) in PARTITIONS.items():
        (root / name).mkdir(parents=True)
        pq.write_table(make_table(first, rows), root / name / "part-0.parquet", row_group_size=90)
        (root / name / "_SUCCESS").write_text("")
    runs = []
    for name, world, steps, load in (("four", 4, 5, ""), ("two", 2, None, str(tmp_path / "four.state"))):
        (tmp_path / name).mkdir()
        spawn(_partitions_phase, (rendezvous_port(), world, str(root), steps, load, str(tmp_path / f"{name}.state"),
                                  str(tmp_path / name)), world)
        runs.append([json.loads((tmp_path / name / f"rank{r}.json").read_text()) for r in range(world)])
    four, two = runs
    batches = [*global_batches(four), *global_batches(two)]
    counts = Counter(itertools.chain.from_iterable(batches))
    reread, dropped = two[0]["rows_reread"], two[0]["dropped"]
    twice = sum(c == 2 for c in counts.values())
    missing = set(range(1800)) - counts.keys()
    assert reread > 0 and set(counts.values()) <= {1, 2} and twice + (dropped - len(missing)) == reread
    assert len(missing) <= dropped < 2 * GLOBAL_BATCH  # each partition's drop_last share
    # time order: each global batch of one partition, every one of hour=1 before any of hour=2
    later = [min(b) >= 1100 for b in batches]
    assert later == [max(b) >= 1100 for b in batches] and later == sorted(later) and any(later)


def test_a_position_after_the_epochs_last_batch_leaves_nothing_to_read_again(tmp_path):
    """Its last window was half read, but the epoch is over: the next world size starts the next."""
    data = tmp_path / "data"
    write_files(data, SIZES, 90)
    states = []
    for reader in rank_readers(data, 4):
        steps, it = reader.steps_in_epoch(0), iter(reader)
        assert len(list(itertools.islice(it, steps))) == steps == 26 and (reader.epoch, reader.step) == (0, steps)
        states.append(reader.with_units_left(reader.state_dict()))
        it.close()
    assert resumed_epoch(states) == ({"epoch": 0, "units": [], "rows": 0}, 0)
    two = rank_readers(data, 2)[0]
    two.load_state_dict({**two.state_dict(), "resumed": resumed_epoch(states)[0]})
    pieces = two.assignment.pieces
    assert two.steps_in_epoch(0) == 0 and pieces(0, 0) == pieces(0, 1) == [] and len(pieces(1, 0)) > 1
