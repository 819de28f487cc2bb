"""A spec resolved against an HF config: the frozen `ModelConfig` every layer is built from.

Per layer: the block kinds of its attention and MLP from the spec's layer-type rules, each
block's frozen config (the block's own `resolve`), its residual, and where its cache parts sit
in the generated cache geometry's groups.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.blocks.ngram import PREFIX as NGRAM
from dayzero.sdk.blocks.ngram import ngram_cache, resolve_ngram
from dayzero.sdk.config.model import (
    ONE_RANK,
    AttnResCfg,
    CacheGroupCfg,
    EmbeddingCfg,
    HeadCfg,
    HyperCfg,
    LayerCfg,
    ModelConfig,
    MtpCfg,
    NormCfg,
    Parallel,
    ResidualCfg,
)
from dayzero.sdk.errors import SpecError
from dayzero.sdk.spec.config_keys import check_config_keys, show_value
from dayzero.sdk.spec.read import LoadedSpec
from dayzero.sdk.spec.resolver import MISSING, Resolver, agree, field
from dayzero.sdk.spec.schema import RuleAll, RuleEvery, RuleField, RuleFirst, RuleIndices, Spec

STATE_ALIGN = 256  # bytes; a state part starts aligned in the request's slot


def layer_types(rule: Any, n: int, r: Resolver, role: str) -> list[str]:
    if isinstance(rule, RuleAll):
        return [rule.block] * n
    if isinstance(rule, RuleEvery):
        every = _whole(rule.n, r, f"layers.{role}.n")
        offset = _whole(rule.offset, r, f"layers.{role}.offset")
        if every <= 0:
            raise SpecError(
                r.source, " / ".join(r.keys_behind(rule.n)) or f"layers.{role}.n", f"must be > 0, got {every}"
            )
        out = [rule.block if max(i + 1 - offset, 0) % every == 0 else rule.other for i in range(n)]
        if rule.last and n:
            out[-1] = rule.block
        return out
    if isinstance(rule, RuleFirst):
        k = r.number(rule.k, int, f"layers.{role}.k")
        return [rule.block if i < k else rule.other for i in range(n)]
    if isinstance(rule, RuleIndices):
        listed = {i - rule.base for i in _indices(rule.layers, r, f"layers.{role}.layers", rule.base)}
        rest = (
            [rule.other] * n
            if isinstance(rule.other, str)
            else layer_types(rule.other, n, r, f"{role}.other")
        )
        return [rule.block if i in listed else rest[i] for i in range(n)]
    assert isinstance(rule, RuleField)
    fields = [rule.field] if isinstance(rule.field, str) else rule.field
    # read_as: per column (what it was read as, its value shown, the config key(s) at fault for
    # layer {i}), for messages
    columns, read_as = [], []
    for f in fields:
        got = _column(rule, f, n, r)
        default = rule.defaults.get(f)
        keyed = _keyed(default, r) if default is not None else []
        where = f"{role}.defaults.{f}"
        if got is None:
            if default is not None:
                columns.append(layer_types(default, n, r, where))
                if keyed:
                    shown = f"absent: the spec's default {_describe(default, r)} from {_show_keys(keyed)}"
                    read_as.append((f, shown, " / ".join(k for k, _ in keyed)))
                else:
                    read_as.append((f, "absent (the spec's default)", f + ".{i}"))
                continue
            if rule.fallback is None:
                raise SpecError(r.source, f, f"missing (layer types of {role}) and the spec has no fallback")
            return layer_types(rule.fallback, n, r, role)
        name, raw, values = got
        if keyed:  # the config also carries the keys the default derives this column from
            derived = layer_types(default, n, r, where)
            if not agree(values[:n], derived):
                raise SpecError(
                    r.source,
                    f"{name} / {' / '.join(k for k, _ in keyed)}",
                    f"two sources of the same per-layer kinds disagree: {name}={show_value(raw)} but "
                    f"from {_show_keys(keyed)} the spec's default for {f} {_describe(default, r)} "
                    f"is {show_value(derived)}",
                )
        columns.append(values[:n])
        also = f" (as from {_show_keys(keyed)})" if keyed else ""
        read_as.append((name, f"= {show_value(raw)}{also}", name + ".{i}"))
    out = []
    for i, vs in enumerate(zip(*columns, strict=True)):
        v = "+".join(map(str, vs))
        if v not in rule.map:
            raise SpecError(
                r.source,
                _at(read_as, i),
                f"unknown layer kind {v!r}; known: {', '.join(rule.map)}",
            )
        out.append(rule.map[v])
    for i, block in enumerate(out):
        if block in rule.follows and (i == 0 or out[i - 1] not in rule.follows[block]):
            after = "it is the first layer" if i == 0 else f"layer {i - 1} is {out[i - 1]!r}"
            raise SpecError(
                r.source,
                _at(read_as, i),
                f"layer {i} is {block!r}, which needs the layer before it to be "
                f"{' or '.join(map(repr, rule.follows[block]))}; {after} (read from "
                + ", ".join(f"{a} {shown}" for a, shown, _ in read_as)
                + ")",
            )
    return out


def _at(read_as: list[tuple[str, str, str]], i: int) -> str:
    return " + ".join(at.replace("{i}", str(i)) for _, _, at in read_as)


def _whole(v: Any, r: Resolver, where: str) -> int:
    """A layer rule's whole number (a literal or a `$symbol`): 2 and 2.0, not 2.5 or true."""
    got = r.number(v, float, where)
    if isinstance(r.value(v), str) or not got.is_integer():
        raise SpecError(
            r.source,
            " / ".join(r.keys_behind(v)) or where,
            f"expected a whole number (for {where}), got {r.value(v)!r}",
        )
    return int(got)


def _indices(v: Any, r: Resolver, where: str, base: int = 0) -> set[int]:
    """A layer rule's index list (literal, `$symbol` or `= expression`): whole numbers >= base."""
    try:
        got = r.value(v)
    except (ArithmeticError, TypeError, ValueError) as e:
        if isinstance(e, SpecError):
            raise
        raise SpecError(r.source, " / ".join(r.keys_behind(v)) or where, f"{e} (for {where})") from None
    ok = isinstance(got, list) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= base for x in got
    )
    if not ok:
        raise SpecError(
            r.source,
            " / ".join(r.keys_behind(v)) or where,
            f"expected a list of layer indices (whole numbers >= {base}, for {where}), got {show_value(got)}",
        )
    return set(got)


def layer_plan(spec: Spec, r: Resolver, mtp: bool = False) -> list[tuple[str, str]]:
    """Each layer's (attention block, mlp block) names, from the spec's layer rules; mtp: and the
    NextN layer's, last (`_mtp_blocks`)."""
    n = r.number(spec.layers.count, int, "layers.count")
    attn = layer_types(spec.layers.attention, n, r, "attention")
    mlp = layer_types(spec.layers.mlp, n, r, "mlp")
    return list(zip(attn, mlp, strict=True)) + ([_mtp_blocks(spec, r, n, str(r.loaded.path))] if mtp else [])


def _keyed(rule: Any, r: Resolver) -> list[tuple[str, Any]]:
    """(key, value) of the config keys present that a rule's numbers are read from."""
    params = {RuleEvery: ("n", "offset"), RuleFirst: ("k",)}.get(type(rule), ())
    keys = [k for p in params for k in r.keys_behind(getattr(rule, p))]
    return [(k, field(r.hf, k)) for k in dict.fromkeys(keys)]


def _show_keys(keyed: list[tuple[str, Any]]) -> str:
    return ", ".join(f"{k}={show_value(v)}" for k, v in keyed)


def _describe(rule: Any, r: Resolver) -> str:
    """A default rule with its numbers resolved: {rule: every, n: 3, offset: 2, ...}."""
    got = rule.model_dump(exclude_defaults=True)
    for p in ("n", "offset", "k"):
        if p in got:
            got[p] = r.value(got[p])
    return "{" + ", ".join(f"{k}: {v}" for k, v in got.items()) + "}"


def _column(rule: RuleField, f: str, n: int, r: Resolver) -> tuple[str, Any, list] | None:
    """(alternative, raw value, values) of one column `a|b|...`: the first alternative present
    (a string read through the rule's `letters`), checked against every other one present; None
    when none is."""
    present = []
    for a in f.split("|"):  # every alternative is named, so read
        raw = r.field(a)
        if raw is MISSING or raw is None:
            continue
        values = raw
        if a in rule.letters and isinstance(raw, str):
            known = rule.letters[a]
            if bad := next(((i, c) for i, c in enumerate(raw) if c not in known), None):
                raise SpecError(
                    r.source,
                    a,
                    f"{show_value(raw)}: letter {bad[1]!r} (layer {bad[0]}) is not one of "
                    + ", ".join(f"{k} ({v})" for k, v in known.items()),
                )
            values = [known[c] for c in raw]
        if not isinstance(values, list) or len(values) < n:
            raise SpecError(
                r.source, a, f"expected a list of at least {n} layer kinds, got {show_value(raw)}"
            )
        present.append((a, raw, values))
    if not present:
        return None
    (a0, raw0, first), *others = present
    for a, raw, values in others:
        if not agree(values, first):
            raise SpecError(
                r.source,
                f"{a0} / {a}",
                f"two fields for the same per-layer kinds disagree: {a0}={show_value(raw0)} "
                f"but {a}={show_value(raw)}",
            )
    return a0, raw0, first


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
        mixer=res.mixer,
        rank=0 if res.rank is None else r.number(res.rank, int, f"{where}.rank"),
    )
    if cfg.streams < 1 or cfg.sinkhorn_iters < 1:
        raise SpecError(r.source, where, f"needs streams >= 1 and sinkhorn_iters >= 1, got {cfg}")
    if (cfg.mixer == "lowrank") != (cfg.rank > 0):
        raise SpecError(r.source, f"{where}.rank", f"a rank > 0 is needed by mixer: lowrank only, got {cfg}")
    return cfg


def _attn_res_block(spec: Spec, r: Resolver) -> int:
    """Attention residuals' block size B (0: not attn_res)."""
    res = spec.residual
    if res.kind != "attn_res":
        if res.block is not None:
            raise SpecError(r.source, "residual.block", f"is read by kind attn_res only, not {res.kind}")
        return 0
    if res.block is None:
        raise SpecError(r.source, "residual.block", "attn_res needs its block size")
    block = r.number(res.block, int, "residual.block")
    if block < 1 or res.depth_scaled or r.number(res.branch_scale, float, "residual.branch_scale") != 1.0:
        raise SpecError(
            r.source, "residual", f"attn_res needs block >= 1 (got {block}), no depth scaling or branch scale"
        )
    return block


def _attn_res(block: int, append: bool) -> AttnResCfg | None:
    return AttnResCfg(block, append) if block else None


def _collapse(norm: NormCfg, hyper: HyperCfg | None, attn_block: int) -> ResidualCfg | None:
    """What replaces the final norm of the stream(s): the low-rank streams' collapse, or the
    attention residuals' output mix (then the final norm)."""
    if hyper is not None and hyper.mixer == "lowrank":
        return ResidualCfg("hyper", norm, 0, hyper)
    return ResidualCfg("attn_res", norm, attn_res=AttnResCfg(attn_block, False)) if attn_block else None


def _ngram(
    spec: Spec,
    r: Resolver,
    hyper: HyperCfg | None,
    vocab: int,
    hidden: int,
    eps: float,
    n: int,
    spath: str,
    source: str,
    par: Parallel,
) -> dict[int, Any]:
    """embedding.ngram resolved: {layer index: NgramCfg} of the layers that inject (their tables
    split by rows under tensor parallelism; whole with data-parallel attention, whose ranks
    each run the residual streams of their own requests)."""
    o = spec.embedding.ngram
    if o is None:
        return {}
    if hyper is None or hyper.mixer != "lowrank":
        raise SpecError(
            spath,
            "embedding.ngram",
            "is injected into low-rank hyper-connection streams: "
            "it needs residual kind hyper with mixer lowrank",
        )
    try:
        return resolve_ngram(
            o, r.value, vocab=vocab, hidden=hidden, streams=hyper.streams, norm_eps=eps, n_layers=n,
            par=ONE_RANK if par.attention_dp else par,
        )  # fmt: skip
    except (ValueError, TypeError) as e:
        if isinstance(e, SpecError):
            raise
        raise SpecError(spath, "embedding.ngram", f"{e} (with {source})") from None


def resolve(
    loaded: LoadedSpec,
    hf: dict,
    group_decls: tuple,
    source: str = "config.json",
    par: Parallel = ONE_RANK,
    mtp: bool = False,
) -> ModelConfig:
    """Spec + HF config -> ModelConfig. `group_decls` is the generated cache geometry; `par`:
    this rank's place in tensor parallelism (the blocks' configs and caches are its shards);
    mtp: with the NextN layer (MtpCfg), for speculative decoding that drafts with it."""
    spec, r = loaded.spec, Resolver(loaded, hf, source)
    spath = str(loaded.path)
    hidden = r.number(spec.embedding.dim, int, "embedding.dim")
    zero = bool(r.value(spec.norm.zero_centred))
    if zero and not spec.norm.weight_in_fp32:
        raise SpecError(spath, "norm.zero_centred", "multiplies by (1 + w) in fp32: set weight_in_fp32: true")
    norm = NormCfg(hidden, r.number(spec.norm.eps, float, "norm.eps"), spec.norm.weight_in_fp32, zero)
    plan = layer_plan(spec, r, mtp)  # with mtp, the NextN layer last: decoder layer n by the same rules
    n = len(plan) - mtp
    attn_types, mlp_types = [a for a, _ in plan], [m for _, m in plan]
    resolved: dict[str, Any] = {}
    for name, opts in loaded.blocks.items():
        if name in attn_types or name in mlp_types:
            block = BLOCKS.get(opts.kind)
            try:
                resolved[name] = block.resolve(opts, r.value)
                if par.size > 1 and not (par.attention_dp and block.role == "attention"):
                    if block.shard is None:
                        raise ValueError(f"block kind {opts.kind!r} has no tensor-parallel sharding yet")
                    resolved[name] = block.shard(resolved[name], par)
            except (ValueError, TypeError) as e:
                if isinstance(e, SpecError):
                    raise
                raise SpecError(spath, f"blocks.{name}", f"{e} (with {source})") from None
    group_of = {m: gi for gi, g in enumerate(group_decls) for m in g.members}
    rows = [0] * len(group_decls)
    members: list[list[int]] = [[] for _ in group_decls]
    windows: list[int | None] = [None] * len(group_decls)
    kinds = [d.kind for d in group_decls]
    hyper = _hyper(spec, r)
    branch = r.number(spec.residual.branch_scale, float, "residual.branch_scale")
    if branch != 1.0 and hyper is not None:
        raise SpecError(r.source, "residual.branch_scale", "is not implemented with hyper-connections")
    attn_block = _attn_res_block(spec, r)

    def starts_block(i: int) -> bool:  # layer i's attention residual starts an attn_res block
        return bool(attn_block) and i % attn_block == 0

    vocab = r.number(spec.embedding.vocab, int, "embedding.vocab")
    ngram = _ngram(spec, r, hyper, vocab, hidden, norm.eps, n, spath, source, par)
    layers = []
    for i in range(len(plan)):
        a, m = attn_types[i], mlp_types[i]
        caches, ngram_caches = [], []
        parts = [(a, decl, caches) for decl in BLOCKS.get(loaded.blocks[a].kind).cache(resolved[a])]
        if i in ngram:
            parts += [(NGRAM, decl, ngram_caches) for decl in ngram_cache(ngram[i])]
        for owner, decl, into in parts:
            key = f"{owner}.{decl.part}"
            if key not in group_of:
                raise SpecError(
                    spath,
                    f"blocks.{a}" if owner == a else "embedding.ngram",
                    f"cache part {key} has no group in the generated geometry; run `dayzero codegen`",
                )
            g = group_of[key]
            # A window the config leaves null (`window: $window`, Mistral's sliding_window: null)
            # sees every key: its sliding group holds whole histories, a paged group.
            unwindowed = (group_decls[g].kind, decl.kind) == ("sliding", "paged")
            if decl.kind != group_decls[g].kind and not unwindowed:
                raise SpecError(spath, f"blocks.{a}.window", f"resolves to a {decl.kind} cache with {source}")
            kinds[g] = decl.kind
            if members[g] and windows[g] != decl.window:
                raise SpecError(
                    spath, f"blocks.{a}.window", f"cache group {group_decls[g].name} mixes windows"
                )
            windows[g] = decl.window
            # state parts are bytes in the request's slot: keep every part aligned for any dtype view
            size = -(-decl.row // STATE_ALIGN) * STATE_ALIGN if decl.kind == "state" else decl.row
            into.append((g, rows[g]))
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
                attn_res=ResidualCfg(
                    spec.residual.kind,
                    norm,
                    k,
                    hyper,
                    branch,
                    _attn_res(attn_block, i % (attn_block or 1) == 0),
                ),
                mlp_res=ResidualCfg(
                    spec.residual.kind, norm, k + 1 if k else 0, hyper, branch, _attn_res(attn_block, False)
                ),
                caches=tuple(caches),
                ngram=ngram.get(i),
                ngram_caches=tuple(ngram_caches),
            )
        )
    groups = tuple(
        CacheGroupCfg(d.name, kinds[gi], windows[gi], rows[gi], tuple(members[gi]))
        for gi, d in enumerate(group_decls)
        if members[gi]
    )
    # drop empty groups and renumber the layers' group indices
    renum = {gi: j for j, gi in enumerate(gi for gi in range(len(group_decls)) if members[gi])}
    layers = [
        dataclasses.replace(
            layer,
            caches=tuple((renum[g], off) for g, off in layer.caches),
            ngram_caches=tuple((renum[g], off) for g, off in layer.ngram_caches),
        )
        for layer in layers
    ]
    nextn = None
    if mtp:  # the NextN layer: pre-norm, or the stack's hyper-connections over its streams (MtpCfg)
        check_implemented(spec.mtp.implements, r, f"{loaded.path.name}'s mtp head")
        last = dataclasses.replace(layers.pop(), ngram=None)
        if spec.residual.kind != "hyper":
            prenorm = ResidualCfg("prenorm", norm)
            last = dataclasses.replace(last, attn_res=prenorm, mlp_res=prenorm)
        streams = last.attn_res.hyper.streams if last.attn_res.hyper else 1
        nextn = MtpCfg(last, norm, feed_normed=spec.mtp.kind == "qwen_mtp", streams=streams)
    if vocab % par.size:
        raise SpecError(
            spath, "embedding.vocab", f"{vocab} rows do not split over tensor-parallel size {par.size}"
        )
    softcap = r.value(spec.head.softcap)
    eos = r.value(spec.eos_token_ids) if spec.eos_token_ids else None
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    max_pos = r.value(spec.max_position)
    for name in spec.symbols:  # every symbol resolves (or fails here, not later)
        r.symbol(name)
    check_implemented(spec.implements, r, loaded.path.name)
    check_config_keys(r.hf, r.read, spec.implements, spec.ignores, r.source, loaded.path.name)
    return ModelConfig(
        family=spec.family,
        spec_hash=loaded.hash,
        embedding=EmbeddingCfg(
            vocab, hidden, par, None if spec.embedding.scale is None else float(r.value(spec.embedding.scale))
        ),
        layers=tuple(layers),
        final_norm=norm,
        streams=hyper.streams if hyper else 1,
        collapse=_collapse(norm, hyper, attn_block),
        head=HeadCfg(
            vocab,
            hidden,
            bool(r.value(spec.head.tie)),
            None if softcap is None else float(softcap),
            par,
            r.number(spec.head.scale, float, "head.scale"),
        ),
        cache_groups=groups,
        max_position=None if max_pos is None else int(max_pos),
        eos_token_ids=eos_ids,
        symbols=tuple(sorted(r.values.items())),
        parallel=par,
        mtp=nextn,
    )


def mtp_unbuildable(spec: Spec) -> str | None:
    """Why the spec's MTP head cannot be built for drafting (None: it can); the model card and
    the support matrix say the same."""
    if spec.mtp is None:
        return "drafting with the MTP head needs an mtp section; the spec has none"
    if spec.residual.kind == "hyper" and spec.residual.mixer == "lowrank":
        return (
            "the MTP head of a model whose streams collapse through a learned low-rank mixer is not "
            "implemented (no reference says which collapse its output takes)"
        )
    if spec.residual.kind == "hyper" and spec.mtp.kind == "qwen_mtp":
        return "a qwen_mtp head over hyper-connection streams is not implemented (no reference gives it)"
    return None


def _mtp_blocks(spec: Spec, r: Resolver, n: int, spath: str) -> tuple[str, str]:
    """The NextN layer's (attention, mlp) blocks: layer n of a stack of n + 1 by the spec's rules."""
    if why := mtp_unbuildable(spec):
        raise SpecError(spath, "mtp", why)
    count = r.value(spec.mtp.layers)
    if count != 1:
        raise SpecError(
            spath, "mtp.layers", f"drafting with the MTP head needs 1 nextn layer, the config has {count}"
        )
    for role, name in (("attention", spec.mtp.attention), ("mlp", spec.mtp.mlp)):
        if name is not None and name not in spec.blocks:
            raise SpecError(spath, f"mtp.{role}", f"no block {name!r}; blocks: {', '.join(spec.blocks)}")
    try:
        attn = spec.mtp.attention or layer_types(spec.layers.attention, n + 1, r, "attention")[n]
        mlp = spec.mtp.mlp or layer_types(spec.layers.mlp, n + 1, r, "mlp")[n]
    except (SpecError, ValueError, IndexError) as e:
        raise SpecError(
            spath, "mtp", f"the layer rules do not place a layer {n} (the NextN layer; name its blocks): {e}"
        ) from None
    return attn, mlp


def check_implemented(implements: dict, r: Resolver, spec_name: str) -> None:
    """Refuse a config value the blocks do not implement (Spec.implements), by field and value.
    An allowed value may be a `$symbol` or `= expression` (a derived field: `num_key_value_heads:
    $heads`); an absent or null field takes transformers' default and passes."""
    for name, allowed in implements.items():
        got = field(r.hf, name)
        if got is MISSING or got is None:
            continue
        ok = [r.value(a) for a in (allowed if isinstance(allowed, list) else [allowed])]
        if got not in ok:
            want = " or ".join(repr(v) for v in ok)
            raise SpecError(
                r.source, name, f"{got!r} is not implemented by {spec_name} (it implements {want})"
            )
