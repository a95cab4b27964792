"""A fuzz of a pt2 artifact's shape expressions, hints, ranges and guards (issue 55): every case
loads as exported, or is refused by a ValueError of one line naming the file, within 5 s of CPU
and twice the memory a normal load takes (trainer/serving/pt2_bounds.py, README "Trust").

Each case loads in a child forked from this process (torch and its pt2 reader already imported):
a case that stalled the loader is killed at a deadline and fails rather than hangs, and the child's
CPU time and peak resident memory are its own (getrusage in the child, against its memory at the
fork). A case the child loads is loaded again here and scored against the export's outputs."""

from __future__ import annotations

import multiprocessing
import resource
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_pt2_bounds import crafted, symbols
from test_trust_pt2 import artifact, example  # noqa: F401
from trainer.serving.export import load

CPU_SECONDS = 5.0
FUZZ = settings(max_examples=24, deadline=None, derandomize=True, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

INTS = st.one_of(st.sampled_from([0, 1, -1, 8, 2 ** 31, 2 ** 63 - 1, 2 ** 63, -2 ** 63 - 1, 10 ** 11, 10 ** 30]),
                 st.integers(-2 ** 70, 2 ** 70))
SYMBOLS = ["Symbol('s0', integer=True)", "Symbol('u0', integer=True)", "Symbol('s1', positive=True, integer=True)"]
CALLS = ["Add", "Mul", "Pow", "Max", "Min", "FloorDiv", "Mod", "Rational", "Equality", "Unequality", "LessThan",
         "GreaterThan", "StrictLessThan", "And", "Not"]
SIZES = ["L['numeric'].size()[0]", "L['lengths'].size()[1]", "L['ids'].size()[0]"]
OPERATORS = ["+", "-", "*", "//", "%", "**"]
COMPARISONS = ["==", "!=", "<=", ">=", "<", ">"]

expressions = st.recursive(
    st.one_of(INTS.map(str), INTS.map(lambda n: f"Integer({n})"), st.sampled_from(SYMBOLS)),
    lambda inner: st.builds(lambda f, args: f"{f}({', '.join(args)})", st.sampled_from(CALLS),
                            st.lists(inner, min_size=1, max_size=4)),
    max_leaves=10)
INT64 = st.one_of(st.sampled_from([0, 1, -1, 2 ** 63 - 1, -2 ** 63]), st.integers(-2 ** 63, 2 ** 63 - 1))
RELATIONS = ["Equality", "Unequality", "LessThan", "GreaterThan", "StrictLessThan", "StrictGreaterThan"]


def linear_forms(names: list[str]) -> st.SearchStrategy[str]:
    """Expressions within the bounds (sums of int64 integers and multiples of the export's
    symbols `names`, or comparisons of them), which torch then reads."""
    term = st.one_of(INT64.map(str), INT64.map(lambda n: f"Integer({n})"), st.sampled_from(names),
                     st.builds(lambda n, s: f"Mul(Integer({n}), {s})", INT64, st.sampled_from(names)))
    form = st.one_of(term, st.lists(term, min_size=2, max_size=6).map(lambda t: f"Add({', '.join(t)})"))
    return st.one_of(form, st.builds(lambda r, a, b: f"{r}({a}, {b})", st.sampled_from(RELATIONS), form, form))


terms = st.recursive(
    st.one_of(INTS.map(str), st.sampled_from(SIZES)),
    lambda inner: st.builds(lambda a, op, b: f"{a} {op} {b}", inner, st.sampled_from(OPERATORS), inner),
    max_leaves=6)
sums = st.lists(st.one_of(INT64.map(str), st.sampled_from(SIZES)), min_size=1, max_size=4).map(" + ".join)
guards = st.builds(lambda a, op, b: f"{a} {op} {b}", st.one_of(terms, sums), st.sampled_from(COMPARISONS),
                   st.one_of(terms, sums))


def _load(folder: str, conn) -> None:
    """In the child: load `folder`; send (outcome, CPU seconds, peak memory grown, in KiB)."""
    torch.set_num_threads(1)
    with open("/proc/self/status") as status:
        start = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    try:
        load(folder)
        outcome = "loaded"
    except ValueError as e:  # UnsafeFileError included
        outcome = f"refused: {e}"
    except BaseException as e:  # noqa: BLE001  reported, and failed by the test
        outcome = f"error: {type(e).__name__}: {e}"
    usage = resource.getrusage(resource.RUSAGE_SELF)
    conn.send((outcome, usage.ru_utime + usage.ru_stime, usage.ru_maxrss - start))


def load_in_child(folder: Path) -> tuple[str, float, int]:
    """(outcome, CPU seconds, KiB of memory grown) of `load(folder)` in a forked child."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_load, args=(str(folder), send))
    child.start()
    ready = receive.poll(20 * CPU_SECONDS)  # wall time: generous on a busy machine, CPU time is checked
    if not ready:
        child.kill()
    child.join()
    assert ready, f"loading {folder} did not end in {20 * CPU_SECONDS} s"
    return receive.recv()


@pytest.fixture(scope="module")
def normal_load(artifact) -> int:  # noqa: F811
    """The memory a load of the export takes (KiB; the most of two), torch's pt2 reader imported first."""
    load(artifact)
    outcomes = [load_in_child(artifact) for _ in range(2)]
    assert all(outcome == "loaded" for outcome, _, _ in outcomes), outcomes
    return max(grown for _, _, grown in outcomes)


@FUZZ
@given(data=st.data())
def test_a_mutated_expression_or_guard_loads_as_exported_or_is_refused_within_the_budget(
        artifact, normal_load, data):  # noqa: F811
    def mutate(doc: dict) -> None:
        for _ in range(data.draw(st.integers(1, 3))):
            kind = data.draw(st.sampled_from(["expression", "expression", "expression", "hint", "range", "guard"]))
            if kind in ("expression", "hint"):
                found = symbols(doc) if kind == "hint" else _all_expressions(doc)
                item = data.draw(st.sampled_from(found))
                if kind == "hint":
                    item["hint"] = {"as_int": data.draw(INTS)}
                else:
                    names = sorted({e["expr_str"] for e in symbols(doc)})
                    item["expr_str"] = data.draw(st.one_of(expressions, linear_forms(names)))
            elif kind == "range":
                name = data.draw(st.sampled_from(sorted(doc["range_constraints"])))
                doc["range_constraints"][name][data.draw(st.sampled_from(["min_val", "max_val"]))] = \
                    data.draw(st.one_of(st.none(), INTS))
            else:
                doc["guards_code"] = data.draw(st.lists(guards, min_size=1, max_size=3))
    with tempfile.TemporaryDirectory() as tmp:
        folder, _ = crafted(artifact, Path(tmp) / "model", mutate)
        outcome, cpu, grown = load_in_child(folder)
        assert cpu <= CPU_SECONDS, (outcome, cpu)
        assert grown <= 2 * normal_load, (outcome, grown, normal_load)
        if outcome.startswith("refused: "):
            assert "\n" not in outcome and str(folder) in outcome, outcome
            return
        assert outcome == "loaded", outcome
        model, _ = load(folder)
        inputs, outputs = example(artifact)
        try:
            scored = model(*inputs)
        except (AssertionError, RuntimeError) as e:  # a guard or range the case declares refuses the example's sizes
            assert "Guard failed" in str(e) or "Expected input" in str(e), str(e)
            return
        assert torch.equal(scored, outputs)


def _all_expressions(doc: dict) -> list[dict]:
    found, stack = [], [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "expr_str" in item:
                found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found
