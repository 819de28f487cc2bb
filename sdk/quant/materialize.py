"""Parameters made real on the device after a build on the meta device: dense ones as empty
tensors in their dtype, the checkpoint's packed ones as PackedWeights (never dense first)."""

from __future__ import annotations

import torch
from torch import nn

from dayzero.kernels.packed import PackedWeight
from dayzero.sdk.errors import WeightError
from dayzero.sdk.quant.packing import PackedParam


def materialize(
    model: nn.Module, device: torch.device, packed: dict[str, PackedParam], act_quant: bool = False
) -> None:
    """A block lists the parameters it reads only through `linear` / `moe_experts` (or
    kernels.packed.dense) in `linear_weights`; only those may be packed. With act_quant, every
    packed weight must be NVFP4 with input scales (activation quantization, see linear_packed)."""
    if act_quant and not packed:
        raise WeightError(
            "activation quantization needs an NVFP4 checkpoint with input scales; this one is not quantized"
        )
    left = dict(packed)
    for mname, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            how = left.pop(full, None)
            if how is None:
                mod._parameters[pname] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
                )
                continue
            if pname not in getattr(mod, "linear_weights", ()):
                raise WeightError(
                    f"the checkpoint packs {full} ({how.format}), which {type(mod).__name__} does not "
                    "read as a linear weight"
                )
            if act_quant and not (how.format == "nvfp4" and how.input_scale):
                raise WeightError(
                    f"activation quantization needs NVFP4 input scales; {full} is {how.format} without"
                )
            del mod._parameters[pname]
            with torch.device(device):
                pw = PackedWeight(how.format, tuple(p.shape), how.input_scale)
            pw.act_quant = act_quant
            setattr(mod, pname, pw)
    if left:
        raise WeightError(
            f"the checkpoint packs weights this model does not have: {', '.join(sorted(left)[:8])}"
        )
