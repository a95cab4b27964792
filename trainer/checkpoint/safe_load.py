"""Reading checkpoints and artifacts without running their code (docs/design.md §2.10).

A run folder, a checkpoint or a pt2 artifact may come from someone else (a shared bucket, a
colleague's run). Their formats are data, but the libraries read parts of them with pickle,
which runs whatever a crafted file asks for. Every rankmix read goes through here instead:

- DCP's `.metadata` is read whole up to a size cap, its opcodes are checked (`scan_pickle`)
  before anything is unpickled, and `MetadataUnpickler` builds DCP's own metadata classes and
  a few builtins, refusing every other global. The result is checked (`check_metadata`):
  exact types, sizes and dtypes, chunks that tile each tensor, storage files inside the folder;
- DCP's byte values (the non-tensor parts of a state dict) and every `torch.load` behind
  `torch.export.load` run with weights_only=True (tensors and plain containers only);
- storage paths in the metadata and file names in a manifest must stay inside their folder,
  links resolved (`inside`);
- a checkpoint's files are opened as they were checked (`open_inside`, `open_checked`): part by
  part from the folder's descriptor, through no link (O_NOFOLLOW), a storage file only when it
  is the very file checked (device and inode), so a link or file swapped in after the check
  changes nothing.

pt2 artifacts are checked by trainer/serving/safe_pt2.py; TorchScript artifacts are programs
by nature and are not covered: see README's "Trust".
"""

from __future__ import annotations

import bisect
import dataclasses
import errno
import functools
import io
import math
import os
import pickle
import pickletools
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import IO, Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, LoadPlan, Metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlanner as DcpLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.futures import Future

from trainer.checkpoint.views import read_rows

METADATA_FILE = ".metadata"

# DCP's metadata takes about 300 bytes per tensor and 140 more per further chunk (measured on
# torch 2.13): 1000 tables, each with its weights and two optimizer states, all row-wise over
# 128 ranks, take 54 MiB. Nothing rankmix trains comes near; a larger file is refused unread.
MAX_METADATA_BYTES = 64 << 20
# DCP's metadata makes one container or instance per 9 bytes or more of its pickle (measured
# from 1 to 128 chunks per tensor, 1 to 3 dimensions). A crafted stream can make a 64-byte
# dict per byte; refusing more than one per 4 bytes keeps the unpickled objects within about
# twice the memory a real metadata of the same size takes.
MIN_BYTES_PER_OBJECT = 4
# Per tensor: 2^40 elements is 4 TiB of float32, beyond any table rankmix trains.
MAX_ELEMENTS = 2 ** 40
MAX_DIMS = 8  # rankmix's tensors have at most 3
# The cells of the grid `tiling_error` lays over a tensor's chunks: a sharding plan's chunks
# form a grid of one cell each (at most 2^20 chunks per tensor).
MAX_CELLS = 2 ** 20

# Every opcode pickle protocols 4 and 5 write for DCP's metadata (dataclasses, dicts, lists,
# tuples, str, int, bool, None) and no other: no persistent ids, extension codes, INST/OBJ,
# text (protocol 0) opcodes, sets, bytes or buffers. Memo entries are made by MEMOIZE alone,
# so the PUT opcodes are refused too: the unpickler sizes its memo from their index, and the
# 9 bytes `\x80\x04]r\xff\xff\xff\xff.` ask for 64 GiB.
_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "NONE", "NEWTRUE", "NEWFALSE", "BININT", "BININT1", "BININT2", "LONG1",
    "SHORT_BINUNICODE", "BINUNICODE", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_LIST",
    "APPEND", "APPENDS", "EMPTY_DICT", "SETITEM", "SETITEMS", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD",
    "MEMOIZE", "BINGET", "LONG_BINGET"})
_NEW_OBJECTS = frozenset({"EMPTY_DICT", "EMPTY_LIST", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NEWOBJ", "REDUCE"})

# Every global a DCP `.metadata` of torch 2.13 refers to (torch.distributed.checkpoint.metadata
# and filesystem's dataclasses, torch's dtype/layout/memory-format objects, torch.Size).
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "StorageMeta", "MetadataIndex", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
}
# torch pickles a dtype, layout or memory format as the name of its module attribute.
_TORCH_TYPES = (torch.dtype, torch.layout, torch.memory_format)
# The dtypes a checkpoint's tensor may have: what a model or optimizer holds (no quantized,
# bit-packed or float8 storage, which rankmix never saves).
_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                     torch.int16, torch.int8, torch.uint8, torch.bool})


class UnsafeFileError(ValueError):
    """A file asks to run code, to read outside its folder, or for memory out of all proportion
    to its size: refused before anything ran."""


@dataclasses.dataclass(frozen=True)
class CheckedFile:
    """A storage file as `check_storage` found it: where it lies below the folder, links resolved
    (`parts`), which file it is (`device`, `inode`) and its size."""

    parts: tuple[str, ...]
    device: int
    inode: int
    size: int


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other global is refused, naming it."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_TYPES):
            return getattr(torch, name)
        raise UnsafeFileError(f"{self.path}: refused to load: it names {module}.{name}, which a DCP checkpoint's "
                              "metadata never holds (a crafted file would run it). Load checkpoints only from "
                              "sources you trust; see README, Trust")


def read_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint folder `path`: read within `MAX_METADATA_BYTES`, its opcodes
    scanned, unpickled by `MetadataUnpickler`, then checked (`check_metadata`)."""
    return _read_checked(path)[0]


def _read_checked(path: Path) -> tuple[Metadata, dict[str, CheckedFile]]:
    """`read_metadata`, and its storage files as `check_metadata` found them."""
    folder = Path(path)
    file = folder / METADATA_FILE
    data = _read_capped(folder, _resolve(folder, METADATA_FILE, file)[1], file)
    scan_pickle(data, file)
    try:
        metadata = MetadataUnpickler(io.BytesIO(data), file).load()
    except UnsafeFileError:
        raise
    except Exception as e:  # the allowed constructors raise anything on crafted arguments: all mean unreadable
        raise ValueError(f"{file}: not a readable checkpoint metadata file ({type(e).__name__}: "
                         f"{first_line(e)[:200]})") from None
    return metadata, check_metadata(metadata, folder, file)


def _read_capped(folder: Path, parts: tuple[str, ...], file: Path) -> bytes:
    """`file`, at `parts` below `folder` (checked inside it), read within `MAX_METADATA_BYTES`."""
    not_regular = ValueError(f"{file}: not a readable checkpoint metadata file (not a regular file)")
    try:
        fd = open_inside(folder, parts, f"{file}:")
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):  # nothing there, or `folder` is a file
            raise not_regular from None
        raise ValueError(f"{file}: not a readable checkpoint metadata file ({type(e).__name__}: {e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder (which fdopen refuses, IsADirectoryError), a FIFO, a device
        os.close(fd)
        raise not_regular
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_METADATA_BYTES + 1)
        except OSError as e:
            raise ValueError(f"{file}: not a readable checkpoint metadata file ({type(e).__name__}: {e})") from None
    if len(data) > MAX_METADATA_BYTES:
        raise UnsafeFileError(f"{file}: refused: larger than {MAX_METADATA_BYTES >> 20} MiB, which no rankmix "
                              "checkpoint's metadata comes near")
    return data


def scan_pickle(data: bytes, file: Path) -> None:
    """Refuse, before anything is unpickled, a pickle with an opcode outside `_OPCODES`, a memo
    read of an entry not yet made, or more objects than `MIN_BYTES_PER_OBJECT` allows."""
    memo = objects = 0
    try:
        for op, arg, pos in pickletools.genops(data):
            if op.name not in _OPCODES:
                raise UnsafeFileError(f"{file}: refused: opcode {op.name} at byte {pos}"
                                      f"{f' (memo index {arg})' if 'PUT' in op.name or 'GET' in op.name else ''}, "
                                      "which a DCP checkpoint's metadata never holds")
            if op.name == "MEMOIZE":
                memo += 1
            elif op.name in ("BINGET", "LONG_BINGET") and arg >= memo:
                raise UnsafeFileError(f"{file}: refused: memo index {arg} at byte {pos}, beyond the {memo} "
                                      "entries memoized so far")
            objects += op.name in _NEW_OBJECTS
    except UnsafeFileError:
        raise
    except ValueError as e:  # pickletools' verdict on a truncated or unknown opcode
        raise ValueError(f"{file}: not a readable checkpoint metadata file ({first_line(e)[:200]})") from None
    if objects * MIN_BYTES_PER_OBJECT > len(data):
        raise UnsafeFileError(f"{file}: refused: it makes {objects} objects in {len(data)} bytes; a DCP "
                              f"checkpoint's metadata makes at most one per {MIN_BYTES_PER_OBJECT} bytes")


@functools.cache
def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _unlike(obj: Any, cls: type) -> str | None:
    """None when `obj` is exactly a `cls` (a dataclass) with every field set (an unpickled one may
    lack any), else what it is instead."""
    if type(obj) is not cls:
        return f"a {type(obj).__name__}"
    missing = [name for name in _fields(cls) if not hasattr(obj, name)]
    return f"a {cls.__name__} without its {missing[0]}" if missing else None


def check_metadata(metadata: Any, folder: Path, file: Path) -> dict[str, CheckedFile]:
    """Refuse metadata (unpickled from `file`, of checkpoint `folder`) that is not DCP's, names a
    storage file outside `folder` or past a file's end, or describes a tensor that DCP's load would
    leave partly unwritten or that no host could allocate; else its storage files as checked."""
    unlike = _unlike(metadata, Metadata)
    if unlike:
        raise ValueError(f"{file}: not a checkpoint metadata file (it holds {unlike})")
    for part, value in (("state_dict_metadata", metadata.state_dict_metadata),
                        ("storage_data", metadata.storage_data)):
        if type(value) is not dict:
            raise ValueError(f"{file}: not a valid checkpoint: its {part} is a {type(value).__name__}, not a dict")
    unlike = metadata.storage_meta is not None and _unlike(metadata.storage_meta, StorageMeta)
    if unlike:
        raise ValueError(f"{file}: not a valid checkpoint: its storage_meta is {unlike}")
    files = check_storage(metadata.storage_data, folder, file)
    for fqn, meta in metadata.state_dict_metadata.items():
        if type(fqn) is not str:
            raise ValueError(f"{file}: not a valid checkpoint: a key is a {type(fqn).__name__}, not a str")
        tensor = type(meta) is TensorStorageMetadata
        unlike = _unlike(meta, TensorStorageMetadata if tensor else BytesStorageMetadata)
        if unlike:
            raise ValueError(f"{file}: not a valid checkpoint: {fqn!r} is {unlike}")
        if tensor:
            check_tensor(fqn, meta, file)
        indexes = [MetadataIndex(fqn, chunk.offsets) for chunk in meta.chunks] if tensor else [MetadataIndex(fqn)]
        missing = next((index for index in indexes if index not in metadata.storage_data), None)
        if missing is not None:
            where = "" if missing.offset is None else f" at offset {tuple(missing.offset)}"
            raise ValueError(f"{file}: not a valid checkpoint: {fqn!r}{where} is stored nowhere")
    return files


def check_storage(storage_data: dict, folder: Path, file: Path) -> dict[str, CheckedFile]:
    """Each entry of `storage_data` names a regular file inside `folder` (links resolved), and
    bytes within it; no transforms (rankmix writes none). The files, by the names given."""
    files: dict[str, CheckedFile] = {}
    for index, info in storage_data.items():
        unlike = _unlike(index, MetadataIndex) or _unlike(info, _StorageInfo) \
            or (type(index.fqn) is not str and f"a key for a {type(index.fqn).__name__}")
        if unlike:
            raise ValueError(f"{file}: not a valid checkpoint: its storage_data holds {unlike}")
        name = info.relative_path
        if type(name) is not str or name not in files:
            try:
                parts = _resolve(folder, name, file)[1]
            except UnsafeFileError as e:
                raise UnsafeFileError(f"{e} (the storage of {index.fqn!r})") from None
            try:  # the resolved path, not followed again: a link put there since is no regular file
                found = os.lstat(os.path.join(os.path.realpath(folder), *parts))
            except OSError:
                found = None
            if found is None or not stat.S_ISREG(found.st_mode):
                raise ValueError(f"{file}: not a valid checkpoint: {index.fqn!r} is stored in {name!r}, "
                                 "which is not a file there")
            files[name] = CheckedFile(parts, found.st_dev, found.st_ino, found.st_size)
        size = files[name].size
        start, length = info.offset, info.length
        if type(start) is not int or type(length) is not int:
            raise ValueError(f"{file}: not a valid checkpoint: {index.fqn!r} is stored at an offset or length that "
                             "is not an int")
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"{file}: not a valid checkpoint: {index.fqn!r} is stored at bytes {start}+{length} "
                             f"of {name!r}, which has {size}")
        if info.transform_descriptors:
            raise ValueError(f"{file}: not a valid checkpoint: {index.fqn!r} is stored transformed, which rankmix "
                             "never writes")
    return files


def check_tensor(fqn: str, meta: TensorStorageMetadata, file: Path) -> None:
    """The dtype, size and chunks of tensor `fqn` are ones a load can allocate and fill whole."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{file}: not a valid checkpoint: tensor {fqn!r} {what}")
    unlike = _unlike(meta.properties, TensorProperties)
    if unlike:
        raise bad(f"has properties that are {unlike}")
    dtype = meta.properties.dtype
    if type(dtype) is not torch.dtype or dtype not in _DTYPES:
        raise bad(f"has dtype {dtype if type(dtype) is torch.dtype else 'a ' + type(dtype).__name__}, "
                  "not one a rankmix checkpoint holds")
    size = meta.size
    if type(size) is not torch.Size or len(size) > MAX_DIMS or any(n < 0 for n in size):
        raise bad(f"has size {size if type(size) is torch.Size else 'a ' + type(size).__name__}")
    if math.prod(size) >= MAX_ELEMENTS:
        raise bad(f"has {math.prod(size)} elements: 2^40 or more, beyond any table rankmix trains")
    if type(meta.chunks) is not list:
        raise bad(f"has chunks in a {type(meta.chunks).__name__}, not a list")
    for chunk in meta.chunks:
        if _unlike(chunk, ChunkStorageMetadata) or not all(
                type(v) is torch.Size and len(v) == len(size) for v in (chunk.offsets, chunk.sizes)):
            raise bad(f"has a chunk that is not a {len(size)}-dimensional ChunkStorageMetadata")
        if not all(0 <= o and 0 <= s and o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, size)):
            raise bad(f"of size {tuple(size)} has a chunk at {tuple(chunk.offsets)} of size {tuple(chunk.sizes)}, "
                      "outside it")
    error = tiling_error(size, meta.chunks)
    if error:
        raise bad(f"of size {tuple(size)}: its chunks {error}")


def tiling_error(size: torch.Size, chunks: list[ChunkStorageMetadata]) -> str | None:
    """Why `chunks` (each inside `size`) do not tile a tensor of `size` exactly, or None when they
    do: on the grid of every chunk's edges, each cell must lie in exactly one chunk. The cells
    covered are counted first, so overlapping chunks never cost more than the grid."""
    edges = [sorted({0, n, *(c.offsets[d] for c in chunks), *(c.offsets[d] + c.sizes[d] for c in chunks)})
             for d, n in enumerate(size)]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > MAX_CELLS:
        return f"cut it into more than {MAX_CELLS} pieces"
    spans = [[(bisect.bisect_left(e, o), bisect.bisect_left(e, o + s)) for e, o, s in zip(edges, c.offsets, c.sizes)]
             for c in chunks]
    covered = sum(math.prod(hi - lo for lo, hi in span) for span in spans)
    if covered < cells:
        return "leave a gap"
    if covered > cells:
        return "overlap"
    grid = torch.zeros([len(e) - 1 for e in edges], dtype=torch.int32)
    for span in spans:
        grid[tuple(slice(lo, hi) for lo, hi in span)] += 1
    return None if bool((grid == 1).all()) else "overlap"


class CheckedFiles(FileSystem):
    """DCP's file system for reading the storage files of checkpoint `folder`: each opened by
    `open_checked` as `files` holds it, by the name the metadata gives (`concat_path` passes the
    name on as it is), never by a path that could lead elsewhere since its check."""

    def __init__(self, folder: Path, files: dict[str, CheckedFile]):
        super().__init__()
        self.folder, self.files = folder, files

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        assert Path(path) == self.folder, f"{path}: not this reader's folder {self.folder}"
        return suffix

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[IO[bytes]]:
        assert mode == "rb" and path in self.files, f"{path}: not a checked storage file of {self.folder} ({mode})"
        with open_checked(self.folder, str(path), self.files[str(path)]) as stream:
            yield stream


class SafeReader(FileSystemReader):
    """DCP's file reader with `read_metadata` above (DCP's own unpickles the file as it is), which
    opens only the storage files it checked, as it checked them (`CheckedFiles`). `metadata`: the
    folder's metadata when the caller has read it already; its storage is checked again here,
    where the reader keeps what it found."""

    def __init__(self, path: str | Path, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata
        folder = Path(path)
        self.fs = CheckedFiles(folder, {} if metadata is None else
                               check_storage(metadata.storage_data, folder, folder / METADATA_FILE))

    def read_data(self, plan: LoadPlan, planner: DcpLoadPlanner) -> Future[None]:
        """DCP's read, but a tensor's rows go straight into their target (`views.read_rows`: no
        whole copy of each saved shard); what that does not serve, DCP's own way."""
        rest, per_file = [], {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            with self.fs.create_stream(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                for req in reqs:
                    info = self.storage_data[req.storage_index]
                    if info.transform_descriptors or not read_rows(self._slice_file(stream, info), info.length,
                                                                   req, planner):
                        rest.append(req)
        if rest:
            return super().read_data(dataclasses.replace(plan, items=rest), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata, self.fs.files = _read_checked(Path(self.path))
        metadata = self._metadata
        if metadata.storage_meta is None:  # what FileSystemReader.read_metadata adds
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with two changes:

    - byte values (the non-tensor parts of a state dict) load with weights_only=True, where
      DCP's own planner unpickles them as they are;
    - no fallback for checkpoints older than torch 2.4. That fallback starts whenever the
      checkpoint holds a key this rank does not (always so on several ranks: each rank's fused
      optimizer holds the state of its own tables only), and its old flattening turns a part of
      plain values, like `trainer`, into one unknown key. Every rankmix checkpoint is newer."""

    def create_local_plan(self) -> LoadPlan:
        return create_default_local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeFileError(f"checkpoint value {fqn!r} refused: it is not plain data ({first_line(e)}). "
                                  "Load checkpoints only from sources you trust; see README, Trust") from None
        if self.flatten_state_dict:  # as DefaultLoadPlanner.load_bytes, less its unchecked unpickling
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def first_line(e: Exception) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def inside(folder: Path, name: str, source: Path) -> Path:
    """`folder / name`, refused (naming `source`, where `name` came from) unless `name` is a relative
    `str` (exactly: a path object's parts may disagree with its string) and the file it names,
    links resolved, lies inside `folder`."""
    return _resolve(folder, name, source)[0]


def _resolve(folder: Path, name: str, source: Path) -> tuple[Path, tuple[str, ...]]:
    """`inside`'s check; (`folder / name`, the parts of the path below `folder` it resolves to)."""
    if type(name) is not str:
        raise UnsafeFileError(f"{source}: refused: it names a {type(name).__name__} where a file name (a str) "
                              "belongs")
    rel = PurePosixPath(name.replace("\\", "/"))
    if not name or "\0" in name or rel.is_absolute() or ".." in rel.parts or Path(name).is_absolute():
        raise UnsafeFileError(f"{source}: refused: it names {name!r}, which is not a file inside {folder}")
    root, real = os.path.realpath(folder), os.path.realpath(folder / rel)
    if real == root or os.path.commonpath([root, real]) != root:
        raise UnsafeFileError(f"{source}: refused: it names {name!r}, which leads to {real}, not a file inside "
                              f"{folder}")
    return folder / rel, Path(os.path.relpath(real, root)).parts


def open_inside(folder: Path, parts: tuple[str, ...], what: str) -> int:
    """A read-only descriptor of the file at `parts` below `folder` (resolved by `_resolve`), each
    part opened relative to the descriptor of the one before and none through a link (O_NOFOLLOW):
    a link that took the place of the file, or of a folder on its way, since its check is refused
    (naming it by `what`) instead of followed out of the folder. O_NONBLOCK: a FIFO put there does
    not wait for a writer. Other failures are OSError."""
    assert parts and not {".", ".."} & set(parts), f"{parts}: not a path below {folder}"
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = below
        return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise UnsafeFileError(f"{what} refused: a link took its place, or a folder's on its way, after it was "
                              "checked; nothing was read through it") from None
    finally:
        os.close(fd)


def open_checked(folder: Path, name: str, checked: CheckedFile) -> IO[bytes]:
    """Storage file `name` of `folder`, opened by `open_inside` and refused unless it is the file
    `check_storage` found (`checked`): nothing is read from a file that took its place since."""
    fd = open_inside(folder, checked.parts, f"storage file {name!r}")
    found = os.fstat(fd)
    if (found.st_dev, found.st_ino) != (checked.device, checked.inode):
        os.close(fd)
        raise UnsafeFileError(f"storage file {name!r} refused: another file took its place after it was checked; "
                              "nothing was read from it")
    return os.fdopen(fd, "rb")
