"""Quantized tiny checkpoints, made by NVIDIA ModelOpt itself (`dayzero tiny F OUT --quantization Q`).

The tiny float checkpoint (sdk/parity/tiny.py) is loaded into the reference class, quantized with
`modelopt.torch.quantization.quantize` (calibrated on random prompts) and written with
`modelopt.torch.export.export_hf_checkpoint`, both on the CPU. ModelOpt unfuses stacked experts
(its `_QuantFusedExperts`) and writes one tensor set per expert.

  nvfp4   NVFP4 weights and activations (input scales), NVFP4_DEFAULT_CFG
  mxfp4   MXFP4 weights (MXFP4_DEFAULT_CFG, activations left unquantized)
  fp8     FP8 weights in 128 x 128 blocks (FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
  mixed   MIXED_PRECISION: attention FP8 blocks, everything else NVFP4

Linears whose input width is not a multiple of the format's block stay unquantized (listed in the
export's exclusions). Other conventions are the same numbers renamed and reshaped (`layout`):
fp8 as DeepSeek's `weight_scale_inv` with `quant_method: fp8`; mxfp4 as gpt-oss `_blocks` /
`_scales` or as compressed-tensors `weight_packed` (format mxfp4-pack-quantized).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
import shutil
import tempfile
from pathlib import Path

import torch

from dayzero.sdk.families import FAMILIES
from dayzero.sdk.loader.safetensors_io import read_header, shard_files
from dayzero.sdk.parity.tiny import write_tiny
from dayzero.sdk.spec.reference import reference_class

QUANTIZATIONS = ("nvfp4", "mxfp4", "fp8", "mixed")
LAYOUTS = {"nvfp4": ("modelopt",), "mixed": ("modelopt",), "fp8": ("modelopt", "deepseek")}
LAYOUTS["mxfp4"] = ("modelopt", "gpt_oss", "compressed_tensors")
CALIBRATION = 4  # random prompts of 16 tokens


def _left_out(model: torch.nn.Module, quantization: str, modules: list[str] | None) -> list[dict]:
    """ModelOpt rules disabling the quantizers of the linears left unquantized: those whose input
    width is not a whole number of the format's blocks (a tiny config's 16-wide latent in MXFP4's
    blocks of 32: ModelOpt cannot export those), and, given `modules` (fnmatch patterns of the
    reference's module names: a release's quantized scope), every linear none of them names."""
    group = {"nvfp4": 16, "mixed": 16, "mxfp4": 32}.get(quantization, 1)
    return [
        {"quantizer_name": f"{name}.*", "enable": False}
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and (
            m.in_features % group
            or (modules is not None and not any(fnmatch.fnmatchcase(name, p) for p in modules))
        )
    ]


def _modelopt_config(quantization: str) -> dict:
    try:
        import modelopt.torch.quantization as mtq
    except ImportError:
        raise RuntimeError(
            "quantized tiny checkpoints are made by ModelOpt: pip install nvidia-modelopt"
        ) from None
    if quantization == "nvfp4":
        return mtq.NVFP4_DEFAULT_CFG
    if quantization == "fp8":
        return mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG
    cfg = copy.deepcopy(mtq.MXFP4_DEFAULT_CFG if quantization == "mxfp4" else mtq.NVFP4_DEFAULT_CFG)
    rules = cfg["quant_cfg"]
    at = next(i for i, r in enumerate(rules) if r.get("quantizer_name") == "*input_quantizer") + 1
    if quantization == "mxfp4":
        rules.insert(at, {"quantizer_name": "*input_quantizer", "enable": False})
    else:  # mixed: attention projections in FP8 blocks, weight-only
        fp8 = next(
            r
            for r in mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG["quant_cfg"]
            if r.get("quantizer_name") == "*weight_quantizer"
        )
        rules.insert(at, {"quantizer_name": "*self_attn*weight_quantizer", "cfg": fp8["cfg"]})
        rules.insert(at + 1, {"quantizer_name": "*self_attn*input_quantizer", "enable": False})
    return cfg


SHARD = re.compile(r"(.+)\.[^.]+\.shard_(\d+)\.weight")  # transformers' WeightConverter shards


def _reshard(out: Path, float_names: dict[str, tuple[int, ...]]) -> None:
    """Put back the shards ModelOpt's export merges. A checkpoint may store a parameter as n
    shards that transformers concatenates at load (`<m>.<p>.shard_<i>.weight`, e.g. an n-gram
    embedding table in `split_ngram_parts`); ModelOpt writes the merged tensor under
    `<m>.shard_.weight` (the parameter's name lost). Split it back along dim 0 into the float
    checkpoint's shards, each checked against its shape; no other tensor changes."""
    from safetensors.torch import load_file, save_file

    groups: dict[str, list[tuple[int, str]]] = {}
    for name in float_names:
        if m := SHARD.fullmatch(name):
            groups.setdefault(m.group(1), []).append((int(m.group(2)), name))
    if not groups:
        return
    path = out / "model.safetensors"
    tensors = load_file(str(path))
    for prefix, shards in groups.items():
        merged = tensors.pop(f"{prefix}.shard_.weight", None)
        if merged is None:
            continue
        names = [n for _, n in sorted(shards)]
        shapes = [float_names[n] for n in names]
        rows = sum(sh[0] for sh in shapes)
        if merged.shape[0] != rows or any(tuple(merged.shape[1:]) != sh[1:] for sh in shapes):
            raise RuntimeError(
                f"ModelOpt's {prefix}.shard_.weight {tuple(merged.shape)} does not split into "
                + ", ".join(f"{n} {sh}" for n, sh in zip(names, shapes, strict=True))
            )
        for n, t in zip(names, merged.split([sh[0] for sh in shapes], dim=0), strict=True):
            tensors[n] = t.contiguous()
    save_file(tensors, str(path))


def _relayout(out: Path, layout: str) -> None:
    """ModelOpt's fp8 / mxfp4 export renamed into another convention, the numbers unchanged."""
    from safetensors.torch import load_file, save_file

    hf = json.loads((out / "config.json").read_text())
    side = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    tensors = load_file(str(out / "model.safetensors"))
    codes = {n for n, t in tensors.items() if f"{n}_scale" in tensors}
    renamed: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        scale = name.endswith("_scale") and name.removesuffix("_scale") in codes
        if name in codes and layout == "gpt_oss":
            renamed[f"{name}_blocks"] = t.reshape(t.shape[0], -1, 16)
        elif name in codes and layout == "compressed_tensors":
            renamed[f"{name}_packed"] = t
        elif scale and layout == "deepseek":  # ModelOpt's [rb, 1, kb, 1] or [] -> [rb, kb]
            renamed[f"{name}_inv"] = t.reshape(t.shape[0], t.shape[2]) if t.dim() == 4 else t.reshape(-1, 1)
        elif scale and layout == "gpt_oss":
            renamed[f"{name}s"] = t
        else:
            renamed[name] = t
    exclude = side.get("exclude_modules") or []
    if layout == "deepseek":
        q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        q |= {"weight_block_size": [128, 128], "modules_to_not_convert": exclude}
    elif layout == "gpt_oss":
        q = {"quant_method": "mxfp4", "modules_to_not_convert": exclude}
    else:
        w = {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True}
        q = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "ignore": exclude}
        q["config_groups"] = {"group_0": {"targets": ["Linear"], "weights": w}}
    (out / "hf_quant_config.json").unlink()
    (out / "model.safetensors").unlink()
    save_file(renamed, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf | {"quantization_config": q}, indent=2))


def write_quantized_tiny(
    family: str,
    out: str | Path,
    quantization: str,
    layout: str = "modelopt",
    seed: int = 0,
    overrides: dict | None = None,
    modules: list[str] | None = None,
) -> Path:
    """The tiny checkpoint quantized by ModelOpt; `modules`: fnmatch patterns of the reference's
    modules to quantize (a release's scope), the other linears left as they are."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; known: {', '.join(QUANTIZATIONS)}")
    if layout not in LAYOUTS[quantization]:
        raise ValueError(f"{quantization} is written as {', '.join(LAYOUTS[quantization])}, not {layout!r}")
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    cfg = copy.deepcopy(_modelopt_config(quantization))
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="dayzero-tiny-") as tmp:
        write_tiny(family, tmp, seed, overrides)
        float_names = {t.name: t.shape for f in shard_files(Path(tmp)) for t in read_header(f)}
        cls = reference_class(FAMILIES.get(family).spec.spec.reference)
        model = cls.from_pretrained(tmp, dtype=torch.float32).eval()
        cfg["quant_cfg"] += _left_out(model, quantization, modules)
        vocab = model.config.get_text_config().vocab_size
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, vocab, (1, 16), generator=g) for _ in range(CALIBRATION)]

        def calibrate(m: torch.nn.Module) -> None:
            for p in prompts:
                m(p)

        with torch.no_grad():
            model = mtq.quantize(model, cfg, calibrate)
            export_hf_checkpoint(model, export_dir=str(out))
        for f in Path(tmp).iterdir():
            if f.suffix != ".safetensors" and f.name not in ("config.json", "generation_config.json"):
                shutil.copy(f, out / f.name)
    _reshard(out, float_names)
    if layout != "modelopt":
        _relayout(out, layout)
    return out
