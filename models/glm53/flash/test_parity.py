# generated from spec.yaml@49ccdfb43573, do not edit
"""GLM-5.3-Flash: parity against transformers.Glm5NextForConditionalGeneration on tiny random checkpoints.

Each shape (the spec's tiny config, then its `shapes` overrides) and each recorded seed writes
a checkpoint through the reference class and runs the full parity suite on CPU in fp32:
prefill logits at every position (max abs diff <= 1e-4), 32 greedy tokens identical with
logprobs within 1e-4, and the same in one mixed batch with chunked prefill, prefix-cache hits
and a forced retraction.
"""

import pytest

from dayzero.sdk.parity import run_parity
from dayzero.sdk.parity.tiny import write_tiny

SHAPES = [
    {
        "text_config": {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "index_topk": 64,
            "index_head_dim": 16,
            "index_n_heads": 4,
            "linear_num_heads": 4,
            "linear_head_dim": 16,
            "swiglu_limit": 2.0,
            "pad_token_id": 0,
            "max_position_embeddings": 512,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "num_heads": 2,
            "intermediate_size": 32,
            "out_hidden_size": 64,
            "projection_intermediate_size": 32,
        },
    },
    {
        "text_config": {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "n_routed_experts": 16,
            "num_experts_per_tok": 3,
            "index_topk": 64,
            "index_head_dim": 16,
            "index_n_heads": 4,
            "linear_num_heads": 2,
            "linear_head_dim": 32,
            "swiglu_limit": 2.0,
            "pad_token_id": 0,
            "max_position_embeddings": 512,
            "layer_types": [
                "linear_attention",
                "full_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            "indexer_types": ["full", "full", "shared", "full", "full", "full"],
            "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "dense", "sparse"],
            "linear_conv_kernel_dim": 3,
            "linear_lower_bound": None,
            "hc_mult": 3,
            "hc_sinkhorn_iters": 7,
            "n_group": 4,
            "topk_group": 2,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "num_heads": 2,
            "intermediate_size": 32,
            "out_hidden_size": 64,
            "projection_intermediate_size": 32,
        },
    },
    {
        "text_config": {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 32,
            "v_head_dim": 8,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "index_topk": 64,
            "index_head_dim": 16,
            "index_n_heads": 4,
            "linear_num_heads": 4,
            "linear_head_dim": 16,
            "swiglu_limit": 0.5,
            "pad_token_id": 0,
            "max_position_embeddings": 512,
            "index_kpool": 8,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "hc_mult": 2,
        },
        "vision_config": {
            "depth": 1,
            "hidden_size": 16,
            "num_heads": 2,
            "intermediate_size": 32,
            "out_hidden_size": 64,
            "projection_intermediate_size": 32,
        },
    },
]
SEEDS = [0, 1, 7, 2026]


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_parity(tmp_path, shape, seed):
    ckpt = write_tiny("glm53_flash", tmp_path / "ckpt", seed=seed, overrides=SHAPES[shape])
    report = run_parity(ckpt, device="cpu", seed=seed)
    assert report.ok, report.table()
