"""Hive-partitioned logs in time order (data.order = "time"; docs/continuous.md).

Listing. `data.train_path` holds `KEY=VALUE/` folders (nested ones too: `date=.../hour=.../`),
parsed with pyarrow's hive partitioning. A partition is a folder of Parquet files under such
folders; it is complete once it holds `data.success_marker` ("": every partition is complete,
for writers that publish a partition atomically). Incomplete partitions are never read. Time
order is the order of the partition values, folder by folder: a key whose values are all
integers compares as integers, any other as strings (ISO dates sort as dates). Once a run has
taken up partitions, their keys' kinds are fixed: a new partition whose value of an integer key
is not one (`hour=late` after `hour=10`), or Hive's partition of nulls, is an error naming it;
once it is moved away the run goes on.

Reading. `PartitionedReader` reads the partitions one after the other, each through a
`ParquetReader` of its own (one epoch, shuffled within `shuffle_buffer`), so ranks split every
partition as they split a fixed file list: disjoint rows, equal steps. To the trainer an
"epoch" is one partition: `epoch` counts the partitions this run folder has trained.

State. A checkpoint holds the partitions consumed, each with its files (path, bytes, rows of
each row group), and the partition being trained with its ParquetReader position, which at
another world size resumes through the units each rank had left (trainer/data/elastic.py). On resume a
consumed partition whose files changed (compared by path and bytes, from the listing alone)
is an error naming the file, as is a new partition that sorts before the last consumed one, or
level with it (`hour=010` after `hour=10`); a consumed partition that is gone (retention) is
not. The partitions after the last consumed one are the new work.

Tables. An Iceberg or Delta table (`iceberg:<ns>.<table>`, `delta:<path>`; trainer/data/lakehouse.py)
is read the same way, its history standing for the folders: every snapshot (version) that
appended files is a partition named `snapshot=<id>` (`version=<n>`), holding the files it added,
in commit order; compactions are skipped, and a snapshot that removed rows is an error.

Agreement. Rank 0 lists the partitions and broadcasts the list over the side group, so every
rank trains the same partitions whatever its own view of a store being written to.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from trainer.config import table_format
from trainer.credentials import redact_uri
from trainer.data.assignment import EpochRows
from trainer.data.batch import Batch
from trainer.data.identity import file_change
from trainer.data.lakehouse import Table, metadata_errors, open_table, store_path
from trainer.data.reader import ParquetReader
from trainer.data.store import open_store
from trainer.dist import on_rank0

log = logging.getLogger("rankmix.data")


@dataclass(frozen=True)
class Partition:
    """One complete partition: its folder below the root, its files and its place in time."""

    name: str  # "date=2026-11-30", or "date=2026-11-30/hour=03": the folder below data.train_path
    key: tuple  # the partition values, folder by folder: what time order sorts by
    files: tuple[tuple[str, int], ...]  # (path, bytes) of its Parquet files, from the listing
    uris: tuple[str, ...] = ()  # a table's: its files as the reader opens them (with their store's scheme)


def list_partitions(root: str, marker: str, retry_seconds: float = 300.0, retry_attempts: int = 3,
                    like: Partition | None = None) -> list[Partition]:
    """The complete partitions under `root`, in time order (module docstring); `like`, the last
    partition taken up, fixes the keys and their kinds."""
    store, path = open_store(root, retry_seconds, retry_attempts)
    shown = redact_uri(root)
    infos = store.call(lambda: store.fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True)),
                       path)
    folders: dict[str, dict[str, int]] = {}  # partition folder -> {file name: bytes}
    for info in infos:
        if info.is_file and (info.base_name.endswith(".parquet") or info.base_name == marker):
            folder = posixpath.relpath(posixpath.dirname(info.path), path)
            if info.base_name.endswith(".parquet") and not _is_partition(folder):
                raise ValueError(f"{shown}: {info.path} lies outside the KEY=VALUE partition folders "
                                 "that data.order=time reads")
            folders.setdefault(folder, {})[info.path] = info.size
    # A folder of a marker alone is no partition: Spark also writes _SUCCESS at the top of what it wrote.
    folders = {f: files for f, files in folders.items() if any(p.endswith(".parquet") for p in files)}
    if not folders:
        raise ValueError(f"{shown}: no KEY=VALUE partition folders with Parquet files (data.order=time)")
    _same_keys(shown, list(folders))
    # Incomplete partitions are never read, so their values decide nothing (yet).
    complete = {name: files for name, files in folders.items()
                if not marker or posixpath.join(path, name, marker) in files}
    keys = _keys(shown, list(complete), like)
    return sorted((Partition(name, keys[name], tuple(sorted((p, size) for p, size in files.items()
                                                            if p.endswith(".parquet"))))
                   for name, files in complete.items()), key=lambda p: p.key)


def table_partitions(table: Table) -> list[Partition]:
    """The snapshots of `table` that appended rows, as partitions in commit order (module docstring)."""
    return [Partition(f"{table.kind}={c.number}", c.order, tuple((store_path(f.uri), f.size) for f in c.added),
                      tuple(f.uri for f in c.added)) for c in table.appends()]


def complete_partitions(root: str, marker: str, retry_seconds: float = 300.0, retry_attempts: int = 3) -> str:
    """`root` for a shuffled read (data.order = shuffled): where it is one folder holding
    KEY=VALUE partition folders, the folders of its complete partitions only (comma-separated,
    in time order; a shuffled reader deals their row groups anew every epoch), else `root`
    itself. Collective where a process group is up: rank 0 lists, so every rank reads the same."""
    return on_rank0(lambda: _complete_folders(root, marker, (retry_seconds, retry_attempts)))


def _complete_folders(root: str, marker: str, retries: tuple[float, int]) -> str:
    """`complete_partitions` on this rank alone."""
    if "," in root or any(c in root.partition("?")[0] for c in "*?["):
        return root  # a list or a glob names its own files
    store, path = open_store(root, *retries)
    below = store.call(lambda: _below(store.fs, path), path)
    if below is None or not any(i.type == pafs.FileType.Directory and _is_partition(i.base_name) for i in below):
        return root
    partitions = list_partitions(root, marker, *retries)
    if not partitions:
        raise ValueError(f"{redact_uri(root)}: none of its KEY=VALUE partitions is complete (holds {marker})")
    return ",".join(_child(root, p.name) for p in partitions)


def _below(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo] | None:
    """What lies directly below the folder `path`; None where it is no folder."""
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        return None
    return fs.get_file_info(pafs.FileSelector(path))


def _is_partition(folder: str) -> bool:
    return folder != "." and all("=" in part.strip("=") for part in folder.split("/"))


def _key_names(folder: str) -> list[str]:
    return [part.split("=", 1)[0] for part in folder.split("/")]


def _same_keys(shown: str, folders: list[str]) -> None:
    names = _key_names(folders[0])
    for folder in folders:
        if _key_names(folder) != names:
            raise ValueError(f"{shown}: partition {folder} does not have the keys {'/'.join(names)} of "
                             f"{folders[0]}: every partition needs the same keys, in the same order")


def _keys(shown: str, folders: list[str], like: Partition | None = None) -> dict[str, tuple]:
    """Each folder's partition values, parsed by pyarrow's hive partitioning (URL-decoded):
    integers where `like`'s are (a partition already taken up), else where every value of a
    key is one. A value that cannot take its place in time order is an error naming it."""
    if not folders:
        return {}
    names = _key_names(folders[0])
    hive = ds.partitioning(pa.schema([(n, pa.string()) for n in names]), flavor="hive")
    values = {f: ds.get_partition_keys(hive.parse(f"/{f}/")) for f in folders}
    for f, v in values.items():
        null = [n for n in names if v[n] is None]
        if null:
            raise ValueError(f"{shown}: partition {f}: its {null[0]} is Hive's null value, which has no place in "
                             "time order; move the folder out of data.train_path")
    if like is None:
        numeric = [all(_is_int(v[n]) for v in values.values()) for n in names]
    else:  # a kind that changed would reorder, or fail to compare with, what was trained
        _same_keys(shown, [like.name, *folders])
        numeric = [isinstance(k, int) for k in like.key]
        for f, v in values.items():
            bad = [n for n, integer in zip(names, numeric) if integer and not _is_int(v[n])]
            if bad:
                raise ValueError(f"{shown}: partition {f}: its {bad[0]} {v[bad[0]]!r} is not an integer, but the "
                                 f"partitions taken up before it ({like.name}) order {bad[0]} as integers; move "
                                 "the folder out of data.train_path, and the run goes on after them")
    return {f: tuple(int(v[n]) if integer else v[n] for n, integer in zip(names, numeric)) for f, v in values.items()}


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _child(root: str, name: str) -> str:
    """The URI of the folder `name` under `root`, keeping a URI's options (`?...`)."""
    base, sep, options = root.partition("?")
    return f"{base.rstrip('/')}/{name}{sep}{options}"


class PartitionedReader:
    """Batches of the complete partitions under `root`, one partition after the other, each
    read by `open_partition(uri, name)` -> a one-epoch ParquetReader. `refresh()` (collective)
    takes up partitions that completed since; `__iter__` yields the batches of the
    partitions known when it gets to them and ends after the last."""

    def __init__(self, root: str, open_partition: Callable[[str, str], ParquetReader], *, marker: str,
                 retry_seconds: float = 300.0, retry_attempts: int = 3, catalog: dict[str, str] | None = None):
        self.root, self.marker = root, marker
        self.open_partition = open_partition
        self._retries = (retry_seconds, retry_attempts)
        self.catalog = catalog or {}  # [data.catalog], for an iceberg: root
        self._table: Table | None = None  # a table root, opened on rank 0 at the first listing
        self.sequence: list[Partition] = []  # consumed partitions (trained by this run folder), then pending ones
        self.consumed: tuple[dict, ...] = ()  # {"partition", "files"} of sequence[:epoch]; replaced, never changed
        self.readers: dict[int, ParquetReader] = {}  # by epoch, opened on demand
        self.epoch = 0
        self.refresh()

    # ------------------------------------------------------------------ listing

    def refresh(self) -> list[Partition]:
        """Take up the complete partitions after the last known one (collective: rank 0's
        listing); returns them. A new partition that sorts before it is an error."""
        last = self.sequence[-1] if self.sequence else None
        listed = self._agreed_listing(last)
        new = [p for p in listed if last is None or p.key > last.key]
        known = {p.name for p in self.sequence}
        late = [p for p in listed if last is not None and p.key <= last.key and p.name not in known]
        if late:
            raise ValueError(f"{redact_uri(self.root)}: partition {late[0].name} completed after {last.name} was "
                             "taken up but sorts before it: time order cannot train it")
        self.sequence += new
        return new

    def _agreed_listing(self, like: Partition | None) -> list[Partition]:
        """Rank 0's listing on every rank; its error raised on every rank."""
        return on_rank0(lambda: self._list(like))

    def _list(self, like: Partition | None) -> list[Partition]:
        if table_format(self.root) is None:
            return list_partitions(self.root, self.marker, *self._retries, like=like)
        with metadata_errors(self.root):
            if self._table is None:
                self._table = open_table(self.root, self.catalog)
            else:
                self._table.refresh()
            return table_partitions(self._table)

    def reader(self, epoch: int) -> ParquetReader:
        """The reader of the `epoch`-th partition (collective the first time: it lists its files)."""
        if epoch not in self.readers:
            self.readers[epoch] = self.open_partition(self.uri(epoch), self.sequence[epoch].name)
        return self.readers[epoch]

    def uri(self, epoch: int) -> str:
        """The folder of the `epoch`-th partition (a table's: its files, comma-separated)."""
        if table_format(self.root) is not None:
            return ",".join(self.sequence[epoch].uris)
        return _child(self.root, self.sequence[epoch].name)

    @property
    def partition(self) -> str:
        """The partition being trained, or the next one."""
        return self.sequence[self.epoch].name if self.epoch < len(self.sequence) else ""

    def steps_in_epoch(self, epoch: int) -> int:
        """Steps of the `epoch`-th partition (0 for one of fewer rows than a batch per rank)."""
        return self.reader(epoch).steps_in_epoch(0)

    def epoch_rows(self, epoch: int) -> EpochRows:
        return self.reader(epoch).epoch_rows(0)

    def steps_left(self) -> int:
        """Steps of the known partitions from the current position (collective: opens them)."""
        current = self.readers[self.epoch].step if self.epoch in self.readers else 0
        return sum(self.steps_in_epoch(e) for e in range(self.epoch, len(self.sequence))) - current

    # ------------------------------------------------------------------ streaming

    def __iter__(self) -> Iterator[Batch]:
        while self.epoch < len(self.sequence):
            reader = self.reader(self.epoch)
            if reader.steps_in_epoch(0):
                yield from reader
            else:
                log.warning("partition %s: fewer rows than one batch per rank; skipped", self.partition)
            self.consumed = self._consumed(reader)
            self.readers.pop(self.epoch - 1, None)  # the one before: the trainer may still ask about this one
            self.epoch += 1

    def _consumed(self, reader: ParquetReader) -> tuple[dict, ...]:
        """The consumed partitions once the current one, read by `reader`, is done."""
        part = self.sequence[self.epoch]
        return (*self.consumed, {"partition": part.name, "key": list(part.key), "files": reader.input_files})

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Partitions consumed (the current one too once its last batch is out: `done`, an
        epoch boundary in any world size) and the position inside the current one."""
        current = self.readers.get(self.epoch)
        step = current.step if current is not None else 0
        done = current is not None and step == current.steps_in_epoch(0)
        inside = current is not None and (step or current.resumed) and not done
        return {"epoch": self.epoch, "step": step, "partition": self.partition, "done": done,
                "consumed": self._consumed(current) if done else self.consumed,
                "reader": current.state_dict() if inside else None}

    def with_units_left(self, state: dict) -> dict:
        """`state` with what its partition has left on this rank (its ParquetReader's units), for a
        resume at another world size (trainer/data/elastic.py)."""
        current = self.readers.get(state["epoch"])
        if not state.get("reader") or current is None:
            return state
        return {**state, "reader": current.with_units_left(state["reader"])}

    def _after_table_history(self, last: dict, listed: dict[str, Partition]) -> None:
        """Refuse a table whose history no longer holds the last trained snapshot: expired or rolled
        back, what came after it cannot be told."""
        if last["partition"] not in listed:
            raise ValueError(f"data reader state: {redact_uri(self.root)}: {last['partition']} was trained last, "
                             "but the table's history no longer holds it (snapshots expired, or rolled back): the "
                             "commits after it cannot be told; start a new run folder from this one's weights "
                             "(checkpoint.load_path)")

    def load_state_dict(self, state: dict) -> None:
        """Continue after the saved partitions: refuse a trained partition whose files changed
        or a new one that sorts before the last trained one; resume inside the saved current one."""
        consumed = tuple(state["consumed"])
        # the listing's keys take the kinds of the trained ones' (list_partitions); a table's are its order
        if consumed and table_format(self.root) is None:
            last = consumed[-1]
            keys = _keys(redact_uri(self.root), [p.name for p in self.sequence],
                         Partition(last["partition"], tuple(last["key"]), ()))
            self.sequence = sorted((replace(p, key=keys[p.name]) for p in self.sequence), key=lambda p: p.key)
        listed = {p.name: p for p in self.sequence}
        if consumed and table_format(self.root) is not None:
            self._after_table_history(consumed[-1], listed)
        for c in consumed:
            # a table's snapshot is its identity (the format never changes one); its listing may hold,
            # before the last trained one, a cleaned-up Delta log's oldest version standing for the past
            if c["partition"] in listed and table_format(self.root) is None:
                change = file_change(c["files"], listed[c["partition"]].files, rows=False)
                if change:
                    raise ValueError(f"data reader state: partition {c['partition']} was trained, but {change} "
                                     "since; a trained partition must not change (write a new partition instead)")
        names = {c["partition"] for c in consumed}
        after = [p for p in self.sequence if p.name not in names and
                 (table_format(self.root) is None or not consumed or p.key > tuple(consumed[-1]["key"]))]
        # A twin of its key (hour=010 after hour=10) is late too, as refresh has it.
        if consumed and after and after[0].key <= tuple(consumed[-1]["key"]):
            raise ValueError(f"data reader state: partition {after[0].name} is new but sorts before the last "
                             f"trained partition {consumed[-1]['partition']}: time order cannot train it")
        # Trained partitions keep their epoch numbers and are never read again (their files may be gone).
        trained = [Partition(c["partition"], tuple(c["key"]), ()) for c in consumed]
        self.sequence, self.consumed, self.readers, self.epoch = trained + after, consumed, {}, len(consumed)
        if state.get("reader") or state.get("resumed"):
            if self.partition != state["partition"]:
                raise ValueError(f"data reader state: partition {state['partition']} was being trained, but it is "
                                 "no longer complete under data.train_path")
            reader = self.reader(self.epoch)
            # `resumed`: the rows the partition had left at another world size (TrainedPosition.load_resized)
            reader.load_state_dict(state.get("reader") or {**reader.state_dict(), "resumed": state["resumed"]})
