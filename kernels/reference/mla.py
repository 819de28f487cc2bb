"""Reference multi-head latent attention and the sparse-attention indexers (DSA, pooled).

Each loops over rows and gathers the row's cached positions (`row_slots`); a selection is a
[T, K] tensor of key positions, -1 where a slot is unused.
"""

from __future__ import annotations

import torch

from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.reference.attention import row_slots
from dayzero.kernels.registry import register


def _rows(meta: PagedMeta):
    """(row, first token, end token, kv_len) for every row with tokens in this step."""
    qs = meta.query_start_cpu
    for r in range(len(qs) - 1):
        if qs[r + 1] > qs[r]:
            yield r, qs[r], qs[r + 1], meta.kv_lens_cpu[r]


@register("mla_attention", "reference")
def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    select: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over the compressed latent, keys and values expanded per row.

    cache [N, L + Dr] holds c (the normed latent, L) and k_r (the roped shared key, Dr) per token;
    w_k [H, Dn, L], w_v [H, Dv, L] are the up-projections (kv_b split per head). For query t at
    position p_t and key position j:
        k[j, h] = [w_k[h] c_j ; k_r[j]]        v[j, h] = w_v[h] c_j
        s[t, h, j] = scale * <[q_nope[t, h] ; q_rope[t, h]], k[j, h]>
        allowed iff j <= p_t and (select is None or j in select[t])
        out[t, h] = sum_j softmax_j(s)[j] v[j, h]      (scores and softmax fp32; 0 if none allowed)
    q_nope [T, H, Dn], q_rope [T, H, Dr] (Dr may be 0) -> [T, H, Dv].
    """
    lat = w_k.shape[-1]
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_v.shape[1])
    for r, a, b, kv_len in _rows(meta):
        pos_k, slots = row_slots(meta, r, 0, kv_len)
        rows = cache[slots].to(q_nope.dtype)  # [L_kv, L + Dr]
        c, k_r = rows[:, :lat], rows[:, lat:]
        k_nope = torch.einsum("jl,hdl->jhd", c, w_k)  # [L_kv, H, Dn]
        v = torch.einsum("jl,hdl->jhd", c, w_v)  # [L_kv, H, Dv]
        s = torch.einsum("thd,jhd->htj", q_nope[a:b].float(), k_nope.float())
        if k_r.shape[1]:
            s = s + torch.einsum("thd,jd->htj", q_rope[a:b].float(), k_r.float())
        s = s * scale
        allowed = pos_k[None, :] <= meta.positions[a:b, None]  # [n, L_kv]
        if select is not None:
            allowed &= (select[a:b, :, None] == pos_k[None, None, :]).any(1)
        s = s.masked_fill(~allowed[None], float("-inf"))
        p = torch.softmax(s, dim=-1).masked_fill(~allowed.any(-1)[None, :, None], 0.0)  # none allowed: 0
        out[a:b] = torch.einsum("htj,jhd->thd", p.to(q_nope.dtype), v)
    return out


def _topk_positions(score: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """score [n, L] (-inf where not allowed), pos [L] -> the positions of the k best [n, k], -1
    where fewer than k are allowed."""
    width = min(k, score.shape[1])
    best, idx = score.topk(width, dim=-1)
    out = torch.where(torch.isfinite(best), pos[idx], -1)
    return torch.nn.functional.pad(out, (0, k - width), value=-1)


@register("dsa_index", "reference")
def dsa_index(
    q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, meta: PagedMeta, topk: int, scale: float
) -> torch.Tensor:
    """The lightning indexer's selection (DeepSeek sparse attention).

    I[t, j] = sum_h weights[t, h] * relu(scale * <q[t, h], k[j]>)    over cached j <= p_t (fp32)
    returns the positions of the top-k I[t, :] ([T, topk], -1 padded when fewer are visible).
    q [T, Hi, Di], weights [T, Hi] fp32, k_cache [N, Di].
    """
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    for r, a, b, kv_len in _rows(meta):
        pos_k, slots = row_slots(meta, r, 0, kv_len)
        keys = k_cache[slots].float()  # [L, Di]
        s = torch.relu(torch.einsum("thd,ld->thl", q[a:b].float(), keys) * scale)
        score = torch.einsum("th,thl->tl", weights[a:b].float(), s)
        score = score.masked_fill(pos_k[None, :] > meta.positions[a:b, None], float("-inf"))
        out[a:b] = _topk_positions(score, pos_k, topk)
    return out


@register("kpool_index", "reference")
def kpool_index(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    ape: torch.Tensor,
    meta: PagedMeta,
    topk: int,
    pool: int,
    scale: float,
    tail: bool = True,
) -> torch.Tensor:
    """The pooled (KPool) indexer: scores groups of `pool` consecutive keys, not single keys.

    cache [N, 2 Di] holds k (the index key) and g (its pooling gate) per token. Complete pool m
    covers positions [m P, (m + 1) P); its key is
        K_m = sum_{i < P} softmax_i(g[mP + i] + ape[i]) * k[mP + i]      (softmax per channel)
    I[t, m] = sum_h weights[t, h] * relu(scale * <q[t, h], K_m>), over pools ending at or before
    p_t; the topk / P best pools' positions are selected, plus (tail) the positions of the
    query's incomplete pool [P floor((p_t + 1) / P), p_t].
    q [T, Hi, Di], weights [T, Hi] fp32, ape [P, Di] -> [T, topk (+ P - 1)] positions, -1 padded.
    """
    di = q.shape[-1]
    keep = topk // pool
    width = topk + (pool - 1 if tail else 0)
    out = torch.full((q.shape[0], width), -1, dtype=torch.int64, device=q.device)
    for r, a, b, kv_len in _rows(meta):
        n_pools = kv_len // pool
        p_t = meta.positions[a:b]
        if n_pools:
            _, slots = row_slots(meta, r, 0, n_pools * pool)
            rows = cache[slots].view(n_pools, pool, 2 * di)
            keys, gate = rows[..., :di], rows[..., di:]
            prob = torch.softmax(gate.float() + ape.float(), dim=1).to(keys.dtype)  # [M, P, Di]
            pooled = (prob * keys).sum(1)  # [M, Di]
            s = torch.relu(torch.einsum("thd,md->thm", q[a:b].float(), pooled.float()) * scale)
            score = torch.einsum("th,thm->tm", weights[a:b].float(), s)
            ends = torch.arange(n_pools, device=q.device) * pool + pool - 1
            score = score.masked_fill(ends[None, :] > p_t[:, None], float("-inf"))
            best = _topk_positions(score, torch.arange(n_pools, device=q.device), keep)  # [n, keep]
            span = torch.arange(pool, device=q.device)
            toks = torch.where(best[..., None] >= 0, best[..., None] * pool + span, -1)
            out[a:b, :topk] = toks.flatten(1)[:, :topk]
        if tail:
            start = (p_t + 1) // pool * pool  # [n]
            t = start[:, None] + torch.arange(pool - 1, device=q.device)
            out[a:b, topk:] = torch.where(t <= p_t[:, None], t, -1)
    return out
