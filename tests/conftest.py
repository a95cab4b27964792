"""The suite runs on the CPU (gloo) even on a GPU host: its exact-equality checks rely on
CPU determinism, and its multi-rank tests start more ranks than a host may have GPUs."""

import importlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

os.environ["CUDA_VISIBLE_DEVICES"] = ""

# `make test` runs pytest-xdist workers side by side: each one's OpenMP pool, and those of the
# runs it starts, get their share of the cores. Pools sized for the whole machine spin
# against each other and run several times slower (docs/design.md §4.15).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(scope="session")
def made_once(tmp_path_factory) -> Callable[[str, Callable[[Path], None]], Path]:
    """`made_once(name, make)`: a folder that `make` fills once per test session, also when
    pytest-xdist's workers (`make test`) share the session: the first to ask makes it under a
    file lock, the others wait for it and reuse it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the workers' basetemps share this parent

    def get(name: str, make: Callable[[Path], None]) -> Path:
        folder = root / name
        with FileLock(f"{folder}.lock"):
            if not (folder / ".made").exists():
                shutil.rmtree(folder, ignore_errors=True)  # a failed attempt's leftovers
                folder.mkdir()
                make(folder)
                (folder / ".made").touch()
        return folder
    return get


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest tests (marked slow) first: pytest-xdist's workers then finish together,
    instead of one of them starting the README's two minutes last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_collection_finish(session: pytest.Session) -> None:
    """`make test-mutation` names in RANKMIX_MUTATION_WARM ("module:function,...") the cached
    makers of a target's costly inputs (the pt2 export: 1.3 s). mutmut collects once, then
    forks a child per mutant: called here, they are made before the fork and inherited."""
    for name in filter(None, os.environ.get("RANKMIX_MUTATION_WARM", "").split(",")):
        module, _, function = name.partition(":")
        getattr(importlib.import_module(module), function)()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under `make test-mutation`: a mutant's child that ran no test (pytest's usage error: a test
    id it could not select; or none collected) is noted in RANKMIX_MUTATION_UNRUN, since mutmut
    records such a child as the mutant killed. tests/mutation.py fails the run on any note."""
    notes, mutant = os.environ.get("RANKMIX_MUTATION_UNRUN"), os.environ.get("MUTANT_UNDER_TEST", "")
    if notes and "__mutmut_" in mutant and exitstatus in (pytest.ExitCode.USAGE_ERROR,
                                                          pytest.ExitCode.NO_TESTS_COLLECTED):
        with open(notes, "a") as out:
            out.write(f"{mutant}: pytest exit {int(exitstatus)} on {' '.join(session.config.args[:3])} ...\n")
