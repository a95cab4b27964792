"""mutmut's `run`, with each mutant's child running tests collected once, before the forks.

    python tests/mutation_fork.py run --max-children N [MUTANT ...]   (tests/mutation.py runs it)

mutmut's fork runner starts a whole pytest session in every child (`pytest.main` on the
mutant's test ids): options parsed, plugins and conftests loaded, the test files collected
again. That was most of a one-test mutant's 0.1 s of CPU over 11,000 mutants. Here the
parent, before its first fork, makes one session of the run's test files and collects it;
a child sets the session's items to its mutant's tests (in mutmut's order, then the
likeliest killers first: mutation_hooks.kill_first) and runs pytest's own test loop over
them, stopping at the first failure (-x) as mutmut's run does. A child whose tests are not
all among the collected ones (an id pytest would select otherwise) runs mutmut's way.

Output is not captured (-s): the parent's prints are mutmut's progress, and a child's go
to /dev/null as mutmut sets it; pytest's terminal reporter is left out of the children.
"""

from __future__ import annotations

import os
import sys

from _pytest.config import _prepareconfig
from _pytest.main import Session
from mutmut.__main__ import cli
from mutmut.configuration import config as mutmut_config
from mutmut.runners.harness import PytestRunner
from mutmut.workers.isolation import ForkRunner

import mutation_hooks

_prepared: dict[str, object] = {}  # "session", "items": {node id: item}, "folder": the session's working folder


def _prepare() -> None:
    """In mutmut's parent, once, before its first fork: a configured session, collected."""
    cfg = mutmut_config()
    args = ["--rootdir=.", "--tb=native", "-x", "-q", "-s", "-p", "no:randomly", "-p", "no:random-order",
            *cfg.pytest_add_cli_args_test_selection, *cfg.pytest_add_cli_args]
    folder = os.path.abspath("mutants")
    here = os.getcwd()
    os.chdir(folder)
    try:
        config = _prepareconfig(args)
        session = Session.from_config(config)
        config._do_configure()
        config.hook.pytest_sessionstart(session=session)
        config.hook.pytest_collection(session=session)
    finally:
        os.chdir(here)
    assert not session.testsfailed, f"collecting {args} failed"
    # a child's progress and failures would go to the run's log, the parent's stdout: mutmut's
    # own child writes them to /dev/null
    config.pluginmanager.unregister(name="terminalreporter")
    _prepared.update(session=session, items={item.nodeid: item for item in session.items}, folder=folder)


def _run_prepared(tests: list[str]) -> int | None:
    """In a mutant's child: its tests through pytest's loop; 1 when one fails, else 0. None
    when a test id is not among the collected items (the caller runs mutmut's way)."""
    items_by_id = _prepared.get("items", {})
    if not tests or any(t not in items_by_id for t in tests):
        return None
    session = _prepared["session"]
    items = [items_by_id[t] for t in tests]
    mutation_hooks.kill_first(items)
    session.items = items
    os.chdir(_prepared["folder"])
    try:
        session.config.hook.pytest_runtestloop(session=session)
    except (session.Failed, session.Interrupted):
        pass
    return 1 if session.testsfailed else 0


_startup = ForkRunner.startup
_run_tests = PytestRunner.run_tests


def startup(self: ForkRunner) -> None:
    _prepare()
    _startup(self)


def run_tests(self: PytestRunner, *, mutant_name: str | None, tests) -> int:
    tests = list(tests)
    code = _run_prepared(tests) if mutant_name else None
    return _run_tests(self, mutant_name=mutant_name, tests=tests) if code is None else code


if __name__ == "__main__":
    ForkRunner.startup = startup
    PytestRunner.run_tests = run_tests
    sys.exit(cli())
