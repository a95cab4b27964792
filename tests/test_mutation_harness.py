"""`make test-mutation`'s own logic (tests/mutation.py, tests/mutation_hooks.py): which modules
mutate in one run, and the order a mutant's child runs its tests in."""

import json
from types import SimpleNamespace

import pytest

import mutation
import mutation_hooks


def test_every_module_is_in_at_most_one_run_and_every_run_names_modules():
    members = [name for run in mutation.RUNS for name in run]
    assert len(members) == len(set(members))
    assert set(members) <= set(mutation.MODULES)


def test_the_modules_asked_for_mutate_in_their_runs_named_after_the_first_asked():
    runs = mutation.runs_of(["moe", "reader", "elastic", "safe_pt2_program"])
    assert runs == {"moe": ["moe"], "reader": ["reader", "elastic"], "safe_pt2_program": ["safe_pt2_program"]}


def items(*names: str) -> list:
    return [SimpleNamespace(nodeid=f"t.py::{name}") for name in names]


def ordered(tmp_path, monkeypatch, mutant: str, kills: list[tuple[str, str]], durations: dict[str, float],
            names: tuple[str, ...]) -> list[str]:
    """The order kill_first gives `names` in a child of `mutant`, after `kills` (function, test)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kills.txt").write_text("".join(f"{f}\tt.py::{t}\n" for f, t in kills))
    (tmp_path / mutation_hooks.STATS).write_text(json.dumps(
        {"duration_by_test": {f"t.py::{t}": s for t, s in durations.items()}}))
    monkeypatch.setenv(mutation_hooks.KILLS, str(tmp_path / "kills.txt"))
    monkeypatch.setenv("MUTANT_UNDER_TEST", mutant)
    collected = items(*names)
    mutation_hooks.kill_first(collected)
    return [item.nodeid.split("::")[1] for item in collected]


def test_a_child_runs_the_killers_of_its_siblings_first_then_of_others_then_the_fastest(tmp_path, monkeypatch):
    kills = [("m.x_f", "slow_killer"), ("m.x_f", "slow_killer"), ("m.x_g", "other_killer")]
    durations = {"slow_killer": 0.5, "other_killer": 0.5, "fast": 0.001, "slower": 0.01, "never": 0.5}
    names = ("never", "slower", "other_killer", "fast", "slow_killer")
    assert ordered(tmp_path, monkeypatch, "m.x_f__mutmut_3", kills, durations, names) == [
        "slow_killer", "fast", "slower", "other_killer", "never"]
    # a mutant of g: its own killer before f's, a test 100 times cheaper before either
    assert ordered(tmp_path, monkeypatch, "m.x_g__mutmut_1", kills, durations, names) == [
        "fast", "other_killer", "slow_killer", "slower", "never"]


def test_outside_a_mutant_child_the_order_is_kept(tmp_path, monkeypatch):
    kills = [("m.x_f", "b")]
    assert ordered(tmp_path, monkeypatch, "stats", kills, {"a": 1.0, "b": 0.1}, ("a", "b")) == ["a", "b"]
    monkeypatch.delenv(mutation_hooks.KILLS)
    collected = items("a", "b")
    mutation_hooks.kill_first(collected)
    assert [i.nodeid for i in collected] == ["t.py::a", "t.py::b"]


@pytest.mark.parametrize("outcome", ["failed", "passed"])
def test_a_failing_test_is_noted_as_a_killer_of_the_mutants_function(tmp_path, monkeypatch, outcome):
    monkeypatch.setenv(mutation_hooks.KILLS, str(tmp_path / "kills.txt"))
    monkeypatch.setenv("MUTANT_UNDER_TEST", "m.xǁCǁf__mutmut_12")
    mutation_hooks.note_kill(SimpleNamespace(failed=outcome == "failed", nodeid="t.py::a[1]"))
    mutation_hooks.note_kill(SimpleNamespace(failed=outcome == "failed", nodeid="t.py::b"))
    expected = "m.xǁCǁf\tt.py::a[1]\nm.xǁCǁf\tt.py::b\n" if outcome == "failed" else None
    assert ((tmp_path / "kills.txt").read_text() if (tmp_path / "kills.txt").exists() else None) == expected
