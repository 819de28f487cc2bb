"""Sparse GQA attention in Triton over a sparse indexer's selection (QSA), reading K/V in place
from the paged cache: no gathered [T, S, H, D] copy, no per-head repeat of the keys.

Math (the reference's, kernels/reference/attention.py with `select`): query token t of row r at
position p_t reads the selected key positions j in select[t] ([T, S] distinct positions in any
order, -1 unused: an indexer's contract) with j <= p_t, j < kv_lens[r], j's block held, and
j > p_t - window when windowed; kv head g = h // (H / Hk):
    s[t, h, j] = scale <q[t, h], K_r[j, g]>                  (cap tanh(s / cap) with a softcap)
    out[t, h]  = sum_j softmax_j(s)[j] V_r[j, g]
    (with sinks [H]: exp(sinks[h]) joins the denominator, a logit without a value)
in fp32 with an online softmax over tiles of the selection; the probabilities are rounded to V's
dtype before the V product. A token that reads no key gets zeros (its sink alone: zeros too).

A program takes one token, one kv head with its G query heads (each key tile loaded once for
all of them) and one split of the selection's columns; the splits merge by their log-sum-exp
(kernels/triton/attention.py `_merge`). The grid is (tokens, kv heads, splits), the ranges read
on the device: a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.triton import attention as dense
from dayzero.kernels.triton.attention import _finish, _merge, _splits, _start, _tile, token_rows


@triton.jit(do_not_specialize=["stride_tr", "window"])
def _select_attention(
    q_ptr,  # [T, H, D]
    k_ptr,  # [N, Hk, D] (rows strided)
    v_ptr,
    sel_ptr,  # [T, S_sel] selected positions, -1 unused
    o_ptr,  # [T, H, S, D] fp32: each split's normalised output
    lse_ptr,  # [T, H, S] fp32: each split's log-sum-exp (-inf: no key read)
    sinks_ptr,  # [H] (read when SINKS)
    rows_ptr,  # [T] each token's row
    pos_ptr,
    kv_lens_ptr,
    table_ptr,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_st,
    stride_tr,
    n_sel,
    scale,
    softcap,
    window,
    block_size,
    H: tl.constexpr,
    S: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BG: tl.constexpr,
    BN: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
    IEEE: tl.constexpr,
):
    t, kh, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    r = tl.load(rows_ptr + t).to(tl.int64)
    p_t = tl.load(pos_ptr + t)
    kv_len = tl.load(kv_lens_ptr + r)
    gi = tl.arange(0, BG)
    hm = gi < G
    h = kh * G + gi  # [BG] query heads of this kv head
    row = (t * H + h) * S + split  # [BG] index into [T, H, S]
    d = tl.arange(0, BD)
    dm = d < D
    per = tl.cdiv(tl.cdiv(n_sel, S), BN) * BN  # this split's columns, whole BN tiles
    start = split * per
    stop = tl.minimum(start + per, n_sel)
    q = tl.load(
        q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0
    )
    m_i, l_i, acc = _start(sinks_ptr, h, hm, split, BG, BD, SINKS)
    for c0 in range(start, stop, BN):
        c = c0 + tl.arange(0, BN)
        j = tl.load(sel_ptr + t * stride_st + c, mask=c < stop, other=-1)  # [BN] key positions
        ok = (j >= 0) & (j <= p_t) & (j < kv_len)
        if WINDOW:
            ok &= j > p_t - window
        blk = tl.load(table_ptr + r * stride_tr + j // block_size, mask=ok, other=-1)
        ok &= blk >= 0
        slot = blk.to(tl.int64) * block_size + j % block_size
        kvm = ok[:, None] & dm[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kn + kh * stride_kh + d[None, :], mask=kvm, other=0.0)
        k = k.to(q.dtype)  # [BN, BD]
        if IEEE:  # noqa: SIM108  (a compile-time branch in Triton)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale  # [BG, BN]
        if SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(ok[None, :], s, float("-inf"))
        v = tl.load(v_ptr + slot[:, None] * stride_vn + kh * stride_vh + d[None, :], mask=kvm, other=0.0)
        m_i, l_i, acc = _tile(s, v.to(q.dtype), m_i, l_i, acc, IEEE)
    _finish(o_ptr, lse_ptr, row, d, acc, m_i, l_i, hm, dm, D)


SELECT_TILE = 32  # selected keys a tile: a gather of scattered rows (no long contiguous runs)


def gqa_attention_select(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    select: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """q [T, H, D], caches [N, Hk, D] (views of the paged pool), sinks [H] or None, select [T, S]
    (None: dense causal attention, the paged kernel's) -> [T, H, D]. `splits`: column splits per
    token (default: by the GPU's size for few tokens)."""
    if select is None:
        return dense.gqa_attention(q, k_cache, v_cache, meta, scale, window, softcap, sinks)
    t, h, dh = q.shape
    hk = k_cache.shape[1]
    if t == 0:
        return q.new_zeros(t, h, dh)
    q = q if q.stride(-1) == 1 else q.contiguous()
    select = select if select.stride(-1) == 1 else select.contiguous()
    rows = token_rows(meta, t)  # [T]
    n_sel = select.shape[1]
    splits = splits or min(_splits(t, hk, 1, q.device), max(1, triton.cdiv(n_sel, SELECT_TILE)))
    o = torch.empty(t, h, splits, dh, dtype=torch.float32, device=q.device)
    lse = torch.empty(t, h, splits, dtype=torch.float32, device=q.device)
    table = meta.block_table
    _select_attention[(t, hk, splits)](
        q, k_cache, v_cache, select, o, lse, lse if sinks is None else sinks, rows, meta.positions,
        meta.kv_lens, table, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), select.stride(0), table.stride(0), n_sel, scale,
        softcap or 1.0, window or 0, meta.block_size,
        H=h, S=splits, G=h // hk, D=dh, BD=triton.next_power_of_2(dh),
        BG=max(16, triton.next_power_of_2(h // hk)), BN=SELECT_TILE,
        SOFTCAP=softcap is not None, WINDOW=window is not None, SINKS=sinks is not None,
        IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2,
    )  # fmt: skip
    return _merge(o, lse, q.dtype)
