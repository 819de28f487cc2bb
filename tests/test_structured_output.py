"""Structured output (sdk/engine/grammar.py, xgrammar): the bitmask the sampler applies against a
loop over the bits, and the embedded default (SmolLM2) constrained to JSON: every answer parses
and matches its schema, greedy and sampled, with overlap on and off, through the engine and
through the server's response_format with the openai client; a bad schema is a 400."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from conftest import SEEDS
from server_fixture import Server

from dayzero.kernels.reference.sampling import allowed_only
from dayzero.sdk.api import LLM
from dayzero.sdk.engine.engine import EngineConfig, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("seed", SEEDS)
def test_the_bitmask_leaves_only_the_allowed_tokens(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    v = 70  # not a multiple of 32: the last word is partly past the vocabulary
    allowed = torch.rand(3, v, generator=g) < 0.3
    words = torch.zeros(3, 3, dtype=torch.int64)
    for s in range(3):
        for t in allowed[s].nonzero().flatten().tolist():
            words[s, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # int32 words
    logits = torch.randn(3, v, generator=g)
    got = allowed_only(logits, bitmask)
    assert torch.equal(torch.isfinite(got), allowed)
    assert torch.equal(got[allowed], logits[allowed])


@pytest.fixture(scope="module")
def llm_pair():
    cfg = dict(kv_cache_bytes=64 << 20, max_batch_size=4)
    return {o: LLM(progress=False, engine=EngineConfig(overlap=o, **cfg)) for o in ("off", "on")}


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_constrained_answers_parse_and_follow_the_schema(llm_pair, overlap: str) -> None:
    llm = llm_pair[overlap]
    prompts = ["Give a city and its population as JSON.", "Which city is the capital of France?"]
    params = [
        SamplingParams(max_tokens=48, temperature=0, grammar=llm.grammars.json(SCHEMA)),
        SamplingParams(max_tokens=48, temperature=1.0, seed=5, grammar=llm.grammars.json(SCHEMA)),
        SamplingParams(max_tokens=48, temperature=0.8, seed=6, grammar=llm.grammars.json(SCHEMA)),
    ]
    outs = llm.engine.generate([llm.encode(p) for p in prompts + prompts[:1]], params)
    for out in outs:
        text = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.finish_reason == "stop", (text, out.finish_reason)
        obj = json.loads(text)
        assert set(obj) == {"city", "population"} and isinstance(obj["population"], int), obj
    # any JSON object: unbounded in length, so a cut answer is allowed; a finished one parses
    (out,) = llm.engine.generate(
        [llm.encode("Reply with a JSON object.")],
        [SamplingParams(max_tokens=64, temperature=0, grammar=llm.grammars.json())],
    )
    text = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert text.lstrip().startswith("{") and (
        out.finish_reason == "length" or isinstance(json.loads(text), dict)
    )
    assert not llm.engine.matchers  # every request's matcher is gone once it finished


def test_response_format_through_the_server() -> None:
    srv = Server()
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Name a city and its population."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    try:
        for seed in (1, 2, 3):
            r = client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=48, temperature=1.0, seed=seed,
                response_format=fmt,
            )  # fmt: skip
            obj = json.loads(r.choices[0].message.content)
            assert set(obj) == {"city", "population"}, obj
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=64, temperature=0,
            response_format={"type": "json_object"},
        )  # fmt: skip
        c = r.choices[0]
        assert c.message.content.lstrip().startswith("{")
        assert c.finish_reason == "length" or isinstance(json.loads(c.message.content), dict)
        bad = {
            "messages": msgs,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
        }
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}, timeout=60)
        assert r.status_code == 200  # the server is unaffected
    finally:
        srv.stop()
