"""Lakehouse tables as a run's input (docs/data.md, "Tables"): `iceberg:<namespace>.<table>`
through pyiceberg and `delta:<path or URI>` through deltalake (delta-rs).

A table is read as one of its snapshots (Iceberg's snapshot id, Delta's version): the snapshot's
data files, listed by the table's own metadata, are handed to the Parquet reader as a file list,
so the reader's machinery is the one of loose files (row-range split, bounded memory, rank
balance, the sha256 of each file's bytes in the checkpoint). Files that a later compaction
replaces stay in the table until its snapshots are expired, so a run pinned to a snapshot resumes
on the same bytes however the table moved on.

Deleted rows are never read as if they were there: a snapshot with Iceberg delete files
(position or equality deletes) or Delta deletion vectors is refused, naming the table and the
snapshot (compact it, or pin a snapshot before the deletes).

Time order (`data.order = "time"`, trainer/data/partitions.py) reads a table's history instead:
each snapshot that appended files is a partition (its added files), in commit order; a
compaction (Iceberg `replace`, Delta `OPTIMIZE`: files rewritten, as many rows as before) is
recognised and skipped; a snapshot that removes rows (delete, overwrite, merge) is an error.

Both libraries are imported when a table is opened: a run of loose files never loads them.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import pyarrow as pa

from trainer.config import DEFAULT_CATALOG, table_format
from trainer.credentials import redact_uri


@dataclass(frozen=True)
class DataFile:
    """One Parquet file of a table, as its metadata records it."""

    uri: str  # as the reader opens it: a local path or a pyarrow filesystem URI
    size: int  # bytes
    rows: int


@dataclass(frozen=True)
class Commit:
    """One snapshot (version) of a table's history, as time order reads it."""

    number: int  # Iceberg's snapshot id, Delta's version
    order: int  # its place in time: Iceberg's sequence number, Delta's version
    operation: str  # the table's own word for it: append, replace, OPTIMIZE, WRITE, DELETE, ...
    added: tuple[DataFile, ...]  # the data files it added
    removed_rows: int  # rows of the data files it removed
    compaction: bool  # the table says it rewrote files without changing the rows


class Table:
    """A table at its snapshots. Subclasses read one format's metadata."""

    kind = ""
    snapshot_option = ""  # the [data] key that pins a snapshot

    def __init__(self, path: str):
        self.path = path  # "iceberg:ns.table" or "delta:/path"
        self.shown = redact_uri(path)

    def current(self) -> int:
        """The newest snapshot (version); a table without one is an error."""
        raise NotImplementedError

    def refresh(self) -> None:
        """Read the table's metadata again: the commits made since it was opened."""
        raise NotImplementedError

    def files(self, snapshot: int) -> list[DataFile]:
        """The data files of `snapshot`, sorted by URI; deleted rows in it are an error."""
        raise NotImplementedError

    def commits(self) -> Iterator[Commit]:
        """The table's history, oldest first (the current snapshot's ancestry)."""
        raise NotImplementedError

    def appends(self, after: int | None = None) -> list[Commit]:
        """The commits that added rows, oldest first, those before `after` (an order) left out;
        compactions skipped, and a commit that removed rows an error naming it."""
        out = []
        for commit in self.commits():
            if after is not None and commit.order <= after:
                continue
            added_rows = sum(f.rows for f in commit.added)
            if commit.removed_rows == 0 and commit.added:
                out.append(commit)
            elif commit.compaction and added_rows == commit.removed_rows:
                continue  # the same rows in other files: nothing new to train
            elif commit.removed_rows:
                removed = commit.removed_rows if commit.removed_rows > 0 else "some"
                raise ValueError(f"{self.shown}: {self.kind} {commit.number} ({commit.operation}) removes "
                                 f"{removed} rows and adds {added_rows}; data.order=time follows appends and "
                                 "compactions only: a trained row cannot be taken back")
        return out

    def _refuse_deletes(self, snapshot: int, what: str) -> None:
        raise ValueError(f"{self.shown}: {self.kind} {snapshot} has {what}; rankmix does not apply them, and will "
                         f"not read deleted rows as if they were there: compact the table, or pin a "
                         f"{self.kind} before the deletes ({self.snapshot_option})")


class IcebergTable(Table):
    """An Iceberg table of a pyiceberg catalog ([data.catalog]: its properties)."""

    kind = "snapshot"
    snapshot_option = "data.snapshot"

    def __init__(self, path: str, catalog: dict[str, str]):
        super().__init__(path)
        from pyiceberg.catalog import load_catalog
        from pyiceberg.exceptions import NoSuchTableError

        name = path.partition(":")[2]
        if name.count(".") < 1 or "" in name.split("."):
            raise ValueError(f"data path {path!r}: expected iceberg:<namespace>.<table>")
        properties = dict(catalog)
        catalog_name = properties.pop("name", DEFAULT_CATALOG)
        if "type" not in properties and properties.get("uri", "").startswith("sqlite"):
            properties["type"] = "sql"  # the embedded catalog: a SQLite file, no server
        try:
            self.table = load_catalog(catalog_name, **properties).load_table(name)
        except NoSuchTableError:
            raise ValueError(f"{self.shown}: no such table in the catalog of [data.catalog]") from None
        except (ValueError, OSError, ImportError) as e:
            raise ValueError(f"{self.shown}: cannot open its catalog ([data.catalog]): "
                             f"{redact_uri(str(e).splitlines()[0] if str(e) else type(e).__name__)}") from None

    def refresh(self) -> None:
        self.table.refresh()

    def current(self) -> int:
        snapshot = self.table.current_snapshot()
        if snapshot is None:
            raise ValueError(f"{self.shown}: the table has no snapshot yet (no rows were ever written)")
        return snapshot.snapshot_id

    def _snapshot(self, snapshot: int):
        found = self.table.snapshot_by_id(snapshot)
        if found is None:
            raise ValueError(f"{self.shown}: no snapshot {snapshot} (data.snapshot); the table's snapshots are "
                             f"{', '.join(str(s.snapshot_id) for s in self.table.snapshots()[-5:])} (newest last), "
                             "unless expired")
        return found

    def files(self, snapshot: int) -> list[DataFile]:
        self._snapshot(snapshot)
        files = []
        for task in self.table.scan(snapshot_id=snapshot).plan_files():
            if task.delete_files:
                self._refuse_deletes(snapshot, f"{len(task.delete_files)} delete file(s) on {task.file.file_path}")
            files.append(_iceberg_file(task.file))
        return _checked(self.shown, files)

    def commits(self) -> Iterator[Commit]:
        from pyiceberg.manifest import ManifestEntryStatus
        from pyiceberg.table.snapshots import Operation, ancestors_of

        current = self.table.current_snapshot()
        lineage = list(ancestors_of(current, self.table.metadata)) if current is not None else []
        for snap in sorted(lineage, key=lambda s: s.sequence_number):
            summary = snap.summary
            added = [_iceberg_file(entry.data_file)
                     for manifest in snap.manifests(self.table.io) if manifest.added_snapshot_id == snap.snapshot_id
                     for entry in manifest.fetch_manifest_entry(self.table.io, discard_deleted=False)
                     if entry.status == ManifestEntryStatus.ADDED and entry.snapshot_id == snap.snapshot_id]
            operation = summary.operation if summary is not None else Operation.APPEND
            removed = int(summary.get("deleted-records", 0) or 0) if summary is not None else 0
            if summary is not None and int(summary.get("added-delete-files", 0) or 0):
                removed = removed or -1  # rows deleted by a delete file: their number is not in the summary
            yield Commit(snap.snapshot_id, snap.sequence_number, operation.value,
                         tuple(_checked(self.shown, added)), removed, operation == Operation.REPLACE)


class DeltaLakeTable(Table):
    """A Delta table, local or on an object store (credentials from the environment)."""

    kind = "version"
    snapshot_option = "data.version"

    def __init__(self, path: str):
        super().__init__(path)
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError

        self.uri = path.partition(":")[2]
        if not self.uri:
            raise ValueError(f"data path {path!r}: expected delta:<path or URI>")
        if "://" not in self.uri:
            self.uri = posixpath.abspath(self.uri)
        self._open = DeltaTable
        try:
            self.table = DeltaTable(self.uri)
        except TableNotFoundError:
            raise ValueError(f"{self.shown}: no Delta table there (no _delta_log)") from None
        self._versions: dict[int, dict[str, DataFile]] = {}

    def refresh(self) -> None:
        self.table = self._open(self.uri)

    def current(self) -> int:
        return self.table.version()

    def _at(self, version: int):
        from deltalake.exceptions import DeltaError

        try:
            return self._open(self.uri, version=version)
        except DeltaError as e:
            raise ValueError(f"{self.shown}: cannot load version {version} (data.version; the newest is "
                             f"{self.current()}): {str(e).splitlines()[0][:200]}") from None

    def _files_at(self, version: int) -> dict[str, DataFile]:
        """uri -> file of `version` (cached: a version never changes)."""
        if version not in self._versions:
            table = self._at(version)
            actions = pa.table(table.get_add_actions(flatten=True)).to_pydict()  # arro3 -> pyarrow, no copy
            by_path = {p: (s, n) for p, s, n in zip(actions["path"], actions["size_bytes"], actions["num_records"])}
            files = {}
            for uri in table.file_uris():
                size, rows = next(v for p, v in by_path.items() if uri.endswith(p) or uri.endswith(_unquoted(p)))
                files[uri] = DataFile(uri, int(size), int(rows if rows is not None else -1))
            self._versions[version] = files
        return self._versions[version]

    def files(self, snapshot: int) -> list[DataFile]:
        table = self._at(snapshot)
        if "deletionVectors" in (table.protocol().reader_features or []):
            vectors = pa.RecordBatchReader.from_stream(table.deletion_vectors()).read_all()
            if vectors.num_rows:
                self._refuse_deletes(snapshot, f"deletion vectors on {vectors.num_rows} file(s)")
        return _checked(self.shown, sorted(self._files_at(snapshot).values(), key=lambda f: f.uri))

    def commits(self) -> Iterator[Commit]:
        history = {h["version"]: h for h in self.table.history()}
        before: dict[str, DataFile] = {}
        for version in range(min(history, default=0), self.current() + 1):
            files = self._files_at(version)
            added = sorted((f for uri, f in files.items() if uri not in before), key=lambda f: f.uri)
            removed = [f for uri, f in before.items() if uri not in files]
            operation = history.get(version, {}).get("operation", "")
            yield Commit(version, version, operation, tuple(_checked(self.shown, added)),
                         sum(f.rows for f in removed), operation == "OPTIMIZE")
            before = files


def open_table(path: str, catalog: dict[str, str]) -> Table:
    """The table `path` names (`table_format(path)` is not None)."""
    kind = table_format(path)
    assert kind is not None, path
    if kind == "iceberg":
        return IcebergTable(path, catalog)
    return DeltaLakeTable(path)


def _iceberg_file(data_file) -> DataFile:
    return DataFile(_local(data_file.file_path), int(data_file.file_size_in_bytes), int(data_file.record_count))


def _local(uri: str) -> str:
    """A file:// URI as a local path (the form the reader lists local files in)."""
    parts = urlsplit(uri)
    return _unquoted(parts.path) if parts.scheme == "file" else uri


def _unquoted(path: str) -> str:
    return unquote(path)


def _checked(shown: str, files: list[DataFile]) -> list[DataFile]:
    """`files`, refusing a URI the reader's comma-separated path list cannot carry."""
    for f in files:
        if "," in f.uri:
            raise ValueError(f"{shown}: data file {redact_uri(f.uri)} has a ',' in its path, which rankmix's "
                             "file lists cannot carry; rename it (rewrite the table's files)")
    return files
