"""Training from lakehouse tables (trainer/data/lakehouse.py, table_input.py; docs/data.md, "Tables"):
a real Iceberg table in a SQLite SQL catalog and a real Delta table, made here from the
synthetic log's files, appended to and compacted between a checkpoint and its resume; a
continuous run following a table's snapshots; MLflow's file store read back."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.cli import rankmix_ranks, run_env
from tests.test_checkpoint import assert_same_state, losses
from tests.test_continuous import records
from trainer.config_loader import dump_toml, load_config
from trainer.data.datasets import synth_features
from trainer.offline.synth import write_synthetic

REPO = Path(__file__).resolve().parents[1]
STEPS = 12  # 6 before the stop, 6 after


def ok(result):
    assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture(scope="module")
def log(tmp_path_factory) -> dict:
    """Four Parquet files of the synthetic log (3,000 rows each), its held-out files, and a config
    on user files with the synthetic schema."""
    root = tmp_path_factory.mktemp("log")
    write_synthetic(root, rows=13_334, files=4, row_group_size=1_000)
    config = root / "config.toml"
    cfg = load_config(str(REPO / "configs" / "debug.toml"), ["--data.dataset=parquet"])
    cfg.features = synth_features()
    dump_toml(cfg, config)
    parts = sorted((root / "train").glob("*.parquet"))
    return {"parts": [pq.read_table(p) for p in parts], "valid": root / "valid", "config": config}


# ----------------------------------------------------------------------------- the two formats


class Iceberg:
    """An Iceberg table in a SQLite catalog, written with pyiceberg."""

    def __init__(self, folder: Path):
        from pyiceberg.catalog import load_catalog

        folder.mkdir(parents=True, exist_ok=True)
        self.properties = {"uri": f"sqlite:///{folder}/catalog.db", "warehouse": f"file://{folder}"}
        self.catalog = load_catalog("lake", type="sql", **self.properties)
        self.properties["name"] = "lake"  # a SQL catalog keeps its tables under its name
        self.catalog.create_namespace("logs")
        self.table = None
        self.path = "iceberg:logs.clicks"

    def args(self) -> list[str]:
        return [f"--data.catalog.{k}={v}" for k, v in self.properties.items()]

    def append(self, rows: pa.Table) -> None:
        if self.table is None:
            self.table = self.catalog.create_table("logs.clicks", schema=rows.schema)
        self.table.append(rows)

    def compact(self) -> None:
        """A REPLACE snapshot, as Spark's rewrite_data_files writes: every data file rewritten into one.
        pyiceberg 0.12 writes no REPLACE itself: its summary of an OVERWRITE is relabelled."""
        from pyiceberg.io.pyarrow import parquet_file_to_data_file
        from pyiceberg.table.snapshots import Operation, Summary
        from pyiceberg.table.update import snapshot
        from pyiceberg.table.update.snapshot import _OverwriteFiles

        def summaries(summary, previous_summary=None):
            out = write_summaries(Summary(Operation.OVERWRITE, **summary.additional_properties), previous_summary)
            return Summary(summary.operation, **out.additional_properties)

        write_summaries = snapshot.update_snapshot_summaries

        self.table = self.catalog.load_table("logs.clicks")
        old = [task.file for task in self.table.scan().plan_files()]
        rows = pa.concat_tables(pq.read_table(f.file_path.removeprefix("file://")) for f in old)
        path = f"{self.table.location()}/data/compacted.parquet".removeprefix("file://")
        pq.write_table(rows, path)
        with mock.patch.object(snapshot, "update_snapshot_summaries", summaries), self.table.transaction() as tx:
            rewrite = _OverwriteFiles(operation=Operation.REPLACE, transaction=tx, io=self.table.io)
            for f in old:
                rewrite.delete_data_file(f)
            rewrite.append_data_file(parquet_file_to_data_file(self.table.io, tx.table_metadata, "file://" + path))
            rewrite.commit()

    def snapshots(self) -> list[int]:
        return [s.snapshot_id for s in self.catalog.load_table("logs.clicks").snapshots()]

    def delete(self) -> None:
        self.catalog.load_table("logs.clicks").delete("hour < 3")


class Delta:
    """A Delta table, written with deltalake."""

    def __init__(self, folder: Path):
        self.folder = folder / "clicks"
        self.path = f"delta:{self.folder}"

    def args(self) -> list[str]:
        return []

    def append(self, rows: pa.Table) -> None:
        from deltalake import write_deltalake

        write_deltalake(str(self.folder), rows, mode="append")

    def compact(self) -> None:
        from deltalake import DeltaTable

        DeltaTable(str(self.folder)).optimize.compact()

    def snapshots(self) -> list[int]:
        from deltalake import DeltaTable

        return list(range(DeltaTable(str(self.folder)).version() + 1))

    def delete(self) -> None:
        from deltalake import DeltaTable

        DeltaTable(str(self.folder)).delete("hour < 3")


FORMATS = {"iceberg": Iceberg, "delta": Delta}


def train_args(log: dict, table, run: Path, steps: int, *extra: str) -> list[str]:
    return ["--config", str(log["config"]), f"--data.train_path={table.path}", f"--data.eval_path={log['valid']}",
            f"--train.run_dir={run}", f"--train.steps={steps}", "--data.shuffle_buffer=512",
            "--metrics.log_every=1", "--metrics.progress=false", "--metrics.tensorboard=false",
            *table.args(), *extra]


def recorded(run: Path) -> dict:
    import tomllib

    return tomllib.loads((run / "config.toml").read_text())["data"]


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_resume_reads_the_pinned_snapshot_after_appends_and_a_compaction(kind, log, tmp_path):
    """A run pins the snapshot it starts on (config.toml and checkpoint); after two appends and a
    compaction its resume trains on bitwise as a run never stopped. Another snapshot is refused."""
    table = FORMATS[kind](tmp_path / "table")
    for part in log["parts"][:2]:
        table.append(part)
    pinned = table.snapshots()[-1]
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    ok(rankmix_ranks(1, *train_args(log, table, whole, STEPS, "--checkpoint.interval=6")))
    ok(rankmix_ranks(1, *train_args(log, table, halves, STEPS // 2)))
    option = "snapshot" if kind == "iceberg" else "version"
    assert recorded(halves)[option] == pinned

    for part in log["parts"][2:]:
        table.append(part)
    table.compact()
    assert table.snapshots()[-1] != pinned
    resumed = ok(rankmix_ranks(1, *train_args(log, table, halves, STEPS)))
    assert f"at step {STEPS // 2}" in resumed.stdout
    assert_same_state(whole / "checkpoints" / f"step-{STEPS}", halves / "checkpoints" / f"step-{STEPS}", tmp_path)
    assert losses(halves) == losses(whole) and len(losses(whole)) == STEPS
    assert recorded(halves)[option] == pinned

    explicit = tmp_path / "explicit"  # a new run folder told the old snapshot trains on it, as `whole` did
    ok(rankmix_ranks(1, *train_args(log, table, explicit, STEPS, f"--data.{option}={pinned}")))
    assert losses(explicit) == losses(whole)

    newest = table.snapshots()[-1]
    refused = rankmix_ranks(1, *train_args(log, table, halves, STEPS + 2, f"--data.{option}={newest}"))
    assert refused.returncode == 2
    assert (f"data reader state was saved reading {option} {pinned} of {table.path}, but this run reads {newest} "
            f"(data.{option}): a resume reads the snapshot it started on; set data.{option}={pinned}, or leave it "
            "unset in the run folder that pinned it") in refused.stderr


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_time_order_trains_each_appended_snapshot_once_in_order_and_skips_a_compaction(kind, log, tmp_path):
    """Three appends and a compaction: three partitions, trained in commit order; a later append
    is the only new work of the next run; a snapshot that deletes rows is refused."""
    table = FORMATS[kind](tmp_path / "table")
    for part in log["parts"][:2]:
        table.append(part)
    table.compact()
    table.append(log["parts"][2])
    run = tmp_path / "run"
    args = ["--data.order=time", "--train.steps=0"]
    ok(rankmix_ranks(1, *train_args(log, table, run, 0, *args)))
    snapshots = table.snapshots()
    appended = [snapshots[0], snapshots[1], snapshots[3]]
    name = "snapshot" if kind == "iceberg" else "version"
    trained = [r["partition"] for r in records(run, "data")]
    assert trained == [f"{name}={s}" for s in appended]
    steps = {r["partition"]: r["rows_trained"] for r in records(run, "data")}
    assert all(rows == 3_000 - 3_000 % 256 for rows in steps.values())

    table.append(log["parts"][3])
    again = ok(rankmix_ranks(1, *train_args(log, table, run, 0, *args)))
    assert [r["partition"] for r in records(run, "data")] == trained + [f"{name}={table.snapshots()[-1]}"]
    assert "resumed from" in again.stdout

    table.delete()
    refused = rankmix_ranks(1, *train_args(log, table, run, 0, *args))
    assert refused.returncode == 2
    assert f"{table.path}: {name} {table.snapshots()[-1]} (" in refused.stderr
    assert ("data.order=time follows appends and compactions only: a trained row cannot be taken back"
            in refused.stderr)


def test_a_following_run_trains_each_new_snapshot_as_it_lands(log, tmp_path):
    """data.follow: the run trains the table's two appends, waits, trains a third and a fourth as
    they are committed (a compaction between them adds nothing), and stops on SIGTERM."""
    import os
    import signal
    import time

    from tests.cli import read_output, start_rankmix

    table = Delta(tmp_path / "table")
    table.append(log["parts"][0])
    table.append(log["parts"][1])
    run = tmp_path / "run"
    args = train_args(log, table, run, 0, "--data.order=time", "--data.follow=true", "--data.poll_seconds=0.2")
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    child = start_rankmix(["train", *args], REPO, run_env(), out, err)

    def trained(n: int) -> list[str]:
        deadline = time.monotonic() + 120
        while len(names := [r["partition"] for r in records(run, "data")] if (run / "metrics.jsonl").exists()
                   else []) < n:
            assert child.is_alive() and time.monotonic() < deadline, read_output(err)[-3000:]
            time.sleep(0.1)
        return names

    try:
        assert trained(2) == ["version=0", "version=1"]
        table.append(log["parts"][2])
        table.compact()
        table.append(log["parts"][3])
        assert trained(4) == ["version=0", "version=1", "version=2", "version=4"]
        os.kill(child.pid, signal.SIGTERM)
        child.join(60)
        assert child.exitcode == 143, read_output(err)[-3000:]
    finally:
        child.kill()


def test_two_ranks_agree_on_the_pinned_snapshot_and_split_its_rows(log, tmp_path):
    """Rank 0 opens the table and broadcasts its snapshot and files: both ranks read them, the
    epoch's rows split between them (a broken agreement fails the ranks' input check)."""
    table = Delta(tmp_path / "table")
    table.append(log["parts"][0])
    table.append(log["parts"][1])
    run = tmp_path / "run"
    ok(rankmix_ranks(2, *train_args(log, table, run, 0, "--train.epochs=1")))
    assert recorded(run)["version"] == 1
    [rows] = [r for r in records(run, "data")]
    assert rows["rows"] == 6_000 and rows["rows_trained"] == 2 * 11 * 256


def test_a_delta_table_on_an_object_store_is_followed_and_pinned_through_one_environment(log, tmp_path):
    """deltalake and the reader take the store from the same AWS_* variables (moto's S3 on
    loopback): a time-order run trains the two appends; a rerun after a third trains it alone."""
    from deltalake import write_deltalake

    from tests.object_store import Server, filesystem

    server = Server()
    try:
        filesystem(server.port).create_dir("lake")
        store = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.port}", "AWS_ACCESS_KEY_ID": "x",
                 "AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}

        def append(rows):
            write_deltalake("s3://lake/clicks", rows, mode="append",
                            storage_options={**store, "AWS_S3_ALLOW_UNSAFE_RENAME": "true"})

        append(log["parts"][0])
        append(log["parts"][1])
        table, run, env = Delta(tmp_path), tmp_path / "run", run_env(**store)
        table.path = "delta:s3://lake/clicks"
        args = train_args(log, table, run, 0, "--data.order=time")
        ok(rankmix_ranks(1, *args, env=env))
        assert [r["partition"] for r in records(run, "data")] == ["version=0", "version=1"]
        append(log["parts"][2])
        ok(rankmix_ranks(1, *args, env=env))
        assert [r["partition"] for r in records(run, "data")] == ["version=0", "version=1", "version=2"]
        pinned = ok(rankmix_ranks(1, *train_args(log, table, tmp_path / "pinned", 4), env=env))
        assert len(losses(tmp_path / "pinned")) == 4, pinned.stdout
        assert recorded(tmp_path / "pinned")["version"] == 2
    finally:
        server.stop()


# ----------------------------------------------------------------------------- MLflow


def test_mlflow_file_store_holds_the_params_metrics_summary_and_artifacts(log, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    store, run = tmp_path / "mlruns", tmp_path / "run"
    table = Delta(tmp_path / "table")
    table.append(log["parts"][0])
    ok(rankmix_ranks(1, *train_args(log, table, run, 6, f"--metrics.mlflow_uri=file:{store}",
                                             "--publish.every_steps=6")))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for this reader; the run set it for itself
    client = MlflowClient(tracking_uri=f"file:{store}")
    [found] = client.search_runs([client.get_experiment_by_name("rankmix").experiment_id])
    assert found.data.params["data.batch_size"] == "256"
    assert found.data.params["data.version"] == "0"
    assert found.data.params["features.item_id.table"] == "item"
    assert found.data.tags["rankmix.run_dir"] == str(run)
    history = [m.step for m in client.get_metric_history(found.info.run_id, "train/loss")]
    assert history == list(range(1, 7))
    assert found.data.metrics["train/loss"] == losses(run)[6]
    summary = json.loads((run / "summary.json").read_text())
    assert found.data.metrics["summary/auc"] == summary["auc"]
    assert found.data.tags["rankmix.artifact.step-6"] == str(run / "publish" / "step-6")
    assert found.info.status == "FINISHED"


def test_an_mlflow_server_down_is_said_once_and_training_goes_on(log, tmp_path):
    table = Delta(tmp_path / "table")
    table.append(log["parts"][0])
    result = ok(rankmix_ranks(1, *train_args(log, table, tmp_path / "run", 3,
                                                      "--metrics.mlflow_uri=http://127.0.0.1:9")))
    said = [line for line in result.stdout.splitlines() if line.startswith("mlflow:")]
    assert len(said) == 1 and said[0].startswith("mlflow: cannot start the run at http://127.0.0.1:9 (")
    assert said[0].endswith("); training goes on without MLflow")
    assert len(losses(tmp_path / "run")) == 3


# ----------------------------------------------------------------------------- errors, fast


def load(*overrides: str):
    return load_config(str(REPO / "configs" / "debug.toml"), ["--data.dataset=parquet", *overrides])


def test_a_secret_in_the_catalog_is_refused_before_it_is_written():
    with pytest.raises(ValueError) as e:
        load("--data.train_path=iceberg:logs.clicks", "--data.catalog.name=lake",
             "--data.catalog.s3.secret-access-key=abc")
    assert str(e.value) == (
        "data.catalog.s3.secret-access-key holds a secret, and the config is written into the run folder; give it "
        "as the environment variable PYICEBERG_CATALOG__LAKE__S3__SECRET_ACCESS_KEY (pyiceberg reads it there), "
        "or through the object store's own chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")
    for key in ("token", "credential", "adls.account-key", "s3.session-token"):
        with pytest.raises(ValueError, match=f"^data.catalog.{key} holds a secret"):
            load("--data.train_path=iceberg:logs.clicks", f"--data.catalog.{key}=x")
    cfg = load("--data.train_path=iceberg:logs.clicks", "--data.catalog.s3.access-key-id=AKIA",
               "--data.catalog.uri=sqlite:////tmp/c.db")
    assert cfg.data.catalog == {"s3.access-key-id": "AKIA", "uri": "sqlite:////tmp/c.db"}


@pytest.mark.parametrize(("overrides", "message"), [
    (["--data.train_path=/logs", "--data.snapshot=7"],
     "data.snapshot=7 pins an Iceberg snapshot, but data.train_path '/logs' is no iceberg: table"),
    (["--data.train_path=iceberg:a.b", "--data.version=3"],
     "data.version=3 pins a Delta version, but data.train_path 'iceberg:a.b' is no delta: table"),
    (["--data.train_path=delta:/t", "--data.version=-2"],
     "data.version must be a Delta version (>= 0) or -1 for the newest, got -2"),
    (["--data.train_path=delta:/t", "--data.order=time", "--data.version=3"],
     "data.version is set, but data.order='time' does not read it; remove it"),
])
def test_a_pin_that_does_not_fit_its_path_is_refused(overrides, message):
    with pytest.raises(ValueError) as e:
        load(*overrides)
    assert str(e.value) == message


def test_an_mlflow_run_stopped_before_its_summary_is_killed_and_a_resume_goes_on_in_it(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from trainer.metrics.mlflow_run import MlflowRun

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    said = []
    first = MlflowRun(f"file:{tmp_path}/mlruns", "exp", "/runs/a", {"data.batch_size": "8"}, said.append)
    first.log(1, "train", {"loss": 0.5, "partition": "date=1", "nan": float("nan"), "flag": True})
    first.close()
    client = MlflowClient(tracking_uri=f"file:{tmp_path}/mlruns")
    run = client.get_run(first.run_id)
    assert run.info.status == "KILLED" and run.data.metrics == {"train/loss": 0.5}
    again = MlflowRun(f"file:{tmp_path}/mlruns", "exp", "/runs/a", {"data.batch_size": "16"}, said.append)
    assert again.run_id == first.run_id
    again.finish({"steps": 2, "auc": 0.75})
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"data.batch_size": "8"}
    assert run.data.metrics["summary/auc"] == 0.75
    assert said == [f"mlflow: run {first.run_id} in experiment 'exp' at file:{tmp_path}/mlruns"] * 2
