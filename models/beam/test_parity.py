# generated from spec.yaml@f7e3e825befc, do not edit
"""Reflection Beam: parity against transformers.BeamForCausalLM on tiny random checkpoints.

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
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "sliding_window": 5,
        "num_experts": 8,
        "n_group": 2,
        "topk_group": 1,
        "num_experts_per_tok": 2,
    },
    {
        "num_hidden_layers": 5,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 32,
        "sliding_window": 16,
        "num_experts": 12,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 3,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "final_logit_softcapping": None,
    },
    {
        "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "mlp_layer_types": ["sparse", "dense", "sparse", "sparse"],
        "num_hidden_layers": 4,
        "sliding_window": 3,
        "n_group": 8,
        "topk_group": 3,
        "num_experts": 32,
        "num_experts_per_tok": 6,
    },
]
SEEDS = [0, 1, 7, 2026]


@pytest.mark.parametrize(
    ("shape", "seed"), [(i, SEEDS[(i + j) % len(SEEDS)]) for i in range(len(SHAPES)) for j in range(1)]
)
def test_parity(tmp_path, shape, seed):
    ckpt = write_tiny("beam", tmp_path / "ckpt", seed=seed, overrides=SHAPES[shape])
    report = run_parity(ckpt, device="cpu", seed=seed, new_tokens=16)
    assert report.ok, report.table()


@pytest.mark.parametrize(
    ("quantization", "layout"), [(q, lay) for q, lays in LAYOUTS.items() for lay in lays]
)
def test_quantized_parity(tmp_path, quantization, layout):
    ckpt = write_quantized_tiny("beam", tmp_path / "ckpt", quantization, layout, seed=5)
    report = run_parity(ckpt, device="cpu", seed=5, new_tokens=16, cache_checks=False)
    assert report.ok, report.table()
