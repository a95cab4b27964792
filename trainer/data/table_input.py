"""A run's tables turned into its readers' file lists (trainer/data/lakehouse.py; docs/data.md, "Tables").

Pinning. A shuffled run reads one snapshot of its training table: `data.snapshot` (Iceberg) or
`data.version` (Delta) where given, else the one the run folder's config.toml recorded when the
run first started, else the table's newest. The pin is written back into the config (so into
config.toml) and into every checkpoint (trainer/checkpoint/state.py's TrainedPosition), so a
resume reads the bytes it started on, whatever was appended or compacted since, and one that
would read another snapshot is refused naming both.

Agreement. Rank 0 opens the table and broadcasts the snapshot and its files, so every rank
reads the same snapshot however the table moves while the job starts.

The held-out splits (data.eval_path, data.valid_path) are read at their newest snapshot when
the run starts: like loose files, they are not part of a checkpoint's input record.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from trainer.config import PIN_FIELDS, DataConfig, table_format
from trainer.data.lakehouse import metadata_errors, open_table
from trainer.dist import on_rank0
from trainer.run_layout import RunFolder

log = logging.getLogger("rankmix.data")


@dataclass(frozen=True)
class TablePin:
    """The snapshot a run reads of its training table: part of its checkpoints' input record."""

    path: str  # data.train_path: "iceberg:ns.table" or "delta:/path"
    snapshot: int  # Iceberg's snapshot id, Delta's version

    def state_dict(self) -> dict:
        return {"path": self.path, "snapshot": self.snapshot}


def pinned_train_files(data: DataConfig, run_dir: str) -> tuple[str, TablePin | None]:
    """The files data.train_path reads (comma-separated) and its pin; a path that is no table
    as it is, without a pin. Sets data.snapshot / data.version to the pin (collective)."""
    kind = table_format(data.train_path)
    if kind is None:
        return data.train_path, None
    option = PIN_FIELDS[kind]
    given = getattr(data, option)
    if given == _unset(option):
        given = _recorded(run_dir, data.train_path, option)
    snapshot, files = on_rank0(lambda: _snapshot_files(data.train_path, data.catalog, given))
    if given is None:
        log.info("%s: reading %s %d, its newest", data.train_path, option, snapshot)
    setattr(data, option, snapshot)
    return files, TablePin(data.train_path, snapshot)


def newest_files(path: str, catalog: dict[str, str]) -> str:
    """The files of a held-out table's newest snapshot (comma-separated); other paths as they are
    (collective)."""
    if not path or table_format(path) is None:
        return path
    return on_rank0(lambda: _snapshot_files(path, catalog, None))[1]


def _snapshot_files(path: str, catalog: dict[str, str], snapshot: int | None) -> tuple[int, str]:
    """(`snapshot`, or the newest where None; its files, comma-separated) of the table `path`."""
    with metadata_errors(path):
        table = open_table(path, catalog)
        snapshot = table.current() if snapshot is None else snapshot
        return snapshot, ",".join(f.uri for f in table.files(snapshot))


def _unset(option: str) -> int:
    """The pin field's default: no pin given."""
    return getattr(DataConfig(), option)


def _recorded(run_dir: str, path: str, option: str) -> int | None:
    """The pin of `path` in the run folder's config.toml (a run started there before), or None."""
    folder = RunFolder(Path(run_dir))
    data = folder.recorded("data", "the table pin")
    value = data.get(option)
    if data.get("train_path") != path or not isinstance(value, int) or value == _unset(option):
        return None
    log.info("%s: reading %s %d, pinned by %s", path, option, value, folder.config)
    return value
