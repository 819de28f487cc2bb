"""Stacked SwiGLU experts without a loop over experts.

Few (token, expert) pairs (decode at small batch): the pairs' expert weights are gathered and
applied with two batched matmuls. Many pairs: two grouped GEMMs over the pairs sorted by expert
(torch._grouped_mm: CUTLASS on Hopper; the Triton backend runs prefill shapes through it too).
Neither path synchronises with the host."""

from __future__ import annotations

import torch

from dayzero.kernels.ops import GATED_ACTS
from dayzero.kernels.reference.basic import swiglu
from dayzero.kernels.reference.moe import moe_experts as expert_loop
from dayzero.kernels.registry import Capabilities, register

GATHER_PAIRS = 16  # up to this many pairs, gather the experts (bounded copy: 16 experts' weights)


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fp32: bool = False,
    limit: float | None = None,
    act: str = "silu",
    alpha: float = 1.702,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's math (kernels/reference/moe.py) without a loop over experts; the biases
    [E, 2I] / [E, Dm] gathered per pair and added to each product's output.

    x [T, Dm], gate_up [E, 2I, Dm], down [E, Dm, I], weights/ids [T, k] -> [T, Dm]. The k expert
    outputs of a token are weighted and summed in fp32, then cast to x's dtype.
    """
    t, k = ids.shape
    flat = ids.reshape(-1)
    if t * k <= GATHER_PAIRS:
        xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [P, Dm, 1], P = T*k pairs
        gu = torch.bmm(gate_up[flat], xs).squeeze(-1)  # [P, 2I]
        g, u = (gu if gate_up_bias is None else gu + gate_up_bias[flat]).chunk(2, dim=-1)  # [P, I]
        hidden = swiglu(g, u, fp32, limit, act, alpha)
        y = torch.bmm(down[flat], hidden[:, :, None]).squeeze(-1)  # [P, Dm]
        y = y if down_bias is None else y + down_bias[flat]
        return (y.float() * weights.reshape(-1, 1).float()).view(t, k, -1).sum(1).to(x.dtype)
    if gate_up.shape[1] % 16 or x.shape[1] % 8:  # grouped GEMM needs 16-byte aligned rows
        return expert_loop(x, gate_up, down, weights, ids, fp32, limit, act, alpha, gate_up_bias, down_bias)
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int64, device=x.device)
    offs = counts.scatter_add_(0, flat, torch.ones_like(flat)).cumsum(0).to(torch.int32)  # no host sync
    xs = x[order // k]  # [T*k, Dm]
    gu = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    g, u = (gu if gate_up_bias is None else gu + gate_up_bias[flat[order]]).chunk(2, dim=-1)  # [T*k, I]
    hidden = swiglu(g, u, fp32, limit, act, alpha)
    y = torch._grouped_mm(hidden, down.transpose(1, 2), offs=offs)  # [T*k, Dm]
    y = y if down_bias is None else y + down_bias[flat[order]]
    out = torch.empty(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    out[order] = y.float() * weights.reshape(-1)[order, None].float()
    return out.view(t, k, -1).sum(1).to(x.dtype)


if hasattr(torch, "_grouped_mm"):  # torch >= 2.8; CUDA: bf16 on compute capability 9.0+
    register(
        "moe_experts",
        "grouped_mm",
        Capabilities(
            devices=frozenset({"cuda"}),
            dtypes=frozenset({torch.bfloat16}),
            features=frozenset({"fp32", "limit", "bias", *GATED_ACTS}),
            min_capability=(9, 0),
            priority=10,
        ),
    )(moe_experts)
