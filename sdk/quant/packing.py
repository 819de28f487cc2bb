"""A checkpoint's packing: which model parameters it stores packed, from its tensor headers alone.

Run before the model is built, so packed parameters are allocated packed (never dense first).
Every inconsistency fails here, naming the tensor: a packed weight of a module the config
excludes (or gives no algorithm), codes of the wrong dtype for the module's algorithm, a missing
scale, a scale whose weight is stored unquantized, one fused parameter mixing formats.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dayzero.sdk.errors import WeightError
from dayzero.sdk.quant.config import QuantConfig
from dayzero.sdk.quant.layout import CODES_DTYPE, NAMES, codes_weight, components, module_of, tensor_name


@dataclass(frozen=True)
class PackedParam:
    format: str
    input_scale: bool  # the checkpoint carries input scales (activation quantization possible)


@dataclass(frozen=True)
class Packing:
    config: QuantConfig
    params: dict[str, PackedParam]  # model parameter -> how it is packed
    tensors: dict[str, tuple[str, str]]  # checkpoint tensor -> (float weight name F, component)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(sorted({p.format for p in self.params.values()}))


Header = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def _weight_format(cfg: QuantConfig, weight: str, dtype: torch.dtype) -> str:
    module = module_of(weight)
    if pattern := cfg.excluded_by(module):
        raise WeightError(
            f"checkpoint tensor {weight} is packed ({str(dtype).removeprefix('torch.')}) but {cfg.source} "
            f"excludes module {module} (pattern {pattern!r})"
        )
    fmt = cfg.format_for(module)
    if fmt is None:
        raise WeightError(
            f"checkpoint tensor {weight} is packed but {cfg.source} names no algorithm for {module}"
        )
    if dtype != CODES_DTYPE[fmt]:
        raise WeightError(
            f"checkpoint tensor {weight} has dtype {str(dtype).removeprefix('torch.')}; "
            f"{fmt} ({cfg.source}) packs it as {str(CODES_DTYPE[fmt]).removeprefix('torch.')}"
        )
    return fmt


def _stray_scales(cfg: QuantConfig, header: Header, claimed: set[str]) -> None:
    """A scale-named tensor next to an unquantized weight is an error, not a silent extra."""
    for name in header:
        if name in claimed:
            continue
        for comp, suffix in NAMES[cfg.convention].items():
            if comp == "codes" or not suffix:
                continue
            if suffix.startswith("@"):
                weight = (
                    name.removesuffix("." + suffix[1:]) + ".weight" if name.endswith(suffix[1:]) else None
                )
            else:
                weight = name[: -len(suffix)] if name.endswith(suffix) else None
            if weight is not None and weight in header:
                dt = str(header[weight][0]).removeprefix("torch.")
                raise WeightError(
                    f"checkpoint tensor {name} scales {weight}, which is stored unquantized ({dt})"
                )


def find_packing(cfg: QuantConfig, header: Header, param_of: Callable[[str], str | None]) -> Packing:
    """`param_of(tensor)`: the model parameter a float tensor name writes (the family's weight
    rules), None when the rules ignore it."""
    params: dict[str, PackedParam] = {}
    tensors: dict[str, tuple[str, str]] = {}
    owner: dict[str, str] = {}  # param -> first weight that packed it (for messages)
    suffixes = [s for c, s in NAMES[cfg.convention].items() if c != "codes" and s and not s.startswith("@")]
    for name, (dtype, _) in header.items():
        if any(name.endswith(s) and name[: -len(s)] in header for s in suffixes):
            continue  # a scale (an e4m3 or u8 scale looks like codes by its dtype)
        weight = codes_weight(cfg.convention, name, dtype)
        if weight is None:
            continue
        fmt = _weight_format(cfg, weight, dtype)
        comps = components(cfg.convention, fmt)
        for comp in comps:
            tname = tensor_name(cfg.convention, weight, comp)
            if tname in header:
                tensors[tname] = (weight, comp)
            elif comp != "input":
                raise WeightError(f"checkpoint tensor {tname} is missing: the {fmt} weight {weight} needs it")
        param = param_of(weight)
        if param is None:  # deliberately ignored by the weight rules, with its scales
            continue
        has_input = tensor_name(cfg.convention, weight, "input") in header if "input" in comps else False
        p = PackedParam(fmt, has_input)
        if param in params and params[param] != p:
            raise WeightError(
                f"checkpoint tensor {weight} is {fmt}{' with input scale' * has_input} but {owner[param]}, "
                f"another part of {param}, is {params[param].format}"
                f"{' with input scale' * params[param].input_scale}"
            )
        params[param], owner[param] = p, owner.get(param, weight)
    if not tensors:
        raise WeightError(f"{cfg.source} declares {'/'.join(cfg.formats)} but no checkpoint tensor is packed")
    _stray_scales(cfg, header, set(tensors))
    return Packing(cfg, params, tensors)
