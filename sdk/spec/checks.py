"""The checks a spec passes after its schema: layer types name blocks of the right role,
weight transforms exist and take the arguments given (a splitting one last, with one target
per piece), block-scoped weight rules name blocks the layers use, every `$symbol` and every
symbol of an `= expression` is known. Each failure names the file and the field path."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from dayzero.kernels.registry import UnknownKeyError
from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.errors import SpecError
from dayzero.sdk.spec.expr import names
from dayzero.sdk.spec.schema import BUILTINS, RuleAll, RuleField, RuleIndices, Spec, Symbol, WeightRule
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
    if isinstance(rule, RuleIndices) and not isinstance(rule.other, str):
        return [("block", rule.block)] + [(f"other.{w}", b) for w, b in rule_blocks(rule.other)]
    return [("block", rule.block), ("other", rule.other)]


def _branch(loc: int | str) -> bool:
    """A pydantic union-branch name in an error's location (`int`, `constrained-str`, ...)."""
    return isinstance(loc, str) and (
        loc in ("int", "float", "bool", "str") or "[" in loc or loc.endswith("-str")
    )


def _formulas(value: Any) -> list[str]:
    """The `= expressions` inside a transform argument (a value or a list of them)."""
    values = value if isinstance(value, list) else [value]
    return [v[1:] for v in values if isinstance(v, str) and v.startswith("=")]


def _check_rule_transforms(source: str, path: str, rule: WeightRule, symbols: set[str]) -> None:
    """Each transform's kind and arguments (by its schema); a splitting kind last, its pieces
    as many as the rule's targets; every target list comes from a splitting kind."""
    what = f"(rule from {rule.src})"
    pieces = None
    steps = rule.transforms
    for ti, tf in enumerate(steps):
        at = f"{path}.{ti}" if isinstance(rule.transform, list) else path
        try:
            tdef = TRANSFORMS.get(tf.kind)
        except UnknownKeyError as e:
            raise SpecError(source, f"{at}.kind", f"{e} {what}") from None
        try:
            args = tdef.params.model_validate(tf.args)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"] if not _branch(x))
            got = f", got {err['input']!r}" if err["type"] != "missing" else ""
            raise SpecError(
                source, f"{at}.args{'.' + loc if loc else ''}", f"{err['msg']}{got} (for {tf.kind}) {what}"
            ) from None
        for name, v in tf.args.items():
            for formula in _formulas(v):
                try:
                    unknown = sorted(names(formula) - symbols)
                except ValueError as e:
                    raise SpecError(source, f"{at}.args.{name}", f"{e} {what}") from None
                if unknown:
                    raise SpecError(
                        source, f"{at}.args.{name}", f"unknown symbol(s) {', '.join(unknown)} {what}"
                    )
        if tdef.splits and ti != len(steps) - 1:
            raise SpecError(
                source, f"{at}.kind", f"{tf.kind} splits the tensor: it must be the last transform {what}"
            )
        pieces = tdef.pieces(args) if tdef.pieces else None
    targets = rule.targets
    if pieces is None and len(targets) > 1:
        raise SpecError(
            source,
            f"{path.rsplit('.', 1)[0]}.to",
            f"{len(targets)} targets need a splitting transform last (split_heads, split) {what}",
        )
    if pieces is not None and pieces != len(targets):
        raise SpecError(
            source,
            f"{path.rsplit('.', 1)[0]}.to",
            f"the transform makes {pieces} pieces for {len(targets)} target(s) {what}",
        )


def check_transforms(source: str, spec: Spec) -> None:
    symbols = set(spec.symbols) | set(BUILTINS)
    for wi, fmt in enumerate(spec.weights):
        for ri, rule in enumerate(fmt.rules):
            _check_rule_transforms(source, f"weights.{wi}.rules.{ri}.transform", rule, symbols)


def check_weight_scopes(source: str, spec: Spec) -> None:
    """A block-scoped weight rule names blocks that the layer rules use, and maps per layer (`{i}`)."""
    used = {b for role in ("attention", "mlp") for _, b in rule_blocks(getattr(spec.layers, role))}
    for wi, fmt in enumerate(spec.weights):
        for ri, rule in enumerate(fmt.rules):
            if not rule.blocks:
                continue
            path = f"weights.{wi}.rules.{ri}.block"
            if bad := [b for b in rule.blocks if b not in used]:
                raise SpecError(
                    source,
                    path,
                    f"{', '.join(map(repr, bad))} is no block of the layer rules (they use "
                    f"{', '.join(sorted(used))}) (rule from {rule.src})",
                )
            if "{i}" not in rule.src:
                raise SpecError(
                    source, path, f"a block-scoped rule maps a layer's tensor: {rule.src!r} has no {{i}}"
                )


def check_reference_modules(source: str, spec: Spec) -> None:
    """A per-block `reference_modules` path names exactly the blocks the layer rules use for
    that role (a layer whose block had no path would go unchecked by the layer diff)."""
    for role in ("attention", "mlp"):
        paths = getattr(spec.reference_modules, role)
        if not isinstance(paths, dict):
            continue
        used = {b for _, b in rule_blocks(getattr(spec.layers, role))}
        where = f"reference_modules.{role}"
        if extra := sorted(set(paths) - used):
            raise SpecError(
                source,
                f"{where}.{extra[0]}",
                f"{extra[0]!r} is not a block of the {role} layer rules (they use {', '.join(sorted(used))})",
            )
        if missing := sorted(used - set(paths)):
            raise SpecError(source, where, f"no path for block(s) {', '.join(missing)} of the layer rules")


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
    for role in ("attention", "mlp"):
        rule, path = getattr(spec.layers, role), f"layers.{role}"
        while isinstance(rule, RuleIndices):  # an index list written as an `= expression`
            if isinstance(rule.layers, str) and rule.layers.startswith("="):
                try:
                    unknown = sorted(names(rule.layers[1:]) - symbols)
                except ValueError as e:
                    raise SpecError(source, f"{path}.layers", str(e)) from None
                if unknown:
                    raise SpecError(source, f"{path}.layers", f"unknown symbol(s) {', '.join(unknown)}")
            rule, path = rule.other, f"{path}.other"
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
