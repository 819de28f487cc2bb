"""Reference GEMMs on packed weights: dequantize on the fly (kernels/packed.py), then the dense op.

Weight-only semantics: y = x W^T with W the exact dequantized weight, formed in fp32 and cast to
x's dtype. With `w.act_quant` (nvfp4 weights carrying input_scale, on request), x is first quantized and
dequantized as NVFP4 hardware reads it (see `fake_quant_nvfp4`), each part of a fused weight with
its own input_scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.kernels.ops import DEFAULT_CONSTS, GATED_ACTS, PACKED_FORMATS
from dayzero.kernels.packed import E2M1, PackedWeight
from dayzero.kernels.reference.moe import expert_loop
from dayzero.kernels.registry import Capabilities, register

E2M1_MAX, E4M3_MAX = 6.0, 448.0


def fake_quant_nvfp4(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [.., K] through NVFP4 activation quantization, back in fp32 (ModelOpt's dynamic block rule):

    per 16-element block b: s_b = e4m3(amax_b / (6 * input_scale))  (0 -> 1)
    x_hat = round_E2M1(x / (s_b * input_scale)) * s_b * input_scale   (round to nearest, ties even)
    """
    blocks = x.float().unflatten(-1, (-1, 16))  # [.., K/16, 16]
    s = blocks.abs().amax(-1, keepdim=True) / (E2M1_MAX * input_scale)
    s = s.masked_fill(s == 0, 1.0).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).float()
    scaled = blocks / (s * input_scale)
    grid = torch.tensor(E2M1[:8], device=x.device)
    mag = scaled.abs().clamp(max=E2M1_MAX)
    # nearest grid value; a tie goes to the even code (the code whose mantissa bit is 0)
    dist = (mag[..., None] - grid).abs()
    best = dist.min(-1, keepdim=True).values
    codes = torch.where(dist == best, torch.arange(8, device=x.device) % 2, 2).argmin(-1)
    q = grid[codes] * scaled.sign()
    return (q * (s * input_scale)).flatten(-2)  # the block scale formed first, as ModelOpt does


def _act_rows(x: torch.Tensor, w: PackedWeight, index=None) -> list[tuple[torch.Tensor, slice | None]]:
    """(x as the GEMM reads it, the output rows it feeds): one entry per distinct input_scale."""
    if not w.has_input_scale:
        return [(x, None)]
    scales = w.input if index is None else w.input[index]  # [N]
    out = []
    for s in scales.unique().tolist():
        rows = (scales == s).nonzero().flatten()
        out.append((fake_quant_nvfp4(x, torch.tensor(s, device=x.device)).to(x.dtype), rows))
    return out


def _gemm(x: torch.Tensor, w: PackedWeight, index=None) -> torch.Tensor:
    dense = w.dequant(x.dtype, index)  # [N, K]
    if not w.act_quant:
        return F.linear(x, dense)
    y = x.new_empty(*x.shape[:-1], dense.shape[0])
    for xq, rows in _act_rows(x, w, index):
        y[..., rows] = F.linear(xq, dense[rows])
    return y


FEATURES = frozenset({"act_quant", *PACKED_FORMATS})


@register("linear_packed", "reference", Capabilities(features=FEATURES | {"bias"}))
def linear_packed(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., K] @ dequant(w)^T (+ b) -> [.., N]."""
    y = _gemm(x, w)
    return y if bias is None else y + bias


@register(
    "moe_experts_packed",
    "reference",
    Capabilities(features=FEATURES | {"fp32", "limit", "skip", *GATED_ACTS}),
)
def moe_experts_packed(
    x: torch.Tensor,
    gate_up: PackedWeight,
    down: PackedWeight,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fp32: bool = False,
    limit: float | None = None,
    act: str = "silu",
    consts: tuple[float, float] = DEFAULT_CONSTS,
) -> torch.Tensor:
    """moe_experts (kernels/reference/moe.py) with each picked expert dequantized when used."""
    up, dn = (lambda h, e: _gemm(h, gate_up, e)), (lambda h, e: _gemm(h, down, e))
    return expert_loop(x, weights, ids, up, dn, fp32, limit, act, consts)
