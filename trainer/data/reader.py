"""Streaming Parquet reader: row ranges of row groups, bounded memory, exact resume.

A `ParquetReader` streams one rank's batches. What it reads is decided elsewhere: the files and
row groups every rank agrees on, and their identity a resume checks, in trainer/data/identity.py;
which rows each rank reads in each epoch, in which windows, in trainer/data/assignment.py (with the
elastic resume of trainer/data/elastic.py); what it is asked to do in `ReaderOptions`
(trainer/data/options.py).

Windows. A window's slices (assignment.py) are read, encoded and given a permutation seeded
with (seed, epoch, rank, window), and its rows are streamed into batches in that order (a batch
may straddle two windows). The batches a rank has yielded in the epoch fix its position exactly:
the state is just (epoch, step), and resuming re-reads one window and skips into it.

Memory: O(shuffle_buffer + SLICE_ROWS) rows, whatever the row groups' size: the window
being consumed and the next window being encoded, each below `shuffle_buffer + SLICE_ROWS`
rows, the slice being encoded and DECODE_AHEAD decoded after it, and a READ_BUFFER per
column being read. A row group is decoded a slice at a time (`iter_batches`); the slices
before a piece's first row are decoded and dropped. A window is held encoded, as numpy
columns (`Rows`): encoding works on whole columns, and a batch's rows are copied (in order)
or gathered (by the permutation) once, straight from the window into its tensors; the window
itself is never copied in shuffled order. Slices are decoded on one thread and encoded on
another, so that decoding (mostly outside the GIL) does not wait for encoding, nor encoding
for the consumer: pyarrow's own pool spent 10-20% more CPU on row-group-sized reads, and
would compete with the training step's threads. With `pin_memory`, PREFETCH_BATCHES more
batches wait in pinned memory.

Object stores: trainer/data/store.py (retries with backoff, then DataUnavailableError).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from trainer.credentials import redact_uri
from trainer.data.assignment import SLICE_ROWS, EpochRows, Piece, RowAssignment, RowGroup, holdout_split, sliced
from trainer.data.batch import Batch, Part, Rows, assemble
from trainer.data.encode import RowEncoder
from trainer.data.identity import agreed_input, file_change, is_digest
from trainer.data.options import ReaderOptions
from trainer.data.requests import grouped_permutation

log = logging.getLogger("rankmix.data")

# Column chunks are read through a buffer of this many bytes each, not whole: a row group's
# chunks, even compressed, can be far larger than a slice.
READ_BUFFER = 1 << 20
PREFETCH_BATCHES = 2  # pinned batches made ahead of the consumer
DECODE_AHEAD = 1  # slices decoded ahead of the one being encoded


class ParquetReader:
    """Yields `Batch`es of `options.batch_size` rows for one rank of `paths`; see the module docstring
    and `ReaderOptions`. Training runs epochs of the same number of steps on every rank; evaluation
    yields every row of the rank once, and all ranks still yield the same number of equally sized
    batches, the padding rows carrying weight 0."""

    def __init__(self, paths: str, encoder: RowEncoder, options: ReaderOptions):
        self.encoder, self.options = encoder, options
        self.num_epochs = options.num_epochs if options.drop_last else 1
        self.source = redact_uri(paths)
        listed = agreed_input(paths, encoder.check_schema, world_size=options.world_size,
                              retry_seconds=options.retry_seconds, retry_attempts=options.retry_attempts,
                              digests=options.drop_last)  # training: a position a resume must check
        self.store, self.input_files = listed.store, listed.files
        self.assignment = RowAssignment(holdout_split(listed.row_groups, options, self.source), options)
        self.row_groups, self.num_rows = self.assignment.row_groups, self.assignment.num_rows
        self.epoch, self.step = 0, 0
        self._filler: Part | None = None
        self.peak_buffered_rows = 0

    @property
    def resumed(self) -> dict | None:
        """{"epoch", "units", "rows"}: an epoch resumed at another world size (trainer/data/elastic.py)."""
        return self.assignment.resumed

    def steps_in_epoch(self, epoch: int) -> int:
        """Batches every rank yields in `epoch`."""
        return self.assignment.steps_in_epoch(epoch)

    def epoch_rows(self, epoch: int) -> EpochRows:
        """The split's rows in `epoch` and those its batches consume on all ranks together."""
        return self.assignment.epoch_rows(epoch)

    def with_units_left(self, state: dict) -> dict:
        """`state`, a position this reader passed, with what its epoch has left on this rank."""
        return self.assignment.with_units_left(state)

    # ------------------------------------------------------------------ streaming

    def __iter__(self) -> Iterator[Batch]:
        while not self.num_epochs or self.epoch < self.num_epochs:
            yield from self._epoch_batches()
            self.epoch, self.step = self.epoch + 1, 0

    def _epoch_batches(self) -> Iterator[Batch]:
        steps = self.steps_in_epoch(self.epoch)
        if steps == 0:
            rows = self.assignment.fewest_rows(self.epoch)
            raise ValueError(f"{self.source}: a rank gets only {rows} rows in epoch {self.epoch}, fewer than "
                             f"one batch of {self.options.batch_size}; use a smaller batch or fewer ranks")
        batches = self._batches(self.epoch, self.step, steps)
        # Pinning gets a thread of its own (it waits on the CUDA driver); without it, handing each
        # batch from a thread to the consumer would cost more than assembling it.
        for batch in _pinned_ahead(batches) if self.options.pin_memory else batches:
            self.step += 1  # here, not in the thread: the position is that of the batches handed out
            yield batch

    def _batches(self, epoch: int, step: int, steps: int) -> Iterator[Batch]:
        """Batches `step` to `steps` - 1 of `epoch`."""
        b = self.options.batch_size
        windows = self.assignment.windows(sliced(self.assignment.pieces(epoch, self.options.rank)))
        chunks = self._window_stream(windows, epoch, skip=step * b)
        held: list[Part] = []  # rows read and not yet yielded, in order
        seen = False
        for _ in range(step, steps):
            while sum(r.num_rows for r in held) < b and (t := next(chunks, None)) is not None:
                held.append(t)
                seen = True
            if not seen and self._filler is None:  # evaluation on a rank with no rows left: pad with any row
                self._filler = Part(self._read(Piece(self.row_groups[0], 0, 1)))
            yield self._padded(_take_front(held, b))

    def _window_stream(self, windows: list[list[Piece]], epoch: int, skip: int) -> Iterator[Part]:
        """Encoded, shuffled rows of `windows`, starting `skip` rows in. Two threads work ahead of
        the consumer: one encodes the next window while the other decodes the pieces after it,
        DECODE_AHEAD ahead of the encoder, so that decoding (mostly outside the GIL) does not
        wait for encoding and the consumer only assembles batches."""
        todo = []
        for i, window in enumerate(windows):
            size = sum(p.num_rows for p in window)
            if skip >= size:
                skip -= size
                continue
            todo.append((i, window, skip))
            skip = 0
        if not todo:
            return
        files = _LastFile(self.store.fs)
        try:
            with ThreadPoolExecutor(1, "rankmix-reader-decode") as decoder, \
                    ThreadPoolExecutor(1, "rankmix-reader-encode") as encoder:
                tables = _ahead(decoder, (partial(self._decode, p, files) for _, w, _ in todo for p in w),
                                DECODE_AHEAD)

                def load(k: int) -> Future:
                    index, window, _ = todo[k]
                    return encoder.submit(lambda: self._encode_window(
                        [self._encode(p, next(tables)) for p in window], index, epoch))
                ahead = load(0)
                for k, (_, _, start) in enumerate(todo):
                    rows = ahead.result()
                    if k + 1 < len(todo):
                        ahead = load(k + 1)
                    yield rows.slice(start)
        finally:
            files.close()

    def _padded(self, parts: list[Part]) -> Batch:
        """Evaluation's short batches are filled to batch_size with weight-0 copies of rows."""
        real, b = sum(p.num_rows for p in parts), self.options.batch_size
        if real:
            self._filler = parts[0]  # its first row pads a later batch without rows of its own
        if real == b:
            return assemble(parts)
        source = Rows.concat([p.as_rows() for p in parts or [self._filler.slice(0, 1)]])
        weights = np.zeros(b, np.float32)
        weights[:real] = 1.0
        return assemble([Part(source, np.resize(np.arange(source.num_rows), b))], weights)

    def _encode_window(self, parts: list[Rows], index: int, epoch: int) -> Part:
        """The window's rows, with their permutation where they are shuffled: batches gather
        from the window by it, rather than the whole window being copied in shuffled order."""
        rows = Rows.concat(parts)
        self.peak_buffered_rows = max(self.peak_buffered_rows, rows.num_rows)
        o = self.options
        if o.shuffle and o.shuffle_buffer:
            rng = np.random.default_rng([o.seed, epoch, o.rank, index])
            if rows.requests is not None:  # a request's rows stay together, to share one lookup of its history
                return Part(rows, grouped_permutation(rng, rows.requests))
            return Part(rows, rng.permutation(rows.num_rows))
        return Part(rows)

    def _read(self, p: Piece) -> Rows:
        """One piece's rows, decoded and encoded (a file opened for it alone)."""
        files = _LastFile(self.store.fs)
        try:
            return self._encode(p, self._decode(p, files))
        finally:
            files.close()

    def _decode(self, p: Piece, files: _LastFile) -> pa.Table:
        where = f"{p.group.path}, row group {p.group.index}"
        try:
            return self.store.call(partial(files.read, p, self.encoder.columns), where)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"cannot read {where}: {e}") from None

    def _encode(self, p: Piece, table: pa.Table) -> Rows:
        g = p.group
        where = f"{g.path}, row group {g.index}"
        # the encoder numbers rows from the piece's first row
        return self.encoder.encode(table, f"{where} from row {g.first + p.start}" if g.first + p.start else where)

    # ------------------------------------------------------------------ state

    def _identity(self) -> dict:
        """What gives a position its meaning: the rows of a rank's batches follow from it."""
        o = self.options
        return {"seed": o.seed, "world_size": o.world_size, "rank": o.rank,
                "batch_size": o.batch_size, "shuffle_buffer": o.shuffle_buffer, "shuffle": o.shuffle,
                "row_groups": len(self.row_groups), "rows": self.num_rows,
                "request_column": self.encoder.requests.column}

    def state_dict(self) -> dict:
        """Exact position: epoch and batches yielded in it, plus what gives them meaning, the
        files (path, bytes, rows of each row group, and a training reader's content digest) included,
        and in an epoch resumed at another world size, the rows it had left (`resumed`)."""
        resumed = {"resumed": self.resumed} if self.resumed and self.resumed["epoch"] == self.epoch else {}
        return {"epoch": self.epoch, "step": self.step, "files": self.input_files, **self._identity(), **resumed}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`'s position; a position that means something else here is an error,
        files added, removed or rewritten since the save included."""
        if "files" not in state:
            raise ValueError("data reader state has no list of the files it read (an older rankmix saved it): "
                             "start a new run folder from its weights (checkpoint.load_path=<the checkpoint>, "
                             "checkpoint.load_mode=weights)")
        if any(len(f) < 4 or not is_digest(f[3]) for f in state["files"]) and self.options.drop_last:
            # The digest guards against a rewritten input, not against a crafted checkpoint (which
            # could carry any digest), so a position saved without one, or with an older rankmix's
            # sampled digest, is honoured as it was then.
            log.warning("data reader state records no sha256 of its files' bytes (an older rankmix saved it): "
                        "only their paths, bytes and row counts were checked; the next checkpoint records it")
        change = file_change(state["files"], self.input_files)
        if change:
            raise ValueError(f"data reader state was saved over other files: {change}; the saved position "
                             "cannot be honoured (a run's input must not change; see docs/continuous.md)")
        for key, mine in self._identity().items():
            if state.get(key, "" if key == "request_column" else None) != mine:  # older states: no requests
                raise ValueError(f"data reader state was saved with {key}={state.get(key)} but this run has "
                                 f"{key}={mine}: the saved position cannot be honoured")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.assignment.resumed = self.assignment.checked_resumed(state.get("resumed"))


def _take_front(held: list[Part], n: int) -> list[Part]:
    """Remove the first `n` rows from `held` (fewer where it runs out) and return them, as
    views: a part of each window they lie in."""
    parts = []
    while n and held:
        head = held[0]
        if head.num_rows <= n:
            parts.append(held.pop(0))
        else:
            parts.append(head.slice(0, n))
            held[0] = head.slice(n)
        n -= parts[-1].num_rows
    return parts


_END = object()


def _ahead(pool: ThreadPoolExecutor, calls: Iterator, ahead: int) -> Iterator:
    """The results of `calls`, in order, each call submitted to `pool` when the result `ahead`
    places before it is taken: at most `ahead` + 1 results wait or are being made."""
    pending: collections.deque[Future] = collections.deque()
    for call in calls:
        pending.append(pool.submit(call))
        if len(pending) > ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _pinned_ahead(batches: Iterator[Batch]) -> Iterator[Batch]:
    """`batches`, assembled and pinned up to PREFETCH_BATCHES ahead in a thread of their own
    (the prefetch thread); an error there is raised here. Closing this generator stops the thread."""
    ready: queue.Queue = queue.Queue(PREFETCH_BATCHES)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for batch in batches:
                if not put(batch.pin_memory()):
                    return
            put(_END)
        except BaseException as e:  # handed to the consumer, which raises it
            put(e)
        finally:
            batches.close()  # the window loader's thread and open files, in the thread that uses them

    thread = threading.Thread(target=run, name="rankmix-reader-prefetch", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()


class _LastFile:
    """The Parquet file read last, kept open for the next row group: consecutive row
    groups often share a file, and opening one (footer parse, reader set-up) costs about
    a third of decoding a 16k-row row group. Also the row group being read, as a stream of
    SLICE_ROWS-row batches and the batch decoded last, while a later piece of it may follow
    (interleaved pieces, slices). Used by one thread at a time."""

    def __init__(self, fs: pafs.FileSystem):
        self.fs = fs
        self.path: str | None = None
        self.stream: pa.NativeFile | None = None
        self.file: pq.ParquetFile | None = None
        self.group: RowGroup | None = None
        self.batches: Iterator[pa.RecordBatch] | None = None
        self.batch: pa.RecordBatch | None = None
        self.start = 0  # the row group's row that self.batch starts at

    def read(self, piece: Piece, columns: list[str]) -> pa.Table:
        """The rows of `piece`, decoding at most the slices up to them; after a failure the
        file is re-opened on the next call."""
        g = piece.group
        lo, hi = g.first + piece.start, g.first + piece.stop
        try:
            if g != self.group or lo < self.start:
                self.group = self.batches = self.batch = None
                file = self._open(g.path)
                if file.metadata.row_group(g.index).num_rows <= SLICE_ROWS:  # one slice: the faster call
                    self.batches = iter(file.read_row_group(g.index, columns=columns,
                                                            use_threads=False).to_batches())
                else:
                    self.batches = file.iter_batches(batch_size=SLICE_ROWS, row_groups=[g.index], columns=columns,
                                                     use_threads=False)
                self.start, self.batch, self.group = 0, next(self.batches), g
            parts = []
            while True:
                end = self.start + self.batch.num_rows
                if end > lo:
                    parts.append(self.batch.slice(max(lo - self.start, 0), min(hi, end) - max(lo, self.start)))
                if end >= hi:
                    break
                self.start, self.batch = end, next(self.batches)
        except BaseException:
            self.close()  # the stream may be dead
            raise
        if piece.stop == g.num_rows:  # the rank's last piece of this row group
            self.group = self.batches = self.batch = None
            self.start = 0
        return pa.Table.from_batches(parts)

    def _open(self, path: str) -> pq.ParquetFile:
        if path != self.path:
            self.close()
            stream = self.fs.open_input_file(path)
            try:
                self.file = pq.ParquetFile(stream, pre_buffer=False, buffer_size=READ_BUFFER)
            except BaseException:
                stream.close()
                raise
            self.path, self.stream = path, stream
        return self.file

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.path = self.stream = self.file = self.group = self.batches = self.batch = None
        self.start = 0
