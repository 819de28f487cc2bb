"""Paged GQA attention for all rows at once: keys gathered into [R, L, Hk, D], queries padded to
[R, Q, H, D], one masked SDPA call (manual softmax when a logit softcap or sinks are asked for)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.registry import Capabilities, register


def _layout(meta: PagedMeta, window: int | None, tokens: int):
    """Index and mask tensors for one step of one group (shared by all its layers).

    slots [R, L] cache slot of key position lo + l; unread [R, L, 1, 1] keys a row may not read;
    tok [R, Q] token index of each padded query; sel [T] the padded positions r * Q + i that are
    real tokens, in token order; allowed [R, Q, L]."""
    dev, bs, qs = meta.query_start.device, meta.block_size, meta.query_start
    n_q = qs[1:] - qs[:-1]  # [R]
    q_max = max(b - a for a, b in zip(meta.query_start_cpu, meta.query_start_cpu[1:], strict=False))
    l_max = max(meta.kv_lens_cpu)
    lo = 0
    if window is not None:  # keys before every row's first window are never needed
        firsts = [
            k - (b - a)
            for k, a, b in zip(meta.kv_lens_cpu, meta.query_start_cpu, meta.query_start_cpu[1:], strict=False)
        ]
        lo = max(0, min(firsts) - window + 1)
    j = torch.arange(lo, l_max, device=dev)  # key positions [L]
    table = meta.block_table[:, (j // bs).clamp(max=meta.block_table.shape[1] - 1)]  # [R, L]
    slots = table.clamp(min=0) * bs + j % bs
    real = (table >= 0) & (j[None, :] < meta.kv_lens[:, None])  # [R, L]: keys the row may read
    if window is not None:  # and no older than its first query's window
        real &= j[None, :] > (meta.kv_lens - n_q)[:, None] - window
    i = torch.arange(q_max, device=dev)
    tok = (qs[:-1, None] + i[None, :]).clamp(max=tokens - 1)  # [R, Q]
    valid_q = i[None, :] < n_q[:, None]
    pos_q = meta.kv_lens[:, None] - n_q[:, None] + i[None, :]  # [R, Q]
    allowed = (j[None, None, :] <= pos_q[:, :, None]) & (table[:, None, :] >= 0)  # [R, Q, L]
    if window is not None:
        allowed &= j[None, None, :] > pos_q[:, :, None] - window
    allowed &= valid_q[:, :, None]
    allowed[:, :, 0] |= ~allowed.any(-1)  # padded queries see one key: no all-masked rows (NaN)
    lens = [b - a for a, b in zip(meta.query_start_cpu, meta.query_start_cpu[1:], strict=False)]
    sel = torch.tensor([r * q_max + i for r, n in enumerate(lens) for i in range(n)], device=dev)
    return slots, ~real[:, :, None, None], tok, sel, allowed


@register(
    "gqa_attention",
    "batched",
    Capabilities(features=frozenset({"causal", "sliding_window", "softcap", "sinks"}), priority=5),
)
def gqa_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reference's math (see kernels/reference/attention.py), batched over rows; with sinks
    [H] each head's logit joins the softmax (manual softmax, as with a softcap).

    q [T, H, D], caches [N, Hk, D] -> [T, H, D]. Key j of row r is allowed for the query at
    position p iff j < kv_lens[r], j <= p, and j > p - window when windowed.
    """
    layout = meta.memo.get(("gqa", window)) or _layout(meta, window, q.shape[0])
    meta.memo[("gqa", window)] = layout
    slots, unread, tok, sel, allowed = layout
    keys = k_cache[slots].to(q.dtype).masked_fill(unread, 0)  # [R, L, Hk, D]; slots no query may read
    vals = v_cache[slots].to(q.dtype).masked_fill(unread, 0)  # can hold anything: zeroed, then masked
    qp = q[tok].transpose(1, 2)  # [R, H, Q, D]
    h, hk = q.shape[1], k_cache.shape[1]
    kt, vt = keys.transpose(1, 2), vals.transpose(1, 2)  # [R, Hk, L, D]
    plain = softcap is None and sinks is None
    if plain and qp.shape[2] > 1:  # prefill rows: a fused kernel (never cuDNN: it plans per shape)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
            out = F.scaled_dot_product_attention(
                qp, kt, vt, attn_mask=allowed[:, None], scale=scale, enable_gqa=h != hk
            )
    elif plain:  # decode only: one query per row, plain batched matmuls
        g = h // hk
        s = torch.einsum("rkgd,rkld->rkgl", qp.reshape(-1, hk, g, qp.shape[3]).float(), kt.float()) * scale
        s = s.masked_fill(~allowed[:, :, None, :].transpose(1, 2), float("-inf"))  # [R, Hk, G, L]
        out = torch.einsum("rkgl,rkld->rkgd", torch.softmax(s, -1).to(q.dtype), vt).reshape(qp.shape)
    else:
        kt, vt = kt.repeat_interleave(h // hk, dim=1), vt.repeat_interleave(h // hk, dim=1)
        s = torch.einsum("rhqd,rhld->rhql", qp.float(), kt.float()) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        if sinks is not None:  # [R, H, Q, L + 1]: the sink logit joins the softmax, then is dropped
            sink = sinks.float()[None, :, None, None].expand(*s.shape[:3], 1)
            p = torch.softmax(torch.cat((s, sink), dim=-1), -1)[..., :-1]
        else:
            p = torch.softmax(s, -1)
        out = torch.einsum("rhql,rhld->rhqd", p.to(q.dtype), vt)
    out = out.transpose(1, 2).reshape(-1, h, q.shape[2])  # [R * Q, H, D]
    return out[sel]  # back to [T, H, D] in token order


CHUNK_BYTES = 256 << 20  # the selected keys, values and scores of a chunk of tokens, at most (about)


@register(
    "gqa_attention",
    "batched_select",
    Capabilities(
        features=frozenset({"causal", "sliding_window", "softcap", "sinks", "select"}),
        priority=3,
        graphs=True,
    ),
)
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
) -> torch.Tensor:
    """Sparse GQA (a sparse indexer's selection): the reference's math (kernels/reference/
    attention.py) over each token's selected key positions only, read from the paged cache.

    select [T, S] key positions (-1 padded; a repeat counts once, as set membership does; None:
    every position of the block table, i.e. dense causal attention over [T, W B]). For
    query token t of row r at position p_t, selected j is read iff j <= p_t, j < kv_lens[r], its
    block is held (and j > p_t - window when windowed):
        out[t, h] = sum_j softmax_j(scale <q[t, h], K_r[j]>) V_r[j]     over the read j
    A token that reads no key (a graph's padding row) gets zeros. Memory: [Tc, S, Hk, D] keys
    and values and [Tc, H, S] scores for token chunks of Tc; only device tensors are read (no
    host copy, no sync): graph-safe.
    q [T, H, D], caches [N, Hk, D] -> [T, H, D].
    """
    t, h, d = q.shape
    hk, bs, table = k_cache.shape[1], meta.block_size, meta.block_table
    if select is None:  # dense: every position the block table can hold (a graph's fixed width)
        select = torch.arange(table.shape[1] * bs, device=q.device).expand(t, -1)
    rows = torch.searchsorted(meta.query_start, torch.arange(t, device=q.device), right=True) - 1  # [T]
    sel = select.sort(-1).values  # [T, S]: a repeat next to its first
    first = torch.ones_like(sel, dtype=torch.bool)
    first[:, 1:] = sel[:, 1:] != sel[:, :-1]
    pos = meta.positions[:, None]  # [T, 1]
    blk = table[rows[:, None], (sel.clamp(min=0) // bs).clamp(max=table.shape[1] - 1)]  # [T, S]
    read = first & (sel >= 0) & (sel <= pos) & (sel < meta.kv_lens[rows][:, None]) & (blk >= 0)
    if window is not None:
        read &= sel > pos - window
    slots = blk.clamp(min=0) * bs + sel.clamp(min=0) % bs  # [T, S]
    out = torch.empty_like(q)
    s_len = sel.shape[1]
    step = max(1, CHUNK_BYTES // max(1, s_len * (2 * hk * d * q.element_size() + 8 * h)))
    for a in range(0, t, step):
        b = min(t, a + step)
        keys = k_cache[slots[a:b]].to(q.dtype).repeat_interleave(h // hk, dim=2)  # [Tc, S, H, D]
        vals = v_cache[slots[a:b]].to(q.dtype).repeat_interleave(h // hk, dim=2)
        s = torch.einsum("thd,tshd->ths", q[a:b].float(), keys.float()) * scale  # [Tc, H, S]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        ok = read[a:b, None, :]  # [Tc, 1, S]
        s = s.masked_fill(~ok, float("-inf"))
        if sinks is not None:  # the sink logit joins the softmax, then is dropped
            sink = sinks.float()[None, :, None].expand(b - a, h, 1)
            p = torch.softmax(torch.cat((s, sink), dim=-1), -1)[..., :-1]
        else:
            p = torch.softmax(s.masked_fill(~ok.any(-1, keepdim=True), 0.0), -1)  # no key read: not NaN
        p = torch.where(ok, p, 0.0)  # [Tc, H, S]
        out[a:b] = torch.einsum("ths,tshd->thd", p.to(q.dtype), vals)
    return out
