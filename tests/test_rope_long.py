"""RoPE scalings whose frequencies depend on the context: longrope's long factors (used by
dayzero for every position when max_position_embeddings > the original context, the long
context the checkpoint is served for) against transformers on prompts past the original
context, where transformers also takes the long factors; dynamic NTK (dayzero: the default
frequencies, which is transformers' within max_position_embeddings; no extension past it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dayzero.sdk.loader import open_checkpoint
from dayzero.sdk.parity.runner import Ours, Reference
from dayzero.sdk.parity.tiny import write_tiny

TOL = 1e-4  # fp32, CPU: the reference's own rounding differences (max |logit| about 4)
ORIG = 16
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "original_max_position_embeddings": ORIG,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
}


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_longrope_long_factors_match_transformers_past_the_original_context(tmp_path, seed: int) -> None:
    path = write_tiny(
        "llama", tmp_path / "ckpt", seed=seed,
        overrides={"rope_parameters": LONGROPE, "max_position_embeddings": 4 * ORIG},
    )  # fmt: skip
    ckpt = open_checkpoint(path)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 512, n).tolist() for n in (ORIG + 1, 3 * ORIG, 4 * ORIG - 2)]
    ours = Ours(ckpt, torch.device("cpu"), torch.float32).prefill_logits(prompts)
    ref = Reference(ckpt, path, torch.device("cpu"), torch.float32)
    for p, got in zip(prompts, ours, strict=True):
        want = ref.logits(p)
        assert (got - want).abs().max().item() <= TOL, len(p)
    # the long factors matter: transformers on a prompt within the original context takes the
    # short ones, and its logits there differ from dayzero's (which serves the long context)
    short = rng.integers(0, 512, ORIG - 2).tolist()
    (ours_short,) = Ours(ckpt, torch.device("cpu"), torch.float32).prefill_logits([short])
    assert (ours_short - ref.logits(short)).abs().max().item() > 100 * TOL
