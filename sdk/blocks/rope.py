"""RoPE frequency tables: the plain kind and YaRN, from an HF `rope_parameters` mapping.

default: inv_freq[j] = theta^(-2j / dim), attention factor 1.
yarn (context extension by `factor` over `original_max_position_embeddings`):
    extrapolated e_j = theta^(-2j / dim), interpolated e_j / factor, blended by a linear ramp
    over the dims between the correction dims of beta_fast and beta_slow rotations;
    attention factor a = m(factor, mscale) / m(factor, mscale_all_dim) (or m(factor) alone),
    m(s, c) = 0.1 c ln(s) + 1 for s > 1 else 1; cos and sin are multiplied by a.
The MLA softmax scale gains m(factor, mscale_all_dim)^2 under yarn (`softmax_mscale`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "yarn")


def _m(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_table(theta: float, dim: int, params: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] fp32, attention factor) for `dim` rotary channels."""
    kind = (params or {}).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported yet; known: {', '.join(ROPE_TYPES)}")
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv = 1.0 / (theta**exps)
    if kind == "default":
        return inv, 1.0
    p = dict(params or {})
    factor, orig = p.get("factor"), p.get("original_max_position_embeddings")
    if factor is None or orig is None:
        raise ValueError("yarn rope_parameters need `factor` and `original_max_position_embeddings`")
    factor = float(factor)
    ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
    attn = p.get("attention_factor")
    if attn is None:
        attn = _m(factor, ms) / _m(factor, ms_all) if ms and ms_all else _m(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def corr(rot: float) -> float:  # the dim at which `rot` full rotations fit the original context
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = corr(fast), corr(slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extra = 1 - ramp  # weight of the extrapolated (unscaled) frequency
    return (inv / factor) * (1 - extra) + inv * extra, float(attn)


def softmax_mscale(params: dict[str, Any] | None) -> float:
    """The factor an MLA softmax scale is multiplied by (yarn with mscale_all_dim), else 1."""
    p = params or {}
    if p.get("rope_type", "default") == "default" or not p.get("mscale_all_dim"):
        return 1.0
    m = _m(float(p["factor"]), float(p["mscale_all_dim"]))
    return m * m
