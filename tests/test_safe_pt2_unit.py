"""trainer/serving/safe_pt2.py in-process, on archives crafted here from one export made once
per process (`exported`: cached, so that each of the mutation target's children reuses it):
each allow-list at its limit (the last accepted entry, name, size or field and one past it) and
each refusal's exact message, checked by `check_pt2` on bytes, with no torch load. Fast: the
mutation target "safe_pt2" runs these (test_trust_pt2.py plants payloads and scores the loads)."""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import pickletools
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from param_ids import plain_ids
from test_trust_pt2 import served, small_features
from trainer.checkpoint.safe_load import MAX_DIMS, MAX_ELEMENTS, UnsafeFileError
from trainer.serving import safe_pt2
from trainer.serving.export import artifact_files
from trainer.serving.safe_pt2 import MAX_PT2_JSON_BYTES, check_graph, check_pt2, load_pt2, op_name, weights_only_loads

PATH = Path("crafted.pt2")
TOP = "archive"
PROGRAM, WEIGHTS = "models/model.json", "data/weights/model_weights_config.json"
CONSTANTS, SAMPLE = "data/constants/model_constants_config.json", "data/sample_inputs/model.pt"
FQN = "ebc.embedding_bags.user.weight"  # weight_0: [20, 8] float32, 640 bytes


@functools.cache
def exported() -> tuple[tuple[str, bytes], ...]:
    """The entries (name below the top folder, bytes) of a small RankMixer's pt2 export, in order."""
    cfg, model = served("rankmixer", small_features())
    files, _ = artifact_files(cfg, model, "pt2", "fp32")
    with zipfile.ZipFile(io.BytesIO(files["model.pt2"])) as archive:
        return tuple((info.filename.partition("/")[2], archive.read(info)) for info in archive.infolist())


def entries() -> list[list]:
    return [[name, data] for name, data in exported()]


def zipped(items: list, top: str = TOP, info: Callable[[zipfile.ZipInfo], None] = lambda i: None) -> bytes:
    """A stored zip of `items` ([name, bytes] or [ZipInfo, bytes]) under folder `top`."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in items:
            entry = name if isinstance(name, zipfile.ZipInfo) else zipfile.ZipInfo(f"{top}/{name}" if top else name)
            info(entry)
            archive.writestr(entry, data)
    return buffer.getvalue()


def with_json(name: str, change: Callable[[dict], object], items: list | None = None) -> list:
    """`items` (the export's entries) with JSON entry `name` as `change` left it."""
    items = entries() if items is None else items
    for item in items:
        if item[0] == name:
            doc = json.loads(item[1])
            change(doc)
            item[1] = json.dumps(doc).encode()
    return items


def program(change: Callable[[dict], object]) -> list:
    return with_json(PROGRAM, change)


def check(items: list | bytes) -> None:
    check_pt2(io.BytesIO(items if isinstance(items, bytes) else zipped(items)), PATH)


def refused(items: list | bytes) -> str:
    with pytest.raises(UnsafeFileError) as error:
        check(items)
    return str(error.value)


def invalid(items: list | bytes) -> str:
    """The message of the ValueError (not UnsafeFileError) that `check` raises."""
    with pytest.raises(ValueError) as error:
        check(items)
    assert type(error.value) is ValueError
    return str(error.value)


def refusal(what: str) -> str:
    return (f"{PATH}: refused: {what}, which no rankmix export holds (loading it could run code or touch files); see "
            "README, Trust")


def torch_error(data: bytes, record: str | None = None) -> str:
    """The first line of what torch's own zip reader raises on `data`: opening it, or reading
    `record` from it (the independent reference of the messages that quote torch)."""
    with pytest.raises(RuntimeError) as error:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        if record is not None:
            reader.get_record(record)
    return str(error.value).strip().splitlines()[0]


def header(data: bytes, name: str, central: bool = False) -> int:
    """Where entry `name`'s local header (or `central` directory header) starts in zip `data`."""
    signature, size = (b"PK\x01\x02", 46) if central else (b"PK\x03\x04", 30)
    start = data.rindex(name.encode()) - size if central else data.index(name.encode()) - size
    assert data[start:start + 4] == signature
    return start


def test_the_export_passes_the_checks():
    check(entries())


def test_the_export_passes_and_loads_as_exported(tmp_path):
    (tmp_path / "model.pt2").write_bytes(zipped(entries()))
    loaded = load_pt2(tmp_path / "model.pt2")
    assert {n.target for n in loaded.graph.nodes if n.op == "call_function"} and \
        set(dict(loaded.named_parameters())) >= {FQN}
    assert torch.equal(loaded.state_dict[FQN], torch.frombuffer(bytearray(dict(exported())["data/weights/weight_0"]),
                                                                dtype=torch.float32).reshape(20, 8))


# ---------------------------------------------------------------------------- the file and its entries


def test_the_model_file_is_a_regular_file_of_its_own(tmp_path):
    (tmp_path / "model.pt2").write_bytes(zipped(entries()))
    (tmp_path / "link.pt2").symlink_to("model.pt2")
    os.mkfifo(tmp_path / "fifo.pt2")
    for name, message in [("link.pt2", "refused: it is a symbolic link; the model file of an export is a file of its "
                                       "own"),
                          ("none.pt2", "cannot be read (No such file or directory)"),
                          ("fifo.pt2", "not a regular file"), ("", "not a regular file")]:
        with pytest.raises(ValueError) as error:
            load_pt2(tmp_path / name)
        assert str(error.value) == f"{tmp_path / name}: {message}"


def test_a_link_put_there_after_the_check_is_not_followed(tmp_path, monkeypatch):
    """O_NOFOLLOW: a link that replaced the file between the link check and the open."""
    (tmp_path / "model.pt2").write_bytes(zipped(entries()))
    (tmp_path / "link.pt2").symlink_to("model.pt2")
    monkeypatch.setattr(os.path, "islink", lambda path: False)
    with pytest.raises(ValueError) as error:
        load_pt2(tmp_path / "link.pt2")
    assert str(error.value) == f"{tmp_path / 'link.pt2'}: cannot be read (Too many levels of symbolic links)"


def test_a_file_that_is_no_zip_is_no_pt2_archive():
    assert invalid(b"PK\x03\x04 not a zip") == f"{PATH}: not a pt2 archive (File is not a zip file)"


@pytest.mark.parametrize("name", ["data/weights/weight_0", "data/weights/weight_999999999",
                                  "data/constants/tensor_123456789", "data/constants/tensor_0"])
def test_raw_tensor_entries_of_up_to_nine_digits_are_accepted(name):
    items = entries()
    check(items if name in dict(exported()) else [*items, [name, b""]])


@pytest.mark.parametrize("name", ["data/weights/weight_1000000000", "data/weights/weight_01", "data/weights/weight_",
                                  "data/weights/weight_0x", "data/constants/weight_0", "data/weights/tensor_0",
                                  "data/weights/weight_-1", "xdata/weights/weight_0", "data/constants/tensor_00",
                                  "data/weights/Weight_0", "models/model.JSON", "models/other.json",
                                  "data/constants/opaque_obj_0", "extra/x.json", "data/weights/model.pt", ""])
def test_any_other_entry_is_refused(name):
    assert refused([*entries(), [name, b""]]) == refusal(f"an entry '{TOP}/{name}'")


def test_an_entry_twice_in_any_case_is_refused():
    assert refused([*entries(), ["data/weights/weight_0", b""]]) == refusal(
        f"'{TOP}/data/weights/weight_0' twice (also as '{TOP}/data/weights/weight_0')")
    items = entries()
    assert refused([*items, [zipfile.ZipInfo("ARCHIVE/byteorder"), b"little"]]) == refusal(
        f"'ARCHIVE/byteorder' twice (also as '{TOP}/byteorder')")


def test_a_stored_entry_whose_sizes_differ_is_refused():
    """Stored, yet its compressed size is not its size (in both headers): no reader knows which."""
    data = bytearray(zipped(entries()))
    for start, field in ((header(data, f"{TOP}/data/weights/weight_3"), 18),
                         (header(data, f"{TOP}/data/weights/weight_3", central=True), 20)):
        size, = struct.unpack_from("<I", data, start + field)
        struct.pack_into("<I", data, start + field, size - 4)
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        info = archive.getinfo(f"{TOP}/data/weights/weight_3")
        assert info.compress_type == zipfile.ZIP_STORED and info.compress_size == info.file_size - 4
    assert refused(bytes(data)) == refusal(f"a compressed entry '{TOP}/data/weights/weight_3'")


def test_a_link_or_a_compressed_entry_is_refused():
    def link(info: zipfile.ZipInfo) -> None:
        if info.filename.endswith("weight_3"):
            info.external_attr = 0o120777 << 16

    def deflated(info: zipfile.ZipInfo) -> None:
        if info.filename.endswith("weight_3"):
            info.compress_type = zipfile.ZIP_DEFLATED
    assert refused(zipped(entries(), info=link)) == refusal(f"a symbolic link '{TOP}/data/weights/weight_3'")
    assert refused(zipped(entries(), info=deflated)) == refusal(f"a compressed entry '{TOP}/data/weights/weight_3'")
    check(zipped(entries(), info=lambda i: setattr(i, "external_attr", 0o100644 << 16)))


@pytest.mark.parametrize("top", ["a", "a.b-c_D9", "_", "x" * 128, "9"])
def test_one_top_folder_of_a_plain_name_is_accepted(top):
    check(zipped(entries(), top=top))


@pytest.mark.parametrize("top", ["x" * 129, ".a", "-a", "a b"])
def test_a_top_folder_of_another_name_is_refused(top):
    assert refused(zipped(entries(), top=top)) == refusal(f"entries under {[top]!r}, not one folder")


def test_entries_under_two_folders_are_refused():
    items = [[zipfile.ZipInfo(f"{TOP}/{n}" if n != "byteorder" else "other/byteorder"), d] for n, d in entries()]
    assert refused(zipped(items)) == refusal(f"entries under {['archive', 'other']!r}, not one folder")


def test_entries_under_four_folders_name_three():
    tops = {"archive_format": "a", "archive_version": "b", "byteorder": "c"}
    items = [[zipfile.ZipInfo(f"{tops.get(n, TOP)}/{n}"), d] for n, d in entries()]
    assert refused(zipped(items)) == refusal(f"entries under {['a', 'archive', 'b']!r}, not one folder")


def test_entries_that_torchs_zip_reader_lists_otherwise_are_refused():
    """Two zips of one layout, one after the other: Python's zip reader reads the last (it
    offsets the central directory by what precedes it), torch's the directory at the offset
    recorded, the first zip's, where four weights have names of the same length."""
    renamed = {f"data/weights/weight_{i}": f"data/weights/weight_{c}" for i, c in zip(range(1, 5), "WXYZ")}
    data = zipped([[renamed.get(n, n), d] for n, d in entries()]) + zipped(entries())
    assert sorted(torch._C.PyTorchFileReader(io.BytesIO(data)).get_all_records()) == \
        sorted(renamed.get(n, n) for n, _ in entries())
    assert refused(data) == refusal("entries that torch's zip reader sees otherwise (['data/weights/weight_1', "
                                    "'data/weights/weight_2', 'data/weights/weight_3'])")


def test_an_archive_torch_cannot_open_is_invalid():
    """Python's zip reader finds the archive after a prefix of junk, torch's does not."""
    data = bytes(1000) + zipped(entries())
    assert len(torch_error(data)) > 200
    assert invalid(data) == f"{PATH}: not an archive torch can read ({torch_error(data)[:200]})"


def test_an_entry_torch_cannot_read_is_invalid():
    """The program's local header is broken: its central directory entry, which both zip readers
    list, is intact."""
    data = bytearray(zipped(entries()))
    data[header(data, f"{TOP}/{PROGRAM}") + 3] = 5
    message = torch_error(bytes(data), PROGRAM)
    assert len(message) > 200
    assert invalid(bytes(data)) == f"{PATH}: not a readable pt2 archive ({PROGRAM}: {message[:200]})"


@pytest.mark.parametrize("missing", ["archive_format", "byteorder", ".data/version", SAMPLE, CONSTANTS])
def test_an_archive_without_an_entry_of_an_export_is_no_pt2_archive(missing):
    assert invalid([i for i in entries() if i[0] != missing]) == \
        f"{PATH}: not a pt2 archive of torch >= 2.8 (no {TOP}/{missing})"


def test_the_first_missing_entry_is_named():
    gone = {"archive_format", "models/model.json", "byteorder"}
    assert invalid([i for i in entries() if i[0] not in gone]) == \
        f"{PATH}: not a pt2 archive of torch >= 2.8 (no {TOP}/archive_format)"


@pytest.mark.parametrize("name, text, fits", [
    ("archive_format", b"pt2", True), ("archive_format", b"pt3", False), ("archive_format", b"pt2\n", False),
    ("archive_version", b"0", True), ("archive_version", b"1", False), ("byteorder", b"big", False),
    (".data/version", b"1", True), (".data/version", b"1\n", True), (".data/version", b"1\n\n", False),
    (".data/serialization_id", b"1" * 64, True), (".data/serialization_id", b"1" * 65, False),
    (".data/serialization_id", b"", False), (".data/serialization_id", b"12a", False),
], ids=plain_ids(20))
def test_the_format_entries_hold_what_torch_writes(name, text, fits):
    items = [[n, text if n == name else d] for n, d in entries()]
    if fits:
        check(items)
    else:
        assert invalid(items) == f"{PATH}: not a pt2 archive of torch >= 2.8: its {name} holds {text[:40]!r}"


def test_an_entry_of_64_mib_is_read_and_one_byte_more_is_refused():
    items = entries()
    index = next(i for i, (name, _) in enumerate(items) if name == "archive_format")
    items[index][1] = b"p" * MAX_PT2_JSON_BYTES
    assert MAX_PT2_JSON_BYTES == 64 << 20
    assert invalid(items) == f"{PATH}: not a pt2 archive of torch >= 2.8: its archive_format holds {b'p' * 40!r}"
    items[index][1] = b"p" * (MAX_PT2_JSON_BYTES + 1)
    assert refused(items) == refusal("a archive_format larger than 64 MiB")


# ---------------------------------------------------------------------------- the program


@pytest.mark.parametrize("data, error", [(b"{", "Expecting property name enclosed in double quotes: line 1 column 2 "
                                                "(char 1)"),
                                         (b"[" * 100_000, "maximum recursion depth exceeded while decoding a JSON "
                                                          "array from a unicode string")])
def test_a_program_that_is_no_json_is_invalid(data, error):
    items = [[n, data if n == PROGRAM else d] for n, d in entries()]
    assert invalid(items) == f"{PATH}: not a valid pt2 archive: {PROGRAM} is not JSON ({error})"


@pytest.mark.parametrize("change", [
    lambda doc: doc.update(extra=1), lambda doc: doc.pop("verifiers"), lambda doc: doc["graph_module"].update(x=1),
    lambda doc: doc["graph_module"].pop("metadata"),
], ids=["extra", "missing", "module-extra", "module-missing"])
def test_a_program_of_other_parts_is_refused(change):
    assert refused(program(change)) == refusal("a program with other parts than a rankmix export's")
    assert refused([[n, b"[]" if n == PROGRAM else d] for n, d in entries()]) == \
        refusal("a program with other parts than a rankmix export's")


@pytest.mark.parametrize("change", [
    lambda doc: doc["graph_module"].update(metadata={"x": "1"}),
    lambda doc: doc["graph_module"].update(treespec_namedtuple_fields={"x": {"field_names": ["a"]}}),
    lambda doc: doc["graph_module"]["graph"].update(custom_obj_values={"x": {"name": "c", "class_fqn": "os.X"}}),
], ids=["metadata", "named-tuples", "custom-objects"])
def test_a_program_with_custom_objects_or_named_tuples_is_refused(change):
    assert refused(program(change)) == refusal("a program with custom objects or named tuples")


def test_a_malformed_program_is_invalid():
    def drop(doc: dict) -> None:
        del doc["graph_module"]["graph"]["nodes"]
    assert invalid(program(drop)) == (f"{PATH}: not a valid pt2 archive: malformed program or payload config "
                                      "(KeyError: 'nodes')")
    assert invalid(program(lambda doc: doc.update(guards_code=5))) == (
        f"{PATH}: not a valid pt2 archive: malformed program or payload config (TypeError: 'int' object is not "
        "iterable)")
    assert invalid(program(lambda doc: doc["graph_module"].update(module_call_graph=[[]]))) == (
        f"{PATH}: not a valid pt2 archive: malformed program or payload config (TypeError: list indices must be "
        "integers or slices, not str)")
    assert invalid(program(lambda doc: doc["graph_module"]["graph"]["nodes"][0].update(metadata=None))) == (
        f"{PATH}: not a valid pt2 archive: malformed program or payload config (TypeError: 'NoneType' object is not "
        "iterable)")
    assert invalid(program(lambda doc: doc["graph_module"]["signature"]["input_specs"][0].update(
        parameter={"arg": {"name": "missing"}, "parameter_name": "p"}))) == (
        f"{PATH}: not a valid pt2 archive: malformed program or payload config (KeyError: 'missing')")
    assert invalid(with_json(WEIGHTS, lambda doc: doc.update(config=[]))) == (
        f"{PATH}: not a valid pt2 archive: malformed program or payload config (AttributeError: 'list' object has no "
        "attribute 'items')")
    assert invalid(program(lambda doc: doc["graph_module"]["signature"].update(input_specs=[{"parameter": {}}]))) == (
        f"{PATH}: not a valid pt2 archive: malformed program or payload config (KeyError: 'parameter_name')")
    long = "x" * 300
    assert invalid(program(lambda doc: doc["graph_module"]["signature"]["input_specs"][0].update(
        parameter={"arg": {"name": long}, "parameter_name": "p"}))) == (
        f"{PATH}: not a valid pt2 archive: malformed program or payload config (KeyError: {repr(long)[:200]})")



def nodes(doc: dict) -> list[dict]:
    return doc["graph_module"]["graph"]["nodes"]


def test_a_graph_node_of_other_fields_or_ops_is_refused():
    assert refused(program(lambda doc: nodes(doc).insert(1, 5))) == refusal("a graph node with fields 5")
    assert refused(program(lambda doc: nodes(doc)[3].update(x=1))) == refusal(
        f"a graph node with fields {sorted([*nodes(json.loads(dict(exported())[PROGRAM]))[3], 'x'])[:8]}")
    fields = [*nodes(json.loads(dict(exported())[PROGRAM]))[3], "x", "y", "z"]
    assert len(fields) > 8  # the message names the first 8
    assert refused(program(lambda doc: nodes(doc)[3].update(x=1, y=1, z=1))) == refusal(
        f"a graph node with fields {sorted(fields)[:8]}")
    assert refused(program(lambda doc: nodes(doc)[3]["metadata"].update(source_fn_stack="x"))) == refusal(
        f"a graph node with fields {sorted(nodes(json.loads(dict(exported())[PROGRAM]))[3])[:8]}")
    for field in ("stack_trace", "nn_module_stack", "torch_fn"):  # each field of a node's metadata may be left out
        check(program(lambda doc, field=field: [node["metadata"].pop(field, None) for node in nodes(doc)]))
    check(program(lambda doc: [(node.pop("is_hop_single_tensor_return"), node.pop("name")) for node in nodes(doc)]))


def test_the_first_op_outside_the_allow_list_is_named():
    def plant(doc: dict) -> None:
        nodes(doc)[2]["target"] = "torch.ops.aten.from_file.default"
        nodes(doc)[5]["target"] = "builtins.exec"
    assert refused(program(plant)) == refusal("a graph that calls torch.ops.aten.from_file.default")
    long = "x" * 300
    assert refused(program(lambda doc: nodes(doc)[4].update(target=long))) == refusal(
        f"a graph that calls {long[:200]}")


def test_a_target_anywhere_in_the_program_is_an_op_of_the_allow_list():
    """A graph nested in an argument (a higher-order op's) is checked too."""
    def plant(doc: dict) -> None:
        nodes(doc)[3]["inputs"].append({"name": "x", "kind": 1, "arg": {"as_int": 1, "nested": [
            {"target": "torch.ops.higher_order.cond"}]}})
    assert refused(program(plant)) == refusal("a graph that calls torch.ops.higher_order.cond")
    long = "x" * 300
    assert refused(program(lambda doc: nodes(doc)[3]["inputs"].append({"name": "x", "kind": 1, "arg": {
        "as_int": 1, "nested": [{"target": long}]}}))) == refusal(f"a graph that calls {long[:200]}")
    check(program(lambda doc: doc["graph_module"]["graph"]["sym_int_values"].update(x={"as_int": 1, "y": [
        {"target": "torch.ops.aten.add.Tensor"}]})))


@pytest.mark.parametrize("kind", ["as_graph", "as_operator", "as_custom_obj", "as_strings", "as_sym_float", "as_"])
def test_an_argument_of_another_kind_is_refused(kind):
    assert refused(program(lambda doc: nodes(doc)[3]["inputs"].append({"name": "x", "kind": 1, "arg": {
        "as_int": 1, kind: "torch.save"}}))) == refusal(f"a graph argument of kind {kind}")


def test_arguments_of_the_allowed_kinds_are_accepted():
    arguments = {k: None for k in safe_pt2._PT2_ARGUMENTS if k not in ("as_expr", "as_tensor", "as_tensors")}
    check(program(lambda doc: doc["graph_module"]["graph"]["sym_int_values"].update(planted=arguments)))


def symbol(doc: dict) -> dict:
    """The first shape expression of `doc`'s graph that is one symbol with a hint."""
    stack = [doc]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            if str(item.get("expr_str", "")).startswith("Symbol(") and item.get("hint"):
                return item
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)
    raise AssertionError("no symbol")


def test_a_shape_expression_beyond_a_linear_form_is_refused():
    code = "Pow(10, 100000000000)" + " " * 100
    assert refused(program(lambda doc: symbol(doc).update(expr_str=code))) == refusal(
        f"a shape expression {code[:100]!r} (sympy evaluates it; rankmix's are sums of int64 integers and multiples "
        "of symbols, or comparisons of them)")
    assert refused(program(lambda doc: symbol(doc).update(expr_str=None))) == refusal(
        "a shape expression 'None' (sympy evaluates it; rankmix's are sums of int64 integers and multiples of symbols, "
        "or comparisons of them)")


@pytest.mark.parametrize("hint, fits", [
    (None, True), ({"as_int": 2 ** 63 - 1}, True), ({"as_int": -2 ** 63}, True), ({"as_bool": True}, True),
    ({"as_float": 1.5}, True), ({"as_int": 2 ** 63}, False), ({"as_int": -2 ** 63 - 1}, False),
    ({"as_int": "1"}, False), ({"as_int": 1, "as_float": 1.0}, False), ({}, False), ([1], False), (1, False),
    ({"as_int": "9" * 150}, False),
], ids=plain_ids(30))
def test_a_shape_expressions_hint_is_an_int64_integer(hint, fits):
    items = program(lambda doc: symbol(doc).update(hint=hint))
    if fits:
        check(items)
    else:
        assert refused(items) == refusal(f"a shape expression's hint {str(hint)[:100]} (not an int64 integer)")


def test_the_shape_expressions_are_spent_from_one_budget(monkeypatch):
    """The same expression twice counts twice (torch parses each time it appears)."""
    doc = json.loads(dict(exported())[PROGRAM])
    budget = safe_pt2.Budget(PATH)
    safe_pt2._check_nodes(doc, budget, PATH)
    assert all(safe_pt2.guard(code, budget) for code in doc["guards_code"])
    spent = budget.limit - budget.left
    assert spent > 100
    monkeypatch.setattr(safe_pt2, "Budget", lambda path: type(budget)(path, terms=spent))
    check(entries())
    monkeypatch.setattr(safe_pt2, "Budget", lambda path: type(budget)(path, terms=spent - 1))
    with pytest.raises(UnsafeFileError) as error:
        check(entries())
    assert str(error.value) == (f"{PATH}: refused to load: its shape expressions and guards hold more than {spent - 1} "
                                "terms, the budget of a load (reading them is sympy's work); see README, Trust")


def test_an_input_guard_beyond_a_sum_of_sizes_is_refused():
    code = "__import__('os').system('true') == 0" + " " * 100
    assert refused(program(lambda doc: doc.update(guards_code=["L['ids'].size()[0] >= 1", code]))) == refusal(
        f"an input guard {code[:100]!r} (guards are compiled into the model's forward; rankmix's compare sums of input "
        "sizes and int64 integers)")
    check(program(lambda doc: doc.update(guards_code=["L['ids'].size()[0] >= 1", "L['numeric'].size()[0] > 0"])))


@pytest.mark.parametrize("name, bounds, fits", [
    ("s0", {"min_val": 0, "max_val": None}, True), ("u12", {"min_val": None, "max_val": 2 ** 63 - 1}, True),
    ("s0", {"min_val": -2 ** 63, "max_val": 5}, True),
    ("s0", {"min_val": 0, "max_val": 2 ** 63}, False), ("s0", {"min_val": -2 ** 63 - 1, "max_val": 1}, False),
    ("s0", {"min_val": 0.5, "max_val": 1}, False), ("s0", {"min_val": 0, "max_val": True}, False),
    ("s0", {"min_val": 0}, False), ("s0", {"min_val": 0, "max_val": 1, "x": 1}, False), ("s0", [0, 1], False),
    ("S0", {"min_val": 0, "max_val": 1}, False), ("s0 ", {"min_val": 0, "max_val": 1}, False),
    ("x" * 150, {"min_val": 0, "max_val": 1}, False), ("s0", {"min_val": 0, "max_val": "9" * 150}, False),
], ids=plain_ids(30))
def test_a_shape_symbols_range_is_of_int64_integers(name, bounds, fits):
    items = program(lambda doc: doc["range_constraints"].update({name: bounds}))
    if fits:
        check(items)
    else:
        assert refused(items) == refusal(f"a shape symbol {name[:100]!r} with range {str(bounds)[:100]}")


@pytest.mark.parametrize("fqn, fits", [("", True), ("a", True), ("a.b_c.D9", True), ("x" * 128, True),
                                       (".".join(["a"] * 32), True), ("x" * 129, False), (".".join(["a"] * 33), False),
                                       ("a..b", False), (".a", False), ("a-b", False), ("os:system", False),
                                       ("a\n", False)], ids=plain_ids(20))
def test_a_module_name_is_a_dotted_path_of_plain_names(fqn, fits):
    items = program(lambda doc: doc["graph_module"]["module_call_graph"][1].update(fqn=fqn))
    if fits:
        check(items)
    else:
        assert refused(items) == refusal(f"a module name {str(fqn)[:100]!r}")


def signature(doc: dict) -> dict:
    return doc["graph_module"]["module_call_graph"][0]["signature"]


LEAF = {"type": None, "context": None, "children_spec": []}


@pytest.mark.parametrize("spec", [
    [1, LEAF], [1, {"type": "builtins.list", "context": "null", "children_spec": [LEAF, LEAF]}],
    [1, {"type": "builtins.dict", "context": '["a", "b"]', "children_spec": [LEAF, LEAF]}],
    [1, {"type": "builtins.dict", "context": "[]", "children_spec": []}],
    [1, {"type": "builtins.tuple", "context": "null", "children_spec": [
        {"type": "builtins.tuple", "context": "null", "children_spec": [LEAF]}]}],
], ids=["leaf", "list", "dict", "empty-dict", "nested"])
def test_a_tree_spec_of_tuples_lists_dicts_and_leaves_is_accepted(spec):
    check(program(lambda doc: signature(doc).update(out_spec=json.dumps(spec))))


@pytest.mark.parametrize("spec, node", [
    ([2, LEAF], LEAF), ([0, LEAF], LEAF), (["1", LEAF], LEAF),
    ([1, {**LEAF, "type": "collections.OrderedDict"}], {**LEAF, "type": "collections.OrderedDict"}),
    ([1, {**LEAF, "type": "builtins.set"}], {**LEAF, "type": "builtins.set"}),
    ([1, {**LEAF, "context": "null"}], {**LEAF, "context": "null"}),
    ([1, {"type": "builtins.tuple", "context": "[]", "children_spec": []}],
     {"type": "builtins.tuple", "context": "[]", "children_spec": []}),
    ([1, {"type": "builtins.list", "context": '"x"', "children_spec": []}],
     {"type": "builtins.list", "context": '"x"', "children_spec": []}),
    ([1, {"type": "builtins.dict", "context": '["a", 1]', "children_spec": []}],
     {"type": "builtins.dict", "context": '["a", 1]', "children_spec": []}),
    ([1, {"type": "builtins.dict", "context": '{"__enum__": true}', "children_spec": []}],
     {"type": "builtins.dict", "context": '{"__enum__": true}', "children_spec": []}),
    ([1, {"type": "builtins.dict", "context": "null", "children_spec": []}],
     {"type": "builtins.dict", "context": "null", "children_spec": []}),
    ([1, {**LEAF, "x": 1}], {**LEAF, "x": 1}), ([1, {"type": None, "context": None}], {"type": None, "context": None}),
    ([1, {"type": "builtins.list", "context": "null", "children_spec": [LEAF, {**LEAF, "type": "os.X"}]}],
     {**LEAF, "type": "os.X"}),
    ([1, [LEAF]], [LEAF]), ([1, {**LEAF, "type": "x" * 150}], {**LEAF, "type": "x" * 150}),
], ids=plain_ids(30))
def test_a_tree_spec_of_anything_else_is_refused(spec, node):
    """Protocol 1 only: torch reads another protocol's spec otherwise."""
    assert refused(program(lambda doc: signature(doc).update(in_spec=json.dumps(spec)))) == refusal(
        f"an input or output structure {str(node)[:100]}")


@pytest.mark.parametrize("spec", [[1], [1, LEAF, 2], {"1": LEAF}, 1, ["x" * 150]])
def test_a_tree_spec_of_another_shape_is_refused(spec):
    assert refused(program(lambda doc: signature(doc).update(out_spec=json.dumps(spec)))) == refusal(
        f"an input or output structure {str(spec)[:100]}")


def test_a_tree_spec_that_is_no_json_is_invalid():
    assert invalid(program(lambda doc: signature(doc).update(out_spec="[1,"))) == (
        f"{PATH}: not a valid pt2 archive: a tree spec is not JSON (Expecting value: line 1 column 4 (char 3))")
    assert invalid(program(lambda doc: signature(doc).update(out_spec=json.dumps(
        [1, {"type": "builtins.list", "context": "nul", "children_spec": []}])))) == (
        f"{PATH}: not a valid pt2 archive: a tree spec's context is not JSON (Expecting value: line 1 column 1 "
        "(char 0))")


def specs(doc: dict, which: str = "input_specs") -> list:
    return doc["graph_module"]["signature"][which]


def test_the_inputs_and_outputs_are_of_an_exports_kinds():
    spec = {"custom_obj": {"arg": {"name": "x"}, "custom_obj_name": "c"}}
    assert refused(program(lambda doc: specs(doc).append(spec))) == refusal("an input of kind 'custom_obj'")
    both = {"parameter": specs(json.loads(dict(exported())[PROGRAM]))[0]["parameter"], "buffer": {}}
    assert refused(program(lambda doc: specs(doc).append(both))) == refusal(f"an input {str(both)[:100]}")
    assert refused(program(lambda doc: specs(doc).append([]))) == refusal("an input []")
    assert refused(program(lambda doc: specs(doc).append({}))) == refusal("an input {}")
    assert refused(program(lambda doc: specs(doc).append({"x" * 60: {}}))) == refusal(f"an input of kind {'x' * 50!r}")
    out = {"buffer_mutation": {"arg": {"name": "x"}, "buffer_name": "b"}}
    assert refused(program(lambda doc: specs(doc, "output_specs").append(out))) == refusal(
        "an output of kind 'buffer_mutation'")
    assert refused(program(lambda doc: specs(doc, "output_specs").append(["user_output"]))) == refusal(
        "an output ['user_output']")
    two = {"user_output": {}, "loss_output": {}}
    assert refused(program(lambda doc: specs(doc, "output_specs").append(two))) == refusal(f"an output {two}")
    long = {"user_output": {}, "x" * 150: {}}
    assert refused(program(lambda doc: specs(doc, "output_specs").append(long))) == refusal(
        f"an output {str(long)[:100]}")
    assert refused(program(lambda doc: specs(doc, "output_specs").append({"x" * 60: {}}))) == refusal(
        f"an output of kind {'x' * 50!r}")
    check(program(lambda doc: specs(doc).append({"user_input": {"arg": {"as_tensor": {"name": "ids"}}}})))


@pytest.mark.parametrize("name, fits", [("a.b", True), ("x" * 128, True), ("x" * 129, False), ("a/b", False),
                                        ("../w", False)])
def test_a_tensor_is_named_by_a_dotted_path(name, fits):
    def rename(doc: dict) -> None:
        specs(doc)[0]["parameter"]["parameter_name"] = name
    items = program(rename)
    if fits:  # named so in the graph only, the weights config's entry is not its tensor
        assert refused(items) == refusal(f"a {WEIGHTS} entry {FQN!r} that is not a tensor of its graph, as the graph "
                                         "declares it")
    else:
        assert refused(items) == refusal(f"a tensor named {name[:100]!r}")


# ---------------------------------------------------------------------------- the payloads


def weights(change: Callable[[dict], object], name: str = WEIGHTS, items: list | None = None) -> list:
    return with_json(name, change, items)


@pytest.mark.parametrize("change, what", [
    (lambda doc: doc.update(x=1), "a {name} with fields ['config', 'x']"),
    (lambda doc: doc.clear(), "a {name} with fields []"),
    (lambda doc: doc.update(a=1, b=1, c=1, d=1, e=1), "a {name} with fields ['a', 'b', 'c', 'config', 'd']"),
    (lambda doc: doc["config"][FQN].update(use_pickle=True), "a pickled {where} (use_pickle True)"),
    (lambda doc: doc["config"][FQN].update(use_pickle=0), "a pickled {where} (use_pickle 0)"),
    (lambda doc: doc["config"][FQN].update(use_pickle="x" * 30), "a pickled {where} (use_pickle 'xxxxxxxxxxxxxxxxxxx)"),
    (lambda doc: doc["config"][FQN].pop("use_pickle"), "a {where} with fields ['is_param', 'path_name', "
                                                       "'tensor_meta']"),
    (lambda doc: doc["config"].update({FQN: [1]}), "a {where} with fields [1]"),
    (lambda doc: doc["config"].update({FQN: [2, 1]}), "a {where} with fields [2, 1]"),
    (lambda doc: doc["config"][FQN].update(a=1, b=1, c=1),
     "a {where} with fields ['a', 'b', 'c', 'is_param', 'path_name', 'tensor_meta']"),
    (lambda doc: doc["config"].update({"x" * 150: doc["config"][FQN]}),
     "a {name} entry '" + "x" * 100 + "' that is not a tensor of its graph, as the graph declares it"),
    (lambda doc: doc["config"][FQN].update(path_name="opaque_obj_0"),
     "a {where} stored in 'opaque_obj_0', not as raw tensor bytes"),
    (lambda doc: doc["config"][FQN].update(path_name="tensor_0"),
     "a {where} stored in 'tensor_0', not as raw tensor bytes"),
    (lambda doc: doc["config"][FQN].update(path_name=0), "a {where} stored in '0', not as raw tensor bytes"),
    (lambda doc: doc["config"][FQN].update(path_name="x" * 150),
     "a {where} stored in '" + "x" * 100 + "', not as raw tensor bytes"),
    (lambda doc: doc["config"][FQN].update(is_param=1), "a {where} that is not a tensor of its graph, as the graph "
                                                        "declares it"),
    (lambda doc: doc["config"].update(other=doc["config"][FQN]), "a {name} entry 'other' that is not a tensor of its "
                                                                 "graph, as the graph declares it"),
    (lambda doc: doc["config"][FQN]["tensor_meta"].update(requires_grad=True),
     "a {where} that is not a tensor of its graph, as the graph declares it"),
], ids=lambda v: "" if callable(v) else plain_ids(30, tail=True)(v))
def test_a_payload_config_holds_plain_tensors_of_the_graph(change, what):
    assert refused(weights(change)) == refusal(what.format(name=WEIGHTS, where=f"{WEIGHTS} entry {FQN!r}"))


@pytest.mark.parametrize("name", [WEIGHTS, CONSTANTS])
def test_a_payload_config_that_is_no_object_or_no_json_is_refused(name):
    assert refused([[n, b"[]" if n == name else d] for n, d in entries()]) == refusal(f"a {name} with fields list")
    assert invalid([[n, b"{" if n == name else d] for n, d in entries()]) == (
        f"{PATH}: not a valid pt2 archive: {name} is not JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))")


def test_a_payload_stored_in_a_file_the_archive_lacks_is_invalid():
    items = weights(lambda doc: doc["config"][FQN].update(path_name="weight_99"))
    assert invalid(items) == (f"{PATH}: not a valid pt2 archive: {WEIGHTS} entry {FQN!r} is stored in weight_99, which "
                              "it lacks")
    check(weights(lambda doc: doc["config"][FQN].update(path_name="weight_99"), items=[*entries(), [
        "data/weights/weight_99", dict(exported())["data/weights/weight_0"]]]))


def test_a_constant_is_checked_in_its_own_folder():
    fqn = next(iter(json.loads(dict(exported())[CONSTANTS])["config"]))
    assert refused(weights(lambda doc: doc["config"][fqn].update(path_name="weight_0"), CONSTANTS)) == refusal(
        f"a {CONSTANTS} entry {fqn!r} stored in 'weight_0', not as raw tensor bytes")
    assert refused(weights(lambda doc: doc["config"][fqn].update(use_pickle=True), CONSTANTS)) == refusal(
        f"a pickled {CONSTANTS} entry {fqn!r} (use_pickle True)")


def declared(change: Callable[[dict], object], size: int | None = None) -> list:
    """The export with weight_0's tensor metadata, in the graph and the weights config alike, as
    `change` left it, and its file of `size` bytes (640 as exported)."""
    def in_graph(doc: dict) -> None:
        name = specs(doc)[0]["parameter"]["arg"]["name"]
        change(doc["graph_module"]["graph"]["tensor_values"][name])
    items = weights(lambda doc: change(doc["config"][FQN]["tensor_meta"]), items=program(in_graph))
    if size is not None:
        items = [[n, d if n != "data/weights/weight_0" else bytes(size)] for n, d in items]
    return items


def extent_error(need: int, itemsize: int, holds: int) -> str:
    return (f"{PATH}: not a valid pt2 archive: {WEIGHTS} entry {FQN!r} (in weight_0) needs {need} bytes of "
            f"{itemsize}, its file holds {holds}")


def test_a_tensor_needs_every_element_of_its_file():
    """One element short of [20, 8] float32 is refused: the last element ends at (offset +
    sum((n - 1) * stride) + 1) elements."""
    check(declared(lambda meta: None, 640))
    check(declared(lambda meta: None, 644))
    assert invalid(declared(lambda meta: None, 636)) == extent_error(640, 4, 636)
    assert invalid(declared(lambda meta: None, 642)) == extent_error(640, 4, 642)
    assert invalid(declared(lambda meta: meta.update(storage_offset={"as_int": 1}), 640)) == extent_error(644, 4, 640)
    check(declared(lambda meta: meta.update(storage_offset={"as_int": 1}), 644))
    strided = {"strides": [{"as_int": 16}, {"as_int": 2}]}
    assert invalid(declared(lambda meta: meta.update(strided), 640)) == extent_error((19 * 16 + 7 * 2 + 1) * 4, 4, 640)
    check(declared(lambda meta: meta.update(strided), (19 * 16 + 7 * 2 + 1) * 4))
    check(declared(lambda meta: meta.update(dtype=6), 320))  # float16: 2 bytes an element
    assert invalid(declared(lambda meta: meta.update(dtype=5), 640)) == extent_error(1280, 8, 640)


def test_an_empty_tensor_needs_no_bytes():
    check(declared(lambda meta: meta.update(sizes=[{"as_int": 0}, {"as_int": 8}], storage_offset={"as_int": 9}), 0))
    check(declared(lambda meta: meta.update(sizes=[{"as_int": 20}, {"as_int": 0}]), 0))
    assert invalid(declared(lambda meta: meta.update(sizes=[{"as_int": 1}, {"as_int": 1}]), 0)) == \
        extent_error(4, 4, 0)
    check(declared(lambda meta: meta.update(sizes=[], strides=[]), 4))
    assert invalid(declared(lambda meta: meta.update(sizes=[], strides=[], storage_offset={"as_int": 1}), 4)) == \
        extent_error(8, 4, 4)


def test_a_tensor_has_at_most_its_dimensions_and_elements():
    ones = [{"as_int": 1}]
    check(declared(lambda meta: meta.update(sizes=ones * MAX_DIMS, strides=ones * MAX_DIMS), 4))
    items = declared(lambda meta: meta.update(sizes=ones * (MAX_DIMS + 1), strides=ones * (MAX_DIMS + 1)), 4)
    assert invalid(items) == (f"{PATH}: not a valid pt2 archive: {WEIGHTS} entry {FQN!r} (in weight_0) has sizes "
                              f"{[1] * (MAX_DIMS + 1)} and strides {[1] * (MAX_DIMS + 1)}")
    items = declared(lambda meta: meta.update(sizes=ones, strides=ones * 2), 4)
    assert invalid(items) == (f"{PATH}: not a valid pt2 archive: {WEIGHTS} entry {FQN!r} (in weight_0) has sizes "
                              "[1] and strides [1, 1]")
    most = [{"as_int": MAX_ELEMENTS - 1}, {"as_int": 1}]
    with pytest.raises(UnsafeFileError) as error:  # its extent fits: the host's memory is what refuses it
        check(declared(lambda meta: meta.update(sizes=most, strides=[{"as_int": 0}, {"as_int": 0}]), 4))
    assert str(error.value).startswith(f"{PATH}: refused to load: tensor p_ebc_embedding_bags_user_weight would take "
                                       f"{(MAX_ELEMENTS - 1) * 4 / 2 ** 30:.1f} GiB")
    past = [{"as_int": MAX_ELEMENTS}, {"as_int": 1}]
    assert invalid(declared(lambda meta: meta.update(sizes=past, strides=[{"as_int": 0}, {"as_int": 0}]), 4)) == (
        f"{PATH}: not a valid pt2 archive: {WEIGHTS} entry {FQN!r} (in weight_0) has sizes [{MAX_ELEMENTS}, 1] and "
        "strides [0, 0]")


@pytest.mark.parametrize("change", [
    lambda meta: meta.update(dtype=9), lambda meta: meta.update(dtype=0), lambda meta: meta.update(layout=1),
    lambda meta: meta.update(device={"type": "cuda", "index": 0}), lambda meta: meta.update(device={"type": "cpu"}),
    lambda meta: meta.update(requires_grad=1), lambda meta: meta.update(x=1), lambda meta: meta.pop("layout"),
], ids=["complex", "dtype-0", "sparse", "cuda", "device-without-index", "requires-grad-int", "extra", "no-layout"])
def test_a_tensor_is_a_plain_cpu_tensor(change):
    meta = json.loads(dict(exported())[WEIGHTS])["config"][FQN]["tensor_meta"]
    change(meta)
    assert refused(declared(change)) == refusal(f"a {WEIGHTS} entry {FQN!r} (in weight_0) that is not a plain CPU "
                                                f"tensor ({str(meta)[:200]})")


def test_every_plain_dtype_is_accepted():
    for number, dtype in safe_pt2._PT2_DTYPES.items():
        check(declared(lambda meta, number=number: meta.update(dtype=number), 160 * dtype.itemsize))


@pytest.mark.parametrize("size", [{"as_int": -1}, {"as_int": True}, {"as_int": 1.0}, {"as_int": 1, "x": 1}, 1,
                                  {"as_expr": "s0"}, {"as_int": "9" * 60}], ids=plain_ids(200))
def test_a_size_is_a_natural_number(size):
    assert invalid(declared(lambda meta: meta["sizes"].__setitem__(0, size), 640)) == (
        f"{PATH}: not a valid pt2 archive: {WEIGHTS} entry {FQN!r} (in weight_0) has a size {str(size)[:50]}, not a "
        "natural number")
    assert invalid(declared(lambda meta: meta.update(storage_offset=size), 640)) == (
        f"{PATH}: not a valid pt2 archive: {WEIGHTS} entry {FQN!r} (in weight_0) has a size {str(size)[:50]}, not a "
        "natural number")


def test_a_weight_of_zero_strides_is_read_from_its_first_element():
    zero = [{"as_int": 0}, {"as_int": 0}]
    check(declared(lambda meta: meta.update(strides=zero), 4))
    assert invalid(declared(lambda meta: meta.update(strides=zero), 0)) == extent_error(4, 4, 0)


# ---------------------------------------------------------------------------- the sample inputs


def sample_entries() -> list[list]:
    with zipfile.ZipFile(io.BytesIO(dict(exported())[SAMPLE])) as archive:
        return [[info.filename, archive.read(info)] for info in archive.infolist()]


def with_sample(data: bytes) -> list:
    return [[n, data if n == SAMPLE else d] for n, d in entries()]


def sample(pickled: bytes | None = None, extra: list | None = None, info=lambda i: None) -> list:
    """The export with sample inputs whose data.pkl is `pickled` (the export's if None)."""
    items = [[n, pickled if pickled is not None and n.endswith("/data.pkl") else d] for n, d in sample_entries()]
    return with_sample(zipped([*items, *(extra or [])], top="", info=info))


def sample_refused(op: str) -> str:
    return refusal(f"sample inputs whose pickle holds {op}")


def test_the_sample_inputs_as_saved_pass():
    check(sample())


def test_a_pickled_object_in_the_sample_inputs_is_refused():
    buffer = io.BytesIO()
    torch.save({"a": 1.5}, buffer)
    assert refused(with_sample(buffer.getvalue())) == sample_refused("BINFLOAT 1.5 at byte 13")
    buffer = io.BytesIO()
    torch.save([print], buffer)
    assert refused(with_sample(buffer.getvalue())) == sample_refused("GLOBAL __builtin__ print at byte 5")


@pytest.mark.parametrize("pickled, op", [
    (b"\x80\x02)q\x00h\x01.", "BINGET 1 at byte 5"),  # a memo entry read as it is being made
    (b"\x80\x02)q\x00h\x00q\x01h\x02.", "BINGET 2 at byte 9"),
    (b"\x80\x02)q\x01.", "BINPUT 1 at byte 3"), (b"\x80\x02)q\x00q\x00.", "BINPUT 0 at byte 5"),
    (b"\x80\x02)r\x01\x00\x00\x00.", "LONG_BINPUT 1 at byte 3"), (b"\x80\x02)q\x00j\x01\x00\x00\x00.",
                                                                  "LONG_BINGET 1 at byte 5"),
    (b"\x80\x02)h\x00.", "BINGET 0 at byte 3"), (b"\x80\x02)p0\n.", "PUT 0 at byte 3"),
    (b"\x80\x04\x95\x02\x00\x00\x00\x00\x00\x00\x00).", "FRAME 2 at byte 2"),
    (b"\x80\x02c" + b"x" * 200 + b"\ny\n.", f"GLOBAL {'x' * 100} at byte 2"),
], ids=["get-as-made", "get-next", "put-ahead", "put-again", "long-put", "long-get", "get-none", "text-put", "frame",
        "global"])
def test_the_sample_pickles_memo_is_made_in_order_and_read_once_made(pickled, op):
    assert refused(sample(pickled)) == sample_refused(op)


def test_a_memo_made_in_order_and_read_once_made_passes():
    check(sample(b"\x80\x02)q\x00)r\x01\x00\x00\x00h\x00j\x01\x00\x00\x00h\x01t."))


def test_a_truncated_sample_pickle_is_invalid():
    assert invalid(sample(b"\x80\x02)q")) == (f"{PATH}: not a valid pt2 archive: unreadable sample inputs (not enough "
                                              "data in stream to read uint1)")


@pytest.mark.parametrize("extra, info, names", [
    ([["archive/data/03", b""]], None, "archive/data/03"), ([["archive/x.py", b""]], None, "archive/x.py"),
    ([["archive/DATA.PKL", b""]], None, None), ([["other/version", b""]], None, "other/version"),
    ([], "link", None), ([], "deflate", None)])
def test_the_sample_inputs_hold_the_entries_of_torch_save_only(extra, info, names):
    def flag(entry: zipfile.ZipInfo) -> None:
        if entry.filename.endswith("/version") and info == "link":
            entry.external_attr = 0o120777 << 16
        if entry.filename.endswith("/version") and info == "deflate":
            entry.compress_type = zipfile.ZIP_DEFLATED
    listed = [n.partition("/")[2] for n, _ in sample_entries()] + [n.partition("/")[2] for n, _ in extra]
    assert refused(sample(extra=extra, info=flag)) == refusal(f"sample inputs with entries {sorted(listed)[:8]}")


def test_the_sample_inputs_may_hold_many_tensors():
    check(sample(extra=[["archive/data/999999999", b""]]))
    listed = sorted([n.partition("/")[2] for n, _ in sample_entries()] + ["data/1000000000"])
    assert refused(sample(extra=[["archive/data/1000000000", b""]])) == refusal(
        f"sample inputs with entries {listed[:8]}")


def test_sample_inputs_under_two_folders_or_with_an_entry_twice_are_refused():
    """Each condition alone: the entries' names are torch.save's, each in the allow-list."""
    listed = [n.partition("/")[2] for n, _ in sample_entries()]
    assert refused(sample(extra=[["other/data/5", b""]])) == refusal(
        f"sample inputs with entries {sorted([*listed, 'data/5'])[:8]}")
    with pytest.warns(UserWarning, match="Duplicate name: 'archive/version'"):
        items = sample(extra=[["archive/version", b"3"]])
    assert refused(items) == refusal(f"sample inputs with entries {sorted([*listed, 'version'])[:8]}")


def test_sample_inputs_torch_cannot_open_or_read_are_invalid():
    data = bytes(1000) + dict(exported())[SAMPLE]
    assert invalid(with_sample(data)) == f"{PATH}: not an archive torch can read ({torch_error(data)[:200]})"
    data = zipped([i for i in sample_entries() if not i[0].endswith("/data.pkl")], top="")
    assert len(torch_error(data, "data.pkl")) > 200 and "data.pkl" in torch_error(data, "data.pkl")
    assert invalid(with_sample(data)) == (f"{PATH}: not a valid pt2 archive: unreadable sample inputs "
                                          f"({torch_error(data, 'data.pkl')[:200]})")


def test_a_sample_pickle_that_pickletools_cannot_read_is_invalid():
    """A STRING opcode whose text lacks its quotes: pickletools quotes the text in its error."""
    pickled = b"\x80\x02S" + b"x" * 300 + b"\n."
    with pytest.raises(ValueError) as error:
        list(pickletools.genops(pickled))
    assert len(str(error.value)) > 200
    assert invalid(sample(pickled)) == (f"{PATH}: not a valid pt2 archive: unreadable sample inputs "
                                        f"({str(error.value)[:200]})")


def test_sample_inputs_that_are_no_zip_are_invalid():
    assert invalid(with_sample(b"not a zip")) == (f"{PATH}: not a valid pt2 archive: unreadable sample inputs (File is "
                                                  "not a zip file)")


# ---------------------------------------------------------------------------- the loaded graph


@functools.cache
def _small() -> bytes:
    class Small(torch.nn.Module):
        def forward(self, x):
            return torch.sigmoid(x) + 1

    buffer = io.BytesIO()
    torch.export.save(torch.export.export(Small(), (torch.ones(2),)), buffer)
    return buffer.getvalue()


def small() -> torch.export.ExportedProgram:
    """A fresh program of sigmoid and add (each test edits its graph)."""
    return torch.export.load(io.BytesIO(_small()))


def test_a_graph_of_inputs_outputs_and_allowed_ops_passes():
    """Also with submodules that hold no graph, or a `graph` that is no fx graph."""
    program = small()
    check_graph(program, PATH)
    program.graph_module.add_submodule("plain", torch.nn.ReLU())
    odd = torch.nn.Module()
    odd.graph = None
    program.graph_module.add_submodule("odd", odd)
    check_graph(program, PATH)


@pytest.mark.parametrize("op, target", [("get_attr", "planted"), ("call_module", "planted"),
                                        ("call_method", "add")])
def test_a_loaded_graph_node_of_another_kind_is_refused(op, target):
    """A get_attr node reads a module attribute (a submodule, an object) that no export holds."""
    program = small()
    graph = program.graph_module.graph
    with graph.inserting_before(next(iter(graph.nodes))):
        graph.create_node(op, target)
    with pytest.raises(UnsafeFileError) as error:
        check_graph(program, PATH)
    assert str(error.value) == refusal(f"a graph node {op} {target}")


def test_a_loaded_graph_that_calls_another_op_is_refused_in_any_submodule():
    program = small()
    sub = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    x = sub.graph.placeholder("x")
    sub.graph.output(sub.graph.call_function(torch.ops.aten.from_file.default, (x,)))
    program.graph_module.add_submodule("planted", sub)
    with pytest.raises(UnsafeFileError) as error:
        check_graph(program, PATH)
    assert str(error.value) == refusal("a graph that calls torch.ops.aten.from_file.default")


@pytest.mark.parametrize("target, name", [
    (torch.ops.aten.add.Tensor, "torch.ops.aten.add.Tensor"), (__import__("operator").add, "_operator.add"),
    (torch.sym_not, "torch.sym_not"), ("x", "?.x"), (None, "?.None"),
    (__import__("types").SimpleNamespace(__module__="torch._ops.aten.torch._ops", __name__="x"),
     "torch.ops.aten.torch._ops.x")])
def test_an_ops_name_is_torchs_serialized_one(target, name):
    assert op_name(target) == name


@pytest.mark.parametrize("before", [None, "0", "x"])
def test_every_load_inside_is_weights_only_and_the_setting_restored(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", raising=False)
    else:
        monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", before)
    buffer = io.BytesIO()
    torch.save({"x": Path("a")}, buffer)
    with weights_only_loads():
        assert os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] == "1"
        with pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") == before
