"""Reading checkpoints and artifacts without running their code (docs/design.md §2.10).

A run folder, a checkpoint or a pt2 artifact may come from someone else (a shared bucket, a
colleague's run). Their formats are data, but the libraries read parts of them with pickle,
which runs whatever a crafted file asks for. Every rankmix read goes through here instead:

- DCP's `.metadata` is unpickled by `MetadataUnpickler`, which builds DCP's own metadata
  classes and a few builtins and refuses every other global;
- DCP's byte values (the non-tensor parts of a state dict) and every `torch.load` behind
  `torch.export.load` run with weights_only=True (tensors and plain containers only);
- storage paths in the metadata and file names in a manifest must stay inside their folder.

TorchScript artifacts are programs by nature and are not covered: see README's "Trust".
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, LoadPlan, Metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILE = ".metadata"

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


class UnsafeFileError(ValueError):
    """A file asks to run code, or to read outside its folder: refused before anything ran."""


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
    """The DCP metadata of checkpoint folder `path`, read with `MetadataUnpickler` and checked:
    every storage file it names lies inside `path`."""
    file = Path(path) / METADATA_FILE
    try:
        with open(file, "rb") as f:
            metadata = MetadataUnpickler(f, file).load()
    except UnsafeFileError:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"{file}: not a readable checkpoint metadata file ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{file}: not a checkpoint metadata file (it holds a {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        inside(Path(path), getattr(info, "relative_path", ""), file)
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with `read_metadata` above (DCP's own unpickles the file as it is).
    `metadata`: the folder's metadata when the caller has read it already."""

    def __init__(self, path: str | Path, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = self._metadata or read_metadata(Path(self.path))
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
    """`folder / name`, refused (naming `source`, where `name` came from) unless it stays inside `folder`."""
    rel = PurePosixPath(str(name).replace("\\", "/"))
    if not name or rel.is_absolute() or ".." in rel.parts or Path(name).is_absolute():
        raise UnsafeFileError(f"{source}: refused: it names {name!r}, which is not a file inside {folder}")
    return folder / rel


# ----------------------------------------------------------------------------- pt2 artifacts

# Payloads of a pt2 archive that its loader unpickles without weights_only: custom (torchbind)
# and opaque objects, and the archives of torch <= 2.7. rankmix's artifacts hold none of them.
_PT2_PICKLED = ("data/constants/custom_obj", "data/constants/opaque_obj")


def check_pt2(path: Path) -> None:
    """Refuse a pt2 archive that holds anything `torch.export.load` would unpickle unchecked."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    inner = ["/".join(n.split("/")[1:]) for n in names]
    if "archive_format" not in inner:
        raise UnsafeFileError(f"{path}: refused: not a torch >= 2.8 pt2 archive (older ones are read with pickle)")
    pickled = [n for n in inner if n.startswith(_PT2_PICKLED) or n in ("data/weights/model.pt",
                                                                         "data/constants/model.pt")]
    if pickled:
        raise UnsafeFileError(f"{path}: refused: it holds pickled objects ({pickled[0]}), which loading would run; "
                              "a rankmix export holds tensors only")


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every torch.load inside runs with weights_only=True, whatever its caller asks for
    (torch reads TORCH_FORCE_WEIGHTS_ONLY_LOAD at each call)."""
    old = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = old


def load_pt2(path: Path) -> torch.export.ExportedProgram:
    """`torch.export.load(path)` on the safe path only: checked first, then loaded with weights-only loads."""
    check_pt2(path)
    with weights_only_loads():
        try:
            return torch.export.load(str(path))
        except pickle.UnpicklingError as e:
            raise UnsafeFileError(f"{path}: refused: a payload is not plain tensors ({first_line(e)})") from None

