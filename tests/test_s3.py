"""ParquetReader on an object store: a real S3-compatible server (moto's, on loopback)
serves the files; batches read through an s3:// URI equal those read from local disk.

pyarrow's S3 URIs accept endpoint_override, scheme and region as query parameters but not
credentials (`access_key=` / `secret_key=` are "Unexpected query parameter"); credentials
go in the URI's user-info (`s3://KEY:SECRET@bucket/prefix?...`) or in the usual AWS_*
environment variables.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("moto.server", reason="moto[server] not installed")
from dense.model_config import TaskSpec  # noqa: E402
from object_store import Server, filesystem, query, upload  # noqa: E402
from trainer.data.datasets import synth_features  # noqa: E402
from trainer.data.encode import RowEncoder  # noqa: E402
from trainer.data.options import ReaderOptions  # noqa: E402
from trainer.data.reader import ParquetReader  # noqa: E402
from trainer.data.store import resolve_files  # noqa: E402
from trainer.offline.synth import write_synthetic  # noqa: E402


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """(uri of the uploaded train folder, local train folder)."""
    server = Server()
    try:
        local = tmp_path_factory.mktemp("synth")
        write_synthetic(local, rows=3_000, files=3, row_group_size=250, seed=3, num_users=200, num_items=100)
        upload(filesystem(server.port), "rankmix-test", {local / "train": "logs/train"})
        yield f"s3://x:x@rankmix-test/logs/train{query(server.port)}", str(local / "train")
    finally:
        server.stop()


def _encoder() -> RowEncoder:
    return RowEncoder(synth_features(), [TaskSpec(name="click")], user_column="user_id")


def _batches(path: str, **kw) -> list:
    reader = ParquetReader(path, _encoder(), ReaderOptions(batch_size=128, **kw))
    return reader, list(reader)


def _same(a, b) -> None:
    assert len(a) == len(b) and len(a) > 0
    for x, y in zip(a, b):
        assert torch.equal(x.sparse.values(), y.sparse.values())
        assert torch.equal(x.sparse.lengths(), y.sparse.lengths())
        assert torch.equal(x.dense, y.dense) and torch.equal(x.labels, y.labels)
        assert torch.equal(x.users, y.users) and torch.equal(x.weights, y.weights)


def test_resolve_s3_uri(s3):
    uri, local = s3
    fs, files = resolve_files(uri)
    assert fs.type_name == "s3"
    assert [f.rsplit("/", 1)[1] for f in files] == [f"part-{i:05d}.parquet" for i in range(3)]


def test_s3_read_equals_local(s3):
    uri, local = s3
    remote_reader, remote = _batches(uri, shuffle=False, drop_last=False)
    local_reader, here = _batches(local, shuffle=False, drop_last=False)
    assert remote_reader.num_rows == local_reader.num_rows == 2_700
    _same(remote, here)


def test_s3_shuffled_sharded_read_equals_local(s3):
    uri, local = s3
    for rank in (0, 1):
        kw = dict(shuffle=True, shuffle_buffer=500, seed=7, rank=rank, world_size=2, num_epochs=1)
        _, remote = _batches(uri, **kw)
        _, here = _batches(local, **kw)
        _same(remote, here)
