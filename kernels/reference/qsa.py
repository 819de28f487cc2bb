"""Reference QSA indexer (Qwen4-Exp's sparse attention): the pooled key of each block of P
positions, formed once when the block completes (`qsa_pool`), and each query's scores over its
row's pooled keys (`qsa_scores`). The selection is `index_topk` (pool, tail)."""

from __future__ import annotations

import torch

from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.reference.attention import row_slots
from dayzero.kernels.reference.basic import rms_norm, rope
from dayzero.kernels.reference.mla import _rows
from dayzero.kernels.registry import register


def pooled_keys(
    raw: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor | None,
    neox: bool,
    starts: torch.Tensor,
) -> torch.Tensor:
    """raw [M, P, Di] (each block's raw keys), starts [M] (its first positions) -> [M, Di]:
        K_m = rope(rmsnorm(mean_{i < P} k[m P + i]) w_k, position m P)
    the mean in fp32 rounded to the keys' dtype, the norm's w_k as the op multiplies by it (fp32),
    RoPE on the first 2 len(inv_freq) channels (none with inv_freq None); each stage rounded to
    the keys' dtype, as transformers' Qwen4ExpTextQSAIndexer."""
    keys = rms_norm(raw.float().mean(1).to(raw.dtype), k_weight, eps, True)  # [M, Di]
    if inv_freq is None:
        return keys
    return rope(keys[:, None, :], starts, inv_freq, neox)[:, 0]


@register("qsa_pool", "reference")
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
    """Write the pooled key of every block of `pool` positions that this step completes.

    raw [N, Di]: the raw index keys k_j (this step's already written; a sliding group of window
    P holds the ones a block still needs), raw_meta its rows; pooled [N', r], r = ceil(Di / P)
    (kernels/ops.py `qsa_row`), meta its rows. Block m completes when its last position m P + P - 1
    is among the step's tokens; K_m (`pooled_keys`) goes to the rows of positions m P + i,
    channels [i r, (i + 1) r), zeros past Di.
    """
    di, r = raw.shape[1], pooled.shape[1]
    n = -(-di // r)  # positions of a block that hold its key's channels
    for row, a, b, kv_len in _rows(meta):
        first = kv_len - (b - a)
        blocks = torch.arange(first // pool, kv_len // pool, device=raw.device)  # ending in [first, kv_len)
        if not len(blocks):
            continue
        lo = int(blocks[0]) * pool
        _, raw_slots = row_slots(raw_meta, row, lo, kv_len // pool * pool)
        keys = raw[raw_slots].view(len(blocks), pool, di)  # [M, P, Di]
        keys = pooled_keys(keys, k_weight, eps, inv_freq, neox, blocks * pool)
        keys = torch.nn.functional.pad(keys, (0, n * r - di)).view(len(blocks), n, r)
        for m, key in zip(blocks.tolist(), keys, strict=True):
            _, slots = row_slots(meta, row, m * pool, m * pool + n)
            pooled[slots] = key.to(pooled.dtype)


def unspread(pooled: torch.Tensor, slots: torch.Tensor, pool: int, di: int) -> torch.Tensor:
    """The pooled keys [M, Di] of blocks whose positions' slots are `slots` [M P] (`qsa_row`)."""
    return pooled[slots].reshape(-1, pool * pooled.shape[1])[:, :di]


@register("qsa_scores", "reference")
def qsa_scores(
    q: torch.Tensor, pooled: torch.Tensor, meta: PagedMeta, pool: int, scale: float
) -> torch.Tensor:
    """The QSA indexer's scores, by block of `pool` positions.

    pooled [N, r] holds each complete block's key K_m spread over its positions (`qsa_pool`).
        I[t, m] = sum_h relu(<q[t, h], K_m>) * scale      (fp32)
    q [T, Hi, Di] (normed and roped) -> [T, M] fp32, M the step's most complete blocks of a row,
    -inf where block m ends after p_t (or is past the row's).
    """
    di = q.shape[-1]
    width = max((kv // pool for *_, kv in _rows(meta)), default=0)
    out = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float32, device=q.device)
    for r, a, b, kv_len in _rows(meta):
        blocks = kv_len // pool
        if not blocks:
            continue
        _, slots = row_slots(meta, r, 0, blocks * pool)
        keys = unspread(pooled, slots, pool, di)  # [M, Di]
        score = torch.relu(torch.einsum("thd,md->tmh", q[a:b].float(), keys.float())).sum(-1) * scale
        ends = torch.arange(blocks, device=q.device) * pool + pool - 1
        out[a:b, :blocks] = score.masked_fill(ends[None, :] > meta.positions[a:b, None], float("-inf"))
    return out
