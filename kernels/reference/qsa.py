"""Reference QSA indexer scores (Qwen4-Exp's sparse attention): each query's scores over the
mean-pooled blocks of its row's cached index keys. The selection is `index_topk` (pool, tail)."""

from __future__ import annotations

import torch

from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.reference.attention import row_slots
from dayzero.kernels.reference.basic import rms_norm, rope
from dayzero.kernels.reference.mla import _rows
from dayzero.kernels.registry import register


@register("qsa_scores", "reference")
def qsa_scores(
    q: torch.Tensor,
    cache: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor | None,
    neox: bool,
    meta: PagedMeta,
    pool: int,
    scale: float,
) -> torch.Tensor:
    """The QSA indexer's scores, by block of `pool` keys.

    cache [N, Di] holds each token's raw index key k. Complete block m covers positions
    [m P, (m + 1) P); its key is
        K_m = rope(rmsnorm(mean_{i < P} k[m P + i]) w_k, position m P)
    (the mean in fp32, rounded to the cache dtype; the norm's w_k as the op multiplies by it, in
    fp32; RoPE on the first 2 len(inv_freq) channels, none with inv_freq None)
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
        keys = cache[slots].view(blocks, pool, di).float().mean(1).to(cache.dtype)  # [M, Di]
        keys = rms_norm(keys, k_weight, eps, True)[:, None, :]  # [M, 1, Di]
        if inv_freq is not None:
            starts = torch.arange(blocks, device=q.device) * pool
            keys = rope(keys, starts, inv_freq, neox)
        score = torch.relu(torch.einsum("thd,md->tmh", q[a:b].float(), keys[:, 0].float())).sum(-1) * scale
        ends = torch.arange(blocks, device=q.device) * pool + pool - 1
        out[a:b, :blocks] = score.masked_fill(ends[None, :] > meta.positions[a:b, None], float("-inf"))
    return out
