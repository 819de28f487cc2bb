"""Weight-only GEMMs on packed weights in Triton (CUDA): 4-bit (nvfp4, mxfp4) or fp8-block
weights, bf16/fp16 activations, fp32 accumulation. For GPUs without FP4 math (Hopper): each
weight tile is decoded in registers right after it is loaded, so a step reads the packed bytes
only. The math is kernels/packed.py's: W[n, k] = value(codes[n, k]) * (scale[n, k // G] * global[n]),
rounded to the activation dtype before the product, as the reference backend does.

One kernel serves dense linears and stacked experts. Experts: the (token, slot) pairs are sorted
by expert and padded to whole row blocks (`_align`, on the device, no host sync); each program
takes one block of one expert and one tile of output columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.packed import PackedWeight
from dayzero.kernels.reference.basic import swiglu

FMT = {"nvfp4": 0, "mxfp4": 1, "fp8_block": 2}


@triton.jit
def _e2m1(c):
    """4-bit code -> value: bit 3 the sign, exponent bits 1-2, mantissa bit 0 (no bias for e=0)."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where(((c >> 3) & 1) == 1, -mag, mag)


@triton.jit
def _packed_gemm(
    x_ptr,
    y_ptr,
    codes_ptr,
    scale_ptr,
    glob_ptr,
    rows_ptr,
    expert_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_ce,
    stride_cn,
    stride_se,
    stride_sn,
    stride_ge,
    x_row_div,
    FMT: tl.constexpr,
    INDIRECT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """y[rows, n-tile] = x[rows // x_row_div] @ W_e^T; e = expert_ptr[block] when INDIRECT."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if INDIRECT:
        e = tl.load(expert_ptr + pid_m)
        if e < 0:
            return
        rows = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM))  # pair ids; M marks padding
    else:
        e = 0
        rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    xrows = (rows // x_row_div).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    wbase = codes_ptr + e.to(tl.int64) * stride_ce + offs_n[:, None].to(tl.int64) * stride_cn
    sbase = scale_ptr + e.to(tl.int64) * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if FMT == 2:  # fp8 codes [N, K], fp32 scale per 128 columns
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < K
            x = tl.load(
                x_ptr + xrows[:, None] * stride_xm + offs_k[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            wm = n_ok[:, None] & k_ok[None, :]
            w = tl.load(wbase + offs_k[None, :], mask=wm, other=0.0).to(tl.float32)
            s = tl.load(sbase + offs_k[None, :] // 128, mask=wm, other=0.0)
            acc += tl.dot(x, tl.trans((w * s).to(x.dtype)))
    else:  # two 4-bit codes a byte [N, K/2], the low nibble the even column
        G: tl.constexpr = 16 if FMT == 0 else 32
        if FMT == 0:
            glob = tl.load(glob_ptr + e.to(tl.int64) * stride_ge + offs_n, mask=n_ok, other=0.0)
        for k0 in range(0, K // 2, BK // 2):
            offs_b = k0 + tl.arange(0, BK // 2)
            b_ok = offs_b < K // 2
            wm = n_ok[:, None] & b_ok[None, :]
            c = tl.load(wbase + offs_b[None, :], mask=wm, other=0)
            s = tl.load(sbase + (offs_b[None, :] * 2) // G, mask=wm, other=0)
            if FMT == 0:  # noqa: SIM108  (a compile-time branch in Triton)
                s = s.to(tl.float32) * glob[:, None]
            else:
                s = tl.exp2(s.to(tl.float32) - 127.0)
            xm = row_ok[:, None] & b_ok[None, :]
            xe = tl.load(x_ptr + xrows[:, None] * stride_xm + 2 * offs_b[None, :], mask=xm, other=0.0)
            xo = tl.load(x_ptr + xrows[:, None] * stride_xm + 2 * offs_b[None, :] + 1, mask=xm, other=0.0)
            acc += tl.dot(xe, tl.trans((_e2m1(c & 15) * s).to(xe.dtype)))
            acc += tl.dot(xo, tl.trans((_e2m1(c >> 4) * s).to(xo.dtype)))
    out = y_ptr + rows[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _tiles(m_blocks: int, n: int) -> int:
    """Output columns per program: enough programs to fill the GPU at decode's few rows."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    for bn in (128, 64, 32):
        if m_blocks * triton.cdiv(n, bn) >= 2 * sms:
            return bn
    return 16


def _launch(x, y, w: PackedWeight, rows=None, experts=None, m=None, x_row_div=1, bm=16) -> None:
    *_, n, k = w.shape
    m = x.shape[0] if m is None else m
    m_blocks = experts.shape[0] if experts is not None else triton.cdiv(m, bm)
    bn = _tiles(m_blocks, n)
    glob = getattr(w, "global", None)
    stacked = len(w.shape) == 3
    _packed_gemm[(m_blocks, triton.cdiv(n, bn))](
        x,
        y,
        w.codes,
        w.scale,
        glob if glob is not None else w.scale,
        rows if rows is not None else x,
        experts if experts is not None else x,
        m,
        n,
        k,
        x.stride(0),
        y.stride(0),
        w.codes.stride(0) if stacked else 0,
        w.codes.stride(-2),
        w.scale.stride(0) if stacked else 0,
        w.scale.stride(-2),
        glob.stride(0) if glob is not None and stacked else 0,
        x_row_div,
        FMT=FMT[w.format.name],
        INDIRECT=experts is not None,
        BM=bm,
        BN=bn,
        BK=256 if w.format.name != "fp8_block" else 128,
        num_warps=4,
    )


def linear_packed(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., K] @ dequant(w)^T (+ b) -> [.., N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty(x2.shape[0], w.shape[-2], dtype=x.dtype, device=x.device)
    _launch(x2, y, w, bm=16 if x2.shape[0] <= 16 else 64)
    y = y.view(*lead, -1)
    return y if bias is None else y + bias


def _align(ids: torch.Tensor, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [S], block experts [B]): the pairs of flat ids [P] sorted by expert, each expert's
    run padded to a multiple of bm with P (a row no program writes); block b of bm rows belongs
    to expert block_experts[b], -1 past the last run. S, B are bounds from the shapes alone."""
    p = ids.numel()
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + bm - 1) // bm * bm
    ends = padded.cumsum(0)
    sorted_e = flat[order]
    rank = torch.arange(p, device=ids.device) - (counts.cumsum(0) - counts)[sorted_e]
    slots = p + min(experts, p) * (bm - 1)
    rows = torch.full((triton.cdiv(slots, bm) * bm,), p, dtype=torch.int64, device=ids.device)
    rows[(ends - padded)[sorted_e] + rank] = order
    starts = torch.arange(rows.numel() // bm, device=ids.device) * bm
    block_experts = torch.searchsorted(ends, starts, right=True)
    return rows, torch.where(starts < ends[-1], block_experts, -1).to(torch.int32)


def moe_experts_packed(
    x: torch.Tensor,
    gate_up: PackedWeight,
    down: PackedWeight,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fp32: bool = False,
    limit: float | None = None,
) -> torch.Tensor:
    """moe_experts (kernels/reference/moe.py) on packed experts; the k outputs of a token are
    weighted and summed in fp32."""
    t, k = ids.shape
    bm = 16 if t * k <= 256 else 64
    rows, blocks = _align(ids, gate_up.shape[0], bm)
    h = torch.empty(t * k, gate_up.shape[-2], dtype=x.dtype, device=x.device)  # [P, 2I]
    _launch(x.contiguous(), h, gate_up, rows, blocks, m=t * k, x_row_div=k, bm=bm)
    g, u = h.chunk(2, dim=-1)
    act = swiglu(g, u, fp32, limit).contiguous()  # [P, I]
    y = torch.empty(t * k, down.shape[-2], dtype=x.dtype, device=x.device)  # [P, Dm]
    _launch(act, y, down, rows, blocks, m=t * k, bm=bm)
    return (y.float() * weights.reshape(-1, 1).float()).view(t, k, -1).sum(1).to(x.dtype)
