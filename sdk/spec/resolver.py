"""Spec symbols looked up in one HF config: the first present field, else the default (a
literal, a `$symbol` or a `= expression`), memoised and checked for cycles."""

from __future__ import annotations

from typing import Any

from dayzero.sdk.errors import SpecError
from dayzero.sdk.spec.config_keys import show_value
from dayzero.sdk.spec.expr import evaluate, names
from dayzero.sdk.spec.read import LoadedSpec
from dayzero.sdk.spec.schema import BUILTINS, Symbol

MISSING = object()


def field(cfg: dict, dotted: str) -> Any:
    cur: Any = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return MISSING
        cur = cur[part]
    return cur


def agree(a: Any, b: Any) -> bool:
    """Two config values for one thing say the same: equal numbers (10000 and 10000.0, but not
    true and 1), equal strings and lists, and mappings whose common keys agree (a
    `rope_scaling` of the old form next to the `rope_parameters` that also holds rope_theta)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return all(agree(a[k], b[k]) for k in a.keys() & b.keys())
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(agree(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


class Resolver:
    """Looks up spec symbols in one HF config (memoised, cycle-checked)."""

    def __init__(self, loaded: LoadedSpec, hf: dict, source: str) -> None:
        self.loaded, self.hf, self.source = loaded, hf, source
        self.values: dict[str, Any] = {}
        self.origin: dict[str, str] = {}  # symbol -> the HF field it was read from
        # every HF field the spec names for what it evaluated (each alternative of a symbol, each
        # field of a layer rule), present or not: the keys it accounts for (config_keys)
        self.read: set[str] = set()
        self._active: set[str] = set()

    def symbol(self, name: str) -> Any:
        if name in self.values:
            return self.values[name]
        spec = self.loaded.spec
        if name in BUILTINS and name not in spec.symbols:
            v = {
                "hidden": lambda: self.value(spec.embedding.dim),
                "norm_eps": lambda: self.value(spec.norm.eps),
                "norm_weight_in_fp32": lambda: spec.norm.weight_in_fp32,
                "max_position": lambda: self.value(spec.max_position),
            }[name]()
            self.values[name] = v
            return v
        if name not in spec.symbols:
            raise SpecError(str(self.loaded.path), f"symbols.{name}", "unknown symbol")
        if name in self._active:
            raise SpecError(str(self.loaded.path), f"symbols.{name}", "refers to itself")
        self._active.add(name)
        sym = spec.symbols[name]
        sym = Symbol(field=sym) if isinstance(sym, str) else sym
        fields = [sym.field] if isinstance(sym.field, str) else (sym.field or [])
        v = MISSING
        self.read.update(fields)
        for f in fields:
            v = field(self.hf, f)
            if v is not MISSING and v is not None:
                self.origin[name] = f
                break
        if name in self.origin:
            self._agree(name, fields, v)
        if v is MISSING or v is None:
            if sym.default is not None:
                try:
                    v = self.value(sym.default)
                except (ArithmeticError, TypeError, ValueError) as e:
                    if isinstance(e, SpecError):
                        raise
                    if keys := self.keys_behind(sym.default):  # the config's values at fault
                        got = ", ".join(f"{k}={show_value(field(self.hf, k))}" for k in keys)
                        raise SpecError(
                            self.source,
                            " / ".join(keys),
                            f"{got}: {e} (in {sym.default!r}, ${name} of {self.loaded.path.name})",
                        ) from None
                    raise SpecError(str(self.loaded.path), f"symbols.{name}.default", f"{e}") from None
            elif sym.required:
                what = "missing" if v is MISSING else "null"
                raise SpecError(
                    self.source,
                    " or ".join(fields) or name,
                    f"{what} (needed by symbol ${name} of {self.loaded.path.name})",
                )
            else:
                v = None
        self._active.discard(name)
        self.values[name] = v
        return v

    def _agree(self, name: str, fields: list[str], v: Any) -> None:
        """The symbol's other alternatives present (not null) hold the value it was read as:
        two config keys for one thing that disagree are refused, naming both (which one a
        reference class reads is its business; the checkpoint is ambiguous)."""
        first = self.origin[name]
        for f in fields[fields.index(first) + 1 :]:
            other = field(self.hf, f)
            if other is MISSING or other is None or agree(v, other):
                continue
            raise SpecError(
                self.source,
                f"{first} / {f}",
                f"{first}={show_value(v)} but {f}={show_value(other)}: both are read as ${name} "
                f"of {self.loaded.path.name} and must agree",
            )

    def keys_behind(self, v: Any) -> list[str]:
        """The HF keys present in the config that value v was read from: a symbol's
        field, or the fields behind the `$symbol` / `= expression` its default is; none for a
        literal or a default of literals."""
        if isinstance(v, str) and v.startswith("$"):
            syms = [v[1:]]
        elif isinstance(v, str) and v.startswith("="):
            syms = sorted(names(v[1:]))
        else:
            return []
        out: list[str] = []
        for name in syms:
            self.symbol(name)
            if name in self.origin:
                keys = [self.origin[name]]
            else:
                sym = self.loaded.spec.symbols.get(name)
                default = sym.default if isinstance(sym, Symbol) else None
                keys = self.keys_behind(default) if isinstance(default, str) else []
            out += [k for k in keys if k not in out]
        return out

    def field(self, dotted: str) -> Any:
        """One HF field (MISSING when absent), recorded as read."""
        self.read.add(dotted)
        return field(self.hf, dotted)

    def number(self, v: Any, kind: type, where: str) -> Any:
        """value(v) as int or float; a non-number names the spec field and the config value."""
        got = self.value(v)
        try:
            if isinstance(got, bool) or got is None:
                raise TypeError
            return kind(got)
        except (TypeError, ValueError):
            sym = v[1:] if isinstance(v, str) and v.startswith("$") else None
            field = " / ".join(self.keys_behind(v)) if sym else ""
            via = f" (symbol ${sym} of {self.loaded.path.name}, for {where})" if sym else ""
            raise SpecError(self.source, field or where, f"expected a number{via}, got {got!r}") from None

    def value(self, v: Any) -> Any:
        """A literal, a `$symbol`, or a `= expression` over symbols."""
        if isinstance(v, str) and v.startswith("$"):
            return self.symbol(v[1:])
        if isinstance(v, str) and v.startswith("="):
            return evaluate(v[1:], self.symbol)
        return v
