"""A checkpoint's quantization config, read once into a frozen QuantConfig.

Forms read (the first present wins; ModelOpt writes both of its forms, which must agree):
  config.json quantization_config, quant_method modelopt   quant_algo, ignore, quantized_layers
  hf_quant_config.json quantization                       quant_algo, exclude_modules, quantized_layers
  config.json quantization_config, quant_method fp8       DeepSeek block FP8 (weight_block_size)
  config.json quantization_config, quant_method mxfp4     gpt-oss (modules_to_not_convert)
  config.json quantization_config, quant_method compressed-tensors, format mxfp4-pack-quantized
quant_algo MIXED_PRECISION names each quantized module's algorithm in `quantized_layers`.
Module patterns (exclusions, quantized_layers keys) are fnmatch wildcards; a pattern also covers
the modules under it (`model.layers.0.self_attn` excludes its q_proj).
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from dayzero.sdk.errors import CheckpointError

# quant_algo -> format (NVFP4 checkpoints carry input scales, W4A16_NVFP4 ones do not)
ALGOS = {
    "NVFP4": "nvfp4",
    "W4A16_NVFP4": "nvfp4",
    "MXFP4": "mxfp4",
    "FP8_PB_WO": "fp8_block",
}
GROUP_SIZE = {"nvfp4": 16, "mxfp4": 32}


@dataclass(frozen=True)
class QuantConfig:
    source: str  # file and key it was read from (for messages)
    convention: str  # tensor naming: modelopt | deepseek | gpt_oss | compressed_tensors
    default: str | None  # format of every module not excluded; None: only `layers` are quantized
    layers: tuple[tuple[str, str], ...] = ()  # MIXED_PRECISION: (module pattern, format)
    exclude: tuple[str, ...] = ()

    def excluded_by(self, module: str) -> str | None:
        return next((p for p in self.exclude if _covers(p, module)), None)

    def format_for(self, module: str) -> str | None:
        if self.excluded_by(module):
            return None
        return next((f for p, f in self.layers if _covers(p, module)), self.default)

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(sorted({f for _, f in self.layers} | ({self.default} if self.default else set())))


def _covers(pattern: str, module: str) -> bool:
    return fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*")


def _algo(name: object, where: str) -> str:
    fmt = ALGOS.get(str(name).upper())
    if fmt is None:
        raise CheckpointError(
            f"{where}: unknown quant_algo {name!r}; known: {', '.join(ALGOS)}, MIXED_PRECISION"
        )
    return fmt


def _modelopt(q: dict, where: str, exclude_key: str) -> QuantConfig:
    algo = q.get("quant_algo")
    exclude = tuple(q.get(exclude_key) or ())
    if str(algo).upper() == "MIXED_PRECISION":
        layers = q.get("quantized_layers") or {}
        if not layers:
            raise CheckpointError(f"{where}: quant_algo MIXED_PRECISION without quantized_layers")
        per = tuple(
            (m, _algo(c.get("quant_algo"), f"{where}.quantized_layers.{m}")) for m, c in layers.items()
        )
        return QuantConfig(where, "modelopt", None, per, exclude)
    fmt = _algo(algo, where)
    group = q.get("group_size")
    if group is not None and fmt in GROUP_SIZE and int(group) != GROUP_SIZE[fmt]:
        raise CheckpointError(f"{where}: group_size {group} for {algo}; the format defines {GROUP_SIZE[fmt]}")
    return QuantConfig(where, "modelopt", fmt, (), exclude)


def _fp8(q: dict, where: str) -> QuantConfig:
    block = q.get("weight_block_size")
    if list(block or ()) != [128, 128]:
        raise CheckpointError(f"{where}: weight_block_size {block}; block FP8 is read with [128, 128] blocks")
    return QuantConfig(where, "deepseek", "fp8_block", (), tuple(q.get("modules_to_not_convert") or ()))


def _compressed(q: dict, where: str) -> QuantConfig:
    fmt = q.get("format")
    if fmt != "mxfp4-pack-quantized":
        raise CheckpointError(f"{where}: compressed-tensors format {fmt!r}; supported: mxfp4-pack-quantized")
    for name, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", 32):
            raise CheckpointError(
                f"{where}: config_groups.{name}.weights {w} is not MXFP4 (4-bit float, groups of 32)"
            )
    return QuantConfig(where, "compressed_tensors", "mxfp4", (), tuple(q.get("ignore") or ()))


def read_quant_config(folder: Path, hf: dict) -> QuantConfig | None:
    """The checkpoint's QuantConfig, or None for an unquantized checkpoint."""
    q = hf.get("quantization_config")
    side = folder / "hf_quant_config.json"
    from_side = None
    if side.exists():
        body = json.loads(side.read_text()).get("quantization")
        if not isinstance(body, dict):
            raise CheckpointError(f"{side}: no `quantization` object")
        from_side = _modelopt(body, f"{side.name}: quantization", "exclude_modules")
    if not q:
        return from_side
    where, method = "config.json: quantization_config", q.get("quant_method")
    if method == "modelopt":
        cfg = _modelopt(q, where, "ignore")
        if from_side and (from_side.default, from_side.layers) != (cfg.default, cfg.layers):
            raise CheckpointError(f"{where} and {side.name} disagree on the quantization algorithm")
        return cfg
    if method == "fp8":
        return _fp8(q, where)
    if method == "mxfp4":
        return QuantConfig(where, "gpt_oss", "mxfp4", (), tuple(q.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        return _compressed(q, where)
    raise CheckpointError(
        f"{where}: quant_method {method!r}; known: modelopt, fp8, mxfp4, compressed-tensors"
    )
