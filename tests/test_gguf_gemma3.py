"""llama.cpp's Gemma 3 files from their header alone: general.architecture `gemma3` (the image-text
model_type; the file holds the text decoder) is detected as family gemma3 through the spec's
gguf `general_architecture`, and the RoPE scaling Gemma 3 from 4B up states
(gemma3.rope.scaling.type linear, factor 8) is the full-attention layers' (the section's
`rope_parameters: rope_parameters.full_attention`), as transformers' Gemma3TextConfig has it."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from dayzero.sdk.blocks.rope import rope_table
from dayzero.sdk.errors import SpecError
from dayzero.sdk.loader import open_checkpoint

# a small Gemma 3 as the 4B's config.json states its RoPE: theta 1e6 scaled linearly by 8 on the
# full-attention layers, 1e4 unscaled on the sliding ones; every 6th layer full
SHAPE = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "sliding_window": 8,
    "max_position_embeddings": 512,
}
FACTOR, THETA = 8.0, 1_000_000.0
GGUF_KEYS = {  # GGUFWriter.add_<key> -> the HF field it states
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "head_count": "num_attention_heads",
    "head_count_kv": "num_key_value_heads",
    "key_length": "head_dim",
    "layer_norm_rms_eps": "rms_norm_eps",
    "sliding_window": "sliding_window",
    "context_length": "max_position_embeddings",
}


def _header(out: Path, arch: str, factor: float | None) -> Path:
    """A GGUF file of metadata only, as llama.cpp's convert script writes a Gemma 3 (no tensors:
    the header is all detection and the config read)."""
    w = gguf.GGUFWriter(str(out), arch)
    for key, field in GGUF_KEYS.items():  # the gguf section's config mapping, read back
        getattr(w, f"add_{key}")(SHAPE[field])
    w.add_rope_freq_base(THETA)
    if factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    w.add_token_list([f"t{i}" for i in range(SHAPE["vocab_size"])])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_gemma3_file_is_detected_as_the_text_family(tmp_path: Path) -> None:
    ckpt = open_checkpoint(_header(tmp_path / "g.gguf", "gemma3", None))
    assert ckpt.family.name == "gemma3" and ckpt.format == "gguf"
    assert "rope_parameters" not in ckpt.hf  # no scaling stated, none read
    with pytest.raises(SpecError, match="no family serves 'gemma3n'"):  # no section names it
        open_checkpoint(_header(tmp_path / "n.gguf", "gemma3n", None))


def test_gemma3_linear_rope_scaling_is_the_full_attention_layers(tmp_path: Path) -> None:
    ckpt = open_checkpoint(_header(tmp_path / "g.gguf", "gemma3", FACTOR))
    want = {"rope_theta": THETA, "rope_type": "linear", "factor": FACTOR}
    assert ckpt.hf["rope_parameters"] == {"full_attention": want}
    layers = ckpt.family.config(ckpt.hf).layers
    ref = Gemma3TextConfig(
        **SHAPE,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": FACTOR, "rope_theta": THETA},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    rotary = Gemma3RotaryEmbedding(ref)
    kinds = ["sliding_attention" if layer.attn.window else "full_attention" for layer in layers]
    assert kinds == ref.layer_types
    for layer, kind in zip(layers, ref.layer_types, strict=True):
        c = layer.attn
        inv, scale = rope_table(c.rope_theta, c.rotary_dim, dict(c.rope_params), c.max_position)
        expected = getattr(rotary, f"{kind}_inv_freq")
        torch.testing.assert_close(inv, expected, rtol=1e-6, atol=0)  # fp32 tables, one rounding
        assert scale == getattr(rotary, f"{kind}_attention_scaling") == 1.0
    full = next(layer.attn for layer in layers if not layer.attn.window)
    sliding = next(layer.attn for layer in layers if layer.attn.window)
    base = 1.0 / THETA ** (np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(
        rope_table(full.rope_theta, 16, dict(full.rope_params))[0], base / FACTOR, rtol=1e-6
    )
    assert sliding.rope_theta == 10_000.0 and dict(sliding.rope_params).get("factor") is None
