"""The gated activations in Triton, shared by the fused SwiGLU (`fused.py`) and the expert kernels
(`moe.py`): kernels/reference/basic.py `gated_act`'s math, in fp32, with the op's constants
(c0, c1) (kernels/ops.py DEFAULT_CONSTS)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(z):
    """tanh(z) = 1 - 2 / (exp(2z) + 1) (exact at the limits: exp overflowing gives 1)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def _act(g, u, c0, c1, ACT: tl.constexpr):
    """a(g) u in fp32 (kernels/reference/basic.py gated_act, constants c0, c1): silu (0), gelu
    with the tanh approximation (1), g sigmoid(c0 g) (u + 1) (2), SiTU (3):
    [c0 tanh(g / c0) sigmoid(g)] [c1 tanh(u / c1)] (c1 = 0: u)."""
    if ACT == 0:
        return g / (1.0 + tl.exp(-g)) * u
    elif ACT == 1:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (1.0 + _tanh(z)) * u
    elif ACT == 2:
        return g / (1.0 + tl.exp(-c0 * g)) * (u + 1.0)
    else:
        lin = tl.where(c1 != 0.0, c1 * _tanh(u / tl.where(c1 != 0.0, c1, 1.0)), u)
        return c0 * _tanh(g / c0) / (1.0 + tl.exp(-g)) * lin


ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1, "clamped_swiglu": 2, "situ": 3}
