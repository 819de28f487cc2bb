"""The arithmetic of `= expressions` in a spec (`default: = hidden // heads`).

Names are spec symbols; numbers, + - * / // **, parentheses, the calls `max(a, b, ...)` /
`min(a, b, ...)` (or of one list), list values (a symbol read from a config list, or a
literal `[a, b]`), `len(list)` and indexing `list[k]` are allowed; nothing else parses, so a
spec cannot run code.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}
_CALLS = {"max": max, "min": min, "len": len}
ALLOWED = "numbers, symbols, + - * / // **, max(...) / min(...), lists, len(list) and list[k]"


def _call(n: ast.AST) -> bool:
    """`max(a, b, ...)` / `min(...)` / `len(x)`: positional arguments only (len: one)."""
    return (
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in _CALLS
        and bool(n.args)
        and (n.func.id != "len" or len(n.args) == 1)
        and not n.keywords
        and not any(isinstance(a, ast.Starred) for a in n.args)
    )


def _len(v: Any) -> int:
    if not isinstance(v, list):
        raise TypeError(f"len() takes a list, got {v!r}")
    return len(v)


def _index(xs: Any, k: Any) -> Any:
    if not isinstance(xs, list) or isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"indexing takes a list and a whole number, got {xs!r}[{k!r}]")
    if not -len(xs) <= k < len(xs):
        raise ValueError(f"index {k} out of range for {xs!r}")
    return xs[k]


def names(expr: str) -> set[str]:
    """The symbols an expression uses; ValueError when it is not a plain arithmetic expression."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"expression {expr.strip()!r} does not parse ({e.msg})") from None
    out, calls = set(), set()
    for n in ast.walk(tree):
        if _call(n):
            calls.add(id(n.func))
        elif isinstance(n, ast.Name):
            if id(n) not in calls:
                out.add(n.id)
        elif not isinstance(
            n,
            (
                ast.Expression,
                ast.Constant,
                ast.BinOp,
                ast.UnaryOp,
                ast.USub,
                ast.Load,
                ast.List,
                ast.Subscript,
                *_BINOPS,
            ),
        ):
            raise ValueError(f"expression {expr.strip()!r}: only {ALLOWED} are allowed")
    return out


def evaluate(expr: str, lookup: Callable[[str], Any]) -> Any:
    """Arithmetic over symbols: names, numbers, + - * / // **, parentheses, max / min, lists,
    len() and indexing; nothing else."""

    def ev(n: ast.AST) -> Any:
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, ast.Name):
            return lookup(n.id)
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            return _BINOPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.List):
            return [ev(e) for e in n.elts]
        if isinstance(n, ast.Subscript) and not isinstance(n.slice, ast.Slice):
            return _index(ev(n.value), ev(n.slice))
        if _call(n):
            args = [ev(a) for a in n.args]
            return _len(args[0]) if n.func.id == "len" else _CALLS[n.func.id](*args)
        raise ValueError(f"expression {expr!r}: only {ALLOWED} are allowed")

    return ev(ast.parse(expr.strip(), mode="eval"))
