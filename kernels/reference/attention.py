"""Reference paged GQA attention: a loop over rows, each gathering its keys from the cache."""

from __future__ import annotations

import torch

from dayzero.kernels.ops import HeadPrep, PagedMeta
from dayzero.kernels.reference.basic import norm_rope
from dayzero.kernels.registry import register


def row_slots(meta: PagedMeta, r: int, lo: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(key positions [L] = lo..kv_len-1, their cache slots [L]) of row r; a position in a block
    the scheduler freed is an error, never a silent read of someone else's KV."""
    bs = meta.block_size
    pos_k = torch.arange(lo, kv_len, device=meta.block_table.device)
    blocks = meta.block_table[r, pos_k // bs].long()
    if bool((blocks < 0).any()):
        raise RuntimeError(f"row {r}: a key in [{lo}, {kv_len}) lies in a block the scheduler freed")
    return pos_k, blocks * bs + pos_k % bs


@register("cache_write", "reference", graphs=True)
def cache_write(rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """cache[slots[t]] = rows[t]; rows [T, W] (or [T, ..]), cache [N, W]."""
    cache[slots] = rows.reshape(rows.shape[0], -1).to(cache.dtype)


@register("kv_write", "reference", graphs=True)
def kv_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """k_cache[slots[t]] = k[t] for every new token t; k, v [T, Hk, D], caches [N, Hk, D]."""
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)


@register("qk_norm_rope_write", "reference", graphs=True)
def qk_norm_rope_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    prep: HeadPrep,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """q [T, H, D], k, v [T, Hk, D]: q' = norm_rope(q) with the log scaling, k' = norm_rope(k)
    (basic.norm_rope's math), k' and v into their cache slots; returns q'."""
    p = prep
    q = norm_rope(
        q, positions, p.q_weight, p.eps, p.weight_in_fp32, p.inv_freq, p.neox, p.log_scaling, p.rope_factor
    )
    k = norm_rope(k, positions, p.k_weight, p.eps, p.weight_in_fp32, p.inv_freq, p.neox, None, p.rope_factor)
    kv_write(k, v, k_cache, v_cache, slots)
    return q


@register("gqa_attention", "reference")
def gqa_attention(
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
    """Grouped-query attention over paged K/V.

    For query token t at position p_t of row r and key position j < kv_lens[r]:
        s[t, h, j] = scale * <q[t, h], K_r[j, h // (H / Hk)]>     (optionally cap * tanh(s / cap))
        allowed iff j <= p_t and (window is None or j > p_t - window)
                    and (select is None or j in select[t])  (a sparse indexer's [T, K], -1 padded)
        out[t, h] = sum_j softmax_j(s[t, h, :])[j] * V_r[j, h // (H / Hk)]
    With sinks [H] (learned per-head logits, gpt-oss): the softmax's denominator also holds
    exp(sinks[h]), a key that is always visible and has no value:
        out[t, h] = sum_j exp(s_j) V_r[j] / (exp(sinks[h]) + sum_j exp(s_j))
    Scores and softmax in fp32; the probabilities are cast to q's dtype before the V product.
    q [T, H, D], caches [N, Hk, D] -> [T, H, D].
    """
    out = torch.empty_like(q)
    h, hk = q.shape[1], k_cache.shape[1]
    qs = meta.query_start_cpu
    for r in range(len(qs) - 1):
        a, b = qs[r], qs[r + 1]
        if a == b:
            continue
        kv_len = meta.kv_lens_cpu[r]
        first = kv_len - (b - a)  # position of the row's first query
        lo = 0 if window is None else max(0, first - window + 1)
        pos_k, slots = row_slots(meta, r, lo, kv_len)
        keys = k_cache[slots].to(q.dtype).repeat_interleave(h // hk, dim=1)  # [L, H, D]
        vals = v_cache[slots].to(q.dtype).repeat_interleave(h // hk, dim=1)
        s = torch.einsum("thd,lhd->htl", q[a:b].float(), keys.float()) * scale  # [H, n, L]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        pos_q = meta.positions[a:b]
        allowed = pos_k[None, :] <= pos_q[:, None]
        if window is not None:
            allowed &= pos_k[None, :] > pos_q[:, None] - window
        if select is not None:
            allowed &= (select[a:b, :, None] == pos_k[None, None, :]).any(1)
        s = s.masked_fill(~allowed[None], float("-inf"))
        if sinks is not None:  # one more logit per head and query, dropped after the softmax
            sink = sinks.float()[:, None, None].expand(h, b - a, 1)
            p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1].to(q.dtype)
        else:
            p = torch.softmax(s, dim=-1).to(q.dtype)
        out[a:b] = torch.einsum("htl,lhd->thd", p, vals)
    return out
