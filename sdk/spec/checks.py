"""The checks a spec passes after its schema: layer types name blocks of the right role,
weight transforms exist and take the arguments given, every `$symbol` and every symbol of an
`= expression` is known. Each failure names the file and the field path."""

from __future__ import annotations

import inspect
from typing import Any

from pydantic import BaseModel

from dayzero.kernels.registry import UnknownKeyError
from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.errors import SpecError
from dayzero.sdk.spec.expr import names
from dayzero.sdk.spec.schema import BUILTINS, RuleAll, RuleField, Spec, Symbol
from dayzero.sdk.transforms import TRANSFORMS

# sections whose strings are never symbol references
LITERAL_SECTIONS = (
    "family",
    "title",
    "architectures",
    "model_types",
    "reference",
    "reference_modules",
    "tiny",
    "shapes",
    "release",
    "bench",
    "ignores",  # config field -> the reason it does not change the math (prose)
)


def _refs(value: Any, path: str):
    """Every `$symbol` reference inside a parsed YAML value, with its field path."""
    if isinstance(value, str) and value.startswith("$"):
        yield path, value[1:]
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _refs(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _refs(v, f"{path}.{i}")


def rule_blocks(rule: Any) -> list[tuple[str, str]]:
    if isinstance(rule, RuleAll):
        return [("block", rule.block)]
    if isinstance(rule, RuleField):
        return [(f"map.{k}", v) for k, v in rule.map.items()] + [
            (f"fallback.{w}", b) for w, b in (rule_blocks(rule.fallback) if rule.fallback else [])
        ]
    return [("block", rule.block), ("other", rule.other)]


def check_transforms(source: str, spec: Spec) -> None:
    for wi, fmt in enumerate(spec.weights):
        for ri, rule in enumerate(fmt.rules):
            if rule.transform is None:
                continue
            path = f"weights.{wi}.rules.{ri}.transform"
            try:
                fn = TRANSFORMS.get(rule.transform.kind)
                inspect.signature(fn).bind(None, **rule.transform.args)
            except UnknownKeyError as e:
                raise SpecError(source, f"{path}.kind", str(e)) from None
            except TypeError as e:
                raise SpecError(source, f"{path}.args", f"{e} (for {rule.transform.kind})") from None


def check_layers(source: str, spec: Spec, blocks: dict[str, BaseModel]) -> None:
    for role in ("attention", "mlp"):
        for where, name in rule_blocks(getattr(spec.layers, role)):
            path = f"layers.{role}.{where}"
            if name not in blocks:
                raise SpecError(source, path, f"unknown block {name!r}; blocks: {', '.join(blocks)}")
            kind = blocks[name].kind
            if BLOCKS.get(kind).role != role:
                raise SpecError(
                    source, path, f"block {name!r} is a {BLOCKS.get(kind).role} block (kind {kind})"
                )


def check_symbols(source: str, spec: Spec, raw: dict) -> None:
    """Every `$symbol` outside the literal sections, and every name in an `= expression`
    default, is a symbol of the spec (or a builtin)."""
    symbols = set(spec.symbols) | set(BUILTINS)
    for where, ref in (r for k, v in raw.items() if k not in LITERAL_SECTIONS for r in _refs(v, k)):
        if ref not in symbols:
            raise SpecError(source, where, f"unknown symbol ${ref}; known: {', '.join(sorted(symbols))}")
    for name, sym in spec.symbols.items():
        if isinstance(sym, Symbol) and isinstance(sym.default, str) and sym.default.startswith("="):
            try:
                used = names(sym.default[1:])
            except ValueError as e:
                raise SpecError(source, f"symbols.{name}.default", str(e)) from None
            if unknown := sorted(used - symbols):
                raise SpecError(source, f"symbols.{name}.default", f"unknown symbol(s) {', '.join(unknown)}")
