"""The decode benchmark's quantized runs: the reference model's weights quantized on the GPU
(sdk/bench/quantize.py) and handed to the loader in ModelOpt's checkpoint layout, so the load
path is the one a real checkpoint takes. Quantized like ModelOpt's defaults: every linear weight
but the LM head and the MoE routers."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from dayzero.kernels.packed import FP8_BLOCK, PackedWeight
from dayzero.sdk.bench.quantize import quantize
from dayzero.sdk.loader.mapping import Mapping
from dayzero.sdk.quant.config import QuantConfig
from dayzero.sdk.quant.packing import Packing, find_packing

SKIPPED = ("head.weight", ".router")  # kept in the model dtype, as ModelOpt's default configs do


def packable(skeleton: torch.nn.Module) -> set[str]:
    """Parameters a quantized checkpoint would pack (a model built on the meta device)."""
    out = set()
    for mname, mod in skeleton.named_modules():
        for p in getattr(mod, "linear_weights", ()):
            full = f"{mname}.{p}" if mname else p
            if isinstance(getattr(mod, p, None), torch.nn.Parameter) and not full.endswith(SKIPPED):
                out.add(full)
    return out


def _components(name: str, w: torch.Tensor, fmt: str) -> Iterator[tuple[str, torch.Tensor]]:
    c = quantize(w, fmt)
    yield name, c["codes"]
    yield f"{name}_scale", c["scale"][::FP8_BLOCK] if fmt == "fp8_block" else c["scale"]
    if fmt == "nvfp4":
        yield f"{name}_scale_2", c["global"][0]


def quantized_stream(
    tensors: Iterator[tuple[str, torch.Tensor]], mapping: Mapping, targets: set[str], fmt: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with each weight that maps into `targets` replaced by its packed form."""
    for name, t in tensors:
        target = mapping.target(name)
        if target is not None and target.param in targets:
            yield from _components(name, t, fmt)
        else:
            yield name, t


def bench_packing(
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]], mapping: Mapping, targets: set[str], fmt: str
) -> Packing:
    """The packing the quantized stream will need, from the float tensors' shapes alone (finding
    a packing reads names and dtypes; the loader checks the shapes)."""
    header = {}
    codes_dtype = torch.float8_e4m3fn if fmt == "fp8_block" else torch.uint8
    scale_dtype = {"nvfp4": torch.float8_e4m3fn, "mxfp4": torch.uint8, "fp8_block": torch.float32}[fmt]
    for name, (dtype, shape) in shapes.items():
        target = mapping.target(name)
        if target is None or target.param not in targets:
            header[name] = (dtype, shape)
            continue
        n, k = shape
        header[name] = (codes_dtype, (n, k if fmt == "fp8_block" else k // 2))
        header[f"{name}_scale"] = (scale_dtype, ())
        if fmt == "nvfp4":
            header[f"{name}_scale_2"] = (torch.float32, ())
    return find_packing(QuantConfig("dayzero bench", "modelopt", fmt), header, mapping.param_of)


def random_packed(model: torch.nn.Module) -> None:
    """Fill packed weights with N(0, 0.02^2) weights quantized, expert by expert (timing only)."""
    with torch.no_grad():
        for w in (m for m in model.modules() if isinstance(m, PackedWeight)):
            lead, (n, k) = w.shape[:-2], w.shape[-2:]
            for i in range(math.prod(lead)):
                parts = quantize(0.02 * torch.randn(n, k, device=w.codes.device), w.format.name)
                for name, buf in w.named_buffers():
                    buf.view(-1, *buf.shape[len(lead) :])[i].copy_(parts[name])
