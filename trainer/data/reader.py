"""Streaming Parquet reader: row ranges of row groups, bounded memory, exact resume.

Assignment. Every rank lists the same row groups (from the files' footers). Each epoch
orders them (shuffled with (seed, epoch) unless shuffle is off) and lays them end to
end as one sequence of N rows; a rank's share of that sequence is a list of *pieces*,
(row group, start, stop) row ranges, so ranks read disjoint rows whatever the number and
sizes of the row groups, in training and evaluation alike:

- by default rank r of W takes the contiguous slice [r*N/W, (r+1)*N/W): every rank gets
  N/W rows (+-1) and decodes only the row groups its slice touches.
- unshuffled training (shuffle=False, drop_last=True, W > 1) interleaves at batch
  granularity: rank r takes rows [k*W*B + r*B, k*W*B + (r+1)*B) for k = 0, 1, ... Global
  step k is then rows [k*W*B, (k+1)*W*B) in file order, the batch one rank with batch W*B
  reads, so runs at different world sizes train on the same global batches. The price:
  a row group larger than W*B rows is decoded by every rank (each keeps its pieces).

Agreement. Each rank lists the files and reads their footers itself, so a file added or
rewritten while a job starts could give the ranks different row groups: different step
counts (one rank stops, the others hang in an all-reduce) or overlapping rows. So a reader
of a share (world_size > 1) in a process group compares, over all ranks, a digest of
(path, size, rows of each row group) of every file; a difference is a ValueError on every
rank naming the first file that differs, and a rank that cannot list its input makes every
rank raise. It is a collective: every rank builds such a reader at the same point.

Resume. A training reader's position records every file's path, size, rows of each row group
and the sha256 of its bytes (trainer/data/identity.py; the ranks share the hashing, each taking
every world_size-th file); resuming over a file added, removed or rewritten is a ValueError naming it.
At another world size a position inside an epoch resumes through the units each rank had left
(trainer/data/elastic.py): they become the resumed epoch's sequence of rows (`resumed`), which
the new ranks split as above.

Data loss. A training epoch is steps_in_epoch = min over ranks of (rank rows // B) steps
on every rank (all ranks compute it from the footers they agree on), so at most
W*B - 1 rows of an epoch are not trained on: contiguous slices leave each rank fewer than
B rows of its own plus at most W-1 rows of imbalance; interleaving leaves only the last,
partial round of W*B rows. `epoch_rows(epoch)` gives the split's rows and the rows used.

Windows. A rank's pieces are cut into *slices* where their row group's rows cross a
multiple of SLICE_ROWS (a piece within one slice stays whole), and the slices are grouped
into *windows* of at least `shuffle_buffer` rows; a window is read, encoded and given a
permutation seeded with (seed, epoch, rank, window), and its rows are streamed into batches
in that order (a batch may straddle two windows). The batches a rank has yielded in the
epoch fix its position exactly: the state is just (epoch, step), and resuming re-reads one
window and skips into it.

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

import bisect
import collections
import hashlib
import itertools
import json
import logging
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch.distributed as dist

from trainer.credentials import redact_uri
from trainer.data.batch import Batch, Part, Rows, assemble
from trainer.data.elastic import units_left
from trainer.data.encode import RowEncoder
from trainer.data.identity import file_digest, is_digest, shared_digests, shown
from trainer.data.store import resolve
from trainer.errors import DataUnavailableError

log = logging.getLogger("rankmix.data")

SLICE_ROWS = 65_536  # rows decoded at once: a larger row group is read in slices of this size
# Column chunks are read through a buffer of this many bytes each, not whole: a row group's
# chunks, even compressed, can be far larger than a slice.
READ_BUFFER = 1 << 20
PREFETCH_BATCHES = 2  # pinned batches made ahead of the consumer
DECODE_AHEAD = 1  # slices decoded ahead of the one being encoded
# Files' footers are read this many at a time: on an object store each file costs round trips.
METADATA_THREADS = 8


@dataclass(frozen=True)
class RowGroup:
    """One row group of one file, as its footer describes it."""

    path: str
    index: int
    num_rows: int
    first: int = 0  # the row group's row this range starts at (a validation share is its tail)


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of one row group: the unit of sharding and reading."""

    group: RowGroup
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class EpochRows:
    """What one epoch makes of the split: for reporting the rows training leaves out."""

    rows: int  # rows in the split
    used: int  # rows the epoch's batches consume over all ranks (every row in evaluation)

    @property
    def dropped(self) -> int:
        return self.rows - self.used


def _footer(fs: pafs.FileSystem, path: str) -> tuple[pa.Schema, list]:
    """A file's schema and row groups, from its footer alone."""
    frag = ds.ParquetFileFormat().make_fragment(path, filesystem=fs)
    schema = frag.physical_schema
    frag.ensure_complete_metadata()
    return schema, frag.row_groups


class ParquetReader:
    """Yields `Batch`es of `batch_size` rows for one rank; see the module docstring.

    Training (`drop_last=True`) runs epochs without end, each of the same number of
    steps on every rank. Evaluation (`drop_last=False`, one epoch) yields every row of
    the rank once; all ranks still yield the same number of equally sized batches, the
    padding rows carrying weight 0. `retry_seconds` and `retry_attempts`: how long a
    failing object store is retried (module docstring); 0 seconds gives up at once.
    `holdout_fraction` > 0 splits every row group: `holdout=True` reads only the last share of
    its rows (a validation split carved from training files), `holdout=False` only the rest.
    `pin_memory` assembles and pins batches ahead in a prefetch thread, so that copies to a
    CUDA device with non_blocking=True overlap compute (it needs CUDA).
    """

    def __init__(self, paths: str, encoder: RowEncoder, *, batch_size: int, shuffle_buffer: int = 0,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 rank: int = 0, world_size: int = 1, num_epochs: int = 0,
                 retry_seconds: float = 300.0, retry_attempts: int = 3, holdout_fraction: float = 0.0,
                 holdout: bool = False, pin_memory: bool = False):
        self.encoder = encoder
        self.pin_memory = pin_memory
        self.batch_size = batch_size
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.rank, self.world_size = rank, world_size
        self.num_epochs = num_epochs if drop_last else 1
        # unshuffled training keeps the global batches of every world size in file order
        self.interleaved = drop_last and not shuffle and world_size > 1
        self.source = redact_uri(paths)
        self.holdout_fraction, self.holdout = holdout_fraction, holdout
        self.row_groups = self._split(self._agreed_input(paths, retry_seconds, retry_attempts))
        self.num_rows = sum(g.num_rows for g in self.row_groups)
        self.epoch, self.step = 0, 0
        self.resumed: dict | None = None  # {"epoch", "units", "rows"}: an epoch resumed at another world size
        self._filler: Part | None = None
        self.peak_buffered_rows = 0

    # ------------------------------------------------------------------ metadata

    def _agreed_input(self, paths: str, retry_seconds: float, retry_attempts: int) -> list[RowGroup]:
        """The row groups of `paths`, the same on every rank (module docstring, Agreement)."""
        view, failure, infos = None, None, []
        try:
            self.store, infos = resolve(paths, retry_seconds, retry_attempts)
            self.fs, self.files = self.store.fs, [i.path for i in infos]
            groups = self._discover()
            view = _input_view(infos, groups)
            self.input_files = [[path, size, rows] for path, size, rows in view]  # in the state: lists, as JSON has them
        except Exception as e:  # any failure: the other ranks must not wait for this rank in the check
            failure = e
        if self.world_size > 1 and dist.is_initialized():
            _check_same_input(self.source, view, failure)
        if failure is not None:
            raise failure
        if self.drop_last:  # training: a position that a resume must check; evaluation never resumes
            digests = shared_digests(infos, self._digest, self.source, self.world_size)
            self.input_files = [[*file, digest] for file, digest in zip(self.input_files, digests, strict=True)]
        return groups

    def _digest(self, info: pafs.FileInfo) -> str:
        try:
            return self.store.call(partial(file_digest, self.fs, info), info.path)
        except (pa.ArrowException, OSError, ValueError) as e:  # not DataUnavailableError, a RuntimeError
            raise ValueError(f"cannot read Parquet file {info.path}: {e}") from None

    def _read_footer(self, path: str) -> tuple[pa.Schema, list]:
        try:
            return self.store.call(partial(_footer, self.fs, path), path)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"cannot read Parquet file {path}: {e}") from None

    def _discover(self) -> list[RowGroup]:
        groups = []
        footers = _concurrently([partial(self._read_footer, path) for path in self.files])
        for path, (schema, infos) in zip(self.files, footers):
            self.encoder.check_schema(schema, path)
            groups += [RowGroup(path, rg.id, rg.num_rows) for rg in infos if rg.num_rows]
        return groups

    def _split(self, groups: list[RowGroup]) -> list[RowGroup]:
        """With `holdout_fraction`: the last share of every row group's rows (`holdout`), or
        the rest. Every row group gives its tail, so the held-out rows spread over the files
        as the training rows do, and no row is in both."""
        if not self.holdout_fraction:
            return groups
        out = []
        for g in groups:
            held = int(g.num_rows * self.holdout_fraction)
            kept = RowGroup(g.path, g.index, held, g.num_rows - held) if self.holdout else \
                RowGroup(g.path, g.index, g.num_rows - held)
            if kept.num_rows:
                out.append(kept)
        if not out:
            raise ValueError(f"{self.source}: a holdout of {self.holdout_fraction} of every row group leaves "
                             f"no {'held-out' if self.holdout else 'training'} rows")
        return out

    def _spans(self, rank: int, n: int) -> Iterator[tuple[int, int]]:
        """`rank`'s rows as [start, stop) positions in an epoch's sequence of `n` rows."""
        w, b = self.world_size, self.batch_size
        if self.interleaved:
            return ((k, min(k + b, n)) for k in range(rank * b, n, w * b))
        return iter([(rank * n // w, (rank + 1) * n // w)])

    def _rank_rows(self, rank: int, n: int) -> int:
        """Rows of `rank` in an epoch of `n` rows: the sum over `_spans`, in closed form."""
        w, b = self.world_size, self.batch_size
        if self.interleaved:
            rounds, rest = divmod(n, w * b)
            return rounds * b + min(max(rest - rank * b, 0), b)
        return (rank + 1) * n // w - rank * n // w

    def _order(self, epoch: int) -> list[Piece]:
        """`epoch`'s sequence of rows: its row groups, shuffled with (seed, epoch) unless shuffle
        is off; or, for the epoch a resume at another world size took up, the rows it had left
        (trainer/data/elastic.py)."""
        if self.resumed is not None and self.resumed["epoch"] == epoch:
            return [Piece(self.row_groups[g], start, stop) for g, start, stop in self.resumed["units"]]
        order = self.row_groups
        if self.shuffle:
            order = [order[i] for i in np.random.default_rng([self.seed, epoch]).permutation(len(order))]
        return [Piece(g, 0, g.num_rows) for g in order]

    def with_units_left(self, state: dict) -> dict:
        """`state`, a position this reader passed, with what its epoch has left on this rank
        (`left`: units, `half_read`: consumed rows of a half-read window), for a resume at another
        world size (trainer/data/elastic.py). Once the epoch's batches are all out, nothing is left:
        the rest is drop_last's share, left out in any world size."""
        if state["step"] >= self.steps_in_epoch(state["epoch"]):
            return {**state, "left": [], "half_read": 0}
        positions = {g: i for i, g in enumerate(self.row_groups)}
        slices = [(position + s.start - p.start, positions[s.group], s.start, s.stop)
                  for position, p in self._placed(state["epoch"], self.rank) for s in _sliced([p])]
        windows = None
        if self.shuffle and self.shuffle_buffer:
            windows = [len(w) for w in self._windows([Piece(self.row_groups[g], a, b) for _, g, a, b in slices])]
        left, reread = units_left(slices, windows, state["step"] * self.batch_size)
        return {**state, "left": [list(u) for u in left], "half_read": reread}

    def _epoch_size(self, epoch: int) -> int:
        """Rows in `epoch`'s sequence."""
        if self.resumed is not None and self.resumed["epoch"] == epoch:
            return self.resumed["rows"]
        return self.num_rows

    def _placed(self, epoch: int, rank: int) -> list[tuple[int, Piece]]:
        """`rank`'s rows in `epoch`, in reading order, each piece with its first row's position
        in the epoch's sequence (the same answer on every rank)."""
        order = self._order(epoch)
        ends = list(itertools.accumulate(p.num_rows for p in order))
        placed = []
        for start, stop in self._spans(rank, ends[-1] if ends else 0):
            i = bisect.bisect_right(ends, start)
            while start < stop:
                p, base = order[i], ends[i] - order[i].num_rows
                end = min(stop, ends[i])
                placed.append((start, Piece(p.group, p.start + start - base, p.start + end - base)))
                start, i = end, i + 1
        return placed

    def _pieces(self, epoch: int, rank: int) -> list[Piece]:
        """`rank`'s rows in `epoch`, in reading order (the same answer on every rank)."""
        return [p for _, p in self._placed(epoch, rank)]

    def steps_in_epoch(self, epoch: int) -> int:
        """Batches every rank yields in `epoch`."""
        n = self._epoch_size(epoch)
        rows = [self._rank_rows(r, n) for r in range(self.world_size)]
        if self.drop_last:
            return min(rows) // self.batch_size
        return max(-(-r // self.batch_size) for r in rows)

    def epoch_rows(self, epoch: int) -> EpochRows:
        """The split's rows (of an epoch resumed at another world size: the rows it had left) and
        those `epoch` consumes on all ranks together; training leaves out fewer than
        world_size * batch_size (module docstring)."""
        if not self.drop_last:
            return EpochRows(self.num_rows, self.num_rows)
        return EpochRows(self._epoch_size(epoch), self.steps_in_epoch(epoch) * self.batch_size * self.world_size)

    def _windows(self, pieces: list[Piece]) -> list[list[Piece]]:
        windows: list[list[Piece]] = [[]]
        rows = 0
        for p in pieces:
            if windows[-1] and rows >= max(self.shuffle_buffer, 1):
                windows.append([])
                rows = 0
            windows[-1].append(p)
            rows += p.num_rows
        return windows

    # ------------------------------------------------------------------ streaming

    def __iter__(self) -> Iterator[Batch]:
        while not self.num_epochs or self.epoch < self.num_epochs:
            yield from self._epoch_batches()
            self.epoch, self.step = self.epoch + 1, 0

    def _epoch_batches(self) -> Iterator[Batch]:
        steps = self.steps_in_epoch(self.epoch)
        if steps == 0:
            rows = min(self._rank_rows(r, self._epoch_size(self.epoch)) for r in range(self.world_size))
            raise ValueError(f"{self.source}: a rank gets only {rows} rows in epoch {self.epoch}, fewer than "
                             f"one batch of {self.batch_size}; use a smaller batch or fewer ranks")
        batches = self._batches(self.epoch, self.step, steps)
        # Pinning gets a thread of its own (it waits on the CUDA driver); without it, handing each
        # batch from a thread to the consumer would cost more than assembling it.
        for batch in _pinned_ahead(batches) if self.pin_memory else batches:
            self.step += 1  # here, not in the thread: the position is that of the batches handed out
            yield batch

    def _batches(self, epoch: int, step: int, steps: int) -> Iterator[Batch]:
        """Batches `step` to `steps` - 1 of `epoch`."""
        windows = self._windows(_sliced(self._pieces(epoch, self.rank)))
        chunks = self._window_stream(windows, epoch, skip=step * self.batch_size)
        held: list[Part] = []  # rows read and not yet yielded, in order
        seen = False
        for _ in range(step, steps):
            while sum(r.num_rows for r in held) < self.batch_size and (t := next(chunks, None)) is not None:
                held.append(t)
                seen = True
            if not seen and self._filler is None:  # evaluation on a rank with no rows left: pad with any row
                self._filler = Part(self._read(Piece(self.row_groups[0], 0, 1)))
            yield self._padded(_take_front(held, self.batch_size))

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
        files = _LastFile(self.fs)
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
        real = sum(p.num_rows for p in parts)
        if real:
            self._filler = parts[0]  # its first row pads a later batch without rows of its own
        if real == self.batch_size:
            return assemble(parts)
        source = Rows.concat([p.as_rows() for p in parts or [self._filler.slice(0, 1)]])
        weights = np.zeros(self.batch_size, np.float32)
        weights[:real] = 1.0
        return assemble([Part(source, np.resize(np.arange(source.num_rows), self.batch_size))], weights)

    def _encode_window(self, parts: list[Rows], index: int, epoch: int) -> Part:
        """The window's rows, with their permutation where they are shuffled: batches gather
        from the window by it, rather than the whole window being copied in shuffled order."""
        rows = Rows.concat(parts)
        self.peak_buffered_rows = max(self.peak_buffered_rows, rows.num_rows)
        if self.shuffle and self.shuffle_buffer:
            return Part(rows, np.random.default_rng([self.seed, epoch, self.rank, index]).permutation(rows.num_rows))
        return Part(rows)

    def _read(self, p: Piece) -> Rows:
        """One piece's rows, decoded and encoded (a file opened for it alone)."""
        files = _LastFile(self.fs)
        try:
            return self._encode(p, self._decode(p, files))
        finally:
            files.close()

    def _decode(self, p: Piece, files: "_LastFile") -> pa.Table:
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
        return {"seed": self.seed, "world_size": self.world_size, "rank": self.rank,
                "batch_size": self.batch_size, "shuffle_buffer": self.shuffle_buffer, "shuffle": self.shuffle,
                "row_groups": len(self.row_groups), "rows": self.num_rows}

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
        if any(len(f) < 4 or not is_digest(f[3]) for f in state["files"]) and self.drop_last:
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
            if state.get(key) != mine:
                raise ValueError(f"data reader state was saved with {key}={state.get(key)} but this run has "
                                 f"{key}={mine}: the saved position cannot be honoured")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self.resumed = self._checked_resumed(state.get("resumed"))

    def _checked_resumed(self, resumed: dict | None) -> dict | None:
        """A resumed epoch's units as a checkpoint holds them: each a row range inside a row group of
        this input, and their rows the sum recorded (a checkpoint is data, not trusted code)."""
        if resumed is None:
            return None
        units, groups = resumed.get("units") if isinstance(resumed, dict) else None, self.row_groups
        if not (isinstance(units, list) and all(
                isinstance(u, list) and len(u) == 3 and all(type(x) is int for x in u)
                and 0 <= u[0] < len(groups) and 0 <= u[1] < u[2] <= groups[u[0]].num_rows for u in units)
                and type(resumed.get("epoch")) is int
                and resumed.get("rows") == sum(stop - start for _, start, stop in units)):
            raise ValueError("data reader state: its resumed epoch's units are not row ranges of this input's "
                             f"{len(groups)} row groups")
        return {"epoch": resumed["epoch"], "units": units, "rows": resumed["rows"]}


def _concurrently(calls: list) -> list:
    """The results of `calls`, in order, made up to METADATA_THREADS at a time; where calls fail,
    the first one's error in their order (not the first to happen) is raised."""
    with ThreadPoolExecutor(max_workers=max(1, min(METADATA_THREADS, len(calls)))) as pool:
        return list(pool.map(lambda call: call(), calls))


def _input_view(files: list[pafs.FileInfo], groups: list[RowGroup]) -> list[tuple[str, int, list[int]]]:
    """(path, bytes, rows of each row group) of every file: what the ranks must agree on."""
    rows: dict[str, list[int]] = {f.path: [] for f in files}
    for g in groups:
        rows[g.path].append(g.num_rows)
    return [(f.path, f.size, rows[f.path]) for f in files]


def file_change(saved: list[list], mine: list[list], rows: bool = True) -> str | None:
    """The first file, in path order, added, removed or changed between two lists of
    [path, bytes, rows of each row group, content digest] (the digest where both lists have one of
    trainer/data/identity.py; `rows=False`: compare paths and bytes only), in words."""
    def described(files: list[list]) -> dict[str, tuple]:
        return {f[0]: (f[1], list(f[2])) if rows else (f[1], None) for f in files}

    def digests(files: list[list]) -> dict[str, str | None]:
        return {f[0]: f[3] if rows and len(f) > 3 and is_digest(f[3]) else None for f in files}
    before, after = described(saved), described(mine)
    then, now = digests(saved), digests(mine)
    for path in sorted(before.keys() | after.keys()):
        if path not in after:
            return f"{path} was removed"
        if path not in before:
            return f"{path} was added"
        if before[path] != after[path]:
            return (f"{path} changed from {_described(before[path])} to {_described(after[path])}" if rows else
                    f"{path} changed from {before[path][0]} to {after[path][0]} bytes")
        if then[path] and now[path] and then[path] != now[path]:
            return (f"{path} was rewritten: still {_described(before[path])}, but the sha256 of its bytes "
                    f"changed from {shown(then[path])} to {shown(now[path])}")
    return None


def _check_same_input(source: str, view: list | None, failure: Exception | None) -> None:
    """Collective (module docstring, Agreement): raises on every rank where another rank
    failed to list its input (`view` None, `failure` its error) or lists other files than
    rank 0. Only plain data crosses: a digest and an error message, and the file lists when
    the digests differ."""
    digest = None if view is None else hashlib.sha256(json.dumps(view).encode()).hexdigest()
    reports: list = [None] * dist.get_world_size()
    message = None if failure is None else str(failure)
    dist.all_gather_object(reports, (digest, message, isinstance(failure, DataUnavailableError)))
    if failure is not None:
        return  # this rank raises its own error
    for rank, (_, message, unavailable) in enumerate(reports):
        if message is not None:
            raise (DataUnavailableError if unavailable else ValueError)(
                f"{source}: rank {rank} cannot read its input: {message}")
    if len({d for d, _, _ in reports}) > 1:
        views: list = [None] * len(reports)
        dist.all_gather_object(views, view)
        raise ValueError(_first_difference(source, views))


def _first_difference(source: str, views: list[list]) -> str:
    """The first file, in path order, that a rank sees otherwise than rank 0, and how."""
    seen = [{path: (size, list(rows)) for path, size, rows in view} for view in views]
    for path in sorted(set().union(*seen)):
        for rank in range(1, len(seen)):
            if seen[rank].get(path) != seen[0].get(path):
                return (f"{source}: the ranks see different files, so their steps would not match: {path} is "
                        f"{_described(seen[0].get(path))} on rank 0 but {_described(seen[rank].get(path))} on rank "
                        f"{rank}; were files added or rewritten while the job started? A run's input must not change")
    return f"{source}: the ranks list the same files in another order or number; a run's input must not change"


def _described(file: tuple[int, list[int]] | None) -> str:
    if file is None:
        return "missing"
    size, rows = file
    return f"{size} bytes in {len(rows)} row group(s) of {sum(rows)} rows"


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


def _sliced(pieces: list[Piece]) -> list[Piece]:
    """`pieces` cut where their row group's rows cross a multiple of SLICE_ROWS: the units
    read, decoded and windowed. A piece within one slice of its row group stays whole."""
    out = []
    for p in pieces:
        start, first = p.start, p.group.first
        while start < p.stop:
            stop = min(p.stop, ((first + start) // SLICE_ROWS + 1) * SLICE_ROWS - first)
            out.append(Piece(p.group, start, stop))
            start = stop
    return out


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
