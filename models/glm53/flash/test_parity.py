# generated from spec.yaml@78f1789229d9, do not edit
"""GLM-5.3-Flash: parity against transformers.Glm5NextForConditionalGeneration on tiny random checkpoints.

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
        "text_config": {
            "num_hidden_layers": 6,
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
            "linear_num_heads": 2,
            "linear_head_dim": 32,
            "linear_conv_kernel_dim": 3,
            "linear_lower_bound": None,
            "hc_mult": 3,
            "hc_sinkhorn_iters": 7,
            "n_routed_experts": 16,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 3,
        }
    },
    {
        "text_config": {
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "qk_nope_head_dim": 32,
            "v_head_dim": 8,
            "index_kpool": 8,
            "index_topk": 64,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "swiglu_limit": 0.5,
            "hc_mult": 2,
        }
    },
    {
        "text_config": {
            "num_hidden_layers": 6,
            "layer_types": [
                "full_attention",
                "full_attention",
                "linear_attention",
                "full_attention",
                "full_attention",
                "linear_attention",
            ],
            "index_topk_freq": 3,
            "index_skip_topk_offset": 1,
        }
    },
]
SEEDS = [0, 1, 7, 2026]


@pytest.mark.parametrize(
    ("shape", "seed"), [(i, SEEDS[(i + j) % len(SEEDS)]) for i in range(len(SHAPES)) for j in range(1)]
)
def test_parity(tmp_path, shape, seed):
    ckpt = write_tiny("glm53_flash", tmp_path / "ckpt", seed=seed, overrides=SHAPES[shape])
    report = run_parity(ckpt, device="cpu", seed=seed, new_tokens=16)
    assert report.ok, report.table()


@pytest.mark.parametrize(("quantization", "layout"), [(q, "modelopt") for q in LAYOUTS])
def test_quantized_parity(tmp_path, quantization, layout):
    ckpt = write_quantized_tiny("glm53_flash", tmp_path / "ckpt", quantization, layout, seed=5)
    report = run_parity(ckpt, device="cpu", seed=5, new_tokens=16, cache_checks=False)
    assert report.ok, report.table()
