"""RoPE scaling from GGUF: llama.cpp's `rope_freqs.weight` back to HF llama3 `rope_parameters`.

llama.cpp's convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors) stores a Llama 3.1 / 3.2
rope_scaling as no metadata at all, only the tensor `rope_freqs.weight` [rotary dims / 2], fp32:
per frequency e_j = theta^(-2j / dim), wavelength w_j = 2 pi / e_j, the divisor

    d_j = 1                            where w_j < L / high_freq_factor
    d_j = factor                       where w_j > L / low_freq_factor
    d_j = 1 / ((1 - s) / factor + s)   between, s = (L / w_j - low_freq_factor) / (high - low)

(L = original_max_position_embeddings; llama.cpp's runtime rotates by e_j / d_j). transformers'
GGUF loader drops the tensor. Here it is read back into the llama3 parameters of
sdk/blocks/rope.py, and the table those serve is checked against e_j / d_j.

The divisors fix `factor` (the plateau) and the two wavelength thresholds L / low_freq_factor and
L / high_freq_factor; the table depends on nothing else, so L itself is not in the tensor: it is
taken from `{arch}.rope.scaling.original_context_length` when the file has it, else chosen so that
low_freq_factor is 1 (Meta's value for every Llama 3.x: the thresholds then give back L and
high_freq_factor exactly). With fewer than two frequencies between the thresholds, the thresholds
are bounded but not fixed; the ratio high / low = 4 (Meta's) is taken where the divisors allow it.
Divisors no llama3 parameters reproduce are refused, naming the tensor.

The convert script reads L from the top level of config.json (default 8192), not from
rope_scaling: Meta's Llama 3.x state none there and get 8192, their rope_scaling's own value. A
checkpoint whose rope_scaling states another L is converted with 8192 anyway; the file then holds
what llama.cpp serves, and that is what is read back here.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dayzero.sdk.blocks.rope import rope_table

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's LLM_TENSOR_ROPE_FREQS
SAME = 1e-6  # relative: a divisor equal to 1 or to the plateau (llama.cpp stores both exactly)
MATCH = 1e-5  # relative: largest |served / (e_j / d_j) - 1| accepted (measured: 0 on the Llama 3.1 /
# 3.2 shapes, at most 7e-7 on shapes whose thresholds the divisors leave open)
META_RATIO = 4.0  # high_freq_factor / low_freq_factor of every Meta Llama 3.x


def _nice(v: float) -> float:
    """v rounded to 6 significant digits (3.9999998 -> 4.0): the parameters as a config states them."""
    return float(f"{v:.6g}")


def _thresholds(x: np.ndarray, d: np.ndarray, factor: float) -> tuple[float, float]:
    """(low / L, high / L): the inverse wavelengths x = 1 / w where the divisor leaves the plateau
    and where it reaches 1. Plateau entries need x <= low / L, ones x >= high / L, and between
    them s = (x - low / L) / (high / L - low / L) is read off each divisor."""
    one, flat = d <= 1 + SAME, d >= factor * (1 - SAME)
    mid = ~one & ~flat
    s = (1 / d[mid] - 1 / factor) / (1 - 1 / factor)
    xm = x[mid]
    if xm.size >= 2:  # x = lo + s (hi - lo): a line through the (s, x) pairs
        if np.ptp(s) == 0:  # equal divisors at different frequencies: no line
            return math.nan, math.nan
        slope, lo = np.polyfit(s, xm, 1)
        return float(lo), float(lo + slope)
    a = float(x[flat].max())  # lo >= a
    b = float(x[one].min()) if one.any() else math.inf  # hi <= b
    if xm.size == 1:
        x1, s1 = float(xm[0]), float(s[0])
        lo = x1 / (1 + (META_RATIO - 1) * s1)
        if a <= lo and META_RATIO * lo <= b:
            return lo, META_RATIO * lo
        w = 0.5 * min((x1 - a) / s1, (b - x1) / (1 - s1))  # any width inside the bounds
        return x1 - s1 * w, x1 + (1 - s1) * w
    lo = math.sqrt(a * b / META_RATIO) if math.isfinite(b) else 2 * a
    if a <= lo and META_RATIO * lo <= b:
        return lo, META_RATIO * lo
    return a + (b - a) / 3, a + 2 * (b - a) / 3


def llama3_from_rope_freqs(
    divisors: torch.Tensor, theta: float, original: int | None, where: str
) -> dict[str, str | float] | None:
    """The llama3 rope parameters whose table is e_j / divisors_j (rope_type, factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings); linear when every
    divisor is the same, None when every divisor is 1 (plain RoPE). `original`: the file's
    original context length, if it states one. Raises ValueError naming `where` and the tensor
    when no llama3 parameters reproduce the divisors."""
    bad = f"{where}: tensor {ROPE_FREQS}"
    d = divisors.double().flatten().numpy()
    if not np.isfinite(d).all() or d.min() <= 0:
        raise ValueError(f"{bad}: RoPE frequency divisors must be finite and positive")
    if (d == 1).all():
        return None
    if d.min() < 1 - SAME:
        raise ValueError(
            f"{bad}: a divisor below 1 ({d.min():.6g}); llama3 rope scaling only divides frequencies "
            "by 1 to `factor`"
        )
    factor = float(d.max())
    if (d >= factor * (1 - SAME)).all():  # every frequency divided alike: linear scaling
        return {"rope_type": "linear", "factor": factor}
    inv, _ = rope_table(theta, 2 * d.size, None)
    want = inv.double().numpy() / d  # what llama.cpp rotates by
    lo, hi = _thresholds(inv.double().numpy() / (2 * math.pi), d, factor)
    worst = (math.inf, 0)
    if 0 < lo < hi:
        length = float(original) if original else 1 / lo
        tries = []  # as a config would state them (L an integer, 6 digits), then unrounded
        if abs(length - round(length)) <= 1e-4 * length:
            n = round(length)
            tries.append((n, _nice(lo * n), _nice(hi * n), _nice(factor)))
        tries.append((length, lo * length, hi * length, factor))
        for length, low, high, f in tries:
            params = {
                "rope_type": "llama3",
                "factor": f,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": length,
            }
            served, _ = rope_table(theta, 2 * d.size, params)
            err = np.abs(served.double().numpy() / want - 1)
            if err.max() <= MATCH:
                return params
            worst = min(worst, (float(err.max()), int(err.argmax())))
    if math.isfinite(worst[0]):
        j, why = worst[1], f"the closest llama3 parameters are off by {worst[0]:.2g} (relative) there"
    else:
        j, why = int(np.argmax(d != 1)), "no llama3 thresholds fit"
    raise ValueError(
        f"{bad}: per-frequency RoPE divisors no llama3 rope scaling reproduces (frequency {j}: "
        f"divisor {d[j]:.6g}; {why}); dayzero reads rope_freqs only as llama.cpp writes Llama 3 "
        "rope scaling"
    )
