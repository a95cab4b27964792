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

import contextlib
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import pyarrow as pa

from trainer.config import DEFAULT_CATALOG, table_format
from trainer.credentials import redact_uri
from trainer.errors import DataUnavailableError


@dataclass(frozen=True)
class DataFile:
    """One Parquet file of a table, as its metadata records it."""

    uri: str  # as the reader opens it: a local path or a pyarrow filesystem URI
    size: int  # bytes
    rows: int
    deletes: str = ""  # Delta: the descriptor of the file's deletion vector ("" : none)


@dataclass(frozen=True)
class Commit:
    """One snapshot (version) of a table's history, as time order reads it."""

    number: int  # Iceberg's snapshot id, Delta's version
    order: tuple[int, ...]  # its place in time: Iceberg's (sequence number, commit ms), Delta's (version,)
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

    def appends(self) -> list[Commit]:
        """The commits that added rows, oldest first; compactions skipped, and a commit that
        removed rows an error naming it."""
        out = []
        for commit in self.commits():
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
        from pyiceberg.catalog import load_catalog  # an optional dependency, imported for iceberg: paths
        from pyiceberg.exceptions import NoSuchTableError

        name = path.removeprefix("iceberg:")
        if "" in name.split(".") or "." not in name:
            raise ValueError(f"data path {path!r}: expected iceberg:<namespace>.<table>")
        # pyiceberg takes a sqlite: or postgresql: uri for its SQL catalog, the embedded one with SQLite
        properties = {k: v for k, v in catalog.items() if k != "name"}
        self._store_options = _s3_options(properties)
        self._commits: dict[int, Commit] = {}  # by snapshot id: a snapshot never changes
        try:
            self.table = load_catalog(catalog.get("name", DEFAULT_CATALOG), **properties).load_table(name)
        except NoSuchTableError:
            raise ValueError(f"{self.shown}: no such table in the catalog of [data.catalog]") from None
        except (ValueError, OSError, ImportError) as e:
            raise ValueError(f"{self.shown}: cannot open its catalog ([data.catalog]): "
                             f"{redact_uri(_first_line(e))}") from None

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
        try:
            tasks = list(self.table.scan(snapshot_id=snapshot).plan_files())
        except ValueError as e:  # pyiceberg plans no equality deletes
            if "equality deletes" not in str(e):
                raise
            self._refuse_deletes(snapshot, "equality delete files")
        for task in tasks:
            if task.delete_files:
                self._refuse_deletes(snapshot, f"{len(task.delete_files)} delete file(s) on {task.file.file_path}")
            files.append(self._file(task.file))
        return _checked(self.shown, sorted(files, key=lambda f: f.uri))

    def commits(self) -> Iterator[Commit]:
        from pyiceberg.table.snapshots import ancestors_of  # loaded with pyiceberg

        current = self.table.current_snapshot()
        # The ancestry, oldest first: a format-1 table numbers every snapshot 0, so its order is
        # the ancestry's, kept in the key by the commit time (which a child never precedes).
        lineage = list(ancestors_of(current, self.table.metadata))[::-1]  # none without a current snapshot
        for snap in lineage:
            if snap.snapshot_id not in self._commits:
                self._commits[snap.snapshot_id] = self._commit(snap)
            yield self._commits[snap.snapshot_id]

    def _commit(self, snap) -> Commit:
        """What snapshot `snap` did: the data files its own manifests added, and the rows it removed
        by its summary (-1: some, by delete files, whose rows the summary does not count)."""
        from pyiceberg.manifest import DataFileContent, ManifestEntryStatus  # loaded with pyiceberg
        from pyiceberg.table.snapshots import Operation

        added = [self._file(entry.data_file)
                 for manifest in snap.manifests(self.table.io) if manifest.added_snapshot_id == snap.snapshot_id
                 for entry in manifest.fetch_manifest_entry(self.table.io)
                 if entry.status == ManifestEntryStatus.ADDED and entry.snapshot_id == snap.snapshot_id
                 and entry.data_file.content == DataFileContent.DATA]  # a delete file holds no rows to train
        operation = snap.summary.operation if snap.summary else Operation.APPEND  # a format-1 table's may lack one
        counts = snap.summary.additional_properties if snap.summary else {}
        removed = int(counts.get("deleted-records", 0))
        if int(counts.get("added-delete-files", 0)):
            removed = removed or -1
        return Commit(snap.snapshot_id, (snap.sequence_number, snap.timestamp_ms), operation.value,
                      tuple(_checked(self.shown, sorted(added, key=lambda f: f.uri))), removed,
                      operation == Operation.REPLACE)

    def _file(self, data_file) -> DataFile:
        return DataFile(_reader_uri(data_file.file_path, self._store_options), int(data_file.file_size_in_bytes),
                        int(data_file.record_count))


class DeltaLakeTable(Table):
    """A Delta table, local or on an object store (credentials and endpoint from the environment:
    AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ..., which deltalake and the reader both read)."""

    kind = "version"
    snapshot_option = "data.version"

    def __init__(self, path: str):
        super().__init__(path)
        from deltalake import DeltaTable  # an optional dependency, imported for delta: paths

        self.uri = path.partition(":")[2]
        if not self.uri:
            raise ValueError(f"data path {path!r}: expected delta:<path or URI>")
        if "://" not in self.uri:
            self.uri = posixpath.abspath(self.uri)
        self._open = DeltaTable
        self.table = self._load(None)
        self._history: list[Commit] = []  # the versions read so far, oldest first
        self._last: dict[str, DataFile] = {}  # the files of the newest version read

    def _load(self, version: int | None):
        from deltalake.exceptions import DeltaError, TableNotFoundError  # loaded with deltalake

        try:
            return self._open(self.uri, version=version)
        except TableNotFoundError:
            raise ValueError(f"{self.shown}: no Delta table there (no _delta_log)") from None
        except (DeltaError, OSError) as e:
            at = "" if version is None else f" at version {version} (data.version)"
            raise ValueError(f"{self.shown}: cannot load the table{at}: "
                             f"{redact_uri(_first_line(e)[:200])}") from None

    def refresh(self) -> None:
        self.table = self._load(None)

    def current(self) -> int:
        return self.table.version()

    def _operations(self, attempts: int = 20) -> dict[int, str]:
        """Each version's operation (WRITE, OPTIMIZE, ...) up to the loaded one, which may move to a
        newer one. deltalake numbers its history down from the version its table object was loaded
        at, but reads the newest commit files in the log: a commit that landed since the load would
        shift every label by one (an append read as the compaction before it). So the history is
        read again at the newest version until no commit lands between the read and a reload."""
        for _ in range(attempts):
            history = self.table.history()
            latest = self._load(None)
            if latest.version() == self.table.version():
                return {h["version"]: h.get("operation", "") for h in history}
            self.table = latest
        raise DataUnavailableError(f"{self.shown}: commits kept landing while its history was read "
                                   f"({attempts} reads); the next poll reads it again")

    def _files_at(self, table) -> dict[str, DataFile]:
        """uri -> file of a loaded version, from its add actions (path, bytes, rows, deletion vector)."""
        actions = pa.table(table.get_add_actions(flatten=True)).to_pydict()  # arro3 -> pyarrow, no copy
        uris = set(table.file_uris())
        root = table.table_uri.rstrip("/")
        vectors = [key for key in actions if key.startswith("deletionVector.")]
        files = {}
        for i, path in enumerate(actions["path"]):
            uri = path if "://" in path else f"{root}/{unquote(path)}"
            uri = uri.removeprefix("file://")
            if uri not in uris:
                raise ValueError(f"{self.shown}: version {table.version()} adds {path!r}, which is not among the "
                                 "table's files (an unexpected layout of the Delta log)")
            deletes = "|".join(str(actions[key][i]) for key in vectors if actions[key][i] is not None)
            rows = actions["num_records"][i]
            files[uri] = DataFile(_reader_uri(uri, {}), int(actions["size_bytes"][i]),
                                  int(rows) if rows is not None else -1, deletes)
        return files

    def files(self, snapshot: int) -> list[DataFile]:
        files = sorted(self._files_at(self._load(snapshot)).values(), key=lambda f: f.uri)
        marked = [f for f in files if f.deletes]
        if marked:
            self._refuse_deletes(snapshot, f"deletion vectors on {len(marked)} file(s)")
        return _checked(self.shown, files)

    def commits(self) -> Iterator[Commit]:
        """Versions read once each: those since the last call are loaded one by one. Where the log
        was cleaned up, the oldest version left stands for everything before it."""
        history = self._operations()
        start = self._history[-1].number + 1 if self._history else min(history, default=0)
        for version in range(start, self.current() + 1):
            files = self._files_at(self._load(version))
            before = self._last
            added = sorted((f for uri, f in files.items() if uri not in before), key=lambda f: f.uri)
            removed = [f for uri, f in before.items() if uri not in files]
            # a deletion vector added to a file that stays: rows deleted, their number unknown here
            deleted = any(f.deletes != before[uri].deletes for uri, f in files.items() if uri in before)
            operation = history.get(version, "")
            self._history.append(Commit(version, (version,), operation, tuple(_checked(self.shown, added)),
                                        -1 if deleted else sum(f.rows for f in removed), operation == "OPTIMIZE"))
            self._last = files
        yield from self._history


@contextlib.contextmanager
def metadata_errors(path: str) -> Iterator[None]:
    """Any failure to read a table's metadata (a catalog or store that failed) as DataUnavailableError
    (exit 4: a scheduler may rerun it, and it resumes); a ValueError (bad input) as it is."""
    try:
        yield
    except (ValueError, DataUnavailableError):
        raise
    except Exception as e:  # noqa: BLE001 - the two libraries' and their stores' errors are many
        raise DataUnavailableError(f"{redact_uri(path)}: the table's metadata could not be read: "
                                   f"{type(e).__name__}: {redact_uri(_first_line(e)[:200])}") from e


def open_table(path: str, catalog: dict[str, str]) -> Table:
    """The table `path` names (`table_format(path)` is not None)."""
    kind = table_format(path)
    assert kind is not None, path
    _needs(kind)
    if kind == "iceberg":
        return IcebergTable(path, catalog)
    return DeltaLakeTable(path)


_LIBRARIES = {"iceberg": "pyiceberg", "delta": "deltalake"}


def _needs(kind: str) -> None:
    """A table format's missing library as the one line that says what to install."""
    try:
        __import__(_LIBRARIES[kind])
    except ImportError:
        raise ValueError(f"{kind}: paths need {_LIBRARIES[kind]}, which is not installed: pip install "
                         "'rankmix[tables]' (make setup installs it)") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _s3_options(catalog: dict[str, str]) -> str:
    """The reader's S3 URI options (trainer/data/store.py) from pyiceberg's s3.endpoint / s3.region."""
    options = []
    if "s3.endpoint" in catalog:  # a URL, or host:port (https)
        parts = urlsplit(catalog["s3.endpoint"] if "://" in catalog["s3.endpoint"] else f"https://{catalog['s3.endpoint']}")
        options += [f"endpoint_override={parts.netloc}", f"scheme={parts.scheme}"]
    if "s3.region" in catalog:
        options.append(f"region={catalog['s3.region']}")
    return "&".join(options)


def _reader_uri(uri: str, s3_options: str) -> str:
    """A table's file URI as the reader opens it: a file:// URI as its local path (as written:
    pyiceberg quotes partition folders into literal %xx names), s3a:// and s3n:// (Hadoop's
    names, in tables Spark wrote) as s3://, with the catalog's endpoint options."""
    parts = urlsplit(uri)
    if parts.scheme == "file":
        return parts.path
    if parts.scheme in ("s3", "s3a", "s3n"):
        return f"s3://{parts.netloc}{parts.path}" + (f"?{s3_options}" if s3_options else "")
    return uri


def store_path(uri: str) -> str:
    """The path of a reader URI inside its store, as the reader records its files: s3://bucket/key?...
    as bucket/key, a local path as it is."""
    parts = urlsplit(uri)
    return f"{parts.netloc.rpartition('@')[2]}{parts.path}" if parts.scheme else uri


def _checked(shown: str, files: list[DataFile]) -> list[DataFile]:
    """`files`, refusing a URI the reader's comma-separated path list cannot carry."""
    for f in files:
        if "," in f.uri:
            raise ValueError(f"{shown}: data file {redact_uri(f.uri)} has a ',' in its path, which rankmix's "
                             "file lists cannot carry; rename it (rewrite the table's files)")
    return files
