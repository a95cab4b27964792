"""Transient object-store faults (trainer.data.reader): a real S3-compatible server (moto's,
on loopback) is stopped in the middle of an epoch and started again on the same port; the
reader retries, re-opening its file, and yields exactly the batches of an undisturbed
read. A store that stays away past the retry budget, or is not there at start, gives one
DataUnavailableError line naming endpoint, bucket and key; permanent errors (missing or
corrupt files) stay ValueErrors, raised at once. No message shows the credentials.

The server (tests/object_store.py) drops its open connections when stopped, as a crash
would, and serves the same objects when started again on the same port.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

pytest.importorskip("moto.server", reason="moto[server] not installed")
from cli import rankmix, run_env  # noqa: E402
from dense.model_config import TaskSpec
from embeddings.features import FeatureSpec, validate_features  # noqa: E402
from object_store import Server, filesystem, free_port, upload  # noqa: E402
from trainer.credentials import redact_uri  # noqa: E402
from trainer.data.encode import RowEncoder  # noqa: E402
from trainer.data.options import ReaderOptions  # noqa: E402
from trainer.data.reader import ParquetReader  # noqa: E402
from trainer.data.store import resolve_files  # noqa: E402
from trainer.errors import DataUnavailableError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUCKET = "rankmix-faults"
SECRET = "se/cr+et"  # a '/' as in real AWS secrets: written %2F in the URI


def uri(port: int, key: str = "train") -> str:
    return (f"s3://AKIDFAULTS:se%2Fcr%2Bet@{BUCKET}/{key}?endpoint_override=127.0.0.1:{port}"
            "&scheme=http&region=us-east-1")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(port, local copy of the uploaded folder, server holder): 3 files of 50-row row groups."""
    holder = {"server": Server()}
    port = holder["server"].port
    local = tmp_path_factory.mktemp("faults")
    start = 0
    for i, n in enumerate([700, 650, 450]):
        ids = np.arange(start, start + n, dtype=np.int64)
        table = pa.table({"item": ids % 50, "price": ids.astype(np.float64), "click": ids % 2, "user": ids})
        pq.write_table(table, local / f"part-{i}.parquet", row_group_size=50)
        start += n
    fs = filesystem(port, "AKIDFAULTS", SECRET)
    upload(fs, BUCKET, {local: "train"})
    with fs.open_output_stream(f"{BUCKET}/corrupt/part-0.parquet") as f:
        f.write(b"PAR1" + bytes(range(256)) * 4 + b"PAR1")
    try:
        yield port, local, holder
    finally:
        holder["server"].stop()


def encoder() -> RowEncoder:
    features = [FeatureSpec(name="item", kind="id", num_embeddings=50), FeatureSpec(name="price", kind="numeric")]
    validate_features(features)
    return RowEncoder(features, [TaskSpec(name="click", label="click")], "user")


KW = dict(batch_size=64, shuffle_buffer=120, seed=5, num_epochs=2, rank=1, world_size=2)


def snaps(batches) -> list[tuple[np.ndarray, ...]]:
    return [(b.users.numpy().copy(), b.dense.numpy().copy(), b.labels.numpy().copy(),
             b.sparse.values().numpy().copy()) for b in batches]


def assert_same(a, b) -> None:
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v, err_msg=f"batch {i}")


def retries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "rankmix.data" and r.levelno == logging.WARNING]


def test_read_goes_on_through_an_outage_mid_epoch(store, caplog):
    port, local, holder = store
    reference = snaps(ParquetReader(str(local), encoder(), ReaderOptions(**KW)))
    # one try per request: pyarrow's own retries (3 by default) can ride out a 2 s outage alone
    reader = ParquetReader(uri(port), encoder(), ReaderOptions(retry_seconds=30, retry_attempts=1, **KW))
    it = iter(reader)
    got = snaps(next(it) for _ in range(4))
    assert reader.step == 4  # in the middle of epoch 0
    holder["server"].stop()
    down = time.monotonic()

    def restart():
        time.sleep(2.0)
        holder["server"] = Server(port)

    thread = threading.Thread(target=restart)
    thread.start()
    with caplog.at_level(logging.WARNING, logger="rankmix.data"):
        got += snaps(it)
    thread.join()
    assert time.monotonic() - down >= 2.0
    assert_same(got, reference)  # no batch lost, repeated or changed
    lines = retries(caplog)
    assert lines
    pattern = (rf"s3 endpoint 127\.0\.0\.1:{port}, {BUCKET}/train/part-\d\.parquet, row group \d+: "
               r"AWS Error NETWORK_CONNECTION .*; retrying in \d+\.\d\d s \(\d+\.\d s of the 30 s retry budget left\)")
    assert all(re.fullmatch(pattern, line) for line in lines), lines
    assert not any(SECRET in line or "%2F" in line for line in lines)


def test_unreachable_store_at_start(store):
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(DataUnavailableError) as info:
        ParquetReader(uri(port), encoder(), ReaderOptions(batch_size=8, retry_seconds=2, retry_attempts=1))
    elapsed = time.monotonic() - started
    message = str(info.value)
    match = re.fullmatch(rf"s3 endpoint 127\.0\.0\.1:{port}, {BUCKET}/train: unreachable for (\d+\.\d) s "
                         r"\(retry budget 2 s\): AWS Error NETWORK_CONNECTION during HeadObject operation: "
                         r"curlCode: 7, Could(?:n't| not) connect to server", message)
    assert match, message  # one line: '.' matches no newline
    assert 2.0 <= float(match.group(1)) <= elapsed < 5.0
    assert info.value.exit_code == 4


def test_store_gone_for_longer_than_the_budget(store):
    port, _, holder = store
    reader = ParquetReader(uri(port), encoder(), ReaderOptions(retry_seconds=1.5, retry_attempts=1, **KW))
    it = iter(reader)
    next(it)
    holder["server"].stop()
    try:
        with pytest.raises(DataUnavailableError) as info:
            list(it)
    finally:
        holder["server"] = Server(port)
    assert re.fullmatch(rf"s3 endpoint 127\.0\.0\.1:{port}, {BUCKET}/train/part-\d\.parquet, row group \d+: "
                        r"unreachable for \d+\.\d s \(retry budget 1\.5 s\): AWS Error NETWORK_CONNECTION .*",
                        str(info.value)), str(info.value)


def test_permanent_errors_are_not_retried(store):
    port = store[0]
    started = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(f"data path not found: {redact_uri(uri(port, 'nothing'))}")):
        ParquetReader(uri(port, "nothing"), encoder(), ReaderOptions(batch_size=8, retry_seconds=30))
    with pytest.raises(ValueError, match=re.escape(f"cannot read Parquet file {BUCKET}/corrupt/part-0.parquet: ")):
        ParquetReader(uri(port, "corrupt"), encoder(), ReaderOptions(batch_size=8, retry_seconds=30))
    assert time.monotonic() - started < 5.0  # far below the 30 s budget


def test_messages_never_show_credentials(store):
    port = store[0]
    with pytest.raises(ValueError) as info:
        resolve_files(uri(port, "nothing"))
    assert str(info.value) == (f"data path not found: s3://***@{BUCKET}/nothing?endpoint_override=127.0.0.1:{port}"
                               "&scheme=http&region=us-east-1")
    with pytest.raises(ValueError, match=re.escape("rankmix-faults/train?x=1: unknown S3 URI option(s) x")) as info:
        resolve_files(f"s3://AKIDFAULTS:{SECRET}@{BUCKET}/train?x=1")
    assert "AKIDFAULTS" not in str(info.value) and "cr+et" not in str(info.value)
    # an unescaped '/' in the secret cuts the URI short; it is still hidden, and named
    with pytest.raises(ValueError, match=re.escape("s3://***@rankmix-faults/t: expected s3://bucket/key or s3://KEY:SECRET@bucket/key")):
        resolve_files(f"s3://AKIDFAULTS:{SECRET}@{BUCKET}/t")


def test_retry_options_are_checked(tmp_path):
    pq.write_table(pa.table({"item": [1], "price": [1.0], "click": [0], "user": [1]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=re.escape("retry_seconds must be >= 0, got -1")):
        ParquetReader(str(tmp_path), encoder(), ReaderOptions(batch_size=1, retry_seconds=-1))
    with pytest.raises(ValueError, match=re.escape("retry_attempts must be >= 1, got 0")):
        ParquetReader(str(tmp_path), encoder(), ReaderOptions(batch_size=1, retry_attempts=0))



# ----------------------------------------------------------------------------- whole runs


@pytest.fixture(scope="module")
def runs_store(store, tmp_path_factory):
    """(config with the synthetic schema, train URI, eval URI) of synthetic logs on the store."""
    from trainer.config_loader import dump_toml, load_config
    from trainer.data.datasets import synth_features
    from trainer.offline.synth import write_synthetic

    port, _, _ = store
    local = tmp_path_factory.mktemp("synth")
    write_synthetic(local, rows=3_000, files=3, row_group_size=250, seed=3, num_users=200, num_items=100)
    fs = filesystem(port, "AKIDFAULTS", SECRET)
    for split in ("train", "valid"):
        pafs.copy_files(str(local / split), f"{BUCKET}/synth/{split}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=fs)
    cfg = load_config(str(REPO / "configs" / "debug.toml"), ["--data.dataset=parquet"])
    cfg.features = synth_features()
    config = local / "parquet.toml"
    dump_toml(cfg, config)
    return config, uri(port, "synth/train"), uri(port, "synth/valid")


def train_through(world: int, runs_store, run, holder, port: int, outage_at: int | None):
    """Train `world` ranks on the store; with `outage_at`, the store goes away once that
    step is logged and comes back on the same port 3 s later."""
    import json

    from cli import rankmix_ranks as train

    config, train_uri, eval_uri = runs_store
    args = ["--config", str(config), f"--data.train_path={train_uri}", f"--data.eval_path={eval_uri}",
            "--data.batch_size=64", "--data.shuffle_buffer=256", "--train.steps=24", f"--train.run_dir={run}",
            "--metrics.log_every=1", "--metrics.eval_batches=2", "--metrics.progress=false",
            "--metrics.tensorboard=false", "--data.retry_attempts=1", "--data.retry_seconds=60"]
    done: list = []  # the run goes on in a thread while this one takes the store away
    runner = threading.Thread(target=lambda: done.append(train(world, *args, env=run_env(
        AWS_EC2_METADATA_DISABLED="true"))), daemon=True)
    runner.start()
    if outage_at is not None:
        metrics, deadline = run / "metrics.jsonl", time.monotonic() + 240
        while not (metrics.exists() and any(json.loads(line)["step"] >= outage_at
                                            for line in metrics.read_text().splitlines())):
            assert runner.is_alive() and time.monotonic() < deadline, done and redact_uri(done[0].stderr[-3000:])
            time.sleep(0.02)
        holder["server"].stop()
        time.sleep(3)
        holder["server"] = Server(port)
    runner.join(330)
    assert done, "the run did not end"
    out, err = done[0].stdout, done[0].stderr
    assert done[0].returncode == 0, redact_uri(err[-3000:])
    return out, err


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_training_rides_out_a_store_restart_bitwise(world, store, runs_store, tmp_path):
    """The store restarted mid-epoch costs only time: the same rows are trained, and the
    final weights, optimizer states and data positions are bitwise those of a run that saw
    no outage."""
    from test_checkpoint import assert_same_state

    port, _, holder = store
    calm, hit = tmp_path / "calm", tmp_path / "hit"
    train_through(world, runs_store, calm, holder, port, outage_at=None)
    _, err = train_through(world, runs_store, hit, holder, port, outage_at=6)
    assert re.search(rf"{BUCKET}/synth/train/part-\d+\.parquet.*; retrying in", err), err[-3000:]  # met the outage
    assert "AKIDFAULTS" not in err and "se%2Fcr" not in err
    assert_same_state(calm / "checkpoints" / "step-24", hit / "checkpoints" / "step-24", tmp_path)


def test_unreachable_store_stops_the_run_with_exit_code_4(runs_store, tmp_path):
    """`rankmix train` against a store that is not there: one line naming endpoint, bucket,
    key and the budget spent, exit code 4 (trainer/errors.py), no traceback, no secret."""
    config, _, _ = runs_store
    port = free_port()  # nothing listens there
    proc = rankmix("train", "--config", str(config), f"--data.train_path={uri(port)}",
                   f"--data.eval_path={uri(port)}", "--data.retry_seconds=1", "--data.retry_attempts=1",
                   f"--train.run_dir={tmp_path / 'run'}", "--metrics.progress=false",
                   env=run_env(AWS_EC2_METADATA_DISABLED="true"), timeout=120)
    assert proc.returncode == 4, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"rankmix: stopped: s3 endpoint 127\.0\.0\.1:{port}, {BUCKET}/train: unreachable for "
                        r"\d+\.\d s \(retry budget 1 s\): .+", last), last
    assert "Traceback" not in proc.stderr and "AKIDFAULTS" not in proc.stderr + proc.stdout
