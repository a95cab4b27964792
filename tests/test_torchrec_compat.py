"""TorchRec's internals in one room: every private member that `embeddings/torchrec_compat.py`
declares exists in the installed TorchRec (a message names the member and the version), and
no other product module reaches past TorchRec's or FBGEMM's public API."""

import ast
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import sys
import tokenize
from functools import cache
from pathlib import Path

import torch
from torchrec.modules.mc_modules import DistanceLFU_EvictionPolicy, MCHManagedCollisionModule

from cli import rendezvous_port, spawn
from embeddings.torchrec_compat import PRIVATE_MEMBERS, Private

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("trainer", "dense", "embeddings", "launch")
COMPAT = REPO / "embeddings" / "torchrec_compat.py"
LIBRARIES = ("torchrec", "fbgemm_gpu")


def missing_members(members, instances: dict[type, object]) -> list[str]:
    """A line for each member that neither its owner class nor the given instance of it has (a
    name ending in "_" is a prefix: some key of the instance's state dict must start with it)."""
    lines = []
    for owner, name, why in members:
        instance = instances.get(owner)
        if name.endswith("_"):
            found = instance is not None and any(key.startswith(name) for key in instance.state_dict())
        else:
            found = hasattr(owner, name) or (instance is not None and hasattr(instance, name))
        if not found:
            library = owner.__module__.split(".")[0]
            lines.append(f"{library} {sys.modules[library].__version__}: {owner.__name__} has no {name} ({why})")
    return lines


def _mch(rows: int, device: str = "cpu") -> MCHManagedCollisionModule:
    return MCHManagedCollisionModule(zch_size=rows, device=torch.device(device),
                                     eviction_policy=DistanceLFU_EvictionPolicy(), eviction_interval=1, name="t")


def _instances_worker(rank: int, port: int, out: str) -> None:
    """TorchRec's own classes (not rankmix's subclasses, which define the overridden members
    themselves), one of each owner, sharded in a world of one; the members they lack, to `out`."""
    import torch.distributed as dist
    from torch import nn
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
    from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.mc_embedding_modules import (
        ManagedCollisionEmbeddingBagCollection,
        ManagedCollisionEmbeddingCollection,
    )
    from torchrec.modules.mc_modules import ManagedCollisionCollection

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    bags = [EmbeddingBagConfig(name="t", feature_names=["f"], num_embeddings=8, embedding_dim=4)]
    unpooled = [EmbeddingConfig(name="s", feature_names=["g"], num_embeddings=8, embedding_dim=4)]
    collection = ManagedCollisionCollection({"t": _mch(8, "meta")}, bags)
    mc = ManagedCollisionEmbeddingBagCollection(EmbeddingBagCollection(tables=bags, device=torch.device("meta")),
                                                collection)
    mc_sequences = ManagedCollisionEmbeddingCollection(
        EmbeddingCollection(tables=unpooled, device=torch.device("meta")),
        ManagedCollisionCollection({"s": _mch(8, "meta")}, unpooled))
    sharders = {"mc": ManagedCollisionEmbeddingBagCollectionSharder(),
                "mc_sequences": ManagedCollisionEmbeddingCollectionSharder()}
    holder = nn.Module()
    holder.mc, holder.mc_sequences = mc, mc_sequences
    plan = ShardingPlan({path: sp.construct_module_sharding_plan(
        module, per_param_sharding={table: sp.row_wise(compute_kernel="fused")}, sharder=sharders[path],
        local_size=1, world_size=1, device_type="cpu") for path, module, table in (("mc", mc, "t"),
                                                                                  ("mc_sequences", mc_sequences, "s"))})
    dmp = DistributedModelParallel(holder, env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
                                   device=torch.device("cpu"), plan=plan, sharders=list(sharders.values())).module
    instances = {}  # each owner class, and the TorchRec classes it derives from, -> an instance
    for x in (_mch(4), collection, mc, mc_sequences, *sharders.values(), dmp.mc, dmp.mc._embedding_module,
              dmp.mc_sequences, dmp.mc_sequences._embedding_module):
        for cls in type(x).__mro__:
            instances.setdefault(cls, x)
    Path(out).write_text(json.dumps(missing_members(PRIVATE_MEMBERS, instances)))
    dist.destroy_process_group()


def test_every_private_member_rankmix_relies_on_exists_in_the_installed_torchrec(tmp_path):
    spawn(_instances_worker, (rendezvous_port(), str(tmp_path / "missing.json")), 1)
    assert json.loads((tmp_path / "missing.json").read_text()) == []


def test_a_missing_member_is_named_with_the_torchrec_version():
    members = [Private(MCHManagedCollisionModule, "_current_iter", "found on the instance"),
               Private(MCHManagedCollisionModule, "_update_and_evict", "found on the class"),
               Private(MCHManagedCollisionModule, "_mch_", "found as a prefix"),
               Private(MCHManagedCollisionModule, "_no_such_member", "rankmix reads it to test the test"),
               Private(MCHManagedCollisionModule, "_no_such_prefix_", "rankmix counts these")]
    version = importlib.metadata.version("torchrec")
    assert missing_members(members, {MCHManagedCollisionModule: _mch(4)}) == [
        f"torchrec {version}: MCHManagedCollisionModule has no _no_such_member (rankmix reads it to test the test)",
        f"torchrec {version}: MCHManagedCollisionModule has no _no_such_prefix_ (rankmix counts these)"]
    assert missing_members(members[:1], {}) == [  # an instance attribute needs an instance
        f"torchrec {version}: MCHManagedCollisionModule has no _current_iter (found on the instance)"]


@cache
def library_privates() -> frozenset[str]:
    """The private names TorchRec and FBGEMM define: attributes set or read on `self`, and
    methods (their tests left out), plus the compat module's table."""
    names = {m.name for m in PRIVATE_MEMBERS if not m.name.endswith("_")}
    for library in LIBRARIES:
        root = Path(importlib.import_module(library).__file__).parent
        for path in root.rglob("*.py"):
            if "test" in path.relative_to(root).as_posix():
                continue
            for node in ast.walk(ast.parse(path.read_bytes())):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                    names.add(node.attr)
                elif isinstance(node, ast.ClassDef):
                    names.update(f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__"))


PREFIXES = tuple(m.name for m in PRIVATE_MEMBERS if m.name.endswith("_"))
TOKEN = re.compile(r"(?<!\w)_[A-Za-z]\w*")


def _is_library_private(name: str) -> bool:
    return name in library_privates() or name.startswith(PREFIXES)


def _derives_from_library(module, class_name: str) -> bool:
    cls = getattr(module, class_name, None)
    return isinstance(cls, type) and any(c.__module__.split(".")[0] in LIBRARIES for c in cls.__mro__)


def reaches_into_libraries(path: Path, module) -> list[str]:
    """`path:line: what` for each use of a TorchRec or FBGEMM private name in the file: an
    import, an attribute (on `self` or `super()` only in a class derived from theirs), an
    override, a string or a comment. `module` is the file imported, to tell which classes derive."""
    source = path.read_text()
    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    found = []

    def visit(node: ast.AST, derived: bool) -> None:
        if isinstance(node, ast.ClassDef):
            derived = _derives_from_library(module, node.name)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and derived and _is_library_private(node.name):
            found.append((node.lineno, f"overrides {node.name}"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
            private = [p for p in node.module.split(".") if p.startswith("_")]
            private += [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            found.extend((node.lineno, f"imports {node.module}: {name}") for name in private)
        elif isinstance(node, ast.Attribute) and _is_library_private(node.attr):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") or (
                isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super")
            if derived or not own:
                found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.extend((node.lineno, f"{t!r} in a string") for t in TOKEN.findall(node.value)
                         if _is_library_private(t))
        for child in ast.iter_child_nodes(node):
            visit(child, derived)

    visit(ast.parse(source), False)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found.extend((token.start[0], f"{t!r} in a comment") for t in TOKEN.findall(token.string)
                         if _is_library_private(t))
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]


def _product_files() -> list[Path]:
    return sorted(p for package in PRODUCT for p in (REPO / package).rglob("*.py") if p != COMPAT)


def _module_of(path: Path):
    return importlib.import_module(".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"))


def test_no_product_module_but_the_compat_one_reaches_into_torchrec_or_fbgemm():
    assert [line for path in _product_files() for line in reaches_into_libraries(path, _module_of(path))] == []


SAMPLE = '''\
from torchrec.modules.mc_modules import MCHManagedCollisionModule, _mch_remap


class Own:
    def __init__(self):
        self._name = "own"  # a private attribute of rankmix's own class


class Tracked(MCHManagedCollisionModule):
    def remap(self, features, mutate_miss_lengths=True, write_weights=None):
        return super().remap(features) if self._evicted else features

    def _update_and_evict(self, *args):
        super()._update_and_evict(*args)


def plan(planner, state):
    # planner._best_plan holds the options
    return planner._best_plan, state["managed._managed_collision_collection.x._mch_counts"]
'''


def test_the_scan_names_file_and_line_of_each_private_use(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text(SAMPLE)
    spec = importlib.util.spec_from_file_location("sample", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert reaches_into_libraries(path, module) == [
        f"{path}:1: imports torchrec.modules.mc_modules: _mch_remap",
        f"{path}:11: self._evicted",
        f"{path}:13: overrides _update_and_evict",
        f"{path}:14: super()._update_and_evict",
        f"{path}:18: '_best_plan' in a comment",
        f"{path}:19: '_managed_collision_collection' in a string",
        f"{path}:19: '_mch_counts' in a string",
        f"{path}:19: planner._best_plan",
    ]
