"""Stacked SwiGLU experts (bf16 / fp16 / fp32 weights) in Triton, reading the picked experts'
weights in place.

Decode shapes (few (token, slot) pairs a step): one pair a program and one tile of output rows,
on the CUDA cores, the expert found by id (no sorting, no copy of any expert's weights):
    h[p] = swiglu(W_gate[e_p] x[t_p], W_up[e_p] x[t_p])     (`_gate_up_swiglu`, fused)
    y[p] = W_down[e_p] h[p]                                  (`_down`)
    out[t] = sum_k weights[t, k] y[t * k + slot]             (fp32)
Each projection's output is rounded to x's dtype before the activation, as the reference's
linear outputs are. Many pairs (prefill) take the batched backend's grouped GEMMs (bf16), which
also read the experts in place, or the reference loop over experts.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dayzero.kernels.batched.moe import moe_experts as grouped_experts
from dayzero.kernels.reference.moe import moe_experts as expert_loop


@triton.jit
def _gate_up_swiglu(
    x_ptr,
    h_ptr,
    w_ptr,  # [E, 2I, K]: gate rows [0, I), up rows [I, 2I)
    ids_ptr,
    n_inter,
    K: tl.constexpr,
    stride_xm,
    stride_hm,
    stride_we,
    stride_wn,
    x_row_div,
    limit,
    LIMIT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    xrow = x_ptr + (p // x_row_div).to(tl.int64) * stride_xm
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < n_inter
    gbase = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    ubase = gbase + n_inter * stride_wn
    acc_g = tl.zeros((BN, BK), tl.float32)
    acc_u = tl.zeros((BN, BK), tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < K
        x = tl.load(xrow + offs_k, mask=km, other=0.0).to(tl.float32)
        wm = n_ok[:, None] & km[None, :]
        acc_g += tl.load(gbase + offs_k[None, :], mask=wm, other=0.0).to(tl.float32) * x[None, :]
        acc_u += tl.load(ubase + offs_k[None, :], mask=wm, other=0.0).to(tl.float32) * x[None, :]
    dt = h_ptr.dtype.element_ty
    g = tl.sum(acc_g, 1).to(dt).to(tl.float32)
    u = tl.sum(acc_u, 1).to(dt).to(tl.float32)
    if LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(h_ptr + p.to(tl.int64) * stride_hm + offs_n, act.to(dt), mask=n_ok)


@triton.jit
def _down(
    h_ptr,
    y_ptr,
    w_ptr,  # [E, N, K]
    ids_ptr,
    N,
    K: tl.constexpr,
    stride_hm,
    stride_ym,
    stride_we,
    stride_wn,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    hrow = h_ptr + p.to(tl.int64) * stride_hm
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    wbase = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BN, BK), tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < K
        h = tl.load(hrow + offs_k, mask=km, other=0.0).to(tl.float32)
        acc += (
            tl.load(wbase + offs_k[None, :], mask=n_ok[:, None] & km[None, :], other=0.0).to(tl.float32)
            * h[None, :]
        )
    y = tl.sum(acc, 1).to(h_ptr.dtype.element_ty).to(tl.float32)  # rounded as a linear's output
    tl.store(y_ptr + p.to(tl.int64) * stride_ym + offs_n, y, mask=n_ok)


@functools.cache
def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tile(pairs: int, n: int, device: torch.device) -> int:
    """Output rows a program: the widest tile that still gives two programs an SM."""
    sms = _sms(device.index or 0) if device.type == "cuda" else 4
    bn = 64
    while bn > 16 and pairs * triton.cdiv(n, bn) < 2 * sms:
        bn //= 2
    return bn


GEMV_PAIRS = 2  # up to this many pairs an expert (on average): one pair a program


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fp32: bool = False,
    limit: float | None = None,
) -> torch.Tensor:
    """The reference's math (kernels/reference/moe.py): x [T, Dm], gate_up [E, 2I, Dm],
    down [E, Dm, I], weights / ids [T, k] -> [T, Dm]. The activation runs in fp32 (`fp32` asks
    for no more than that)."""
    t, k = ids.shape
    e, two_i, dm = gate_up.shape
    if t * k > GEMV_PAIRS * e or gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        grouped = x.dtype == torch.bfloat16 and x.is_cuda and hasattr(torch, "_grouped_mm")
        return (grouped_experts if grouped else expert_loop)(x, gate_up, down, weights, ids, fp32, limit)
    x = x.contiguous()
    flat = ids.reshape(-1).contiguous()
    p, i = t * k, two_i // 2
    h = torch.empty(p, i, dtype=x.dtype, device=x.device)
    bn = _tile(p, i, x.device)
    _gate_up_swiglu[(p, triton.cdiv(i, bn))](
        x, h, gate_up, flat, i, dm, x.stride(0), h.stride(0), gate_up.stride(0), gate_up.stride(1), k,
        limit or 0.0, LIMIT=limit is not None, BN=bn, BK=128, num_warps=4,
    )  # fmt: skip
    y = torch.empty(p, dm, dtype=torch.float32, device=x.device)
    bn = _tile(p, dm, x.device)
    _down[(p, triton.cdiv(dm, bn))](
        h, y, down, flat, dm, i, h.stride(0), y.stride(0), down.stride(0), down.stride(1),
        BN=bn, BK=128, num_warps=4,
    )  # fmt: skip
    return (y * weights.reshape(-1, 1).float()).view(t, k, dm).sum(1).to(x.dtype)
