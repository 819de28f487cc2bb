"""Manifold-constrained hyper-connections (mHC) in Triton: the math and rounding of
kernels/reference/hyper.py, where the reference takes about 130 launches a residual (20 Sinkhorn
iterations of sums and divisions over a 4 x 4 matrix) and these take three and one.

  hc_pre   the unweighted RMSNorm of the flattened streams into fp32 (`_hc_norm`, a program a
           token), the projection (the dense GEMV of kernels/triton/linear.py), then a program a
           token for pre / post / comb with Sinkhorn on the [N, N] matrix in registers and
           h = sum_i pre_i X_i (`_hc_weights`)                              -> h [T, D], post, comb
  hc_post  a program a (token, block of D): X'_j = post_j y + sum_i C_ij X_i        -> [T, N, D]

N is padded to a power of two; the padding rows and columns of C hold 0 through every step, so
they add nothing to a sum.

Qwen4-Exp's low-rank hyper-connections (kernels/reference/hyper.py `hc_lowrank_*`), two launches
where the reference takes about a dozen small ones a residual (the mixer's three linears stay
GEMMs / GEMVs between them):

  hc_lowrank_norm  a program a (token, stream): x' = x + inject_j y (rounded as the reference:
                   the product, then the sum), then x' / rms(x') * (1 + w_j)        -> x', Xn
  hc_lowrank_mix   a program a (token, block of D): mean_i sigmoid(u_i) Xn_i, and the inject
                   weights 2 sigmoid(i / N) in the first block's program      -> h [T, D], inject [T, N]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.reference import hyper as ref
from dayzero.kernels.triton.linear import linear


@triton.jit
def _hc_norm(x_ptr, out_ptr, N, D, stride_xt, stride_xn, norm_eps, NP: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    d0 = tl.arange(0, BD)
    xrow = x_ptr + t * stride_xt + i[:, None] * stride_xn
    ss = tl.zeros((NP, BD), tl.float32)
    for d in range(0, D, BD):
        m = (i < N)[:, None] & (d + d0 < D)[None, :]
        v = tl.load(xrow + d + d0[None, :], mask=m, other=0.0).to(tl.float32)
        ss += v * v
    r = 1.0 / tl.sqrt(tl.sum(tl.sum(ss, 1), 0) / (N * D) + norm_eps)
    for d in range(0, D, BD):
        m = (i < N)[:, None] & (d + d0 < D)[None, :]
        v = tl.load(xrow + d + d0[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * N * D + i[:, None] * D + d + d0[None, :], v * r, mask=m)


@triton.jit
def _hc_weights(
    z_ptr, base_ptr, scale_ptr, x_ptr, h_ptr, post_ptr, comb_ptr, N, D, stride_z, stride_xt, stride_xn,
    stride_h, iters, eps, NP: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    i_ok = i < N
    zrow = z_ptr + t * stride_z
    sp, sq, sc = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    zp = tl.load(zrow + i, mask=i_ok, other=0.0)
    zq = tl.load(zrow + N + i, mask=i_ok, other=0.0)
    bp = tl.load(base_ptr + i, mask=i_ok, other=0.0)
    bq = tl.load(base_ptr + N + i, mask=i_ok, other=0.0)
    pre = 1.0 / (1.0 + tl.exp(-(zp * sp + bp))) + eps  # [NP]
    post = 2.0 / (1.0 + tl.exp(-(zq * sq + bq)))
    cm = i_ok[:, None] & i_ok[None, :]
    cij = i[:, None] * N + i[None, :]
    zc = tl.load(zrow + 2 * N + cij, mask=cm, other=0.0)
    bc = tl.load(base_ptr + 2 * N + cij, mask=cm, other=0.0)
    # padding rows stay finite (all 0 before the softmax), padding columns -inf; both 0 after
    logits = tl.where(cm, zc * sc + bc, tl.where(i_ok[:, None], float("-inf"), 0.0))
    e = tl.exp(logits - tl.max(logits, 1)[:, None])
    c = tl.where(cm, e / tl.sum(e, 1)[:, None] + eps, 0.0)  # [NP, NP]
    c = c / (tl.sum(c, 0)[None, :] + eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, 1)[:, None] + eps)
        c = c / (tl.sum(c, 0)[None, :] + eps)
    tl.store(post_ptr + t * N + i, post, mask=i_ok)
    tl.store(comb_ptr + t * N * N + cij, c, mask=cm)
    dt = h_ptr.dtype.element_ty
    d0 = tl.arange(0, BD)
    xrow = x_ptr + t * stride_xt + i[:, None] * stride_xn
    for d in range(0, D, BD):
        m = i_ok[:, None] & (d + d0 < D)[None, :]
        v = tl.load(xrow + d + d0[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(h_ptr + t * stride_h + d + d0, tl.sum(pre[:, None] * v, 0).to(dt), mask=d + d0 < D)


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, n, d = x.shape
    fp32 = all(v.dtype == torch.float32 for v in (fn, base, scale))
    if not fp32 or x.stride(-1) != 1 or iters < 1:
        return ref.hc_pre(x, fn, base, scale, iters, eps, norm_eps)
    h = torch.empty(t, d, dtype=x.dtype, device=x.device)
    post = torch.empty(t, n, dtype=torch.float32, device=x.device)
    comb = torch.empty(t, n, n, dtype=torch.float32, device=x.device)
    if not t:
        return h, post, comb
    np_, bd = triton.next_power_of_2(n), min(1024, triton.next_power_of_2(d))
    flat = torch.empty(t, n * d, dtype=torch.float32, device=x.device)
    _hc_norm[(t,)](x, flat, n, d, x.stride(0), x.stride(1), norm_eps, NP=np_, BD=bd)
    z = linear(flat, fn)  # [T, (2 + N) N] fp32
    _hc_weights[(t,)](
        z, base, scale, x, h, post, comb, n, d, z.stride(0), x.stride(0), x.stride(1), h.stride(0),
        iters, eps, NP=np_, BD=bd,
    )  # fmt: skip
    return h, post, comb


@triton.jit
def _hc_post(
    x_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, N, D, stride_xt, stride_xn, stride_y,
    NP: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = tl.arange(0, NP)
    i_ok = i < N
    d = pid * BD + tl.arange(0, BD)
    d_ok = d < D
    dt = out_ptr.dtype.element_ty
    m = i_ok[:, None] & d_ok[None, :]
    x = tl.load(x_ptr + t * stride_xt + i[:, None] * stride_xn + d[None, :], mask=m, other=0.0).to(tl.float32)
    cm = i_ok[:, None] & i_ok[None, :]
    c = tl.load(comb_ptr + t * N * N + i[:, None] * N + i[None, :], mask=cm, other=0.0)
    c = c.to(dt).to(tl.float32)  # [NP (i), NP (j)]
    mixed = tl.sum(c[:, :, None] * x[:, None, :], 0).to(dt).to(tl.float32)  # [NP (j), BD]
    w = tl.load(post_ptr + t * N + i, mask=i_ok, other=0.0).to(dt).to(tl.float32)
    y = tl.load(y_ptr + t * stride_y + d, mask=d_ok, other=0.0).to(tl.float32)
    spread = (w[:, None] * y[None, :]).to(dt).to(tl.float32)
    out = out_ptr + t * N * D + i[:, None] * D + d[None, :]
    tl.store(out, (spread + mixed).to(dt), mask=m)


def hc_post(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    t, n, d = x.shape
    weights_fp32 = post.dtype == comb.dtype == torch.float32 and y.dtype == x.dtype
    if (
        not weights_fp32
        or x.stride(-1) != 1
        or y.stride(-1) != 1
        or not post.is_contiguous()
        or not comb.is_contiguous()
    ):
        return ref.hc_post(x, y, post, comb)
    out = torch.empty(t, n, d, dtype=x.dtype, device=x.device)
    if t:
        bd = min(256, triton.next_power_of_2(d))
        _hc_post[(t, triton.cdiv(d, bd))](
            x, y, post, comb, out, n, d, x.stride(0), x.stride(1), y.stride(0),
            NP=triton.next_power_of_2(n), BD=bd,
        )  # fmt: skip
    return out


@triton.jit
def _lr_norm(
    x_ptr, w_ptr, y_ptr, inj_ptr, xo_ptr, xn_ptr, N, D, stride_xt, stride_xn, stride_y, eps,
    BD: tl.constexpr, HAS_Y: tl.constexpr, ZC: tl.constexpr, W_FP32: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    t, i = r // N, r % N
    d = tl.arange(0, BD)
    m = d < D
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * stride_xt + i * stride_xn + d, mask=m, other=0.0).to(tl.float32)
    if HAS_Y:  # the previous block's output into this stream
        w = tl.load(inj_ptr + t * N + i).to(dt).to(tl.float32)
        y = tl.load(y_ptr + t * stride_y + d, mask=m, other=0.0).to(tl.float32)
        x = ((w * y).to(dt).to(tl.float32) + x).to(dt).to(tl.float32)
        tl.store(xo_ptr + r * D + d, x.to(dt), mask=m)
    h = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    g = tl.load(w_ptr + i * D + d, mask=m, other=0.0).to(tl.float32)
    if ZC:
        g = g + 1.0
    if W_FP32:
        out = g * h
    else:
        out = g * h.to(dt).to(tl.float32)
        if ROUND:  # the product in x's dtype (else it promoted to fp32)
            out = out.to(dt).to(tl.float32)
    tl.store(xn_ptr + r * D + d, out.to(xn_ptr.dtype.element_ty), mask=m)


def hc_lowrank_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centred: bool,
    weight_in_fp32: bool,
    y: torch.Tensor | None = None,
    inject: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    t, n, d = x.shape
    if x.stride(-1) != 1 or (y is not None and (y.stride(-1) != 1 or not inject.is_contiguous())):
        return ref.hc_lowrank_norm(x, weight, eps, zero_centred, weight_in_fp32, y, inject)
    w_dtype = torch.float32 if zero_centred else weight.dtype
    dtype = x.dtype if weight_in_fp32 else torch.promote_types(w_dtype, x.dtype)
    xn = torch.empty(t, n * d, dtype=dtype, device=x.device)
    xo = x if y is None else torch.empty(t, n, d, dtype=x.dtype, device=x.device)
    if t:
        _lr_norm[(t * n,)](
            x, weight.contiguous(), x if y is None else y, x if y is None else inject, xo, xn, n, d,
            x.stride(0), x.stride(1), 0 if y is None else y.stride(0), eps,
            BD=triton.next_power_of_2(d), HAS_Y=y is not None, ZC=zero_centred, W_FP32=weight_in_fp32,
            ROUND=dtype == x.dtype,
        )  # fmt: skip
    return xo, xn


@triton.jit
def _lr_mix(
    u_ptr, xn_ptr, i_ptr, h_ptr, inj_ptr, N, D, stride_u, stride_xn, stride_i,
    NP: tl.constexpr, BD: tl.constexpr, HAS_I: tl.constexpr,
):  # fmt: skip
    t, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    s = tl.arange(0, NP)
    s_ok = s < N
    d = pid * BD + tl.arange(0, BD)
    m = s_ok[:, None] & (d < D)[None, :]
    at = s[:, None] * D + d[None, :]
    u = tl.load(u_ptr + t * stride_u + at, mask=m, other=0.0).to(tl.float32)
    xn = tl.load(xn_ptr + t * stride_xn + at, mask=m, other=0.0).to(tl.float32)
    dt = h_ptr.dtype.element_ty
    g = (1.0 / (1.0 + tl.exp(-u))).to(u_ptr.dtype.element_ty).to(tl.float32)
    p = tl.where(m, (g * xn).to(dt).to(tl.float32), 0.0)
    tl.store(h_ptr + t * D + d, (tl.sum(p, 0) / N).to(dt), mask=d < D)
    if HAS_I:  # noqa: SIM102 (a constexpr, then a runtime test: Triton keeps them apart)
        if pid == 0:
            it = i_ptr.dtype.element_ty
            v = (tl.load(i_ptr + t * stride_i + s, mask=s_ok, other=0.0).to(tl.float32) / N).to(it)
            w = (1.0 / (1.0 + tl.exp(-v.to(tl.float32)))).to(it).to(tl.float32)
            tl.store(inj_ptr + t * N + s, (2.0 * w).to(it), mask=s_ok)


def hc_lowrank_mix(
    u: torch.Tensor, xn: torch.Tensor, i: torch.Tensor | None, streams: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    t, nd = u.shape
    if u.stride(-1) != 1 or xn.stride(-1) != 1 or (i is not None and i.stride(-1) != 1):
        return ref.hc_lowrank_mix(u, xn, i, streams)
    d = nd // streams
    h = torch.empty(t, d, dtype=torch.promote_types(u.dtype, xn.dtype), device=u.device)
    inj = None if i is None else torch.empty(t, streams, dtype=i.dtype, device=u.device)
    if t:
        bd = min(256, triton.next_power_of_2(d))
        _lr_mix[(t, triton.cdiv(d, bd))](
            u, xn, u if i is None else i, h, h if inj is None else inj, streams, d, u.stride(0),
            xn.stride(0), 0 if i is None else i.stride(0), NP=triton.next_power_of_2(streams), BD=bd,
            HAS_I=i is not None,
        )  # fmt: skip
    return h, inj
