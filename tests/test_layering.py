"""The floors of docs/design.md §2, checked on the source: the four packages are floors, and
every import points down a floor or stays inside its package; inside trainer/ and dense/ the
modules are floors too (INNER_FLOORS), and every import points down one or stays on its floor.

    floor 3  launch/      the CLI and job launch
    floor 2  trainer/     composes the floors below: config tree, data, loop, checkpoints, metrics, serving
    floor 1  dense/       [model] and the towers, tokenizers, heads
    floor 0  embeddings/  the feature schema, [embeddings], the registry base, the hooks protocol; tables

Imports of every kind count: at module level, inside functions, and under `if TYPE_CHECKING:`
(an annotation is a dependency too). Besides: no loop between packages, no circle between
modules (of any kind of import), no name starting with `_` imported from another package,
no two modules of one file name, and a function-level import says why
in a comment on its line or above its group (an optional dependency, a command that must start
without torch). `test_the_checks_find_a_planted_*` run the checks on a copy with a planted fault.
"""

import ast
import functools
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOORS = {"embeddings": 0, "dense": 1, "trainer": 2, "launch": 3}
# The floors inside a package, lowest first: (name, the modules on it, relative to the package).
# A module, or a subpackage, stands on the floor of the longest name here that is it or holds it.
INNER_FLOORS: dict[str, list[tuple[str, list[str]]]] = {
    "trainer": [
        ("helpers", ["errors", "dist", "credentials", "files", "precision", "run_layout"]),
        ("config", ["config", "config_loader"]),
        # metrics' arithmetic reads no data; evaluation and report do, and stand on "parts"
        ("measures", ["metrics"]),
        ("generators", ["offline"]),  # they score their teacher with measures' auc
        ("data", ["data"]),  # datasets.py builds the generators' data sets
        ("parts", ["ranking_model", "auto_width", "optimizer", "pipeline", "lifecycle", "checkpoint",
                   "metrics.evaluation", "metrics.report"]),
        ("serving", ["serving"]),
        ("components", ["components"]),
        ("loop", ["train"]),
        ("runs", ["assembly", "run", "unimixer_two_stage", "score"]),
    ],
    "dense": [
        ("registries", ["tower_registry", "sequence_registry"]),
        ("modules", ["layout", "tokenizer", "rankmixer", "moe", "unimixer", "unimixer_moe", "baselines", "sequence",
                     "cost"]),
        # tables and builders without torch: a builder imports its modules on use
        ("declarations", ["tower_configs", "sequence_modules"]),
        ("model config", ["model_config"]),
        ("heads", ["heads"]),
    ],
}


def modules(root: Path = REPO) -> dict[str, Path]:
    """Dotted name -> file of every module of the four packages (a package by its __init__)."""
    found = {}
    for pkg in FLOORS:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> list[tuple[int, str, list[str], str]]:
    """(line, imported module of ours, names taken from it, where: "module" | "function" |
    "type_checking") of every import of `path` that names one of our modules."""
    return _imports(path.read_text(), frozenset(known))


@functools.cache
def _imports(source: str, known: frozenset[str]) -> list[tuple[int, str, list[str], str]]:
    tree = ast.parse(source)
    where: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            where |= {id(n): "function" for n in ast.walk(node)}
    for node in ast.walk(tree):  # TYPE_CHECKING wins over function: never executed
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            where |= {id(n): "type_checking" for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        kind = where.get(id(node), "module")
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, [], kind) for a in node.names if a.name.split(".")[0] in FLOORS]
        elif (isinstance(node, ast.ImportFrom) and node.module and not node.level
              and node.module.split(".")[0] in FLOORS):
            for a in node.names:  # `from pkg import module` imports that module
                sub = f"{node.module}.{a.name}"
                out.append((node.lineno, sub, [], kind) if sub in known else (node.lineno, node.module, [a.name], kind))
    return out


def package(module: str) -> str:
    return module.split(".")[0]


def upward(root: Path = REPO) -> list[str]:
    """Every import that points up a floor."""
    known = modules(root)
    return [f"{path.relative_to(root)}:{line}: {module} (floor {FLOORS[package(module)]}) imports {target} "
            f"(floor {FLOORS[package(target)]}, {kind}-level)"
            for module, path in known.items() for line, target, _, kind in imports(path, known)
            if FLOORS[package(target)] > FLOORS[package(module)]]


def package_loops(root: Path = REPO) -> list[list[str]]:
    """Loops in the graph of which package imports which (any kind of import)."""
    known = modules(root)
    edges = defaultdict(set)
    for module, path in known.items():
        edges[package(module)] |= {package(t) for _, t, _, _ in imports(path, known)} - {package(module)}
    return cycles(edges)


def inner_floor(module: str) -> tuple[int, str] | None:
    """(floor, its name) of `module` inside its package; None for a package without floors inside
    (and for the package itself), or for a module that INNER_FLOORS does not place."""
    pkg, _, rest = module.partition(".")
    best = None
    for floor, (name, members) in enumerate(INNER_FLOORS.get(pkg, ())):
        for member in members:
            if (rest == member or rest.startswith(member + ".")) and (best is None or len(member) > len(best[2])):
                best = (floor, name, member)
    return best and best[:2]


def inner_upward(root: Path = REPO) -> list[str]:
    """Every import inside trainer/ or dense/ that points up a floor of INNER_FLOORS."""
    known, wrong = modules(root), []
    for module, path in known.items():
        for line, target, _, kind in imports(path, known):
            a, b = inner_floor(module), inner_floor(target)
            if package(target) == package(module) and a and b and b[0] > a[0]:
                wrong.append(f"{path.relative_to(root)}:{line}: {module} (floor {a[0]} {a[1]}) imports {target} "
                             f"(floor {b[0]} {b[1]}, {kind}-level)")
    return wrong


def module_loops(root: Path = REPO) -> list[str]:
    """Circles between modules through imports of any kind, each hop named by its file, line
    and kind (the first import of the one module by the other)."""
    known = modules(root)
    hops: dict[str, dict[str, tuple[int, str]]] = defaultdict(dict)
    for module, path in known.items():
        for line, target, _, kind in sorted(imports(path, known)):
            if target in known and target != module:
                hops[module].setdefault(target, (line, kind))
    return [f"circle of {len(loop) - 1} modules: " + "; ".join(
                f"{known[a].relative_to(root)}:{hops[a][b][0]}: {a} imports {b} ({hops[a][b][1]}-level)"
                for a, b in zip(loop, loop[1:]))
            for loop in cycles({m: set(t) for m, t in hops.items()})]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One loop through each strongly connected group of `edges` (depth-first search)."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    return found


def private_imports(root: Path = REPO) -> list[str]:
    """`from other_package.module import _name`: a name its package keeps to itself."""
    known = modules(root)
    return [f"{path.relative_to(root)}:{line}: imports {name} from {target}"
            for module, path in known.items() for line, target, names, _ in imports(path, known)
            if package(target) != package(module) for name in names if name.startswith("_")]


def has_reason(lines: list[str], line: int) -> bool:
    """A comment on the import's line, or on a line above its group of imports."""
    i = line - 1
    if "#" in lines[i]:
        return True
    while i > 0 and lines[i - 1].strip().startswith(("from ", "import ", "#")):
        i -= 1
        if lines[i].strip().startswith("#") or "#" in lines[i]:
            return True
    return False


def test_every_import_points_down_or_stays_in_its_package():
    wrong = upward()
    assert not wrong, "\n".join(wrong)


def test_no_loop_between_packages():
    assert not package_loops()


def test_no_circle_between_modules():
    circles = module_loops()
    assert not circles, "\n".join(circles)


def test_every_import_inside_a_package_points_down_or_stays_on_its_floor():
    wrong = inner_upward()
    assert not wrong, "\n".join(wrong)


def unplaced(root: Path = REPO) -> list[str]:
    """The modules of trainer/ and dense/ on no floor of INNER_FLOORS, and its names that are no
    module (one moved or removed)."""
    known = modules(root)
    named = [f"{pkg}.{m}" for pkg, floors in INNER_FLOORS.items() for _, members in floors for m in members]
    return ([f"{m}: on no floor" for m in known if package(m) in INNER_FLOORS and m not in INNER_FLOORS
             and not inner_floor(m)] + [f"{m}: on a floor, but no module" for m in named if m not in known])


def test_every_module_of_trainer_and_dense_stands_on_a_floor():
    assert unplaced() == []


def test_design_draws_the_floors_inside_trainer_and_dense():
    """docs/design.md §2 draws INNER_FLOORS: for each package, its floors' numbers and names."""
    drawn: dict[str, list[tuple[int, str]]] = defaultdict(list)
    pkg = ""
    for line in (REPO / "docs" / "design.md").read_text().splitlines():
        words = line.split()
        if len(words) == 1 and words[0].rstrip("/") in INNER_FLOORS:
            pkg = words[0].rstrip("/")
        elif pkg and len(words) > 2 and words[0] == "floor":
            drawn[pkg].append((int(words[1]), line[len("  floor 9   "):].split("  ")[0]))
        elif pkg and line.startswith("```"):
            pkg = ""
    assert drawn == {p: [(n, name) for n, (name, _) in reversed(list(enumerate(floors)))]
                     for p, floors in INNER_FLOORS.items()}


def test_no_private_name_crosses_a_package():
    wrong = private_imports()
    assert not wrong, "\n".join(wrong)


def test_no_two_modules_share_a_file_name():
    names = defaultdict(list)
    for path in modules().values():
        if path.name != "__init__.py":
            names[path.name].append(str(path.relative_to(REPO)))
    assert not {n: p for n, p in names.items() if len(p) > 1}


def test_function_level_imports_say_why():
    silent = []
    known = modules()
    for _, path in known.items():
        lines = path.read_text().splitlines()
        silent += [f"{path.relative_to(REPO)}:{line}: import of {name}" for line, name, _, kind in imports(path, known)
                   if kind == "function" and not has_reason(lines, line)]
    assert not silent, "function-level imports without a reason:\n" + "\n".join(silent)


@pytest.fixture
def copy(tmp_path) -> Path:
    """The four packages' sources, to plant a fault in."""
    for pkg in FLOORS:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    assert not upward(tmp_path) and not package_loops(tmp_path) and not private_imports(tmp_path)
    assert not module_loops(tmp_path) and not inner_upward(tmp_path) and not unplaced(tmp_path)
    return tmp_path


@pytest.mark.parametrize("planted, where", [
    ("from trainer.config import Config\n", "module"),
    ("def f():\n    from launch.cli import main  # on use\n    return main\n", "function"),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dense.layout import InputLayout\n",
     "type_checking"),
], ids=["module", "function", "type_checking"])
def test_the_checks_find_a_planted_upward_import(copy, planted, where):
    """An upward import planted in embeddings/features.py, at module level, in a function or
    for annotations only, is named by the floor check and closes a loop between packages."""
    path = copy / "embeddings" / "features.py"
    path.write_text(path.read_text() + "\n" + planted)
    wrong = upward(copy)
    assert len(wrong) == 1 and wrong[0].startswith("embeddings/features.py:") and f"{where}-level" in wrong[0], wrong
    assert "embeddings.features (floor 0) imports" in wrong[0]
    assert package_loops(copy)


def test_the_checks_find_a_planted_private_import(copy):
    path = copy / "launch" / "plan.py"
    path.write_text(path.read_text() + "\nfrom trainer.data.store import _transient\n")
    assert private_imports(copy) == [f"launch/plan.py:{len(path.read_text().splitlines())}: imports _transient "
                                     "from trainer.data.store"]


def test_the_checks_find_a_planted_circle_between_modules(copy):
    """Two modules that import each other, one of them for annotations only, are a circle."""
    (copy / "dense" / "a.py").write_text("from dense import b\n")
    (copy / "dense" / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import dense.a\n")
    assert module_loops(copy) == ["circle of 2 modules: dense/a.py:1: dense.a imports dense.b (module-level); "
                                  "dense/b.py:4: dense.b imports dense.a (type_checking-level)"]
    assert unplaced(copy) == ["dense.a: on no floor", "dense.b: on no floor"]
    (copy / "trainer" / "files.py").unlink()
    assert unplaced(copy)[2:] == ["trainer.files: on a floor, but no module"]


@pytest.mark.parametrize("file, planted, message", [
    ("trainer/config.py",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer.train import Trainer\n",
     "trainer.config (floor 1 config) imports trainer.train (floor 8 loop, type_checking-level)"),
    ("trainer/metrics/streaming.py", "def f():\n    from trainer.metrics.evaluation import Evaluator  # on use\n",
     "trainer.metrics.streaming (floor 2 measures) imports trainer.metrics.evaluation (floor 5 parts, "
     "function-level)"),
    ("dense/tower_registry.py", "from dense.heads import build_dense\n",
     "dense.tower_registry (floor 0 registries) imports dense.heads (floor 4 heads, module-level)"),
], ids=["trainer-type_checking", "trainer-function-subpackage", "dense-module"])
def test_the_checks_find_a_planted_import_up_inside_a_package(copy, file, planted, message):
    """An import up a floor inside trainer/ or dense/ (to a module, or to the upper part of a
    subpackage that stands on two floors) is named with its line and floors, and closes a circle."""
    path = copy / file
    path.write_text(path.read_text() + "\n" + planted)
    wrong = inner_upward(copy)
    assert wrong == [f"{file}:{len(path.read_text().splitlines())}: {message}"]  # the planted import, last
    assert module_loops(copy)


def test_a_reason_may_head_a_group_of_imports():
    lines = ["def f():", "    # only when asked: torch is slow to import", "    import torch", "    import numpy",
             "    import json", "    x = 1", "    import os"]
    assert [has_reason(lines, n) for n in (3, 4, 5, 7)] == [True, True, True, False]
