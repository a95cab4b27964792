"""A reader's input and its identity: the files and row groups every rank agrees on, and the
sha256 of every file's bytes (issue 55).

Listing. `agreed_input` lists the files of a reader's paths and reads their footers (METADATA_THREADS
at a time): the row groups of trainer/data/assignment.py, and each file's schema, checked by the encoder.

Agreement. Each rank lists the files and reads their footers itself, so a file added or
rewritten while a job starts could give the ranks different row groups: different step
counts (one rank stops, the others hang in an all-reduce) or overlapping rows. So a reader
of a share (world_size > 1) in a process group compares, over all ranks, a digest of
(path, size, rows of each row group) of every file; a difference is a ValueError on every
rank naming the first file that differs, and a rank that cannot list its input makes every
rank raise. It is a collective: every rank builds such a reader at the same point.

Resume. A training reader records, for every file, its path, bytes, rows of each row group and
the sha256 of its bytes; a resume computes the digest again from the bytes and refuses a file
added, removed or rewritten (`file_change`), naming it. Size and modification time prove nothing:
`cp -p`, `rsync -a` and `tar` restore them over changed bytes.

- Streaming: each file is read in DIGEST_BLOCK reads through the store's pyarrow filesystem
  (local disk, S3), so a file being hashed holds DIGEST_BLOCK whatever its size, and a failed
  read is retried from the start of the file (trainer/data/store.py).
- Once per run: the reader computes the digests when it is built, and a run builds its
  training reader once (in time order, one per partition); epochs reuse them. Nothing caches
  them across readers: a cache keyed by (path, size, mtime) would answer a resume from the
  metadata the attack keeps.
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
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import torch.distributed as dist

from trainer.credentials import redact_uri
from trainer.data.assignment import RowGroup
from trainer.data.store import Store, resolve
from trainer.errors import DataUnavailableError

PREFIX = "sha256:"
DIGEST_BLOCK = 4 << 20  # bytes a read: large enough that a read's round trip and a call's cost vanish
# Files hashed at once on a rank: sha256 and pyarrow's reads run outside the GIL, and on an object
# store a file is a series of round trips.
DIGEST_THREADS = 8
# Files' footers are read this many at a time: on an object store each file costs round trips.
METADATA_THREADS = 8


@dataclass(frozen=True)
class AgreedInput:
    """A reader's input, as every rank lists it."""

    store: Store
    row_groups: list[RowGroup]
    files: list[list]  # [path, bytes, rows of each row group, (a training reader's) digest]: in a position


def agreed_input(paths: str, check_schema: Callable[[pa.Schema, str], None], *, world_size: int,
                 retry_seconds: float, retry_attempts: int, digests: bool) -> AgreedInput:
    """The files and row groups of `paths`, the same on every rank (module docstring, Agreement),
    each file's schema checked by `check_schema`; with `digests` (a training reader, whose position
    a resume must check) each file's digest too."""
    source = redact_uri(paths)
    view, failure, infos = None, None, []
    try:
        store, infos = resolve(paths, retry_seconds, retry_attempts)
        groups = _discover(store, [i.path for i in infos], check_schema)
        view = _input_view(infos, groups)
    except Exception as e:  # any failure: the other ranks must not wait for this rank in the check
        failure = e
    if world_size > 1 and dist.is_initialized():
        _check_same_input(source, view, failure)
    if failure is not None:
        raise failure
    files = [[path, size, rows] for path, size, rows in view]  # in the state: lists, as JSON has them
    if digests:
        hashed = shared_digests(infos, partial(_digest, store), source, world_size)
        files = [[*file, digest] for file, digest in zip(files, hashed, strict=True)]
    return AgreedInput(store, groups, files)


def _footer(fs: pafs.FileSystem, path: str) -> tuple[pa.Schema, list]:
    """A file's schema and row groups, from its footer alone."""
    frag = ds.ParquetFileFormat().make_fragment(path, filesystem=fs)
    schema = frag.physical_schema
    frag.ensure_complete_metadata()
    return schema, frag.row_groups


def _read_footer(store: Store, path: str) -> tuple[pa.Schema, list]:
    try:
        return store.call(partial(_footer, store.fs, path), path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"cannot read Parquet file {path}: {e}") from None


def _discover(store: Store, files: list[str], check_schema: Callable[[pa.Schema, str], None]) -> list[RowGroup]:
    """The row groups with rows of `files`, in order, their schemas checked."""
    groups = []
    footers = _concurrently([partial(_read_footer, store, path) for path in files])
    for path, (schema, infos) in zip(files, footers):
        check_schema(schema, path)
        groups += [RowGroup(path, rg.id, rg.num_rows) for rg in infos if rg.num_rows]
    return groups


def _digest(store: Store, info: pafs.FileInfo) -> str:
    try:
        return store.call(partial(file_digest, store.fs, info), info.path)
    except (pa.ArrowException, OSError, ValueError) as e:  # not DataUnavailableError, a RuntimeError
        raise ValueError(f"cannot read Parquet file {info.path}: {e}") from None


def _concurrently(calls: list) -> list:
    """The results of `calls`, in order, made up to METADATA_THREADS at a time; where calls fail,
    the first one's error in their order (not the first to happen) is raised."""
    with ThreadPoolExecutor(max_workers=max(1, min(METADATA_THREADS, len(calls)))) as pool:
        return list(pool.map(lambda call: call(), calls))


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


def _input_view(files: list[pafs.FileInfo], groups: list[RowGroup]) -> list[tuple[str, int, list[int]]]:
    """(path, bytes, rows of each row group) of every file: what the ranks must agree on."""
    rows: dict[str, list[int]] = {f.path: [] for f in files}
    for g in groups:
        rows[g.path].append(g.num_rows)
    return [(f.path, f.size, rows[f.path]) for f in files]


def file_change(saved: list[list], mine: list[list], rows: bool = True) -> str | None:
    """The first file, in path order, added, removed or changed between two lists of
    [path, bytes, rows of each row group, content digest] (the digest where both lists have one;
    `rows=False`: compare paths and bytes only), in words."""
    def described(files: list[list]) -> dict[str, tuple]:
        return {f[0]: (f[1], list(f[2])) if rows else (f[1], None) for f in files}

    def digests(files: list[list]) -> dict[str, str | None]:
        return {f[0]: f[3] if rows and len(f) > 3 and is_digest(f[3]) else None for f in files}
    before, after = described(saved), described(mine)
    then, now = digests(saved), digests(mine)
    for path in sorted(before.keys() | after.keys()):
        if path not in after:
            return f"{path} was removed"
        if path not in before:
            return f"{path} was added"
        if before[path] != after[path]:
            return (f"{path} changed from {_described(before[path])} to {_described(after[path])}" if rows else
                    f"{path} changed from {before[path][0]} to {after[path][0]} bytes")
        if then[path] and now[path] and then[path] != now[path]:
            return (f"{path} was rewritten: still {_described(before[path])}, but the sha256 of its bytes "
                    f"changed from {shown(then[path])} to {shown(now[path])}")
    return None


def _check_same_input(source: str, view: list | None, failure: Exception | None) -> None:
    """Collective (module docstring, Agreement): raises on every rank where another rank
    failed to list its input (`view` None, `failure` its error) or lists other files than
    rank 0. Only plain data crosses: a digest and an error message, and the file lists when
    the digests differ."""
    digest = None if view is None else hashlib.sha256(json.dumps(view).encode()).hexdigest()
    reports: list = [None] * dist.get_world_size()
    message = None if failure is None else str(failure)
    dist.all_gather_object(reports, (digest, message, isinstance(failure, DataUnavailableError)))
    if failure is not None:
        return  # this rank raises its own error
    for rank, (_, message, unavailable) in enumerate(reports):
        if message is not None:
            raise (DataUnavailableError if unavailable else ValueError)(
                f"{source}: rank {rank} cannot read its input: {message}")
    if len({d for d, _, _ in reports}) > 1:
        views: list = [None] * len(reports)
        dist.all_gather_object(views, view)
        raise ValueError(_first_difference(source, views))


def _first_difference(source: str, views: list[list]) -> str:
    """The first file, in path order, that a rank sees otherwise than rank 0, and how."""
    seen = [{path: (size, list(rows)) for path, size, rows in view} for view in views]
    for path in sorted(set().union(*seen)):
        for rank in range(1, len(seen)):
            if seen[rank].get(path) != seen[0].get(path):
                return (f"{source}: the ranks see different files, so their steps would not match: {path} is "
                        f"{_described(seen[0].get(path))} on rank 0 but {_described(seen[rank].get(path))} on rank "
                        f"{rank}; were files added or rewritten while the job started? A run's input must not change")
    return f"{source}: the ranks list the same files in another order or number; a run's input must not change"


def _described(file: tuple[int, list[int]] | None) -> str:
    if file is None:
        return "missing"
    size, rows = file
    return f"{size} bytes in {len(rows)} row group(s) of {sum(rows)} rows"
