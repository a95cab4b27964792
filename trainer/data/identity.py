"""A training file's identity: the sha256 of every one of its bytes (issue 55).

A training reader records, for every file, its path, bytes, rows of each row group and this
digest (trainer/data/reader.py, Resume); a resume computes the digest again from the bytes
and refuses a file whose digest differs, naming it. Size and modification time prove nothing:
`cp -p`, `rsync -a` and `tar` restore them over changed bytes.

- Streaming: each file is read in DIGEST_BLOCK reads through the store's pyarrow filesystem
  (local disk, S3), so a file being hashed holds DIGEST_BLOCK whatever its size, and a failed
  read is retried from the start of the file (trainer/data/store.py).
- Once per run: the reader computes the digests when it is built, and a run builds its
  training reader once (in time order, one per partition); epochs reuse them. Nothing caches them across readers: a cache keyed
  by (path, size, mtime) would answer a resume from the metadata the attack keeps.
- Split over the ranks: under a process group each rank hashes every world_size-th file and
  the ranks share the digests in one collective, so every byte is read once per run, not once
  per rank. A rank that fails makes every rank raise.

Cost (docs/scale.md): sha256 runs at about 1.8 GB/s a core with SHA-NI; on the scale
rehearsal's 12 GB log the digest took about a fifth of one epoch's raw pyarrow read of the same
files (0.12-0.46 over runs and log sizes), paid once per run: 0.3-0.8% of its training epoch.

A digest is "sha256:" and the hex digest, so that `sha256sum FILE` shows the same hex. Older
rankmix versions recorded another digest (sampled above 8 MiB); a position carrying one resumes
as one carrying none, with a warning (the reader's `load_state_dict`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pyarrow.fs as pafs
import torch.distributed as dist

from trainer.errors import DataUnavailableError

PREFIX = "sha256:"
DIGEST_BLOCK = 4 << 20  # bytes a read: large enough that a read's round trip and a call's cost vanish
# Files hashed at once on a rank: sha256 and pyarrow's reads run outside the GIL, and on an object
# store a file is a series of round trips.
DIGEST_THREADS = 8


def content_digest(stream: pafs.NativeFile) -> tuple[str, int]:
    """(digest, bytes read) of everything `stream` holds from its position to its end."""
    h = hashlib.sha256()
    size = 0
    while block := stream.read(DIGEST_BLOCK):
        h.update(block)
        size += len(block)
    return PREFIX + h.hexdigest(), size


def file_digest(fs: pafs.FileSystem, info: pafs.FileInfo) -> str:
    """The digest of the listed file `info`, opened afresh (a retry starts over). A file whose
    bytes differ in number from its listing changed while the run started: a ValueError."""
    with fs.open_input_stream(info.path) as stream:
        digest, size = content_digest(stream)
    if size != info.size:
        raise ValueError(f"it changed while it was read: listed with {info.size} bytes, read {size}")
    return digest


def is_digest(value: object) -> bool:
    """Whether `value` is a digest this module writes (not an older rankmix's, nor none)."""
    return isinstance(value, str) and value.startswith(PREFIX) and len(value) == len(PREFIX) + 64


def shown(digest: str) -> str:
    """A digest in a message: its first 16 hex digits, as `sha256sum` starts."""
    return digest[len(PREFIX):][:16]


def shared_digests(infos: list[pafs.FileInfo], digest: Callable[[pafs.FileInfo], str], source: str,
                   world_size: int) -> list[str]:
    """`digest` of every file, in order. Under a process group (world_size > 1) each rank hashes
    every world_size-th file and the ranks share the digests (a collective every rank calls); a
    rank that fails makes every rank raise, its own error on it and a line naming it elsewhere."""
    shared = world_size > 1 and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if shared else (0, 1)
    mine, failure = {}, None
    ours = range(rank, len(infos), world)
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(DIGEST_THREADS, len(ours)))) as pool:
            mine = dict(zip(ours, pool.map(digest, [infos[i] for i in ours])))  # the first failure in order
    except (DataUnavailableError, ValueError) as e:
        failure = e
    if not shared:
        if failure is not None:
            raise failure
        return [mine[i] for i in range(len(infos))]
    parts: list = [None] * world
    dist.all_gather_object(parts, (mine, None if failure is None else str(failure),
                                   isinstance(failure, DataUnavailableError)))
    for r, (_, message, unavailable) in enumerate(parts):
        if message is not None:
            raise (DataUnavailableError if unavailable else ValueError)(
                message if r == rank else f"{source}: rank {r} cannot read its input: {message}")
    merged = {i: d for part, _, _ in parts for i, d in part.items()}
    return [merged[i] for i in range(len(infos))]
