"""The per-layer n-gram embedding ops' decode step for all rows at once (kernels/reference/ngram.py
has the math and every other step).

A decode step (StateMeta.decode: token r is row r's only token, or rows of `steps` tokens with
their states kept after each in checkpoint slots) reads the device copies of the rows' slots
and fresh flags alone: each row's history or conv inputs gathered by slot, one token of all rows
at a time, the new state written back into the slots (or checkpoints). No host copy is read and no
shape depends on a row's length: graph-safe (a CUDA graph's padding rows read and write the
pool's scratch slot, with fresh set).

    ngram_ids:    seq = [history ; token] [R, n]; the token s places back is seq[:, n - 1 - s], or
                  eos once an eos lies between it and the token; h_k = xor_{s < k} sh_s m_s
    dilated_conv: u = [state ; x] [R, C, (K - 1) d + 1]; y = silu(sum_i w[:, i] u[:, :, i d])
"""

from __future__ import annotations

import torch

from dayzero.kernels.batched.linear_attention import DECODE_GRAPHS, _written, conv_step
from dayzero.kernels.reference import ngram as reference
from dayzero.kernels.registry import Capabilities, register


@register("ngram_ids", "batched", Capabilities(**DECODE_GRAPHS))
def ngram_ids(
    ids: torch.Tensor,
    history: torch.Tensor,
    multipliers: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
    heads_per_ngram: int,
    eos: int,
    meta,
) -> torch.Tensor:
    """ids [R steps] (`steps` a row, in order), history [slots, n - 1] -> [R steps, (n - 1) Hg]
    hashed ids (the reference's); a row's history moves on by each token, written after each to
    its slot (or checkpoint)."""
    if not (meta.decode and meta.slots is not None):
        return reference.ngram_ids(ids, history, multipliers, sizes, offsets, heads_per_ngram, eos, meta)
    n, steps = multipliers.shape[0], meta.steps
    prev = history.index_select(0, meta.slots)  # [R, n - 1]
    prev = torch.where((meta.fresh != 0)[:, None], eos, prev)  # a fresh row's history: eos
    out = ids.new_empty(ids.shape[0], sizes.shape[0])
    for t in range(steps):
        tok = ids[t::steps]
        seq = torch.cat((prev, tok[:, None]), dim=1)  # [R, n]
        mixed = seq[:, n - 1] * multipliers[0]
        blocked = torch.zeros_like(tok, dtype=torch.bool)
        for s in range(1, n):  # the token s places back, eos past a document boundary
            back = seq[:, n - 1 - s]
            blocked |= back == eos
            mixed = torch.bitwise_xor(mixed, torch.where(blocked, eos, back) * multipliers[s])  # h_{s+1}
            cols = slice((s - 1) * heads_per_ngram, s * heads_per_ngram)
            out[t::steps, cols] = torch.remainder(mixed[:, None], sizes[cols]) + offsets[cols]
        prev = seq[:, 1:]
        history.index_copy_(0, _written(meta, t), prev)
    return out


@register("dilated_conv", "batched", Capabilities(**DECODE_GRAPHS))
def dilated_conv(
    x: torch.Tensor, weight: torch.Tensor, dilation: int, state: torch.Tensor, meta
) -> torch.Tensor:
    """x [R steps, C] (`steps` tokens a row, in order), weight [C, 1, K], state [slots, C,
    (K - 1) d] -> [R steps, C] in x's dtype (the reference's); after each token the slot (or
    checkpoint) keeps the last (K - 1) d inputs."""
    if not (meta.decode and meta.slots is not None):
        return reference.dilated_conv(x, weight, dilation, state, meta)
    return conv_step(x, weight, state, meta, dilation)
