"""`dayzero new` (sdk/spec/draft.py) against the transformers classes the configs come from:
an MLA config (q_lora_rank / kv_lora_rank) drafts an mla block, and DeepSeek-V3's draft, generated
out of tree, gives the reference's logits (fp32, tolerance TOL: `dayzero parity`'s fp32 logit
tolerance); partial RoPE is read into rope.fraction and flagged; shared experts (DeepSeek's
count x width, Qwen2-MoE's gated one) are drafted, flagged, and their tensors mapped."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from conftest import SEEDS
from safetensors import safe_open

from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.cli import main
from dayzero.sdk.loader.mapping import Mapping
from dayzero.sdk.spec.assemble import layer_plan
from dayzero.sdk.spec.read import load_spec
from dayzero.sdk.spec.resolver import Resolver

TOL = 1e-4


def _draft(tmp_path: Path, name: str, cfg) -> tuple[Path, str]:
    """`dayzero new NAME --from-config` on cfg's full config.json: (the spec's path, its text)."""
    hf = cfg.to_dict() | {"architectures": [cfg.__class__.__name__.replace("Config", "ForCausalLM")]}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    out = tmp_path / name
    assert main(["new", name, "--from-config", str(tmp_path / "config.json"), "--out", str(out)]) == 0
    return out / "spec.yaml", (out / "spec.yaml").read_text()


def _resolved(spec: Path, hf: dict, block: str):
    loaded = load_spec(spec)
    opts = loaded.blocks[block]
    return BLOCKS.get(opts.kind).resolve(opts, Resolver(loaded, hf, "config.json").value)


@pytest.fixture(scope="module")
def drafted_dsv3(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """DeepSeek-V3's draft (its full-size default config, 2 shared experts), generated out of tree:
    (family name, the draft's text). Only its identity is renamed (a family of models/ may serve
    DeepseekV3ForCausalLM too); the reference, the symbols, blocks and rules are the draft's. The
    family is registered for these tests only (the registry and DAYZERO_SPECS restored after)."""
    from transformers import DeepseekV3Config

    from dayzero.sdk.families import FAMILIES

    name = "drafted_dsv3"
    spec, text = _draft(tmp_path_factory.mktemp("draft"), name, DeepseekV3Config(n_shared_experts=2))
    raw = yaml.safe_load(text) | {"architectures": ["DraftedDeepseekV3"], "model_types": [name]}
    assert raw["reference"] == "transformers.DeepseekV3ForCausalLM"
    spec.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FAMILIES, "_items", dict(FAMILIES._items))
        # recorded as it is (absent: deleted again on exit); codegen --spec appends the spec
        mp.setitem(os.environ, "DAYZERO_SPECS", os.environ.get("DAYZERO_SPECS", ""))
        assert main(["codegen", "--spec", str(spec)]) == 0  # registers the family
        yield name, text


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_an_mla_config_drafts_mla_that_matches_deepseek_v3(tmp_path, drafted_dsv3, seed: int) -> None:
    """DeepSeek-V3 (MLA with low-rank q, sigmoid grouped routing, shared experts): the draft,
    generated with `codegen --spec`, prefills 8 prompts with the reference's logits."""
    from dayzero.sdk.loader import open_checkpoint
    from dayzero.sdk.parity.runner import Ours, Reference, make_prompts
    from dayzero.sdk.parity.tiny import write_tiny

    name, text = drafted_dsv3
    assert "# check: MLA (kv_lora_rank 512, q_lora_rank 1536)" in text
    assert "# check: shared experts: drafted from n_shared_experts (2)" in text
    raw = yaml.safe_load(text)
    assert (
        raw["blocks"]["attn"]["kind"] == "mla"
        and raw["blocks"]["moe"]["shared_intermediate"] == "$shared_ffn"
    )
    ckpt = open_checkpoint(write_tiny(name, tmp_path / "ckpt", seed=seed), name)
    ours = Ours(ckpt, torch.device("cpu"), torch.float32)
    ref = Reference(ckpt, ckpt.folder, torch.device("cpu"), torch.float32)
    attn = ref.model.model.layers[1].self_attn
    mla = ours.cfg.layers[1].attn
    assert (mla.q_lora, mla.kv_lora, mla.nope_dim, mla.rope_dim) == (
        attn.q_lora_rank,
        attn.kv_lora_rank,
        attn.qk_nope_head_dim,
        attn.qk_rope_head_dim,
    )
    assert abs(mla.scale - attn.scaling) < 1e-12
    shared = ref.model.model.layers[1].mlp.shared_experts.gate_proj.out_features
    assert ours.cfg.layers[1].mlp.shared_intermediate == shared == 2 * ref.model.config.moe_intermediate_size
    prompts = make_prompts(ours.cfg.embedding.vocab, seed)
    got = ours.prefill_logits(prompts)
    err = max((a - ref.logits(p)).abs().max().item() for a, p in zip(got, prompts, strict=True))
    assert err < TOL, err


@pytest.mark.parametrize("config", ["Glm4Config", "Glm4MoeConfig"])
def test_partial_rotary_is_drafted_into_the_rope_fraction_and_flagged(tmp_path, config: str) -> None:
    """partial_rotary_factor (in rope_parameters since transformers 5) -> rope.fraction; the
    rotary channels equal the reference's rotary embedding's (2 x its inverse frequencies)."""
    import transformers

    cls = getattr(transformers, config)
    cfg = cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    spec, text = _draft(tmp_path, "partial", cfg)
    factor = cfg.rope_parameters["partial_rotary_factor"]
    assert f"# check: partial RoPE (partial_rotary_factor {factor})" in text
    gqa = _resolved(spec, cfg.to_dict(), "attn")
    rotary = getattr(transformers, config.replace("Config", "RotaryEmbedding"), None)
    if rotary is None:  # the rotary embedding class lives in the modeling module
        module = __import__(cls.__module__.replace("configuration", "modeling"), fromlist=["x"])
        rotary = getattr(module, config.replace("Config", "RotaryEmbedding"))
    assert gqa.rotary_dim == 2 * rotary(cfg).inv_freq.shape[0] == int(gqa.head_dim * factor)
    assert "rope_parameters.partial_rotary_factor" not in (yaml.safe_load(text).get("implements") or {})


def test_a_gated_shared_expert_is_drafted_and_its_tensors_mapped(tmp_path) -> None:
    """Qwen2-MoE: shared_expert_intermediate_size -> a sigmoid-gated shared expert of that width;
    every shared-expert tensor of a checkpoint saved by the reference class finds its parameter."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=48,
        num_experts=4,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    spec, text = _draft(tmp_path, "qmoe", cfg)
    assert "# check: shared expert: drafted from shared_expert_intermediate_size" in text
    moe = _resolved(spec, cfg.to_dict(), "moe")
    torch.manual_seed(0)
    ref = Qwen2MoeForCausalLM(cfg)
    shared = ref.model.layers[0].mlp.shared_expert
    assert moe.shared_gate and moe.shared_intermediate == shared.gate_proj.out_features == 48
    ref.save_pretrained(tmp_path / "ckpt")
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "pt") as f:
        names = [n for n in f.keys() if ".shared_expert" in n]  # noqa: SIM118 (not a dict)
    loaded = load_spec(spec)
    r = Resolver(loaded, cfg.to_dict(), "config.json")
    mapping = Mapping(loaded.spec.weights[0], r.value, layers=layer_plan(loaded.spec, r))
    got = {n: mapping.param_of(n) for n in names}
    assert len(got) == 2 * 4  # per layer: gate, up, down and the gate's weight
    assert got["model.layers.1.mlp.shared_expert_gate.weight"] == "layers.1.mlp.shared_gate"
    assert got["model.layers.0.mlp.shared_expert.down_proj.weight"] == "layers.0.mlp.shared.down"
    assert got["model.layers.0.mlp.shared_expert.gate_proj.weight"] == "layers.0.mlp.shared.gate_up"


def test_an_mla_config_without_a_q_latent_drafts_plain_q(tmp_path) -> None:
    """DeepSeek-V2-Lite's form (q_lora_rank null): q = x W_q (q_lora 0, the `q_proj` rule) and a
    tiny config that keeps q_lora_rank null (the config class's default is 1536)."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention

    cfg = DeepseekV2Config(q_lora_rank=None, hidden_size=64, num_attention_heads=4, num_key_value_heads=4)
    spec, text = _draft(tmp_path, "lite", cfg)
    raw = yaml.safe_load(text)
    assert raw["tiny"]["q_lora_rank"] is None
    assert {"from": "model.layers.{i}.self_attn.q_proj.weight", "to": "layers.{i}.attn.a_proj[q]"} in raw[
        "weights"
    ][0]["rules"]
    mla = _resolved(spec, cfg.to_dict(), "attn")
    cfg._attn_implementation = "eager"
    ref = DeepseekV2Attention(cfg, 0)
    assert mla.q_lora == 0 and ref.q_lora_rank is None
    assert (mla.heads, mla.kv_lora, mla.nope_dim, mla.rope_dim, mla.v_dim) == (
        ref.num_heads,
        ref.kv_lora_rank,
        ref.qk_nope_head_dim,
        ref.qk_rope_head_dim,
        ref.v_head_dim,
    )
    assert abs(mla.scale - ref.scaling) < 1e-12
