"""Reference elementwise and matmul ops: embedding, linear, RMSNorm, RoPE, SwiGLU, softcap, and the
fused small ops (residual add + RMSNorm, head norm + RoPE + query scaling, the sigmoid output
gate) as compositions of them: the fused kernels' ground truth, rounding included."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.kernels.ops import ACTIVATIONS, DEFAULT_CONSTS
from dayzero.kernels.registry import register

SMALL_M = 4  # rows up to which the fp32 CPU linear takes W @ x^T


@register("embedding", "reference", graphs=True)
def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)  # [T, Dm]


@register("linear", "reference", graphs=True)
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b), x read in W's dtype. A few fp32 rows on the CPU (decode, verify, the MTP
    head) go as W [N, K] @ x^T [K, M<=4] (M = 1 padded to 2): CPU BLAS streams W for that
    product at about twice the rate of its matrix-vector path, and decode is W's bytes."""
    x = x.to(weight.dtype)  # [M, K]
    m = x.shape[0]
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and m <= SMALL_M:
        xs = x if m > 1 else torch.cat((x, x))
        y = (weight @ xs.t())[:, :m].t().contiguous()  # [M, N]
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


@register("layer_norm", "reference", graphs=True)
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@register("rms_norm", "reference", graphs=True)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * w, the statistic in fp32.

    weight_in_fp32: multiply by w before casting back (Gemma/Beam order); otherwise cast, then
    multiply (Llama order). Identical in fp32, differs by rounding in bf16. A zero-centred norm
    (Gemma's (1 + w)) passes w = 1 + w_stored in fp32 (sdk/blocks/norm.py `RMSNorm.scale`),
    with weight_in_fp32.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (weight * h).to(x.dtype)
    return weight * h.to(x.dtype)


GATE_ACTS = {"silu": F.silu, "sigmoid": torch.sigmoid}  # ops.OUTPUT_GATES


@register("rms_norm_gated", "reference", graphs=True)
def rms_norm_gated(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor,
    eps: float,
    act: str = "silu",
    weight_in_fp32: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y = rms_norm(x, w) rounded as `rms_norm` rounds it, then y * act(z) in fp32, rounded to
    out_dtype (x's by default); x, z [.., D], w [D]. The output gate of the linear attentions
    (Gated DeltaNet: silu or sigmoid of z; KDA: sigmoid, the norm in fp32)."""
    h = rms_norm(x, weight, eps, weight_in_fp32)
    return (h.float() * GATE_ACTS[act](z.float())).to(out_dtype or x.dtype)


@register("rope", "reference", graphs=True)
def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, neox: bool = True) -> torch.Tensor:
    """Rotary embedding on the first 2 * len(inv_freq) channels of x [T, H, D].

    angle[t, j] = positions[t] * inv_freq[j]. neox (rotate-half): channel j pairs with j + R/2;
    otherwise (GPT-J) channel 2j pairs with 2j + 1. Channels past R pass through (partial RoPE).
    """
    rot = 2 * inv_freq.shape[0]
    ang = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, R/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # [T, 1, R/2]
    xr = x[..., :rot].float()
    if neox:
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)


@register("add_rms_norm", "reference", graphs=True)
def add_rms_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_in_fp32: bool = False,
    post_weight: torch.Tensor | None = None,
    scales: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One residual add and the next block's norm: y <- rms_norm(y, post_weight) (sandwich),
    x' = x + y, or x * a + y * b with scales (a, b) (depth-scaled); returns (x', rms_norm(x'))
    [T, D] each, every intermediate rounded to x's dtype as the unfused ops round it."""
    if post_weight is not None:
        y = rms_norm(y, post_weight, eps, weight_in_fp32)
    x = x + y if scales is None else y * scales[1] + x * scales[0]
    return x, rms_norm(x, weight, eps, weight_in_fp32)


def norm_rope(  # the math of qk_norm_rope_write (reference/attention.py)
    x: torch.Tensor,
    positions: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    weight_in_fp32: bool = False,
    inv_freq: torch.Tensor | None = None,
    neox: bool = True,
    log_scaling: tuple[float, float] | None = None,
    rope_factor: float = 1.0,
) -> torch.Tensor:
    """Per head vector of x [T, H, D], each step optional: rms_norm(x, weight) (qk-norm), then
    rope at positions (inv_freq) with its rotated channels times rope_factor (the scaled RoPE
    kinds' attention factor), then x * (1 + (p + 1) / base) ** exponent (log_scaling =
    (base, exponent): scalable-softmax query scaling) in fp32, each step rounded back."""
    if weight is not None:
        x = rms_norm(x, weight, eps, weight_in_fp32)
    if inv_freq is not None:
        x = rope(x, positions, inv_freq, neox)
        if rope_factor != 1.0:
            rot = 2 * inv_freq.shape[0]
            x = torch.cat(((x[..., :rot].float() * rope_factor).to(x.dtype), x[..., rot:]), dim=-1)
    if log_scaling is not None:
        base, exponent = log_scaling
        s = torch.exp(exponent * torch.log1p((positions.float() + 1) / base))  # [T]
        x = (x.float() * s[:, None, None]).to(x.dtype)
    return x


@register("sigmoid_gate", "reference", graphs=True)
def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """o * sigmoid(gate (+ bias[h])): o, gate [T, H, D], bias [H]."""
    if bias is not None:
        gate = gate + bias[None, :, None]
    return o * torch.sigmoid(gate)


def gated_act(
    g: torch.Tensor, u: torch.Tensor, act: str = "silu", consts: tuple[float, float] = DEFAULT_CONSTS
) -> torch.Tensor:
    """act(g) * u in g's dtype, with (c0, c1) = consts:
    silu               silu(g) u  (SwiGLU)
    gelu_pytorch_tanh  gelu_tanh(g) u  (GeGLU, torch's tanh approximation)
    clamped_swiglu     g sigmoid(c0 g) (u + 1)  (gpt-oss's experts, c0 = alpha)
    situ               [c0 tanh(g / c0) sigmoid(g)] [c1 tanh(u / c1)]  (Kimi K3; c0 = beta,
                       c1 = the linear beta; c1 = 0: u unchanged)"""
    if act == "silu":
        return F.silu(g) * u
    if act == "gelu_pytorch_tanh":
        return F.gelu(g, approximate="tanh") * u
    if act == "clamped_swiglu":
        return g * torch.sigmoid(g * consts[0]) * (u + 1)
    if act == "situ":
        beta, linear = consts
        return (
            beta
            * torch.tanh(g / beta)
            * torch.sigmoid(g)
            * (linear * torch.tanh(u / linear) if linear else u)
        )
    raise ValueError(f"activation {act!r} is not implemented; known: {', '.join(ACTIVATIONS)}")


@register("swiglu", "reference", graphs=True)
def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    fp32: bool = False,
    limit: float | None = None,
    act: str = "silu",
    consts: tuple[float, float] = DEFAULT_CONSTS,
) -> torch.Tensor:
    """act(min(gate, limit)) * clamp(up, -limit, limit) (no clamp without a limit; `act` and its
    constants as gated_act); with fp32 the activation and product run in fp32 and are cast back."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if fp32:
        return gated_act(gate.float(), up.float(), act, consts).to(gate.dtype)
    return gated_act(gate, up, act, consts)


@register("softcap", "reference", graphs=True)
def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) in fp32 (bf16 tanh saturates badly); returns fp32."""
    return torch.tanh(x.float() / cap) * cap
