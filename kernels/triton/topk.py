"""The sparse indexers' top-k selection (op `index_topk`) in one Triton program per query token:
an exact radix select over the row's visible columns, no sort, no host sync, graph-safe.

Scores s [T, M] fp32 (-inf: not visible), query t sees the columns m < n_t = (p_t + 1) // P
(every indexer's scores are -inf past them). With k = topk / P groups to pick:
    c = the k-th largest finite s[t, m], m < n_t   (none when at most k are finite: take them all)
    chosen = {m: s_m > c} + the first k - |{s_m > c}| of {m: s_m = c}      (ties to low columns)
written in increasing column order, -1 padded: `kernels/reference/mla.py` `index_topk`'s set.

c comes from the order-preserving integer image of fp32 (u = bits for s >= 0, bits ^ 0x7FFFFFFF
below, + 2^31: unsigned order = float order; -0 read as +0) in four 8-bit passes: each pass
histograms the next digit of the columns that match the digits found so far and keeps the digit
where the count from the top reaches the still-missing rank. Cost per row: one counting pass,
four histogram passes when more than k are finite, one compaction pass, each over n_t columns
(not the graph's width), so a decode step reads its rows' own context and a prefill chunk its
causal triangle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.reference.mla import expand_groups


@triton.jit
def _ukey(x):
    """fp32 -> int64 in [0, 2^32), ordered as the floats (-0 as +0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648


# the step's token count and the scores' width change with the step: not specialised on
@triton.jit(do_not_specialize=["width", "stride_st", "stride_ot"])
def _index_topk(
    s_ptr,  # [T, width] fp32 scores
    pos_ptr,  # [T] query positions
    out_ptr,  # [T, K] chosen columns, -1 padded
    width,
    stride_st,
    stride_ot,
    K: tl.constexpr,
    P: tl.constexpr,
    BLOCK: tl.constexpr,
    BK: tl.constexpr,
):
    t = tl.program_id(0)
    n = tl.minimum((tl.load(pos_ptr + t).to(tl.int32) + 1) // P, width)
    row = s_ptr + t.to(tl.int64) * stride_st
    cols = tl.arange(0, BLOCK)
    finite = tl.zeros((), tl.int32)
    for start in range(0, n, BLOCK):
        x = tl.load(row + start + cols, mask=start + cols < n, other=float("-inf"))
        finite += tl.sum((x > float("-inf")).to(tl.int32))
    # kth: the u of c, need: how many columns tied at c to take; all finite: c = -inf, none tied
    kth = _ukey(tl.full((), float("-inf"), tl.float32))
    need = tl.zeros((), tl.int32)
    if finite > K:
        digits = tl.arange(0, 256)
        prefix = tl.zeros((), tl.int64)
        rem = tl.full((), K, tl.int32)  # the rank of c among the columns still matching the prefix
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros((256,), tl.int32)
            for start in range(0, n, BLOCK):
                c = start + cols
                u = _ukey(tl.load(row + c, mask=c < n, other=float("-inf")))
                match = (c < n) & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
                hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
            above = tl.sum(hist) - tl.cumsum(hist, 0)  # [256] matching columns with a larger digit
            d = tl.max(tl.where(above + hist >= rem, digits, -1))
            rem -= tl.sum(tl.where(digits == d, above, 0))
            prefix += d.to(tl.int64) << shift
        kth, need = prefix, rem
    taken = tl.zeros((), tl.int32)
    tied = tl.zeros((), tl.int32)
    for start in range(0, n, BLOCK):
        c = start + cols
        u = _ukey(tl.load(row + c, mask=c < n, other=float("-inf")))
        eq = ((c < n) & (u == kth)).to(tl.int32)
        take = ((c < n) & (u > kth)) | ((eq != 0) & (tied + tl.cumsum(eq, 0) <= need))
        slot = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(out_ptr + t * stride_ot + slot, c.to(tl.int64), mask=take)
        taken += tl.sum(take.to(tl.int32))
        tied += tl.sum(eq)
    for start in tl.static_range(0, K, BK):
        slot = start + tl.arange(0, BK)
        tl.store(
            out_ptr + t * stride_ot + slot, tl.full((BK,), -1, tl.int64), mask=(slot >= taken) & (slot < K)
        )


def index_topk(
    scores: torch.Tensor, positions: torch.Tensor, topk: int, pool: int = 1, tail: bool = False
) -> torch.Tensor:
    """scores [T, M] fp32 by group of `pool` keys (-inf: not visible), positions [T] -> [T, topk]
    (+ [T, P - 1] with `tail`) positions, -1 padded (the reference op's contract)."""
    t, width = scores.shape
    k = topk // pool
    best = torch.empty(t, k, dtype=torch.long, device=scores.device)
    if t and k:
        scores = scores if scores.stride(-1) == 1 else scores.contiguous()
        _index_topk[(t,)](
            scores, positions, best, width, scores.stride(0), best.stride(0),
            K=k, P=pool, BLOCK=1024, BK=min(1024, triton.next_power_of_2(k)), num_warps=4,
        )  # fmt: skip
    return expand_groups(best, positions, pool, tail)
