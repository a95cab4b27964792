"""What conftest.py does for `make test-mutation` (tests/mutation.py) alone: nothing of it
runs in `make test`, where none of these variables is set.

mutmut collects a target's tests once, then forks a child per mutant that runs the tests
calling the mutated function, in an order of its own (a set's), and stops at the first
failure. A mutant is killed by the first failing test; most fail the same few tests as
their siblings. So each child runs first the tests that killed most mutants of the same
function before (then of any), per second they take: a killed mutant then costs about one
test instead of a third of them.
"""

from __future__ import annotations

import importlib
import json
import os
from collections import Counter

import pytest

WARM = "RANKMIX_MUTATION_WARM"  # "module:function,...": cached makers of costly inputs
UNRUN = "RANKMIX_MUTATION_UNRUN"  # file: mutants whose child ran no test
KILLS = "RANKMIX_MUTATION_KILLS"  # file: "function<TAB>test id" for each test that failed a mutant
STATS = "mutmut-stats.json"  # mutmut's durations of the tests, in the children's working folder


def _mutant() -> str:
    """The mutant this process tests ("pkg.module.x_function__mutmut_7"), or ""."""
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    return mutant if "__mutmut_" in mutant else ""


def warm() -> None:
    """Call the makers named in RANKMIX_MUTATION_WARM: made before mutmut forks (the pt2
    export: 1.3 s), they are inherited by every child."""
    for name in filter(None, os.environ.get(WARM, "").split(",")):
        module, _, function = name.partition(":")
        getattr(importlib.import_module(module), function)()


def kill_first(items: list[pytest.Item]) -> None:
    """In a mutant's child: order `items` as the module docstring says (stable otherwise)."""
    mutant, kills = _mutant(), os.environ.get(KILLS)
    if not mutant or not kills:
        return
    function = mutant.rpartition("__mutmut_")[0]
    own, anyone = Counter(), Counter()
    if os.path.exists(kills):
        with open(kills) as f:
            for line in f:
                killer_of, _, test = line.rstrip("\n").partition("\t")
                anyone[test] += 1
                own[test] += killer_of == function
    durations = {}
    if os.path.exists(STATS):
        with open(STATS) as f:
            durations = json.load(f).get("duration_by_test", {})
    total = sum(anyone.values())

    def rate(item: pytest.Item) -> float:
        # likelihood to kill over cost: the order that stops soonest on average, were the tests'
        # failures independent; a test of no kill yet still runs early when it is cheap
        odds = own[item.nodeid] + anyone[item.nodeid] / (1 + total) + 0.01
        return odds / (durations.get(item.nodeid, 0.0) + 0.002)
    items.sort(key=rate, reverse=True)


def note_kill(report: pytest.TestReport) -> None:
    """In a mutant's child: a test that failed is noted as a killer of the mutant's function."""
    mutant, kills = _mutant(), os.environ.get(KILLS)
    if mutant and kills and report.failed:
        # one short append (O_APPEND): the children writing at once do not interleave lines
        with open(kills, "a") as f:
            f.write(f"{mutant.rpartition('__mutmut_')[0]}\t{report.nodeid}\n")


def note_unrun(session: pytest.Session, exitstatus: int) -> None:
    """In a mutant's child that ran no test (pytest's usage error: a test id it could not
    select; or none collected): noted in RANKMIX_MUTATION_UNRUN, since mutmut records such a
    child as the mutant killed. tests/mutation.py fails the run on any note."""
    notes, mutant = os.environ.get(UNRUN), _mutant()
    if notes and mutant and exitstatus in (pytest.ExitCode.USAGE_ERROR, pytest.ExitCode.NO_TESTS_COLLECTED):
        with open(notes, "a") as out:
            out.write(f"{mutant}: pytest exit {int(exitstatus)} on {' '.join(session.config.args[:3])} ...\n")
