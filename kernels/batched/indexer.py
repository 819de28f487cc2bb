"""The sparse-attention indexers (DSA, KPool, QSA) vectorised over rows, over a width fixed by the
block table: what a CUDA graph's decode step needs (the Triton indexer's contract,
kernels/triton/indexer.py), in torch, on any device.

The scores are [T, W B] by key position (or [T, W B / P] by pool), W the block table's width and
B the block size: under a captured graph, max model length / block size pages whatever the
step's context lengths, so one capture serves every length. Column j of token t (row r, position
p_t) is visible iff j <= p_t, j < kv_len[r] and j's block is held; every other column is -inf
(the reference's scores, then -inf: the same top-k, `index_topk` being independent of the
width). Only device tensors are read (the rows from query_start, the lengths, the block table);
no host copy, no sync: graph-safe.

DSA:   I[t, j] = sum_h w[t, h] relu(scale <q[t, h], k_j>)                            (fp32)
KPool: K_m = sum_{i < P} softmax_i(g[mP + i] + ape[i]) k[mP + i]   (per channel),
       I[t, m] = sum_h w[t, h] relu(scale <q[t, h], K_m>),  pool m complete and m P + P - 1 <= p_t
QSA:   K_m = rope(rmsnorm(mean_{i < P} k[mP + i]) w_k, mP), formed once as block m completes
       (`qsa_pool`) and read back from the pooled cache,  I[t, m] = scale sum_h relu(<q[t, h], K_m>)
Memory: the rows' keys [R, W B, Di] (and gates; QSA's pooled [R, W B / P, Di]), the scores of a
chunk of tokens [Tc, Hi, W B] with Tc from CHUNK_BYTES.
"""

from __future__ import annotations

import torch

from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.reference.mla import index_topk
from dayzero.kernels.reference.qsa import pooled_keys, unspread
from dayzero.kernels.registry import Capabilities, register

CHUNK_BYTES = 64 << 20  # the scores' intermediates per token chunk, at most (about)
_CAPS = dict(priority=5, graphs=True)


def _layout(meta: PagedMeta, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row of each token [T], cache slot of each key column [R, W B], visible [T, W B])."""
    bs, table = meta.block_size, meta.block_table
    dev = table.device
    rows = torch.searchsorted(meta.query_start, torch.arange(t, device=dev), right=True) - 1  # [T]
    j = torch.arange(table.shape[1] * bs, device=dev)  # [W B]
    blk = table[:, j // bs].long()  # [R, W B]
    slots = blk.clamp(min=0) * bs + j % bs
    held = (blk >= 0) & (j[None, :] < meta.kv_lens[:, None])  # [R, W B]
    visible = held[rows] & (j[None, :] <= meta.positions[:, None])  # [T, W B]
    return rows, slots, visible


def _scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, scale: float):
    """sum_h weights[t, h] relu(scale <q[t, h], keys[rows[t], j]>): q [T, Hi, Di], weights [T, Hi],
    keys [R, L, Di] -> [T, L] fp32, in token chunks."""
    t, hi, di = q.shape
    length = keys.shape[1]
    out = torch.empty(t, length, dtype=torch.float32, device=q.device)
    step = max(1, CHUNK_BYTES // max(1, 4 * length * (hi + di)))
    kf = keys.float()
    for a in range(0, t, step):
        b = min(t, a + step)
        s = torch.relu(torch.einsum("thd,tld->thl", q[a:b].float(), kf[rows[a:b]]) * scale)  # [Tc, Hi, L]
        out[a:b] = torch.einsum("th,thl->tl", weights[a:b].float(), s)
    return out


@register("dsa_scores", "batched", Capabilities(**_CAPS))
def dsa_scores(
    q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, meta: PagedMeta, scale: float
) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi] fp32, k_cache [N, Di] -> [T, W B] fp32 scores by key
    position, -inf where a position is not visible."""
    t = q.shape[0]
    rows, slots, visible = _layout(meta, t)
    keys = k_cache[slots]  # [R, W B, Di]
    return _scores(q, weights, keys, rows, scale).masked_fill(~visible, float("-inf"))


@register("kpool_scores", "batched", Capabilities(**_CAPS))
def kpool_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    ape: torch.Tensor,
    meta: PagedMeta,
    pool: int,
    scale: float,
) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi] fp32, cache [N, 2 Di] rows [k ; g], ape [P, Di] -> [T, W B / P]
    fp32 scores by pool, -inf where a pool is not complete before the query."""
    t, di = q.shape[0], q.shape[-1]
    rows, slots, visible = _layout(meta, t)
    m = slots.shape[1] // pool
    slots, visible = slots[:, : m * pool], visible[:, : m * pool]
    kv = cache[slots].view(slots.shape[0], m, pool, 2 * di)  # [R, M, P, 2 Di]
    keys, gate = kv[..., :di], kv[..., di:]
    prob = torch.softmax(gate.float() + ape.float(), dim=2).to(keys.dtype)  # [R, M, P, Di]
    pooled = (prob * keys).sum(2)  # [R, M, Di]
    # a pool is visible when its last position is (positions before it are then visible too)
    seen = visible.view(t, m, pool)[..., -1]  # [T, M]
    return _scores(q, weights, pooled, rows, scale).masked_fill(~seen, float("-inf"))


@register("dsa_index", "batched", Capabilities(**_CAPS))
def dsa_index(
    q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, meta: PagedMeta, topk: int, scale: float
) -> torch.Tensor:
    """The lightning indexer's selection [T, topk] (kernels/reference `dsa_index`)."""
    return index_topk(dsa_scores(q, weights, k_cache, meta, scale), meta.positions, topk)


@register("kpool_index", "batched", Capabilities(features=frozenset({"tail"}), **_CAPS))
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
    """The pooled indexer's selection [T, topk (+ P - 1)] (kernels/reference `kpool_index`)."""
    scores = kpool_scores(q, weights, cache, ape, meta, pool, scale)
    return index_topk(scores, meta.positions, topk, pool, tail)


@register("qsa_pool", "batched", Capabilities(**_CAPS))
def qsa_pool(
    raw: torch.Tensor,
    raw_meta: PagedMeta,
    pooled: torch.Tensor,
    meta: PagedMeta,
    k_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor | None,
    neox: bool,
    pool: int,
) -> None:
    """The pooled key of every block this step completes (kernels/reference `qsa_pool`): a token
    at position p_t with (p_t + 1) % P == 0 forms its block's key from the raw keys of positions
    p_t - P + 1 .. p_t. At most M = T // P + R tokens of a step complete a block (a row of n
    tokens completes at most n // P + 1): the completing ones are sorted first and M tokens taken,
    those among them that complete nothing writing to the group's scratch slot (meta.scratch), so
    the shapes stay fixed and the work is M P Di, not T P Di."""
    if meta.scratch < 0:
        raise ValueError("qsa_pool/batched sends the tokens that complete no block to a scratch slot: none")
    t, di, r = meta.positions.shape[0], raw.shape[1], pooled.shape[1]
    n, bs, dev = -(-di // r), meta.block_size, raw.device
    rows = torch.searchsorted(meta.query_start, torch.arange(t, device=dev), right=True) - 1  # [T]
    done = ((meta.positions + 1) % pool == 0) & (meta.positions < meta.kv_lens[rows])  # [T]
    m = min(t, t // pool + meta.query_start.shape[0] - 1)
    if m == 0:
        return
    pick = torch.argsort((~done).to(torch.int32), stable=True)[:m]  # [M] the completing tokens first
    rows, pos, done, t = rows[pick], meta.positions[pick], done[pick], m
    start = (pos + 1 - pool).clamp(min=0)  # [T] that block's first position
    j = torch.minimum(start[:, None] + torch.arange(pool, device=dev), pos[:, None])  # [T, P] held
    blk = raw_meta.block_table[rows[:, None], j // bs].long().clamp(min=0)
    keys = pooled_keys(raw[blk * bs + j % bs], k_weight, eps, inv_freq, neox, start)  # [T, Di]
    keys = torch.nn.functional.pad(keys, (0, n * r - di)).view(t * n, r).to(pooled.dtype)
    j = torch.minimum(start[:, None] + torch.arange(n, device=dev), pos[:, None])  # [T, n] K_m's rows
    slots = meta.block_table[rows[:, None], j // bs].long().clamp(min=0) * bs + j % bs
    pooled[torch.where(done[:, None], slots, meta.scratch).view(-1)] = keys


@register("qsa_scores", "batched", Capabilities(**_CAPS))
def qsa_scores(
    q: torch.Tensor, pooled: torch.Tensor, meta: PagedMeta, pool: int, scale: float
) -> torch.Tensor:
    """The QSA indexer's scores by block of `pool` positions (kernels/reference `qsa_scores`) over
    the block table's width: q [T, Hi, Di] (normed and roped), pooled [N, r] the blocks' keys
    spread over their positions (kernels/ops.py `qsa_row`) -> [T, W B / P] fp32, -inf where a
    block is not complete before the query.

        I[t, m] = scale sum_h relu(<q[t, h], K_m>)
    """
    t, di = q.shape[0], q.shape[-1]
    rows, slots, visible = _layout(meta, t)
    m = slots.shape[1] // pool
    slots, visible = slots[:, : m * pool], visible[:, : m * pool]
    keys = unspread(pooled, slots.reshape(-1), pool, di).view(slots.shape[0], m, di)  # [R, M, Di]
    seen = visible.view(t, m, pool)[..., -1]  # [T, M]: the block's last position is visible
    ones = torch.ones(q.shape[:2], dtype=torch.float32, device=q.device)  # [T, Hi]: heads summed
    return _scores(q, ones, keys, rows, scale).masked_fill(~seen, float("-inf"))
