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
    q_nope [T, H, Dn], q_rope [T, H, Dr] (Dr may be 0) -> [T, H, Dv]. select [T, K]: distinct
    positions per token, -1 unused, in any order (every indexer's selection is; the other
    backends would count a repeated position twice).
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
    """score [n, L] (-inf where not allowed), pos [L] increasing -> the positions of the k best
    [n, k] in increasing order, -1 past the allowed ones when fewer than k are.

    Ties at the k-th best score go to the lowest positions, so the selection does not depend on
    L: columns of -inf appended (a CUDA graph's width, max model length / block size pages, over
    a step's own) change nothing, and tied scores (ReLU zeros) select the same keys at any width:
        c = the k-th best score;  chosen = {j: s_j > c} + the first k - |{s_j > c}| of {j: s_j = c}
    (c = -inf: fewer than k allowed; every allowed j, no tie taken)."""
    n, width = score.shape[1], min(k, score.shape[1])
    if width == 0:
        return torch.full((score.shape[0], k), -1, dtype=torch.long, device=score.device)
    kth = score.topk(width, dim=-1).values[:, -1:]  # [n, 1]
    above = score > kth
    tied = (score == kth) & torch.isfinite(kth)
    chosen = above | (tied & (tied.cumsum(-1) <= width - above.sum(-1, keepdim=True)))  # [n, L]
    col = torch.arange(n, device=score.device)
    first, idx = torch.where(chosen, col, n).topk(width, dim=-1, largest=False)  # chosen columns, in order
    out = torch.where(first < n, pos[idx], -1)
    return torch.nn.functional.pad(out, (0, k - width), value=-1)


def _dsa_row_scores(q, weights, keys, scale):
    """I[t, j] = sum_h weights[t, h] relu(scale <q[t, h], keys[j]>): q [n, Hi, Di], weights
    [n, Hi], keys [L, Di] -> [n, L] fp32."""
    s = torch.relu(torch.einsum("thd,ld->thl", q.float(), keys.float()) * scale)
    return torch.einsum("th,thl->tl", weights.float(), s)


@register("dsa_scores", "reference")
def dsa_scores(
    q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, meta: PagedMeta, scale: float
) -> torch.Tensor:
    """The lightning indexer's scores, by key position (the part of dsa_index before its top-k).

    I[t, j] = sum_h weights[t, h] * relu(scale * <q[t, h], k[j]>)    over cached j <= p_t (fp32)
    q [T, Hi, Di], weights [T, Hi] fp32, k_cache [N, Di] -> [T, L] fp32, L the step's longest
    row, column j key position j, -inf where j is not visible (j > p_t, or past the row). A sum
    over heads: heads split over ranks give partial scores whose sum is the whole one.
    """
    width = max((kv for *_, kv in _rows(meta)), default=0)
    out = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float32, device=q.device)
    for r, a, b, kv_len in _rows(meta):
        pos_k, slots = row_slots(meta, r, 0, kv_len)
        score = _dsa_row_scores(q[a:b], weights[a:b], k_cache[slots], scale)  # [n, L_kv]
        out[a:b, pos_k] = score.masked_fill(pos_k[None, :] > meta.positions[a:b, None], float("-inf"))
    return out


@register("kpool_scores", "reference")
def kpool_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    ape: torch.Tensor,
    meta: PagedMeta,
    pool: int,
    scale: float,
) -> torch.Tensor:
    """The pooled (KPool) indexer's scores, by pool (the part of kpool_index before its top-k).

    cache [N, 2 Di] holds k (the index key) and g (its pooling gate) per token. Complete pool m
    covers positions [m P, (m + 1) P); its key is
        K_m = sum_{i < P} softmax_i(g[mP + i] + ape[i]) * k[mP + i]      (softmax per channel)
    I[t, m] = sum_h weights[t, h] * relu(scale * <q[t, h], K_m>) (fp32)
    q [T, Hi, Di], weights [T, Hi] fp32, ape [P, Di] -> [T, M] fp32, M the step's most complete
    pools of a row, -inf where pool m ends after p_t (or is past the row's).
    """
    di = q.shape[-1]
    width = max((kv // pool for *_, kv in _rows(meta)), default=0)
    out = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float32, device=q.device)
    for r, a, b, kv_len in _rows(meta):
        n_pools = kv_len // pool
        if not n_pools:
            continue
        _, slots = row_slots(meta, r, 0, n_pools * pool)
        rows = cache[slots].view(n_pools, pool, 2 * di)
        keys, gate = rows[..., :di], rows[..., di:]
        prob = torch.softmax(gate.float() + ape.float(), dim=1).to(keys.dtype)  # [M, P, Di]
        score = _dsa_row_scores(q[a:b], weights[a:b], (prob * keys).sum(1), scale)  # [n, M]
        ends = torch.arange(n_pools, device=q.device) * pool + pool - 1
        out[a:b, :n_pools] = score.masked_fill(ends[None, :] > meta.positions[a:b, None], float("-inf"))
    return out


@register("index_topk", "reference", graphs=True)  # shapes from the tensors, no host sync
def index_topk(
    scores: torch.Tensor, positions: torch.Tensor, topk: int, pool: int = 1, tail: bool = False
) -> torch.Tensor:
    """A sparse indexer's selection from its scores: scores [T, M] fp32 over groups of `pool`
    consecutive key positions (column m: positions [m P, (m + 1) P); -inf: not visible; P = 1:
    single keys, DSA), positions [T] the queries' -> the positions of the topk / P best groups
    [T, topk], -1 where fewer are visible; with `tail` + the positions of the query's
    incomplete group [P floor((p_t + 1) / P), p_t] ([T, P - 1] more, -1 padded).
    Query t sees the complete groups before it, m < (p_t + 1) // P: later columns are not read
    (every indexer's scores are -inf there).
    """
    cols = torch.arange(scores.shape[1], device=scores.device)
    seen = cols[None, :] < ((positions + 1) // pool)[:, None]  # [T, M]
    best = _topk_positions(scores.masked_fill(~seen, float("-inf")), cols, topk // pool)
    return expand_groups(best, positions, pool, tail)


def expand_groups(best: torch.Tensor, positions: torch.Tensor, pool: int, tail: bool) -> torch.Tensor:
    """best [T, k] chosen groups (-1 padded), positions [T] -> their key positions [T, k P]
    (+ with `tail` the query's incomplete group's [T, P - 1], -1 padded)."""
    if pool == 1:  # single keys: no span, no incomplete group
        return best
    span = torch.arange(pool, device=best.device)
    out = torch.where(best[..., None] >= 0, best[..., None] * pool + span, -1).flatten(1)  # [T, k P]
    if not tail:
        return out
    t = (positions + 1) // pool * pool
    t = t[:, None] + torch.arange(pool - 1, device=best.device)  # [T, P - 1]
    return torch.cat((out, torch.where(t <= positions[:, None], t, -1)), dim=1)


@register("dsa_index", "reference")
def dsa_index(
    q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, meta: PagedMeta, topk: int, scale: float
) -> torch.Tensor:
    """The lightning indexer's selection (DeepSeek sparse attention): the positions of the top-k
    dsa_scores of each query ([T, topk], -1 padded when fewer are visible).
    q [T, Hi, Di], weights [T, Hi] fp32, k_cache [N, Di].
    """
    return index_topk(dsa_scores(q, weights, k_cache, meta, scale), meta.positions, topk)


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
    """The pooled (KPool) indexer: the topk / P best pools of kpool_scores, each pool's positions,
    plus (tail) the positions of the query's incomplete pool [P floor((p_t + 1) / P), p_t].
    q [T, Hi, Di], weights [T, Hi] fp32, ape [P, Di] -> [T, topk (+ P - 1)] positions, -1 padded.
    """
    scores = kpool_scores(q, weights, cache, ape, meta, pool, scale)
    return index_topk(scores, meta.positions, topk, pool, tail)
