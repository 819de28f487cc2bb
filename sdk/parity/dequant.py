"""A quantized checkpoint as float tensors under their float names: what the parity reference
loads (weight-only semantics: the reference runs on exactly the weights dayzero dequantizes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from dayzero.kernels.packed import DEQUANT
from dayzero.sdk.loader import Checkpoint, safetensors_io
from dayzero.sdk.quant.layout import module_of, to_rows


def dequantized_tensors(
    ckpt: Checkpoint, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint; packed weights dequantized (in fp32, then cast) and named
    F, their scale tensors dropped. Holds the checkpoint in memory: meant for test checkpoints."""
    packing = ckpt.packing
    tensors = dict(safetensors_io.iter_tensors(safetensors_io.shard_files(ckpt.path)))
    if packing is None:
        yield from tensors.items()
        return
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for name, (weight, comp) in packing.tensors.items():
        weights.setdefault(weight, {})[comp] = tensors.pop(name)
    yield from tensors.items()
    for weight, comps in weights.items():
        fmt = packing.config.format_for(module_of(weight))
        rows = comps["codes"].shape[0]
        per_row = {c: to_rows(fmt, c, t, rows) for c, t in comps.items()}
        yield weight, DEQUANT[fmt](per_row).to(dtype)


def write_dequantized(ckpt: Checkpoint, out: Path) -> Path:
    """config.json without its quantization config + model.safetensors of float weights."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    hf = {
        k: v
        for k, v in json.loads((ckpt.path / "config.json").read_text()).items()
        if k != "quantization_config"
    }
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    save_file({n: t.contiguous() for n, t in dequantized_tensors(ckpt)}, str(out / "model.safetensors"))
    return out
