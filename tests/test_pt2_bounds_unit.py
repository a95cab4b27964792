"""trainer/serving/pt2_bounds.py in-process, on expressions, guards and graphs written here as
JSON: each bound at its limit (the last accepted input and one term, integer, byte or element
past it) and each refusal's exact message. Fast, no export: the mutation target "pt2_bounds"
runs these (test_pt2_bounds.py crafts whole archives and runs `rankmix score`)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from param_ids import plain_ids
from trainer.checkpoint.safe_load import UnsafeFileError
from trainer.dist import node_memory_bytes
from trainer.serving.pt2_bounds import (
    INT64_MAX,
    INT64_MIN,
    MAX_EXPRESSION_CHARS,
    MAX_PT2_DISTINCT,
    MAX_PT2_TERMS,
    Budget,
    Sizes,
    _elements,
    _parsed,
    check_allocations,
    expression,
    guard,
    hints,
    host_memory,
    is_int64,
)

PATH = Path("m.pt2")
S0, S1 = "Symbol('s0', integer=True)", "Symbol('s1', positive=True, integer=True, nonnegative=True)"
GIB = 2 ** 30


def parse(text: str) -> tuple[dict, int] | None:
    """The linear form of `text` with a budget of its own, and the terms it spent."""
    budget = Budget(PATH)
    form = expression(text, budget)
    return form, MAX_PT2_TERMS - budget.left


# ---------------------------------------------------------------------------- shape expressions


@pytest.mark.parametrize("text, form, terms", [
    ("7", ({}, 7), 1), ("-7", ({}, -7), 1), ("Integer(7)", ({}, 7), 1), ("Integer(-7)", ({}, -7), 1),
    (str(INT64_MAX), ({}, INT64_MAX), 1), (str(INT64_MIN), ({}, INT64_MIN), 1),
    (f"Integer({INT64_MAX})", ({}, INT64_MAX), 1), (S0, ({"s0": 1}, 0), 1), (S1, ({"s1": 1}, 0), 1),
    (f"Mul(3, {S0})", ({"s0": 3}, 0), 3), (f"Mul({S0}, -3)", ({"s0": -3}, 0), 3),
    (f"Mul(Integer(4), {S0})", ({"s0": 4}, 0), 3),
    (f"Add(1, {S0})", ({"s0": 1}, 1), 3), (f"Add({S0}, 2, {S0}, Mul(5, {S1}), -4)", ({"s0": 2, "s1": 5}, -2), 8),
    (f"Equality({S0}, 3)", ({}, 0), 3), (f"StrictGreaterThan(Add({S0}, 1), {S1})", ({}, 0), 5),
    ("Unequality(1, 2)", ({}, 0), 3), ("LessThan(1, 2)", ({}, 0), 3), ("StrictLessThan(1, 2)", ({}, 0), 3),
    ("GreaterThan(1, 2)", ({}, 0), 3),
    ("Symbol('abcdefgh123456789', integer=True)", ({"abcdefgh123456789": 1}, 0), 1),
], ids=plain_ids(40))
def test_a_linear_form_is_read_with_its_terms(text, form, terms):
    assert parse(text) == (form, terms)


@pytest.mark.parametrize("text", [
    str(INT64_MAX + 1), str(INT64_MIN - 1), f"Integer({INT64_MAX + 1})", f"Integer({INT64_MIN - 1})", "True",
    "1.5", "'1'", "-(-1)", "Integer(1, 2)", "Integer(x=1)", "Integer()", "Neg(1)", "+1",
    "Symbol('S0', integer=True)", "Symbol('s', integer=True)", "Symbol('abcdefghi1', integer=True)",
    "Symbol('s1234567890', integer=True)", "Symbol('s0', real=True)", "Symbol('s0', integer=1)",
    "Symbol('s0', integer=x)", "Symbol('s0', 'integer')", "Symbol(s0)", "Symbol(0)", "Symbol()",
    "symbol('s0')", "x.Symbol('s0')",
    f"Mul({S0}, {S1})", "Mul(2, 3)", f"Mul(2, {S0}, 3)", f"Mul(2, {S0}, evaluate=False)", f"Mul({S0})",
    f"Add({S0})", "Add(1, 2, evaluate=False)", "Add(1, Add(1, 2))", f"Add(1, Pow({S0}, 2))",
    f"Equality({S0})", "Equality(1, 2, 3)", "Equality(1, 2, evaluate=False)", "Equality(1, Pow(2, 3))",
    "Equality(Pow(2, 3), 1)", "And(1, 2)", "x.Equality(1, 2)", "Pow(10, 100000000000)",
    "1 +", "", "(" * 200 + "x" + ")" * 200, "a\0", "1" * (MAX_EXPRESSION_CHARS + 1),
], ids=plain_ids(40))
def test_anything_else_is_no_linear_form_and_costs_no_terms(text):
    assert parse(text) == (None, 0)


@pytest.mark.parametrize("value", [None, 1, b"1", ["1"], {"1": 1}])
def test_an_expression_that_is_no_text_is_no_linear_form(value):
    assert parse(value) == (None, 0)


def test_an_expression_of_the_longest_length_is_read():
    text = "Add(" + ", ".join(["1"] * ((MAX_EXPRESSION_CHARS - 5) // 3)) + ")"
    text += " " * (MAX_EXPRESSION_CHARS - len(text))
    assert len(text) == MAX_EXPRESSION_CHARS
    assert parse(text) == (({}, (MAX_EXPRESSION_CHARS - 5) // 3), (MAX_EXPRESSION_CHARS - 5) // 3 + 1)
    assert _parsed(text + " ") is None and isinstance(_parsed(text), ast.Call)


def test_an_expression_is_parsed_once_and_its_terms_spent_each_time_it_appears():
    budget = Budget(PATH)
    text = f"Add(1, {S0})"
    assert expression(text, budget) == ({"s0": 1}, 1) and budget.left == MAX_PT2_TERMS - 3
    assert budget.seen == {text: (({"s0": 1}, 1), 3)}
    budget.seen[text] = (({"s9": 2}, 0), 5)  # the cached form and terms are what a second reading gives
    assert expression(text, budget) == ({"s9": 2}, 0) and budget.left == MAX_PT2_TERMS - 8
    assert expression("Pow(2, 3)", budget) is None and budget.seen["Pow(2, 3)"] == (None, 0)
    assert budget.distinct == {("s0",), (frozenset({("s0", 1)}), 1)}  # a form read from the cache is not kept again
    assert expression(7, budget) is None and 7 not in budget.seen and budget.left == MAX_PT2_TERMS - 8


def test_the_terms_of_a_load_are_bounded():
    budget = Budget(PATH)
    budget.spend(MAX_PT2_TERMS - 1)
    budget.spend(1)
    assert budget.left == 0 and MAX_PT2_TERMS == 1 << 17
    with pytest.raises(UnsafeFileError) as refused:
        budget.spend(1)
    assert str(refused.value) == (f"{PATH}: refused to load: its shape expressions and guards hold more than "
                                  f"{MAX_PT2_TERMS} terms, the budget of a load (reading them is sympy's work); see "
                                  "README, Trust")
    small = Budget(PATH, terms=3)
    assert expression("Add(1, 2)", small) == ({}, 3) and small.left == 0
    with pytest.raises(UnsafeFileError, match="more than 3 terms"):
        expression("1", small)


def test_the_distinct_symbols_products_and_sums_of_a_load_are_bounded():
    budget = Budget(PATH)
    for i in range(MAX_PT2_DISTINCT):
        expression(f"Symbol('s{i}', integer=True)", budget)
    assert len(budget.distinct) == MAX_PT2_DISTINCT == 1 << 11
    expression("Add(Symbol('s0', integer=True), 0)", budget)  # nothing new: a sum of one symbol and 0 is it
    expression("Integer(5)", budget)  # a constant alone is kept by no one
    with pytest.raises(UnsafeFileError) as refused:
        expression("Add(Symbol('s0', integer=True), 1)", budget)
    assert str(refused.value) == (f"{PATH}: refused to load: its shape expressions hold more than {MAX_PT2_DISTINCT} "
                                  "distinct symbols, products and sums, the budget of a load (torch's work on each "
                                  "grows with their number); see README, Trust")


def test_what_a_load_keeps_is_each_symbol_product_and_sum():
    budget = Budget(PATH, distinct=5)
    expression(f"Add(Mul(3, {S0}), {S1}, 2)", budget)
    assert budget.distinct == {("s0",), ("s1",), ("s0", 3), (frozenset({("s0", 3), ("s1", 1)}), 2)}
    expression(f"Add({S0}, {S1})", budget)
    assert (frozenset({("s0", 1), ("s1", 1)}), 0) in budget.distinct and len(budget.distinct) == 5
    with pytest.raises(UnsafeFileError, match="more than 5 distinct"):
        expression(f"Mul(2, {S1})", budget)


# ---------------------------------------------------------------------------- guards


@pytest.mark.parametrize("code, terms", [
    ("L['ids'].size()[0] == 3", 2), ("L['ids'].size()[63] != -3", 2), ("L['a_1'].size()[1] < 2", 2),
    ("L['ids'].size()[0] <= L['lengths'].size()[1]", 2), ("3 > L['ids'].size()[0]", 2),
    (f"L['ids'].size()[0] >= {INT64_MIN}", 2), (f"{INT64_MAX} == L['ids'].size()[0]", 2),
    ("L['ids'].size()[0] + 2 - L['x'].size()[1] == 1", 6), ("2 * L['ids'].size()[0] == L['x'].size()[0] * 3", 2),
    ("L['ids'].size()[0] == " + " + ".join(["1"] * 65), 130),
    ("L['ids'].size()[0] == " + "1 + (" * 64 + "1" + ")" * 64, 130),
], ids=plain_ids(40))
def test_a_guard_of_sums_of_sizes_and_int64_integers_is_accepted_with_its_terms(code, terms):
    budget = Budget(PATH)
    assert guard(code, budget) is True and MAX_PT2_TERMS - budget.left == terms


@pytest.mark.parametrize("code", [
    "L['ids'].size()[0] == " + " + ".join(["1"] * 66), "L['ids'].size()[0] == " + "1 + (" * 65 + "1" + ")" * 65,
    f"L['ids'].size()[0] == {INT64_MAX + 1}",
    f"L['ids'].size()[0] == {INT64_MIN - 1}", "L['ids'].size()[0] == Integer(1)", "L['ids'].size()[0]",
    "1 < L['ids'].size()[0] < 3", "L['ids'].size()[0] is 1", "L['ids'].size()[0] in 1", "L['ids'].size()[0] == 1.0",
    "L['ids'].size()[0] * L['ids'].size()[0] == 1", "2 * 3 == L['ids'].size()[0]", "L['ids'].size()[0] * x == 1",
    "L['ids'].size()[0] // 2 == 1", "L['ids'].size()[0] ** 2 == 1", "L['ids'].size()[64] == 1",
    "L['ids'].size()[-1] == 1", "L['ids'].size()['0'] == 1", "L['ids'].size(0)[0] == 1",
    "L['ids'].size(x=0)[0] == 1", "L['ids'].shape()[0] == 1", "M['ids'].size()[0] == 1", "L[0].size()[0] == 1",
    "L['i d'].size()[0] == 1", "L.ids.size()[0] == 1", "size()[0] == 1", "L['ids'].size[0] == 1",
    "L['ids'].size()[0:1] == 1", "x == 1", "(lambda: 1)() == 1", "1 == 1 == 1", "-L['ids'].size()[0] == 1",
    "L['ids'].size()[0] == " + "1" * (MAX_EXPRESSION_CHARS - 20), "", "1 ==", None, 3,
], ids=plain_ids(40))
def test_any_other_guard_is_refused_and_costs_no_terms(code):
    budget = Budget(PATH)
    assert guard(code, budget) is False and budget.left == MAX_PT2_TERMS


def test_a_guard_spends_from_the_budget():
    budget = Budget(PATH, terms=3)
    assert guard("L['ids'].size()[0] == 2", budget) and guard("x == 2", budget) is False and budget.left == 1
    with pytest.raises(UnsafeFileError, match="more than 3 terms"):
        guard("L['ids'].size()[0] + 1 == 2", budget)


@pytest.mark.parametrize("value, fits", [(0, True), (INT64_MAX, True), (INT64_MIN, True), (INT64_MAX + 1, False),
                                         (INT64_MIN - 1, False), (True, False), (1.0, False), ("1", False)])
def test_int64_is_the_range_of_int64(value, fits):
    assert is_int64(value) is fits and (INT64_MIN, INT64_MAX) == (-2 ** 63, 2 ** 63 - 1)


# ---------------------------------------------------------------------------- sizes at the example inputs


def sizes(graph: dict | None = None, **hint: int) -> Sizes:
    """Sizes of `graph` where s0 = 2 s1 + 3 and s1 is a symbol of hint `hint['s1']`."""
    forms = {"A": ({"s0": 2, "s1": 1}, 3), "B": ({"s1": 1}, 0), "C": ({"s2": 1}, 0)}
    return Sizes(graph or {"sym_int_values": {}, "tensor_values": {}}, forms, {"s0": 5, **hint})


@pytest.mark.parametrize("arg, value", [
    ({"as_int": 7}, 7), ({"as_float": 2.5}, 2.5), ({"as_int": 2.5}, 2.5), ({"as_sym_int": {"as_int": 4}}, 4),
    ({"as_expr": {"expr_str": "A"}}, 17), ({"as_sym_int": {"as_expr": {"expr_str": "A", "hint": None}}}, 17),
    ({"as_expr": {"expr_str": "C"}}, None), ({"as_expr": {"expr_str": "D"}}, None), ({"as_expr": "A"}, None),
    ({"as_name": "n"}, 9), ({"as_sym_int": {"as_name": "n"}}, 9), ({"as_name": "m"}, None), ({"as_name": 1}, None),
    ({"as_int": "7"}, None), ({"as_int": None}, None), ({"as_float": "n"}, None), ({"as_bool": True}, None),
    ({"as_int": 1, "x": 2}, None),
    ({}, None), (None, None), (7, None),
], ids=plain_ids(40))
def test_a_size_argument_is_its_number_at_the_example_inputs(arg, value):
    got = sizes({"sym_int_values": {"n": {"as_int": 9}}, "tensor_values": {}}, s1=4).value(arg)
    assert got == value and type(got) is type(value)


def test_a_declared_tensor_is_its_sizes_and_bytes_per_element():
    graph = {"sym_int_values": {}, "tensor_values": {
        "a": {"sizes": [{"as_int": 2}, {"as_expr": {"expr_str": "B"}}], "dtype": 7},
        "b": {"sizes": [{"as_int": 2}], "dtype": 99}, "c": {"dtype": 13}, "d": [], "e": {"sizes": [], "dtype": 12}}}
    of = sizes(graph, s1=3)
    assert [of.tensor(n) for n in "abcdef"] == [([2, 3], 4), ([2], 16), ([None], 2), ([None], 16), ([], 1),
                                                ([None], 16)]
    assert [of.tensor("x")[1] for _ in ()] == [] and of.shape("x") == [None] and of.shape([]) == []


def test_the_hints_are_those_of_the_expressions_that_are_one_symbol():
    forms = {"s0": ({"s0": 1}, 0), "2s1": ({"s1": 2}, 0), "s2+1": ({"s2": 1}, 1), "s3": ({"s3": 1}, 0),
             "s4": ({"s4": 1}, 0), "s5": ({"s5": 1}, 0), "s6": ({"s6": 1}, 0), "cmp": ({}, 0),
             "two": ({"s7": 1, "s8": 1}, 0)}
    found = [{"expr_str": "s0", "hint": {"as_int": 4}}, {"expr_str": "2s1", "hint": {"as_int": 4}},
             {"expr_str": "s2+1", "hint": {"as_int": 4}}, {"expr_str": "s3"}, {"expr_str": "s4", "hint": None},
             {"expr_str": "s5", "hint": {"as_float": 4.0}}, {"expr_str": "s6", "hint": {"as_int": True}},
             {"expr_str": "cmp", "hint": {"as_int": 1}}, {"expr_str": "two", "hint": {"as_int": 1}},
             {"expr_str": "unknown", "hint": {"as_int": 1}}, {"expr_str": "s0", "hint": {"as_int": 0}}]
    assert hints(forms, found) == {"s0": 0}


# ---------------------------------------------------------------------------- allocations within the host's memory


def node(op: str, out: str, **arguments) -> dict:
    return {"target": f"torch.ops.aten.{op}", "outputs": [{"as_tensor": {"name": out}}],
            "inputs": [{"name": k, "arg": v, "kind": 1} for k, v in arguments.items()]}


def tensor(*shape: int, dtype: int = 7) -> dict:
    return {"sizes": [{"as_int": n} for n in shape], "dtype": dtype}


def check(nodes: list[dict], values: dict, cap: int, payload: int = 0, hint: int = 5) -> None:
    graph = {"nodes": nodes, "tensor_values": values, "sym_int_values": {}}
    check_allocations(graph, sizes(graph, s1=hint), payload, cap, PATH)


def too_large(what: str, need: int, cap: int) -> str:
    return (f"{PATH}: refused to load: {what} would take {need / GIB:.1f} GiB at the example inputs, more than this "
            f"host's {cap / GIB:.1f} GiB of memory; see README, Trust")


def refusal(nodes: list[dict], values: dict, cap: int, payload: int = 0) -> str:
    with pytest.raises(UnsafeFileError) as refused:
        check(nodes, values, cap, payload)
    return str(refused.value)


CAP = 3 * GIB


@pytest.mark.parametrize("op, arguments, dtype, elements", [
    ("arange.default", {"end": {"as_int": CAP // 4}}, 7, CAP // 4),
    ("arange.default", {"end": {"as_float": CAP / 4 - 0.5}}, 7, CAP // 4),
    ("arange.default", {"end": {"as_sym_int": {"as_expr": {"expr_str": "B"}}}}, 7, 5),
    ("empty.memory_format", {"size": {"as_ints": [CAP // 8, 2]}}, 7, CAP // 4),
    ("zeros.default", {"size": {"as_ints": [CAP // 4]}}, 7, CAP // 4),
    ("ones.default", {"size": {"as_sym_ints": [{"as_int": CAP // 20}, {"as_expr": {"expr_str": "B"}}]}}, 7,
     CAP // 20 * 5),
    ("new_zeros.default", {"size": {"as_ints": [CAP // 4]}}, 7, CAP // 4),
    ("new_zeros.default", {"size": {"as_ints": [CAP // 2]}, "dtype": {"as_scalar_type": 6}}, 7, CAP // 2),
    ("new_zeros.default", {"size": {"as_ints": [CAP]}, "dtype": {"as_scalar_type": 12}}, 7, CAP),
    ("new_zeros.default", {"size": {"as_ints": [CAP // 16]}, "dtype": {"as_scalar_type": 99}}, 1, CAP // 16),
    ("new_zeros.default", {"size": {"as_ints": [CAP // 16]}, "dtype": "x"}, 1, CAP // 16),
    ("pad.default", {"self": {"as_tensor": {"name": "in"}}, "pad": {"as_ints": [1, 2, 1000, 1]}}, 7, 2 * 1004 * 7),
    ("pad.default", {"self": {"as_tensor": {"name": "in"}}, "pad": {"as_ints": [1, 2]}}, 7, 2 * 3 * 7),
    ("pad.default", {"self": {"as_tensor": {"name": "in"}}, "pad": {"as_ints": [1, 2, 0, 1, 3, 0]}}, 7, 5 * 4 * 7),
    ("repeat_interleave.self_Tensor", {"output_size": {"as_sym_int": {"as_int": CAP // 4}}}, 7, CAP // 4),
    ("repeat_interleave.self_Tensor", {"output_size": {"as_int": 1000}, "dim": {"as_int": 1},
                                       "self": {"as_tensor": {"name": "in"}}}, 7, 8000),
    ("repeat_interleave.self_Tensor", {"output_size": {"as_int": 1000}, "dim": {"as_int": -3},
                                       "self": {"as_tensor": {"name": "in"}}}, 7, 12000),
    ("repeat_interleave.self_Tensor", {"output_size": {"as_int": 1000}, "dim": {"as_int": -1},
                                       "self": {"as_tensor": {"name": "in"}}}, 7, 6000),
    ("repeat_interleave.self_Tensor", {"output_size": {"as_int": 1000}, "dim": {"as_int": 0},
                                       "self": {"as_tensor": {"name": "in"}}}, 7, 12000),
    ("scalar_tensor.default", {"s": {"as_float": 2.0 ** 40}}, 5, 1),
], ids=["arange", "arange-float", "arange-symbol", "empty", "zeros", "ones-sym-ints", "new_zeros", "new_zeros-fp16",
        "new_zeros-bool", "new_zeros-other-dtype", "new_zeros-dtype-of-no-kind", "pad", "pad-last", "pad-every-dim",
        "repeat_interleave",
        "repeat_interleave-dim", "repeat_interleave-dim-from-the-end", "repeat_interleave-last-dim",
        "repeat_interleave-first-dim", "scalar_tensor"])
def test_an_allocation_of_the_hosts_memory_fits_and_one_byte_more_does_not(op, arguments, dtype, elements):
    """Each allocating op sized from its arguments at the example inputs (s1 = 5), in its dtype:
    at a cap of exactly its bytes it fits; one byte less, it is refused. Its input `in` is [2, 3, 4];
    its output's size is not declared (so that only the op's arguments size it)."""
    values = {"out": {"dtype": dtype}, **({"in": tensor(2, 3, 4, dtype=12)} if "self" in arguments else {})}
    if "dtype" in arguments and arguments["dtype"] != "x":
        size = {6: 2, 12: 1}.get(arguments["dtype"]["as_scalar_type"], 16)
    else:
        size = {7: 4, 5: 8, 1: 1}[dtype] if "dtype" not in arguments else 16
    need = elements * size
    check([node(op, "out", **arguments)], values, need)
    assert refusal([node(op, "out", **arguments)], values, need - 1) == too_large(
        f"node out (torch.ops.aten.{op})", need, need - 1)


@pytest.mark.parametrize("op, arguments", [
    ("arange.default", {"end": {"as_expr": {"expr_str": "C"}}}), ("arange.default", {}),
    ("empty.memory_format", {"size": {"as_sym_ints": [{"as_expr": {"expr_str": "C"}}]}}),
    ("empty.memory_format", {"size": {"as_ints": [2.0 ** 40]}}),
    ("empty.memory_format", {"size": {"as_ints": 2 ** 40}}), ("empty.memory_format", {"size": {"as_int": 2 ** 40}}),
    ("empty.memory_format", {"size": {"as_ints": [2 ** 40], "x": 1}}), ("empty.memory_format", {}),
    ("repeat_interleave.self_Tensor", {}), ("repeat_interleave.self_Tensor", {"output_size": {"as_none": True}}),
    ("repeat_interleave.self_Tensor", {"output_size": {"as_expr": {"expr_str": "C"}}}),
    ("repeat_interleave.self_Tensor", {"output_size": {"as_int": 2 ** 40}, "dim": {"as_int": 3},
                                       "self": {"as_tensor": {"name": "in"}}}),
    ("repeat_interleave.self_Tensor", {"output_size": {"as_int": 2 ** 40}, "dim": {"as_int": -4},
                                       "self": {"as_tensor": {"name": "in"}}}),
    ("repeat_interleave.self_Tensor", {"output_size": {"as_int": 2 ** 40}, "dim": {"as_float": 0.0},
                                       "self": {"as_tensor": {"name": "in"}}}),
    ("repeat_interleave.self_Tensor", {"output_size": {"as_int": 2 ** 40}, "dim": {"as_int": 0},
                                       "self": {"as_tensor": {"name": "unsized"}}}),
    ("pad.default", {"self": {"as_tensor": {"name": "in"}}, "pad": {"as_ints": [2 ** 40]}}),
    ("pad.default", {"self": {"as_tensor": {"name": "in"}}, "pad": {"as_ints": [0, 0, 0, 0, 0, 0, 2 ** 40, 0]}}),
    ("pad.default", {"self": {"as_tensor": {"name": "unsized"}}, "pad": {"as_ints": [2 ** 40, 0]}}),
    ("linear.default", {"size": {"as_ints": [2 ** 40]}}),
], ids=plain_ids(40))
def test_an_allocation_that_follows_from_values_is_not_sized_here(op, arguments):
    """TorchRec's jagged sizes and `repeats` are known only as the graph runs: not refused."""
    check([node(op, "out", **arguments)], {"out": {"dtype": 7}, "in": tensor(2, 3, 4), "unsized": {"dtype": 7}}, 100)


@pytest.mark.parametrize("output", [{"as_none": True}, {"as_sym_int": {"name": "out"}}, {"as_tensor": "out"},
                                    {"as_tensor": {"name": 5}}])
def test_an_allocation_with_no_tensor_output_is_not_sized(output):
    empty = {**node("empty.memory_format", "out", size={"as_ints": [2 ** 40]}), "outputs": [output]}
    check([empty], {}, 100)


def test_every_allocation_is_sized_after_one_that_follows_from_values():
    """Arguments of no name are skipped; an allocation of no size known here is passed over."""
    unknown = node("empty.memory_format", "a", size={"as_sym_ints": [{"as_expr": {"expr_str": "C"}}]})
    unknown["inputs"] += [5, {"name": 5, "arg": {"as_ints": [2 ** 40]}}]
    assert refusal([unknown, node("zeros.default", "b", size={"as_ints": [26]})], {"a": {"dtype": 7}}, 100) == \
        too_large("node b (torch.ops.aten.zeros.default)", 104, 100)


@pytest.mark.parametrize("end, elements", [(-5, 0), (0, 0), (2.5, 3), (-math.inf, None), (math.nan, None)])
def test_an_arange_makes_its_ends_elements(end, elements):
    got = _elements("torch.ops.aten.arange.default", {"end": {"as_float": end}}, sizes())
    assert got == elements if elements is not None else got == math.inf


def test_an_arange_to_infinity_is_refused():
    assert refusal([node("arange.default", "out", end={"as_float": math.inf})], {"out": tensor(1)}, CAP) == \
        too_large("node out (torch.ops.aten.arange.default)", math.inf, CAP)


@pytest.mark.parametrize("shape, elements", [([0, 2 ** 90], 0), ([-1, 5], 0), ([2 ** 40, 2 ** 40], 2 ** 80),
                                             ([2 ** 40, 2 ** 40, 2], math.inf), ([2 ** 81], math.inf), ([], 1),
                                             ([2 ** 81, 0], 0), ([5, 1, 1], 5)])
def test_a_shapes_elements_are_counted_up_to_2_to_the_80(shape, elements):
    assert _elements("torch.ops.aten.zeros.default", {"size": {"as_ints": shape}}, sizes()) == elements


def test_allocations_fit_together_with_the_weights_up_to_the_hosts_memory():
    """400 + 200 + 200 bytes of allocations (float32 zeros and ones, an int64 arange) and the weights."""
    nodes = [node("zeros.default", "a", size={"as_ints": [100]}), node("ones.default", "b", size={"as_ints": [50]}),
             node("arange.default", "c", end={"as_int": 25})]
    values = {"a": tensor(1), "b": tensor(1), "c": tensor(1, dtype=5)}
    check(nodes, values, 1200, payload=400)
    assert refusal(nodes, values, 800, payload=1) == too_large(
        "its weights and allocations together (the largest: node a (torch.ops.aten.zeros.default))", 801, 800)
    assert refusal(nodes, values, 1200, payload=401) == too_large(
        "its weights and allocations together (the largest: its weights)", 1601, 1200)
    check(nodes[1:], values, 400)
    assert refusal(nodes[1:], values, 399) == too_large(
        "its weights and allocations together (the largest: node b (torch.ops.aten.ones.default))", 400, 399)
    assert refusal([], {}, 5, payload=6) == too_large("its weights and allocations together (the largest: its "
                                                      "weights)", 6, 5)
    check([], {}, 6, payload=6)


def test_the_largest_allocation_is_named_when_they_do_not_fit_together():
    nodes = [node("zeros.default", "a", size={"as_ints": [10]}), node("ones.default", "b", size={"as_ints": [30]}),
             node("zeros.default", "c", size={"as_ints": [20]})]
    values = {"a": tensor(1), "b": tensor(1), "c": tensor(1)}
    assert refusal(nodes, values, 230, payload=11) == too_large(
        "its weights and allocations together (the largest: node b (torch.ops.aten.ones.default))", 251, 230)
    check(nodes, values, 251, payload=11)
    assert refusal(nodes, values, 250, payload=119) == too_large(
        "its weights and allocations together (the largest: node b (torch.ops.aten.ones.default))", 359, 250)
    assert refusal(nodes, values, 350, payload=120) == too_large(
        "its weights and allocations together (the largest: its weights)", 360, 350)


def test_a_declared_tensor_fits_in_the_hosts_memory_and_one_byte_more_does_not():
    values = {"x": {"sizes": [{"as_int": 3}, {"as_expr": {"expr_str": "B"}}], "dtype": 5}, "y": tensor(2, 2),
              "z": {"sizes": [{"as_expr": {"expr_str": "C"}}], "dtype": 5}}
    nodes = [node("linear.default", "y"), {**node("split_with_sizes.default", "u"), "outputs": [
        {"as_tensors": [{"name": "x"}, {"name": "w"}]}]}]
    check(nodes, values, 3 * 5 * 8)
    assert refusal(nodes, values, 3 * 5 * 8 - 1) == too_large("node x (torch.ops.aten.split_with_sizes.default)",
                                                              120, 119)
    assert refusal([], values, 119) == too_large("tensor x", 120, 119)
    assert refusal([], {"y": tensor(2, 2)}, 15) == too_large("tensor y", 16, 15)
    assert refusal([node("linear.default", "y")], {"y": tensor(2, 2)}, 15) == too_large(
        "node y (torch.ops.aten.linear.default)", 16, 15)
    many = {**node("split_with_sizes.default", "u"), "outputs": [{"as_tensors": [{"name": "y"}]}, {"as_int": 1}]}
    assert refusal([many], {"y": tensor(2, 2)}, 15) == too_large("tensor y", 16, 15)
    ints = {**node("split_with_sizes.default", "u"), "outputs": [{"as_sym_ints": [{"name": "y"}]}]}
    assert refusal([ints], {"y": tensor(2, 2)}, 15) == too_large("tensor y", 16, 15)
    check([], {"y": tensor(2, 2)}, 16)


def test_a_tensor_name_is_its_long_name():
    assert refusal([], {"t" * 150: tensor(4)}, 15) == too_large(f"tensor {'t' * 100}", 16, 15)


def test_the_hosts_memory_is_the_nodes():
    assert host_memory() == node_memory_bytes() > 0
