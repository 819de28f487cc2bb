"""Stacked gated experts (bf16 / fp16 / fp32 weights) in Triton, reading the picked experts'
weights in place.

Decode shapes (few (token, slot) pairs a step): one pair a program and one tile of output rows,
on the CUDA cores, the expert found by id (no sorting, no copy of any expert's weights):
    h[p] = swiglu(W_gate[e_p] x[t_p], W_up[e_p] x[t_p])     (`_gate_up_swiglu`, fused)
    y[p] = W_down[e_p] h[p]                                  (`_down`)
    out[t] = sum_k weights[t, k] y[t * k + slot]             (fp32)
swiglu is the block's activation (silu, gelu tanh, or clamped_swiglu: g sigmoid(alpha g) (u + 1));
optional biases (gate_up [E, 2I], down [E, Dm]) are added to the fp32 sums before the output
rounding. Each projection's output is rounded to x's dtype before the activation, as the
reference's linear outputs are. Many pairs (prefill, large decode batches): the pairs sorted by expert on the
device, then tensor-core tiles of one expert's block of pairs (`_grouped`, gate/up + SwiGLU
fused, then down); in bf16 from GROUPED_MM_PAIRS pairs an expert (prefill), torch's grouped
GEMM over the same sorted pairs. No path syncs with the host or copies an expert's weights.
A pair of id -1 (no expert: another expert-parallel rank's pick) adds nothing: its GEMV programs
exit before reading any weight, the sorted paths leave it out of every expert's block, and the
weighted sum (`combine`) skips it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.batched.moe import moe_experts as grouped_mm_experts
from dayzero.kernels.ops import DEFAULT_CONSTS
from dayzero.kernels.reference.moe import moe_experts as expert_loop
from dayzero.kernels.triton.act import ACT_CODES, _act
from dayzero.kernels.triton.packed import _align, _rows_tile, _sms, combine


@triton.jit
def _gate_up_swiglu(
    x_ptr,
    h_ptr,
    w_ptr,  # [E, 2I, K]: gate rows [0, I), up rows [I, 2I)
    b_ptr,  # [E, 2I] bias (read when BIAS)
    ids_ptr,
    n_inter,
    K: tl.constexpr,
    stride_xm,
    stride_hm,
    stride_we,
    stride_wn,
    stride_be,
    x_row_div,
    limit,
    c0,
    c1,
    LIMIT: tl.constexpr,
    BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if e < 0:  # no expert: no weight read, h[p] unset (its `_down` program skips it too)
        return
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
    g, u = tl.sum(acc_g, 1), tl.sum(acc_u, 1)
    if BIAS:
        g += tl.load(b_ptr + e * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        u += tl.load(b_ptr + e * stride_be + n_inter + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    g, u = g.to(dt).to(tl.float32), u.to(dt).to(tl.float32)
    if LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    act = _act(g, u, c0, c1, ACT)
    tl.store(h_ptr + p.to(tl.int64) * stride_hm + offs_n, act.to(dt), mask=n_ok)


@triton.jit
def _down(
    h_ptr,
    y_ptr,
    w_ptr,  # [E, N, K]
    b_ptr,  # [E, N] bias (read when BIAS)
    ids_ptr,
    N,
    K: tl.constexpr,
    stride_hm,
    stride_ym,
    stride_we,
    stride_wn,
    stride_be,
    BIAS: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    p, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    if e < 0:  # no expert: no weight read, y[p] unset (`combine` skips it)
        return
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
    y = tl.sum(acc, 1)
    if BIAS:
        y += tl.load(b_ptr + e * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    y = y.to(h_ptr.dtype.element_ty).to(tl.float32)  # rounded as a linear's output
    tl.store(y_ptr + p.to(tl.int64) * stride_ym + offs_n, y, mask=n_ok)


@triton.jit
def _grouped(
    x_ptr,
    y_ptr,
    w_ptr,  # [E, N, K], or [E, 2N, K] with SWIGLU (gate rows [0, N), up rows [N, 2N))
    b_ptr,  # [E, N] or [E, 2N] bias (read when BIAS)
    rows_ptr,  # [S] pair ids sorted by expert, each expert's run padded to BM with M
    expert_ptr,  # [S / BM] the expert of each block of BM rows, -1 past the last
    M,
    N,
    K: tl.constexpr,
    stride_xm,
    stride_ym,
    stride_we,
    stride_wn,
    stride_be,
    x_row_div,
    limit,
    c0,
    c1,
    SWIGLU: tl.constexpr,
    LIMIT: tl.constexpr,
    BIAS: tl.constexpr,
    ACT: tl.constexpr,
    IEEE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """Tensor-core tiles over one block of BM pairs of one expert and BN output columns:
    y[p, n] = sum_k W_e[n, k] x[p // x_row_div, k] (with SWIGLU: swiglu(gate, up) of the two
    halves; + the bias when BIAS, in fp32), each output rounded to y's dtype as a linear's is."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(expert_ptr + pid_m)
    if e < 0:
        return
    rows = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM))
    row_ok = rows < M
    xrows = (rows // x_row_div).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    wbase = w_ptr + e.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        km = offs_k < K
        x = tl.load(
            x_ptr + xrows[:, None] * stride_xm + offs_k[None, :],
            mask=row_ok[:, None] & km[None, :],
            other=0.0,
        )
        wm = n_ok[:, None] & km[None, :]
        w = tl.load(wbase + offs_k[None, :], mask=wm, other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        if SWIGLU:
            wu = tl.load(wbase + N * stride_wn + offs_k[None, :], mask=wm, other=0.0)
            if IEEE:
                acc_u += tl.dot(x, tl.trans(wu), input_precision="ieee")
            else:
                acc_u += tl.dot(x, tl.trans(wu))
    dt = y_ptr.dtype.element_ty if SWIGLU else x_ptr.dtype.element_ty
    if BIAS:
        bias = b_ptr + e.to(tl.int64) * stride_be + offs_n
        acc += tl.load(bias, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_u += tl.load(bias + N, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(dt).to(tl.float32)
    if SWIGLU:
        u = acc_u.to(dt).to(tl.float32)
        if LIMIT:
            out = tl.minimum(out, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        out = _act(out, u, c0, c1, ACT)
    dst = y_ptr + rows[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(dst, out.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# the decode GEMVs' geometry: output rows a program at most / at least, the reduction tile, warps,
# and the programs an SM should get at least (smaller row tiles until it does)
GEMV = {"bn_max": 16, "bn_min": 16, "bk": 128, "warps": 8, "per_sm": 2}  # scripts/tune_expert_gemv.py


def _tile(pairs: int, n: int, device: torch.device) -> int:
    """Output rows a program: the widest tile that still gives every SM GEMV["per_sm"] programs."""
    sms = _sms(device.index or 0) if device.type == "cuda" else 4
    bn = GEMV["bn_max"]
    while bn > GEMV["bn_min"] and pairs * triton.cdiv(n, bn) < GEMV["per_sm"] * sms:
        bn //= 2
    return bn


GEMV_PAIRS = 2  # up to this many pairs an expert (on average): one pair a program
# from this many pairs an expert (on average: prefill), bf16 runs torch's grouped GEMM (CUTLASS
# tiles sized for large M; kernels/batched/moe.py) instead of the sorted-pair Triton tiles
GROUPED_MM_PAIRS = 16


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
    """The reference's math (kernels/reference/moe.py): x [T, Dm], gate_up [E, 2I, Dm],
    down [E, Dm, I], weights / ids [T, k], optional biases [E, 2I] / [E, Dm] -> [T, Dm]. The
    activation runs in fp32 (`fp32` asks for no more than that)."""
    t, k = ids.shape
    e, two_i, dm = gate_up.shape
    more = (act, consts, gate_up_bias, down_bias)
    if gate_up.stride(-1) != 1 or down.stride(-1) != 1:  # rows must be contiguous (never so far)
        return expert_loop(x, gate_up, down, weights, ids, fp32, limit, *more)
    if t * k >= GROUPED_MM_PAIRS * e and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return grouped_mm_experts(x, gate_up, down, weights, ids, fp32, limit, *more)
    if t * k > GEMV_PAIRS * e:
        return _grouped_experts(x, gate_up, down, weights, ids, limit, *more)
    x = x.contiguous()
    flat = ids.reshape(-1).contiguous()
    p, i = t * k, two_i // 2
    h = torch.empty(p, i, dtype=x.dtype, device=x.device)
    bn = _tile(p, i, x.device)
    gub = gate_up if gate_up_bias is None else gate_up_bias.contiguous()
    _gate_up_swiglu[(p, triton.cdiv(i, bn))](
        x, h, gate_up, gub, flat, i, dm, x.stride(0), h.stride(0), gate_up.stride(0), gate_up.stride(1),
        gub.stride(0), k, limit or 0.0, *consts, LIMIT=limit is not None, BIAS=gate_up_bias is not None,
        ACT=ACT_CODES[act], BN=bn, BK=GEMV["bk"], num_warps=GEMV["warps"],
    )  # fmt: skip
    y = torch.empty(p, dm, dtype=torch.float32, device=x.device)
    bn = _tile(p, dm, x.device)
    db = down if down_bias is None else down_bias.contiguous()
    _down[(p, triton.cdiv(dm, bn))](
        h, y, down, db, flat, dm, i, h.stride(0), y.stride(0), down.stride(0), down.stride(1), db.stride(0),
        BIAS=down_bias is not None, BN=bn, BK=GEMV["bk"], num_warps=GEMV["warps"],
    )  # fmt: skip
    return combine(y, weights, ids, x.dtype)


def _grouped_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    limit,
    act: str = "silu",
    consts: tuple[float, float] = DEFAULT_CONSTS,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Many pairs: sorted by expert on the device (`_align`, no host sync), tensor-core tiles."""
    t, k = ids.shape
    e, two_i, dm = gate_up.shape
    p, i = t * k, two_i // 2
    x = x.contiguous()
    bm = _rows_tile(p // e + 1)  # rows an expert gets on average
    rows, blocks = _align(ids, e, bm)
    ieee = x.dtype == torch.float32
    h = torch.empty(p, i, dtype=x.dtype, device=x.device)
    gub = gate_up if gate_up_bias is None else gate_up_bias.contiguous()
    _grouped[(blocks.shape[0], triton.cdiv(i, 64))](
        x, h, gate_up, gub, rows, blocks, p, i, dm, x.stride(0), h.stride(0), gate_up.stride(0),
        gate_up.stride(1), gub.stride(0), k, limit or 0.0, *consts, SWIGLU=True, LIMIT=limit is not None,
        BIAS=gate_up_bias is not None, ACT=ACT_CODES[act], IEEE=ieee, BM=bm, BN=64, BK=64, num_warps=4,
    )  # fmt: skip
    y = torch.empty(p, dm, dtype=torch.float32, device=x.device)
    db = down if down_bias is None else down_bias.contiguous()
    _grouped[(blocks.shape[0], triton.cdiv(dm, 64))](
        h, y, down, db, rows, blocks, p, dm, i, h.stride(0), y.stride(0), down.stride(0), down.stride(1),
        db.stride(0), 1, 0.0, 1.0, 0.0, SWIGLU=False, LIMIT=False, BIAS=down_bias is not None, ACT=0,
        IEEE=ieee, BM=bm, BN=64, BK=64, num_warps=4,
    )  # fmt: skip
    return combine(y, weights, ids, x.dtype)
