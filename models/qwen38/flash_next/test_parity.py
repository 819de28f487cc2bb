# generated from spec.yaml@220216eebc82, do not edit
"""Qwen3.8-Flash-Next: parity against transformers.Qwen4ExpForCausalLM on tiny random checkpoints.

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
        "ple_layer_ids": [],
        "hc_count": 4,
        "output_gate_type": "sigmoid",
        "norm_topk_prob": False,
        "layer_types": ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        "indexer_compress_ratio": 8,
        "indexer_n_heads": 1,
    },
    {
        "num_hidden_layers": 5,
        "layer_types": [
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        "ple_layer_ids": [1, 2, 4],
        "ngram_size": 4,
        "heads_per_ngram": 3,
        "ple_embed_dim": 36,
        "ple_conv_kernel_size": 2,
        "split_ngram_parts": 1,
        "hc_count": 2,
        "hc_lowrank": 8,
    },
]
SEEDS = [0, 1, 7, 2026]


@pytest.mark.parametrize(
    ("shape", "seed"), [(i, SEEDS[(i + j) % len(SEEDS)]) for i in range(len(SHAPES)) for j in range(1)]
)
def test_parity(tmp_path, shape, seed):
    ckpt = write_tiny("qwen38_flash_next", tmp_path / "ckpt", seed=seed, overrides=SHAPES[shape])
    report = run_parity(ckpt, device="cpu", seed=seed, new_tokens=16)
    assert report.ok, report.table()


@pytest.mark.parametrize(("quantization", "layout"), [(q, "modelopt") for q in LAYOUTS])
def test_quantized_parity(tmp_path, quantization, layout):
    ckpt = write_quantized_tiny("qwen38_flash_next", tmp_path / "ckpt", quantization, layout, seed=5)
    report = run_parity(ckpt, device="cpu", seed=5, new_tokens=16, cache_checks=False)
    assert report.ok, report.table()
