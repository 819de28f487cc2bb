"""The independent Kimi K3 reference (tests/kimi_k3_reference.py) cross-checked where
transformers can: with K3's extras off (plain pre-norm instead of AttnRes, the low-rank KDA
gate, the softplus decay without a bound, no MLA output gate, experts at the hidden width,
SwiGLU) it must give transformers' `kimi_linear` logits on the same weights, at every position
of random prompts (fp32, several seeds). Then K3's own extras must each change the logits."""

from __future__ import annotations

import pytest
import torch
from conftest import SEEDS
from kimi_k3_reference import KimiK3Config, KimiK3ForCausalLM

TOL = 1e-4  # relative to the largest logit: the reference's token loop vs kimi_linear's chunked KDA


def _kimi_linear(seed: int):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    hf = KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=8,
        num_experts_per_token=2, linear_head_dim=16, linear_num_heads=4, first_k_dense_replace=1,
        layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 4, routed_scaling_factor=2.5, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    hf._attn_implementation = "eager"
    torch.manual_seed(seed)
    ref = KimiLinearForCausalLM(hf).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(torch.randn(p.shape) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 10) + (p.dim() == 1))
            if name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape) * 0.5)
        for layer in ref.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    return hf, ref


def _k3_off(hf, extras: dict | None = None) -> KimiK3ForCausalLM:
    text = {
        "vocab_size": hf.vocab_size, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 5,
        "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_act": "silu",
        "rms_norm_eps": hf.rms_norm_eps,
        "mla_norm_eps": 1e-6, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_output_gate": False, "num_experts": 8,
        "num_experts_per_token": 2, "num_shared_experts": 1, "moe_intermediate_size": 24,
        "routed_expert_hidden_size": None, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
        "attn_res_block_size": None,
        "linear_attn_config": {"kda_layers": [1, 2, 3, 5], "full_attn_layers": [4], "num_heads": 4,
                               "head_dim": 16, "short_conv_kernel_size": 4, "use_full_rank_gate": False,
                               "gate_lower_bound": None},
    }  # fmt: skip
    for k, v in (extras or {}).items():
        if k in text["linear_attn_config"]:
            text["linear_attn_config"] = text["linear_attn_config"] | {k: v}
        else:
            text[k] = v
    return KimiK3ForCausalLM(KimiK3Config(text_config=text)).eval()


def _copy(ref, ours: KimiK3ForCausalLM) -> None:
    """kimi_linear's (HF-converted) tensors into the release's names (fact sheet section 2.5)."""
    lm, m = ours.language_model, ref.model
    with torch.no_grad():
        lm.model.embed_tokens.weight.copy_(m.embed_tokens.weight)
        lm.model.norm.weight.copy_(m.norm.weight)
        lm.lm_head.weight.copy_(ref.lm_head.weight)
        for a, b in zip(m.layers, lm.model.layers, strict=True):
            b.input_layernorm.weight.copy_(a.input_layernorm.weight)
            b.post_attention_layernorm.weight.copy_(a.post_attention_layernorm.weight)
            at, bt = a.self_attn, b.self_attn
            if hasattr(at, "forget_gate"):
                for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj", "o_norm"):
                    if hasattr(bt, n):  # a full-rank gate (g_proj) keeps its own random weight
                        getattr(bt, n).weight.copy_(getattr(at, n).weight)
                for conv, w in zip(
                    (bt.q_conv1d, bt.k_conv1d, bt.v_conv1d), at.conv1d.weight.chunk(3), strict=True
                ):
                    conv.weight.copy_(w)
                bt.f_a_proj.weight.copy_(at.forget_gate.f_a_proj.weight)
                bt.f_b_proj.weight.copy_(at.forget_gate.f_b_proj.weight)
                bt.dt_bias.copy_(at.forget_gate.dt_bias)
                bt.A_log.zero_()
                bt.A_log[: bt.h].copy_(at.forget_gate.A_log.flatten())
            else:
                for n in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                          "kv_b_proj", "o_proj"):  # fmt: skip
                    getattr(bt, n).weight.copy_(getattr(at, n).weight)  # a gate's g_proj stays random
            if b.mlp is not None:
                for n in ("gate_proj", "up_proj", "down_proj"):
                    getattr(b.mlp, n).weight.copy_(getattr(a.mlp, n).weight)
                continue
            moe, src = b.block_sparse_moe, a.mlp
            moe.gate.weight.copy_(src.gate.weight)
            moe.gate.e_score_correction_bias.copy_(src.gate.e_score_correction_bias)
            for e, ex in enumerate(
                moe.experts if moe.routed_expert_down_proj is None else ()
            ):  # latent: random
                g, u = src.experts.gate_up_proj[e].chunk(2)
                ex.w1.weight.copy_(g)
                ex.w3.weight.copy_(u)
                ex.w2.weight.copy_(src.experts.down_proj[e])
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(moe.shared_experts, n).weight.copy_(getattr(src.shared_experts, n).weight)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_with_the_extras_off_it_is_kimi_linear(seed: int) -> None:
    hf, ref = _kimi_linear(seed)
    ours = _k3_off(hf)
    _copy(ref, ours)
    ids = torch.randint(
        0, hf.vocab_size, (2, 70), generator=torch.Generator().manual_seed(seed)
    )  # > one chunk
    with torch.no_grad():
        want, got = ref(ids).logits, ours(ids).logits
    assert _rel(got, want) < TOL


@pytest.mark.parametrize(
    "extra",
    [{"attn_res_block_size": 2}, {"use_full_rank_gate": True}, {"gate_lower_bound": -5.0},
     {"mla_use_output_gate": True}, {"routed_expert_hidden_size": 32}, {"hidden_act": "situ"}],
)  # fmt: skip
def test_each_k3_extra_changes_the_logits(extra: dict) -> None:
    """Each extra on its own (its new tensors random) moves the logits away from kimi_linear's."""
    hf, ref = _kimi_linear(SEEDS[0])
    ours = _k3_off(hf, extra)
    _copy(ref, ours)
    ids = torch.randint(0, hf.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _rel(ours(ids).logits, ref(ids).logits) > 1e-3


def test_the_release_names_round_trip_and_greedy_decoding_recomputes(tmp_path) -> None:
    """The fact sheet's tiny config (AttnRes over blocks of 2, SiTU, latent MoE, gated NoPE-MLA on
    layer 4, full-rank bounded KDA): saved and loaded by name with nothing missing or unused,
    the same logits, the release's tensor names, and generate's greedy tokens equal to the
    argmax of a full recompute (no cache)."""
    from dayzero.sdk.families import FAMILIES

    ours = KimiK3ForCausalLM(KimiK3Config(**FAMILIES.get("kimi_k3").spec.spec.tiny)).eval()
    names = set(ours.state_dict())
    for name in (
        "language_model.model.output_attn_res_proj.weight",
        "language_model.model.layers.0.self_attention_res_norm.weight",
        "language_model.model.layers.1.self_attn.g_proj.weight",
        "language_model.model.layers.1.self_attn.A_log",
        "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
        "language_model.model.layers.3.self_attn.g_proj.weight",
        "language_model.model.layers.2.block_sparse_moe.routed_expert_norm.weight",
        "language_model.model.layers.2.block_sparse_moe.experts.7.w3.weight",
        "language_model.model.layers.0.mlp.gate_proj.weight",
    ):
        assert name in names, name
    assert ours.language_model.model.layers[1].self_attn.A_log.shape == (16,)  # [max(h, d)], zero padded
    ours.save_pretrained(tmp_path)
    again, info = KimiK3ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(SEEDS[0]))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, again.eval()(ids).logits)
        out = again.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                             do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
        assert out[0, 9:].tolist() == again(out[:, :-1]).logits[0, -4:].argmax(-1).tolist()
