"""The arithmetic of `= expressions` in a spec (`default: = hidden // heads`).

Names are spec symbols; numbers, + - * / // ** and parentheses are allowed; nothing else parses,
so a spec cannot run code.
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


def names(expr: str) -> set[str]:
    """The symbols an expression uses; ValueError when it is not a plain arithmetic expression."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"expression {expr.strip()!r} does not parse ({e.msg})") from None
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif not isinstance(
            n, (ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp, ast.USub, ast.Load, *_BINOPS)
        ):
            raise ValueError(
                f"expression {expr.strip()!r}: only numbers, symbols and + - * / // ** are allowed"
            )
    return out


def evaluate(expr: str, lookup: Callable[[str], Any]) -> Any:
    """Arithmetic over symbols: names, numbers, + - * / // ** and parentheses; nothing else."""

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
        raise ValueError(f"expression {expr!r}: only numbers, symbols and + - * / // ** are allowed")

    return ev(ast.parse(expr.strip(), mode="eval"))
