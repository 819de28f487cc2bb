"""Attention blocks. Each kind's math is in its module docstring."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from dayzero.kernels.ops import HeadPrep, qsa_row
from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.base import BLOCKS, BlockDef, CacheDecl, StaticCache
from dayzero.sdk.blocks.norm import zero_centred
from dayzero.sdk.blocks.rope import ROPE_TYPES, rope_kind, rope_table, with_original_context
from dayzero.sdk.config.model import ONE_RANK, Parallel, Slice
from dayzero.sdk.config.options import BoolV, FloatV, IntV, Ref, Strict


class RopeOpts(Strict):
    kind: Literal["default"] | Ref = "default"  # a $symbol lets the config name it (then checked)
    theta: FloatV
    fraction: FloatV = 1.0  # partial RoPE: the first fraction of each head's channels rotate
    neox: bool = True  # rotate-half pairing (else interleaved pairs)
    # a symbol holding the HF rope_parameters (or legacy rope_scaling) mapping: its rope type and
    # scaling (linear, dynamic, llama3, longrope, yarn; sdk/blocks/rope.py)
    parameters: Ref | None = None
    # the pretraining context kept outside the mapping (Phi-3's top-level
    # original_max_position_embeddings): for llama3, longrope and yarn it replaces the mapping's,
    # as transformers gives it priority
    original_context: IntV | None = None


class QueryScalingOpts(Strict):
    """log_position: q *= (1 + (p + 1) / base) ** exponent at position p (scalable softmax)."""

    kind: Literal["log_position"]
    base: FloatV
    exponent: FloatV


class QkNormOpts(Strict):
    """q / k RMSNorm. over `head`: each head's D channels (Qwen3, Gemma3; weights [D]); `all`:
    the whole q [H D] and k [Hk D] projections before the head split (OLMo2; weights [H D] and
    [Hk D]). zero_centred: the weights apply as (1 + w) in fp32 (Gemma3). enabled: a flag or a
    $symbol (a config field that turns the norm on)."""

    enabled: BoolV = True
    over: Literal["head", "all"] = "head"
    zero_centred: bool = False


class QsaOpts(Strict):
    """The QSA sparse indexer (Qwen4-Exp): scores over blocks of `pool` mean-pooled keys, the
    best budget / pool blocks plus the query's incomplete block attended."""

    kind: Literal["qsa"]
    heads: IntV  # Hi indexer query heads
    kv_heads: IntV = 1  # indexer key heads: one is implemented
    head_dim: IntV  # Di
    budget: IntV  # tokens selected from complete blocks (a multiple of pool)
    pool: IntV  # P: consecutive keys averaged into one block


@dataclass(frozen=True)
class QsaCfg:
    heads: int
    head_dim: int
    budget: int
    pool: int


class GqaOpts(Strict):
    kind: Literal["gqa"]
    heads: IntV
    kv_heads: IntV
    head_dim: IntV
    bias: BoolV = False  # q/k/v and output projection biases
    o_bias: BoolV | None = None  # the output projection's bias alone (Qwen2: q/k/v only); None: as bias
    qk_norm: BoolV | QkNormOpts = False  # true: per head, as the spec's norm order
    rope: RopeOpts | None = None  # None: NoPE
    window: IntV | None = None  # sliding window (tokens a query sees, itself included)
    output_gate: Literal["none", "sigmoid", "sigmoid_head_bias"] = "none"
    query_scaling: QueryScalingOpts | None = None
    softcap: FloatV | None = None
    scale: FloatV | None = None  # default head_dim ** -0.5
    sinks: BoolV = False  # a learned logit per query head joins each softmax (gpt-oss)
    indexer: QsaOpts | None = None  # sparse attention: the QSA indexer's selection


@dataclass(frozen=True)
class GqaCfg:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    bias: bool
    qk_norm: bool
    norm_eps: float
    norm_weight_in_fp32: bool
    rope_theta: float | None
    rotary_dim: int
    neox: bool
    rope_params: tuple[tuple[str, Any], ...]  # the HF rope_parameters (sorted items), or ()
    max_position: int | None
    window: int | None
    output_gate: str
    query_scaling: tuple[float, float] | None  # (base, exponent)
    softcap: float | None
    scale: float
    qk_norm_over: Literal["head", "all"] = "head"
    qk_norm_zero_centred: bool = False
    sinks: bool = False
    o_bias: bool = False  # the output projection's bias (b_o)
    par: Parallel = ONE_RANK  # tensor parallel: heads / kv_heads above are this rank's
    kv_total: int = 0  # the model's KV heads (sharded configs)
    indexer: QsaCfg | None = None


class GqaAttention(nn.Module):
    """Grouped-query attention over the paged KV cache.

    [q; k; v; g] = x W_in (+ b on q, k, v: bias)       q, g [T, H, D]; k, v [T, Hk, D]
    q, k <- rmsnorm_D(q), rmsnorm_D(k)                  (qk_norm; over `all`: rmsnorm_{H D} of
                                                         q and rmsnorm_{Hk D} of k before the
                                                         split; zero-centred: weights (1 + w))
    q, k <- a rope(q, p), a rope(k, p)                  (rope; NoPE when absent; frequencies and
                                                         attention factor a: sdk/blocks/rope.py)
    q <- q * (1 + (p + 1) / base) ** exponent           (query_scaling)
    o[t, h] = sum_{j <= p_t, j > p_t - W} softmax_j(scale * q[t, h] . k[j, h // (H/Hk)]) v[j, ...]
              (sinks: exp(s_h) joins each softmax's denominator, s [H] learned, no value)
    o <- o * sigmoid(g (+ b_gate[h]))                   (output_gate)
    y = o W_o (+ b_o: o_bias, by default as bias)      [T, Dm]

    With the QSA indexer (Qwen4-Exp) the attention sees only S(t), j in S(t) as well as j <= p_t:
    [q_i; k_i] = x W_idx                 q_i [T, Hi, Di]; k_i [T, Di] (cached raw in a sliding
                                          group of window P: a block's keys until it completes)
    q_i <- rope(rmsnorm_Di(q_i), p_t)    (the norm as the q/k norms, zero-centred with them; the
                                          attention's RoPE table on the first rotary channels)
    K_m = rope(rmsnorm_Di(mean_{i < P} k_i[m P + i]), m P)     complete blocks m of P keys,
          formed once when the step holding m P + P - 1 writes it, cached in a paged group of
          ceil(Di / P) elements a token (kernels/ops.py `qsa_row`): Di / P a token, not Di
    I[t, m] = sum_h relu(<q_i[t, h], K_m>) / sqrt(Di)          blocks ending at or before p_t
    S(t) = the positions of the budget / P best blocks + [P floor((p_t + 1) / P), p_t] (the
           query's incomplete block, always kept)

    Tensor parallel over P ranks: each rank holds H / P query heads (and their gates) and their
    KV heads (Hk / P, or, with Hk < P, the one KV head its query heads read: replicated), its
    columns of W_o; y = sum over ranks of o_r W_o,r (all-reduce), + b_o once; sinks split by
    head. A q/k norm over all heads is not sharded (its statistic spans the ranks). The QSA
    indexer splits by its query heads (Hi / P; k_i, its cache and K_m replicated): each rank's
    partial sum over its heads of I is summed over ranks (all-reduce), then every rank takes
    the same S(t).
    """

    linear_weights = ("in_proj", "o_proj", "index_proj")  # may be packed

    def __init__(self, cfg: GqaCfg, ops: OpTable, caches: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        (self.group, self.offset), *index = caches  # K and V; with the indexer raw and pooled keys
        self.index_caches = tuple(index)
        h, hk, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.split = [h * d, hk * d, hk * d] + ([h * d] if cfg.output_gate != "none" else [])
        self.in_proj = nn.Parameter(torch.empty(sum(self.split), cfg.hidden))
        self.qkv_bias = nn.Parameter(torch.empty(sum(self.split[:3]))) if cfg.bias else None
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden, h * d))
        self.o_bias = nn.Parameter(torch.empty(cfg.hidden)) if cfg.o_bias else None
        every = cfg.qk_norm_over == "all"
        self.q_norm = nn.Parameter(torch.empty(h * d if every else d)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.empty(hk * d if every else d)) if cfg.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(h)) if cfg.sinks else None
        self.gate_bias = nn.Parameter(torch.empty(h)) if cfg.output_gate == "sigmoid_head_bias" else None
        inv, self.rope_factor = None, 1.0
        if cfg.rope_theta is not None:
            params = dict(cfg.rope_params)
            inv, self.rope_factor = rope_table(cfg.rope_theta, cfg.rotary_dim, params, cfg.max_position)
        self.register_buffer("inv_freq", inv, persistent=False)  # fp32 in every model dtype
        ix = cfg.indexer
        if ix is not None:  # [q_i; k_i] projection and the indexer's q / k norms
            self.index_proj = nn.Parameter(torch.empty((ix.heads + 1) * ix.head_dim, cfg.hidden))
            self.index_q_norm = nn.Parameter(torch.empty(ix.head_dim))
            self.index_k_norm = nn.Parameter(torch.empty(ix.head_dim))

    @staticmethod
    def parts(cfg: GqaCfg) -> dict[str, dict[str, int]]:
        h, hk, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        proj = {"q": h * d, "k": hk * d, "v": hk * d} | ({"gate": h * d} if cfg.output_gate != "none" else {})
        out = {"in_proj": proj, "qkv_bias": {"q": h * d, "k": hk * d, "v": hk * d}}
        if (ix := cfg.indexer) is not None:
            out["index_proj"] = {"q": ix.heads * ix.head_dim, "k": ix.head_dim}
        return out

    @staticmethod
    def shards(cfg: GqaCfg) -> dict[str, dict[str, Slice]]:
        p, d, h, hk = cfg.par, cfg.head_dim, cfg.heads, cfg.kv_heads
        if p.size == 1:
            return {}
        q = Slice(-2, p.rank * h * d, h * d)
        first_kv = p.rank * hk if cfg.kv_total >= p.size else p.rank * cfg.kv_total // p.size
        kv = Slice(-2, first_kv * d, hk * d)
        out = {
            "in_proj": {"q": q, "k": kv, "v": kv} | ({"gate": q} if cfg.output_gate != "none" else {}),
            "o_proj": {"": Slice(-1, p.rank * h * d, h * d)},
        }
        if cfg.bias:
            out["qkv_bias"] = {
                part: Slice(-1, sl.start, sl.length) for part, sl in (("q", q), ("k", kv), ("v", kv))
            }
        if cfg.output_gate == "sigmoid_head_bias":
            out["gate_bias"] = {"": Slice(-1, p.rank * h, h)}
        if cfg.sinks:
            out["sinks"] = {"": Slice(-1, p.rank * h, h)}
        if (ix := cfg.indexer) is not None:  # its query heads' rows; the key head's whole
            hi, di = ix.heads, ix.head_dim
            out["index_proj"] = {"q": Slice(-2, p.rank * hi * di, hi * di), "k": Slice(-2, 0, di)}
        return out

    def _norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The q / k norm weights as the ops multiply by them: w, or 1 + w in fp32 (zero-centred)."""
        if self.q_norm is None or not self.cfg.qk_norm_zero_centred:
            return self.q_norm, self.k_norm
        return zero_centred(self.q_norm), zero_centred(self.k_norm)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        c, ops, t = self.cfg, self.ops, x.shape[0]
        proj = ops.linear(x, self.in_proj)  # [T, (2H + 2Hk) D] or [T, (H + 2Hk) D]
        qkv, gate = proj[:, : sum(self.split[:3])], proj[:, sum(self.split[:3]) :]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q, k, v = qkv.split(self.split[:3], dim=-1)
        qw, kw = self._norm_weights()
        if c.qk_norm_over == "all" and qw is not None:  # over H D / Hk D, before the head split
            q = ops.rms_norm(q, qw, c.norm_eps, c.norm_weight_in_fp32)
            k = ops.rms_norm(k, kw, c.norm_eps, c.norm_weight_in_fp32)
            qw = kw = None
        q = q.reshape(t, c.heads, c.head_dim)
        k = k.reshape(t, c.kv_heads, c.head_dim)
        v = v.reshape(t, c.kv_heads, c.head_dim)
        kv = ctx.caches[self.group][:, self.offset : self.offset + 2 * c.kv_heads * c.head_dim]
        kv = kv.view(-1, 2, c.kv_heads, c.head_dim)  # [N, 2, Hk, D]
        meta = ctx.paged[self.group]
        if qw is not None or self.inv_freq is not None or c.query_scaling is not None:
            prep = HeadPrep(
                qw, kw, c.norm_eps, c.norm_weight_in_fp32, self.inv_freq, c.neox,
                c.query_scaling, self.rope_factor,
            )  # fmt: skip
            q = ops.qk_norm_rope_write(q, k, v, ctx.positions, prep, kv[:, 0], kv[:, 1], meta.slots)
        else:
            ops.kv_write(k, v, kv[:, 0], kv[:, 1], meta.slots)
        if c.indexer is not None:
            sel = self._select(x, ctx)  # [T, budget + P - 1] key positions, -1 padded
            o = ops.gqa_attention(q, kv[:, 0], kv[:, 1], meta, c.scale, c.window, c.softcap, self.sinks, sel)
        elif self.sinks is None:
            o = ops.gqa_attention(q, kv[:, 0], kv[:, 1], meta, c.scale, c.window, c.softcap)  # [T, H, D]
        else:
            o = ops.gqa_attention(q, kv[:, 0], kv[:, 1], meta, c.scale, c.window, c.softcap, self.sinks)
        if c.output_gate != "none":
            o = ops.sigmoid_gate(o, gate.reshape(t, c.heads, c.head_dim), self.gate_bias)
        if c.par.size == 1:
            return ops.linear(o.reshape(t, -1), self.o_proj, self.o_bias)
        y = ops.tp.all_reduce(ops.linear(o.reshape(t, -1), self.o_proj))  # [T, Dm] summed over ranks
        return y if self.o_bias is None else y + self.o_bias

    def _select(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """The QSA indexer's selection [T, budget + P - 1] of key positions (-1 padded)."""
        c, ix, ops, t = self.cfg, self.cfg.indexer, self.ops, x.shape[0]
        di = ix.head_dim
        qi, ki = ops.linear(x, self.index_proj).split([ix.heads * di, di], dim=-1)  # [T, Hi Di], [T, Di]
        zc = c.qk_norm_zero_centred
        qw = zero_centred(self.index_q_norm) if zc else self.index_q_norm
        kw = zero_centred(self.index_k_norm) if zc else self.index_k_norm
        qi = ops.rms_norm(qi.reshape(t, ix.heads, di), qw, c.norm_eps, c.norm_weight_in_fp32)
        if self.inv_freq is not None:
            qi = ops.rope(qi, ctx.positions, self.inv_freq, c.neox)  # [T, Hi, Di]
        (g_raw, off_raw), (g, off) = self.index_caches
        raw, raw_meta = ctx.caches[g_raw][:, off_raw : off_raw + di], ctx.paged[g_raw]  # [N, Di]
        ops.cache_write(ki, raw, raw_meta.slots)
        pooled, meta = ctx.caches[g][:, off : off + qsa_row(di, ix.pool)], ctx.paged[g]  # [N', r]
        ops.qsa_pool(raw, raw_meta, pooled, meta, kw, c.norm_eps, self.inv_freq, c.neox, ix.pool)
        score = ops.qsa_scores(qi, pooled, meta, ix.pool, di**-0.5)
        if c.par.size > 1:  # this rank's heads' share of sum_h relu(q_h K_m): summed over ranks
            score = ops.tp.all_reduce(score)
        return ops.index_topk(score, ctx.positions, ix.budget, ix.pool, True)


def _resolve_qsa(o: QsaOpts, val, rot: int, window: int | None) -> QsaCfg:
    ix = QsaCfg(int(val(o.heads)), int(val(o.head_dim)), int(val(o.budget)), int(val(o.pool)))
    if int(val(o.kv_heads)) != 1:
        raise ValueError(
            f"the QSA indexer implements one key head (indexer kv_heads 1), got {val(o.kv_heads)}"
        )
    if min(ix.heads, ix.head_dim, ix.budget, ix.pool) <= 0 or ix.budget % ix.pool:
        raise ValueError(f"QSA indexer budget {ix.budget} must be a positive multiple of pool {ix.pool}")
    if rot > ix.head_dim:
        raise ValueError(f"{rot} rotary channels exceed the QSA indexer head_dim {ix.head_dim}")
    if window is not None:
        raise ValueError("the QSA indexer is not implemented with a sliding window")
    return ix


def _resolve_gqa(o: GqaOpts, val) -> GqaCfg:
    d = int(val(o.head_dim))
    rope = o.rope
    params: dict[str, Any] = {}
    if rope is not None:
        params = dict((val(rope.parameters) if rope.parameters is not None else None) or {})
        kind = val(rope.kind) or "default"
        if params and rope_kind(params) != kind and kind != "default":
            raise ValueError(f"rope kind {kind!r} disagrees with rope_parameters' {rope_kind(params)!r}")
        params.setdefault("rope_type", params.get("type") or kind)  # a legacy mapping names it `type`
        if (kind := rope_kind(params)) not in ROPE_TYPES:
            raise ValueError(f"rope kind {kind!r} is not supported yet; known: {', '.join(ROPE_TYPES)}")
        if rope.original_context is not None and (orig := val(rope.original_context)) is not None:
            params = with_original_context(params, int(orig))
    rot = 0 if rope is None else int(d * float(val(rope.fraction)))
    if rope is not None and (rot <= 0 or rot % 2):
        raise ValueError(
            f"rope.fraction gives {rot} rotary channels of head_dim {d}; need an even number > 0"
        )
    max_pos = None if val("$max_position") is None else int(val("$max_position"))
    if rope is not None:
        rope_table(float(val(rope.theta)), rot, params, max_pos)  # bad parameters fail here, named
    qs = o.query_scaling
    qk = o.qk_norm if isinstance(o.qk_norm, QkNormOpts) else QkNormOpts(enabled=o.qk_norm)
    if qk.zero_centred and not bool(val("$norm_weight_in_fp32")):
        raise ValueError(
            "qk_norm.zero_centred multiplies by (1 + w) in fp32: needs norm.weight_in_fp32: true"
        )
    heads, kv_heads = int(val(o.heads)), int(val(o.kv_heads))
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"{heads} query heads do not split into groups over {kv_heads} KV heads")
    window = None if o.window is None or val(o.window) is None else int(val(o.window))
    return GqaCfg(
        hidden=int(val("$hidden")),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=d,
        bias=bool(val(o.bias)),
        qk_norm=bool(val(qk.enabled)),
        norm_eps=float(val("$norm_eps")),
        norm_weight_in_fp32=bool(val("$norm_weight_in_fp32")),
        rope_theta=None if rope is None else float(val(rope.theta)),
        rotary_dim=rot,
        neox=True if rope is None else rope.neox,
        rope_params=tuple(sorted((k, _frozen(v)) for k, v in params.items())),
        max_position=max_pos,
        window=window,
        output_gate=o.output_gate,
        query_scaling=None if qs is None else (float(val(qs.base)), float(val(qs.exponent))),
        softcap=None if o.softcap is None or val(o.softcap) is None else float(val(o.softcap)),
        scale=d**-0.5 if o.scale is None else float(val(o.scale)),
        qk_norm_over=qk.over,
        qk_norm_zero_centred=qk.zero_centred,
        sinks=bool(val(o.sinks)),
        o_bias=bool(val(o.bias if o.o_bias is None else o.o_bias)),
        indexer=None if o.indexer is None else _resolve_qsa(o.indexer, val, rot, window),
    )


def _shard_gqa(c: GqaCfg, par: Parallel) -> GqaCfg:
    if c.qk_norm and c.qk_norm_over == "all":
        raise ValueError("a q/k norm over all heads (qk_norm.over: all) is not tensor-parallel yet")
    ix = c.indexer
    if ix is not None:  # by indexer query head; the one key head and its cache replicated
        ix = dataclasses.replace(ix, heads=par.even(ix.heads, "qsa indexer heads"))
    h = par.even(c.heads, "query heads")
    if c.kv_heads % par.size and par.size % c.kv_heads:
        raise ValueError(
            f"{c.kv_heads} KV heads neither split over nor replicate evenly across "
            f"tensor-parallel size {par.size}"
        )
    return dataclasses.replace(
        c, heads=h, kv_heads=max(c.kv_heads // par.size, 1), par=par, kv_total=c.kv_heads, indexer=ix
    )


def _frozen(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _gqa_needs(c: GqaCfg):
    attn = {"causal"} | ({"sliding_window"} if c.window else set()) | ({"softcap"} if c.softcap else set())
    attn |= {"sinks"} if c.sinks else set()
    attn |= {"select"} if c.indexer else set()
    needs = [
        ("linear", frozenset({"bias"}) if c.bias or c.o_bias else frozenset(), None),
        ("gqa_attention", frozenset(attn), c.head_dim),
    ]
    fp32 = {"weight_in_fp32"} if c.norm_weight_in_fp32 else set()
    per_head = c.qk_norm and c.qk_norm_over == "head"
    prep = {"norm"} | fp32 if per_head else set()
    if c.qk_norm and not per_head:
        needs.append(("rms_norm", frozenset(fp32), None))
    if c.rope_theta is not None:
        prep |= (
            {"rope"} | ({"partial"} if c.rotary_dim < c.head_dim else set()) | ({"neox"} if c.neox else set())
        )
    if c.query_scaling is not None:
        prep.add("log_scaling")
    needs.append(
        ("qk_norm_rope_write", frozenset(prep), None) if prep else ("kv_write", frozenset(), c.head_dim)
    )
    if c.output_gate != "none":
        needs.append(
            ("sigmoid_gate", frozenset({"bias"} if c.output_gate == "sigmoid_head_bias" else ()), None)
        )
    if c.indexer is not None:
        needs += [("rms_norm", frozenset(fp32), None), ("cache_write", frozenset(), None)]
        needs += [("qsa_pool", frozenset(), None), ("qsa_scores", frozenset(), None)]
        needs.append(("index_topk", frozenset({"tail"}), None))
        if c.rope_theta is not None:
            rope = {"partial"} | ({"neox"} if c.neox else set())
            needs.append(("rope", frozenset(rope), None))
    return needs


def _gqa_cache(c: GqaCfg) -> tuple[CacheDecl, ...]:
    row = 2 * c.kv_heads * c.head_dim
    kv = CacheDecl("kv", "sliding", row, c.window) if c.window else CacheDecl("kv", "paged", row)
    if (ix := c.indexer) is None:
        return (kv,)
    raw = CacheDecl("index_raw", "sliding", ix.head_dim, ix.pool)  # a block's keys until it completes
    return kv, raw, CacheDecl("index", "paged", qsa_row(ix.head_dim, ix.pool))


def _gqa_static_cache(o: GqaOpts) -> tuple[StaticCache, ...]:
    kv = (
        StaticCache("kv", "paged", "", "kv")
        if o.window is None
        else StaticCache("kv", "sliding", str(o.window), "kv_swa")
    )
    if o.indexer is None:
        return (kv,)
    raw = StaticCache("index_raw", "sliding", f"qsa_raw_{o.indexer.pool}", "index_raw")
    return kv, raw, StaticCache("index", "paged", "index_qsa", "index")


BLOCKS.add(
    "gqa",
    BlockDef(
        "gqa",
        "attention",
        GqaOpts,
        _resolve_gqa,
        GqaAttention,
        _gqa_needs,
        _gqa_cache,
        _gqa_static_cache,
        GqaAttention.__doc__ or "",
        _shard_gqa,
    ),
)
