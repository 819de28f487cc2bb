"""Linear-attention ops for all rows at once (no loop over rows on the device).

The short causal convolution: each token's K inputs gathered by one index from the rows' states
and the step's tokens, the state of each row written back in one scatter.

    y[t, c] = silu(sum_{i < K} w[c, i] * u[t - K + 1 + i, c])

u: the row's inputs, its last K - 1 earlier ones (the state in its slot; zeros for a row that
starts at position 0) before this step's. The index is built on the host from the step's row
layout (the scheduler's query starts and slots, host tuples), so nothing is read back from the
device. Memory: [T, C] a term (the K terms summed one at a time), [R, K - 1, C] for the states.

A decode step (StateMeta.decode: token r is row r's only token, or rows of `steps` tokens with
their states kept after each in checkpoint slots) reads the device copies of the slots and fresh
flags alone: the rows' states gathered by slot [R, ...], one step of each op for all rows (a
token of each at a time), the new states written back into their slots (or checkpoints). No
host copy is read and no shape depends on a row's length: graph-safe (a CUDA graph's padding
rows all read and write the pool's scratch slot, with fresh set). Kimi delta attention and the
gated delta rule run that step here; any other step goes to the reference ops (row by row; fla
on CUDA does those).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

import dayzero.kernels.ops  # noqa: F401  (declares the ops registered here)
from dayzero.kernels.reference import linear_attention as reference
from dayzero.kernels.registry import OPS, Capabilities, register

DECODE_GRAPHS = dict(priority=10, graphs=True)  # short_conv: over the reference (and no other)


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


def _initial(state: torch.Tensor, meta) -> torch.Tensor:
    """The decode rows' states [R, ...] gathered from their slots, zeros where fresh (whatever a
    fresh row's slot held, NaN included, is not read)."""
    s = state.index_select(0, meta.slots)
    fresh = (meta.fresh != 0).view(-1, *(1,) * (s.dim() - 1))
    return s.masked_fill(fresh, 0)


def _written(meta, t: int) -> torch.Tensor:
    """The slots the state after token t of each row goes to (`StateMeta.checkpoints`)."""
    return meta.slots if meta.checkpoints is None else meta.checkpoints[:, t]


def conv_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, meta, dilation: int = 1
) -> torch.Tensor:
    """`steps` tokens a row, in order: x [R steps, C] -> silu(sum_i w[:, i] u_{i d}) [R steps, C],
    u = [the row's last (K - 1) d inputs ; this token] [R, C, (K - 1) d + 1] (d: the dilation;
    1: the short conv); after each token u's last (K - 1) d columns go to its slot (or
    checkpoint)."""
    n, w = meta.steps, weight[:, 0, :]  # [C, K]
    hist = _initial(state, meta).to(x.dtype)  # [R, C, (K - 1) d]
    ys = []
    for t in range(n):
        seq = torch.cat((hist, x[t::n, :, None]), dim=2)
        y = seq[:, :, 0].to(w.dtype) * w[:, 0]
        for i in range(1, w.shape[1]):  # the order of the sums over the whole step's taps below
            y += seq[:, :, i * dilation].to(w.dtype) * w[:, i]
        hist = seq[:, :, 1:]
        state.index_copy_(0, _written(meta, t), hist.to(state.dtype))
        ys.append(F.silu(y).to(x.dtype))
    return ys[0] if n == 1 else torch.stack(ys, dim=1).view(x.shape)


@register("short_conv", "batched", Capabilities(features=OPS.get("short_conv").features, **DECODE_GRAPHS))
def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, meta) -> torch.Tensor:
    """x [T, C]; weight [C, 1, K] (the sums in its dtype); state [slots, C, K - 1] -> [T, C] in x's
    dtype; each row's state left as its last K - 1 inputs (kernels/reference: `short_conv`)."""
    if meta.decode and meta.slots is not None:
        return conv_step(x, weight, state, meta)
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


def _recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    meta,
) -> torch.Tensor:
    """The decode step of kda_recurrence / gated_delta_rule, `steps` tokens a row in order: q, k
    [R steps, HV, Dk] (heads already repeated to HV), v [R steps, HV, Dv], decay, beta as the
    reference's `delta_step`; state [slots, HV, Dk, Dv] fp32 written after each token to the
    rows' slots (or checkpoints) -> [R steps, HV, Dv] in v's dtype."""
    n = meta.steps
    qn = reference.l2norm(q.float()) * q.shape[-1] ** -0.5
    kn, s, outs = reference.l2norm(k.float()), _initial(state, meta), []
    for t in range(n):  # token t of every row
        o, s = reference.delta_step(qn[t::n], kn[t::n], v[t::n].float(), decay[t::n], beta[t::n].float(), s)
        state.index_copy_(0, _written(meta, t), s)
        outs.append(o)
    o = outs[0] if n == 1 else torch.stack(outs, dim=1).view(v.shape)
    return o.to(v.dtype)


def _bind(op: str, decay: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """The batched `op` (kda_recurrence or gated_delta_rule: the reference's arguments and
    result): a decode step for all rows at once, with decay(g fp32) the factor on the state
    (KDA: exp(g) [R, H, Dk] per key channel; the gated delta rule: exp(g) [R, HV, 1] per value
    head, the query / key heads repeated to HV); any other step through the reference."""
    ref = getattr(reference, op)

    def run(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        meta,
        chunked: bool = True,
    ) -> torch.Tensor:
        if not (meta.decode and meta.slots is not None):
            return ref(q, k, v, g, beta, state, meta, chunked)
        rep = v.shape[1] // q.shape[1]
        if rep > 1:  # value head j reads query / key head j // rep
            q, k = (x.repeat_interleave(rep, dim=1) for x in (q, k))
        return _recurrent_step(q, k, v, decay(g.float()), beta, state, meta)

    run.__name__ = run.__qualname__ = f"{op}_batched"
    run.__doc__ = f"{op}: the decode step batched over rows, other steps the reference's."
    return run


_DECODE_CAPS = Capabilities(features=frozenset({"chunked"}), priority=5, graphs=True)
kda_recurrence = register("kda_recurrence", "batched", _DECODE_CAPS)(_bind("kda_recurrence", torch.exp))
gated_delta_rule = register("gated_delta_rule", "batched", _DECODE_CAPS)(
    _bind("gated_delta_rule", lambda g: g.exp()[..., None])
)
