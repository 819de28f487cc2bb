"""Kimi delta attention (KDA): linear attention with a per-channel forget gate and a fixed-size state."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.base import BLOCKS, BlockDef, CacheDecl
from dayzero.sdk.blocks.linear_state import (
    check_kernel,
    state_cache,
    state_views,
    static_state_cache,
)
from dayzero.sdk.config.model import ONE_RANK, Parallel, Slice
from dayzero.sdk.config.options import FloatV, IntV, Strict


class KdaOpts(Strict):
    kind: Literal["kda"]
    heads: IntV
    head_dim: IntV
    conv_kernel: IntV = 4
    gate_lower_bound: FloatV | None = None  # the "safe gate": g = lb * sigmoid(exp(A) (f + dt))
    norm_eps: FloatV = 1e-6  # the gated output RMS norm
    # the output gate's projection: low_rank (x W_ga) W_gb (kimi_linear) or full_rank x W_g (Kimi K3)
    output_gate: Literal["low_rank", "full_rank"] = "low_rank"


@dataclass(frozen=True)
class KdaCfg:
    hidden: int
    heads: int
    head_dim: int
    conv_kernel: int
    gate_lower_bound: float | None
    norm_eps: float
    full_rank_gate: bool = False
    par: Parallel = ONE_RANK  # tensor parallel: `heads` above are this rank's


class KdaAttention(nn.Module):
    """Kimi delta attention over each request's recurrent state.

    [q; k; v] = silu(causal_conv_K(x [W_q; W_k; W_v]))               [T, H, D] each
    f = (x W_fa) W_fb + dt_bias                                       [T, H, D] fp32
    g = lb * sigmoid(exp(A_log)_h f)  or  -exp(A_log)_h softplus(f)   (log forget gate)
    beta = sigmoid(x W_b)                                             [T, H]
    S_t = diag(exp(g_t)) S_{t-1} + k_t beta_t (v_t - k_t^T diag(exp(g_t)) S_{t-1})^T, o_t = q_t^T S_t
          (q, k l2-normalised, q / sqrt(D); S [H, D, D] fp32)
    o <- rmsnorm_D(o) w_o * sigmoid(gate)   (fp32);   y = o W_o
    gate = (x W_ga) W_gb (low rank, W_ga [D, Dm]) or x W_g (full rank, W_g [H D, Dm])
    The state (conv inputs and S) lives in the request's state slot: chunked prefill, prefix
    hits (a snapshot at a block boundary) and retraction all continue the same recurrence.
    Tensor parallel over P ranks: each rank holds H / P heads (their rows of W_q, W_k, W_v, the
    conv, W_fb, W_gb or W_g, W_b, dt_bias, A_log; their columns of W_o) and their state; the
    low-rank W_fa, W_ga and the output norm are replicated; y = sum over ranks of o_r W_o,r (all-reduce).
    """

    fp32_params = ("conv", "dt_bias", "A_log")
    linear_weights = ("in_proj", "f_a", "f_b", "b_proj", "g_a", "g_b", "g_proj", "o_proj")  # may be packed

    def __init__(self, cfg: KdaCfg, ops: OpTable, caches: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        (_, self.conv_off), (_, self.state_off) = caches
        h, d, dm = cfg.heads, cfg.head_dim, cfg.hidden
        c = h * d
        self.in_proj = nn.Parameter(torch.empty(3 * c, dm))  # [q; k; v]
        self.conv = nn.Parameter(torch.empty(3 * c, 1, cfg.conv_kernel))  # depthwise
        self.f_a = nn.Parameter(torch.empty(d, dm))
        self.f_b = nn.Parameter(torch.empty(c, d))
        self.dt_bias = nn.Parameter(torch.empty(c))
        self.A_log = nn.Parameter(torch.empty(h))
        self.b_proj = nn.Parameter(torch.empty(h, dm))
        if cfg.full_rank_gate:
            self.g_proj = nn.Parameter(torch.empty(c, dm))
        else:
            self.g_a = nn.Parameter(torch.empty(d, dm))
            self.g_b = nn.Parameter(torch.empty(c, d))
        self.o_norm = nn.Parameter(torch.empty(d))
        self.o_proj = nn.Parameter(torch.empty(dm, c))

    @staticmethod
    def parts(cfg: KdaCfg) -> dict[str, dict[str, int]]:
        c = cfg.heads * cfg.head_dim
        return {"in_proj": {"q": c, "k": c, "v": c}, "conv": {"q": c, "k": c, "v": c}}

    @staticmethod
    def shards(cfg: KdaCfg) -> dict[str, dict[str, Slice]]:
        p, h, d = cfg.par, cfg.heads, cfg.head_dim
        if p.size == 1:
            return {}
        rows = Slice(-2, p.rank * h * d, h * d)  # this rank's heads' channels
        conv = Slice(-3, rows.start, rows.length)  # [C, 1, K] per part
        return {
            "in_proj": {"q": rows, "k": rows, "v": rows},
            "conv": {"q": conv, "k": conv, "v": conv},
            "f_b": {"": rows},
            ("g_proj" if cfg.full_rank_gate else "g_b"): {"": rows},
            "dt_bias": {"": Slice(-1, rows.start, rows.length)},
            "A_log": {"": Slice(-1, p.rank * h, h)},
            "b_proj": {"": Slice(-2, p.rank * h, h)},
            "o_proj": {"": Slice(-1, rows.start, rows.length)},
        }

    def _state(self, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of this layer's conv inputs [slots, 3C, K - 1] and recurrent state [slots, H, D, D]."""
        c = self.cfg
        ch, state = 3 * c.heads * c.head_dim, (c.heads, c.head_dim, c.head_dim)
        # the model dtype: o_norm is neither packed nor kept in fp32
        return state_views(ctx, self.conv_off, ch, c.conv_kernel, self.state_off, state, self.o_norm.dtype)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        c, ops, t = self.cfg, self.ops, x.shape[0]
        h, d = c.heads, c.head_dim
        conv_state, rec_state = self._state(ctx)
        qkv = ops.short_conv(ops.linear(x, self.in_proj), self.conv, conv_state, ctx.state)  # [T, 3C]
        q, k, v = (z.reshape(t, h, d) for z in qkv.chunk(3, dim=-1))
        f = ops.linear(ops.linear(x, self.f_a), self.f_b)  # [T, H D]
        # g [T, H, D] fp32, beta [T, H]
        g, beta = ops.kda_gates(f, ops.linear(x, self.b_proj), self.A_log, self.dt_bias, c.gate_lower_bound)
        o = ops.kda_recurrence(q, k, v, g, beta, rec_state, ctx.state)  # [T, H, D]
        if c.full_rank_gate:
            gate = ops.linear(x, self.g_proj).view(t, h, d)
        else:
            gate = ops.linear(ops.linear(x, self.g_a), self.g_b).view(t, h, d)
        # the norm and the gate's product in fp32 (w read in fp32: w * h promotes to it)
        o = ops.rms_norm_gated(o.float(), self.o_norm, gate, c.norm_eps, "sigmoid", True, x.dtype)
        y = ops.linear(o.reshape(t, -1), self.o_proj)
        return ops.tp.all_reduce(y) if c.par.size > 1 else y


def _resolve(o: KdaOpts, val) -> KdaCfg:
    lb = None if o.gate_lower_bound is None else val(o.gate_lower_bound)
    cfg = KdaCfg(
        hidden=int(val("$hidden")),
        heads=int(val(o.heads)),
        head_dim=int(val(o.head_dim)),
        conv_kernel=check_kernel(int(val(o.conv_kernel))),
        gate_lower_bound=None if lb is None else float(lb),
        norm_eps=float(val(o.norm_eps)),
        full_rank_gate=o.output_gate == "full_rank",
    )
    return cfg


def _shard(c: KdaCfg, par: Parallel) -> KdaCfg:
    return dataclasses.replace(c, heads=par.even(c.heads, "KDA heads"), par=par)


def _needs(c: KdaCfg):
    return [
        ("linear", frozenset(), None),
        ("short_conv", frozenset({"silu"}), None),
        ("kda_gates", frozenset(), None),
        ("kda_recurrence", frozenset({"chunked"}), None),
        ("rms_norm_gated", frozenset(), None),
    ]


def _cache(c: KdaCfg) -> tuple[CacheDecl, ...]:
    return state_cache(3 * c.heads * c.head_dim, c.conv_kernel, c.heads * c.head_dim * c.head_dim)


BLOCKS.add(
    "kda",
    BlockDef(
        "kda",
        "attention",
        KdaOpts,
        _resolve,
        KdaAttention,
        _needs,
        _cache,
        static_state_cache,
        KdaAttention.__doc__,
        _shard,
    ),
)
