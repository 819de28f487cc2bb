"""Gated DeltaNet: linear attention with one scalar forget gate per value head and token."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from dayzero.kernels.ops import OUTPUT_GATES
from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.base import BLOCKS, BlockDef, CacheDecl
from dayzero.sdk.blocks.linear_state import (
    check_kernel,
    state_cache,
    state_views,
    static_state_cache,
)
from dayzero.sdk.config.model import ONE_RANK, Parallel, Slice
from dayzero.sdk.config.options import FloatV, IntV, Ref, Strict


class GdnOpts(Strict):
    kind: Literal["gated_deltanet"]
    heads: IntV  # query / key heads H
    value_heads: IntV  # value heads HV, a multiple of H (each key head serves HV / H of them)
    head_dim: IntV  # key head size Dk
    value_dim: IntV  # value head size Dv
    conv_kernel: IntV = 4
    norm_eps: FloatV = 1e-6  # the gated output RMSNorm
    # the output gate's activation (Qwen4-Exp: output_gate_type)
    gate: Literal["silu", "sigmoid"] | Ref = "silu"


@dataclass(frozen=True)
class GdnCfg:
    hidden: int
    heads: int
    value_heads: int
    head_dim: int
    value_dim: int
    conv_kernel: int
    norm_eps: float
    gate: str = "silu"  # act(z): silu or sigmoid
    par: Parallel = ONE_RANK  # tensor parallel: the heads above are this rank's


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet over each request's recurrent state (Qwen3.5's linear attention).

    [q; k; v; z] = x W_in,  [b; a] = x W_ba        q, k [T, H, Dk]; v, z [T, HV, Dv]; b, a [T, HV]
    [q; k; v] <- silu(causal_conv_K([q; k; v]))     (depthwise over the channels, per request)
    beta = sigmoid(b),  g = -exp(A_log) softplus(a + dt_bias)     [T, HV] (fp32; g the log decay)
    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - k_t^T exp(g_t) S_{t-1})^T,  o_t = q_t^T S_t
          (q, k l2-normalised, q / sqrt(Dk); value head j reads key head j // (HV / H);
          S [HV, Dk, Dv] fp32; chunked over a prefill, one step a decode token)
    o <- rmsnorm_Dv(o) w_o * act(z)     (the norm rounded to the model dtype, then x w_o; the
                                         gate's product in fp32; act silu, or sigmoid: gate)
    y = o W_out                                     [T, Dm]
    The state (conv inputs and S) lives in the request's state slot: chunked prefill, prefix
    hits (a snapshot at a block boundary) and retraction all continue the same recurrence.
    Tensor parallel over P ranks: each rank holds H / P key heads and HV / P value heads (their
    rows of W_in, W_ba, the conv, dt_bias, A_log; their columns of W_out) and their state; w_o
    is replicated; y = sum over ranks of o_r W_out,r (all-reduce).
    """

    fp32_params = ("conv", "dt_bias", "A_log")
    linear_weights = ("in_proj", "ba_proj", "out_proj")  # may be packed

    def __init__(self, cfg: GdnCfg, ops: OpTable, caches: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        (_, self.conv_off), (_, self.state_off) = caches
        ck, cv, hv = cfg.heads * cfg.head_dim, cfg.value_heads * cfg.value_dim, cfg.value_heads
        self.in_proj = nn.Parameter(torch.empty(2 * ck + 2 * cv, cfg.hidden))  # [q; k; v; z]
        self.ba_proj = nn.Parameter(torch.empty(2 * hv, cfg.hidden))  # [b; a]
        self.conv = nn.Parameter(torch.empty(2 * ck + cv, 1, cfg.conv_kernel))  # depthwise, [q; k; v]
        self.dt_bias = nn.Parameter(torch.empty(hv))
        self.A_log = nn.Parameter(torch.empty(hv))
        self.norm = nn.Parameter(torch.empty(cfg.value_dim))
        self.out_proj = nn.Parameter(torch.empty(cfg.hidden, cv))

    @staticmethod
    def parts(cfg: GdnCfg) -> dict[str, dict[str, int]]:
        ck, cv = cfg.heads * cfg.head_dim, cfg.value_heads * cfg.value_dim
        return {
            "in_proj": {"q": ck, "k": ck, "v": cv, "z": cv},
            "ba_proj": {"b": cfg.value_heads, "a": cfg.value_heads},
            "conv": {"q": ck, "k": ck, "v": cv},
        }

    @staticmethod
    def shards(cfg: GdnCfg) -> dict[str, dict[str, Slice]]:
        p, h, hv = cfg.par, cfg.heads, cfg.value_heads
        if p.size == 1:
            return {}
        keys = Slice(-2, p.rank * h * cfg.head_dim, h * cfg.head_dim)  # this rank's heads' channels
        vals = Slice(-2, p.rank * hv * cfg.value_dim, hv * cfg.value_dim)
        heads = Slice(-2, p.rank * hv, hv)  # one row per value head

        def conv(s: Slice) -> Slice:  # [C, 1, K]
            return Slice(-3, s.start, s.length)

        return {
            "in_proj": {"q": keys, "k": keys, "v": vals, "z": vals},
            "ba_proj": {"b": heads, "a": heads},
            "conv": {"q": conv(keys), "k": conv(keys), "v": conv(vals)},
            "dt_bias": {"": Slice(-1, heads.start, hv)},
            "A_log": {"": Slice(-1, heads.start, hv)},
            "out_proj": {"": Slice(-1, vals.start, vals.length)},
        }

    def _state(self, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of this layer's conv inputs [slots, 2 H Dk + HV Dv, K - 1] and recurrent state
        [slots, HV, Dk, Dv]."""
        c = self.cfg
        ch, state = (
            2 * c.heads * c.head_dim + c.value_heads * c.value_dim,
            (c.value_heads, c.head_dim, c.value_dim),
        )
        # the model dtype: the output norm's weight is neither packed nor kept in fp32
        return state_views(ctx, self.conv_off, ch, c.conv_kernel, self.state_off, state, self.norm.dtype)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        c, ops, t = self.cfg, self.ops, x.shape[0]
        ck, cv, hv = c.heads * c.head_dim, c.value_heads * c.value_dim, c.value_heads
        conv_state, rec_state = self._state(ctx)
        qkv, z = ops.linear(x, self.in_proj).split([2 * ck + cv, cv], dim=-1)  # [T, 2Ck + Cv], [T, Cv]
        q, k, v = ops.short_conv(qkv, self.conv, conv_state, ctx.state).split([ck, ck, cv], dim=-1)
        b, a = ops.linear(x, self.ba_proj).split([hv, hv], dim=-1)  # [T, HV] each
        g, beta = ops.gdn_gates(b, a, self.A_log, self.dt_bias)  # [T, HV] each, g fp32
        o = ops.gated_delta_rule(
            q.reshape(t, c.heads, c.head_dim),
            k.reshape(t, c.heads, c.head_dim),
            v.reshape(t, hv, c.value_dim),
            g,
            beta,
            rec_state,
            ctx.state,
        )  # [T, HV, Dv]
        # rmsnorm rounded, then x w_o; times act(z) in fp32
        z = z.reshape(t, hv, c.value_dim)
        o = ops.rms_norm_gated(o, self.norm, z, c.norm_eps, c.gate, False, x.dtype)
        y = ops.linear(o.reshape(t, cv), self.out_proj)
        return ops.tp.all_reduce(y) if c.par.size > 1 else y


def _resolve(o: GdnOpts, val) -> GdnCfg:
    cfg = GdnCfg(
        hidden=int(val("$hidden")),
        heads=int(val(o.heads)),
        value_heads=int(val(o.value_heads)),
        head_dim=int(val(o.head_dim)),
        value_dim=int(val(o.value_dim)),
        conv_kernel=check_kernel(int(val(o.conv_kernel))),
        norm_eps=float(val(o.norm_eps)),
        gate=str(val(o.gate)),
    )
    if cfg.gate not in OUTPUT_GATES:
        raise ValueError(
            f"Gated DeltaNet output gate {cfg.gate!r} is not implemented (known: {', '.join(OUTPUT_GATES)})"
        )
    if cfg.heads <= 0 or cfg.value_heads % cfg.heads:
        raise ValueError(f"{cfg.value_heads} value heads are not a multiple of {cfg.heads} key heads")
    return cfg


def _shard(c: GdnCfg, par: Parallel) -> GdnCfg:
    h = par.even(c.heads, "Gated DeltaNet key heads")
    return dataclasses.replace(
        c, heads=h, value_heads=par.even(c.value_heads, "Gated DeltaNet value heads"), par=par
    )


def _needs(c: GdnCfg):
    return [
        ("linear", frozenset(), None),
        ("short_conv", frozenset({"silu"}), None),
        ("gdn_gates", frozenset(), None),
        ("gated_delta_rule", frozenset({"chunked"}), None),
        ("rms_norm_gated", frozenset(), None),
    ]


def _cache(c: GdnCfg) -> tuple[CacheDecl, ...]:
    ch = 2 * c.heads * c.head_dim + c.value_heads * c.value_dim
    return state_cache(ch, c.conv_kernel, c.value_heads * c.head_dim * c.value_dim)


BLOCKS.add(
    "gated_deltanet",
    BlockDef(
        "gated_deltanet",
        "attention",
        GdnOpts,
        _resolve,
        GatedDeltaNet,
        _needs,
        _cache,
        static_state_cache,
        GatedDeltaNet.__doc__ or "",
        _shard,
    ),
)
