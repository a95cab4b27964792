"""The import rule of docs/design.md §2, checked on the source: floors, and every import
points down or sideways within its package.

    floor 0  trainer/config.py, credentials.py, registry.py, hooks.py   the contracts
    floor 1  embeddings/ and dense/                                      each imports floor 0 only
    floor 2  the rest of trainer/                                        floors 0-1 and itself
    floor 3  launch/                                                     anything

Imports under `if TYPE_CHECKING:` are annotations only and do not count. A function-level
import needs its reason in a comment on its line or the line above (an optional dependency,
a command that must start without torch, the fork server's preload).
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "embeddings", "dense", "launch")
GROUND = {"trainer.config", "trainer.credentials", "embeddings.registry", "embeddings.hooks"}


def floor(module: str) -> int:
    if module in GROUND:
        return 0
    return {"embeddings": 1, "dense": 1, "trainer": 2, "launch": 3}[module.split(".")[0]]


def modules() -> list[tuple[str, Path]]:
    return sorted((".".join(p.relative_to(REPO).with_suffix("").parts), p)
                  for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported rankmix module, inside a function) of every import outside TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    in_function = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        for name in names:
            out.append((node.lineno, name, id(node) in in_function))
    return out


def ours(name: str) -> str | None:
    """The rankmix module `name` refers to (a package's own module, or the package itself)."""
    return name if name.split(".")[0] in PACKAGES else None


def violations(module: str, path: Path) -> list[str]:
    """`module`'s imports that point up a floor, or across floor 1 from one package to the other."""
    wrong = []
    for line, name, _ in imports(path):
        target = ours(name)
        if target is None:
            continue
        same_package = target.split(".")[0] == module.split(".")[0]
        up = floor(target) > floor(module) and not (same_package and floor(module) > 0)
        across = floor(module) == 1 == floor(target) and not same_package
        if up or across:
            wrong.append(f"{path.name}:{line}: {module} (floor {floor(module)}) imports {target} "
                         f"(floor {floor(target)})")
    return wrong


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


def test_every_import_points_down_or_sideways():
    wrong = [v for module, path in modules() for v in violations(module, path)]
    assert not wrong, "\n".join(wrong)


def test_the_ground_floor_imports_only_itself():
    for module in GROUND:
        path = REPO / (module.replace(".", "/") + ".py")
        above = [f"{path.name}:{line}: {name}" for line, name, _ in imports(path)
                 if ours(name) and ours(name) not in GROUND]
        assert not above, above


def test_function_level_imports_say_why():
    silent = []
    for _, path in modules():
        lines = path.read_text().splitlines()
        silent += [f"{path.relative_to(REPO)}:{line}: import of {name}"
                   for line, name, in_function in imports(path) if in_function and not has_reason(lines, line)]
    assert not silent, "function-level imports without a reason:\n" + "\n".join(silent)


@pytest.mark.parametrize("source, expected", [
    ("from dense.heads import build_dense\n", ["x.py:1: embeddings.x (floor 1) imports dense.heads (floor 1)"]),
    ("from trainer.data import ids\n", ["x.py:1: embeddings.x (floor 1) imports trainer.data (floor 2)"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer.data.batch import Batch\n", []),
    ("from trainer.config import FeatureSpec\nfrom embeddings.tables import FUSED\n", []),
])
def test_the_rule_finds_what_it_should(tmp_path, source, expected):
    """The check itself, on a planted module of embeddings/."""
    (tmp_path / "x.py").write_text(source)
    assert violations("embeddings.x", tmp_path / "x.py") == expected


def test_a_reason_may_head_a_group_of_imports():
    lines = ["def f():", "    # only when asked: torch is slow to import", "    import torch", "    import numpy",
             "    import json", "    x = 1", "    import os"]
    assert [has_reason(lines, n) for n in (3, 4, 5, 7)] == [True, True, True, False]
