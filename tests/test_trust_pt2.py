"""A pt2 artifact is data, or it is refused (trainer/serving/safe_pt2.py `load_pt2`, README "Trust").

torch.export's loader runs parts of an archive as code: pickled objects, graph ops that read
and write files, shape expressions (evaluated by sympy), input guards (compiled into the
forward) and tree specs (which import modules). Each test crafts such an archive from a real
export, made here in-process once per module, and checks that loading it (`export.load`, what
`rankmix score --model` calls) refuses it in one line naming the file before anything ran: a
payload that ran would leave a marker file. The fuzzing mutates the same export: every case
loads and scores exactly as the export does, or is refused by a ValueError of one line.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import stat
import tempfile
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagCollection

from dense.heads import build_dense
from dense.model_config import TaskSpec
from dense.tower_registry import TOWERS
from embeddings.features import FeatureSpec
from embeddings.tables import table_configs
from trainer.checkpoint.safe_load import UnsafeFileError
from trainer.config_loader import load_config
from trainer.data.datasets import synth_features
from trainer.ranking_model import RankingModel
from trainer.serving.export import artifact_files, load, serving_model, write_artifact
from trainer.serving.safe_pt2 import _PT2_DTYPES, PT2_OPS, check_graph, check_pt2

TOP = "archive"  # the top folder of an export's archive (torch.export.save into a buffer names it so)
WEIGHTS, CONSTANTS = "data/weights/model_weights_config.json", "data/constants/model_constants_config.json"
PROGRAM = "models/model.json"
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def small_features() -> list[FeatureSpec]:
    """An id, a list and two numeric features (with transforms): every input path in brief."""
    return [FeatureSpec(name="user", num_embeddings=20, embedding_dim=8),
            FeatureSpec(name="tags", kind="id_list", num_embeddings=10, embedding_dim=8, pooling="mean", max_len=3),
            FeatureSpec(name="age", kind="numeric", transform=["log1p"], fill_null=0.0),
            FeatureSpec(name="score", kind="numeric", transform=["clip", "standardize"], clip_max=5.0, mean=1.0)]


def served(tower: str, features: list[FeatureSpec], tables: str = "fp32", *overrides: str):
    """(config, its ServingModel with seeded weights): `tower` at a small size."""
    uses = TOWERS.get(tower)
    small = {"--model.hidden_dim=16": uses.tokens, "--model.num_tokens=4": uses.tokens,
             "--model.num_layers=1": uses.tokens,
             "--model.moe.num_experts=2": "moe" in uses.tables, "--model.mlp.hidden=[8]": "mlp" in uses.tables,
             "--model.unimixer.tau_anneal_steps=10": "unimixer" in uses.tables}
    cfg = load_config("configs/debug.toml", [f"--model.tower={tower}", *(o for o, read in small.items() if read),
                                             *overrides])
    cfg.features = features
    cfg.model.tasks = [TaskSpec(name="click"), TaskSpec(name="like")]
    torch.manual_seed(0)
    layout, tower_module, heads = build_dense(cfg.model, cfg.features)
    model = RankingModel(EmbeddingBagCollection(tables=table_configs(cfg.features)), layout, tower_module, heads)
    with torch.no_grad():
        return cfg, serving_model(cfg, model.eval().state_dict(), step=3, tables=tables)


@pytest.fixture(scope="module")
def artifact(made_once) -> Path:
    """A `rankmix export` folder of a small RankMixer, made in-process."""
    def make(folder: Path) -> None:
        cfg, model = served("rankmixer", small_features())
        files, manifest = artifact_files(cfg, model, "pt2", "fp32")
        write_artifact(cfg, folder / "export", files, {**manifest, "checkpoint": "seeded", "step": 3})
    return made_once("pt2-trust-export", make) / "export"


def example(artifact: Path) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    inputs = torch.load(artifact / "example_inputs.pt", weights_only=True)
    return (inputs["ids"], inputs["lengths"], inputs["numeric"]), torch.load(artifact / "example_outputs.pt",
                                                                              weights_only=True)


def entries(artifact: Path) -> list[tuple[zipfile.ZipInfo, bytes]]:
    with zipfile.ZipFile(artifact / "model.pt2") as archive:
        return [(info, archive.read(info)) for info in archive.infolist()]


def planted(artifact: Path, dest: Path, items: list[tuple[zipfile.ZipInfo | str, bytes]]) -> Path:
    """A copy of export `artifact` at `dest` whose model.pt2 holds `items` (entry, bytes)."""
    shutil.copytree(artifact, dest)
    with warnings.catch_warnings(), zipfile.ZipFile(dest / "model.pt2", "w") as archive:
        warnings.simplefilter("ignore")  # "Duplicate name": some tests mean it
        for info, data in items:
            archive.writestr(info, data)
    return dest


def edited(items: list, name: str, change) -> list:
    """`items` with the JSON of entry TOP/name replaced by what `change` makes of it (in place)."""
    out = []
    for info, data in items:
        if info.filename == f"{TOP}/{name}":
            doc = json.loads(data)
            change(doc)
            data = json.dumps(doc).encode()
        out.append((info, data))
    return out


def refusal(folder: Path, what: str) -> str:
    return (f"{folder / 'model.pt2'}: refused: {what}, which no rankmix export holds (loading it could run code or "
            "touch files); see README, Trust")


def expression_refused(code: str) -> str:
    return (f"a shape expression {code[:100]!r} (sympy evaluates it; rankmix's are sums of int64 integers and "
            "multiples of symbols, or comparisons of them)")


def guard_refused(code: str) -> str:
    return (f"an input guard {code[:100]!r} (guards are compiled into the model's forward; rankmix's compare sums "
            "of input sizes and int64 integers)")


class System:
    """Runs `touch marker` when unpickled (os.system, the review's payload)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class TorchSave(System):
    """Writes the marker when unpickled, through a torch function (torch.save)."""

    def __reduce__(self):
        return torch.save, ({"x": 1}, str(self.marker))


class Touch(System):
    """Makes the marker when unpickled, through builtins.getattr: getattr(Path(marker), "touch")()."""

    class Bound(System):
        def __call__(self):
            pass

        def __reduce__(self):
            return getattr, (self.marker, "touch")

    def __reduce__(self):
        return Touch.Bound(self.marker), ()


def test_an_export_loads_and_scores_as_exported(artifact):
    model, manifest = load(artifact)
    inputs, outputs = example(artifact)
    assert manifest["format"] == "pt2" and torch.equal(model(*inputs), outputs)


# ---------------------------------------------------------------------------- the review's attacks


@pytest.mark.parametrize("payload", [System, TorchSave, Touch])
def test_an_opaque_object_in_upper_case_is_refused_unread(artifact, tmp_path, payload):
    """Finding 1: torch's zip reader finds `OPAQUE_OBJ_0` when asked for `opaque_obj_0`, which the
    constants config names as an opaque object, which torch unpickles with pickle.loads."""
    marker = tmp_path / "ran"
    items = edited(entries(artifact), CONSTANTS, lambda doc: doc["config"].update(
        planted={"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}))
    folder = planted(artifact, tmp_path / "model", [*items, (f"{TOP}/data/constants/OPAQUE_OBJ_0",
                                                             pickle.dumps(payload(marker)))])
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, f"an entry '{TOP}/data/constants/OPAQUE_OBJ_0'")
    assert not marker.exists(), "the planted payload ran"


def writer_program(victim: Path, size: int, inputs: tuple[torch.Tensor, ...]) -> torch.export.ExportedProgram:
    """torch.export of a model that, scoring, writes `size` bytes "B" into file `victim` through
    aten.from_file(shared=True) and copy_: the review's artifact."""
    class Writer(torch.nn.Module):
        def forward(self, ids, lengths, numeric):
            mapped = torch.from_file(str(victim), shared=True, size=size, dtype=torch.uint8)
            mapped.copy_(torch.full((size,), ord("B"), dtype=torch.uint8))
            return torch.sigmoid(numeric[:, :2].float())

    library = torch.library.Library("aten", "IMPL")  # from_file has no shape function to trace with
    library.impl("from_file", lambda filename, shared=None, size=0, **kw: torch.empty(
        size, dtype=kw["dtype"], device="meta"), "Meta")
    try:
        return torch.export.export(Writer(), inputs, strict=False)
    finally:
        library._destroy()


def test_a_graph_that_writes_a_file_is_refused_before_it_runs(artifact, tmp_path):
    """Finding 2: aten.from_file(path, shared=True) then copy_ wrote chosen bytes to a chosen path."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"A" * 16)
    inputs, _ = example(artifact)
    program = writer_program(victim, 16, inputs)
    folder = shutil.copytree(artifact, tmp_path / "model")
    torch.export.save(program, folder / "model.pt2")
    with pytest.raises(UnsafeFileError) as refused:
        model, _ = load(folder)
        model(*inputs)
    assert str(refused.value) == refusal(folder, "a graph that calls torch.ops.aten.from_file.default")
    assert victim.read_bytes() == b"A" * 16
    with pytest.raises(UnsafeFileError) as refused:  # the loaded graph is checked again, whatever its source
        check_graph(program, folder / "model.pt2")
    assert str(refused.value) == refusal(folder, "a graph that calls torch.ops.aten.from_file.default")


def first_expression(doc: dict) -> dict:
    stack = [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict) and "expr_str" in item:
            return item
        stack.extend(item.values() if isinstance(item, dict) else item if isinstance(item, list) else [])
    raise AssertionError("the export holds no shape expression")


def test_a_shape_expression_that_runs_python_is_refused(artifact, tmp_path):
    """The deserializer hands each shape expression to sympy.sympify, which evaluates it as Python."""
    marker = tmp_path / "ran"
    code = f"__import__('os').system('touch {marker}')"
    items = edited(entries(artifact), PROGRAM, lambda doc: first_expression(doc).update(expr_str=code))
    folder = planted(artifact, tmp_path / "model", items)
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, expression_refused(code))
    assert not marker.exists()


def test_an_input_guard_that_runs_python_is_refused(artifact, tmp_path):
    """`.module()` compiles the program's guards into the forward, which runs them on each call."""
    marker = tmp_path / "ran"
    code = f"__import__('os').system('touch {marker}') == 0"
    folder = planted(artifact, tmp_path / "model",
                     edited(entries(artifact), PROGRAM, lambda doc: doc.update(guards_code=[code])))
    inputs, _ = example(artifact)
    with pytest.raises(UnsafeFileError) as refused:
        model, _ = load(folder)
        model(*inputs)
    assert str(refused.value) == refusal(folder, guard_refused(code))
    assert not marker.exists()


def test_a_tree_spec_that_imports_a_module_is_refused(artifact, tmp_path, monkeypatch):
    """torch rebuilds an enum in a tree spec's context by importing the module it names."""
    marker = tmp_path / "ran"
    (tmp_path / "rankmix_planted_module.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                                        "import enum\nclass E(enum.Enum):\n    A = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    context = json.dumps([{"__enum__": True, "fqn": "rankmix_planted_module:E", "name": "A"}])
    node = {}

    def plant(doc: dict) -> None:
        signature = doc["graph_module"]["module_call_graph"][0]["signature"]
        spec = json.loads(signature["in_spec"])
        node.update(spec[1]["children_spec"][1], context=context)  # the kwargs dict of forward(*args, **kwargs)
        spec[1]["children_spec"][1] = node
        signature["in_spec"] = json.dumps(spec)
    folder = planted(artifact, tmp_path / "model", edited(entries(artifact), PROGRAM, plant))
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, f"an input or output structure {str(node)[:100]}")
    assert not marker.exists()


def test_a_model_file_that_is_a_link_is_refused(artifact, tmp_path):
    folder = shutil.copytree(artifact, tmp_path / "model")
    (folder / "model.pt2").rename(folder / "elsewhere.pt2")
    (folder / "model.pt2").symlink_to("elsewhere.pt2")
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == f"{folder / 'model.pt2'}: refused: it is a symbolic link; the model file of an " \
                                 "export is a file of its own"


def _link(info: zipfile.ZipInfo) -> zipfile.ZipInfo:
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


def _deflated(info: zipfile.ZipInfo) -> zipfile.ZipInfo:
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


W0 = f"{TOP}/data/weights/weight_0"


@pytest.mark.parametrize("change, what", [
    (lambda items: [(W0.upper() if i.filename == W0 else i, d) for i, d in items], f"an entry '{W0.upper()}'"),
    (lambda items: [*items, (W0, b"")], f"'{W0}' twice (also as '{W0}')"),
    (lambda items: [*items, ("ARCHIVE/data/weights/weight_0", b"")],
     f"'ARCHIVE/data/weights/weight_0' twice (also as '{W0}')"),
    (lambda items: [(_link(i) if i.filename == W0 else i, d) for i, d in items], f"a symbolic link '{W0}'"),
    (lambda items: [(_deflated(i) if i.filename == W0 else i, d) for i, d in items], f"a compressed entry '{W0}'"),
    (lambda items: [*items, (f"{TOP}/data/constants/custom_obj_0", b"")],
     f"an entry '{TOP}/data/constants/custom_obj_0'"),
    (lambda items: [*items, (f"{TOP}/data/weights/model.pt", b"")], f"an entry '{TOP}/data/weights/model.pt'"),
    (lambda items: [*items, (f"{TOP}/extra/module_info.json", b"{}")], f"an entry '{TOP}/extra/module_info.json'"),
    (lambda items: [*items, (f"{TOP}/data/aotinductor/model/model.so", b"")],
     f"an entry '{TOP}/data/aotinductor/model/model.so'"),
    (lambda items: [*items, (f"{TOP}/models/other.json", b"{}")], f"an entry '{TOP}/models/other.json'"),
    (lambda items: [*items, ("other/data/weights/weight_99", b"")],
     "entries under ['archive', 'other'], not one folder"),
], ids=["case", "twice", "twice-by-case", "link", "compressed", "custom-object", "legacy-weights", "extra-file",
        "aoti", "second-program", "two-folders"])
def test_only_the_entries_of_an_export_are_accepted(artifact, tmp_path, change, what):
    folder = planted(artifact, tmp_path / "model", change(entries(artifact)))
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, what)


def _first(doc: dict) -> tuple[str, dict]:
    return next(iter(doc["config"].items()))


@pytest.mark.parametrize("change, what", [
    (lambda fqn, entry: entry.update(use_pickle=True), "a pickled {config} entry {fqn!r} (use_pickle True)"),
    (lambda fqn, entry: entry.update(USE_PICKLE=True),
     "a {config} entry {fqn!r} with fields ['USE_PICKLE', 'is_param', 'path_name', 'tensor_meta', 'use_pickle']"),
    (lambda fqn, entry: entry.update(path_name="opaque_obj_0"),
     "a {config} entry {fqn!r} stored in 'opaque_obj_0', not as raw tensor bytes"),
    (lambda fqn, entry: entry.update(path_name="weight_0/../../constants/tensor_0"),
     "a {config} entry {fqn!r} stored in 'weight_0/../../constants/tensor_0', not as raw tensor bytes"),
    (lambda fqn, entry: entry["tensor_meta"]["sizes"].append({"as_int": 2}),
     "a {config} entry {fqn!r} that is not a tensor of its graph, as the graph declares it"),
], ids=["use-pickle", "key-case", "opaque-path", "path-escape", "other-shape"])
def test_the_payload_configs_hold_plain_tensors_of_the_graph(artifact, tmp_path, change, what):
    fqn = []

    def plant(doc: dict) -> None:
        fqn.append(_first(doc)[0])
        change(*_first(doc))
    folder = planted(artifact, tmp_path / "model", edited(entries(artifact), WEIGHTS, plant))
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, what.format(config=WEIGHTS, fqn=fqn[0]))


def test_a_pickled_sample_input_is_refused_unread(artifact, tmp_path):
    """The sample inputs are unpickled (weights-only); their pickle may name tensors' globals only."""
    marker = tmp_path / "ran"
    buffer = io.BytesIO()
    torch.save(Touch(marker), buffer)
    items = [(i, buffer.getvalue() if i.filename == f"{TOP}/data/sample_inputs/model.pt" else d)
             for i, d in entries(artifact)]
    folder = planted(artifact, tmp_path / "model", items)
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, "sample inputs whose pickle holds GLOBAL __builtin__ getattr at "
                                                 "byte 2")
    assert not marker.exists()


# ---------------------------------------------------------------------------- the allow-lists


def check_export(cfg, model, tables: str) -> None:
    """The export of `model` (as `rankmix export` makes it) calls only PT2_OPS, and its archive
    passes check_pt2 whole."""
    files, _ = artifact_files(cfg, model, "pt2", tables)
    with zipfile.ZipFile(io.BytesIO(files["model.pt2"])) as archive:
        program = json.loads(archive.read(f"{TOP}/{PROGRAM}"))
    ops = {node["target"] for node in program["graph_module"]["graph"]["nodes"]}
    assert ops <= PT2_OPS, (f"tower {cfg.model.tower} (--tables {tables}) calls {sorted(ops - PT2_OPS)}: add them to "
                            "PT2_OPS in trainer/serving/safe_pt2.py once you checked that none reads or writes files")
    check_pt2(io.BytesIO(files["model.pt2"]), Path(cfg.model.tower))


@pytest.mark.parametrize("tower", TOWERS.names())
def test_every_towers_export_is_within_the_allow_lists(tower):
    check_export(*served(tower, small_features()), "fp32")


@pytest.mark.parametrize("tables, features", [("fp32", "debug"), ("int8", "small"), ("int4", "small")])
def test_the_debug_config_and_quantized_tables_are_within_the_allow_lists(tables, features):
    import fbgemm_gpu  # noqa: F401  registers the ops of TorchRec's quantized tables
    check_export(*served("rankmixer", synth_features() if features == "debug" else small_features(), tables), tables)


def test_the_dtype_numbers_are_torchs():
    from torch._export.serde.serialize import _TORCH_TO_SERIALIZE_DTYPE
    assert all(_TORCH_TO_SERIALIZE_DTYPE[dtype].value == number for number, dtype in _PT2_DTYPES.items())


# ---------------------------------------------------------------------------- fuzzing

NAMES = [f"{TOP}/data/constants/OPAQUE_OBJ_0", f"{TOP}/data/constants/opaque_obj_0", f"{TOP}/Data/weights/weight_0",
         f"{TOP}/data/constants/custom_obj_0", f"{TOP}/data/weights/model.pt", f"{TOP}/extra/x.json",
         f"{TOP}/data/aotinductor/m/m.so", f"{TOP}/models/model.JSON", f"{TOP}/../x", "/x", f"{TOP}/data/weights/",
         f"{TOP}/data/weights/weight_99", f"{TOP}/data/constants/tensor_99"]
TOPS = ["model", "a.b-c", "ARCHIVE", "", "..", "x y", "x" * 200]
OPS = ["torch.ops.aten.from_file.default", "torch.ops.aten.copy_.default", "torch.save", "builtins.exec",
       "torch.ops.higher_order.cond", "#custom:op", "_operator.getitem"]
EXPRESSIONS = ["__import__('os').system('true')", "lambdify([], 'x')", "Symbol('s0').__class__", "Symbol('../x')",
               "Integer(2) + Integer(3)", "Float('1.5')", ""]
VALUES = [True, False, None, 0, 1, -1, 2 ** 70, "true", "", "opaque_obj_0", "OPAQUE_OBJ_0", "custom_obj_0",
          "../weight_0", {"as_int": -1}, [{"as_int": 2 ** 40}], {"type": "cuda", "index": 0}, [], {}]


def _mutate_entries(items: list, data, marker: Path) -> None:
    kind = data.draw(st.sampled_from(["rename", "case", "add", "remove", "duplicate", "link", "compress", "top",
                                      "reorder"]))
    i = data.draw(st.integers(0, len(items) - 1))
    name, payload, flags = items[i]
    if kind == "rename":
        items[i][0] = data.draw(st.one_of(st.sampled_from(NAMES), st.text(max_size=30)))
    elif kind == "case":
        start, length = data.draw(st.integers(0, len(name))), data.draw(st.integers(1, 8))
        items[i][0] = name[:start] + name[start:start + length].swapcase() + name[start + length:]
    elif kind == "add":
        items.append([data.draw(st.sampled_from(NAMES)), data.draw(st.sampled_from(
            [b"", pickle.dumps(System(marker)), pickle.dumps(Touch(marker)), b"\0" * 64])), set()])
    elif kind == "remove":
        del items[i]
    elif kind == "duplicate":
        items.append([data.draw(st.sampled_from([name, name.upper(), name.lower()])), payload, set(flags)])
    elif kind in ("link", "compress"):
        flags.add(kind)
    elif kind == "top":
        top = data.draw(st.sampled_from(TOPS))
        for item in items:
            item[0] = top + "/" + item[0].partition("/")[2]
    else:
        items.reverse()


def _mutate_json(items: list, data) -> None:
    """Change one value of the program or a payload config: a key, a node's target or argument,
    a shape expression, a guard, a tree spec, or a field of a tensor's entry."""
    name = data.draw(st.sampled_from([PROGRAM, WEIGHTS, CONSTANTS]))
    item = next((item for item in items if item[0] == f"{TOP}/{name}"), None)
    if item is None:
        return
    doc = json.loads(item[1])
    if name == PROGRAM:
        graph = doc["graph_module"]["graph"]
        node = data.draw(st.sampled_from(graph["nodes"]))
        change = data.draw(st.sampled_from(["target", "argument", "meta", "expr", "guard", "spec", "key"]))
        if change == "target":
            node["target"] = data.draw(st.sampled_from(OPS))
        elif change == "argument":
            node["inputs"].append({"name": "x", "arg": {data.draw(st.sampled_from(
                ["as_graph", "as_operator", "as_custom_obj", "as_strings"])): "torch.save"}, "kind": 1})
        elif change == "meta":
            node["metadata"]["source_fn_stack"] = "x,torch.save"
        elif change == "expr":
            first_expression(doc)["expr_str"] = data.draw(st.sampled_from(EXPRESSIONS))
        elif change == "guard":
            doc["guards_code"] = data.draw(st.sampled_from([[], ["L['ids'].size()[0] >= 0"], ["open('x')"]]))
        elif change == "spec":
            signature = doc["graph_module"]["module_call_graph"][0]["signature"]
            signature["in_spec"] = data.draw(st.sampled_from([
                '[1, {"type": "collections.defaultdict", "context": "{}", "children_spec": []}]',
                '[1, {"type": "builtins.dict", "context": "[{\\"__enum__\\": true}]", "children_spec": []}]']))
        else:
            doc[data.draw(st.sampled_from(["extra", "guards_code", "verifiers"]))] = None
    elif doc["config"]:
        fqn = data.draw(st.sampled_from(sorted(doc["config"])))
        entry = doc["config"][data.draw(st.sampled_from([fqn, "planted"]))] = dict(doc["config"][fqn])
        field = data.draw(st.sampled_from(["use_pickle", "path_name", "is_param", "tensor_meta", "USE_PICKLE"]))
        value = data.draw(st.sampled_from(VALUES))
        if field == "tensor_meta" and value is not None:
            entry["tensor_meta"] = {**entry["tensor_meta"], data.draw(st.sampled_from(
                ["sizes", "strides", "storage_offset", "dtype", "device", "layout", "requires_grad"])): value}
        else:
            entry[field] = value
    item[1] = json.dumps(doc, indent=data.draw(st.sampled_from([None, 1]))).encode()


@FUZZ
@given(data=st.data())
def test_a_mutated_export_loads_as_exported_or_is_refused_in_one_line(artifact, data):
    """Mutations of the archive's entries (names, case, added, removed, doubled, links,
    compression, its top folder, their order) and of its JSON (program and payload configs)."""
    inputs, outputs = example(artifact)
    items = [[info.filename, payload, set()] for info, payload in entries(artifact)]
    with tempfile.TemporaryDirectory() as tmp:
        marker = Path(tmp) / "ran"
        for _ in range(data.draw(st.integers(1, 3))):
            if data.draw(st.booleans()):
                _mutate_entries(items, data, marker)
            else:
                _mutate_json(items, data)
        infos = []
        for name, payload, flags in items:
            info = zipfile.ZipInfo(name)
            info = _link(info) if "link" in flags else _deflated(info) if "compress" in flags else info
            infos.append((info, payload))
        folder = planted(artifact, Path(tmp) / "model", infos)
        try:
            model, _ = load(folder)
        except ValueError as e:  # UnsafeFileError included
            assert "\n" not in str(e) and str(folder) in str(e), str(e)
        else:
            assert torch.equal(model(*inputs), outputs)
        assert sorted(os.listdir(tmp)) == ["model"] and sorted(os.listdir(folder)) == sorted(os.listdir(artifact))
