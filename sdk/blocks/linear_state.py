"""What the linear-attention blocks (KDA, Gated DeltaNet) share: their state in the request's
state slot (the short conv's last K - 1 inputs in the model dtype, the fp32 recurrent state
S [H, Dk, Dv]), its cache parts, and the Mamba-style log decay -exp(A_log) softplus(f)."""

from __future__ import annotations

import math

import torch

from dayzero.sdk.blocks.base import CacheDecl, StaticCache


def state_views(
    ctx, conv_off: int, conv_ch: int, kernel: int, state_off: int, state: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's conv inputs [slots, C, K - 1] (in `dtype`, the model's) and
    recurrent state [slots, *state] fp32, at byte offsets conv_off / state_off of each slot."""
    pool = ctx.state.pool
    n_conv = conv_ch * (kernel - 1) * dtype.itemsize
    conv = pool[:, conv_off : conv_off + n_conv].view(dtype).view(-1, conv_ch, kernel - 1)
    n_s = math.prod(state) * 4
    rec = pool[:, state_off : state_off + n_s].view(torch.float32)
    return conv, rec.view(-1, *state)


def state_cache(conv_ch: int, kernel: int, state_elems: int) -> tuple[CacheDecl, CacheDecl]:
    """The two state parts: conv inputs sized for the widest dtype (fp32), the fp32 state."""
    return (
        CacheDecl("conv", "state", conv_ch * (kernel - 1) * 4),
        CacheDecl("recurrent", "state", state_elems * 4),
    )


def static_state_cache(_o) -> tuple[StaticCache, ...]:
    return StaticCache("conv", "state", "", "state"), StaticCache("recurrent", "state", "", "state")


def check_kernel(kernel: int) -> int:
    if kernel < 2:
        raise ValueError(f"conv_kernel must be >= 2, got {kernel}")
    return kernel
