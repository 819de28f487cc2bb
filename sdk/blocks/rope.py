"""RoPE frequency tables from an HF `rope_parameters` (or legacy `rope_scaling`) mapping.

default: inv_freq[j] = e_j = theta^(-2j / dim), attention factor 1.
linear: e_j / factor.
dynamic (NTK): e_j while positions stay within max_position_embeddings, which is all a served
    request reaches (transformers rescales only past it).
llama3: wavelength w_j = 2 pi / e_j; e_j / factor where w_j > L / low_freq_factor, e_j where
    w_j < L / high_freq_factor, between them (1 - s) e_j / factor + s e_j with
    s = (L / w_j - low_freq_factor) / (high_freq_factor - low_freq_factor),
    L = original_max_position_embeddings.
longrope: e_j / f_j with f = long_factor when the model's context (max_position_embeddings)
    exceeds L, else short_factor (one choice per model: transformers picks per forward pass
    by the sequence's length, which a KV cache cannot follow); attention factor
    sqrt(1 + ln(factor) / ln(L)), factor = max_position_embeddings / L (or given).
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

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "longrope", "yarn")


def _m(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_kind(params: dict[str, Any] | None) -> str:
    p = params or {}
    return str(p.get("rope_type") or p.get("type") or "default")


ORIGINAL_CONTEXT_TYPES = ("llama3", "longrope", "yarn")  # the types transformers gives the key


def with_original_context(params: dict[str, Any], orig: int) -> dict[str, Any]:
    """params with original_max_position_embeddings = orig where its type reads one: a config's
    top-level original_max_position_embeddings (Phi-3's) wins over the mapping's, as in
    transformers' standardize_rope_params."""
    if rope_kind(params) not in ORIGINAL_CONTEXT_TYPES:
        return params
    return params | {"original_max_position_embeddings": orig}


def _need(p: dict[str, Any], kind: str, *keys: str) -> list:
    if missing := [k for k in keys if p.get(k) is None]:
        raise ValueError(f"{kind} rope_parameters need {', '.join(missing)}")
    return [p[k] for k in keys]


def rope_table(
    theta: float, dim: int, params: dict[str, Any] | None, max_position: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] fp32, attention factor) for `dim` rotary channels; max_position: the
    model's max_position_embeddings (longrope, yarn without a factor)."""
    kind = rope_kind(params)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope type {kind!r} is not supported yet; known: {', '.join(ROPE_TYPES)}")
    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv = 1.0 / (theta**exps)
    p = dict(params or {})
    if kind in ("default", "dynamic"):
        return inv, 1.0
    if kind == "linear":
        return inv / float(_need(p, kind, "factor")[0]), 1.0
    if kind == "llama3":
        factor, low, high, orig = (float(v) for v in _need(
            p, kind, "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"
        ))  # fmt: skip
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > orig / low, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        mid = (wavelen >= orig / high) & (wavelen <= orig / low)
        return torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled), 1.0
    if kind == "longrope":
        long, short, orig = _need(p, kind, "long_factor", "short_factor", "original_max_position_embeddings")
        ctx = max_position or orig
        ext = torch.tensor(long if ctx > orig else short, dtype=torch.float32)
        if ext.numel() != dim // 2:
            raise ValueError(f"longrope factors have {ext.numel()} entries; the rotary dims need {dim // 2}")
        factor = float(p.get("factor") or ctx / orig)
        attn = p.get("attention_factor")
        if attn is None:
            attn = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        return inv / ext, float(attn)
    factor, orig = p.get("factor"), p.get("original_max_position_embeddings")
    if factor is None and orig is not None and max_position:
        factor = max_position / orig
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
    if rope_kind(p) != "yarn" or not p.get("mscale_all_dim"):
        return 1.0
    m = _m(float(p["factor"]), float(p["mscale_all_dim"]))
    return m * m
