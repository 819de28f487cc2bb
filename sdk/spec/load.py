"""Reading a spec (file -> validated `Spec` + block options) and resolving it against an HF
config (-> `ModelConfig`). Every error names the file, the field path and what was expected."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.blocks.norm import EmbeddingCfg, HeadCfg, HyperCfg, NormCfg, ResidualCfg
from dayzero.sdk.registry import UnknownKeyError
from dayzero.sdk.spec.config import CacheGroupCfg, LayerCfg, ModelConfig
from dayzero.sdk.spec.schema import RuleAll, RuleEvery, RuleField, RuleFirst, Spec, Symbol

BUILTINS = ("hidden", "norm_eps", "norm_weight_in_fp32")
STATE_ALIGN = 256  # bytes; a state part starts aligned in the request's slot
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
)


class SpecError(ValueError):
    def __init__(self, source: str, path: str, message: str) -> None:
        self.source, self.path = source, path
        super().__init__(f"{source}: {path or '(top level)'}: {message}")


@dataclass(frozen=True)
class LoadedSpec:
    spec: Spec
    blocks: dict[str, BaseModel]  # block name -> validated options of its kind
    path: Path
    hash: str  # of the spec file's bytes

    @property
    def folder(self) -> Path:
        return self.path.parent


_BRANCHES = {
    "int",
    "float",
    "bool",
    "str",
    "constrained-str",
    "list[str]",
}


def _loc(loc: tuple) -> str:
    """A field path without pydantic's union-branch names (`heads.int` -> `heads`)."""
    return ".".join(str(x) for x in loc if str(x) not in _BRANCHES)


def _raise_validation(source: str, prefix: str, err: ValidationError) -> None:
    errors = err.errors()
    first = _loc(errors[0]["loc"])
    same = [e for e in errors if _loc(e["loc"]) == first]  # one field, several union branches
    if len(same) > 1 and any("pattern" in e["msg"] for e in same):
        kinds = [str(e["loc"][-1]) for e in same if str(e["loc"][-1]) in ("int", "float", "bool")]
        msg = f"expected {' or '.join(kinds) or 'a value'} or a `$symbol` reference, got {same[0]['input']!r}"
    else:
        msg = same[0]["msg"]
    rest = len({_loc(e["loc"]) for e in errors}) - 1
    more = f" (and {rest} more)" if rest else ""
    path = f"{prefix}{'.' if prefix and first else ''}{first}"
    raise SpecError(source, path, f"{msg}{more}") from None


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


def load_spec(path: str | Path) -> LoadedSpec:
    path = Path(path)
    source = str(path)
    raw_bytes = path.read_bytes()
    try:
        raw = yaml.safe_load(raw_bytes)
    except yaml.YAMLError as e:
        raise SpecError(source, "", f"not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise SpecError(source, "", f"expected a mapping at the top level, got {type(raw).__name__}")
    try:
        spec = Spec.model_validate(raw)
    except ValidationError as e:
        _raise_validation(source, "", e)
    blocks: dict[str, BaseModel] = {}
    for name, body in spec.blocks.items():
        if not isinstance(body, dict) or "kind" not in body:
            raise SpecError(source, f"blocks.{name}", "expected a mapping with a `kind`")
        try:
            bdef = BLOCKS.get(str(body["kind"]))
        except UnknownKeyError as e:
            raise SpecError(source, f"blocks.{name}.kind", str(e)) from None
        try:
            blocks[name] = bdef.options.model_validate(body)
        except ValidationError as e:
            _raise_validation(source, f"blocks.{name}", e)
    _check_plan(source, spec, blocks)
    _check_transforms(source, spec)
    symbols = set(spec.symbols) | set(BUILTINS)
    for where, ref in (r for k, v in raw.items() if k not in LITERAL_SECTIONS for r in _refs(v, k)):
        if ref not in symbols:
            raise SpecError(source, where, f"unknown symbol ${ref}; known: {', '.join(sorted(symbols))}")
    for name, sym in spec.symbols.items():
        if isinstance(sym, Symbol) and isinstance(sym.default, str) and sym.default.startswith("="):
            try:
                names = _names(sym.default[1:])
            except ValueError as e:
                raise SpecError(source, f"symbols.{name}.default", str(e)) from None
            if unknown := sorted(names - symbols):
                raise SpecError(source, f"symbols.{name}.default", f"unknown symbol(s) {', '.join(unknown)}")
    return LoadedSpec(spec, blocks, path, hashlib.sha256(raw_bytes).hexdigest()[:12])


def _rule_blocks(rule: Any) -> list[tuple[str, str]]:
    if isinstance(rule, RuleAll):
        return [("block", rule.block)]
    if isinstance(rule, RuleField):
        return [(f"map.{k}", v) for k, v in rule.map.items()] + [
            (f"fallback.{w}", b) for w, b in (_rule_blocks(rule.fallback) if rule.fallback else [])
        ]
    return [("block", rule.block), ("other", rule.other)]


def _check_transforms(source: str, spec: Spec) -> None:
    from dayzero.sdk.loader.mapping import TRANSFORMS

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


def _check_plan(source: str, spec: Spec, blocks: dict[str, BaseModel]) -> None:
    for role in ("attention", "mlp"):
        for where, name in _rule_blocks(getattr(spec.layers, role)):
            path = f"layers.{role}.{where}"
            if name not in blocks:
                raise SpecError(source, path, f"unknown block {name!r}; blocks: {', '.join(blocks)}")
            kind = blocks[name].kind
            if BLOCKS.get(kind).role != role:
                raise SpecError(
                    source, path, f"block {name!r} is a {BLOCKS.get(kind).role} block (kind {kind})"
                )


# ---- resolution against an HF config ---------------------------------------------------------

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Pow: operator.pow,
}


def _names(expr: str) -> set[str]:
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


def _eval(expr: str, lookup) -> Any:
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


_MISSING = object()


def _field(cfg: dict, dotted: str) -> Any:
    cur: Any = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


class Resolver:
    """Looks up spec symbols in one HF config (memoised, cycle-checked)."""

    def __init__(self, loaded: LoadedSpec, hf: dict, source: str) -> None:
        self.loaded, self.hf, self.source = loaded, hf, source
        self.values: dict[str, Any] = {}
        self.origin: dict[str, str] = {}  # symbol -> the HF field it was read from
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
        v = _MISSING
        for f in fields:
            v = _field(self.hf, f)
            if v is not _MISSING and v is not None:
                self.origin[name] = f
                break
        if v is _MISSING or v is None:
            if sym.default is not None:
                try:
                    v = self.value(sym.default)
                except (ArithmeticError, TypeError, ValueError) as e:
                    if isinstance(e, SpecError):
                        raise
                    raise SpecError(str(self.loaded.path), f"symbols.{name}.default", f"{e}") from None
            elif sym.required:
                what = "missing" if v is _MISSING else "null"
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

    def number(self, v: Any, kind: type, where: str) -> Any:
        """value(v) as int or float; a non-number names the spec field and the config value."""
        got = self.value(v)
        try:
            if isinstance(got, bool) or got is None:
                raise TypeError
            return kind(got)
        except (TypeError, ValueError):
            sym = v[1:] if isinstance(v, str) and v.startswith("$") else None
            field = self.origin.get(sym, "") if sym else ""
            via = f" (symbol ${sym} of {self.loaded.path.name}, for {where})" if sym else ""
            raise SpecError(self.source, field or where, f"expected a number{via}, got {got!r}") from None

    def value(self, v: Any) -> Any:
        """A literal, a `$symbol`, or a `= expression` over symbols."""
        if isinstance(v, str) and v.startswith("$"):
            return self.symbol(v[1:])
        if isinstance(v, str) and v.startswith("="):
            return _eval(v[1:], self.symbol)
        return v


def _plan(rule: Any, n: int, r: Resolver, role: str) -> list[str]:
    if isinstance(rule, RuleAll):
        return [rule.block] * n
    if isinstance(rule, RuleEvery):
        every = r.number(rule.n, int, f"layers.{role}.n")
        if every <= 0:
            raise SpecError(r.source, f"layers.{role}.n", f"must be > 0, got {every}")
        out = [rule.block if (i + 1) % every == 0 else rule.other for i in range(n)]
        if rule.last and n:
            out[-1] = rule.block
        return out
    if isinstance(rule, RuleFirst):
        k = r.number(rule.k, int, f"layers.{role}.k")
        return [rule.block if i < k else rule.other for i in range(n)]
    assert isinstance(rule, RuleField)
    fields = [rule.field] if isinstance(rule.field, str) else rule.field
    columns = []
    for f in fields:
        # `a|b`: the first of the alternatives present (a nested sub-config, or the flat field)
        present = (v for a in f.split("|") if (v := _field(r.hf, a)) is not _MISSING and v is not None)
        values = next(present, None)
        if values is None:
            if rule.fallback is None:
                raise SpecError(r.source, f, f"missing (layer plan of {role}) and the spec has no fallback")
            return _plan(rule.fallback, n, r, role)
        if not isinstance(values, list) or len(values) < n:
            raise SpecError(r.source, f, f"expected a list of at least {n} layer kinds, got {values!r}")
        columns.append(values[:n])
    out = []
    for i, vs in enumerate(zip(*columns, strict=True)):
        v = "+".join(map(str, vs))
        if v not in rule.map:
            raise SpecError(
                r.source,
                " + ".join(f"{f}.{i}" for f in fields),
                f"unknown layer kind {v!r}; known: {', '.join(rule.map)}",
            )
        out.append(rule.map[v])
    return out


def _hyper(spec: Spec, r: Resolver) -> HyperCfg | None:
    res = spec.residual
    if res.kind != "hyper":
        return None
    where = "residual"
    cfg = HyperCfg(
        streams=r.number(res.streams, int, f"{where}.streams"),
        sinkhorn_iters=r.number(res.sinkhorn_iters, int, f"{where}.sinkhorn_iters"),
        eps=r.number(res.eps, float, f"{where}.eps"),
        norm_eps=r.number(spec.norm.eps, float, "norm.eps"),
    )
    if cfg.streams < 1 or cfg.sinkhorn_iters < 1:
        raise SpecError(r.source, where, f"needs streams >= 1 and sinkhorn_iters >= 1, got {cfg}")
    return cfg


def resolve(loaded: LoadedSpec, hf: dict, group_decls: tuple, source: str = "config.json") -> ModelConfig:
    """Spec + HF config -> ModelConfig. `group_decls` is the generated cache geometry."""
    spec, r = loaded.spec, Resolver(loaded, hf, source)
    spath = str(loaded.path)
    hidden = r.number(spec.embedding.dim, int, "embedding.dim")
    norm = NormCfg(hidden, r.number(spec.norm.eps, float, "norm.eps"), spec.norm.weight_in_fp32)
    n = r.number(spec.layers.count, int, "layers.count")
    attn_plan, mlp_plan = _plan(spec.layers.attention, n, r, "attention"), _plan(spec.layers.mlp, n, r, "mlp")
    resolved: dict[str, Any] = {}
    for name, opts in loaded.blocks.items():
        if name in attn_plan or name in mlp_plan:
            try:
                resolved[name] = BLOCKS.get(opts.kind).resolve(opts, r.value)
            except (ValueError, TypeError) as e:
                if isinstance(e, SpecError):
                    raise
                raise SpecError(spath, f"blocks.{name}", f"{e} (with {source})") from None
    group_of = {m: gi for gi, g in enumerate(group_decls) for m in g.members}
    rows = [0] * len(group_decls)
    members: list[list[int]] = [[] for _ in group_decls]
    windows: list[int | None] = [None] * len(group_decls)
    hyper = _hyper(spec, r)
    layers = []
    for i in range(n):
        a, m = attn_plan[i], mlp_plan[i]
        caches = []
        for decl in BLOCKS.get(loaded.blocks[a].kind).cache(resolved[a]):
            key = f"{a}.{decl.part}"
            if key not in group_of:
                raise SpecError(
                    spath,
                    f"blocks.{a}",
                    f"cache part {key} has no group in the generated geometry; run `dayzero codegen`",
                )
            g = group_of[key]
            if decl.kind != group_decls[g].kind:
                raise SpecError(spath, f"blocks.{a}.window", f"resolves to a {decl.kind} cache with {source}")
            if members[g] and windows[g] != decl.window:
                raise SpecError(
                    spath, f"blocks.{a}.window", f"cache group {group_decls[g].name} mixes windows"
                )
            windows[g] = decl.window
            # state parts are bytes in the request's slot: keep every part aligned for any dtype view
            size = -(-decl.row // STATE_ALIGN) * STATE_ALIGN if decl.kind == "state" else decl.row
            caches.append((g, rows[g]))
            rows[g] += size
            if i not in members[g]:
                members[g].append(i)
        k = 2 * (i + 1) if spec.residual.depth_scaled else 0
        layers.append(
            LayerCfg(
                index=i,
                attn_kind=loaded.blocks[a].kind,
                attn=resolved[a],
                mlp_kind=loaded.blocks[m].kind,
                mlp=resolved[m],
                attn_res=ResidualCfg(spec.residual.kind, norm, k, hyper),
                mlp_res=ResidualCfg(spec.residual.kind, norm, k + 1 if k else 0, hyper),
                caches=tuple(caches),
            )
        )
    groups = tuple(
        CacheGroupCfg(d.name, d.kind, windows[gi], rows[gi], tuple(members[gi]))
        for gi, d in enumerate(group_decls)
        if members[gi]
    )
    # drop empty groups and renumber the layers' group indices
    renum = {gi: j for j, gi in enumerate(gi for gi in range(len(group_decls)) if members[gi])}
    layers = [
        dataclasses.replace(layer, caches=tuple((renum[g], off) for g, off in layer.caches))
        for layer in layers
    ]
    vocab = r.number(spec.embedding.vocab, int, "embedding.vocab")
    softcap = r.value(spec.head.softcap)
    eos = r.value(spec.eos_token_ids) if spec.eos_token_ids else None
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    max_pos = r.value(spec.max_position)
    for name in spec.symbols:  # every symbol resolves (or fails here, not later)
        r.symbol(name)
    return ModelConfig(
        family=spec.family,
        spec_hash=loaded.hash,
        embedding=EmbeddingCfg(vocab, hidden),
        layers=tuple(layers),
        final_norm=norm,
        streams=hyper.streams if hyper else 1,
        head=HeadCfg(
            vocab, hidden, bool(r.value(spec.head.tie)), None if softcap is None else float(softcap)
        ),
        cache_groups=groups,
        max_position=None if max_pos is None else int(max_pos),
        eos_token_ids=eos_ids,
        symbols=tuple(sorted(r.values.items())),
    )
