"""Quantize a float weight into a format's per-row components (kernels/packed.py), on any device.

For benchmarks at real widths, where running ModelOpt over tens of GB would be slow: the scales
follow ModelOpt's rules (nvfp4: global = amax / (6 * 448), block scale = e4m3(amax_16 / (6 *
global)); mxfp4: 2^ceil(log2(amax_32 / 6)); fp8_block: amax_128x128 / 448); values round to the
nearest grid point. On random weights the result equals ModelOpt's bit for bit
(tests/test_quant.py); a value exactly half-way between two grid points rounds up in magnitude,
which may differ from ModelOpt (test checkpoints come from ModelOpt itself, sdk/parity/quantized_tiny.py).
"""

from __future__ import annotations

import torch

from dayzero.kernels.packed import E2M1, FP8_BLOCK

E2M1_MAX, E4M3_MAX = 6.0, 448.0
ROWS = 4096  # rows quantized at a time (bounds the temporaries)


def _codes(scaled: torch.Tensor) -> torch.Tensor:
    """fp32 [.., K] already divided by its scale -> packed E2M1 codes u8 [.., K/2]."""
    grid = torch.tensor(E2M1[:8], device=scaled.device)
    bounds = (grid[1:] + grid[:-1]) / 2
    mag = torch.bucketize(scaled.abs().clamp(max=E2M1_MAX), bounds, right=True).to(torch.uint8)
    c = mag | ((scaled < 0).to(torch.uint8) << 3)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _nvfp4(w: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    blocks = w.float().unflatten(-1, (-1, 16))
    s = blocks.abs().amax(-1) / (E2M1_MAX * g)
    s = s.masked_fill(s == 0, 1.0).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    codes = _codes((blocks / (s.float() * g)[..., None]).flatten(-2))
    return {"codes": codes, "scale": s}


def _mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    blocks = w.float().unflatten(-1, (-1, 32))
    e = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=2**-126) / E2M1_MAX)).clamp(-127, 127)
    codes = _codes((blocks / torch.exp2(e)[..., None]).flatten(-2))
    return {"codes": codes, "scale": (e + 127).to(torch.uint8)}


def _fp8_block(w: torch.Tensor) -> dict[str, torch.Tensor]:
    n, k = w.shape
    kb = -(-k // FP8_BLOCK)
    pad = torch.nn.functional.pad(w.float(), (0, kb * FP8_BLOCK - k))
    amax = pad.unflatten(-1, (kb, FP8_BLOCK)).abs().amax(-1)  # [n, kb] per row; per 128 rows below
    rb = -(-n // FP8_BLOCK)
    amax = torch.nn.functional.pad(amax, (0, 0, 0, rb * FP8_BLOCK - n)).unflatten(0, (rb, FP8_BLOCK)).amax(1)
    scale = (amax / E4M3_MAX).clamp(min=1e-12).repeat_interleave(FP8_BLOCK, 0)[:n]  # [n, kb]
    codes = (w.float() / scale.repeat_interleave(FP8_BLOCK, 1)[:, :k]).clamp(-E4M3_MAX, E4M3_MAX)
    return {"codes": codes.to(torch.float8_e4m3fn), "scale": scale}


def quantize(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """w [N, K] -> the per-row components of `fmt` (nvfp4 also `global` [N])."""
    if fmt == "fp8_block":
        return _fp8_block(w)
    if fmt == "mxfp4":
        return {k: torch.cat(v) for k, v in _chunked(w, _mxfp4).items()}
    g = w.abs().amax().float() / (E2M1_MAX * E4M3_MAX)
    out = {k: torch.cat(v) for k, v in _chunked(w, lambda c: _nvfp4(c, g)).items()}
    return out | {"global": g.expand(w.shape[0]).clone()}


def _chunked(w: torch.Tensor, fn) -> dict[str, list[torch.Tensor]]:
    parts: dict[str, list[torch.Tensor]] = {}
    for chunk in w.split(ROWS):
        for k, v in fn(chunk).items():
            parts.setdefault(k, []).append(v)
    return parts
