"""MoE routing in Triton: one program a token does the reference's whole selection
(kernels/reference/moe.py) in registers, where the reference takes about fifteen launches.

  s = sigmoid(z) or softmax(z) over the E experts        z: router logits [T, E] fp32
  c = s + b_corr                                         (selection only)
  groups: group score = sum of the group's top-2 c; experts outside the topk_groups best groups
          are out; then the top_k c, largest first (ties: the lower expert id)
  w = s[picked] (/ their sum + 1e-20), times scale       -> (w [T, k] fp32, ids [T, k] int64)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route(
    z_ptr, b_ptr, w_ptr, ids_ptr, E, stride_z, scale,
    K: tl.constexpr, BK: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, TOPG: tl.constexpr,
    BE: tl.constexpr, SIGMOID: tl.constexpr, BIAS: tl.constexpr, RENORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    m = e < E
    z = tl.load(z_ptr + t * stride_z + e, mask=m, other=float("-inf"))
    if SIGMOID:
        s = tl.where(m, 1.0 / (1.0 + tl.exp(-z)), 0.0)
    else:
        ez = tl.where(m, tl.exp(z - tl.max(z, 0)), 0.0)
        s = ez / tl.sum(ez, 0)
    c = s
    if BIAS:
        c = s + tl.load(b_ptr + e, mask=m, other=0.0).to(tl.float32)
    c = tl.where(m, c, float("-inf"))
    if G > 1:
        group = e // (E // G)
        gi = tl.arange(0, BG)
        gs = tl.full((BG,), float("-inf"), tl.float32)
        for g in tl.static_range(G):
            cg = tl.where(group == g, c, float("-inf"))
            top = tl.argmax(cg, 0, tie_break_left=True)
            second = tl.max(tl.where(e == top, float("-inf"), cg), 0)
            gs = tl.where(gi == g, tl.max(cg, 0) + second, gs)
        keep = e < 0
        for _ in tl.static_range(TOPG):
            best = tl.argmax(gs, 0, tie_break_left=True)
            keep = keep | (group == best)
            gs = tl.where(gi == best, float("-inf"), gs)
        c = tl.where(keep, c, float("-inf"))
    kk = tl.arange(0, BK)
    wv = tl.zeros((BK,), tl.float32)
    iv = tl.zeros((BK,), tl.int64)
    for j in tl.static_range(K):
        pick = tl.argmax(c, 0, tie_break_left=True)
        wv = tl.where(kk == j, tl.sum(tl.where(e == pick, s, 0.0), 0), wv)
        iv = tl.where(kk == j, pick.to(tl.int64), iv)
        c = tl.where(e == pick, float("-inf"), c)
    if RENORM:
        wv = wv / (tl.sum(wv, 0) + 1e-20)
    tl.store(w_ptr + t * K + kk, wv * scale, mask=kk < K)
    tl.store(ids_ptr + t * K + kk, iv, mask=kk < K)


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
    t, e = logits.shape
    z = logits.float()
    if z.stride(-1) != 1:
        z = z.contiguous()
    w = torch.empty(t, top_k, dtype=torch.float32, device=z.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=z.device)
    if t:
        _route[(t,)](
            z, z if correction_bias is None else correction_bias, w, ids, e, z.stride(0), scale,
            K=top_k, BK=triton.next_power_of_2(top_k), G=groups, BG=triton.next_power_of_2(groups),
            TOPG=topk_groups, BE=triton.next_power_of_2(e), SIGMOID=score == "sigmoid",
            BIAS=correction_bias is not None, RENORM=renormalize, num_warps=4 if e > 256 else 1,
        )  # fmt: skip
    return w, ids
