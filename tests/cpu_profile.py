"""A pytest plugin: each test's CPU seconds, its own and every process it starts, robust to
the machine's load (wall times on a shared 2-core machine are not).

Each pytest(-xdist) worker moves itself into a cgroup v1 `cpuacct` group of its own, which
the processes it starts inherit (forked ranks, torchrun, subprocesses), and reads
`cpuacct.usage` before and after each test. Needs write access to /sys/fs/cgroup/cpuacct
(root in a container). One JSON line per test: {"id", "wall", "cpu"}.

    PYTHONPATH=tests CPU_PROFILE_OUT=/tmp/cpu .venv/bin/python -m pytest -n 2 -p cpu_profile tests -m "not bench"
    python3 -c "import json,glob; rows=[json.loads(l) for f in glob.glob('/tmp/cpu/*.jsonl') for l in open(f)]; \\
        [print(round(r['cpu'], 1), r['id']) for r in sorted(rows, key=lambda r: -r['cpu'])[:20]]"
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

CGROUPS = Path("/sys/fs/cgroup/cpuacct")


class _Profile:
    def __init__(self, out: Path) -> None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.group = CGROUPS / f"rankmix-tests-{worker}-{os.getpid()}"
        self.group.mkdir(exist_ok=True)
        (self.group / "cgroup.procs").write_text(str(os.getpid()))
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / f"{worker}.jsonl", "a")

    def usage(self) -> float:
        return int((self.group / "cpuacct.usage").read_text()) / 1e9


_profile: _Profile | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _profile
    _profile = _Profile(Path(os.environ.get("CPU_PROFILE_OUT", "cpu-profile")))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cpu, wall = _profile.usage(), time.monotonic()
    yield
    _profile.log.write(json.dumps({"id": item.nodeid, "wall": time.monotonic() - wall,
                                   "cpu": _profile.usage() - cpu}) + "\n")
    _profile.log.flush()


def pytest_unconfigure(config: pytest.Config) -> None:
    """Back to the root group; the worker's group goes once its last process has exited."""
    if _profile is not None:
        (CGROUPS / "cgroup.procs").write_text(str(os.getpid()))
        try:
            _profile.group.rmdir()
        except OSError:  # a process it started is still alive (the forkserver exits after this)
            pass
