"""API fuzzing: Hypothesis-generated bodies (valid fields with wrong types and values, unknown fields,
non-JSON) against a live server; no response may be a 5xx, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fixture import Server

ORDINARY = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 40),
    st.just(10**12),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "logprobs",
    "top_logprobs",
    "ignore_eos",
    "stream_options",
    "stop_token_ids",
    "logit_bias",
    "max_completion_tokens",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "unknown_field",
]
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "bot"]),
        "content": st.one_of(st.text(max_size=20), VALUES),
    }
)
BODIES = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=6),
    st.fixed_dictionaries(
        {"prompt": st.text(max_size=30), "max_tokens": st.integers(-2, 6)},
        optional={k: VALUES for k in FIELDS[4:12]},
    ),
    st.fixed_dictionaries(
        {"messages": st.lists(MESSAGE, max_size=3), "max_tokens": st.integers(-2, 6)},
        optional={k: VALUES for k in FIELDS[4:12]},
    ),
)


@pytest.fixture(scope="module")
def server():
    s = Server("--max-num-seqs", "8", "--kv-cache-memory", "128MiB", "--max-model-len", "512")
    s.answer = httpx.post(f"{s.url}/v1/completions", json=ORDINARY, timeout=60).json()["choices"][0]["text"]
    yield s
    s.stop()


def post(http: httpx.Client, url: str, content: bytes, stream: bool) -> httpx.Response:
    """POST a JSON body; a stream is read to its end (a server that breaks mid-stream fails)."""
    headers = {"content-type": "application/json"}
    if not stream:
        return http.post(url, content=content, headers=headers)
    with http.stream("POST", url, content=content, headers=headers) as r:
        r.read()
    return r


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=BODIES,
    raw=st.one_of(st.none(), st.binary(max_size=20)),
)
def test_no_body_makes_a_5xx(server, path: str, body: dict, raw: bytes | None) -> None:
    if isinstance(body.get("max_tokens"), int) or "max_tokens" not in body:
        body.setdefault("max_tokens", 4)  # keep generations short
    content = raw if raw is not None else json.dumps(body, allow_nan=True).encode()
    with httpx.Client(timeout=120) as http:
        r = post(http, f"{server.url}{path}", content, stream=body.get("stream") is True and raw is None)
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.status_code >= 400:
        assert "error" in r.json()


NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, float("nan"), float("inf")]),
)
NUMERIC = {  # every numeric field, where it sits in a body
    "max_tokens": NUMBERS,
    "max_completion_tokens": NUMBERS,
    "temperature": NUMBERS,
    "top_p": NUMBERS,
    "top_k": NUMBERS,
    "min_p": NUMBERS,
    "seed": NUMBERS,
    "n": NUMBERS,
    "presence_penalty": NUMBERS,
    "frequency_penalty": NUMBERS,
    "repetition_penalty": NUMBERS,
    "min_tokens": NUMBERS,
    "logprobs": NUMBERS,
    "top_logprobs": NUMBERS,
    "stop_token_ids": st.lists(NUMBERS, min_size=1, max_size=2),
    "logit_bias": st.dictionaries(st.integers(-(2**70), 2**70).map(str), NUMBERS, min_size=1, max_size=2),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chat=st.booleans(),
    numbers=st.fixed_dictionaries({}, optional=NUMERIC),
    prompt_ids=st.one_of(st.none(), st.lists(NUMBERS, min_size=1, max_size=2)),
)
def test_out_of_range_numbers_are_4xx_and_leave_the_server_serving(
    server, chat: bool, numbers: dict, prompt_ids: list | None
) -> None:
    """Integers up to 2^70 and floats with NaN / inf in every numeric field: never a 5xx nor a hang,
    and the next ordinary request still answers correctly."""
    body = {"max_tokens": 2} | numbers
    if chat:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = prompt_ids if prompt_ids is not None else "Hi"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    content = json.dumps(body, allow_nan=True).encode()
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"})
        assert r.status_code < 500, (r.status_code, r.text[:500], body)
        if r.status_code >= 400:
            assert r.json()["error"]["param"], r.text
        ok = http.post(f"{server.url}/v1/completions", json=ORDINARY)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == server.answer, ok.text


def test_still_serving_after_the_fuzz(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# ---- tools, tool_choice, response_format, echo, prompt lists, /tokenize and /detokenize --------
# Against a server whose template takes tools and which parses Hermes calls. Strings may carry
# lone surrogate escapes, which st.text never draws: they are spliced into the JSON text.
SURROGATE = "\udcff"  # written by json.dumps as the escape "\udcff"
WORDS = st.one_of(st.text(max_size=10), st.just(SURROGATE), st.just("a" + SURROGATE + "b"))
SCHEMA = st.one_of(
    st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    st.just({"type": "boolean"}),
    st.just({"type": "nonsense"}),
    VALUES,
)
TOOL = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "other"]), "function": st.fixed_dictionaries(
        {"name": WORDS}, optional={"description": WORDS, "parameters": SCHEMA, "strict": st.booleans()})}
)  # fmt: skip
TOOL_CHOICE = st.one_of(
    st.sampled_from(["auto", "none", "required", "sometimes"]),
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": WORDS})}),
    VALUES,
)
RESPONSE_FORMAT = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text", "yaml"])}),
    st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"name": WORDS}, optional={"schema": SCHEMA, "strict": st.booleans()})}
    ),
    VALUES,
)  # fmt: skip
CALL = st.fixed_dictionaries(
    {"id": WORDS, "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": WORDS, "arguments": st.one_of(WORDS, st.just('{"a": 1}'))})}
)  # fmt: skip
TURN = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": WORDS}),
    st.fixed_dictionaries({"role": st.just("assistant"), "tool_calls": st.lists(CALL, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("tool"), "tool_call_id": WORDS, "content": WORDS}),
)
TOOL_BODIES = st.fixed_dictionaries(
    {"messages": st.lists(TURN, min_size=1, max_size=3), "max_tokens": st.integers(1, 4)},
    optional={
        "tools": st.lists(TOOL, max_size=2), "tool_choice": TOOL_CHOICE, "response_format": RESPONSE_FORMAT,
        "parallel_tool_calls": st.booleans(), "stream": st.booleans(), "min_tokens": st.integers(0, 4),
    },
)  # fmt: skip
PROMPTS = st.one_of(
    WORDS, st.lists(WORDS, min_size=1, max_size=3), st.lists(st.integers(-5, 60000), max_size=3)
)
COMPLETION_BODIES = st.fixed_dictionaries(
    {"prompt": PROMPTS, "max_tokens": st.integers(1, 4)},
    optional={"echo": st.booleans(), "response_format": RESPONSE_FORMAT, "n": st.integers(1, 3),
              "logprobs": st.one_of(st.none(), st.integers(0, 3)), "stream": st.booleans()},
)  # fmt: skip
TOKENIZE_BODIES = st.one_of(
    st.fixed_dictionaries({"prompt": WORDS}, optional={"add_special_tokens": st.booleans()}),
    st.fixed_dictionaries(
        {"messages": st.lists(TURN, min_size=1, max_size=2)}, optional={"tools": st.lists(TOOL, max_size=2)}
    ),
)
DETOKENIZE_BODIES = st.fixed_dictionaries({"tokens": st.lists(st.integers(-(2**40), 2**40), max_size=4)})


@pytest.fixture(scope="module")
def tools_server():
    from pathlib import Path

    template = Path(__file__).parent / "data" / "tools_template.jinja"
    s = Server("--chat-template", str(template), "--tool-call-parser", "hermes", "--max-model-len", "512")
    s.answer = httpx.post(f"{s.url}/v1/completions", json=ORDINARY, timeout=60).json()["choices"][0]["text"]
    yield s
    s.stop()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target=st.one_of(
        st.tuples(st.just("/v1/chat/completions"), TOOL_BODIES),
        st.tuples(st.just("/v1/completions"), COMPLETION_BODIES),
        st.tuples(st.just("/tokenize"), TOKENIZE_BODIES),
        st.tuples(st.just("/detokenize"), DETOKENIZE_BODIES),
    )
)
def test_tools_formats_and_token_routes_never_5xx(tools_server, target: tuple[str, dict]) -> None:
    """Tools, tool_choice, response_format (schemas xgrammar refuses too), echo, prompt lists,
    /tokenize and /detokenize, with lone surrogates in any string: never a 5xx nor a hang, an
    error in OpenAI's shape, and the next ordinary request answers as before."""
    path, body = target
    content = json.dumps(body).encode()  # a lone surrogate goes out as its \\u escape
    with httpx.Client(timeout=120) as http:
        r = post(http, f"{tools_server.url}{path}", content, stream=body.get("stream") is True)
        assert r.status_code < 500, (r.status_code, r.text[:500], body)
        if r.status_code >= 400:
            assert r.json()["error"]["message"], r.text
        ok = http.post(f"{tools_server.url}/v1/completions", json=ORDINARY)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == tools_server.answer, ok.text
