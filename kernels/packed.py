"""Packed (quantized) weights: the formats' math and the container kernels receive.

A linear weight W [*lead, N, K] (lead: the expert index of stacked experts) stays in its
checkpoint's packed form; every component is stored per output row, so the parts of a fused
projection (q/k/v, gate/up) keep their own scales exactly:

  nvfp4       codes  u8 [N, K/2]   two E2M1 codes a byte, the low nibble the even element
              scale  e4m3 [N, K/16]  block scale of 16 elements
              global f32 [N]       the part's weight_scale_2
              input  f32 [N]       the part's input_scale (optional: activation quantization)
              W[n, k] = E2M1[code] * (scale[n, k // 16] * global[n])
  mxfp4       codes  u8 [N, K/2], scale u8 [N, K/32] (E8M0)
              W[n, k] = E2M1[code] * 2^(scale[n, k // 32] - 127)
  fp8_block   codes  e4m3 [N, K], scale f32 [N, ceil(K/128)]: the checkpoint's 128 x 128 block
              scales repeated over each block's rows (a part of a fused weight need not start
              on a 128-row boundary)
              W[n, k] = codes[n, k] * scale[n, k // 128]

E2M1 codes: bit 3 the sign, bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from dayzero.kernels.registry import Registry

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_BLOCK = 128


@dataclass(frozen=True)
class Component:
    name: str
    dtype: torch.dtype
    cols: Callable[[int], int] | None  # per-row width from K; None: one value per row
    optional: bool = False


@dataclass(frozen=True)
class Format:
    name: str
    components: tuple[Component, ...]
    k_multiple: int  # K must be a multiple of this
    bits: float  # stored bits per weight element, block scales included (global / input excluded)

    def component(self, name: str) -> Component:
        return next(c for c in self.components if c.name == name)


FORMATS: Registry[Format] = Registry("quantization format")
FORMATS.add(
    "nvfp4",
    Format(
        "nvfp4",
        (
            Component("codes", torch.uint8, lambda k: k // 2),
            Component("scale", torch.float8_e4m3fn, lambda k: k // 16),
            Component("global", torch.float32, None),
            Component("input", torch.float32, None, optional=True),
        ),
        k_multiple=16,
        bits=4.5,
    ),
)
FORMATS.add(
    "mxfp4",
    Format(
        "mxfp4",
        (
            Component("codes", torch.uint8, lambda k: k // 2),
            Component("scale", torch.uint8, lambda k: k // 32),
        ),
        k_multiple=32,
        bits=4.25,
    ),
)
FORMATS.add(
    "fp8_block",
    Format(
        "fp8_block",
        (
            Component("codes", torch.float8_e4m3fn, lambda k: k),
            Component("scale", torch.float32, lambda k: math.ceil(k / FP8_BLOCK)),
        ),
        k_multiple=1,
        bits=8 + 32 / FP8_BLOCK,
    ),
)


class PackedWeight(nn.Module):
    """A weight [*lead, N, K] in a packed format; components are buffers named as in FORMATS."""

    def __init__(self, fmt: str, shape: tuple[int, ...], with_input_scale: bool = False) -> None:
        super().__init__()
        self.format = FORMATS.get(fmt)
        self.shape = tuple(shape)
        self.act_quant = False  # quantize activations with `input` before the GEMM (see linear_packed)
        *lead, n, k = self.shape
        if k % self.format.k_multiple:
            raise ValueError(f"{fmt}: K = {k} is not a multiple of {self.format.k_multiple}")
        for c in self.format.components:
            if c.optional and not with_input_scale:
                continue
            cols = () if c.cols is None else (c.cols(k),)
            self.register_buffer(c.name, torch.empty(*lead, n, *cols, dtype=c.dtype))

    @property
    def has_input_scale(self) -> bool:
        return "input" in self._buffers

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequant(
        self, dtype: torch.dtype = torch.float32, index: int | torch.Tensor | None = None
    ) -> torch.Tensor:
        """W (or W[index] of stacked experts) in `dtype`; the products are formed in fp32."""
        parts = {n: (b if index is None else b[index]) for n, b in self._buffers.items()}
        return DEQUANT[self.format.name](parts).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.format.name}, shape={list(self.shape)}"


def _unpack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """u8 [.., K/2] -> fp32 [.., K], the low nibble first."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=codes.device)
    pairs = torch.stack((codes & 0x0F, codes >> 4), dim=-1)  # [.., K/2, 2]
    return table[pairs.long()].flatten(-2)


def _blocks(values: torch.Tensor, scale: torch.Tensor, size: int) -> torch.Tensor:
    """values [.., K] * scale [.., ceil(K/size)] repeated over each block of `size` elements."""
    k = values.shape[-1]
    return (values * scale.repeat_interleave(size, dim=-1)[..., :k]).contiguous()


def dequant_nvfp4(p: dict[str, torch.Tensor]) -> torch.Tensor:
    block_scale = p["scale"].float() * p["global"][..., None]  # [.., N, K/16]: as ModelOpt forms it
    return _blocks(_unpack_e2m1(p["codes"]), block_scale, 16)


def dequant_mxfp4(p: dict[str, torch.Tensor]) -> torch.Tensor:
    return _blocks(_unpack_e2m1(p["codes"]), torch.exp2(p["scale"].float() - 127), 32)


def dequant_fp8_block(p: dict[str, torch.Tensor]) -> torch.Tensor:
    return _blocks(p["codes"].float(), p["scale"], FP8_BLOCK)


DEQUANT: dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]] = {
    "nvfp4": dequant_nvfp4,
    "mxfp4": dequant_mxfp4,
    "fp8_block": dequant_fp8_block,
}


def dense(w: torch.Tensor | PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a dense tensor: for a block that reads a weight other than through `linear`
    (MLA's kv_b split per head)."""
    return w.dequant(dtype) if isinstance(w, PackedWeight) else w
