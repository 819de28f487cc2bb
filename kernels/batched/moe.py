"""Stacked SwiGLU experts without a loop over experts.

Few (token, expert) pairs (decode at small batch): the pairs' expert weights are gathered and
applied with two batched matmuls. Many pairs: two grouped GEMMs over the pairs sorted by expert
(torch._grouped_mm: CUTLASS on Hopper; the Triton backend runs prefill shapes through it too).
A pair of id -1 (no expert) adds nothing: the grouped GEMMs sort it past every expert's group,
so no expert is read for it; the gathered path (a fixed shape, at most GATHER_PAIRS pairs)
reads expert 0 for it and drops the product. Neither path synchronises with the host."""

from __future__ import annotations

import torch

from dayzero.kernels.ops import DEFAULT_CONSTS, GATED_ACTS
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
    consts: tuple[float, float] = DEFAULT_CONSTS,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's math (kernels/reference/moe.py) without a loop over experts; the biases
    [E, 2I] / [E, Dm] gathered per pair and added to each product's output; id -1: no expert.

    x [T, Dm], gate_up [E, 2I, Dm], down [E, Dm, I], weights/ids [T, k] -> [T, Dm]. The k expert
    outputs of a token are weighted and summed in fp32, then cast to x's dtype.
    """
    t, k = ids.shape
    e = gate_up.shape[0]
    flat = ids.reshape(-1)  # [P], P = T*k pairs
    live = (flat >= 0)[:, None]  # [P, 1]: the pair has an expert
    pick = flat.clamp(min=0)  # [P]: the expert a pair's bias is read from (its output is dropped if skipped)
    w = weights.reshape(-1, 1).float()  # [P, 1]
    if t * k <= GATHER_PAIRS:
        # a fixed shape a pair: a skipped pair gathers expert 0 (at most GATHER_PAIRS of them)
        xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [P, Dm, 1]
        gu = torch.bmm(gate_up[pick], xs).squeeze(-1)  # [P, 2I]
        g, u = (gu if gate_up_bias is None else gu + gate_up_bias[pick]).chunk(2, dim=-1)  # [P, I]
        hidden = swiglu(g, u, fp32, limit, act, consts)
        y = torch.bmm(down[pick], hidden[:, :, None]).squeeze(-1)  # [P, Dm]
        y = y if down_bias is None else y + down_bias[pick]
        return torch.where(live, y.float() * w, 0.0).view(t, k, -1).sum(1).to(x.dtype)
    if gate_up.shape[1] % 16 or x.shape[1] % 8:  # grouped GEMM needs 16-byte aligned rows
        return expert_loop(x, gate_up, down, weights, ids, fp32, limit, act, consts, gate_up_bias, down_bias)
    key = torch.where(live[:, 0], flat, e)  # [P]: skipped pairs sort after every expert's
    order = key.argsort(stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.zeros(e + 1, dtype=torch.int64, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    # each expert's group ends at offs[e] (no host sync); the skipped pairs' rows, past the last
    # end, belong to no group: no expert is read for them and their (unset) outputs are dropped
    offs = counts[:e].cumsum(0).to(torch.int32)
    xs = x[order // k]  # [P, Dm]
    gu = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # [P, 2I]
    g, u = (gu if gate_up_bias is None else gu + gate_up_bias[pick[order]]).chunk(2, dim=-1)  # [P, I]
    hidden = swiglu(g, u, fp32, limit, act, consts)
    y = torch._grouped_mm(hidden, down.transpose(1, 2), offs=offs)  # [P, Dm]
    y = y if down_bias is None else y + down_bias[pick[order]]
    out = torch.empty(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    out[order] = torch.where(live[order], y.float() * w[order], 0.0)
    return out.view(t, k, -1).sum(1).to(x.dtype)


if hasattr(torch, "_grouped_mm"):  # torch >= 2.8; CUDA: bf16 on compute capability 9.0+
    register(
        "moe_experts",
        "grouped_mm",
        Capabilities(
            devices=frozenset({"cuda"}),
            dtypes=frozenset({torch.bfloat16}),
            features=frozenset({"fp32", "limit", "bias", "skip", *GATED_ACTS}),
            min_capability=(9, 0),
            priority=10,
        ),
    )(moe_experts)
