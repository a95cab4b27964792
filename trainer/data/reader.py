"""Streaming Parquet reader: row-group granularity, bounded memory, exact resume.

Every rank sees the same list of row groups (from the files' footers), shuffled per
epoch with a seed, and takes every `world_size`-th one, so ranks read disjoint row
groups. A rank's row groups are grouped into *windows* of at least `shuffle_buffer`
rows; a window is read, encoded, permuted with a seed of (seed, epoch, rank, window)
and its rows are streamed into batches (a batch may straddle two windows). The rows a
rank has consumed in the epoch therefore fix its position exactly: the state is just
(epoch, rows consumed), and resuming re-reads one window and skips into it.

Memory: at most the current and the next window, each below `shuffle_buffer` plus
one row group. A window is held encoded, as numpy columns (`Rows`): encoding, shuffling
and batch assembly work on whole columns, and a batch is a slice of the window copied
once into its tensors. All ranks compute every rank's row count from the footers, so they agree
on the steps per epoch (the smallest rank's rows // batch) without communicating.
"""

from __future__ import annotations

import fnmatch
import posixpath
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from trainer.data.batch import Batch, Rows
from trainer.data.encode import RowEncoder


@dataclass(frozen=True)
class RowGroup:
    """One row group of one file: the unit of sharding and shuffling."""

    path: str
    index: int
    num_rows: int


def resolve_files(spec: str) -> tuple[pafs.FileSystem, list[str]]:
    """Comma-separated files, directories (every *.parquet below) or globs; local or URI."""
    fs: pafs.FileSystem | None = None
    files: list[str] = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        item_fs, path = (pafs.FileSystem.from_uri(item) if "://" in item
                         else (pafs.LocalFileSystem(), posixpath.abspath(item)))
        if fs is not None and item_fs.type_name != fs.type_name:
            raise ValueError(f"data path {spec!r} mixes filesystems ({fs.type_name}, {item_fs.type_name})")
        fs = item_fs
        files += _expand(fs, path, item)
    if fs is None or not files:
        raise ValueError(f"no Parquet files found at {spec!r}")
    return fs, files


def _expand(fs: pafs.FileSystem, path: str, shown: str) -> list[str]:
    if any(c in path for c in "*?["):
        parent, pattern = posixpath.split(path)
        infos = fs.get_file_info(pafs.FileSelector(parent, allow_not_found=True))
        return sorted(i.path for i in infos if i.is_file and fnmatch.fnmatch(i.base_name, pattern))
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise ValueError(f"data path not found: {shown}")
    if info.type == pafs.FileType.Directory:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        return sorted(i.path for i in infos if i.is_file and i.base_name.endswith(".parquet"))
    return [path]


class ParquetReader:
    """Yields `Batch`es of `batch_size` rows for one rank; see the module docstring.

    Training (`drop_last=True`) runs epochs without end, each of the same number of
    steps on every rank. Evaluation (`drop_last=False`, one epoch) yields every row of
    the rank once; all ranks still yield the same number of equally sized batches, the
    padding rows carrying weight 0.
    """

    def __init__(self, paths: str, encoder: RowEncoder, *, batch_size: int, shuffle_buffer: int = 0,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 rank: int = 0, world_size: int = 1, num_epochs: int = 0):
        self.encoder = encoder
        self.batch_size = batch_size
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.rank, self.world_size = rank, world_size
        self.num_epochs = num_epochs if drop_last else 1
        self.source = paths
        self.fs, self.files = resolve_files(paths)
        self.row_groups = self._discover()
        self.epoch, self.step = 0, 0
        self._filler: Rows | None = None
        self.peak_buffered_rows = 0
        if drop_last and len(self.row_groups) < world_size:
            raise ValueError(f"{paths}: {len(self.row_groups)} row groups cannot be split over "
                             f"{world_size} ranks; write smaller row groups or more files")

    # ------------------------------------------------------------------ metadata

    def _discover(self) -> list[RowGroup]:
        fmt = ds.ParquetFileFormat()
        groups = []
        for path in self.files:
            try:
                frag = fmt.make_fragment(path, filesystem=self.fs)
                schema = frag.physical_schema
                frag.ensure_complete_metadata()
                infos = frag.row_groups
            except (pa.ArrowException, OSError) as e:
                raise ValueError(f"cannot read Parquet file {path}: {e}") from None
            self.encoder.check_schema(schema, path)
            groups += [RowGroup(path, rg.id, rg.num_rows) for rg in infos if rg.num_rows]
        return groups

    @property
    def num_rows(self) -> int:
        return sum(g.num_rows for g in self.row_groups)

    def _assignment(self, epoch: int) -> list[list[RowGroup]]:
        """Every rank's row groups for `epoch` (the same answer on every rank)."""
        order = np.arange(len(self.row_groups))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(order)
        return [[self.row_groups[i] for i in order[r::self.world_size]] for r in range(self.world_size)]

    def steps_in_epoch(self, epoch: int) -> int:
        """Batches every rank yields in `epoch`."""
        rows = [sum(g.num_rows for g in groups) for groups in self._assignment(epoch)]
        if self.drop_last:
            return min(rows) // self.batch_size
        return max(-(-r // self.batch_size) for r in rows)

    def _windows(self, groups: list[RowGroup]) -> list[list[RowGroup]]:
        windows: list[list[RowGroup]] = [[]]
        rows = 0
        for g in groups:
            if windows[-1] and rows >= max(self.shuffle_buffer, 1):
                windows.append([])
                rows = 0
            windows[-1].append(g)
            rows += g.num_rows
        return windows

    # ------------------------------------------------------------------ streaming

    def __iter__(self) -> Iterator[Batch]:
        while not self.num_epochs or self.epoch < self.num_epochs:
            yield from self._epoch_batches()
            self.epoch, self.step = self.epoch + 1, 0

    def _epoch_batches(self) -> Iterator[Batch]:
        steps = self.steps_in_epoch(self.epoch)
        if steps == 0:
            rows = min(sum(g.num_rows for g in groups) for groups in self._assignment(self.epoch))
            raise ValueError(f"{self.source}: a rank gets only {rows} rows in epoch {self.epoch}, fewer than "
                             f"one batch of {self.batch_size}; use a smaller batch or fewer ranks")
        windows = self._windows(self._assignment(self.epoch)[self.rank])
        chunks = self._window_stream(windows, skip=self.step * self.batch_size)
        held: list[Rows] = []  # rows read and not yet yielded, in order
        seen = False
        while self.step < steps:
            while sum(r.num_rows for r in held) < self.batch_size and (t := next(chunks, None)) is not None:
                held.append(t)
                seen = True
            if not seen and self._filler is None:  # evaluation on a rank with no rows left: pad with any row
                self._filler = self._read(self.row_groups[0]).slice(0, 1)
            rows = _take_front(held, self.batch_size)
            self.step += 1
            yield self._padded(rows)

    def _window_stream(self, windows: list[list[RowGroup]], skip: int) -> Iterator[Rows]:
        """Encoded, shuffled rows of `windows`, starting `skip` rows in. The next window is
        read and encoded in a background thread while this one is consumed: Parquet decode
        and most of the encoding run outside the GIL."""
        todo = []
        for i, window in enumerate(windows):
            size = sum(g.num_rows for g in window)
            if skip >= size:
                skip -= size
                continue
            todo.append((i, window, skip))
            skip = 0
        if not todo:
            return
        files = _LastFile(self.fs)
        try:
            with ThreadPoolExecutor(max_workers=1) as pool:
                load = partial(self._load_window, epoch=self.epoch, files=files)
                future = pool.submit(load, todo[0][1], todo[0][0])
                for k, (_, _, start) in enumerate(todo):
                    rows = future.result()
                    if k + 1 < len(todo):
                        future = pool.submit(load, todo[k + 1][1], todo[k + 1][0])
                    yield rows.slice(start)
        finally:
            files.close()

    def _padded(self, rows: Rows | None) -> Batch:
        """Evaluation's short batches are filled to batch_size with weight-0 copies of rows."""
        real = rows.num_rows if rows is not None else 0
        if real:
            self._filler = rows.slice(0, 1)
        if real == self.batch_size:
            return rows.to_batch()
        source = rows if real else self._filler
        weights = np.zeros(self.batch_size, np.float32)
        weights[:real] = 1.0
        take = np.resize(np.arange(source.num_rows), self.batch_size)
        return source.take(take).to_batch(weights)

    def _load_window(self, groups: list[RowGroup], index: int, epoch: int, files: "_LastFile") -> Rows:
        rows = Rows.concat([self._read(g, files) for g in groups])
        if self.shuffle and self.shuffle_buffer:
            rng = np.random.default_rng([self.seed, epoch, self.rank, index])
            rows = rows.take(rng.permutation(rows.num_rows))
        self.peak_buffered_rows = max(self.peak_buffered_rows, rows.num_rows)
        return rows

    def _read(self, g: RowGroup, files: "_LastFile | None" = None) -> Rows:
        where = f"{g.path}, row group {g.index}"
        own = files is None
        files = _LastFile(self.fs) if own else files
        try:
            raw = files.get(g.path).read_row_group(g.index, columns=self.encoder.columns)
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"cannot read {where}: {e}") from None
        finally:
            if own:
                files.close()
        return self.encoder.encode(raw, where)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Exact position: epoch and batches yielded in it, plus what gives them meaning."""
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed,
                "world_size": self.world_size, "rank": self.rank, "batch_size": self.batch_size,
                "shuffle_buffer": self.shuffle_buffer, "row_groups": len(self.row_groups)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state`'s position; a position that means something else here is an error."""
        for key in ("seed", "world_size", "rank", "batch_size", "shuffle_buffer", "row_groups"):
            if state[key] != getattr(self, key) if key != "row_groups" else state[key] != len(self.row_groups):
                mine = len(self.row_groups) if key == "row_groups" else getattr(self, key)
                raise ValueError(f"data reader state was saved with {key}={state[key]} but this run has "
                                 f"{key}={mine}: the saved position cannot be honoured")
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


def _take_front(held: list[Rows], n: int) -> Rows | None:
    """Remove the first `n` rows from `held` (fewer where it runs out) and return them:
    a view when they lie in one window, a copy where they straddle two."""
    parts = []
    while n and held:
        head = held[0]
        if head.num_rows <= n:
            parts.append(held.pop(0))
        else:
            parts.append(head.slice(0, n))
            held[0] = head.slice(n)
        n -= parts[-1].num_rows
    return Rows.concat(parts) if parts else None


class _LastFile:
    """The Parquet file read last, kept open for the next row group: consecutive row
    groups often share a file, and opening one (footer parse, reader set-up) costs about
    a third of decoding a 16k-row row group. Used by one thread at a time."""

    def __init__(self, fs: pafs.FileSystem):
        self.fs = fs
        self.path: str | None = None
        self.stream: pa.NativeFile | None = None
        self.file: pq.ParquetFile | None = None

    def get(self, path: str) -> pq.ParquetFile:
        if path != self.path:
            self.close()
            stream = self.fs.open_input_file(path)
            try:
                self.file = pq.ParquetFile(stream)
            except BaseException:
                stream.close()
                raise
            self.path, self.stream = path, stream
        return self.file

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.path = self.stream = self.file = None
