# generated from spec.yaml@2336bc5d7f66, do not edit
"""Kimi K3: parity against kimi_k3_reference.KimiK3ForCausalLM on tiny random checkpoints.

Each shape (the spec's tiny config, then with each of its `shapes` overrides) writes a checkpoint
through the reference class from its recorded seeds (1 a shape, shape i's from SEEDS[i] on,
so that the shapes run different seeds) and runs `dayzero.sdk.parity.run_parity` on CPU
in fp32 (its checks and tolerances are in that module's docstring).
Greedy checks: 8 tokens per prompt.

Quantized: the tiny config quantized by NVIDIA ModelOpt in the release's layouts, each over the
modules the release quantizes (sdk/parity/quantized_tiny.py); the reference runs on the
dequantized weights. Their parity runs the checks that read weights (prefill logits, greedy,
mixed batch): the cache checks see no difference between formats.
"""

import pytest

from dayzero.sdk.parity import run_parity
from dayzero.sdk.parity.quantized_tiny import write_quantized_tiny
from dayzero.sdk.parity.tiny import write_tiny

SHAPES = [
    {},
    {
        "text_config": {
            "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3]},
            "latent_moe_use_norm": False,
        }
    },
]
SEEDS = [0, 1, 7, 2026]


@pytest.mark.parametrize(
    ("shape", "seed"), [(i, SEEDS[(i + j) % len(SEEDS)]) for i in range(len(SHAPES)) for j in range(1)]
)
def test_parity(tmp_path, shape, seed):
    ckpt = write_tiny("kimi_k3", tmp_path / "ckpt", seed=seed, overrides=SHAPES[shape])
    report = run_parity(ckpt, device="cpu", seed=seed, new_tokens=8)
    assert report.ok, report.table()


RELEASE_LAYOUTS = {
    "mxfp4/compressed_tensors": ["*.block_sparse_moe.experts.*"],
    "mixed/modelopt": ["*.block_sparse_moe.experts.*", "*.self_attn.*"],
}


@pytest.mark.parametrize("layout", list(RELEASE_LAYOUTS))
def test_quantized_parity(tmp_path, layout):
    quantization, convention = layout.split("/")
    ckpt = write_quantized_tiny(
        "kimi_k3", tmp_path / "ckpt", quantization, convention, seed=5, modules=RELEASE_LAYOUTS[layout]
    )
    report = run_parity(ckpt, device="cpu", seed=5, new_tokens=8, cache_checks=False)
    assert report.ok, report.table()
