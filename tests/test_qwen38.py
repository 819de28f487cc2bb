"""Qwen3.8 (models/qwen38, transformers' qwen3_5_moe) beyond its generated parity test: the
interleaved mRoPE table at text positions is plain partial RoPE, a nested checkpoint
(Qwen3_5MoeForConditionalGeneration: text_config, model.language_model.*) resolves and maps like
the flat one, and the MTP head's tensors are set aside (counted), never matched by a rule."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dayzero.sdk.blocks.rope import rope_table
from dayzero.sdk.families import FAMILIES
from dayzero.sdk.loader import Checkpoint
from dayzero.sdk.spec.reference import reference_config

MROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
MROPE |= {"mrope_section": [11, 11, 10], "mrope_interleaved": True}  # Qwen3.5's


def test_interleaved_mrope_at_text_positions_is_partial_rope() -> None:
    """Qwen3_5MoeTextRotaryEmbedding with Qwen3.5's sections (head_dim 256, a quarter rotating:
    32 frequencies = 11 + 11 + 10) and the same position in every section, as the text model
    passes it: its cos / sin equal the plain partial-RoPE table the gqa block builds."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    ref = Qwen3_5MoeTextRotaryEmbedding(Qwen3_5MoeTextConfig(head_dim=256, rope_parameters=dict(MROPE)))
    pos = torch.arange(0, 5000, 7)
    cos, sin = ref(torch.zeros(1, dtype=torch.float32), pos[None, None].expand(3, 1, -1))
    inv, factor = rope_table(1e7, 64, {"rope_type": "default"})
    ang = pos[:, None].float() * inv  # [T, 32]
    assert factor == 1.0 and cos.shape[-1] == 64
    assert torch.equal(cos[0], torch.cat((ang, ang), -1).cos())
    assert torch.equal(sin[0], torch.cat((ang, ang), -1).sin())


def _configs() -> tuple[dict, dict]:
    """A flat config (the tiny, as Qwen3_5MoeForCausalLM's) and the same text model nested in
    Qwen3_5MoeConfig with real-checkpoint keys (mRoPE, MTP fields, no layer_types)."""
    fam = FAMILIES.get("qwen38")
    tiny = dict(fam.spec.spec.tiny) | {"num_hidden_layers": 8}
    flat = reference_config(fam.spec.spec.reference, tiny)
    text = tiny | {"rope_parameters": dict(MROPE), "full_attention_interval": 4, "attn_output_gate": True}
    text |= {"mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "mamba_ssm_dtype": "float32"}
    nested = reference_config("transformers.Qwen3_5MoeForConditionalGeneration", {"text_config": text})
    nested["text_config"].pop("layer_types")  # from full_attention_interval
    return flat, nested


def test_a_nested_config_resolves_and_maps_like_the_flat_one() -> None:
    fam = FAMILIES.get("qwen38")
    flat, nested = _configs()
    a, b = fam.config(flat), fam.config(nested)
    plan = [(x.attn_kind, x.mlp_kind) for x in a.layers]
    assert plan == [(x.attn_kind, x.mlp_kind) for x in b.layers]
    assert [k for k, _ in plan] == ["gated_deltanet"] * 3 + ["gqa"] + ["gated_deltanet"] * 3 + ["gqa"]
    assert [x.attn for x in a.layers[:3]] == [x.attn for x in b.layers[:3]]  # Gated DeltaNet
    full, full_nested = a.layers[3].attn, b.layers[3].attn
    assert full_nested == dataclasses.replace(full, rope_theta=1e7)  # the nested one's theta
    assert full.rotary_dim == 4 and full.output_gate == "sigmoid" and full.qk_norm_zero_centred  # 16 x 0.25

    ckpt = Checkpoint(Path("."), "safetensors", nested, fam)
    m = ckpt.mapping
    assert m.param_of("model.language_model.layers.4.linear_attn.in_proj_b.weight") == "layers.4.attn.ba_proj"
    assert m.param_of("model.language_model.layers.3.self_attn.q_norm.weight") == "layers.3.attn.q_norm"
    assert m.param_of("model.visual.blocks.0.attn.qkv.weight") is None  # ignored: vision tower
    assert m.is_mtp("mtp.layers.0.mlp.experts.3.up_proj.weight") and m.is_mtp("mtp.fc.weight")
    assert not m.is_mtp("model.language_model.layers.0.mlp.gate.weight")
