"""Kimi K3's NVFP4 release declares its quantized modules as the fact sheet describes (section 4),
not as ModelOpt's export of the tiny reference writes them: the routed experts once per layer as
the subtree `...block_sparse_moe.experts` (NVFP4, group 16), the attention projections one by one
(FP8_PB_WO) next to alias modules that hold no tensors (`fused_qkv_a_proj_with_mqa`,
`fused_qkvg_proj`, `in_proj_qkvgfab`), and `exclude_modules` naming lm_head and the router. The
tiny mixed checkpoint rewritten that way loads packed as before and passes parity against the
independent reference on the dequantized weights (the generated test covers ModelOpt's own form)."""

from __future__ import annotations

import json
import re

from dayzero.sdk.families import FAMILIES
from dayzero.sdk.loader import open_checkpoint
from dayzero.sdk.parity import run_parity
from dayzero.sdk.parity.quantized_tiny import write_quantized_tiny

SCOPE = FAMILIES.get("kimi_k3").spec.spec.parity.quantized["mixed/modelopt"]  # the release's scope
ALIASES = ("fused_qkv_a_proj_with_mqa", "fused_qkvg_proj", "in_proj_qkvgfab")


def _release_form(layers: dict) -> dict:
    out = {}
    for module, algo in layers.items():
        if m := re.fullmatch(r"(.*\.block_sparse_moe\.experts)\.\d+\.w[123]", module):
            out[m.group(1)] = algo | {"group_size": 16}
        else:
            out[module] = algo
            if module.endswith(".self_attn.o_proj"):
                for alias in ALIASES:
                    out[module.removesuffix("o_proj") + alias] = algo
    return out


def test_the_release_form_of_the_mixed_quant_config_loads_and_passes_parity(tmp_path) -> None:
    ckpt = write_quantized_tiny("kimi_k3", tmp_path / "ckpt", "mixed", "modelopt", seed=5, modules=SCOPE)
    side = json.loads((ckpt / "hf_quant_config.json").read_text())
    layers = _release_form(side["quantization"]["quantized_layers"])
    assert sum(k.endswith(".experts") for k in layers) == 3  # one subtree entry per MoE layer
    exclude = ["lm_head", "*.block_sparse_moe.gate"]
    side["quantization"] |= {"quantized_layers": layers, "exclude_modules": exclude}
    (ckpt / "hf_quant_config.json").write_text(json.dumps(side))
    hf = json.loads((ckpt / "config.json").read_text())
    hf["quantization_config"] |= {"quantized_layers": layers, "ignore": exclude}
    (ckpt / "config.json").write_text(json.dumps(hf))

    quant = open_checkpoint(ckpt).quant
    assert quant.format_for("language_model.model.layers.1.block_sparse_moe.experts.3.w2") == "nvfp4"
    assert quant.format_for("language_model.model.layers.1.self_attn.f_b_proj") == "fp8_block"
    assert quant.format_for("language_model.model.layers.1.block_sparse_moe.gate") is None
    assert quant.format_for("language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj") is None
    report = run_parity(ckpt, device="cpu", seed=5, new_tokens=8)
    assert report.ok, report.table()
