"""Kimi K3's config classes (the fact sheet's fields and release values, section 1): what the
spec resolves a checkpoint's config.json against, as transformers' config classes do for the
families it has. Written by hand (transformers has no class for K3); the parity reference,
tests/kimi_k3_reference.py, builds on them. The defaults are the release's (93 layers, MLA on
layers 4, 8, ..., 92 and 93 counted from 1)."""

from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig


class KimiK3TextConfig(PretrainedConfig):
    model_type = "kimi_linear"

    def __init__(
        self,
        vocab_size: int = 163840,
        hidden_size: int = 7168,
        intermediate_size: int = 33792,
        num_hidden_layers: int = 93,
        num_attention_heads: int = 96,
        num_key_value_heads: int = 96,
        hidden_act: str = "situ",
        activation_situ_beta: float = 4.0,
        activation_situ_linear_beta: float | None = 25.0,
        rms_norm_eps: float = 1e-5,
        mla_norm_eps: float | None = None,
        q_lora_rank: int | None = 1536,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_nope: bool = True,
        mla_use_output_gate: bool = True,
        num_experts: int | None = 896,
        num_experts_per_token: int = 16,
        num_shared_experts: int = 2,
        moe_intermediate_size: int = 3072,
        routed_expert_hidden_size: int | None = 3584,
        latent_moe_use_norm: bool = True,
        moe_renormalize: bool = True,
        moe_router_activation_func: str = "sigmoid",
        topk_method: str = "noaux_tc",
        use_grouped_topk: bool = True,
        num_expert_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        first_k_dense_replace: int = 1,
        moe_layer_freq: int = 1,
        attn_res_block_size: int | None = 12,
        num_nextn_predict_layers: int = 0,
        max_position_embeddings: int = 1048576,
        linear_attn_config: dict | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ) -> None:
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act, self.activation_situ_beta = hidden_act, activation_situ_beta
        self.activation_situ_linear_beta = activation_situ_linear_beta
        self.rms_norm_eps, self.mla_norm_eps = rms_norm_eps, mla_norm_eps
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = (
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
        )
        self.mla_use_nope, self.mla_use_output_gate = mla_use_nope, mla_use_output_gate
        self.num_experts, self.num_experts_per_token = num_experts, num_experts_per_token
        self.num_shared_experts, self.moe_intermediate_size = num_shared_experts, moe_intermediate_size
        self.routed_expert_hidden_size, self.latent_moe_use_norm = (
            routed_expert_hidden_size,
            latent_moe_use_norm,
        )
        self.moe_renormalize, self.moe_router_activation_func = moe_renormalize, moe_router_activation_func
        self.topk_method, self.use_grouped_topk = topk_method, use_grouped_topk
        self.num_expert_group, self.topk_group = num_expert_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.first_k_dense_replace, self.moe_layer_freq = first_k_dense_replace, moe_layer_freq
        self.attn_res_block_size = attn_res_block_size
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.max_position_embeddings = max_position_embeddings  # the context trained on (no RoPE)
        full = [*range(4, num_hidden_layers, 4), num_hidden_layers]  # the release's MLA layers (1-based)
        self.linear_attn_config = linear_attn_config or {
            "kda_layers": [i for i in range(1, num_hidden_layers + 1) if i not in full],
            "full_attn_layers": full,
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        }
        kwargs = {"bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839} | kwargs
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


class KimiK3Config(PretrainedConfig):
    model_type = "kimi_k3"
    sub_configs: ClassVar[dict] = {"text_config": KimiK3TextConfig}

    def __init__(
        self, text_config: dict | KimiK3TextConfig | None = None, vision_config: dict | None = None, **kw
    ):
        if not isinstance(text_config, KimiK3TextConfig):
            text_config = KimiK3TextConfig(**(text_config or {}))
        self.text_config, self.vision_config = text_config, vision_config
        super().__init__(**kw)
