"""RMSNorm in Triton: one launch where the reference takes about six small ones. The math is the
reference's (kernels/reference/basic.py), in fp32:

  rms_norm   y = x / sqrt(mean(x^2) + eps) * w; weight_in_fp32: w * h rounded once (Gemma/Beam
             order), else h rounded to x's dtype, then times w (Llama order)

  rms_norm_gated   rms_norm(x, w) rounded as above, then * act(z) (silu or sigmoid) in fp32,
                   rounded to the output dtype: a linear attention's output gate in one launch

(RoPE is kernels/triton/fused.py's norm_rope with only its rotation on.)

A row is one vector of the last dim: x [.., D] with any strides over its (at most two) leading
dims, so q / k views of a fused projection are read in place. The weight is w [D], or w [H, D]
for x [T, H, D]: one weight a head or stream (low-rank hyper-connections norm each stream with
its own).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.ops import OUTPUT_GATES
from dayzero.kernels.reference import basic as ref


@triton.jit
def _rms_norm(
    x_ptr, w_ptr, y_ptr, H, stride_t, stride_h, stride_wh, D, eps, BD: tl.constexpr, W_FP32: tl.constexpr
):  # fmt: skip
    r = tl.program_id(0)
    t, h = r // H, r % H
    d = tl.arange(0, BD)
    m = d < D
    x = tl.load(x_ptr + t.to(tl.int64) * stride_t + h * stride_h + d, mask=m, other=0.0).to(tl.float32)
    hx = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + h * stride_wh + d, mask=m, other=0.0).to(tl.float32)
    dt = x_ptr.dtype.element_ty
    y = w * hx if W_FP32 else w * hx.to(dt).to(tl.float32)
    tl.store(y_ptr + r.to(tl.int64) * D + d, y.to(y_ptr.dtype.element_ty), mask=m)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, H, stride over t, stride over h) of x [T, D] or [T, H, D] (last dim contiguous)."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False) -> torch.Tensor:
    shape, per_head = x.shape, weight.dim() == 2  # w [H, D] against x [.., H, D]
    if per_head and (x.dim() < 3 or weight.shape != x.shape[-2:]):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    if x.dim() > 3:
        x = x.reshape(-1, *x.shape[-2:]) if per_head else x.reshape(-1, x.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    # the reference's result dtype: x's when the product is rounded once, else w * (h in x's dtype)
    dtype = x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    rows, h, st, sh = _rows(x)
    if rows:
        d = x.shape[-1]
        _rms_norm[(rows,)](
            x, weight, y, h, st, sh, d if per_head else 0, d, eps, BD=triton.next_power_of_2(d),
            W_FP32=weight_in_fp32,
        )  # fmt: skip
    return y.view(shape)


@triton.jit
def _rms_norm_gated(
    x_ptr, w_ptr, z_ptr, y_ptr, H, stride_t, stride_h, stride_zt, stride_zh, D, eps,
    BD: tl.constexpr, W_FP32: tl.constexpr, ROUND: tl.constexpr, SIGMOID: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    t, h = (r // H).to(tl.int64), r % H
    d = tl.arange(0, BD)
    m = d < D
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * stride_t + h * stride_h + d, mask=m, other=0.0).to(tl.float32)
    hx = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    if W_FP32:
        y = (w * hx).to(dt).to(tl.float32)
    else:
        y = w * hx.to(dt).to(tl.float32)
        if ROUND:  # the product in x's dtype (else it promoted to fp32)
            y = y.to(dt).to(tl.float32)
    z = tl.load(z_ptr + t * stride_zt + h * stride_zh + d, mask=m, other=0.0).to(tl.float32)
    a = 1.0 / (1.0 + tl.exp(-z))
    if not SIGMOID:
        a = z * a  # silu
    tl.store(y_ptr + r.to(tl.int64) * D + d, (y * a).to(y_ptr.dtype.element_ty), mask=m)


def rms_norm_gated(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor,
    eps: float,
    act: str = "silu",
    weight_in_fp32: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if x.dim() != 3 or z.shape != x.shape or weight.dim() != 1 or act not in OUTPUT_GATES:
        return ref.rms_norm_gated(x, weight, z, eps, act, weight_in_fp32, out_dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    t, h, d = x.shape
    norm_dtype = x.dtype if weight_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if t * h:
        _rms_norm_gated[(t * h,)](
            x, weight.contiguous(), z, y, h, x.stride(0), x.stride(1), z.stride(0), z.stride(1), d, eps,
            BD=triton.next_power_of_2(d), W_FP32=weight_in_fp32, ROUND=norm_dtype == x.dtype,
            SIGMOID=act == "sigmoid",
        )  # fmt: skip
    return y
