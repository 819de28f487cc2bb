# generated from spec.yaml@618a2e0e07e1, do not edit
"""Qwen3.8: parity against transformers.Qwen3_5MoeForCausalLM on tiny random checkpoints.

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

SHAPES = [{}]
SEEDS = [0, 1, 7, 2026]


@pytest.mark.parametrize(
    ("shape", "seed"), [(i, SEEDS[(i + j) % len(SEEDS)]) for i in range(len(SHAPES)) for j in range(1)]
)
def test_parity(tmp_path, shape, seed):
    ckpt = write_tiny("qwen38", tmp_path / "ckpt", seed=seed, overrides=SHAPES[shape])
    report = run_parity(ckpt, device="cpu", seed=seed, new_tokens=16)
    assert report.ok, report.table()


@pytest.mark.parametrize(("quantization", "layout"), [(q, "modelopt") for q in LAYOUTS])
def test_quantized_parity(tmp_path, quantization, layout):
    ckpt = write_quantized_tiny("qwen38", tmp_path / "ckpt", quantization, layout, seed=5)
    report = run_parity(ckpt, device="cpu", seed=5, new_tokens=16, cache_checks=False)
    assert report.ok, report.table()
