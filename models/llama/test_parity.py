# generated from spec.yaml@8659430fa18c, do not edit
"""Llama: parity against transformers.LlamaForCausalLM on tiny random checkpoints.

Each shape (the spec's tiny config, then with each of its `shapes` overrides) writes a checkpoint
through the reference class from its recorded seeds (1 a shape, shape i's from SEEDS[i] on,
so that the shapes run different seeds) and runs `dayzero.sdk.parity.run_parity` on CPU
in fp32 (its checks and tolerances are in that module's docstring).
Greedy checks: 16 tokens per prompt.

Quantized: the tiny config quantized by NVIDIA ModelOpt in every format and checkpoint
convention dayzero reads (sdk/parity/quantized_tiny.py); the reference runs on the dequantized weights.
Their parity runs the checks that read weights (prefill logits, greedy, mixed batch): the cache
checks see no difference between formats.
"""

import pytest

from dayzero.sdk.parity import run_parity
from dayzero.sdk.parity.quantized_tiny import LAYOUTS, write_quantized_tiny
from dayzero.sdk.parity.tiny import write_tiny

SHAPES = [
    {},
    {
        "hidden_size": 96,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 24,
        "tie_word_embeddings": True,
    },
    {"num_attention_heads": 4, "num_key_value_heads": 4, "attention_bias": True, "num_hidden_layers": 2},
    {
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "hidden_size": 96,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    },
    {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    },
    {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    {
        "rope_parameters": {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "attention_factor": 1.2,
            "original_max_position_embeddings": 512,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
        }
    },
]
SEEDS = [0, 1, 7, 2026]


@pytest.mark.parametrize(
    ("shape", "seed"), [(i, SEEDS[(i + j) % len(SEEDS)]) for i in range(len(SHAPES)) for j in range(1)]
)
def test_parity(tmp_path, shape, seed):
    ckpt = write_tiny("llama", tmp_path / "ckpt", seed=seed, overrides=SHAPES[shape])
    report = run_parity(ckpt, device="cpu", seed=seed, new_tokens=16)
    assert report.ok, report.table()


@pytest.mark.parametrize(
    ("quantization", "layout"), [(q, lay) for q, lays in LAYOUTS.items() for lay in lays]
)
def test_quantized_parity(tmp_path, quantization, layout):
    ckpt = write_quantized_tiny("llama", tmp_path / "ckpt", quantization, layout, seed=5)
    report = run_parity(ckpt, device="cpu", seed=5, new_tokens=16, cache_checks=False)
    assert report.ok, report.table()
