"""Reference per-layer n-gram embedding ops: hashed n-gram ids from each row's token history,
and the dilated causal depthwise conv that follows them, both continuing the row's state."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.kernels.reference.linear_attention import _rows
from dayzero.kernels.registry import register


def shifted_tokens(tokens: torch.Tensor, n: int, eos: int) -> torch.Tensor:
    """tokens [L] (a row's history then its new tokens) -> [n, L]: row s holds, at t, the token
    s places back, tok[t - s], or eos when an eos lies in tok[t - s .. t - 1] (the n-gram does
    not reach across a document boundary) or t - s < 0."""
    out = tokens.new_full((n, tokens.shape[0]), eos)
    out[0] = tokens
    is_eos = tokens == eos
    blocked = torch.zeros_like(is_eos)  # [L]: an eos in tok[t - s .. t - 1]
    for s in range(1, n):
        blocked[s:] |= is_eos[:-s]
        out[s, s:] = torch.where(blocked[s:], eos, tokens[:-s])
    return out


@register("ngram_ids", "reference")
def ngram_ids(
    ids: torch.Tensor,
    history: torch.Tensor,
    multipliers: torch.Tensor,
    sizes: torch.Tensor,
    offsets: torch.Tensor,
    heads_per_ngram: int,
    eos: int,
    meta,
) -> torch.Tensor:
    """Hashed n-gram ids of each token, continuing each row's token history.

    ids [T] int64; history [slots, n - 1] int64, each row's last n - 1 tokens (eos for a row
    starting at position 0); multipliers [n] odd int64; sizes, offsets [(n - 1) Hg] int64 (Hg =
    heads_per_ngram hashed heads per order). With sh_s(t) the token s places back
    (`shifted_tokens`), the order-k id (k = 2..n) for head j of its Hg:
        h_k(t) = xor_{s < k} sh_s(t) * m_s                     (int64; no overflow: m_s < 2^63 / V)
        id[t, (k - 2) Hg + j] = h_k(t) mod sizes[.] + offsets[.]
    -> [T, (n - 1) Hg] int64; history[slot] <- the row's last n - 1 tokens.
    """
    n = multipliers.shape[0]
    out = ids.new_empty(ids.shape[0], sizes.shape[0])
    for slot, has_init, a, b in _rows(meta):
        prev = history[slot] if has_init else history.new_full((n - 1,), eos)
        seq = torch.cat((prev, ids[a:b]))  # [n - 1 + L]
        sh = shifted_tokens(seq, n, eos)[:, n - 1 :] * multipliers[:, None]  # [n, L]
        mixed = sh[0]
        for k in range(2, n + 1):
            mixed = torch.bitwise_xor(mixed, sh[k - 1])  # h_k: orders 2..k
            cols = slice((k - 2) * heads_per_ngram, (k - 1) * heads_per_ngram)
            out[a:b, cols] = torch.remainder(mixed[:, None], sizes[cols]) + offsets[cols]
        history[slot] = seq[seq.shape[0] - (n - 1) :]
    return out


@register("dilated_conv", "reference")
def dilated_conv(
    x: torch.Tensor, weight: torch.Tensor, dilation: int, state: torch.Tensor, meta
) -> torch.Tensor:
    """y[t, c] = silu(sum_{i < K} w[c, i] * x[t - (K - 1 - i) d, c]), continuing the row's state.

    x [T, C]; weight [C, 1, K]; state [slots, C, (K - 1) d] holds each row's last (K - 1) d
    inputs (zeros for a row starting at position 0). Returns [T, C] in x's dtype.
    """
    out = torch.empty_like(x)
    span = (weight.shape[-1] - 1) * dilation
    for slot, has_init, a, b in _rows(meta):
        prev = state[slot] if has_init else torch.zeros_like(state[slot])  # [C, (K - 1) d]
        seq = torch.cat((prev.to(x.dtype), x[a:b].t()), dim=1)  # [C, (K - 1) d + n]
        y = F.conv1d(seq[None].to(weight.dtype), weight, groups=seq.shape[0], dilation=dilation)[0]
        out[a:b] = F.silu(y).t().to(x.dtype)
        state[slot] = seq[:, seq.shape[1] - span :].to(state.dtype)
    return out
