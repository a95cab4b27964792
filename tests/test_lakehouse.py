"""trainer/data/lakehouse.py in-process: a table's snapshots, files, commits and refusals, on real
Iceberg (SQLite catalog) and Delta tables made here (the runs that train from them: test_tables.py)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.test_tables import Delta, Iceberg, log  # noqa: F401 - log is the module's fixture
from trainer.data.lakehouse import Commit, DataFile, open_table
from trainer.errors import DataUnavailableError


def test_a_missing_table_or_snapshot_is_named(log, tmp_path):
    with pytest.raises(ValueError) as e:
        open_table(f"delta:{tmp_path}/none", {})
    assert str(e.value) == f"delta:{tmp_path}/none: no Delta table there (no _delta_log)"
    lake = Iceberg(tmp_path / "lake")
    with pytest.raises(ValueError) as e:
        open_table(lake.path, dict(lake.properties))
    assert str(e.value) == "iceberg:logs.clicks: no such table in the catalog of [data.catalog]"
    lake.append(log["parts"][0])
    table = open_table(lake.path, dict(lake.properties))
    [snapshot] = lake.snapshots()
    assert [f.rows for f in table.files(snapshot)] == [3_000]
    with pytest.raises(ValueError) as e:
        table.files(snapshot + 1)
    assert str(e.value) == (f"iceberg:logs.clicks: no snapshot {snapshot + 1} (data.snapshot); the table's "
                            f"snapshots are {snapshot} (newest last), unless expired")
    with pytest.raises(ValueError) as e:
        open_table("iceberg:clicks", {})
    assert str(e.value) == "data path 'iceberg:clicks': expected iceberg:<namespace>.<table>"


def test_a_tables_file_uris_become_the_readers():
    from trainer.data.lakehouse import _reader_uri, _s3_options, store_path

    assert _reader_uri("file:///lake/ts=2026-01-01%3A00/f.parquet", "") == "/lake/ts=2026-01-01%3A00/f.parquet"
    options = _s3_options({"s3.endpoint": "http://minio:9000", "s3.region": "eu-west-1", "uri": "x"})
    assert options == "endpoint_override=minio:9000&scheme=http&region=eu-west-1"
    assert _reader_uri("s3a://bucket/t/f.parquet", options) == f"s3://bucket/t/f.parquet?{options}"
    assert _reader_uri("s3://bucket/t/f.parquet", "") == "s3://bucket/t/f.parquet"
    assert _reader_uri("gs://bucket/f.parquet", options) == "gs://bucket/f.parquet"
    assert store_path(f"s3://bucket/t/f.parquet?{options}") == "bucket/t/f.parquet"
    assert store_path("/lake/f.parquet") == "/lake/f.parquet"


def test_an_iceberg_snapshot_with_a_position_delete_is_refused_pinned_and_in_time_order(log, tmp_path):
    """A position delete file (what Spark's merge-on-read DELETE writes; pyiceberg writes none, so it
    is committed here as its own file) is refused with the snapshot named, never read past."""
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat
    from pyiceberg.typedef import Record

    lake = Iceberg(tmp_path / "lake")
    lake.append(log["parts"][0])
    target = next(iter(lake.table.scan().plan_files())).file.file_path
    deletes = tmp_path / "deletes.parquet"
    pq.write_table(pa.table({"file_path": [target], "pos": pa.array([1], pa.int64())}), deletes)
    with lake.table.transaction() as tx, tx.update_snapshot().fast_append() as append:
        append.append_data_file(DataFile.from_args(
            content=DataFileContent.POSITION_DELETES, file_path=f"file://{deletes}", file_format=FileFormat.PARQUET,
            partition=Record(), record_count=1, file_size_in_bytes=os.path.getsize(deletes)))
    first, deleted = lake.snapshots()
    table = open_table(lake.path, dict(lake.properties))
    assert len(table.files(first)) == 1
    with pytest.raises(ValueError) as e:
        table.files(deleted)
    assert str(e.value) == (
        f"iceberg:logs.clicks: snapshot {deleted} has 1 delete file(s) on {target}; rankmix does not apply them, "
        "and will not read deleted rows as if they were there: compact the table, or pin a snapshot before the "
        "deletes (data.snapshot)")
    assert [c.removed_rows for c in table.commits()] == [0, -1]  # -1: the summary does not count them
    with pytest.raises(ValueError) as e:
        table.appends()
    assert str(e.value) == (
        f"iceberg:logs.clicks: snapshot {deleted} (append) removes some rows and adds 0; data.order=time follows "
        "appends and compactions only: a trained row cannot be taken back")


def test_a_delta_tables_history_is_its_appends_its_compactions_and_what_removed_rows(tmp_path):
    from deltalake import DeltaTable, write_deltalake

    path = tmp_path / "clicks"
    write_deltalake(path, pa.table({"x": [1, 2, 3]}))
    write_deltalake(path, pa.table({"x": [4, 5]}), mode="append")
    DeltaTable(path).optimize.compact()
    write_deltalake(path, pa.table({"x": [6]}), mode="append")
    table = open_table(f"delta:{path}", {})
    commits = list(table.commits())
    assert [(c.number, c.order, c.operation, [f.rows for f in c.added], c.removed_rows, c.compaction)
            for c in commits] == [(0, (0,), "WRITE", [3], 0, False), (1, (1,), "WRITE", [2], 0, False),
                                  (2, (2,), "OPTIMIZE", [5], 5, True), (3, (3,), "WRITE", [1], 0, False)]
    assert [c.number for c in table.appends()] == [0, 1, 3]
    assert [f.uri for f in table.files(3)] == sorted(DeltaTable(path).file_uris())
    assert sum(f.rows for f in table.files(3)) == 6 and all(f.size > 0 and not f.deletes for f in table.files(3))
    assert [f.rows for f in table.files(1)] == [2, 3] or [f.rows for f in table.files(1)] == [3, 2]

    DeltaTable(path).delete("x > 4")
    table.refresh()
    with pytest.raises(ValueError) as e:
        table.appends()
    assert str(e.value) == (f"delta:{path}: version 4 (DELETE) removes 6 rows and adds 4; data.order=time follows "
                            "appends and compactions only: a trained row cannot be taken back")
    assert table.current() == 4 and len(list(table.commits())) == 5  # the versions read before are not read again
    with pytest.raises(ValueError, match=f"^delta:{path}: cannot load the table at version 9 \\(data.version\\): "):
        table.files(9)


def test_a_commit_landing_after_the_tables_load_does_not_shift_its_historys_versions(tmp_path):
    """A follower loads the table, then a writer commits before the history is read: deltalake
    numbers its history down from the loaded version while reading the newest commit files, so
    without a reload the append after a compaction read as that compaction's version (and the
    run stopped on a compaction it took for a rewrite: tests/test_tables.py's follower, once in a while)."""
    from deltalake import DeltaTable, write_deltalake

    path = tmp_path / "clicks"
    write_deltalake(path, pa.table({"x": [1, 2, 3]}))
    table = open_table(f"delta:{path}", {})
    assert [c.number for c in table.appends()] == [0]
    write_deltalake(path, pa.table({"x": [4, 5]}), mode="append")
    DeltaTable(path).optimize.compact()
    table.refresh()  # loaded at the compaction, version 2
    write_deltalake(path, pa.table({"x": [6]}), mode="append")  # version 3 lands before the history is read
    assert [(c.number, c.operation) for c in table.commits()] == [(0, "WRITE"), (1, "WRITE"), (2, "OPTIMIZE"),
                                                                  (3, "WRITE")]
    assert [c.number for c in table.appends()] == [0, 1, 3] and table.current() == 3
    write_deltalake(path, pa.table({"x": [7]}), mode="append")  # lands again before the one read allowed
    with pytest.raises(DataUnavailableError) as e:
        table._operations(attempts=1)
    assert str(e.value) == (f"delta:{path}: commits kept landing while its history was read (1 reads); the next "
                            "poll reads it again")
    assert table.current() == 4 and table._operations(attempts=1)[4] == "WRITE"  # the newer version, read next


# ----------------------------------------------------------------------------- Iceberg, in detail


def _added(lake: Iceberg, tmp_path, *names: str) -> list[str]:
    """Files of the log's first rows named `names`, added to the table as they are (one snapshot)."""
    paths = []
    for name in names:
        paths.append(str(tmp_path / name))
        pq.write_table(pq.read_table(lake.first).slice(0, 100), paths[-1])
    lake.table.add_files(paths)
    return paths


@pytest.fixture
def lake(log, tmp_path) -> Iceberg:
    lake = Iceberg(tmp_path / "lake")
    lake.append(log["parts"][0])
    lake.first = next(iter(lake.table.scan().plan_files())).file.file_path.removeprefix("file://")
    return lake


def test_an_iceberg_tables_history_is_its_appends_its_compaction_and_what_removed_rows(lake, log, tmp_path):
    lake.append(log["parts"][1])
    lake.compact()
    lake.table = lake.catalog.load_table("logs.clicks")
    lake.append(log["parts"][2])
    table = open_table(lake.path, dict(lake.properties))
    snapshots = lake.catalog.load_table("logs.clicks").snapshots()
    assert [(c.number, c.order, c.operation, [f.rows for f in c.added], c.removed_rows, c.compaction)
            for c in table.commits()] == [
        (snapshots[0].snapshot_id, (1, snapshots[0].timestamp_ms), "append", [3_000], 0, False),
        (snapshots[1].snapshot_id, (2, snapshots[1].timestamp_ms), "append", [3_000], 0, False),
        (snapshots[2].snapshot_id, (3, snapshots[2].timestamp_ms), "replace", [6_000], 6_000, True),
        (snapshots[3].snapshot_id, (4, snapshots[3].timestamp_ms), "append", [3_000], 0, False)]
    assert [c.number for c in table.appends()] == [s.snapshot_id for i, s in enumerate(snapshots) if i != 2]
    lake.delete()
    table.refresh()
    deleted = lake.catalog.load_table("logs.clicks").current_snapshot()
    with pytest.raises(ValueError) as e:
        table.appends()
    counts = deleted.summary.additional_properties  # what the writer says it did
    assert str(e.value) == (
        f"iceberg:logs.clicks: snapshot {deleted.snapshot_id} ({deleted.summary.operation.value}) removes "
        f"{counts['deleted-records']} rows and adds {counts.get('added-records', 0)}; data.order=time follows "
        "appends and compactions only: a trained row cannot be taken back")


def test_a_snapshots_files_are_sorted_by_path_and_a_comma_in_one_is_refused(lake, tmp_path):
    b, a = _added(lake, tmp_path, "b.parquet", "a.parquet")  # one snapshot, planned in this order
    table = open_table(lake.path, dict(lake.properties))
    newest = table.current()
    assert [f.uri for f in table.files(newest)] == sorted([lake.first, a, b])
    assert [f.uri for f in table.appends()[-1].added] == [a, b]
    [comma] = _added(lake, tmp_path, "x,y.parquet")
    table.refresh()
    message = (f"iceberg:logs.clicks: data file {comma} has a ',' in its path, which rankmix's file lists cannot "
               "carry; rename it (rewrite the table's files)")
    for call in (lambda: table.files(table.current()), table.appends):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == message


def test_a_missing_snapshot_names_the_newest_five(lake, log):
    for part in log["parts"][1:4]:
        lake.append(part)
    for part in log["parts"][1:3]:
        lake.append(part)
    ids = lake.snapshots()
    assert len(ids) == 6
    with pytest.raises(ValueError) as e:
        open_table(lake.path, dict(lake.properties)).files(7)
    assert str(e.value) == (f"iceberg:logs.clicks: no snapshot 7 (data.snapshot); the table's snapshots are "
                            f"{', '.join(map(str, ids[1:]))} (newest last), unless expired")


def test_an_empty_table_has_no_snapshot_and_no_appends(tmp_path):
    lake = Iceberg(tmp_path / "lake")
    lake.catalog.create_table("logs.clicks", schema=pa.schema([("x", pa.int64())]))
    table = open_table(lake.path, dict(lake.properties))
    assert table.appends() == []
    with pytest.raises(ValueError) as e:
        table.current()
    assert str(e.value) == "iceberg:logs.clicks: the table has no snapshot yet (no rows were ever written)"


def test_the_catalog_is_found_by_its_name_and_a_bad_one_is_named(tmp_path):
    from pyiceberg.catalog import load_catalog

    properties = {"uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": f"file://{tmp_path}"}
    writer = load_catalog("default", **properties)  # pyiceberg's name without data.catalog.name
    writer.create_namespace("logs")
    writer.create_table("logs.clicks", schema=pa.schema([("x", pa.int64())]))
    assert open_table("iceberg:logs.clicks", properties).current  # found under "default"
    with pytest.raises(ValueError) as e:
        open_table("iceberg:logs.clicks", {**properties, "name": "other"})
    assert str(e.value) == "iceberg:logs.clicks: no such table in the catalog of [data.catalog]"
    with pytest.raises(ValueError) as e:
        open_table("iceberg:logs.clicks", {"warehouse": f"file://{tmp_path}"})
    assert str(e.value).startswith("iceberg:logs.clicks: cannot open its catalog ([data.catalog]): ")
    assert "\n" not in str(e.value) and len(str(e.value)) > 70
    for bad in ("iceberg:logs.", "iceberg:.clicks", "iceberg:clicks"):
        with pytest.raises(ValueError) as e:
            open_table(bad, properties)
        assert str(e.value) == f"data path {bad!r}: expected iceberg:<namespace>.<table>"


@pytest.mark.parametrize(("kind", "library"), [("iceberg", "pyiceberg"), ("delta", "deltalake")])
def test_a_missing_library_is_named_with_what_to_install(kind, library, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, library, None)  # import raises ImportError
    with pytest.raises(ValueError) as e:
        open_table(f"{kind}:a.b", {})
    assert str(e.value) == (f"{kind}: paths need {library}, which is not installed: pip install 'rankmix[tables]' "
                            "(make setup installs it)")


def test_the_catalogs_s3_endpoint_reaches_the_readers_uris(lake):
    from types import SimpleNamespace

    from trainer.data.lakehouse import _s3_options

    assert _s3_options({"s3.endpoint": "minio:9000"}) == "endpoint_override=minio:9000&scheme=https"
    assert _s3_options({"s3.region": "eu-west-1"}) == "region=eu-west-1"
    table = open_table(lake.path, {**lake.properties, "s3.endpoint": "http://m:9000", "s3.region": "r"})
    file = SimpleNamespace(file_path="s3a://bucket/t/f.parquet", file_size_in_bytes=3, record_count=2)
    assert table._file(file) == DataFile("s3://bucket/t/f.parquet?endpoint_override=m:9000&scheme=http&region=r",
                                         3, 2)


def test_an_equality_delete_is_refused_by_name(lake, tmp_path):
    from pyiceberg.manifest import DataFile as IcebergFile
    from pyiceberg.manifest import DataFileContent, FileFormat
    from pyiceberg.typedef import Record

    deletes = tmp_path / "equality.parquet"
    pq.write_table(pa.table({"user_id": pa.array([1], pa.int64())}), deletes)
    field = lake.table.schema().find_field("user_id").field_id
    with lake.table.transaction() as tx, tx.update_snapshot().fast_append() as append:
        append.append_data_file(IcebergFile.from_args(
            content=DataFileContent.EQUALITY_DELETES, file_path=f"file://{deletes}", file_format=FileFormat.PARQUET,
            partition=Record(), record_count=1, file_size_in_bytes=os.path.getsize(deletes), equality_ids=[field]))
    newest = lake.snapshots()[-1]
    with pytest.raises(ValueError) as e:
        open_table(lake.path, dict(lake.properties)).files(newest)
    assert str(e.value) == (
        f"iceberg:logs.clicks: snapshot {newest} has equality delete files; rankmix does not apply them, and will "
        "not read deleted rows as if they were there: compact the table, or pin a snapshot before the deletes "
        "(data.snapshot)")


def test_a_snapshot_without_a_summary_reads_as_an_append(lake):
    """Format 1 makes a snapshot's summary optional; pyiceberg always writes one, so a bare snapshot stands in."""
    from types import SimpleNamespace

    table = open_table(lake.path, dict(lake.properties))
    bare = SimpleNamespace(summary=None, snapshot_id=5, sequence_number=0, timestamp_ms=7, manifests=lambda io: [])
    assert table._commit(bare) == Commit(5, (0, 7), "append", (), 0, False)
