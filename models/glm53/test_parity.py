# generated from spec.yaml@40d8a6bf3fef, do not edit
"""GLM-5.3: parity against transformers.GlmMoeDsaForCausalLM on tiny random checkpoints.

Each shape (the spec's tiny config, then with each of its `shapes` overrides) writes a checkpoint
through the reference class from its recorded seeds (1 a shape, shape i's from SEEDS[i] on,
so that the shapes run different seeds) and runs `dayzero.sdk.parity.run_parity` on CPU
in fp32 (its checks and tolerances are in that module's docstring).
Greedy checks: 16 tokens per prompt.

Quantized: the tiny config quantized by NVIDIA ModelOpt in every format, in ModelOpt's own
checkpoint convention (the others, the same numbers renamed, run on the families whose spec asks
for all of them) (sdk/parity/quantized_tiny.py); the reference runs on the dequantized weights.
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
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 24,
        "n_routed_experts": 16,
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
        "index_n_heads": 2,
        "index_head_dim": 8,
        "index_topk_pattern": "FSS",
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
        "num_hidden_layers": 5,
        "first_k_dense_replace": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 8,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "index_head_dim": 32,
        "index_topk": 96,
        "index_topk_pattern": "FSFSS",
        "attention_bias": True,
    },
    {
        "num_hidden_layers": 6,
        "index_topk_pattern": None,
        "index_topk_freq": 3,
        "index_skip_topk_offset": 1,
        "first_k_dense_replace": 2,
    },
]
SEEDS = [0, 1, 7, 2026]


@pytest.mark.parametrize(
    ("shape", "seed"), [(i, SEEDS[(i + j) % len(SEEDS)]) for i in range(len(SHAPES)) for j in range(1)]
)
def test_parity(tmp_path, shape, seed):
    ckpt = write_tiny("glm53", tmp_path / "ckpt", seed=seed, overrides=SHAPES[shape])
    report = run_parity(ckpt, device="cpu", seed=seed, new_tokens=16)
    assert report.ok, report.table()


@pytest.mark.parametrize(("quantization", "layout"), [(q, "modelopt") for q in LAYOUTS])
def test_quantized_parity(tmp_path, quantization, layout):
    ckpt = write_quantized_tiny("glm53", tmp_path / "ckpt", quantization, layout, seed=5)
    report = run_parity(ckpt, device="cpu", seed=5, new_tokens=16, cache_checks=False)
    assert report.ok, report.table()
