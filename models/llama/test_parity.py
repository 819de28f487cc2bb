# generated from spec.yaml@d6c0f885b68c, do not edit
"""Llama: parity against transformers.LlamaForCausalLM on tiny random checkpoints.

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
        "intermediate_size": 160,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
    },
    {
        "vocab_size": 512,
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "head_dim": 24,
    },
    {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "attention_bias": True,
    },
    {
        "vocab_size": 512,
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    },
]
SEEDS = [0, 1, 7, 2026]


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_parity(tmp_path, shape, seed):
    ckpt = write_tiny("llama", tmp_path / "ckpt", seed=seed, overrides=SHAPES[shape])
    report = run_parity(ckpt, device="cpu", seed=seed)
    assert report.ok, report.table()
