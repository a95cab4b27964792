"""Reading a pt2 artifact without running its code (docs/design.md §2.10, README "Trust").

torch.export's loader rebuilds a program from a pt2 archive's JSON (the graph, the payloads'
configs) and raw tensor bytes, yet several parts of an archive are code to it: pickled payloads
(opaque and custom objects, `use_pickle` tensors), graph ops that read and write files
(aten.from_file), shape expressions that sympy evaluates as Python, guards that `.module()`
compiles into the forward, tree specs that import modules, and the entries of older formats.
So `check_pt2` accepts only what rankmix's own exports hold, each part against an allow-list
taken from the exports of every tower and shipped config (tests/test_trust_pt2.py checks that
they stay within it), before torch reads anything; `check_graph` checks the loaded graph again.
Shape expressions, guards and sizes are bounded data besides (trainer/serving/pt2_bounds.py): the
work torch's reader does on them within a budget, and the graph's tensors within the host's memory.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import pickletools
import re
import stat
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from trainer.checkpoint.safe_load import MAX_DIMS, MAX_ELEMENTS, UnsafeFileError, first_line
from trainer.serving.pt2_bounds import (
    SYMBOL,
    Budget,
    Linear,
    Sizes,
    check_allocations,
    expression,
    guard,
    hints,
    host_memory,
    is_int64,
)

# Every op a rankmix export's graph calls, named as torch's serializer names them: every tower,
# tokenizer, pooling, norm, MoE inference, feature kind, table quantization and shipped config.
# None reads or writes a file; a new op in a tower fails tests/test_trust_pt2.py until added here.
PT2_OPS = frozenset({
    "_operator.add", "_operator.eq", "_operator.ge", "_operator.getitem", "_operator.le", "_operator.mul",
    "torch.sym_not",
    *(f"torch.ops.aten.{op}" for op in (
        "__and__.Scalar", "__and__.Tensor", "__or__.Tensor", "__rshift__.Scalar", "__xor__.Tensor",
        "_assert_async.msg", "_assert_scalar.default", "_assert_tensor_metadata.default", "add.Tensor",
        "addcmul.default", "addmm.default", "alias.default", "all.default", "any.default", "arange.default",
        "baddbmm.default", "bitwise_not.default", "bmm.default", "cat.default", "chunk.default", "clamp.default",
        "contiguous.default", "cumsum.default", "detach_.default", "div.Tensor", "embedding_bag.padding_idx",
        "empty.memory_format", "eq.Scalar", "eq.Tensor", "flatten.using_ints", "floor_divide.default",
        "full_like.default", "ge.Scalar", "ge.Tensor", "gelu.default", "gt.Scalar", "index.Tensor",
        "index_add_.default", "index_select.default", "isfinite.default", "isnan.default", "item.default",
        "layer_norm.default", "le.Tensor", "lift_fresh_copy.default", "linear.default", "log1p.default",
        "lt.Scalar", "mean.dim", "minimum.default", "mm.default", "mul.Tensor", "narrow.default",
        "new_zeros.default", "nonzero.default", "pad.default", "permute.default", "relu.default",
        "remainder.Tensor", "repeat_interleave.self_Tensor", "reshape.default", "rms_norm.default",
        "scalar_tensor.default", "scaled_dot_product_attention.default", "searchsorted.Tensor", "select.int",
        "sigmoid.default", "silu.default", "slice.Tensor", "split_with_sizes.default", "squeeze.dim",
        "stack.default", "sub.Tensor", "sum.default", "sum.dim_IntList", "sym_size.int", "to.device", "to.dtype",
        "transpose.int", "unbind.int", "unsqueeze.default", "view.default", "view_as.default",
        "where.ScalarSelf", "where.self", "zeros_like.default",
        # sequence modules (dense/sequence.py) and their padding in the artifact
        "baddbmm_.default", "einsum.default", "embedding.default", "expand_as.default", "lt.Tensor",
        "masked_fill.Scalar", "matmul.default", "ones.default", "relu_.default", "softmax.int", "t.default",
        "unflatten.int", "where.ScalarOther", "zeros.default",
        # the soft search's top k (dense/sequence.py soft_search)
        "expand.default", "gather.default", "sort.default", "topk.default")),
    # TorchRec's quantized tables (--tables fp16|int8|int4)
    *(f"torch.ops.fbgemm.{op}" for op in (
        "asynchronous_complete_cumsum.default", "bounds_check_indices.default",
        "int_nbit_split_embedding_codegen_lookup_function.default", "permute_2D_sparse_data.default")),
})

# The entries of a rankmix export, below the archive's one top folder. Exact names: torch's zip
# reader finds an entry whatever its case, so no other spelling is accepted, nor two entries
# that differ by case only.
_PT2_FILES = frozenset({"archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id",
                        "models/model.json", "data/sample_inputs/model.pt", "data/weights/model_weights_config.json",
                        "data/constants/model_constants_config.json"})
_PT2_PAYLOAD = re.compile(r"(data/weights/weight_|data/constants/tensor_)(0|[1-9][0-9]{0,8})")  # raw tensor bytes
_PT2_TOP = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_PT2_TEXTS = {"archive_format": rb"pt2", "archive_version": rb"0", "byteorder": rb"little",
              ".data/version": rb"[0-9]{1,4}\n?", ".data/serialization_id": rb"[0-9]{1,64}"}
# Per JSON or sample-inputs entry: the criteo_1tb config's whole archive takes 2.3 MiB, an export of 64 sparse
# features 4 MiB. JSON of small values takes up to 20 times its size as Python objects, twice (here and in torch).
MAX_PT2_JSON_BYTES = 64 << 20

# What the program (models/model.json) may hold besides ops: the exports' argument kinds (no
# graphs, operators or custom objects as arguments), node metadata, inputs and outputs. Its shape
# expressions, which sympy evaluates, and its guards are bounded data (trainer/serving/pt2_bounds.py).
_PT2_PROGRAM = frozenset({"graph_module", "guards_code", "opset_version", "range_constraints", "schema_version",
                          "torch_version", "verifiers"})
_PT2_GRAPH_MODULE = frozenset({"graph", "metadata", "module_call_graph", "signature", "treespec_namedtuple_fields"})
_PT2_ARGUMENTS = frozenset({"as_bool", "as_device", "as_expr", "as_float", "as_int", "as_ints", "as_layout", "as_name",
                            "as_none", "as_scalar_type", "as_string", "as_sym_bool", "as_sym_int", "as_sym_ints",
                            "as_tensor", "as_tensors"})
_PT2_NODE = frozenset({"target", "inputs", "outputs", "metadata", "is_hop_single_tensor_return", "name"})
_PT2_NODE_META = frozenset({"stack_trace", "nn_module_stack", "torch_fn"})
_PT2_INPUTS = {"user_input": None, "parameter": "parameter_name", "buffer": "buffer_name",
               "tensor_constant": "tensor_constant_name"}  # an input's kind: the field naming its tensor
_PT2_OUTPUTS = frozenset({"user_output"})
_PT2_FQN = re.compile(r"[A-Za-z0-9_]{1,128}(\.[A-Za-z0-9_]{1,128}){0,31}")
_PT2_TREES = frozenset({None, "builtins.tuple", "builtins.list", "builtins.dict"})

# A payload's config: which file holds its bytes, and the tensor they make (dtype, shape, ...).
_PT2_PAYLOAD_KEYS = frozenset({"path_name", "is_param", "use_pickle", "tensor_meta"})
_PT2_TENSOR_KEYS = frozenset({"dtype", "sizes", "strides", "storage_offset", "requires_grad", "device", "layout"})
_PT2_STRIDED, _PT2_CPU = 7, {"type": "cpu", "index": None}
# torch._export.serde.schema.ScalarType's numbers of the plain dtypes a rankmix tensor may have
_PT2_DTYPES = {1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64, 6: torch.float16,
               7: torch.float32, 8: torch.float64, 12: torch.bool, 13: torch.bfloat16}

# The sample inputs (a torch.save archive) are unpickled, weights-only; their pickle may hold
# only what a tuple of tensors takes (protocol 2, as torch.save writes it).
_PT2_SAMPLE_FILES = frozenset({"data.pkl", ".format_version", ".storage_alignment", "byteorder", "version",
                               ".data/serialization_id", ".data/version"})
_PT2_SAMPLE_DATA = re.compile(r"data/(0|[1-9][0-9]{0,8})")
_PT2_SAMPLE_OPCODES = frozenset({
    "PROTO", "STOP", "MARK", "GLOBAL", "BINPERSID", "REDUCE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "BININT", "BININT1", "BININT2", "LONG1", "NONE", "NEWTRUE", "NEWFALSE", "BINUNICODE", "SHORT_BINUNICODE",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_DICT", "EMPTY_LIST", "APPEND", "APPENDS",
    "SETITEM", "SETITEMS"})
_PT2_SAMPLE_GLOBALS = frozenset({"collections OrderedDict", "torch._utils _rebuild_tensor_v2"} | {
    f"torch {kind}Storage" for kind in ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char",
                                        "Byte", "Bool")})


def _refused(path: Path, what: str) -> UnsafeFileError:
    return UnsafeFileError(f"{path}: refused: {what}, which no rankmix export holds (loading it could run code "
                           "or touch files); see README, Trust")


def load_pt2(path: Path) -> torch.export.ExportedProgram:
    """The ExportedProgram of pt2 archive `path`, on the safe path only: the file (not a link) is
    opened once, checked whole (`check_pt2`), read by torch with weights-only loads, and its
    graph checked again (`check_graph`) before anyone can call `.module()` on it."""
    with _open_plain(path) as f:
        check_pt2(f, path)
        f.seek(0)
        # torch's pt2 reader imports TorchInductor: only a command that loads an artifact needs it
        from torch.export.pt2_archive._package import load_pt2 as read_pt2_archive
        with weights_only_loads():
            try:
                # torch.export.load's own wrapper retries a failed archive as torch 2.7's format
                # (other entries, other rules) and logs a traceback: its pt2 reader alone, then.
                contents = read_pt2_archive(f)
            except pickle.UnpicklingError as e:
                raise UnsafeFileError(f"{path}: refused: a payload is not plain tensors ({first_line(e)})") from None
            except Exception as e:  # the archive passed the checks: whatever torch raises means damaged payloads
                raise ValueError(f"{path}: not a loadable pt2 archive ({type(e).__name__}: "
                                 f"{first_line(e)[:300]})") from None
    if set(contents.exported_programs) != {"model"} or contents.aoti_runners or contents.extra_files:
        raise _refused(path, "programs other than one `model`")
    program = contents.exported_programs["model"]
    check_graph(program, path)
    return program


def _open_plain(path: Path) -> BinaryIO:
    """`path` opened for reading, refused when it is a symbolic link or not a regular file."""
    if os.path.islink(path):
        raise UnsafeFileError(f"{path}: refused: it is a symbolic link; the model file of an export is a file "
                              "of its own")
    try:  # O_NOFOLLOW: a link put there since is refused all the same; O_NONBLOCK: a FIFO does not hang
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # before fdopen, which raises IsADirectoryError on a folder
        os.close(fd)
        raise ValueError(f"{path}: not a regular file")
    return os.fdopen(fd, "rb")


def check_pt2(f: BinaryIO, path: Path) -> None:
    """Refuse pt2 archive `f` (named `path` in messages) unless it holds what rankmix's exports
    hold, and nothing else: the entries `_PT2_FILES` and raw tensor bytes, stored, each once
    whatever its case, none a link, listed alike by Python's and torch's zip readers; tensors
    only in the payload configs (no pickled, custom or opaque objects), each within its file and
    as the graph declares it; a program of `PT2_OPS` whose expressions, guards and tree specs are
    bounded data (`pt2_bounds`); tensors, at the example inputs, that fit in this host's memory;
    sample inputs of tensors only. Nothing in it is unpickled, evaluated or run here."""
    try:
        archive = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise ValueError(f"{path}: not a pt2 archive ({first_line(e)})") from None
    with archive:
        _, sizes = _pt2_entries(archive, path)
    reader = _torch_reader(f, sizes, path)
    files = {name: _record(reader, name, path) for name in _PT2_FILES}
    for name, pattern in _PT2_TEXTS.items():
        if not re.fullmatch(pattern, files[name]):
            raise ValueError(f"{path}: not a pt2 archive of torch >= 2.8: its {name} holds {files[name][:40]!r}")
    try:
        program = _json(files["models/model.json"], "models/model.json", path)
        declared, shapes = _check_program(program, path)
        for name in ("data/weights/model_weights_config.json", "data/constants/model_constants_config.json"):
            _check_payloads(_json(files[name], name, path), name, sizes, declared, path)
        payload_bytes = sum(n for name, n in sizes.items() if _PT2_PAYLOAD.fullmatch(name))
        check_allocations(program["graph_module"]["graph"], shapes, payload_bytes, host_memory(), path)
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a field missing, or of another type
        raise ValueError(f"{path}: not a valid pt2 archive: malformed program or payload config "
                         f"({type(e).__name__}: {first_line(e)[:200]})") from None
    _check_sample_inputs(files["data/sample_inputs/model.pt"], path)


def _pt2_entries(archive: zipfile.ZipFile, path: Path) -> tuple[str, dict[str, int]]:
    """(the archive's top folder, {entry below it: its size}), every entry checked."""
    tops, sizes, seen = set(), {}, {}
    for info in archive.infolist():
        top, _, name = info.filename.partition("/")
        tops.add(top)
        if (info.external_attr >> 16) & 0o170000 == stat.S_IFLNK:
            raise _refused(path, f"a symbolic link {info.filename!r}")
        if name not in _PT2_FILES and not _PT2_PAYLOAD.fullmatch(name):
            raise _refused(path, f"an entry {info.filename!r}")
        if info.filename.casefold() in seen:
            raise _refused(path, f"{info.filename!r} twice (also as {seen[info.filename.casefold()]!r})")
        seen[info.filename.casefold()] = info.filename
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise _refused(path, f"a compressed entry {info.filename!r}")
        sizes[name] = info.file_size
    if len(tops) != 1 or not _PT2_TOP.fullmatch(top):
        raise _refused(path, f"entries under {sorted(tops)[:3]!r}, not one folder")
    missing = sorted(_PT2_FILES - set(sizes))
    if missing:
        raise ValueError(f"{path}: not a pt2 archive of torch >= 2.8 (no {top}/{missing[0]})")
    return top, sizes


def _torch_reader(f: BinaryIO, checked: Iterable[str], path: Path) -> torch._C.PyTorchFileReader:
    """torch's own zip reader of `f` (the one that loads it), which must list the entries checked
    below the same top folder: where two zip readers could read one file two ways, what rankmix
    checks is what torch reads."""
    f.seek(0)
    try:
        reader = torch._C.PyTorchFileReader(f)
        names = reader.get_all_records()
    except RuntimeError as e:
        raise ValueError(f"{path}: not an archive torch can read ({first_line(e)[:200]})") from None
    if sorted(names) != sorted(checked):
        differ = sorted(set(names) ^ set(checked))[:3]
        raise _refused(path, f"entries that torch's zip reader sees otherwise ({differ})")
    return reader


def _record(reader: torch._C.PyTorchFileReader, name: str, path: Path) -> bytes:
    """Entry `name` as torch reads it, within `MAX_PT2_JSON_BYTES`."""
    try:
        if reader.get_record_size(name) > MAX_PT2_JSON_BYTES:
            raise _refused(path, f"a {name} larger than {MAX_PT2_JSON_BYTES >> 20} MiB")
        return reader.get_record(name)
    except RuntimeError as e:
        raise ValueError(f"{path}: not a readable pt2 archive ({name}: {first_line(e)[:200]})") from None


def _json(data: bytes, name: str, path: Path) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not a valid pt2 archive: {name} is not JSON ({first_line(e)[:200]})") from None


def _check_program(doc: dict, path: Path) -> tuple[dict[str, dict], Sizes]:
    """Check the serialized program; return the tensor metadata its graph declares for each
    parameter, buffer and constant, by name, and its sizes at the example inputs."""
    if type(doc) is not dict or set(doc) != _PT2_PROGRAM or set(doc["graph_module"]) != _PT2_GRAPH_MODULE:
        raise _refused(path, "a program with other parts than a rankmix export's")
    module = doc["graph_module"]
    if module["metadata"] or module["treespec_namedtuple_fields"] or module["graph"]["custom_obj_values"]:
        raise _refused(path, "a program with custom objects or named tuples")
    budget = Budget(path)
    forms, expressions = _check_nodes(doc, budget, path)
    for code in doc["guards_code"]:
        if not guard(code, budget):
            raise _refused(path, f"an input guard {str(code)[:100]!r} (guards are compiled into the model's forward; "
                                 "rankmix's compare sums of input sizes and int64 integers)")
    for name, bounds in doc["range_constraints"].items():
        if not SYMBOL.fullmatch(name) or type(bounds) is not dict or set(bounds) != {"min_val", "max_val"} or \
                not all(v is None or is_int64(v) for v in bounds.values()):
            raise _refused(path, f"a shape symbol {name[:100]!r} with range {str(bounds)[:100]}")
    for call in module["module_call_graph"]:
        if not _PT2_FQN.fullmatch(call["fqn"]) and call["fqn"] != "":
            raise _refused(path, f"a module name {str(call['fqn'])[:100]!r}")
        if call["signature"] is not None:
            for spec in (call["signature"]["in_spec"], call["signature"]["out_spec"]):
                _check_tree(spec, path)
    return _declared_tensors(module, path), Sizes(module["graph"], forms, hints(forms, expressions))


def _check_nodes(doc: dict, budget: Budget, path: Path) -> tuple[dict[str, Linear], list[dict]]:
    """Every graph node calls an op of `PT2_OPS` with arguments of `_PT2_ARGUMENTS`; every shape
    expression (which sympy evaluates) is a linear form with an int64 hint (`pt2_bounds.expression`),
    its terms spent from `budget`. Returns {expression: its linear form}, and the expressions'
    fields (expression and hint) in the order found."""
    for node in doc["graph_module"]["graph"]["nodes"]:  # in order, so that the first op refused is named
        if type(node) is not dict or not set(node) <= _PT2_NODE or not set(node["metadata"]) <= _PT2_NODE_META:
            raise _refused(path, f"a graph node with fields {sorted(node)[:8] if type(node) is dict else node!r}")
        if node["target"] not in PT2_OPS:
            raise _refused(path, f"a graph that calls {str(node['target'])[:200]}")
    forms: dict[str, Linear] = {}
    expressions: list[dict] = []
    stack: list[Any] = [doc]
    while stack:
        item = stack.pop()
        if type(item) is list:
            stack.extend(item)
        elif type(item) is dict:
            if "target" in item and item["target"] not in PT2_OPS:
                raise _refused(path, f"a graph that calls {str(item['target'])[:200]}")
            if "expr_str" in item:
                form, hint = expression(item["expr_str"], budget), item.get("hint")
                if form is None:
                    raise _refused(path, f"a shape expression {str(item['expr_str'])[:100]!r} (sympy evaluates it; "
                                         "rankmix's are sums of int64 integers and multiples of symbols, or "
                                         "comparisons of them)")
                if hint is not None and not (type(hint) is dict and len(hint) == 1 and
                                             all(is_int64(v) or type(v) in (bool, float) for v in hint.values())):
                    raise _refused(path, f"a shape expression's hint {str(hint)[:100]} (not an int64 integer)")
                forms[item["expr_str"]] = form
                expressions.append(item)
            unknown = [k for k in item if k.startswith("as_") and k not in _PT2_ARGUMENTS]
            if unknown:
                raise _refused(path, f"a graph argument of kind {unknown[0]}")
            stack.extend(item.values())
    return forms, expressions


def _check_tree(text: Any, path: Path) -> None:
    """A tree spec (the program's input or output structure) of tuples, lists, dicts with str
    keys and leaves: torch rebuilds the types a spec names by importing their modules."""
    spec = _json(text, "a tree spec", path)
    if type(spec) is not list or len(spec) != 2:
        raise _refused(path, f"an input or output structure {str(spec)[:100]}")
    protocol, root = spec
    stack = [root]
    while stack:
        node = stack.pop()
        if protocol != 1 or type(node) is not dict or set(node) != {"type", "context", "children_spec"} or \
                node["type"] not in _PT2_TREES or not _plain_context(node, path):
            raise _refused(path, f"an input or output structure {str(node)[:100]}")
        stack.extend(node["children_spec"])


def _plain_context(node: dict, path: Path) -> bool:
    """A tree node's context is what torch writes for its type: none for a leaf, JSON null for a
    tuple or list, a JSON list of str keys for a dict (so never an object, which torch would
    read as an enum to import)."""
    if node["type"] is None:
        return node["context"] is None
    context = _json(node["context"], "a tree spec's context", path)
    if node["type"] == "builtins.dict":
        return type(context) is list and all(type(key) is str for key in context)
    return context is None


def _declared_tensors(module: dict, path: Path) -> dict[str, dict]:
    """{parameter, buffer or constant name: the tensor metadata the graph declares for it}; the
    signature holds only the input and output kinds of a rankmix export."""
    values, declared = module["graph"]["tensor_values"], {}
    for spec in module["signature"]["input_specs"]:
        if type(spec) is not dict or len(spec) != 1:
            raise _refused(path, f"an input {str(spec)[:100]}")
        (kind, body), = spec.items()
        if kind not in _PT2_INPUTS:
            raise _refused(path, f"an input of kind {kind[:50]!r}")
        if _PT2_INPUTS[kind]:
            name = body[_PT2_INPUTS[kind]]
            if not _PT2_FQN.fullmatch(name):
                raise _refused(path, f"a tensor named {name[:100]!r}")
            declared[name] = values[body["arg"]["name"]]
    for spec in module["signature"]["output_specs"]:
        if type(spec) is not dict or len(spec) != 1:
            raise _refused(path, f"an output {str(spec)[:100]}")
        (kind, _), = spec.items()
        if kind not in _PT2_OUTPUTS:
            raise _refused(path, f"an output of kind {kind[:50]!r}")
    return declared


def _check_payloads(doc: dict, name: str, sizes: dict[str, int], declared: dict[str, dict], path: Path) -> None:
    """Payload config `name` (`doc`): plain tensors only, each the raw bytes of an entry beside
    the config, of the metadata the graph declares for it, and within its entry."""
    folder = name.rsplit("/", 1)[0] + "/"
    if type(doc) is not dict or set(doc) != {"config"}:
        raise _refused(path, f"a {name} with fields {sorted(doc)[:5] if type(doc) is dict else type(doc).__name__}")
    for fqn, entry in doc["config"].items():
        where = f"{name} entry {fqn[:100]!r}"
        if type(entry) is not dict or set(entry) != _PT2_PAYLOAD_KEYS:
            raise _refused(path, f"a {where} with fields {sorted(entry)[:6] if type(entry) is dict else entry!r}")
        if entry["use_pickle"] is not False:
            raise _refused(path, f"a pickled {where} (use_pickle {entry['use_pickle']!r:.20})")
        file = entry["path_name"]
        if type(file) is not str or not _PT2_PAYLOAD.fullmatch(folder + file):
            raise _refused(path, f"a {where} stored in {str(file)[:100]!r}, not as raw tensor bytes")
        if folder + file not in sizes:
            raise ValueError(f"{path}: not a valid pt2 archive: {where} is stored in {file}, which it lacks")
        if fqn not in declared or entry["tensor_meta"] != declared[fqn] or type(entry["is_param"]) is not bool:
            raise _refused(path, f"a {where} that is not a tensor of its graph, as the graph declares it")
        _check_extent(entry["tensor_meta"], sizes[folder + file], f"{where} (in {file})", path)


def _check_extent(meta: dict, nbytes: int, where: str, path: Path) -> None:
    """The tensor `meta` describes is a plain CPU tensor within the `nbytes` of its file."""
    if set(meta) != _PT2_TENSOR_KEYS or meta["dtype"] not in _PT2_DTYPES or meta["layout"] != _PT2_STRIDED or \
            meta["device"] != _PT2_CPU or type(meta["requires_grad"]) is not bool:
        raise _refused(path, f"a {where} that is not a plain CPU tensor ({str(meta)[:200]})")
    shape, strides = ([_as_int(d, where, path) for d in meta[key]] for key in ("sizes", "strides"))
    offset = _as_int(meta["storage_offset"], where, path)
    itemsize = _PT2_DTYPES[meta["dtype"]].itemsize
    if len(shape) != len(strides) or len(shape) > MAX_DIMS or math.prod(shape) >= MAX_ELEMENTS:
        raise ValueError(f"{path}: not a valid pt2 archive: {where} has sizes {shape} and strides {strides}")
    need = 0 if math.prod(shape) == 0 else (offset + sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * itemsize
    if need > nbytes or nbytes % itemsize:
        raise ValueError(f"{path}: not a valid pt2 archive: {where} needs {need} bytes of {itemsize}, its file "
                         f"holds {nbytes}")


def _as_int(value: Any, where: str, path: Path) -> int:
    if type(value) is not dict or set(value) != {"as_int"} or type(value["as_int"]) is not int or value["as_int"] < 0:
        raise ValueError(f"{path}: not a valid pt2 archive: {where} has a size {str(value)[:50]}, not a natural number")
    return value["as_int"]


def _check_sample_inputs(data: bytes, path: Path) -> None:
    """The sample inputs, a torch.save archive within, hold tensors only."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = _sample_entries(archive, path)
        pickled = _torch_reader(io.BytesIO(data), names, path).get_record("data.pkl")
    except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as e:
        raise ValueError(f"{path}: not a valid pt2 archive: unreadable sample inputs ({first_line(e)[:200]})") from None
    _scan_sample_pickle(pickled, path)


def _sample_entries(archive: zipfile.ZipFile, path: Path) -> list[str]:
    """The entries below the sample inputs' top folder: torch.save's, stored, each once, no link."""
    infos = archive.infolist()
    names = [info.filename.partition("/")[2] for info in infos]
    if len({info.filename.partition("/")[0] for info in infos}) != 1 or \
            len({name.casefold() for name in names}) != len(names) or \
            any(info.compress_type != zipfile.ZIP_STORED or (info.external_attr >> 16) & 0o170000 == stat.S_IFLNK
                for info in infos) or \
            not all(name in _PT2_SAMPLE_FILES or _PT2_SAMPLE_DATA.fullmatch(name) for name in names):
        raise _refused(path, f"sample inputs with entries {sorted(names)[:8]}")
    return names


def _scan_sample_pickle(pickled: bytes, path: Path) -> None:
    """Refuse, unread, a sample-inputs pickle with an opcode or global outside the allow-lists,
    or a memo entry made out of order or read before it is made."""
    made = 0
    try:
        for op, arg, pos in pickletools.genops(pickled):
            if op.name not in _PT2_SAMPLE_OPCODES or (op.name == "GLOBAL" and arg not in _PT2_SAMPLE_GLOBALS) or \
                    ("PUT" in op.name and arg != made) or ("GET" in op.name and arg >= made):
                raise _refused(path, f"sample inputs whose pickle holds {op.name} {str(arg)[:100]} at byte {pos}")
            made += "PUT" in op.name
    except UnsafeFileError:
        raise
    except ValueError as e:  # pickletools' verdict on a truncated or unknown opcode
        raise ValueError(f"{path}: not a valid pt2 archive: unreadable sample inputs ({first_line(e)[:200]})") from None


def check_graph(program: torch.export.ExportedProgram, path: Path) -> None:
    """Every node of `program`'s graphs is an input, an output or a call of an op in `PT2_OPS`."""
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if isinstance(graph, torch.fx.Graph) else ():
            if node.op not in ("placeholder", "output", "call_function"):
                raise _refused(path, f"a graph node {node.op} {node.target}")
            if node.op == "call_function" and op_name(node.target) not in PT2_OPS:
                raise _refused(path, f"a graph that calls {op_name(node.target)}")


def op_name(target: Any) -> str:
    """The name torch's serializer gives a node's target (`torch.ops.aten.add.Tensor`, `_operator.add`)."""
    module = str(getattr(target, "__module__", None) or "?").replace("torch._ops", "torch.ops", 1)
    return f"{module}.{getattr(target, '__name__', target)}"


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
