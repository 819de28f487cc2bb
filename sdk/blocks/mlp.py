"""Feed-forward blocks: SwiGLU and mixture-of-experts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from dayzero.kernels.ops import ACTIVATIONS, DEFAULT_CONSTS
from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.base import BLOCKS, BlockDef
from dayzero.sdk.config.model import ONE_RANK, Parallel, Slice
from dayzero.sdk.config.options import BoolV, FloatV, IntV, Ref, Strict

# the gated MLPs' activations: a(g) u with a = silu (SwiGLU), gelu_pytorch_tanh (GeGLU),
# clamped_swiglu: g sigmoid(alpha g) (u + 1) (gpt-oss; with its limit), or situ (Kimi K3):
# [b tanh(g / b) sigmoid(g)] [b_l tanh(u / b_l)], b = situ_beta, b_l = situ_linear_beta (null: u)
Activation = Literal["silu", "gelu_pytorch_tanh", "clamped_swiglu", "situ"]


class SwigluOpts(Strict):
    kind: Literal["swiglu"]
    intermediate: IntV
    fp32: BoolV = False  # activation and product in fp32
    limit: FloatV | None = None  # clamp: gate <= limit, |up| <= limit
    # the activation, or a $symbol reading it from the config (hidden_act / hidden_activation)
    activation: Activation | Ref = "silu"
    alpha: FloatV = 1.702  # clamped_swiglu's sigmoid slope
    situ_beta: FloatV = 4.0  # situ's gate bound
    situ_linear_beta: FloatV | None = 25.0  # situ's bound on up (null: up unbounded)


@dataclass(frozen=True)
class SwigluCfg:
    hidden: int
    intermediate: int  # this rank's, when sharded
    fp32: bool
    limit: float | None = None
    par: Parallel = ONE_RANK
    reduce: bool = True  # sum the ranks' outputs here (False: the enclosing block does)
    act: str = "silu"
    consts: tuple[float, float] = DEFAULT_CONSTS  # the activation's (kernels/ops.py)


def act_args(c: SwigluCfg | MoeCfg) -> tuple:
    """The swiglu op's trailing (activation, constants), passed only past the default silu."""
    return () if c.act == "silu" else (c.act, c.consts)


class SwiGLU(nn.Module):
    """y = W_down (a(g) * u), g = x W_gate, u = x W_up; [gate; up] is one fused projection;
    a = silu (SwiGLU), gelu_tanh (GeGLU), clamped_swiglu: a(g) u = g sigmoid(alpha g) (u + 1), or
    SiTU: a(g) u = [b tanh(g / b) sigmoid(g)] [b_l tanh(u / b_l)] (Kimi K3; not SiLU: both halves
    bounded, by b and b_l).
    With a limit: g <- min(g, limit), u <- clamp(u, -limit, limit) before the product.
    Tensor parallel over P ranks: each holds I / P of the intermediate (rows of W_gate, W_up,
    columns of W_down); y = sum over ranks of its partial product (all-reduce)."""

    linear_weights = ("gate_up", "down")  # may be packed

    def __init__(self, cfg: SwigluCfg, ops: OpTable) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate, cfg.hidden))
        self.down = nn.Parameter(torch.empty(cfg.hidden, cfg.intermediate))

    @staticmethod
    def parts(cfg: SwigluCfg) -> dict[str, dict[str, int]]:
        return {"gate_up": {"gate": cfg.intermediate, "up": cfg.intermediate}}

    @staticmethod
    def shards(cfg: SwigluCfg) -> dict[str, dict[str, Slice]]:
        if cfg.par.size == 1:
            return {}
        cols = Slice(-2, cfg.par.rank * cfg.intermediate, cfg.intermediate)
        return {"gate_up": {"gate": cols, "up": cols}, "down": {"": Slice(-1, cols.start, cols.length)}}

    def forward(self, x: torch.Tensor, rows: tuple[int, ...] | None = None) -> torch.Tensor:
        """x [T, Dm] -> [T, Dm]; rows (data-parallel attention): every rank's row count of x, in
        rank order -> this rank's rows of the sum over ranks, [rows[rank], Dm]."""
        gate, up = self.ops.linear(x, self.gate_up).chunk(2, dim=-1)  # [T, I] each
        y = self.ops.linear(
            self.ops.swiglu(gate, up, self.cfg.fp32, self.cfg.limit, *act_args(self.cfg)), self.down
        )
        return self.ops.tp.reduce(y, rows) if self.cfg.reduce and self.cfg.par.size > 1 else y


class MoeOpts(Strict):
    kind: Literal["moe"]
    experts: IntV
    top_k: IntV
    intermediate: IntV
    score: Literal["sigmoid", "softmax"] = "softmax"
    correction_bias: bool = False
    groups: IntV = 1
    topk_groups: IntV = 1
    renormalize: BoolV = True
    routed_scale: FloatV = 1.0
    shared_intermediate: IntV = 0  # 0: no shared expert
    shared_gate: bool = False  # sigmoid(x w_g) scales the shared expert
    fp32: BoolV = False  # expert activations in fp32
    limit: FloatV | None = None  # SwiGLU clamp of routed and shared experts (see swiglu)
    activation: Activation | Ref = "silu"  # of routed and shared experts (see swiglu)
    alpha: FloatV = 1.702
    situ_beta: FloatV = 4.0
    situ_linear_beta: FloatV | None = 25.0
    router_bias: BoolV = False  # a bias [E] added to the router logits before top-k (gpt-oss)
    expert_bias: BoolV = False  # gate_up [E, 2I] and down [E, Dm] biases of the routed experts
    # latent MoE (Kimi K3): the routed experts work in this width, between a down projection of x
    # and an up projection of their weighted sum (null: the hidden width, no projections)
    latent: IntV | None = None
    latent_norm: BoolV = True  # RMSNorm on the routed sum in the latent width
    latent_norm_eps: FloatV = 1e-6


@dataclass(frozen=True)
class MoeCfg:
    hidden: int
    experts: int
    top_k: int
    intermediate: int
    score: str
    correction_bias: bool
    groups: int
    topk_groups: int
    renormalize: bool
    routed_scale: float
    shared_intermediate: int
    shared_gate: bool
    fp32: bool
    limit: float | None = None
    act: str = "silu"
    consts: tuple[float, float] = DEFAULT_CONSTS  # the activation's (kernels/ops.py)
    router_bias: bool = False
    expert_bias: bool = False
    latent: int = 0  # the routed experts' width (0: hidden, no latent projections)
    latent_norm: bool = True
    latent_norm_eps: float = 1e-6
    par: Parallel = ONE_RANK  # sharded: `experts` (expert parallel) or the intermediates are this rank's
    experts_total: int = 0  # the model's routed experts (sharded configs)


class MoE(nn.Module):
    """Routed experts (+ shared expert).

    s = score(x W_r^T + b_r) (fp32; sigmoid or softmax over E experts; b_r: router_bias)
    pick top_k by s + b_corr (bias only selects), within the topk_groups best of `groups`
    groups (group score = sum of its top-2); w = s[picked] (/ sum when renormalize)
    y = routed_scale * sum_k w_k SwiGLU_{e_k}(x)  (+ [sigmoid(x w_g)] SwiGLU_shared(x))
    (sigmoid + correction bias + groups is DeepSeek's `noaux_tc` selection; every SwiGLU takes
    the block's limit and activation; expert_bias: SwiGLU_e(x) = W_down,e a([g; u] + b_gu,e) + b_d,e;
    softmax + renormalize over the top-k is softmax over the top-k logits, gpt-oss's router)
    Latent (Kimi K3): the routed experts read u = x W_ld [T, L] and their sum r [T, L] returns as
    W_lu rmsnorm(r) (no norm without latent_norm); the shared expert stays at width Dm:
        y = W_lu rmsnorm(routed_scale * sum_k w_k SwiGLU_{e_k}(x W_ld)) + SwiGLU_shared(x)

    Over P ranks the router (and routing) is replicated; expert parallel: rank r holds experts
    [r E / P, (r + 1) E / P) whole and passes the others' picks as id -1 (no expert: no work,
    the op's feature `skip`); tensor parallel: every rank
    holds I / P of every expert's intermediate; the shared expert is split by its intermediate
    either way; y = sum over ranks (one all-reduce). Latent: W_ld, W_lu and the norm are
    replicated; the ranks' partial r are summed first (an all-reduce in the latent width, as the
    norm needs all of r), W_lu rmsnorm(r) is then whole on every rank and only the shared
    expert's part is summed. Expert biases need expert parallel (a
    down bias split over intermediates would be added once per rank).
    """

    fp32_params = ("router", "correction_bias", "router_bias")  # routing stays fp32 in every model dtype
    linear_weights = ("router", "gate_up", "down", "shared_gate", "latent_down", "latent_up")  # may be packed

    def __init__(self, cfg: MoeCfg, ops: OpTable) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        e, i, h = cfg.experts, cfg.intermediate, cfg.hidden
        total, w = cfg.experts_total or e, cfg.latent or cfg.hidden  # w: the routed experts' width
        self.first = cfg.par.rank * e if cfg.par.experts else 0  # this rank's first expert
        self.router = nn.Parameter(torch.empty(total, h))
        self.correction_bias = nn.Parameter(torch.empty(total)) if cfg.correction_bias else None
        self.router_bias = nn.Parameter(torch.empty(total)) if cfg.router_bias else None
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, w))
        self.down = nn.Parameter(torch.empty(e, w, i))
        self.gate_up_bias = nn.Parameter(torch.empty(e, 2 * i)) if cfg.expert_bias else None
        self.down_bias = nn.Parameter(torch.empty(e, w)) if cfg.expert_bias else None
        latent = bool(cfg.latent)
        self.latent_down = nn.Parameter(torch.empty(w, h)) if latent else None
        self.latent_up = nn.Parameter(torch.empty(h, w)) if latent else None
        self.latent_norm = nn.Parameter(torch.empty(w)) if latent and cfg.latent_norm else None
        si = cfg.shared_intermediate
        shared = SwigluCfg(h, si, cfg.fp32, cfg.limit, cfg.par, reduce=False, act=cfg.act, consts=cfg.consts)
        self.shared = SwiGLU(shared, ops) if si else None
        self.shared_gate = nn.Parameter(torch.empty(1, h)) if si and cfg.shared_gate else None

    def routed(self) -> tuple[int, float]:
        """(routed-expert parameters, the fraction of them one token uses)."""
        return self.gate_up.numel() + self.down.numel(), self.cfg.top_k / self.cfg.experts

    @staticmethod
    def parts(cfg: MoeCfg) -> dict[str, dict[str, int]]:
        halves = {"gate": cfg.intermediate, "up": cfg.intermediate}
        return {"gate_up": halves, "gate_up_bias": halves} | {
            "shared.gate_up": {"gate": cfg.shared_intermediate, "up": cfg.shared_intermediate}
        }

    @staticmethod
    def shards(cfg: MoeCfg) -> dict[str, dict[str, Slice]]:
        """Expert parallel: `[e]` places the leading (expert) index; tensor parallel: slices of
        each expert's tensors (the shared expert states its own)."""
        p = cfg.par
        if p.size == 1:
            return {}
        if p.experts:
            mine = Slice(-3, p.rank * cfg.experts, cfg.experts)  # [e]: the expert index
            out = {"gate_up": {"[e]": mine}, "down": {"[e]": mine}}
            if cfg.expert_bias:  # [E, N]: the expert index is the second dim from the end
                mine = Slice(-2, mine.start, mine.length)
                out |= {"gate_up_bias": {"[e]": mine}, "down_bias": {"[e]": mine}}
            return out
        cols = Slice(-2, p.rank * cfg.intermediate, cfg.intermediate)
        return {"gate_up": {"gate": cols, "up": cols}, "down": {"": Slice(-1, cols.start, cols.length)}}

    def forward(self, x: torch.Tensor, rows: tuple[int, ...] | None = None) -> torch.Tensor:
        """x [T, Dm] -> [T, Dm]; rows: as SwiGLU's (this rank's rows of the sum over ranks)."""
        c, ops = self.cfg, self.ops
        logits = ops.linear(x, self.router, self.router_bias).float()  # [T, E] fp32 (x read in fp32)
        w, ids = ops.moe_route(  # w [T, k] fp32, the routed scale folded in
            logits,
            c.top_k,
            c.score,
            self.correction_bias,
            c.groups,
            c.topk_groups,
            c.renormalize,
            c.routed_scale,
        )
        if c.par.experts and c.par.size > 1:  # [T, k] this rank's local expert ids, -1: another rank's
            local = ids - self.first
            ids = torch.where((local >= 0) & (local < c.experts), local, -1)
        extra = (
            act_args(c) if self.gate_up_bias is None else (c.act, c.consts, self.gate_up_bias, self.down_bias)
        )
        u = x if self.latent_down is None else ops.linear(x, self.latent_down)  # [T, L]
        y = ops.moe_experts(u, self.gate_up, self.down, w, ids, c.fp32, c.limit, *extra)
        s = None
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = s * torch.sigmoid(ops.linear(x, self.shared_gate))
        if self.latent_up is None:
            y = y if s is None else y + s
            return ops.tp.reduce(y, rows) if c.par.size > 1 else y
        return self._latent_out(y, s, rows)

    def _latent_out(self, r: torch.Tensor, s: torch.Tensor | None, rows) -> torch.Tensor:
        """r [T, L] the routed sum (this rank's part), s [T, Dm] the shared expert's (this rank's
        part) or None -> W_lu rmsnorm(r) + s, this rank's rows with data-parallel attention."""
        c, ops = self.cfg, self.ops
        if c.par.size > 1:
            r = ops.tp.all_reduce(r)
        if self.latent_norm is not None:
            r = ops.rms_norm(r, self.latent_norm, c.latent_norm_eps)
        y = ops.linear(r, self.latent_up)  # [T, Dm], whole on every rank
        if c.par.size > 1 and rows is not None:  # this rank's rows
            start = sum(rows[: c.par.rank])
            y = y[start : start + rows[c.par.rank]]
        if s is None:
            return y
        return y + (ops.tp.reduce(s, rows) if c.par.size > 1 else s)


def _limit(o, val) -> float | None:
    v = None if o.limit is None else val(o.limit)
    if v is not None and float(v) <= 0:
        raise ValueError(f"limit must be > 0, got {v}")
    return None if v is None else float(v)


def _activation(o, val) -> tuple[str, tuple[float, float]]:
    """(activation, its constants); an activation the blocks do not implement is refused by name."""
    act = val(o.activation)
    if act not in ACTIVATIONS:
        raise ValueError(
            f"activation {act!r} is not implemented by the gated MLPs; known: {', '.join(ACTIVATIONS)}"
        )
    if act == "clamped_swiglu":
        return act, (float(val(o.alpha)), 0.0)
    if act == "situ":
        beta = float(val(o.situ_beta))
        linear = None if o.situ_linear_beta is None else val(o.situ_linear_beta)
        if beta <= 0 or (linear is not None and float(linear) <= 0):
            raise ValueError(f"situ's betas must be > 0 (situ_linear_beta may be null), got {beta}, {linear}")
        return act, (beta, 0.0 if linear is None else float(linear))
    return str(act), DEFAULT_CONSTS


def _resolve_swiglu(o: SwigluOpts, val) -> SwigluCfg:
    act, consts = _activation(o, val)
    h, i = int(val("$hidden")), int(val(o.intermediate))
    return SwigluCfg(h, i, bool(val(o.fp32)), _limit(o, val), act=act, consts=consts)


def _resolve_moe(o: MoeOpts, val) -> MoeCfg:
    act, consts = _activation(o, val)
    c = MoeCfg(
        hidden=int(val("$hidden")),
        experts=int(val(o.experts)),
        top_k=int(val(o.top_k)),
        intermediate=int(val(o.intermediate)),
        score=o.score,
        correction_bias=o.correction_bias,
        groups=int(val(o.groups) or 1),
        topk_groups=int(val(o.topk_groups) or 1),
        renormalize=bool(val(o.renormalize)),
        routed_scale=float(val(o.routed_scale)),
        shared_intermediate=int(val(o.shared_intermediate) or 0),
        shared_gate=o.shared_gate,
        fp32=bool(val(o.fp32)),
        limit=_limit(o, val),
        act=act,
        consts=consts,
        router_bias=bool(val(o.router_bias)),
        expert_bias=bool(val(o.expert_bias)),
        latent=int(val(o.latent) or 0),
        latent_norm=bool(val(o.latent_norm)),
        latent_norm_eps=float(val(o.latent_norm_eps)),
    )
    if c.experts % c.groups or c.topk_groups > c.groups:
        raise ValueError(f"{c.experts} experts do not split into {c.groups} groups with top {c.topk_groups}")
    if c.groups > 1 and c.experts // c.groups < 2:
        raise ValueError("grouped routing scores a group by its top-2 experts; groups need >= 2 experts")
    if not 0 < c.top_k <= c.experts:
        raise ValueError(f"top_k {c.top_k} must be in 1..{c.experts}")
    return c


def _shard_swiglu(c: SwigluCfg, par: Parallel) -> SwigluCfg:
    return dataclasses.replace(c, intermediate=par.even(c.intermediate, "the SwiGLU intermediate"), par=par)


def _shard_moe(c: MoeCfg, par: Parallel) -> MoeCfg:
    shared = par.even(c.shared_intermediate, "the shared expert's intermediate")
    if par.experts:
        experts = par.even(c.experts, "the routed experts")
        return dataclasses.replace(
            c, experts=experts, shared_intermediate=shared, par=par, experts_total=c.experts
        )
    if c.expert_bias:
        raise ValueError("expert biases are not split over intermediates: use expert parallel")
    inter = par.even(c.intermediate, "the expert intermediate")
    return dataclasses.replace(
        c, intermediate=inter, shared_intermediate=shared, par=par, experts_total=c.experts
    )


def _act_features(c) -> frozenset[str]:
    act = {c.act} if c.act != "silu" else set()
    return frozenset(({"fp32"} if c.fp32 else set()) | ({"limit"} if c.limit is not None else set()) | act)


def _swiglu_needs(c: SwigluCfg):
    return [("linear", frozenset(), None), ("swiglu", _act_features(c), None)]


def _skip(c: MoeCfg) -> set[str]:
    """An expert-parallel rank's ids hold -1 (another rank's expert): the op must skip them."""
    return {"skip"} if c.par.experts and c.par.size > 1 else set()


def _moe_needs(c: MoeCfg):
    route = {c.score} | ({"correction_bias"} if c.correction_bias else set())
    route |= ({"grouped"} if c.groups > 1 else set()) | ({"renormalize"} if c.renormalize else set())
    needs = [
        ("linear", frozenset({"bias"}) if c.router_bias else frozenset(), None),
        ("moe_route", frozenset(route), None),
        ("moe_experts", _act_features(c) | ({"bias"} if c.expert_bias else set()) | _skip(c), None),
    ]
    if c.latent and c.latent_norm:
        needs.append(("rms_norm", frozenset(), None))
    shared = SwigluCfg(c.hidden, c.shared_intermediate, c.fp32, c.limit, act=c.act, consts=c.consts)
    return needs + (_swiglu_needs(shared) if c.shared_intermediate else [])


BLOCKS.add(
    "swiglu",
    BlockDef(
        "swiglu",
        "mlp",
        SwigluOpts,
        _resolve_swiglu,
        SwiGLU,
        _swiglu_needs,
        doc=SwiGLU.__doc__,
        shard=_shard_swiglu,
    ),
)
BLOCKS.add(
    "moe", BlockDef("moe", "mlp", MoeOpts, _resolve_moe, MoE, _moe_needs, doc=MoE.__doc__, shard=_shard_moe)
)
