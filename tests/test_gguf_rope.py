"""Llama 3.1 / 3.2 GGUFs: the llama3 RoPE scaling as llama.cpp stores it (`rope_freqs.weight`).

A tiny Llama-3.1-style HF checkpoint (rope_parameters llama3, original_max_position_embeddings 64)
is written as GGUF the way llama.cpp's convert_hf_to_gguf.py does (names, q/k rows permuted, the
per-frequency divisors in `rope_freqs.weight`, no rope-scaling metadata), loaded through dayzero,
and its prefill logits on 200-token prompts compared with transformers' LlamaForCausalLM on the
original HF checkpoint: within 1e-4 (the parity suite's fp32 tolerance; measured 3.5e-6 to 6.0e-6
over the 9 cases, logits up to 4.9), while the same weights without the scaling are off by 3.3 to
5.5 past position 64. Tensors that no llama3 parameters reproduce, malformed
ones and RoPE scaling metadata dayzero does not read are refused, naming the tensor or key.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dayzero.sdk.blocks.rope import rope_table
from dayzero.sdk.errors import CheckpointError, WeightError
from dayzero.sdk.families import build
from dayzero.sdk.loader import load_weights, open_checkpoint
from dayzero.sdk.loader.gguf_rope import ROPE_FREQS, llama3_from_rope_freqs
from dayzero.sdk.parity.runner import Ours
from dayzero.sdk.parity.tiny import write_tiny

TOL = 1e-4  # fp32 logits, dayzero vs transformers (sdk/parity/runner.py's prefill tolerance)
PROMPT = 200  # tokens: far past original_max_position_embeddings (64)


def llama3(theta: float, factor: float, low: float = 1.0, high: float = 4.0, orig: int = 64) -> dict:
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }


# (overrides of the llama spec's tiny config, how many frequencies fall between the thresholds)
SHAPES = {
    "tiny-head16": ({"rope_parameters": llama3(500000.0, 8.0)}, 1),
    "head64-theta1e4": (
        {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
         "rope_parameters": llama3(10000.0, 8.0)}, 5,
    ),
    "llama3.2-factor32": (
        {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
         "rope_parameters": llama3(500000.0, 32.0)}, 3,
    ),
}  # fmt: skip
SEEDS = [0, 1, 7]


def llamacpp_rope_freqs(cfg: dict) -> np.ndarray:
    """llama.cpp's LlamaModel.generate_extra_tensors, step for step (fp32 torch). llama.cpp reads
    original_max_position_embeddings from the top level of config.json (default 8192): that is
    where Meta's 8192 sits in effect for every Llama 3.x; here it is the rope parameters' own."""
    rope = cfg["rope_parameters"]
    base = rope["rope_theta"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: q/k rows of each head interleaved in pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def write_gguf(
    hf_dir: Path,
    out: Path,
    rope_freqs: np.ndarray | None = None,
    metadata: dict | None = None,
) -> Path:
    """hf_dir's Llama as llama.cpp would convert it to an f32 GGUF; `rope_freqs` replaces the
    divisors it would compute (None: computed when the config has llama3 rope parameters)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_vocab_size(cfg["vocab_size"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    for key, value in (metadata or {}).items():
        (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    if rope_freqs is None and cfg["rope_parameters"].get("rope_type") == "llama3":
        rope_freqs = llamacpp_rope_freqs(cfg)
    if rope_freqs is not None:  # llama.cpp yields it before the model's tensors
        w.add_tensor(ROPE_FREQS, np.asarray(rope_freqs, dtype=np.float32))
    for name, t in load_file(hf_dir / "model.safetensors").items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            gname = f"blk.{i}.{NAMES[module]}.weight"
            if module == "self_attn.q_proj":
                t = _permute(t, heads)
            elif module == "self_attn.k_proj":
                t = _permute(t, kv)
        w.add_tensor(gname, t.float().contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _reference_logits(hf_dir: Path, prompt: list[int], rope_parameters: dict | None = None) -> torch.Tensor:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(hf_dir)
    if rope_parameters is not None:
        cfg.rope_parameters = rope_parameters
    model = LlamaForCausalLM.from_pretrained(
        hf_dir, config=cfg, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.inference_mode():
        return model.eval()(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_llama31_gguf_matches_transformers_on_the_hf_checkpoint(
    tmp_path: Path, shape: str, seed: int
) -> None:
    overrides, n_mid = SHAPES[shape]
    hf_dir = write_tiny("llama", tmp_path / "hf", seed=seed, overrides=overrides)
    path = write_gguf(hf_dir, tmp_path / "model.gguf")
    hf = json.loads((hf_dir / "config.json").read_text())
    divisors = llamacpp_rope_freqs(hf)
    assert int(((divisors > 1) & (divisors < divisors.max())).sum()) == n_mid

    ckpt = open_checkpoint(path)
    assert ckpt.config_tensors == {ROPE_FREQS}
    got = ckpt.hf["rope_parameters"]
    want = overrides["rope_parameters"]
    assert got == want  # Meta-style parameters (low_freq_factor 1) come back exactly

    prompt = np.random.default_rng(seed).integers(0, hf["vocab_size"], size=PROMPT).tolist()
    (ours,) = Ours(ckpt, torch.device("cpu"), torch.float32).prefill_logits([prompt])
    ref = _reference_logits(hf_dir, prompt)
    assert (ours - ref).abs().max().item() <= TOL
    unscaled = _reference_logits(hf_dir, prompt, {"rope_type": "default", "rope_theta": want["rope_theta"]})
    assert (unscaled - ref)[64:].abs().max().item() > 100 * TOL  # the factors matter at these positions


@pytest.mark.parametrize(("head_dim", "factor"), [(128, 8.0), (64, 32.0)])  # Llama 3.1 8B, 3.2 1B
def test_meta_llama3_divisors_give_back_the_config(head_dim: int, factor: float) -> None:
    rope = llama3(500000.0, factor, 1.0, 4.0, 8192)
    cfg = {"hidden_size": head_dim, "num_attention_heads": 1, "rope_parameters": rope}
    divisors = torch.from_numpy(llamacpp_rope_freqs(cfg))
    got = llama3_from_rope_freqs(divisors, 500000.0, None, "x.gguf")
    assert got == {k: v for k, v in rope.items() if k != "rope_theta"}


def test_parameters_only_fixed_up_to_the_original_length_serve_the_same_table() -> None:
    """low / high factors 2 / 8 over 64 give the same divisors as 1 / 4 over 32: the tensor
    cannot tell them apart, and both serve one table (the recovered one states low 1)."""
    theta, dim = 500000.0, 32
    cfg = {"hidden_size": dim, "num_attention_heads": 1, "rope_parameters": llama3(theta, 16.0, 2.0, 8.0, 64)}
    divisors = llamacpp_rope_freqs(cfg)
    got = llama3_from_rope_freqs(torch.from_numpy(divisors), theta, None, "x.gguf")
    assert got == {k: v for k, v in llama3(theta, 16.0, 1.0, 4.0, 32).items() if k != "rope_theta"}
    served, _ = rope_table(theta, dim, got)
    truth, _ = rope_table(theta, dim, cfg["rope_parameters"])
    assert torch.equal(served, truth)
    stated = llama3_from_rope_freqs(torch.from_numpy(divisors), theta, 64, "x.gguf")  # the file states L
    assert (stated["low_freq_factor"], stated["high_freq_factor"]) == pytest.approx((2.0, 8.0), rel=1e-6)


@pytest.fixture(scope="module")
def tiny_llama31(tmp_path_factory) -> Path:
    return write_tiny("llama", tmp_path_factory.mktemp("hf"), seed=3, overrides=SHAPES["tiny-head16"][0])


@pytest.mark.parametrize("seed", [0, 1])
def test_rope_freqs_no_llama3_parameters_reproduce_are_refused(
    tmp_path: Path, tiny_llama31: Path, seed: int
) -> None:
    divisors = 1 + 7 * np.random.default_rng(seed).random(8)
    path = write_gguf(tiny_llama31, tmp_path / "model.gguf", rope_freqs=divisors)
    with pytest.raises(
        CheckpointError, match=rf"{path}: tensor rope_freqs\.weight: per-frequency RoPE divisors no llama3"
    ):
        open_checkpoint(path)


def test_rope_freqs_one_divisor_off_is_refused() -> None:
    cfg = {"hidden_size": 128, "num_attention_heads": 2, "rope_parameters": llama3(10000.0, 8.0)}
    divisors = llamacpp_rope_freqs(cfg)
    j = int(np.argmax((divisors > 1) & (divisors < 8)))
    divisors[j] *= 1.001
    with pytest.raises(
        ValueError, match=r"x\.gguf: tensor rope_freqs\.weight: .* \(frequency \d+: divisor .*off by"
    ):
        llama3_from_rope_freqs(torch.from_numpy(divisors), 10000.0, None, "x.gguf")


@pytest.mark.parametrize(
    ("divisors", "message"),
    [
        (np.full(6, 2.0), r"tensor rope_freqs\.weight has 6 entries; 16 rotary dims need 8"),
        (
            np.array([1, 1, 2, np.nan, 8, 8, 8, 8]),
            r"tensor rope_freqs\.weight: RoPE frequency divisors must be finite",
        ),
        (np.array([0.5, 1, 2, 4, 8, 8, 8, 8]), r"tensor rope_freqs\.weight: a divisor below 1 \(0\.5\)"),
    ],
)
def test_malformed_rope_freqs_are_refused(tmp_path: Path, tiny_llama31: Path, divisors, message: str) -> None:
    path = write_gguf(tiny_llama31, tmp_path / "model.gguf", rope_freqs=divisors)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(path)


def test_rope_freqs_of_ones_is_plain_rope_and_consumed(tmp_path: Path) -> None:
    hf_dir = write_tiny(
        "llama",
        tmp_path / "hf",
        seed=0,
        overrides={"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    )
    path = write_gguf(hf_dir, tmp_path / "model.gguf", rope_freqs=np.ones(8))
    ckpt = open_checkpoint(path)
    assert "rope_parameters" not in ckpt.hf and ckpt.config_tensors == {ROPE_FREQS}
    prompt = list(range(3, 150))
    (ours,) = Ours(ckpt, torch.device("cpu"), torch.float32).prefill_logits([prompt])
    assert (ours - _reference_logits(hf_dir, prompt)).abs().max().item() <= TOL


def test_rope_freqs_is_never_written_to_a_parameter(tmp_path: Path, tiny_llama31: Path) -> None:
    """Without the config having read it, rope_freqs.weight matches no weight rule: strict."""
    path = write_gguf(tiny_llama31, tmp_path / "model.gguf")
    ckpt = open_checkpoint(path)
    cfg = ckpt.family.config(ckpt.hf, str(path))
    model, _ = build(ckpt.family, cfg, ckpt.hf, torch.device("cpu"), torch.float32)
    with pytest.raises(WeightError, match=r"checkpoint tensor rope_freqs\.weight matches no weight rule"):
        load_weights(model, replace(ckpt, config_tensors=frozenset()), progress=False)


def test_linear_scaling_metadata_is_read(tmp_path: Path) -> None:
    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    hf_dir = write_tiny("llama", tmp_path / "hf", seed=2, overrides={"rope_parameters": rope})
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    ckpt = open_checkpoint(write_gguf(hf_dir, tmp_path / "model.gguf", metadata=meta))
    assert ckpt.hf["rope_parameters"] == rope and ckpt.config_tensors == frozenset()
    prompt = list(range(5, 205))
    (ours,) = Ours(ckpt, torch.device("cpu"), torch.float32).prefill_logits([prompt])
    assert (ours - _reference_logits(hf_dir, prompt)).abs().max().item() <= TOL


def test_rope_scaling_type_not_read_is_refused(tmp_path: Path, tiny_llama31: Path) -> None:
    meta = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    path = write_gguf(tiny_llama31, tmp_path / "model.gguf", metadata=meta)
    with pytest.raises(
        CheckpointError, match=r"metadata llama\.rope\.scaling\.type = 'yarn' is not read yet"
    ):
        open_checkpoint(path)


def test_parity_reference_of_a_llama31_gguf_keeps_its_scaling(tmp_path: Path, tiny_llama31: Path) -> None:
    """`dayzero parity` builds transformers from the GGUF with the config dayzero read (its
    rope_parameters), not transformers' GGUF reading, which drops the llama3 factors."""
    from dayzero.sdk.parity.runner import Reference

    path = write_gguf(tiny_llama31, tmp_path / "model.gguf")
    ckpt = open_checkpoint(path)
    prompt = np.random.default_rng(5).integers(0, ckpt.hf["vocab_size"], size=PROMPT).tolist()
    ref = Reference(ckpt, tmp_path, torch.device("cpu"), torch.float32).logits(prompt)
    assert (ref - _reference_logits(tiny_llama31, prompt)).abs().max().item() <= TOL
