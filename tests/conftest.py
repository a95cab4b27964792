"""The suite runs on the CPU (gloo) even on a GPU host: its exact-equality checks rely on
CPU determinism, and its multi-rank tests start more ranks than a host may have GPUs."""

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock

import mutation_hooks

os.environ["CUDA_VISIBLE_DEVICES"] = ""

# `make test` runs pytest-xdist workers side by side: each one's OpenMP pool, and those of the
# runs it starts, get their share of the cores. Pools sized for the whole machine spin
# against each other and run several times slower (docs/design.md §4.15).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture
def world_of_one(monkeypatch):
    """A process group of this process alone, as `rankmix score` makes, left as it was found."""
    # on use: torch, which the suite's other tests and mutation children need not import here
    import torch.distributed as dist

    from trainer.dist import init_distributed, shutdown

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)  # restored afterwards, as init_distributed sets them
    own = not dist.is_initialized()
    env = init_distributed("gloo", "cpu")
    yield env
    if own:
        shutdown()


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
    instead of one of them starting the README's two minutes last. Under `make
    test-mutation`, a mutant's likeliest killers first (tests/mutation_hooks.py)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    mutation_hooks.kill_first(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    mutation_hooks.warm()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    mutation_hooks.note_kill(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    mutation_hooks.note_unrun(session, exitstatus)
