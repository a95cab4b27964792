"""A real S3-compatible store on loopback for the object-store tests: moto's S3 application
served by werkzeug's threaded server, as in moto's ThreadedMotoServer, except that stopping
it also cuts the connections it has open, as a crash would. ThreadedMotoServer.stop() only
closes the listening socket, and a pooled keep-alive connection would go on being served,
hiding an outage. moto keeps its buckets in process-wide state, so a server started again on
the same port serves the same objects.

Import it after `pytest.importorskip("moto.server")`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
from moto import server as moto_server
from werkzeug.serving import make_server  # moto[server] brings it

REGION = "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Handler(moto_server.MotoRequestHandler):
    """moto's request handler, remembering its open connections."""

    live: set[socket.socket] = set()

    def setup(self) -> None:
        super().setup()
        self.live.add(self.connection)

    def finish(self) -> None:
        self.live.discard(self.connection)
        super().finish()


class Server:
    """moto's S3 server on 127.0.0.1:`port` (0: a port the server binds itself, so that no other
    process can take it first), whose stop() drops every connection."""

    def __init__(self, port: int = 0):
        app = moto_server.DomainDispatcherApplication(moto_server.create_backend_app)
        self.server = make_server("127.0.0.1", port, app, threaded=True, request_handler=_Handler)
        self.port = self.server.server_port
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()  # and closes the listening socket
        self.thread.join()
        for connection in list(_Handler.live):
            with contextlib.suppress(OSError):  # closed meanwhile
                connection.shutdown(socket.SHUT_RDWR)


def query(port: int) -> str:
    """The URI query that points pyarrow at the server on `port`."""
    return f"?endpoint_override=127.0.0.1:{port}&scheme=http&region={REGION}"


def filesystem(port: int, access_key: str = "x", secret_key: str = "x") -> pafs.S3FileSystem:
    return pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", access_key=access_key, secret_key=secret_key,
                             scheme="http", region=REGION, allow_bucket_creation=True)


def upload(fs: pafs.S3FileSystem, bucket: str, folders: dict[Path, str]) -> None:
    """Create `bucket` and copy each local folder (key) to its prefix in it (value)."""
    fs.create_dir(bucket)
    for source, prefix in folders.items():
        pafs.copy_files(str(source), f"{bucket}/{prefix}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=fs)


@contextlib.contextmanager
def synthetic_bucket(local: Path, bucket: str, userinfo: str, **rows) -> Iterator[tuple[dict, dict]]:
    """A server on loopback holding a synthetic log (written into `local` by
    trainer/offline/synth.py with `rows` as its options) under `bucket`/logs: yields
    ({split: URI with `userinfo`}, {split: the same URI without}); stopped on exit."""
    from trainer.offline.synth import write_synthetic

    splits = ("train", "valid")
    server = Server()
    try:
        write_synthetic(local, **rows)
        upload(filesystem(server.port), bucket, {local / s: f"logs/{s}" for s in splits})
        yield ({s: f"s3://{userinfo}@{bucket}/logs/{s}{query(server.port)}" for s in splits},
               {s: f"s3://{bucket}/logs/{s}{query(server.port)}" for s in splits})
    finally:
        server.stop()
