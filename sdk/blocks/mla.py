"""Multi-head latent attention (MLA), optionally sparse through a DSA or pooled (KPool) indexer."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from dayzero.kernels.packed import PackedWeight, dense
from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.base import BLOCKS, BlockDef, CacheDecl, StaticCache
from dayzero.sdk.blocks.rope import rope_table, softmax_mscale
from dayzero.sdk.config.model import ONE_RANK, Parallel, Slice
from dayzero.sdk.config.options import BoolV, FloatV, IntV, Ref, Strict

SELECTION = "sparse_selection"  # StepContext.shared key: the last indexer's selection [T, K]


class MlaRopeOpts(Strict):
    theta: FloatV
    interleaved: bool = True  # pairs (2j, 2j + 1) rotate together (DeepSeek); else rotate-half
    parameters: Ref | None = None  # a symbol holding the HF `rope_parameters` mapping (yarn)


class IndexerOpts(Strict):
    kind: Literal["dsa", "kpool"]
    heads: IntV
    head_dim: IntV
    topk: IntV
    reuse: bool = False  # use the selection of the last earlier layer that ran an indexer
    rope_interleaved: bool | None = None  # the index keys' RoPE pairing; None: as the MLA's
    pool: IntV = 16  # kpool: keys per pooled group
    tail: BoolV = True  # kpool: always attend to the query's incomplete group
    norm_eps: FloatV = 1e-6  # the index key's LayerNorm


class MlaOpts(Strict):
    kind: Literal["mla"]
    heads: IntV
    q_lora: IntV | None = None  # None or 0: q = x W_q (no low-rank query path)
    kv_lora: IntV
    nope_dim: IntV
    rope_dim: IntV = 0  # 0: NoPE, no shared key part
    v_dim: IntV
    rope: MlaRopeOpts | None = None
    # true: NoPE with the rope_dim part kept: q_r and the shared key k_r are never rotated (Kimi
    # Linear's MLA); the `rope` section, if any, is unused. A $symbol lets the config say so
    nope: BoolV = False
    latent_norm_eps: FloatV = 1e-6  # the q and kv latent RMS norms
    bias: BoolV = False  # biases on the down projections and the output projection
    output_gate: BoolV = False  # o <- o * sigmoid(x W_g) before W_o (Kimi K3's mla_use_output_gate)
    indexer: IndexerOpts | None = None


@dataclass(frozen=True)
class IndexerCfg:
    kind: str
    heads: int
    head_dim: int
    topk: int
    reuse: bool
    pool: int
    tail: bool
    norm_eps: float
    rope_interleaved: bool = True


@dataclass(frozen=True)
class MlaCfg:
    hidden: int
    heads: int
    q_lora: int  # 0: plain q
    kv_lora: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    nope: bool  # the rope_dim channels stay unrotated (a position-free shared key)
    rope_theta: float | None
    rope_params: tuple[tuple[str, Any], ...]  # the HF rope_parameters (sorted items), or ()
    interleaved: bool
    latent_norm_eps: float
    bias: bool
    scale: float
    indexer: IndexerCfg | None
    output_gate: bool = False
    par: Parallel = ONE_RANK  # tensor parallel: `heads` above are this rank's


class MlaAttention(nn.Module):
    """Multi-head latent attention; the cache keeps the latent, never expanded K/V.

    q = W_qb rmsnorm(x W_qa) (or x W_q)                 [T, H, Dn + Dr] = [q_n ; q_r]
    [c ; k_r] = x W_kva;  c <- rmsnorm(c)                c [T, L] latent, k_r [T, Dr] shared key
    q_r, k_r <- a * rope(q_r, p), a * rope(k_r, p)       (a: the rope table's attention factor;
                                                         `nope`: q_r, k_r unrotated, a = 1)
    k[j, h] = [W_k[h] c_j ; k_r[j]],  v[j, h] = W_v[h] c_j   ([W_k; W_v] = W_kvb per head)
    o[t, h] = sum_{j in S(t)} softmax_j(scale <q[t, h], k[j, h]>) v[j, h];  y = o W_o
    (output_gate: o <- o * sigmoid(x W_g), W_g [H Dv, Dm], elementwise in fp32, before W_o)
    S(t) = all j <= p_t, or the indexer's selection (sparse attention):
      dsa:   I[t, j] = sum_h w[t, h] relu(<q_i[t, h], k_i[j]> / sqrt(Di)), top-k j <= p_t
      kpool: the same over pooled groups of P keys (softmax(gate + ape)-weighted), the top
             k / P groups ending at or before p_t, plus the query's incomplete group
    q_i = W_iq rmsnorm(x W_qa), k_i = layernorm(x W_ik) (both roped on the first Dr channels,
    paired as the MLA's RoPE unless the indexer says otherwise; unrotated with `nope`),
    w = x W_iw / sqrt(Hi). A `reuse` layer attends to the last indexer layer's S(t).

    Tensor parallel over P ranks: each rank holds H / P heads (its rows of W_qb, or of W_q, of
    W_kvb and of W_g, its columns of W_o) and Hi / P indexer heads (its rows of W_iq and W_iw); the
    latents, the index key (W_ik, its norm, the pool gate and ape) and their caches are
    replicated, so every rank caches the same [c ; k_r] and k_i. Each rank scores with its
    indexer heads (I_r: the sum above over its h, w still scaled by the whole 1 / sqrt(Hi)),
    I = sum over ranks of I_r (all-reduce), and every rank takes the same top-k of I;
    y = sum over ranks of o_r W_o,r (all-reduce), + b_o once.
    """

    fp32_params = ("index_weights",)  # the indexer's head weights stay fp32 in every dtype
    linear_weights = (
        "a_proj", "q_b", "kv_b", "g_proj", "o_proj", "index_q", "index_k", "index_weights", "pool_gate"
    )  # fmt: skip

    def __init__(self, cfg: MlaCfg, ops: OpTable, caches: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.latent_cache = caches[0]  # (group, offset) of [c ; k_r]
        self.index_cache = caches[1] if len(caches) > 1 else None
        h, dq = cfg.heads, cfg.nope_dim + cfg.rope_dim
        q_in = cfg.q_lora or h * dq
        a_out = q_in + cfg.kv_lora + cfg.rope_dim
        self.a_proj = nn.Parameter(torch.empty(a_out, cfg.hidden))  # [q_a or q ; kv_a]
        self.a_bias = nn.Parameter(torch.empty(a_out)) if cfg.bias else None
        self.q_norm = nn.Parameter(torch.empty(cfg.q_lora)) if cfg.q_lora else None
        self.q_b = nn.Parameter(torch.empty(h * dq, cfg.q_lora)) if cfg.q_lora else None
        self.kv_norm = nn.Parameter(torch.empty(cfg.kv_lora))
        self.kv_b = nn.Parameter(torch.empty(h * (cfg.nope_dim + cfg.v_dim), cfg.kv_lora))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden, h * cfg.v_dim))
        self.o_bias = nn.Parameter(torch.empty(cfg.hidden)) if cfg.bias else None
        self.g_proj = nn.Parameter(torch.empty(h * cfg.v_dim, cfg.hidden)) if cfg.output_gate else None
        ix = cfg.indexer
        own = ix is not None and not ix.reuse
        di = ix.head_dim if ix else 0
        self.index_q = nn.Parameter(torch.empty(ix.heads * di, cfg.q_lora)) if own else None
        self.index_k = nn.Parameter(torch.empty(di, cfg.hidden)) if own else None
        self.index_k_norm = nn.Parameter(torch.empty(di)) if own else None
        self.index_k_bias = nn.Parameter(torch.empty(di)) if own else None
        self.index_weights = nn.Parameter(torch.empty(ix.heads, cfg.hidden)) if own else None
        pooled = own and ix.kind == "kpool"
        self.pool_ape = nn.Parameter(torch.empty(ix.pool, di)) if pooled else None
        self.pool_gate = nn.Parameter(torch.empty(di, cfg.hidden)) if pooled else None
        inv, self.rope_factor = (None, 1.0)
        if cfg.rope_dim and not cfg.nope:
            inv, self.rope_factor = rope_table(cfg.rope_theta, cfg.rope_dim, dict(cfg.rope_params))
        self.register_buffer("inv_freq", inv, persistent=False)
        self._kv_b_dense: torch.Tensor | None = None  # a packed kv_b, dequantized on first use

    @staticmethod
    def parts(cfg: MlaCfg) -> dict[str, dict[str, int]]:
        q_in = cfg.q_lora or cfg.heads * (cfg.nope_dim + cfg.rope_dim)
        kv = cfg.kv_lora + cfg.rope_dim
        return {"a_proj": {"q": q_in, "kv": kv}, "a_bias": {"q": q_in, "kv": kv}}

    @staticmethod
    def shards(cfg: MlaCfg) -> dict[str, dict[str, Slice]]:
        p, h = cfg.par, cfg.heads
        if p.size == 1:
            return {}
        dq, dkv = cfg.nope_dim + cfg.rope_dim, cfg.nope_dim + cfg.v_dim
        out = {
            "kv_b": {"": Slice(-2, p.rank * h * dkv, h * dkv)},
            "o_proj": {"": Slice(-1, p.rank * h * cfg.v_dim, h * cfg.v_dim)},
        }
        if cfg.output_gate:
            out["g_proj"] = {"": Slice(-2, p.rank * h * cfg.v_dim, h * cfg.v_dim)}
        q = Slice(-2, p.rank * h * dq, h * dq)
        ix = cfg.indexer
        if ix is not None and not ix.reuse:  # the indexer's query heads and their weights
            hi, di = ix.heads, ix.head_dim
            out["index_q"] = {"": Slice(-2, p.rank * hi * di, hi * di)}
            out["index_weights"] = {"": Slice(-2, p.rank * hi, hi)}
        if cfg.q_lora:
            out["q_b"] = {"": q}
        else:  # q = x W_q sits in a_proj's q part: split by head, the kv latent replicated
            out["a_proj"] = {"q": q, "kv": Slice(-2, 0, cfg.kv_lora + cfg.rope_dim)}
            if cfg.bias:
                out["a_bias"] = {
                    "q": Slice(-1, q.start, q.length),
                    "kv": Slice(-1, 0, cfg.kv_lora + cfg.rope_dim),
                }
        return out

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """Rotate the first Dr channels of x [T, H, D] and scale them by the attention factor."""
        r = self.ops.rope(x, positions, self.inv_freq, not interleaved)
        if self.rope_factor == 1.0:
            return r
        dr = self.cfg.rope_dim
        return torch.cat((r[..., :dr] * self.rope_factor, r[..., dr:]), dim=-1)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        c, ops, t = self.cfg, self.ops, x.shape[0]
        h, dn, dr = c.heads, c.nope_dim, c.rope_dim
        a = ops.linear(x, self.a_proj, self.a_bias)
        q_in = c.q_lora or h * (dn + dr)
        q, latent = a[:, :q_in], a[:, q_in:]
        q_res = None
        if self.q_b is not None:
            q_res = ops.rms_norm(q, self.q_norm, c.latent_norm_eps)  # [T, Lq]
            q = ops.linear(q_res, self.q_b)
        q = q.reshape(t, h, dn + dr)
        lat = ops.rms_norm(latent[:, : c.kv_lora], self.kv_norm, c.latent_norm_eps)  # [T, L]
        k_r = latent[:, c.kv_lora :]  # [T, Dr]
        q_n, q_r = q[..., :dn], q[..., dn:]
        if dr and not c.nope:
            q_r = self._rope(q_r, ctx.positions, c.interleaved)
            k_r = self._rope(k_r[:, None, :], ctx.positions, c.interleaved)[:, 0]
        g, off = self.latent_cache
        cache = ctx.caches[g][:, off : off + c.kv_lora + dr]
        meta = ctx.paged[g]
        ops.cache_write(torch.cat((lat, k_r), dim=-1), cache, meta.slots)
        select = self._select(x, q_res, ctx)
        w_k, w_v = self._kv_b_heads(x.dtype)
        o = ops.mla_attention(q_n, q_r, cache, w_k, w_v, meta, c.scale, select)  # [T, H, Dv]
        if self.g_proj is not None:  # fp32 gate, rounded once
            gate = ops.linear(x, self.g_proj).view(t, h, c.v_dim)
            o = ops.sigmoid_gate(o.float(), gate.float(), None).to(o.dtype)
        if c.par.size == 1:
            return ops.linear(o.reshape(t, -1), self.o_proj, self.o_bias)
        y = ops.tp.all_reduce(ops.linear(o.reshape(t, -1), self.o_proj))  # [T, Dm] summed over ranks
        return y if self.o_bias is None else y + self.o_bias

    def _kv_b_heads(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b split per head: W_k [H, Dn, L], W_v [H, Dv, L] (the absorbed form folds them into
        q and the output). A packed kv_b is dequantized once (the loader writes it before the
        first step), not every step."""
        c, w = self.cfg, self.kv_b
        if isinstance(w, PackedWeight):
            if self._kv_b_dense is None or self._kv_b_dense.dtype != dtype:
                self._kv_b_dense = dense(w, dtype)
            w = self._kv_b_dense
        w = w.view(c.heads, c.nope_dim + c.v_dim, c.kv_lora)
        return w[:, : c.nope_dim], w[:, c.nope_dim :]

    def _select(self, x: torch.Tensor, q_res: torch.Tensor | None, ctx) -> torch.Tensor | None:
        """The indexer's selection [T, K] of key positions (None: dense attention)."""
        ix, ops = self.cfg.indexer, self.ops
        if ix is None:
            return None
        if ix.reuse:
            if SELECTION not in ctx.shared:
                raise RuntimeError("a layer reusing sparse selections comes before any indexer layer")
            return ctx.shared[SELECTION]
        t, di = x.shape[0], ix.head_dim
        qi = ops.linear(q_res, self.index_q).reshape(t, ix.heads, di)
        ki = ops.layer_norm(ops.linear(x, self.index_k), self.index_k_norm, self.index_k_bias, ix.norm_eps)
        if self.cfg.rope_dim and not self.cfg.nope:
            qi = self._rope(qi, ctx.positions, ix.rope_interleaved)
            ki = self._rope(ki[:, None, :], ctx.positions, ix.rope_interleaved)[:, 0]
        p = self.cfg.par
        # [T, Hi] fp32: x read in the fp32 weights' dtype
        w = ops.linear(x, self.index_weights).float() * (ix.heads * p.size) ** -0.5
        g, off = self.index_cache
        meta = ctx.paged[g]
        if ix.kind == "dsa":
            cache = ctx.caches[g][:, off : off + di]
            ops.cache_write(ki, cache, meta.slots)
            if p.size == 1:
                sel = ops.dsa_index(qi, w, cache, meta, ix.topk, di**-0.5)
            else:  # this rank's heads' part of I, summed over the ranks: [T, L]
                score = ops.tp.all_reduce(ops.dsa_scores(qi, w, cache, meta, di**-0.5))
                sel = ops.index_topk(score, meta.positions, ix.topk)
        else:
            cache = ctx.caches[g][:, off : off + 2 * di]
            ops.cache_write(torch.cat((ki, ops.linear(x, self.pool_gate)), dim=-1), cache, meta.slots)
            if p.size == 1:
                sel = ops.kpool_index(qi, w, cache, self.pool_ape, meta, ix.topk, ix.pool, di**-0.5, ix.tail)
            else:  # by pool: [T, M]
                score = ops.kpool_scores(qi, w, cache, self.pool_ape, meta, ix.pool, di**-0.5)
                score = ops.tp.all_reduce(score)
                sel = ops.index_topk(score, meta.positions, ix.topk, ix.pool, ix.tail)
        ctx.shared[SELECTION] = sel
        return sel


def _resolve(o: MlaOpts, val) -> MlaCfg:
    rope_dim, nope_dim = int(val(o.rope_dim) or 0), int(val(o.nope_dim))
    no_rotation = bool(val(o.nope))
    rotated = rope_dim if not no_rotation else 0  # the channels RoPE rotates
    if rotated and o.rope is None:
        raise ValueError(f"rope_dim {rope_dim} needs a `rope` section (or `nope: true`)")
    if rotated % 2:
        raise ValueError(f"rope_dim must be even, got {rope_dim}")
    params = val(o.rope.parameters) if rotated and o.rope.parameters else None
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"rope.parameters must name a mapping (HF rope_parameters), got {params!r}")
    if rotated:
        rope_table(float(val(o.rope.theta)), rope_dim, params)  # an unknown rope type fails here
    q_lora = int(val(o.q_lora) or 0)
    ix = None
    if o.indexer is not None:
        i = o.indexer
        ix = IndexerCfg(
            i.kind,
            int(val(i.heads)),
            int(val(i.head_dim)),
            int(val(i.topk)),
            i.reuse,
            int(val(i.pool)),
            bool(val(i.tail)),
            float(val(i.norm_eps)),
            (o.rope.interleaved if o.rope else True) if i.rope_interleaved is None else i.rope_interleaved,
        )
        if not q_lora:
            raise ValueError("a sparse-attention indexer reads the q latent: it needs q_lora > 0")
        if ix.topk <= 0 or (ix.kind == "kpool" and (ix.pool <= 0 or ix.topk % ix.pool)):
            raise ValueError(
                f"indexer topk {ix.topk} must be > 0 (and a multiple of pool {ix.pool} for kpool)"
            )
        if rotated > ix.head_dim:
            raise ValueError(f"rope_dim {rope_dim} exceeds the indexer head_dim {ix.head_dim}")
    return MlaCfg(
        hidden=int(val("$hidden")),
        heads=int(val(o.heads)),
        q_lora=q_lora,
        kv_lora=int(val(o.kv_lora)),
        nope_dim=nope_dim,
        rope_dim=rope_dim,
        v_dim=int(val(o.v_dim)),
        nope=no_rotation,
        rope_theta=float(val(o.rope.theta)) if rotated else None,
        rope_params=tuple(sorted((params or {}).items())),
        interleaved=o.rope.interleaved if o.rope else True,
        latent_norm_eps=float(val(o.latent_norm_eps)),
        bias=bool(val(o.bias)),
        scale=(nope_dim + rope_dim) ** -0.5 * softmax_mscale(params),
        indexer=ix,
        output_gate=bool(val(o.output_gate)),
    )


def _shard(c: MlaCfg, par: Parallel) -> MlaCfg:
    ix = c.indexer
    if ix is not None:
        ix = dataclasses.replace(ix, heads=par.even(ix.heads, f"{ix.kind} indexer heads"))
    return dataclasses.replace(c, heads=par.even(c.heads, "MLA heads"), indexer=ix, par=par)


def _needs(c: MlaCfg):
    ix = c.indexer
    out = [
        ("linear", frozenset({"bias"}) if c.bias else frozenset(), None),
        ("rms_norm", frozenset(), None),
        ("cache_write", frozenset(), None),
        ("mla_attention", frozenset({"causal"} | ({"select"} if ix else set())), None),
    ]
    if c.output_gate:
        out.append(("sigmoid_gate", frozenset(), None))
    if c.rope_dim and not c.nope:
        neox = not c.interleaved or (ix is not None and not ix.reuse and not ix.rope_interleaved)
        out.append(("rope", frozenset({"neox"}) if neox else frozenset(), None))
    if ix and not ix.reuse:
        out.append(("layer_norm", frozenset(), None))
        tail = frozenset({"tail"} if ix.kind == "kpool" and ix.tail else ())
        if c.par.size > 1:  # scores of this rank's heads, summed over the ranks, then the top-k
            out += [(f"{ix.kind}_scores", frozenset(), None), ("index_topk", tail, None)]
        elif ix.kind == "dsa":
            out.append(("dsa_index", frozenset(), None))
        else:
            out.append(("kpool_index", tail, None))
    return out


def _cache(c: MlaCfg) -> tuple[CacheDecl, ...]:
    latent = CacheDecl("latent", "paged", c.kv_lora + c.rope_dim)
    ix = c.indexer
    if ix is None or ix.reuse:
        return (latent,)
    return latent, CacheDecl("index", "paged", ix.head_dim * (1 if ix.kind == "dsa" else 2))


def _static_cache(o: MlaOpts) -> tuple[StaticCache, ...]:
    latent = StaticCache("latent", "paged", "mla", "mla")
    ix = o.indexer
    if ix is None or ix.reuse:
        return (latent,)
    return latent, StaticCache("index", "paged", f"index_{ix.kind}", "index")


BLOCKS.add(
    "mla",
    BlockDef(
        "mla",
        "attention",
        MlaOpts,
        _resolve,
        MlaAttention,
        _needs,
        _cache,
        _static_cache,
        MlaAttention.__doc__,
        _shard,
    ),
)
