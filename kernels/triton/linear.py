"""Thin dense linears of decode steps in Triton: a GEMV over the CUDA cores for a handful of rows
and few outputs (routers, gates, low-rank projections), where cuBLAS splits the reduction over a
second launch; everything else runs torch's F.linear (cuBLAS), which reads the wide projections
of a decode step at least as fast (scripts/tune_dense_gemv.py on the H200: [14336, 5120] 48.2 us
against 50.8 for the best GEMV geometry, [64, 5120] fp32 9.4 against 7.7).

    y[m, n] = sum_k x[m, k] W[n, k] (+ b[n])      fp32 sums, rounded to y's dtype (W's)

x is read in W's dtype (ops.linear's contract); a bf16 x against an fp32 W (a router) is widened
inside the GEMV, so the router's cast costs no launch of its own.

A program takes BN output rows and every row of x (at most GEMV_ROWS), so W's tile is read once
for all of them; the grid depends only on the shapes (graph-safe, no host sync).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dayzero.kernels.triton.packed import _sms


@triton.jit
def _gemv(
    x_ptr, w_ptr, b_ptr, y_ptr, N, M, stride_xm, stride_ym, stride_wn,
    K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BIAS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BM)
    m_ok = offs_m < M
    offs_n = pid * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    xbase = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    wbase = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BM, BN, BK), tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < K
        x = tl.load(xbase + offs_k[None, :], mask=m_ok[:, None] & km[None, :], other=0.0).to(tl.float32)
        w = tl.load(wbase + offs_k[None, :], mask=n_ok[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]  # [BM, BN, BK]
    y = tl.sum(acc, 2)  # [BM, BN]
    if BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    dst = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(dst, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


GEMV_ROWS, GEMV_MAX_N = 2, 1024  # up to this many rows of x and outputs a GEMV; more: F.linear
# output rows a program at most, the tile's elements (BN x BK), warps, and the programs an SM
# should get at least (narrower row tiles, wider reduction tiles until it does)
DENSE = {"bn_max": 16, "tile": 2048, "warps": 8, "per_sm": 2}  # scripts/tune_dense_gemv.py


def geometry(n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(BN, BK): the widest row tile that still gives every SM DENSE["per_sm"] programs, and the
    reduction tile that keeps BN x BK at DENSE["tile"] elements (within K)."""
    sms = _sms(device.index or 0) if device.type == "cuda" else 4
    bn = DENSE["bn_max"]
    while bn > 1 and triton.cdiv(n, bn) < DENSE["per_sm"] * sms:
        bn //= 2
    return bn, min(max(DENSE["tile"] // bn, 16), triton.next_power_of_2(k))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int] | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """x [.., K] @ weight[N, K]^T (+ bias) -> [.., N] in weight's dtype, x read in it (widened in
    the GEMV when the weight is fp32, else cast first). `tiles` (BN, BK) and `warps` override the
    geometry (the tuning script)."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    n = weight.shape[0]
    thin = 0 < m <= GEMV_ROWS and n <= GEMV_MAX_N
    widen = x.dtype == weight.dtype or weight.dtype == torch.float32  # exact inside the GEMV
    if not thin or weight.stride(-1) != 1 or not widen:
        return F.linear(x.to(weight.dtype), weight, bias)
    x2 = x.reshape(m, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(m, n, dtype=weight.dtype, device=x.device)
    bn, bk = tiles or geometry(n, k, x.device)
    _gemv[(triton.cdiv(n, bn),)](
        x2, weight, weight if bias is None else bias, y, n, m, x2.stride(0), y.stride(0), weight.stride(0),
        K=k, BM=triton.next_power_of_2(m), BN=bn, BK=bk, BIAS=bias is not None,
        num_warps=warps or DENSE["warps"],
    )  # fmt: skip
    return y.view(*x.shape[:-1], n)
