"""Reference ops of manifold-constrained hyper-connections (mHC, GLM-5.3-Flash): the residual is N
streams X [T, N, D]; before each block their mixing weights come from one projection of the
flattened streams, after it the block's output is spread back and the streams mixed.

  z = (flatten(X) / sqrt(mean(flatten(X)^2) + norm_eps)) W^T   (fp32, unweighted RMSNorm) [T, (2 + N) N]
  pre  = sigmoid(a_pre z_pre + b_pre) + eps                            [T, N]
  post = 2 sigmoid(a_post z_post + b_post)                             [T, N]
  C = softmax_rows(a_comb z_comb + b_comb) + eps, then Sinkhorn: C / (column sums + eps), then
      (C / (row sums + eps), C / (column sums + eps)) x (iters - 1)    [T, N, N]
  h = sum_i pre_i X_i  (fp32, rounded to X's dtype)                    [T, D]
  X'_j = post_j y + sum_i C_ij X_i   (C and post_j y rounded to X's dtype, the sum in fp32)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.kernels.reference.basic import rms_norm
from dayzero.kernels.registry import register


@register("hc_pre", "reference", graphs=True)
def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, N, D], fn [(2 + N) N, N D], base [(2 + N) N], scale [3] -> (h [T, D] in x's dtype,
    post [T, N] fp32, comb [T, N, N] fp32)."""
    n = x.shape[1]
    flat = x.flatten(1).float()  # [T, N D]
    z = F.linear(flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps), fn.float())
    zp, zq, zc = z.split([n, n, n * n], dim=-1)
    bp, bq, bc = base.float().split([n, n, n * n])
    sp, sq, sc = scale.float().unbind(0)
    pre = torch.sigmoid(zp * sp + bp) + eps  # [T, N]
    post = 2 * torch.sigmoid(zq * sq + bq)  # [T, N]
    comb = torch.softmax(zc.view(-1, n, n) * sc + bc.view(n, n), dim=-1) + eps  # [T, N, N]
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    h = (pre[..., None] * x).sum(1).to(x.dtype)  # [T, D]
    return h, post, comb


@register("hc_post", "reference", graphs=True)
def hc_post(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """x [T, N, D], y [T, D], post [T, N], comb [T, N, N] -> x' [T, N, D] in x's dtype."""
    mixed = torch.matmul(comb.to(x.dtype).transpose(-1, -2), x)  # [T, N, D]: sum_i C_ij X_i
    return post.to(x.dtype)[..., None] * y[:, None, :] + mixed


@register("hc_lowrank_norm", "reference", graphs=True)
def hc_lowrank_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool,
    weight_in_fp32: bool,
    y: torch.Tensor | None = None,
    inject: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Low-rank hyper-connections (Qwen4-Exp), the previous block's output into the streams and
    their norm: x [T, N, D], weight [N D] (one [D] a stream; 1 + w in fp32 when zero_centred),
    y [T, D] and inject [T, N] (optional) -> (x' = x + inject_j y, Xn = rms_norm_D(x') [T, N D]),
    x' rounded as x's dtype rounds `inject_j y` and then the sum."""
    if y is not None:
        x = inject.to(x.dtype)[..., None] * y[:, None, :] + x
    n, d = x.shape[1:]
    w = weight.float() + 1.0 if zero_centred else weight
    return x, rms_norm(x, w.view(n, d), eps, weight_in_fp32).flatten(1)


@register("hc_lowrank_mix", "reference", graphs=True)
def hc_lowrank_mix(
    u: torch.Tensor, xn: torch.Tensor, i: torch.Tensor | None, streams: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """u [T, N D] (the mixer's W_up output), Xn [T, N D], i [T, N] (W_inj Xn; None: the final
    collapse) -> (h = mean_i sigmoid(u_i) Xn_i [T, D], inject = 2 sigmoid(i / N) [T, N] or None),
    each op rounded to the inputs' dtype as torch rounds it."""
    t, nd = u.shape
    h = (torch.sigmoid(u) * xn).view(t, streams, nd // streams).mean(1)
    return h, None if i is None else 2 * torch.sigmoid(i / streams)
