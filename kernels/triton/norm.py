"""RMSNorm and RoPE in Triton: one launch each where the reference takes six to fifteen small ones
(a decode step calls them about a hundred times). The math is the reference's
(kernels/reference/basic.py), in fp32:

  rms_norm   y = x / sqrt(mean(x^2) + eps) * w; weight_in_fp32: w * h rounded once (Gemma/Beam
             order), else h rounded to x's dtype, then times w (Llama order)
  rope       angle[t, j] = positions[t] * inv_freq[j]; neox pairs channel j with j + R/2, else 2j
             with 2j + 1; (a, b) -> (a cos - b sin, b cos + a sin); channels past R pass through

A row is one vector of the last dim: x [.., D] with any strides over its (at most two) leading
dims, so q / k views of a fused projection are read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm(
    x_ptr, w_ptr, y_ptr, H, stride_t, stride_h, D, eps, BD: tl.constexpr, W_FP32: tl.constexpr
):  # fmt: skip
    r = tl.program_id(0)
    t, h = r // H, r % H
    d = tl.arange(0, BD)
    m = d < D
    x = tl.load(x_ptr + t.to(tl.int64) * stride_t + h * stride_h + d, mask=m, other=0.0).to(tl.float32)
    hx = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    y = w * hx if W_FP32 else w * hx.to(dt).to(tl.float32)
    tl.store(y_ptr + r.to(tl.int64) * D + d, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rope(
    x_ptr, pos_ptr, f_ptr, y_ptr, H, stride_t, stride_h, D,
    HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, NEOX: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    t, h = r // H, r % H
    base = x_ptr + t.to(tl.int64) * stride_t + h * stride_h
    out = y_ptr + r.to(tl.int64) * D
    j = tl.arange(0, BH)
    jm = j < HALF
    ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(f_ptr + j, mask=jm, other=0.0).to(tl.float32)
    c, s = tl.cos(ang), tl.sin(ang)
    i1 = j if NEOX else 2 * j
    i2 = j + HALF if NEOX else 2 * j + 1
    a = tl.load(base + i1, mask=jm, other=0.0).to(tl.float32)
    b = tl.load(base + i2, mask=jm, other=0.0).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    tl.store(out + i1, (a * c - b * s).to(dt), mask=jm)
    tl.store(out + i2, (b * c + a * s).to(dt), mask=jm)
    d = tl.arange(0, BD)
    rest = (d >= 2 * HALF) & (d < D)
    tl.store(out + d, tl.load(base + d, mask=rest, other=0.0), mask=rest)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, H, stride over t, stride over h) of x [T, D] or [T, H, D] (last dim contiguous)."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False) -> torch.Tensor:
    if x.dim() > 3 or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    # the reference's result dtype: x's when the product is rounded once, else w * (h in x's dtype)
    dtype = x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    rows, h, st, sh = _rows(x)
    if rows:
        d = x.shape[-1]
        _rms_norm[(rows,)](
            x, weight, y, h, st, sh, d, eps, BD=triton.next_power_of_2(d), W_FP32=weight_in_fp32
        )
    return y


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, neox: bool = True) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, h, st, sh = _rows(x)
    half = inv_freq.shape[0]
    if rows:
        _rope[(rows,)](
            x, positions, inv_freq, y, h, st, sh, x.shape[-1],
            HALF=half, BH=triton.next_power_of_2(half), BD=triton.next_power_of_2(x.shape[-1]), NEOX=neox,
        )  # fmt: skip
    return y
