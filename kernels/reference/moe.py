"""Reference mixture-of-experts: routing (sigmoid / softmax, grouped top-k) and stacked gated experts
(SwiGLU, GeGLU, the clamped form; optional biases)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dayzero.kernels.ops import DEFAULT_CONSTS
from dayzero.kernels.reference.basic import swiglu
from dayzero.kernels.registry import register


@register("moe_route", "reference", graphs=True)
def moe_route(
    logits: torch.Tensor,
    top_k: int,
    score: str = "softmax",
    correction_bias: torch.Tensor | None = None,
    groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick top_k experts per token from router logits [T, E] (fp32).

    s = sigmoid(logits) or softmax(logits). Selection uses c = s + correction_bias (the bias
    never enters the weights). With groups > 1 the E experts form `groups` equal groups, a
    group scores the sum of its top-2 c, and only experts of the topk_groups best groups may be
    picked. weights = s at the picked experts, divided by their sum when renormalize, times
    scale (the routed scale: sum_k (scale w_k) y_k = scale sum_k w_k y_k).
    Returns (weights [T, k] fp32, ids [T, k] int64).
    """
    s = logits.float().sigmoid() if score == "sigmoid" else logits.float().softmax(dim=-1)
    choice = s if correction_bias is None else s + correction_bias.float()
    if groups > 1:
        t, e = choice.shape
        group_score = choice.view(t, groups, e // groups).topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(topk_groups, dim=-1).indices, 1.0)
        keep = keep.bool()[:, :, None].expand(t, groups, e // groups).reshape(t, e)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale if scale != 1.0 else w, ids


@register("moe_experts", "reference")
def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fp32: bool = False,
    limit: float | None = None,
    act: str = "silu",
    consts: tuple[float, float] = DEFAULT_CONSTS,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k weights[t, k] * (down_e swiglu(g, u) + b_down_e), [g; u] = gate_up_e x[t]
    + b_gate_up_e, e = ids[t, k] (swiglu as the `swiglu` op, with its optional fp32, limit and
    activation; the biases [E, 2I] / [E, Dm] are optional, added in each linear's output).
    A pair with id -1 is no expert: it adds nothing (its weight is not read).

    x [T, Dm], gate_up [E, 2I, Dm], down [E, Dm, I], weights/ids [T, k] -> [T, Dm].
    """
    return expert_loop(
        x,
        weights,
        ids,
        lambda h, e: F.linear(h, gate_up[e], None if gate_up_bias is None else gate_up_bias[e]),
        lambda h, e: F.linear(h, down[e], None if down_bias is None else down_bias[e]),
        fp32,
        limit,
        act,
        consts,
    )


def expert_loop(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    up: Callable[[torch.Tensor, int], torch.Tensor],
    down: Callable[[torch.Tensor, int], torch.Tensor],
    fp32: bool,
    limit: float | None,
    act: str = "silu",
    consts: tuple[float, float] = DEFAULT_CONSTS,
) -> torch.Tensor:
    """sum_k weights[t, k] * down(swiglu(up(x[t], e)), e), e = ids[t, k], over the pairs with
    e >= 0 (-1: no expert), one picked expert at a time (up / down: expert e's projection,
    however its weight is stored)."""
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        if e < 0:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        g, u = up(x[tok], e).chunk(2, dim=-1)
        y = down(swiglu(g, u, fp32, limit, act, consts), e) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out
