"""RoPE scalings whose frequencies depend on the context: longrope's long factors (used by
dayzero for every position when max_position_embeddings > the original context, the long
context the checkpoint is served for) against transformers on prompts past the original
context, where transformers also takes the long factors; dynamic NTK (dayzero: the default
frequencies, which is transformers' within max_position_embeddings; no extension past it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dayzero.sdk.engine.engine import SamplingParams
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


# Phi-3's longrope with partial RoPE: head_dim 16, partial_rotary_factor 0.5 -> 8 rotary
# channels, 4 factors each.
PHI3_ROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "short_factor": [1.0, 1.2, 1.6, 2.4],
    "long_factor": [1.0, 3.0, 9.0, 27.0],
}


def _as_on_the_hub(path: Path) -> None:
    """config.json as Phi-3's on the hub: a legacy rope_scaling {type, short_factor, long_factor},
    rope_theta, partial_rotary_factor and original_max_position_embeddings at the top level."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_scaling"] = {
        "type": "longrope",
        "short_factor": rope["short_factor"],
        "long_factor": rope["long_factor"],
    }
    cfg |= {"rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"]}
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(("seed", "max_pos"), [(2, 4 * ORIG), (5, ORIG)])
def test_phi3_longrope_with_partial_rotary_matches_transformers(tmp_path, seed: int, max_pos: int) -> None:
    """max_pos 4 x ORIG (config.json in the hub's legacy form): the long factors and attention
    factor sqrt(1 + ln 4 / ln 16), on prompts past the original context and 6 greedy tokens
    after one; max_pos = ORIG (transformers' rope_parameters): the short factors (transformers'
    choice within the original context), on a prompt inside it."""
    overrides = {
        "rope_parameters": PHI3_ROPE,
        "original_max_position_embeddings": ORIG,
        "max_position_embeddings": max_pos,
    }
    path = write_tiny("phi3", tmp_path / "ckpt", seed=seed, overrides=overrides)
    if max_pos > ORIG:
        _as_on_the_hub(path)
    ckpt = open_checkpoint(path)
    rope = dict(ckpt.family.config(ckpt.hf).layers[0].attn.rope_params)
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == ORIG
    rng = np.random.default_rng(seed)
    lengths = (ORIG + 1, 3 * ORIG) if max_pos > ORIG else (ORIG - 3,)
    prompts = [rng.integers(0, 512, n).tolist() for n in lengths]
    cpu = torch.device("cpu")
    ours = Ours(ckpt, cpu, torch.float32)
    ref = Reference(ckpt, path, cpu, torch.float32)
    errs = [
        (got - ref.logits(p)).abs().max().item()
        for got, p in zip(ours.prefill_logits(prompts), prompts, strict=True)
    ]
    assert max(errs) <= TOL, dict(zip(lengths, errs, strict=True))
    if max_pos > ORIG:  # decode past the original context: transformers keeps the long factors
        new = 6
        (out,) = ours.engine(max_batch_size=1).generate(
            [prompts[0]], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        )
        toks, lps = ref.greedy(prompts[0], new)
        assert out.token_ids == toks
        lp_err = float(np.max(np.abs(np.array(out.logprobs) - np.array(lps))))
        assert lp_err <= TOL, lp_err
        print(f"phi3 longrope max_pos {max_pos}: max |dlogit| {max(errs):.2e}, max |dlogprob| {lp_err:.2e}")
    else:
        print(f"phi3 longrope max_pos {max_pos}: max |dlogit| {max(errs):.2e}")
