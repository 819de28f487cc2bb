"""The short causal convolution of linear-attention layers for all rows at once (no loop over rows
on the device): each token's K inputs gathered by one index from the rows' states and the step's
tokens, the state of each row written back in one scatter.

    y[t, c] = silu(sum_{i < K} w[c, i] * u[t - K + 1 + i, c])

u: the row's inputs, its last K - 1 earlier ones (the state in its slot; zeros for a row that
starts at position 0) before this step's. The index is built on the host from the step's row
layout (the scheduler's query starts and slots, host tuples), so nothing is read back from the
device. Memory: [T, C] a term (the K terms summed one at a time), [R, K - 1, C] for the states.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

import dayzero.kernels.ops  # noqa: F401  (declares the ops registered here)
from dayzero.kernels.registry import OPS, Capabilities, register


def _index(meta, k: int) -> tuple[np.ndarray, ...]:
    """(tokens [T'], taps [T', K], state rows [R, K - 1], slots [R], fresh [R]) over the R rows
    with tokens: a tap index < R (K - 1) reads the rows' states flattened, else R (K - 1) + token;
    T' the rows' tokens in order; fresh: the row starts from a zero state."""
    qs = np.asarray(meta.query_start_cpu)
    starts, lens = qs[:-1], np.diff(qs)
    keep = lens > 0
    starts, lens = starts[keep], lens[keep]
    slots = np.asarray(meta.slots_cpu)[keep]
    fresh = ~np.asarray(meta.has_initial_state_cpu, dtype=bool)[keep]
    rows = len(lens)
    row = np.repeat(np.arange(rows), lens)  # [T'] the token's row among the kept ones
    tokens = np.repeat(starts, lens) + (np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens))
    off = tokens - starts[row]  # [T'] position within this step's part of the row
    hist = rows * (k - 1)

    def at(r: np.ndarray, rel: np.ndarray) -> np.ndarray:
        """Where input `rel` (relative to the row's first token this step; < 0: the state) is."""
        return np.where(rel >= 0, hist + starts[r] + rel, r * (k - 1) + (k - 1) + rel)

    taps = at(row[:, None], off[:, None] - (k - 1) + np.arange(k)[None, :])  # [T', K]
    last = at(np.arange(rows)[:, None], lens[:, None] - (k - 1) + np.arange(k - 1)[None, :])  # [R, K-1]
    return tokens, taps, last, slots, fresh


@register("short_conv", "batched", Capabilities(features=OPS.get("short_conv").features, priority=10))
def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, meta) -> torch.Tensor:
    """x [T, C]; weight [C, 1, K] (the sums in its dtype); state [slots, C, K - 1] -> [T, C] in x's
    dtype; each row's state left as its last K - 1 inputs (kernels/reference: `short_conv`)."""
    out = torch.empty_like(x)
    k = weight.shape[-1]
    tokens, taps, last, slots, fresh = _index(meta, k)
    if not len(slots):
        return out
    dev = x.device
    slot_t = torch.from_numpy(slots).to(dev)
    fresh_t = torch.from_numpy(fresh).to(dev)[:, None, None]
    prev = state[slot_t].to(x.dtype).masked_fill(fresh_t, 0)  # [R, C, K - 1]
    src = torch.cat((prev.transpose(1, 2).reshape(-1, x.shape[1]), x))  # [R (K - 1) + T, C]
    taps_t = torch.from_numpy(taps).to(dev)
    w = weight[:, 0, :]  # [C, K]
    y = src[taps_t[:, 0]].to(w.dtype) * w[:, 0]
    for i in range(1, k):
        y += src[taps_t[:, i]].to(w.dtype) * w[:, i]  # [T', C]
    out[torch.from_numpy(tokens).to(dev)] = F.silu(y).to(x.dtype)
    state[slot_t] = src[torch.from_numpy(last).to(dev)].transpose(1, 2).to(state.dtype)  # [R, C, K - 1]
    return out
