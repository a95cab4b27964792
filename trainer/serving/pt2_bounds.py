"""Bounds on the work a pt2 archive asks of its loader and of its graph (README "Trust").

Reading an archive, torch hands every shape expression to sympy, which evaluates it: one
`Pow(10, 100000000000)` keeps a loader busy for days, and memory grows with it. Running the
graph, an op with a crafted size (`arange(4e9)`, `empty`, `zeros`, `new_zeros`, `pad`, ...)
asks for more memory than the host has. So, before torch reads anything:

- a shape expression must be what rankmix's exports write, a linear form: a sum of integers,
  symbols and integer multiples of a symbol, or a comparison of two such sums, every integer
  within int64 (no Pow, no division, no Max: none of them appears in any export, and each can
  make sympy's work grow far beyond the text's length); a guard compares sums of input sizes
  and int64 integers. A linear form costs sympy work in proportion to its length.
- the whole archive's expressions and guards hold at most `MAX_PT2_TERMS` terms, of which at
  most `MAX_PT2_DISTINCT` distinct symbols, products and sums. That is the load's CPU and memory
  budget, checked on the text before anything is evaluated: torch's work per term is bounded in
  a linear form, so the budgets bound the parse (measured below). A runtime limit instead
  would be neither cheap nor sure: a signal (an alarm) waits for sympy's big-integer arithmetic
  to return and reaches the main thread only, RLIMIT_CPU or RLIMIT_AS on a server kills it (or,
  for RLIMIT_AS, breaks CUDA's address-space reservations) rather than refusing a file, and a
  child process that parses first costs a second torch import or a fork of a threaded process.
- every tensor the graph declares, and every tensor an allocating op makes from its arguments,
  is sized at the example inputs (the symbols' hints, as the export recorded them); each must
  fit in this host's memory, and so must the weights with every allocation together. A size
  that follows from a tensor's values (an unbacked symbol: TorchRec's jagged lengths, `item`)
  has no number before the graph runs, and is not checked here.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.checkpoint.safe_load import UnsafeFileError
from trainer.dist import node_memory_bytes

INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1
# Terms (integers, symbols, sums, products, comparisons) of all the shape expressions and guards
# of one archive, each time it appears, and the distinct symbols, products and sums among them,
# which torch keeps in a dict that it copies for each expression it reads (its work grows with
# the one times the other). The export of tests/test_trust_pt2.py holds 193 terms and 10 distinct
# ones; one of 64 sparse features 54k and 571 (both grow with the square of the features), which
# torch reads in 12 s here. At both budgets, a crafted archive of the costliest terms took 39 s of
# CPU and 89 MiB more memory here (2 busy cores); without them, one such archive ran past 10 min.
MAX_PT2_TERMS = 1 << 17
MAX_PT2_DISTINCT = 1 << 11
MAX_EXPRESSION_CHARS = 10_000  # per expression or guard

_RELATIONS = frozenset({"Equality", "Unequality", "LessThan", "StrictLessThan", "GreaterThan", "StrictGreaterThan"})
_ASSUMPTIONS = frozenset({"integer", "positive", "nonnegative"})
SYMBOL = re.compile(r"[a-z]{1,8}[0-9]{1,9}")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")

# A linear form: {symbol: its coefficient}, and the constant term.
Linear = tuple[dict[str, int], int]


class Budget:
    """The terms an archive's expressions and guards may still hold (`MAX_PT2_TERMS`)."""

    def __init__(self, path: Path, terms: int = MAX_PT2_TERMS, distinct: int = MAX_PT2_DISTINCT):
        self.path, self.left, self.limit, self.most = path, terms, terms, distinct
        self.seen: dict[str, tuple[Linear | None, int]] = {}  # expression -> (its form, its terms): parsed once
        self.distinct: set[tuple] = set()  # the symbols, products and sums that torch keeps

    def spend(self, terms: int) -> None:
        self.left -= terms
        if self.left < 0:
            raise UnsafeFileError(f"{self.path}: refused to load: its shape expressions and guards hold more than "
                                  f"{self.limit} terms, the budget of a load (reading them is sympy's work); see "
                                  "README, Trust")

    def keep(self, form: Linear) -> None:
        """Count the symbols, products and sum of `form` that torch keeps."""
        coefficients, constant = form
        self.distinct.update((name,) for name in coefficients)
        self.distinct.update((name, c) for name, c in coefficients.items() if c != 1)
        if len(coefficients) + (constant != 0) > 1:
            self.distinct.add((frozenset(coefficients.items()), constant))
        if len(self.distinct) > self.most:
            raise UnsafeFileError(f"{self.path}: refused to load: its shape expressions hold more than {self.most} "
                                  "distinct symbols, products and sums, the budget of a load (torch's work on each "
                                  "grows with their number); see README, Trust")


def expression(text: Any, budget: Budget) -> Linear | None:
    """The linear form of shape expression `text` ({} and 0 for a comparison), or None where
    `text` is not one that rankmix's exports write; its terms are spent from `budget` (torch
    parses each time an expression appears, so each time counts)."""
    if type(text) is str and text in budget.seen:
        form, terms = budget.seen[text]
    else:
        form, terms = _expression(_parsed(text))
        if type(text) is str:
            budget.seen[text] = form, terms
        if form is not None:
            budget.keep(form)
    budget.spend(terms)
    return form


def _expression(tree: ast.AST | None) -> tuple[Linear | None, int]:
    """(the linear form of a comparison of linear forms or a linear form, or None; its terms)."""
    if tree is None:
        return None, 0
    if isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id in _RELATIONS:
        sides = [_linear(arg) for arg in tree.args]
        if tree.keywords or len(sides) != 2 or None in sides:
            return None, 0
        return ({}, 0), 1 + sum(terms for _, _, terms in sides)
    form = _linear(tree)
    return (None, 0) if form is None else ((form[0], form[1]), form[2])


def _linear(node: ast.AST) -> tuple[dict[str, int], int, int] | None:
    """(coefficients, constant, terms) of `Add` of terms, or of one term, else None."""
    args = node.args if _call(node, "Add") and len(node.args) >= 2 and not node.keywords else [node]
    coefficients: dict[str, int] = {}
    constant, terms = 0, len(args) > 1
    for arg in args:
        term = _term(arg)
        if term is None:
            return None
        name, value, n = term
        terms += n
        if name is None:
            constant += value
        else:
            coefficients[name] = coefficients.get(name, 0) + value
    return coefficients, constant, terms


def _term(node: ast.AST) -> tuple[str | None, int, int] | None:
    """(symbol or None, coefficient or integer, terms) of an integer, a symbol or `Mul` of an
    integer and a symbol, else None."""
    value = _integer(node)
    if value is not None:
        return None, value, 1
    name = _symbol(node)
    if name is not None:
        return name, 1, 1
    if _call(node, "Mul") and len(node.args) == 2 and not node.keywords:
        for a, b in (node.args, node.args[::-1]):
            value, name = _integer(a), _symbol(b)
            if value is not None and name is not None:
                return name, value, 3
    return None


def _integer(node: ast.AST) -> int | None:
    """The value of an int64 literal, `-literal` or `Integer(literal)`, else None."""
    if _call(node, "Integer") and len(node.args) == 1 and not node.keywords:
        node = node.args[0]
    negative = isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
    node = node.operand if negative else node
    if not (isinstance(node, ast.Constant) and type(node.value) is int):
        return None
    value = -node.value if negative else node.value
    return value if INT64_MIN <= value <= INT64_MAX else None


def _symbol(node: ast.AST) -> str | None:
    """The name of `Symbol('s0', integer=True, ...)`, else None."""
    if _call(node, "Symbol") and len(node.args) == 1 and isinstance(node.args[0], ast.Constant) and \
            type(node.args[0].value) is str and SYMBOL.fullmatch(node.args[0].value) and \
            all(k.arg in _ASSUMPTIONS and isinstance(k.value, ast.Constant) and type(k.value.value) is bool
                for k in node.keywords):
        return node.args[0].value
    return None


def _call(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name


def guard(code: Any, budget: Budget) -> bool:
    """`code` compares sums of sizes of the inputs (`L['name'].size()[i]`) and int64 integers,
    each term maybe times an integer; its terms are spent from `budget`."""
    tree = _parsed(code)
    if not (isinstance(tree, ast.Compare) and len(tree.ops) == 1 and
            isinstance(tree.ops[0], (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE))):
        return False
    terms = [0]

    def term(node: ast.AST, depth: int = 0) -> bool:
        terms[0] += 1
        if depth > 64:  # a sum of many terms nests to the left; deeper is no guard torch writes
            return False
        if _integer(node) is not None and not _call(node, "Integer"):
            return True
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
            return term(node.left, depth + 1) and term(node.right, depth + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            return (_integer(node.left) is not None and _size(node.right)) or \
                (_size(node.left) and _integer(node.right) is not None)
        return _size(node)
    if not (term(tree.left) and term(tree.comparators[0])):
        return False
    budget.spend(terms[0])
    return True


def _size(node: ast.AST) -> bool:
    """`node` is `L['name'].size()[i]`."""
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
        type(node.slice.value) is int and 0 <= node.slice.value < 64 and isinstance(call := node.value, ast.Call) and \
        not call.args and not call.keywords and isinstance(call.func, ast.Attribute) and \
        call.func.attr == "size" and isinstance(arg := call.func.value, ast.Subscript) and \
        isinstance(arg.value, ast.Name) and arg.value.id == "L" and isinstance(arg.slice, ast.Constant) and \
        type(arg.slice.value) is str and bool(_IDENTIFIER.fullmatch(arg.slice.value))


def _parsed(text: Any) -> ast.AST | None:
    """The tree of Python expression `text` of at most `MAX_EXPRESSION_CHARS` characters, else None."""
    if type(text) is not str or len(text) > MAX_EXPRESSION_CHARS:
        return None
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def is_int64(value: Any) -> bool:
    return type(value) is int and INT64_MIN <= value <= INT64_MAX


# The ops of PT2_OPS that make a new tensor whose size their arguments give, not their inputs'
# sizes: the argument that sizes it. (Every other op's output follows from its inputs, and its
# declared size is checked with every tensor's.)
_ALLOCATING = {"torch.ops.aten.arange.default": "end", "torch.ops.aten.empty.memory_format": "size",
               "torch.ops.aten.zeros.default": "size", "torch.ops.aten.ones.default": "size",
               "torch.ops.aten.new_zeros.default": "size", "torch.ops.aten.pad.default": "pad",
               "torch.ops.aten.repeat_interleave.self_Tensor": "output_size",
               "torch.ops.aten.scalar_tensor.default": "s"}
_ITEMSIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 2, 7: 4, 8: 8, 12: 1, 13: 2}  # serde ScalarType -> bytes
_WIDEST = 16  # a complex128, the widest dtype torch has: where a dtype is not one of the above


class Sizes:
    """Sizes in a serialized graph, as numbers at the example inputs: each symbol at its hint
    (the size the export traced with), None where a size follows from data (no hint)."""

    def __init__(self, graph: dict, forms: dict[str, Linear], hints: dict[str, int]):
        self.graph, self.forms, self.hints = graph, forms, hints

    def value(self, arg: Any) -> int | float | None:
        """A SymInt or Scalar argument ({"as_int": n}, {"as_expr": ...}, {"as_sym_int": ...},
        {"as_name": a name of the graph's sym_int_values}) as a number, or None."""
        kind, body = _only(arg)
        if kind == "as_sym_int":
            kind, body = _only(body)
        if kind == "as_name" and type(body) is str:
            kind, body = _only(self.graph["sym_int_values"].get(body))
        if kind in ("as_int", "as_float") and type(body) in (int, float):
            return body
        if kind == "as_expr" and type(body) is dict and body.get("expr_str") in self.forms:
            coefficients, constant = self.forms[body["expr_str"]]
            if all(name in self.hints for name in coefficients):
                return constant + sum(c * self.hints[name] for name, c in coefficients.items())
        return None

    def shape(self, sizes: Any) -> list[int | float | None]:
        return [self.value(s) for s in sizes] if type(sizes) is list else [None]

    def tensor(self, name: str) -> tuple[list[int | float | None], int]:
        """(the sizes, the bytes per element) the graph declares for tensor `name`."""
        meta = self.graph["tensor_values"].get(name)
        if type(meta) is not dict:
            return [None], _WIDEST
        return self.shape(meta.get("sizes")), _ITEMSIZES.get(meta.get("dtype"), _WIDEST)


def hints(forms: dict[str, Linear], expressions: Iterable[dict]) -> dict[str, int]:
    """{symbol: the size the export traced with}, from the expressions that are one symbol."""
    found = {}
    for item in expressions:
        form, hint = forms.get(item["expr_str"]), item.get("hint")
        if form and form[1] == 0 and len(form[0]) == 1 and next(iter(form[0].values())) == 1 and \
                type(hint) is dict and type(hint.get("as_int")) is int:
            found[next(iter(form[0]))] = hint["as_int"]
    return found


def check_allocations(graph: dict, sizes: Sizes, payload_bytes: int, cap: int, path: Path) -> None:
    """Refuse a graph one of whose tensors, at the example inputs, takes more than `cap` bytes,
    or whose allocating ops' tensors together with its payloads (`payload_bytes`) do."""
    def refuse(what: str, need: float) -> UnsafeFileError:
        return UnsafeFileError(f"{path}: refused to load: {what} would take {need / 2 ** 30:.1f} GiB at the example "
                               f"inputs, more than this host's {cap / 2 ** 30:.1f} GiB of memory; see README, Trust")
    made = {}  # tensor name -> "node <name> (<op>)", for the messages
    total, largest = payload_bytes, ("its weights", payload_bytes)
    for node in graph["nodes"]:
        outputs = [_tensor_name(o) for o in node["outputs"] if _tensor_name(o)]
        kind, many = _only(node["outputs"][0] if len(node["outputs"]) == 1 else None)
        listed = many if kind == "as_tensors" and type(many) is list else []
        for name in outputs + [_tensor_name({"as_tensor": t}) for t in listed]:
            made[name] = f"node {name} ({node['target']})"
        if node["target"] not in _ALLOCATING or not outputs:
            continue
        arguments = {i["name"]: i["arg"] for i in node["inputs"] if type(i) is dict and type(i.get("name")) is str}
        elements = _elements(node["target"], arguments, sizes)
        _, itemsize = sizes.tensor(outputs[0])
        what = f"node {outputs[0]} ({node['target']})"
        if elements is None:  # its size follows from values (TorchRec's jagged lengths): known only as it runs
            continue
        need = elements * (itemsize if "dtype" not in arguments else _dtype_size(arguments["dtype"]))
        if need > cap:
            raise refuse(what, need)
        total += need
        largest = max(largest, (what, need), key=lambda x: x[1])
    if total > cap:
        raise refuse(f"its weights and allocations together (the largest: {largest[0]})", total)
    for name in graph["tensor_values"]:
        shape, itemsize = sizes.tensor(name)
        if None not in shape and (need := _product(shape) * itemsize) > cap:
            raise refuse(made.get(name, f"tensor {name[:100]}"), need)


def _elements(op: str, arguments: dict, sizes: Sizes) -> int | float | None:
    """The elements of the tensor allocating op `op` makes from its `arguments`, or None."""
    if op == "torch.ops.aten.scalar_tensor.default":
        return 1
    if op == "torch.ops.aten.arange.default":
        end = sizes.value(arguments.get("end"))
        return None if end is None else max(0, math.inf if not math.isfinite(end) else math.ceil(end))
    arg = arguments.get(_ALLOCATING[op])
    if op == "torch.ops.aten.repeat_interleave.self_Tensor":
        if arg is None or arg == {"as_none": True}:
            return None  # the sum of `repeats`, a tensor's values
        count, dim = sizes.value(arg), sizes.value(arguments.get("dim"))
        if count is None or dim is None:  # without dim, `self` is flattened: `count` elements
            return count
        shape, _ = sizes.tensor(_tensor_name(arguments.get("self")))
        if None in shape or type(dim) is not int or not -len(shape) <= dim < len(shape):
            return None
        return count * _product(shape[:dim] + shape[dim + 1:] if dim != -1 else shape[:-1])
    shape = _ints(arg, sizes)
    if shape is None:
        return None
    if op == "torch.ops.aten.pad.default":  # pad: (before, after) per dimension from the last
        base, _ = sizes.tensor(_tensor_name(arguments.get("self")))
        if None in base or len(shape) % 2 or len(shape) // 2 > len(base):
            return None
        for i in range(len(shape) // 2):
            base[-1 - i] += shape[2 * i] + shape[2 * i + 1]
        shape = base
    return _product(shape)


def _ints(arg: Any, sizes: Sizes) -> list[int | float] | None:
    """An int list argument (as_ints, as_sym_ints) as numbers, or None."""
    if type(arg) is not dict or len(arg) != 1:
        return None
    (kind, body), = arg.items()
    if kind not in ("as_ints", "as_sym_ints") or type(body) is not list:
        return None
    values = [b if kind == "as_ints" else sizes.value(b) for b in body]
    return None if any(type(v) is not int for v in values) else values


def _product(shape: list) -> int | float:
    """The elements of a tensor of `shape` (a negative size counts as none: torch refuses it),
    inf once past 2^80 (so that a list of a million sizes costs no big-number arithmetic)."""
    if any(n <= 0 for n in shape):
        return 0
    elements = 1
    for n in shape:
        elements *= n
        if elements > 2 ** 80:
            return math.inf
    return elements


def _tensor_name(arg: Any) -> str:
    kind, body = _only(arg)
    return body["name"] if kind == "as_tensor" and type(body) is dict and type(body.get("name")) is str else ""


def _only(arg: Any) -> tuple[str | None, Any]:
    """(key, value) of a dict of one entry (how the graph writes a union), else (None, None)."""
    return next(iter(arg.items())) if type(arg) is dict and len(arg) == 1 else (None, None)


def _dtype_size(arg: Any) -> int:
    return _ITEMSIZES.get(arg.get("as_scalar_type"), _WIDEST) if type(arg) is dict else _WIDEST


def host_memory() -> int:
    """The memory a graph's tensors may take: this node's, within its cgroup's limit."""
    return node_memory_bytes()
