"""A pt2 artifact cannot stall its loader nor ask for more memory than the host has
(trainer/serving/pt2_bounds.py, README "Trust"): its shape expressions and guards are linear
forms of int64 integers within a budget of terms, and its tensors, sized at the example inputs,
fit in this host's memory. Each test crafts an archive from the export of tests/test_trust_pt2.py;
a crafted archive that used to stall `rankmix score --model` runs as a command of its own, with a
deadline, so that the test fails rather than hangs where the bound is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cli import rankmix
from test_one_line_errors import one_line
from test_trust_pt2 import (  # noqa: F401
    PROGRAM,
    artifact,
    edited,
    entries,
    example,
    expression_refused,
    guard_refused,
    planted,
    refusal,
)
from trainer.checkpoint.safe_load import UnsafeFileError
from trainer.serving.export import load
from trainer.serving.pt2_bounds import MAX_PT2_DISTINCT, MAX_PT2_TERMS, host_memory
from trainer.serving.safe_pt2 import _PT2_DTYPES

HOST = host_memory()


def symbols(doc: dict) -> list[dict]:
    """The shape expressions of `doc` that are one symbol with a hint ({"expr_str", "hint"})."""
    found, stack = [], [doc]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("expr_str", "").startswith("Symbol(") and item.get("hint"):
                found.append(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def graph(doc: dict) -> dict:
    return doc["graph_module"]["graph"]


def node_of(doc: dict, op: str) -> dict:
    """The first node of `doc`'s graph that calls `op` (torch.ops.aten.<op>)."""
    return next(n for n in graph(doc)["nodes"] if n["target"] == f"torch.ops.aten.{op}")


def set_argument(doc: dict, op: str, name: str, value: dict) -> str:
    """Set argument `name` of the first `op` node to `value`; its output tensor's name."""
    node = node_of(doc, op)
    for i in node["inputs"]:
        if i["name"] == name:
            i["arg"] = value
            break
    else:
        node["inputs"].append({"name": name, "arg": value, "kind": 1})
    return node["outputs"][0]["as_tensor"]["name"]


def itemsize(doc: dict, tensor: str) -> int:
    return _PT2_DTYPES[graph(doc)["tensor_values"][tensor]["dtype"]].itemsize


def too_large(folder: Path, what: str, need: int) -> str:
    return (f"{folder / 'model.pt2'}: refused to load: {what} would take {need / 2 ** 30:.1f} GiB at the example "
            f"inputs, more than this host's {HOST / 2 ** 30:.1f} GiB of memory; see README, Trust")


def crafted(artifact: Path, dest: Path, change) -> tuple[Path, dict]:
    """A copy of the export whose program `change` edited; (its folder, the edited program)."""
    doc = {}

    def edit(program: dict) -> None:
        change(program)
        doc.update(program)
    return planted(artifact, dest, edited(entries(artifact), PROGRAM, edit)), doc


# ---------------------------------------------------------------------------- finding 1: shape expressions


def test_a_shape_expression_that_would_stall_sympy_is_refused_in_one_line(artifact, tmp_path):
    """Issue 55, finding 1: `Pow(10, 100000000000)` in place of a symbol kept `rankmix score
    --model` in sympy's Integer._eval_power until killed."""
    code = "Pow(10, 100000000000)"
    folder, _ = crafted(artifact, tmp_path / "model", lambda doc: symbols(doc)[0].update(expr_str=code))
    proc = rankmix("score", "--model", str(folder), "--data", str(tmp_path / "none"), "--out", str(tmp_path / "out"),
                   timeout=90)
    assert one_line(proc) == f"rankmix: error: {refusal(folder, expression_refused(code))}"


@pytest.mark.parametrize("code", [
    "Integer(9223372036854775808)", "-9223372036854775809", "Pow(Symbol('s0', integer=True), 2)",
    "Mul(Symbol('s0', integer=True), Symbol('s1', integer=True))", "Max(Symbol('s0', integer=True), 1)",
    "FloorDiv(Symbol('s0', integer=True), 2)", "Mod(Symbol('s0', integer=True), 2)", "Rational(1, 3)",
    "Add(Symbol('s0', integer=True))", "Mul(2, Add(Symbol('s0', integer=True), 1))",
    "Equality(Symbol('s0', integer=True), Symbol('s1', integer=True), Symbol('s2', integer=True))",
    "And(Equality(1, 1), Equality(2, 2))", "Add(-(-1), Symbol('s0', integer=True))", "1" + "0" * 5000,
], ids=["above-int64", "below-int64", "pow", "product", "max", "floordiv", "mod", "rational", "add-of-one",
        "mul-of-add", "three-sides", "and", "double-negation", "5000-digits"])
def test_a_shape_expression_beyond_a_linear_form_of_int64_integers_is_refused(artifact, tmp_path, code):
    folder, _ = crafted(artifact, tmp_path / "model", lambda doc: symbols(doc)[0].update(expr_str=code))
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, expression_refused(code))


@pytest.mark.parametrize("code", ["L['numeric'].size()[0] * 9223372036854775808 == L['lengths'].size()[1]",
                                  "L['numeric'].size()[0] == L['lengths'].size()[1] // 2",
                                  "L['numeric'].size()[0] * L['numeric'].size()[0] >= 0",
                                  "L['numeric'].size()[0] == " + " + ".join(["1"] * 100)],
                         ids=["above-int64", "floordiv", "product", "deep-sum"])
def test_a_guard_beyond_a_sum_of_sizes_and_int64_integers_is_refused(artifact, tmp_path, code):
    folder, _ = crafted(artifact, tmp_path / "model", lambda doc: doc.update(guards_code=[code]))
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, guard_refused(code))


def test_hints_and_ranges_beyond_int64_are_refused(artifact, tmp_path):
    big = {"as_int": 2 ** 63}
    folder, _ = crafted(artifact, tmp_path / "hint", lambda doc: symbols(doc)[0].update(hint=big))
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, f"a shape expression's hint {big} (not an int64 integer)")
    name = []

    def widen(doc: dict) -> None:
        name.append(next(iter(doc["range_constraints"])))
        doc["range_constraints"][name[0]]["max_val"] = 2 ** 63
    folder, doc = crafted(artifact, tmp_path / "range", widen)
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == refusal(folder, f"a shape symbol {name[0]!r} with range "
                                                 f"{doc['range_constraints'][name[0]]}")


def test_shape_expressions_beyond_the_budget_of_a_load_are_refused(artifact, tmp_path):
    """Each expression is bounded, and so are all of them together: copies of one sum of 3,000
    ones past `MAX_PT2_TERMS` terms."""
    total = "Add(" + ", ".join(["1"] * 3000) + ")"
    copies = MAX_PT2_TERMS // 3000 + 1
    folder, _ = crafted(artifact, tmp_path / "model", lambda doc: graph(doc)["sym_int_values"].update(
        {f"planted_{i}": {"as_expr": {"expr_str": total, "hint": None}} for i in range(copies)}))
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == (f"{folder / 'model.pt2'}: refused to load: its shape expressions and guards hold "
                                  f"more than {MAX_PT2_TERMS} terms, the budget of a load (reading them is sympy's "
                                  "work); see README, Trust")


def test_more_distinct_symbols_than_the_budget_of_a_load_are_refused(artifact, tmp_path):
    """torch copies its dict of every symbol, product and sum it has read for each expression."""
    folder, _ = crafted(artifact, tmp_path / "model", lambda doc: graph(doc)["sym_int_values"].update(
        {f"planted_{i}": {"as_expr": {"expr_str": f"Symbol('s{1000 + i}', integer=True)", "hint": None}}
         for i in range(MAX_PT2_DISTINCT + 1)}))
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == (f"{folder / 'model.pt2'}: refused to load: its shape expressions hold more than "
                                  f"{MAX_PT2_DISTINCT} distinct symbols, products and sums, the budget of a load "
                                  "(torch's work on each grows with their number); see README, Trust")


# ---------------------------------------------------------------------------- finding 2: allocations


def test_an_arange_beyond_the_hosts_memory_is_refused_in_one_line(artifact, tmp_path):
    """Issue 55, finding 2: aten.arange with a crafted end loaded, to allocate it at serve time."""
    end = HOST // 8 + 1
    out = []
    folder, doc = crafted(artifact, tmp_path / "model",
                          lambda doc: out.append(set_argument(doc, "arange.default", "end", {"as_int": end})))
    proc = rankmix("score", "--model", str(folder), "--data", str(tmp_path / "none"), "--out", str(tmp_path / "out"),
                   timeout=90)
    what = f"node {out[0]} (torch.ops.aten.arange.default)"
    assert one_line(proc) == f"rankmix: error: {too_large(folder, what, end * itemsize(doc, out[0]))}"


@pytest.mark.parametrize("op, name, value", [
    ("empty.memory_format", "size", lambda n: {"as_ints": [n]}),
    ("new_zeros.default", "size", lambda n: {"as_ints": [n, 1]}),
    ("new_zeros.default", "size", lambda n: {"as_sym_ints": [{"as_int": 1}, {"as_int": n}]}),
    ("repeat_interleave.self_Tensor", "output_size", lambda n: {"as_sym_int": {"as_int": n}}),
    ("arange.default", "end", lambda n: {"as_float": float(n)}),
], ids=["empty", "new_zeros", "new_zeros-sym-ints", "repeat_interleave", "arange-float"])
def test_an_allocation_beyond_the_hosts_memory_is_refused_before_torch_reads_the_graph(artifact, tmp_path, op, name,
                                                                                        value):
    elements = HOST + 1  # more than the host's memory in any dtype
    out = []
    folder, doc = crafted(artifact, tmp_path / "model",
                          lambda doc: out.append(set_argument(doc, op, name, value(elements))))
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == too_large(folder, f"node {out[0]} (torch.ops.aten.{op})",
                                           elements * itemsize(doc, out[0]))


def test_a_size_that_follows_from_the_example_inputs_is_sized_at_them(artifact, tmp_path):
    """arange(end=k * batch): the batch symbol's hint (the example's rows) sizes it."""
    found = {}

    def plant(doc: dict) -> None:
        symbol = symbols(doc)[0]
        found["hint"] = symbol["hint"]["as_int"]
        found["k"] = HOST // (8 * found["hint"]) + 1
        found["out"] = set_argument(doc, "arange.default", "end", {"as_sym_int": {"as_expr": {
            "expr_str": f"Mul(Integer({found['k']}), {symbol['expr_str']})", "hint": None}}})
    folder, doc = crafted(artifact, tmp_path / "model", plant)
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == too_large(folder, f"node {found['out']} (torch.ops.aten.arange.default)",
                                           found["k"] * found["hint"] * itemsize(doc, found["out"]))


def test_allocations_that_fit_one_by_one_but_not_together_are_refused(artifact, tmp_path):
    half = HOST // 2 + 1
    out = []

    def plant(doc: dict) -> None:
        out.append(set_argument(doc, "empty.memory_format", "size", {"as_ints": [half // itemsize(doc, node_of(
            doc, "empty.memory_format")["outputs"][0]["as_tensor"]["name"]) + 1]}))
        out.append(set_argument(doc, "new_zeros.default", "size", {"as_ints": [half // itemsize(doc, node_of(
            doc, "new_zeros.default")["outputs"][0]["as_tensor"]["name"]) + 1]}))
    folder, doc = crafted(artifact, tmp_path / "model", plant)
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    message = str(refused.value)
    assert message.startswith(f"{folder / 'model.pt2'}: refused to load: its weights and allocations together (the "
                              f"largest: node ") and message.endswith(f"GiB at the example inputs, more than this "
                                                                      f"host's {HOST / 2 ** 30:.1f} GiB of memory; "
                                                                      "see README, Trust")


def test_a_declared_tensor_beyond_the_hosts_memory_is_refused(artifact, tmp_path):
    """What an op's output takes follows from its inputs: the size the graph declares is checked."""
    name = []

    def plant(doc: dict) -> None:
        name.append(node_of(doc, "linear.default")["outputs"][0]["as_tensor"]["name"])
        graph(doc)["tensor_values"][name[0]]["sizes"] = [{"as_int": HOST}, {"as_int": 1}]
    folder, doc = crafted(artifact, tmp_path / "model", plant)
    with pytest.raises(UnsafeFileError) as refused:
        load(folder)
    assert str(refused.value) == too_large(folder, f"node {name[0]} (torch.ops.aten.linear.default)",
                                           HOST * itemsize(doc, name[0]))


def test_the_export_fits_and_loads_as_exported(artifact):
    """The bounds refuse none of the export's own expressions, guards or tensors."""
    model, _ = load(artifact)
    inputs, outputs = example(artifact)
    assert torch.equal(model(*inputs), outputs)
    doc = json.loads(dict((i.filename, d) for i, d in entries(artifact))[f"archive/{PROGRAM}"])
    assert symbols(doc) and graph(doc)["tensor_values"]
