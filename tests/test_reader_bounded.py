"""The reader in bounded memory: row groups read in slices of SLICE_ROWS rows, whatever their
size; and batches pinned in a prefetch thread for CUDA training."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from cli import spawn
from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec
from test_reader import assert_same, make_encoder, make_table, snap, users_of
from trainer.data.assignment import SLICE_ROWS, Piece, RowGroup, sliced
from trainer.data.batch import Batch
from trainer.data.encode import RowEncoder
from trainer.data.identity import METADATA_THREADS, _concurrently
from trainer.data.options import ReaderOptions
from trainer.data.reader import ParquetReader, _ahead

BIG = 2 * SLICE_ROWS + 1_234  # rows of the one row group of `big_file`: three slices, the last short


@pytest.fixture(scope="module")
def big_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("big") / "one-group.parquet"
    pq.write_table(make_table(0, BIG), path, row_group_size=BIG)
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    return path


def test_pieces_are_cut_at_the_row_groups_slice_boundaries():
    g = RowGroup("f", 0, 3 * SLICE_ROWS)
    assert sliced([Piece(g, 5, 2 * SLICE_ROWS + 7)]) == [
        Piece(g, 5, SLICE_ROWS), Piece(g, SLICE_ROWS, 2 * SLICE_ROWS), Piece(g, 2 * SLICE_ROWS, 2 * SLICE_ROWS + 7)]
    assert sliced([Piece(g, 0, SLICE_ROWS)]) == [Piece(g, 0, SLICE_ROWS)]  # one slice: whole
    # a held-out tail starts mid row group: the cut is at the row group's own rows
    tail = RowGroup("f", 0, 10, first=SLICE_ROWS - 4)
    assert sliced([Piece(tail, 1, 10)]) == [Piece(tail, 1, 4), Piece(tail, 4, 10)]


def test_a_row_group_beyond_a_slice_gives_every_row_in_file_order(big_file):
    batches = [snap(b) for b in ParquetReader(str(big_file), make_encoder(),
                                              ReaderOptions(batch_size=1_000, shuffle=False, drop_last=False))]
    users = users_of(batches, real_only=True)
    np.testing.assert_array_equal(users, np.arange(BIG))
    tags = pq.read_table(big_file, columns=["tags"]).column("tags").combine_chunks()
    got = np.concatenate([b["values"][b["lengths"][:1_000].sum():] for b in batches])
    np.testing.assert_array_equal(got[:tags.flatten().to_numpy().size], tags.flatten().to_numpy())


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_ranks_read_disjoint_rows_of_one_big_row_group(big_file, shuffle):
    kw = dict(batch_size=700, shuffle=shuffle, shuffle_buffer=5_000, seed=3, num_epochs=1, world_size=2)
    ranks = [[snap(b) for b in ParquetReader(str(big_file), make_encoder(), ReaderOptions(rank=r, **kw))]
             for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == BIG // 2 // 700
    users = [users_of(r) for r in ranks]
    assert not set(users[0]) & set(users[1])
    if not shuffle:  # interleaved: global step k is rows [1400 k, 1400 (k + 1))
        np.testing.assert_array_equal(np.stack([u.reshape(-1, 700) for u in users], 1).reshape(-1),
                                      np.arange(len(users[0]) * 2))


def test_holdout_of_a_big_row_group_is_its_tail(big_file):
    held = ParquetReader(str(big_file), make_encoder(), ReaderOptions(batch_size=1_000, shuffle=False, drop_last=False,
                                                                      holdout_fraction=0.6, holdout=True))
    users = users_of([snap(b) for b in held], real_only=True)
    np.testing.assert_array_equal(users, np.arange(BIG - int(BIG * 0.6), BIG))


def test_resume_inside_a_sliced_row_group_is_exact(big_file):
    kw = dict(batch_size=900, shuffle_buffer=20_000, seed=5, num_epochs=2)
    reference = [snap(b) for b in ParquetReader(str(big_file), make_encoder(), ReaderOptions(**kw))]
    first = ParquetReader(str(big_file), make_encoder(), ReaderOptions(**kw))
    head = [snap(b) for b in itertools.islice(iter(first), len(reference) // 2 + 37)]
    fresh = ParquetReader(str(big_file), make_encoder(), ReaderOptions(**kw))
    fresh.load_state_dict(first.state_dict())
    assert_same(head + [snap(b) for b in fresh], reference)
    assert fresh.peak_buffered_rows < 20_000 + SLICE_ROWS


def _read_worker(rank: int, path: str, out: str) -> None:
    """Peak RSS growth of one shuffled pass over `path` with a 4,096-row shuffle buffer."""
    encoder = RowEncoder([FeatureSpec(name="item", kind="id", num_embeddings=1_000),
                          FeatureSpec(name="price", kind="numeric")], [TaskSpec(name="click", label="click")], "user")
    reader = ParquetReader(path, encoder, ReaderOptions(batch_size=1_024, shuffle_buffer=4_096, seed=1, num_epochs=1))
    with open("/proc/self/status") as f:
        before = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    rows = sum(len(b) for b in reader)
    with open("/proc/self/status") as f:
        grown = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) - before
    torch.save({"rows": rows, "grown_mb": grown / 1024, "peak_buffered_rows": reader.peak_buffered_rows}, out)


def _one_group_pass(folder: Path, rows: int) -> dict:
    """A pass over a file of one row group of `rows` rows of 4 int64/float64 columns."""
    ids = np.arange(rows, dtype=np.int64)
    path = folder / f"{rows}.parquet"
    pq.write_table(pa.table({"item": ids % 1_000, "price": ids.astype(np.float64), "click": ids % 2, "user": ids}),
                   path, row_group_size=rows)
    spawn(_read_worker, (str(path), str(folder / f"{rows}.pt")), 1)
    got = torch.load(folder / f"{rows}.pt")
    assert got["rows"] == rows // 1_024 * 1_024
    assert got["peak_buffered_rows"] <= SLICE_ROWS  # the buffer is below one slice: windows are slices
    return got


def test_memory_is_bounded_by_the_buffer_and_a_slice_not_the_row_group(tmp_path):
    small, large = (_one_group_pass(tmp_path, rows) for rows in (1_000_000, 4_000_000))
    decoded_mb = 4_000_000 * 4 * 8 / 2**20  # 122 MB: what decoding the large row group at once holds
    # Flat in the row group's size: 4 x the rows add at most a few MB (allocator noise). At
    # commit 52d25ef, which decoded whole row groups, the large pass grew by about 3 x
    # decoded_mb and the difference was about 300 MB.
    assert large["grown_mb"] - small["grown_mb"] < 16, (small, large)
    # a slice is 2 MB decoded; the rest is a fixed cost (threads, allocator arenas), about 45 MB
    assert large["grown_mb"] < decoded_mb / 2, large


# ----------------------------------------------------------------------------- pinned batches


@pytest.fixture
def pins(monkeypatch) -> list[str]:
    """The thread of every Batch.pin_memory call; the batch comes back unpinned (pinning needs
    CUDA, which the suite hides), so everything else runs as on a GPU host."""
    threads: list[str] = []

    def pin_memory(self: Batch) -> Batch:
        threads.append(threading.current_thread().name)
        return self
    monkeypatch.setattr(Batch, "pin_memory", pin_memory)
    return threads


def test_pin_memory_pins_every_batch_in_the_prefetch_thread(big_file, pins):
    kw = dict(batch_size=2_000, shuffle_buffer=10_000, seed=2, num_epochs=2)
    plain = [snap(b) for b in ParquetReader(str(big_file), make_encoder(), ReaderOptions(**kw))]
    assert pins == []  # a CPU run does not pin
    pinned = [snap(b) for b in ParquetReader(str(big_file), make_encoder(), ReaderOptions(pin_memory=True, **kw))]
    assert_same(pinned, plain)
    assert pins == ["rankmix-reader-prefetch"] * len(plain)


def test_closing_a_pinning_reader_stops_its_thread(big_file, pins):
    reader = ParquetReader(str(big_file), make_encoder(), ReaderOptions(batch_size=500, num_epochs=0, pin_memory=True))
    batches = iter(reader)
    for _ in range(3):
        next(batches)
    assert "rankmix-reader-prefetch" in [t.name for t in threading.enumerate()]
    state = reader.state_dict()
    batches.close()
    assert [t.name for t in threading.enumerate()] == ["MainThread"]
    assert (state["epoch"], state["step"]) == (0, 3)  # the batches handed out, not those made ahead


def test_a_data_error_in_the_prefetch_thread_is_raised_to_the_consumer(tmp_path, pins):
    table = make_table(0, 300)
    clicks = np.arange(300) % 2
    clicks[250] = 7
    pq.write_table(table.set_column(table.schema.get_field_index("click"), "click", pa.array(clicks)),
                   tmp_path / "bad.parquet", row_group_size=100)
    reader = ParquetReader(str(tmp_path / "bad.parquet"), make_encoder(), ReaderOptions(batch_size=50, shuffle=False,
                                                                                        num_epochs=1, pin_memory=True))
    with pytest.raises(ValueError, match=r"bad.parquet, row group 2, column 'click': label must be 0 or 1, "
                                         r"got 7.0 at row 50$"):
        list(reader)
    assert [t.name for t in threading.enumerate()] == ["MainThread"]


# ----------------------------------------------------------------------------- decoding ahead


@pytest.mark.parametrize("ahead", [0, 1, 3])
def test_results_come_in_order_each_call_submitted_ahead_places_before_its_result_is_taken(ahead):
    pulled = []  # calls taken from the iterator, that is submitted

    def calls():
        for i in range(8):
            pulled.append(i)
            yield lambda i=i: i * i
    with ThreadPoolExecutor(1) as pool:
        results = _ahead(pool, calls(), ahead)
        for i in range(8):
            assert next(results) == i * i
            assert len(pulled) == min(i + ahead + 1, 8)
        assert next(results, None) is None


def test_a_failed_call_raises_at_its_place_after_the_results_before_it():
    def fail():
        raise ValueError("call 2 failed")
    with ThreadPoolExecutor(1) as pool:
        results = _ahead(pool, iter([lambda: 0, lambda: 1, fail, lambda: 3]), 2)
        assert [next(results), next(results)] == [0, 1]
        with pytest.raises(ValueError, match="^call 2 failed$"):
            next(results)


def test_the_next_slice_is_decoded_while_one_is_encoded(tmp_path, monkeypatch):
    pq.write_table(make_table(0, 40), tmp_path / "f.parquet", row_group_size=10)  # 4 slices, 4 windows
    decoding = {g: threading.Event() for g in range(4)}
    overlapped = []
    decode, encode = ParquetReader._decode, ParquetReader._encode

    def decoded(self, p, files):
        decoding[p.group.index].set()
        return decode(self, p, files)

    def encoded(self, p, table):
        # a serial reader would decode the next slice only after this: the wait would time out
        overlapped.append(p.group.index == 3 or decoding[p.group.index + 1].wait(timeout=10))
        return encode(self, p, table)
    monkeypatch.setattr(ParquetReader, "_decode", decoded)
    monkeypatch.setattr(ParquetReader, "_encode", encoded)
    batches = [snap(b) for b in ParquetReader(str(tmp_path), make_encoder(), ReaderOptions(batch_size=10, shuffle=False,
                                                                                           num_epochs=1))]
    assert overlapped == [True] * 4
    assert users_of(batches).tolist() == list(range(40))


def test_closing_a_reader_mid_epoch_stops_its_decoding_and_encoding_threads(tmp_path):
    pq.write_table(make_table(0, 400), tmp_path / "f.parquet", row_group_size=50)
    batches = iter(ParquetReader(str(tmp_path), make_encoder(),
                                 ReaderOptions(batch_size=20, shuffle=False, num_epochs=1)))
    next(batches)
    assert {"rankmix-reader-decode_0", "rankmix-reader-encode_0"} <= {t.name for t in threading.enumerate()}
    batches.close()
    assert [t.name for t in threading.enumerate()] == ["MainThread"]


# ----------------------------------------------------------------------------- files' metadata


@pytest.mark.parametrize("calls", [2, 2 * METADATA_THREADS])
def test_files_metadata_is_read_metadata_threads_at_a_time_results_in_order(calls):
    together = threading.Barrier(min(calls, METADATA_THREADS), timeout=5)  # passes only when that many run at once
    running, peak, lock = 0, 0, threading.Lock()

    def call(i: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        together.wait()
        time.sleep(0.05)  # still running while the next ones would start, were there more threads
        with lock:
            running -= 1
        return i
    assert _concurrently([lambda i=i: call(i) for i in range(calls)]) == list(range(calls))
    assert peak == min(calls, METADATA_THREADS)


def test_of_failed_metadata_calls_the_first_in_order_is_raised_not_the_first_to_fail():
    later_failed = threading.Event()

    def first():
        later_failed.wait(timeout=5)  # fails after the later call has
        raise OSError("no footer in file 1")

    def later():
        later_failed.set()
        raise OSError("no footer in file 3")
    with pytest.raises(OSError, match="^no footer in file 1$"):
        _concurrently([lambda: 0, first, lambda: 2, later])
    assert later_failed.is_set()
    assert _concurrently([]) == [] and _concurrently([lambda: 5]) == [5]
