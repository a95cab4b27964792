"""trainer/checkpoint/safe_load.py in-process, on tiny checkpoints saved here by DCP itself: each
limit of the metadata scanner at its boundary (the last accepted input and one element or byte
past it), each refusal's exact message, and loads that give back what was saved. Fast: the
mutation target "safe_load" runs these (test_trust_dcp.py's crafted runs need a trained run)."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import pickletools
import socket
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from trainer.checkpoint import safe_load
from trainer.checkpoint.safe_load import (
    MAX_CELLS,
    MAX_DIMS,
    MAX_ELEMENTS,
    CheckedFile,
    LoadPlanner,
    SafeReader,
    UnsafeFileError,
    check_metadata,
    check_storage,
    check_tensor,
    first_line,
    inside,
    open_checked,
    open_inside,
    read_metadata,
    scan_pickle,
    tiling_error,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STORAGE = "__0_0.distcp"


def saved() -> dict:
    """What each test checkpoint holds: tensors of 2, 1 and 0 dimensions, an empty one, plain values."""
    return {"model": {"w": torch.arange(20.0).reshape(5, 4), "b": torch.arange(3), "s": torch.tensor(7.5),
                      "e": torch.zeros(0, 4)},
            "trainer": {"step": 4, "name": "x" * 300}}


def fresh() -> dict:
    """A state dict of `saved()`'s shapes holding other values, for a load to fill."""
    return {"model": {"w": torch.zeros(5, 4), "b": torch.zeros(3, dtype=torch.int64), "s": torch.tensor(0.0),
                      "e": torch.ones(0, 4)},
            "trainer": {"step": 0, "name": ""}}


@pytest.fixture
def step(tmp_path: Path) -> Path:
    folder = tmp_path / "step"
    dcp.save(saved(), checkpoint_id=str(folder), no_dist=True)
    return folder


def metadata_of(step: Path) -> Metadata:
    return pickle.loads((step / ".metadata").read_bytes())  # the test's own file: trusted


def rewrite(step: Path, edit) -> Path:
    """`edit` applied to `step`'s metadata, pickled back; returns the `.metadata` file."""
    metadata = metadata_of(step)
    edit(metadata)
    (step / ".metadata").write_bytes(pickle.dumps(metadata))
    return step / ".metadata"


def load(step: Path, state: dict | None = None, **planner) -> dict:
    state = fresh() if state is None else state
    dcp.load(state, storage_reader=SafeReader(step), planner=LoadPlanner(**planner), no_dist=True)
    return state


def load_error(step: Path, state: dict | None = None) -> BaseException:
    """The first error of `load`, as DCP reports it (a CheckpointException of each rank's)."""
    with pytest.raises(CheckpointException) as failed:
        load(step, state)
    return next(iter(failed.value.failures.values()))[0]


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


def refusal(call, error=ValueError) -> str:
    with pytest.raises(error) as refused:
        call()
    assert type(refused.value) is error
    return str(refused.value)


# ----------------------------------------------------------------------------- loads


def test_a_load_gives_back_what_was_saved(step):
    """Every tensor (read_rows' path and DCP's own for the 0-dimensional one) and plain value."""
    assert same(load(step), saved())


def test_a_load_without_flattening_gives_back_the_values_by_their_keys(step):
    state, planner = {"model.w": torch.zeros(5, 4), "trainer.step": 0}, LoadPlanner(flatten_state_dict=False)
    dcp.load(state, storage_reader=SafeReader(step), planner=planner, no_dist=True)
    assert same(planner.state_dict, {"model.w": saved()["model"]["w"], "trainer.step": 4})


def test_a_key_the_checkpoint_lacks_fails_the_load_unless_partial_loads_are_allowed(step):
    state = fresh()
    state["model"]["extra"] = torch.zeros(2)
    assert str(load_error(step, state)) == "Missing key in checkpoint state_dict: model.extra."
    loaded = load(step, state, allow_partial_load=True)
    assert same(loaded["model"]["w"], saved()["model"]["w"]) and same(loaded["model"]["extra"], torch.zeros(2))


def test_a_reader_given_the_metadata_reads_the_same_and_not_the_file_again(step):
    state, metadata = fresh(), read_metadata(step)
    (step / ".metadata").write_bytes(b"not read again")
    reader = SafeReader(step, metadata)
    dcp.load(state, storage_reader=reader, planner=LoadPlanner(), no_dist=True)
    assert same(state, saved()) and reader.read_metadata() is metadata


class CountingPlanner(LoadPlanner):
    """Counts the commits of each tensor: each is read once, by read_rows or by DCP's own read."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.commits: dict[str, int] = {}

    def commit_tensor(self, read_item, tensor):
        fqn = read_item.dest_index.fqn
        self.commits[fqn] = self.commits.get(fqn, 0) + 1
        super().commit_tensor(read_item, tensor)


@pytest.mark.parametrize("parts", [["w"], ["w", "b", "s", "e"]], ids=["rows-only", "mixed"])
def test_each_tensor_is_read_once(step, parts):
    """Only read_rows' tensors (2-dimensional ones), or those with a scalar DCP reads its own way."""
    state = {"model": {name: fresh()["model"][name] for name in parts}}
    planner = CountingPlanner()
    dcp.load(state, storage_reader=SafeReader(step), planner=planner, no_dist=True)
    assert same(state, {"model": {name: saved()["model"][name] for name in parts}})
    assert planner.commits == {f"model.{name}": 1 for name in parts if name != "e"}  # an empty one has no item


def test_the_metadata_is_dcps_own_reading_with_this_readers_load_id(step):
    """DCP's FileSystemReader, which unpickles the file as it is, is the reference."""
    ours, theirs = SafeReader(step), FileSystemReader(step)
    mine, reference = ours.read_metadata(), theirs.read_metadata()
    assert mine.storage_meta.load_id == ours.load_id and reference.storage_meta.load_id == theirs.load_id
    mine.storage_meta.load_id = reference.storage_meta.load_id = None
    assert mine == reference
    assert ours.read_metadata() is mine  # read once


def test_a_metadata_without_storage_meta_gets_one_with_the_load_id(step):
    def edit(metadata):
        metadata.storage_meta = None
    rewrite(step, edit)
    reader = SafeReader(step)
    assert reader.read_metadata().storage_meta == StorageMeta(load_id=reader.load_id)
    assert same(load(step), saved())


def test_a_planted_value_is_refused_whatever_torchs_default(step, tmp_path, monkeypatch):
    """The environment may ask torch.load to unpickle anything by default: rankmix still refuses."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {ran}",)
    buffer = io.BytesIO()
    torch.save(Payload(), buffer)
    size = os.stat(step / STORAGE).st_size
    with open(step / STORAGE, "ab") as f:  # the value after the others, and the metadata pointing at it
        f.write(buffer.getvalue())

    def edit(metadata):
        info = metadata.storage_data[MetadataIndex("trainer.step")]
        info.offset, info.length = size, len(buffer.getvalue())
    rewrite(step, edit)
    error = load_error(step)
    message = str(error)
    assert type(error) is UnsafeFileError
    assert message.startswith("checkpoint value 'trainer.step' refused: it is not plain data (Weights only load "
                              "failed. ") and message.endswith("Load checkpoints only from sources you trust; "
                                                               "see README, Trust")
    assert not ran.exists()


# ----------------------------------------------------------------------------- the metadata file


def test_a_folder_without_metadata_or_with_a_folder_fifo_or_socket_there_is_refused(tmp_path):
    file = tmp_path / ".metadata"
    not_regular = f"{file}: not a readable checkpoint metadata file (not a regular file)"
    assert refusal(lambda: read_metadata(tmp_path)) == not_regular
    (tmp_path / "f").write_text("")
    assert refusal(lambda: read_metadata(tmp_path / "f")) == (f"{tmp_path / 'f' / '.metadata'}: not a readable "
                                                               "checkpoint metadata file (not a regular file)")
    file.mkdir()
    assert refusal(lambda: read_metadata(tmp_path)) == not_regular
    file.rmdir()
    os.mkfifo(file)
    assert refusal(lambda: read_metadata(tmp_path)) == not_regular  # at once: no writer awaited
    file.unlink()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(file))
        assert refusal(lambda: read_metadata(tmp_path)) == (
            f"{file}: not a readable checkpoint metadata file (OSError: [Errno 6] No such device or address: "
            "'.metadata')")


def test_a_metadata_file_of_exactly_the_cap_is_read_and_one_byte_more_refused(step, monkeypatch):
    """Bytes after the pickle's STOP are never unpickled; the cap counts them all the same."""
    data = (step / ".metadata").read_bytes()
    monkeypatch.setattr(safe_load, "MAX_METADATA_BYTES", 4 * len(data))
    (step / ".metadata").write_bytes(data.ljust(4 * len(data), b"\0"))
    assert read_metadata(step) == metadata_of(step)
    monkeypatch.setattr(safe_load, "MAX_METADATA_BYTES", 4 * len(data) - 1)
    assert refusal(lambda: read_metadata(step), UnsafeFileError) == (
        f"{step / '.metadata'}: refused: larger than 0 MiB, which no rankmix checkpoint's metadata comes near")
    monkeypatch.setattr(safe_load, "MAX_METADATA_BYTES", 4 << 20)
    (step / ".metadata").write_bytes(data.ljust((4 << 20) + 1, b"\0"))
    assert refusal(lambda: read_metadata(step), UnsafeFileError) == (
        f"{step / '.metadata'}: refused: larger than 4 MiB, which no rankmix checkpoint's metadata comes near")


def test_a_metadata_that_became_a_link_after_its_check_is_refused(step, tmp_path):
    os.replace(step / ".metadata", tmp_path / "elsewhere")
    (step / ".metadata").symlink_to(tmp_path / "elsewhere")
    assert refusal(lambda: safe_load._read_capped(step, (".metadata",), step / ".metadata"), UnsafeFileError) == (
        f"{step / '.metadata'}: refused: a link took its place, or a folder's on its way, after it was checked; "
        "nothing was read through it")


def test_a_huge_metadata_is_refused_having_read_no_more_than_the_cap(tmp_path, monkeypatch):
    """A sparse file of 256 MiB: reading it whole would take 256 MiB."""
    monkeypatch.setattr(safe_load, "MAX_METADATA_BYTES", 1 << 20)
    with open(tmp_path / ".metadata", "wb") as f:
        f.truncate(256 << 20)
    tracemalloc.start()
    try:
        assert refusal(lambda: read_metadata(tmp_path), UnsafeFileError) == (
            f"{tmp_path / '.metadata'}: refused: larger than 1 MiB, which no rankmix checkpoint's metadata comes near")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_a_metadata_file_that_fails_to_read_is_unreadable():
    """/proc/self/mem is a regular file whose read at offset 0 fails (nothing is mapped there)."""
    assert refusal(lambda: safe_load._read_capped(Path("/proc/self"), ("mem",), Path("m"))) == (
        "m: not a readable checkpoint metadata file (OSError: [Errno 5] Input/output error)")


def test_a_metadata_reading_past_its_memo_is_refused(tmp_path):
    """BINGET of index 1 with one entry memoized: the unpickler would read past its memo."""
    assert unpickled(tmp_path, b"\x80\x04N\x94h\x01.") == (f"{tmp_path / '.metadata'}: refused: memo index 1 "
                                                           "at byte 4, beyond the 1 entries memoized so far")


def test_a_metadata_linked_from_inside_is_read_and_one_linked_outside_refused(step, tmp_path):
    (step / "real").write_bytes((step / ".metadata").read_bytes())
    (step / ".metadata").unlink()
    (step / ".metadata").symlink_to("real")
    assert read_metadata(step) == metadata_of(step)
    (step / ".metadata").unlink()
    (step / ".metadata").symlink_to(step / "real")
    os.replace(step / "real", tmp_path / "outside")
    (step / ".metadata").unlink()
    (step / ".metadata").symlink_to(tmp_path / "outside")
    assert refusal(lambda: read_metadata(step), UnsafeFileError) == (
        f"{step / '.metadata'}: refused: it names '.metadata', which leads to {tmp_path / 'outside'}, not a file "
        f"inside {step}")


def unpickled(tmp_path: Path, data: bytes) -> str:
    """read_metadata's refusal of a `.metadata` of `data`."""
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(ValueError) as refused:
        read_metadata(tmp_path)
    return str(refused.value)


def global_pickle(module: str, name: str) -> bytes:
    """A pickle (4) of the global `module.name`."""
    return (b"\x80\x04" + b"\x8c" + bytes([len(module)]) + module.encode() + b"\x94\x8c" + bytes([len(name)])
            + name.encode() + b"\x94\x93\x94.")


@pytest.mark.parametrize("module, name", [("posix", "system"), ("torch", "load"), ("nottorch", "float32"),
                                          ("torch", "nothing")])
def test_a_global_outside_dcps_metadata_is_refused_naming_it(tmp_path, module, name):
    assert unpickled(tmp_path, global_pickle(module, name)) == (
        f"{tmp_path / '.metadata'}: refused to load: it names {module}.{name}, which a DCP checkpoint's metadata "
        "never holds (a crafted file would run it). Load checkpoints only from sources you trust; see README, Trust")


def test_a_stream_the_allowed_constructors_reject_is_one_line_of_at_most_200_characters(tmp_path):
    """torch.device of a long string: its error repeats the string."""
    arg = b"\x8c\xf0" + b"y" * 240 + b"\x94\x85\x94R\x94."
    message = unpickled(tmp_path, global_pickle("torch", "device")[:-1] + arg)
    error = f"{tmp_path / '.metadata'}: not a readable checkpoint metadata file (RuntimeError: "
    assert message.startswith(error) and message.endswith(")") and "\n" not in message
    assert len(message) == len(error) + 200 + 1 and "Expected one of" in message
    assert unpickled(tmp_path, b"\x80\x04.") == (f"{tmp_path / '.metadata'}: not a readable checkpoint metadata file "
                                                 "(UnpicklingError: unpickling stack underflow)")


def test_a_pickle_of_another_thing_is_refused(tmp_path):
    assert unpickled(tmp_path, pickle.dumps({"a": [1, 2]}, protocol=4)) == (
        f"{tmp_path / '.metadata'}: not a checkpoint metadata file (it holds a dict)")


# ----------------------------------------------------------------------------- the opcode scanner


def scanned(data: bytes) -> str | None:
    """scan_pickle's refusal of `data` (None: accepted)."""
    try:
        scan_pickle(data, Path("m"))
    except ValueError as e:
        return str(e)
    return None


def every_opcode_pickle() -> bytes:
    """A pickle of every opcode DCP's metadata may hold that a small metadata lacks: True, ints of
    4 and more bytes, a string of 256 bytes, a list and dict of several items, one dict item, a
    memo entry fetched by index 256."""
    strings = [str(i) for i in range(300)]
    return pickle.dumps([(1, 2, 3), True, -1, 2 ** 40, "z" * 256, [1, 2], {1: 2}, {1: 2, 3: 4}, strings, strings[290]],
                        protocol=4)


def test_every_opcode_of_a_metadata_is_accepted(step):
    metadata = (step / ".metadata").read_bytes()
    ops = {op.name for data in (metadata, every_opcode_pickle()) for op, _, _ in pickletools.genops(data)}
    assert ops >= {"NEWTRUE", "BININT", "LONG1", "BINUNICODE", "APPENDS", "SETITEM", "SETITEMS", "LONG_BINGET",
                   "BINGET", "MEMOIZE", "FRAME", "TUPLE", "TUPLE3", "NEWOBJ", "REDUCE", "BUILD", "STACK_GLOBAL"}
    assert scanned(every_opcode_pickle()) is None and scanned(metadata) is None


@pytest.mark.parametrize("data, says", [
    (b"\x80\x04Nq\x00.", "opcode BINPUT at byte 3 (memo index 0)"),
    (b"\x80\x04Nr\x00\x00\x00\x00.", "opcode LONG_BINPUT at byte 3 (memo index 0)"),
    (b"\x80\x04Np0\n.", "opcode PUT at byte 3 (memo index 0)"),
    (b"\x80\x04N\x94g0\n.", "opcode GET at byte 4 (memo index 0)"),
    (b"\x80\x04cos\nsystem\n.", "opcode GLOBAL at byte 2"),
    (b"\x80\x04C\x01x.", "opcode SHORT_BINBYTES at byte 2"),
    (b"\x80\x04\x8f.", "opcode EMPTY_SET at byte 2"),
], ids=["binput", "long-binput", "put", "get", "global", "bytes", "set"])
def test_an_opcode_dcp_never_writes_is_refused(data, says):
    assert scanned(data) == f"m: refused: {says}, which a DCP checkpoint's metadata never holds"


@pytest.mark.parametrize("get", [b"h", b"j"], ids=["binget", "long-binget"])
def test_a_memo_read_at_the_memo_size_is_refused_and_one_below_accepted(get):
    """Two entries memoized: index 1 is the last one made, index 2 one past it."""
    def stream(index: int) -> bytes:
        arg = bytes([index]) if get == b"h" else index.to_bytes(4, "little")
        return b"\x80\x04N\x94N\x94" + get + arg + b"."
    assert scanned(stream(1)) is None and scanned(stream(0)) is None
    assert scanned(stream(2)) == "m: refused: memo index 2 at byte 6, beyond the 2 entries memoized so far"


@pytest.mark.parametrize("op", [b"}", b"]", b"t", b"\x85", b"\x86", b"\x87", b"\x81", b"R"],
                         ids=["dict", "list", "tuple", "tuple1", "tuple2", "tuple3", "newobj", "reduce"])
def test_one_new_object_per_4_bytes_is_accepted_and_a_byte_less_refused(op):
    """Only the opcodes are scanned: the objects need not make sense to be counted."""
    made = b"\x80\x04" + op * 10 + b"."
    assert scanned(made.ljust(40, b"\0")) is None
    assert scanned(made.ljust(39, b"\0")) == ("m: refused: it makes 10 objects in 39 bytes; a DCP checkpoint's "
                                              "metadata makes at most one per 4 bytes")


def test_a_truncated_or_unknown_opcode_is_unreadable():
    long = scanned(b"\x80\x04S" + b"a" * 300 + b"\n.")  # pickletools' error repeats the text: cut at 200
    assert long.startswith("m: not a readable checkpoint metadata file (no string quotes around b'aaa") \
        and long.endswith("aaa)")
    assert len(long) == len("m: not a readable checkpoint metadata file ()") + 200
    assert scanned(b"\x80\x04\x8c\x05ab") == ("m: not a readable checkpoint metadata file (expected 5 bytes in a "
                                              "unicodestring1, but only 2 remain)")
    assert scanned(b"\x80\x04\xff.") == ("m: not a readable checkpoint metadata file (at position 2, opcode "
                                      "b'\\xff' unknown)")


# ----------------------------------------------------------------------------- the metadata's contents


def checked(step: Path, edit) -> str | None:
    """check_metadata's refusal of `step`'s metadata after `edit` (None: accepted)."""
    metadata = metadata_of(step)
    edit(metadata)
    try:
        check_metadata(metadata, step, Path("m"))
    except ValueError as e:
        return str(e)
    return None


def storage(key: str, offset: tuple[int, ...] | None = (0, 0)):
    return MetadataIndex(key, None if offset is None else torch.Size(offset))


def drop_field(name: str, of=lambda m: m):
    def edit(metadata):
        obj = of(metadata)
        delattr(obj, name)
    return edit


def test_the_files_checked_are_the_storage_files_as_found(step):
    found = os.stat(step / STORAGE)
    assert check_metadata(metadata_of(step), step, Path("m")) == {
        STORAGE: CheckedFile((STORAGE,), found.st_dev, found.st_ino, found.st_size)}


def test_a_storage_file_linked_from_inside_is_checked_as_its_target(step):
    (step / "sub").mkdir()
    os.replace(step / STORAGE, step / "sub" / "real")
    (step / STORAGE).symlink_to("sub/real")
    found = os.stat(step / "sub" / "real")
    files = check_storage(metadata_of(step).storage_data, step, Path("m"))
    assert files == {STORAGE: CheckedFile(("sub", "real"), found.st_dev, found.st_ino, found.st_size)}
    assert same(load(step), saved())


def set_attr(name: str, value, of=lambda m: m):
    def edit(metadata):
        setattr(of(metadata), name, value)
    return edit


def the(key: str):
    return lambda m: m.state_dict_metadata[key]


def info_of(key: str, offset: tuple[int, ...] | None = (0, 0)):
    return lambda m: m.storage_data[storage(key, offset)]


@pytest.mark.parametrize("edit, says", [
    (set_attr("state_dict_metadata", [1]), "its state_dict_metadata is a list, not a dict"),
    (set_attr("storage_data", ()), "its storage_data is a tuple, not a dict"),
    (set_attr("storage_meta", 3), "its storage_meta is a int"),
    (lambda m: m.state_dict_metadata.update({5: BytesStorageMetadata()}), "a key is a int, not a str"),
    (lambda m: m.state_dict_metadata.update({"x": {}}), "'x' is a dict"),
    (lambda m: m.state_dict_metadata.update({"x": BytesStorageMetadata()}), "'x' is stored nowhere"),
    (lambda m: m.storage_data.pop(storage("model.w")), "'model.w' at offset (0, 0) is stored nowhere"),
    (drop_field("chunks", the("model.w")), "'model.w' is a TensorStorageMetadata without its chunks"),
], ids=["sdm-list", "storage-tuple", "storage-meta-int", "int-key", "dict-value",
        "bytes-nowhere", "chunk-nowhere", "no-chunks"])
def test_a_metadata_not_of_dcps_shape_is_refused(step, edit, says):
    assert checked(step, edit) == f"m: not a valid checkpoint: {says}"


def test_a_metadata_missing_a_field_or_of_another_class_is_refused(step):
    metadata = metadata_of(step)
    del metadata.state_dict_metadata  # a field without a default: the class has none either
    assert refusal(lambda: check_metadata(metadata, step, Path("m"))) == (
        "m: not a checkpoint metadata file (it holds a Metadata without its state_dict_metadata)")
    assert refusal(lambda: check_metadata(dataclasses.replace(metadata_of(step).storage_meta), step, Path("m"))) == (
        "m: not a checkpoint metadata file (it holds a StorageMeta)")
    assert checked(step, set_attr("storage_meta", None)) is None


@pytest.mark.parametrize("edit, says", [
    (lambda m: m.storage_data.update({("model.w",): m.storage_data.pop(storage("model.w"))}),
     "its storage_data holds a tuple"),
    (lambda m: m.storage_data.update({storage("model.w"): (STORAGE, 0, 1)}), "its storage_data holds a tuple"),
    (lambda m: m.storage_data.update({MetadataIndex(3): m.storage_data[storage("model.w")]}),
     "its storage_data holds a key for a int"),
    (drop_field("length", info_of("model.w")), "its storage_data holds a _StorageInfo without its length"),
    (set_attr("relative_path", 3, info_of("model.w")),
     "refused: it names a int where a file name (a str) belongs (the storage of 'model.w')"),
    (set_attr("relative_path", "nothing", info_of("model.w")),
     "'model.w' is stored in 'nothing', which is not a file there"),
    (set_attr("relative_path", ".", info_of("model.w")),
     "refused: it names '.', which leads to {step}, not a file inside {step} (the storage of 'model.w')"),
    (set_attr("offset", "0", info_of("model.w")), "'model.w' is stored at an offset or length that is not an int"),
    (set_attr("length", 1.0, info_of("model.w")), "'model.w' is stored at an offset or length that is not an int"),
    (set_attr("offset", -1, info_of("model.w")), "'model.w' is stored at bytes -1+{length} of '__0_0.distcp', "
                                                 "which has {size}"),
    (set_attr("length", -1, info_of("model.w")), "'model.w' is stored at bytes {offset}+-1 of '__0_0.distcp', "
                                                 "which has {size}"),
    (set_attr("transform_descriptors", ["zstd"], info_of("model.w")),
     "'model.w' is stored transformed, which rankmix never writes"),
], ids=["index-tuple", "info-tuple", "fqn-int", "info-partial", "path-int", "path-missing", "path-folder",
        "offset-str", "length-float", "offset-negative", "length-negative", "transformed"])
def test_a_storage_entry_dcp_would_misread_is_refused(step, edit, says):
    info = metadata_of(step).storage_data[storage("model.w")]
    says = says.format(step=step, length=info.length, offset=info.offset, size=os.stat(step / STORAGE).st_size)
    message = checked(step, edit)
    assert message in (f"m: not a valid checkpoint: {says}", f"m: {says}"), message


def test_a_storage_file_that_is_a_folder_or_fifo_is_refused(step):
    info = metadata_of(step).storage_data[storage("model.w")]
    for name, make in (("sub", os.mkdir), ("fifo", os.mkfifo)):
        make(step / name)
        info.relative_path = name
        assert refusal(lambda: check_storage({storage("model.w"): info}, step, Path("m"))) == (
            f"m: not a valid checkpoint: 'model.w' is stored in {name!r}, which is not a file there")


def test_an_entry_ending_at_its_files_end_is_accepted_and_one_byte_past_it_refused(step):
    size = os.stat(step / STORAGE).st_size
    info = metadata_of(step).storage_data[storage("model.w")]
    for offset, length in ((size - 1, 1), (size, 0), (0, size), (size - info.length, info.length)):
        assert check_storage({storage("model.w"): dataclasses.replace(info, offset=offset, length=length)},
                             step, Path("m")) == check_metadata(metadata_of(step), step, Path("m"))
    for offset, length in ((size - info.length + 1, info.length), (size, 1), (0, size + 1), (size + 1, 0)):
        assert refusal(lambda offset=offset, length=length: check_storage(
            {storage("model.w"): dataclasses.replace(info, offset=offset, length=length)}, step, Path("m"))) == (
            f"m: not a valid checkpoint: 'model.w' is stored at bytes {offset}+{length} of '__0_0.distcp', "
            f"which has {size}")


def test_no_transform_descriptors_or_an_empty_list_is_accepted(step):
    info = metadata_of(step).storage_data[storage("model.w")]
    for none in (None, []):
        assert check_storage({storage("model.w"): dataclasses.replace(info, transform_descriptors=none)}, step,
                             Path("m")).keys() == {STORAGE}


def test_a_metadata_with_transform_descriptors_is_refused_by_the_load(step):
    def edit(metadata):
        metadata.storage_data[storage("model.b", (0,))].transform_descriptors = ["zstd"]
    file = rewrite(step, edit)
    assert refusal(lambda: read_metadata(step)) == (f"{file}: not a valid checkpoint: 'model.b' is stored "
                                                    "transformed, which rankmix never writes")
    # given the metadata, it checks it all the same
    assert refusal(lambda: SafeReader(step, metadata_of(step))) == (
        f"{file}: not a valid checkpoint: 'model.b' is stored transformed, which rankmix never writes")


# ----------------------------------------------------------------------------- tensors


def tensor(size: tuple[int, ...], *chunks: tuple[tuple[int, ...], tuple[int, ...]], dtype=torch.float32,
           ) -> TensorStorageMetadata:
    chunks = chunks or ((tuple(0 for _ in size), size),)
    return TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])


def tensor_refusal(meta) -> str | None:
    try:
        check_tensor("t", meta, Path("m"))
    except ValueError as e:
        return str(e).removeprefix("m: not a valid checkpoint: tensor 't' ")
    return None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool])
def test_every_dtype_a_model_or_optimizer_holds_is_accepted(dtype):
    assert tensor_refusal(tensor((2,), dtype=dtype)) is None


def test_a_tensor_at_each_limit_is_accepted_and_one_past_it_refused():
    assert tensor_refusal(tensor((1,) * MAX_DIMS)) is None
    assert tensor_refusal(tensor((1,) * (MAX_DIMS + 1))) == "has size torch.Size([1, 1, 1, 1, 1, 1, 1, 1, 1])"
    assert tensor_refusal(tensor((MAX_ELEMENTS - 1,))) is None
    assert tensor_refusal(tensor((2 ** 20, 2 ** 20))) == ("has 1099511627776 elements: 2^40 or more, beyond any "
                                                          "table rankmix trains")
    assert tensor_refusal(tensor((0, 4))) is None
    assert tensor_refusal(tensor((-1, 4))) == "has size torch.Size([-1, 4])"
    assert tensor_refusal(tensor(())) is None


@pytest.mark.parametrize("meta, says", [
    (dataclasses.replace(tensor((2,)), properties=None), "has properties that are a NoneType"),
    (dataclasses.replace(tensor((2,)), size=(2,)), "has size a tuple"),
    (tensor((2,), dtype=torch.complex64), "has dtype torch.complex64, not one a rankmix checkpoint holds"),
    (tensor((2,), dtype="float32"), "has dtype a str, not one a rankmix checkpoint holds"),
    (dataclasses.replace(tensor((2,)), chunks=tuple(tensor((2,)).chunks)), "has chunks in a tuple, not a list"),
    (dataclasses.replace(tensor((2,)), chunks=[None]), "has a chunk that is not a 1-dimensional ChunkStorageMetadata"),
    (tensor((2, 2), ((0,), (2,))), "has a chunk that is not a 2-dimensional ChunkStorageMetadata"),
    (dataclasses.replace(tensor((2,)), chunks=[ChunkStorageMetadata(torch.Size([0]), (2,))]),
     "has a chunk that is not a 1-dimensional ChunkStorageMetadata"),
    (dataclasses.replace(tensor((2,)), chunks=[ChunkStorageMetadata((0,), torch.Size([2]))]),
     "has a chunk that is not a 1-dimensional ChunkStorageMetadata"),
    (tensor((4, 2), ((0, 0), (2, 2)), ((2, 0), (3, 2))), "of size (4, 2) has a chunk at (2, 0) of size (3, 2), "
                                                         "outside it"),
    (tensor((4, 2), ((0, 0), (4, 2)), ((0, -1), (4, 1))), "of size (4, 2) has a chunk at (0, -1) of size (4, 1), "
                                                          "outside it"),
    (tensor((4, 2), ((0, 0), (4, 2)), ((1, 0), (-1, 2))), "of size (4, 2) has a chunk at (1, 0) of size (-1, 2), "
                                                          "outside it"),
], ids=["properties", "size-tuple", "complex", "dtype-str", "chunks-tuple", "chunk-none", "chunk-dims",
        "sizes-tuple", "offsets-tuple", "past-end", "negative-offset", "negative-size"])
def test_a_tensor_a_load_cannot_allocate_or_fill_is_refused(meta, says):
    assert tensor_refusal(meta) == says


def test_chunks_ending_at_the_tensors_end_and_empty_chunks_are_accepted():
    assert tensor_refusal(tensor((4, 2), ((0, 0), (2, 2)), ((2, 0), (2, 2)), ((4, 0), (0, 2)))) is None
    assert tensor_refusal(tensor((4, 2), ((0, 0), (4, 2)), ((1, 1), (0, 0)))) is None


def grid(*cuts: tuple[tuple[int, int], tuple[int, int]]) -> list[ChunkStorageMetadata]:
    return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in cuts]


@pytest.mark.parametrize("chunks, says", [
    ((((0, 0), (2, 4)), ((2, 0), (3, 4))), None),
    ((((0, 0), (3, 2)), ((0, 2), (3, 2)), ((3, 0), (2, 4))), None),
    ((((0, 0), (3, 4)),), "leave a gap"),
    ((((0, 0), (3, 4)), ((3, 0), (1, 4))), "leave a gap"),
    ((((0, 0), (5, 4)), ((2, 0), (3, 4))), "overlap"),
    ((((0, 0), (3, 2)), ((2, 2), (3, 2)), ((0, 2), (2, 2)), ((3, 0), (2, 3))), "overlap"),
    ((((0, 0), (3, 4)), ((2, 0), (2, 4))), "overlap"),
    ((((0, 0), (5, 2)), ((0, 1), (5, 2)), ((0, 3), (5, 1))), "overlap"),
    ((((0, 0), (5, 3)), ((0, 2), (5, 1)), ((0, 3), (5, 1))), "overlap"),
], ids=["rows", "grid", "gap", "gap-2", "overlap", "overlap-2d", "overlap-and-gap", "overlap-columns",
        "overlap-last-columns"])
def test_chunks_tile_a_tensor_exactly_or_are_refused(chunks, says):
    assert tiling_error(torch.Size([5, 4]), grid(*chunks)) == says


def test_a_grid_of_exactly_max_cells_is_tiled_and_one_cell_more_refused():
    """k diagonal 1x1 chunks of a (k, k) tensor: k*k cells, k covered."""
    def diagonal(k: int, extra: int = 0) -> str | None:
        return tiling_error(torch.Size([k, k + extra]), grid(*(((i, i), (1, 1)) for i in range(k))))
    side = int(MAX_CELLS ** 0.5)
    assert side * side == MAX_CELLS
    assert diagonal(side) == "leave a gap"
    assert diagonal(side - 1, 2) == "leave a gap"  # (side - 1) * (side + 1) cells: one fewer
    assert diagonal(side, 1) == f"cut it into more than {MAX_CELLS} pieces"  # side more


def test_a_metadata_whose_chunks_do_not_tile_is_refused_by_the_load(step):
    def edit(metadata):
        meta = metadata.state_dict_metadata["model.w"]
        info = metadata.storage_data.pop(storage("model.w"))
        meta.chunks = grid(((0, 0), (3, 4)))
        metadata.storage_data[storage("model.w")] = info
    file = rewrite(step, edit)
    assert refusal(lambda: read_metadata(step)) == (f"{file}: not a valid checkpoint: tensor 'model.w' of size "
                                                    "(5, 4): its chunks leave a gap")


# ----------------------------------------------------------------------------- paths and opening


@pytest.mark.parametrize("name, why", [
    ("", "it names '', which is not a file inside {folder}"),
    ("a\0b", "it names 'a\\x00b', which is not a file inside {folder}"),
    ("/etc/passwd", "it names '/etc/passwd', which is not a file inside {folder}"),
    ("\\etc\\passwd", "it names '\\\\etc\\\\passwd', which is not a file inside {folder}"),
    ("../x", "it names '../x', which is not a file inside {folder}"),
    ("a/../b", "it names 'a/../b', which is not a file inside {folder}"),
    ("..\\x", "it names '..\\\\x', which is not a file inside {folder}"),
    (".", "it names '.', which leads to {folder}, not a file inside {folder}"),
    ("out", "it names 'out', which leads to {outside}, not a file inside {folder}"),
    (b"a", "it names a bytes where a file name (a str) belongs"),
], ids=["empty", "nul", "absolute", "backslash-absolute", "parent", "parent-inside", "backslash-parent", "dot",
        "link-out", "bytes"])
def test_a_name_leading_outside_its_folder_is_refused(tmp_path, name, why):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "out").symlink_to(tmp_path)
    assert refusal(lambda: inside(folder, name, Path("src")), UnsafeFileError) == (
        f"src: refused: {why.format(folder=folder, outside=tmp_path)}")


def test_a_name_inside_its_folder_is_that_path(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "f").write_text("")
    (tmp_path / "l").symlink_to("sub/f")
    assert inside(tmp_path, "./sub/f", Path("src")) == tmp_path / "sub" / "f"
    assert inside(tmp_path, "l", Path("src")) == tmp_path / "l"
    assert inside(tmp_path, "not-yet", Path("src")) == tmp_path / "not-yet"
    assert safe_load._resolve(tmp_path, "l", Path("src")) == (tmp_path / "l", ("sub", "f"))


def test_a_file_below_its_folder_is_opened_through_its_folders(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"data")
    with os.fdopen(open_inside(tmp_path, ("a", "b", "f"), "w"), "rb") as f:
        assert f.read() == b"data"
    with pytest.raises(FileNotFoundError):
        open_inside(tmp_path, ("a", "g"), "w")


@pytest.mark.parametrize("link", [("a",), ("a", "f")], ids=["folder", "file"])
def test_a_link_in_the_place_of_a_file_or_folder_is_refused_not_followed(tmp_path, link):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_bytes(b"outside")
    (tmp_path / "in" / "a").mkdir(parents=True)
    (tmp_path / "in" / "a" / "f").write_bytes(b"inside")
    target = tmp_path / "in" / Path(*link)
    (tmp_path / "real" / "f" if len(link) == 2 else tmp_path / "real").rename(tmp_path / "moved")
    if target.is_dir():
        os.rename(target, tmp_path / "old")
    else:
        target.unlink()
    target.symlink_to(tmp_path / "moved")
    assert refusal(lambda: open_inside(tmp_path / "in", ("a", "f"), "what"), UnsafeFileError) == (
        "what refused: a link took its place, or a folder's on its way, after it was checked; nothing was read "
        "through it")


def test_a_fifo_in_the_place_of_a_file_or_folder_opens_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "file")
    os.mkfifo(tmp_path / "folder")
    result: list = []

    def opening():
        try:
            os.close(open_inside(tmp_path, ("file",), "w"))
            result.append(refusal(lambda: open_inside(tmp_path, ("folder", "f"), "w"), UnsafeFileError))
        except BaseException as e:
            result.append(e)
    thread = threading.Thread(target=opening, daemon=True)
    thread.start()
    thread.join(5)
    if thread.is_alive():  # let the open that waits go on
        for name in ("file", "folder"):
            os.close(os.open(tmp_path / name, os.O_WRONLY | os.O_NONBLOCK))
    assert result == ["w refused: a link took its place, or a folder's on its way, after it was checked; nothing "
                      "was read through it"]


def test_a_storage_file_is_opened_only_while_it_is_the_one_checked(tmp_path):
    (tmp_path / "f").write_bytes(b"data")
    found = os.stat(tmp_path / "f")
    with open_checked(tmp_path, "f", CheckedFile(("f",), found.st_dev, found.st_ino, 4)) as f:
        assert f.read() == b"data"
    for other in (CheckedFile(("f",), found.st_dev, found.st_ino + 1, 4),
                  CheckedFile(("f",), found.st_dev + 1, found.st_ino, 4)):
        assert refusal(lambda other=other: open_checked(tmp_path, "f", other), UnsafeFileError) == (
            "storage file 'f' refused: another file took its place after it was checked; nothing was read from it")
    os.replace(tmp_path / "f", tmp_path / "g")
    (tmp_path / "f").symlink_to("g")
    assert refusal(lambda: open_checked(tmp_path, "f", CheckedFile(("f",), found.st_dev, found.st_ino, 4)),
                   UnsafeFileError) == ("storage file 'f' refused: a link took its place, or a folder's on its way, "
                                        "after it was checked; nothing was read through it")


def test_the_first_line_of_an_error():
    assert first_line(ValueError("  one\ntwo  ")) == "one"
    assert first_line(KeyError()) == "KeyError" and first_line(OSError("  \n ")) == "OSError"
