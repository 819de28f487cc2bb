"""Tool calls: each format's parser on whole answers and on every way a stream can split them
(sdk/server/tools.py), and the server's request side over HTTP with the openai client: tools
and earlier calls / results rendered through the chat template, missing-parser refusals. (No
model in CI emits calls of these formats reliably, so the formats are covered by the parser and
stream tests, and end to end with the model's sampler scripted to write them
(tests/scripted_kernels.py); calls the model generates, held by a grammar, are
tests/test_tool_choice.py.)"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_fixture import Server

from dayzero.sdk.server.tools import TOOL_PARSERS, ToolStream

WEATHER = {"city": "Paris", "days": 3, "units": {"t": "C"}}
ANSWERS = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": ' + json.dumps(WEATHER) + "}\n"
    '</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>',
    "glm45": "Let me check.<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    '<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>units</arg_key>\n<arg_value>{"t": "C"}'
    "</arg_value>\n</tool_call><tool_call>time\n</tool_call>",
    "kimi_k2": "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0"
    "<|tool_call_argument_begin|>" + json.dumps(WEATHER) + "<|tool_call_end|><|tool_call_begin|>"
    "functions.time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
}


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
def test_parsers_read_calls_and_content(fmt: str) -> None:
    content, calls = TOOL_PARSERS.get(fmt).parse(ANSWERS[fmt])
    assert content.strip() == "Let me check."
    assert [c.name for c in calls] == ["weather", "time"]
    assert json.loads(calls[0].arguments) == WEATHER and json.loads(calls[1].arguments) == {}
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
def test_text_without_a_complete_call_stays_content(fmt: str) -> None:
    parser = TOOL_PARSERS.get(fmt)
    broken = ANSWERS[fmt].replace('"city"', "city")  # hermes / kimi: no longer JSON
    for text in ("No tools needed, the answer is 4.", ANSWERS[fmt][:40]):
        assert parser.parse(text) == (text, [])
    if fmt != "glm45":  # a first call that is not JSON: no call is taken, all of it stays content
        assert parser.parse(broken) == (broken, [])


@pytest.mark.parametrize("fmt", sorted(ANSWERS))
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streams_give_the_same_calls_at_any_split(fmt: str, step: int) -> None:
    """The answer fed `step` characters at a time: the content sent equals the whole-text
    content (a half marker is never sent as content), each call comes out once, in order."""
    parser, text = TOOL_PARSERS.get(fmt), ANSWERS[fmt]
    stream, content, calls = ToolStream(parser), "", []
    for i in range(0, len(text), step):
        piece = text[i : i + step]
        got, new = stream.feed(piece, final=i + step >= len(text))
        assert parser.start not in content + got
        content += got
        calls += new
    want_content, want_calls = parser.parse(text)
    assert content == want_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]


def test_a_stream_without_calls_is_all_content() -> None:
    stream, out = ToolStream(TOOL_PARSERS.get("hermes")), ""
    for piece in ("The answer", " is <tool", "_box> not a call", ""):
        out += stream.feed(piece, final=piece == "")[0]
    assert out == "The answer is <tool_box> not a call"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
]


def test_tools_and_earlier_calls_go_through_the_template(tool_server) -> None:
    r = httpx.post(f"{tool_server.url}/tokenize", json={"messages": HISTORY, "tools": TOOLS}, timeout=30)
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    text = httpx.post(f"{tool_server.url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert '"name": "get_weather"' in text and "The weather in a city" in text  # the tool definition
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<tool_response>18 C and sunny</tool_response>" in text


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_conversation_round_trips_through_the_openai_client(tool_server, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused")
    kw = dict(model="SmolLM2-135M-Instruct", messages=HISTORY, tools=TOOLS, max_tokens=12, temperature=0)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert choice.message.content is not None or choice.message.tool_calls
        return
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    whole = client.chat.completions.create(**kw).choices[0].message.content or ""
    assert text == whole  # no call in this answer: the stream's content is the whole answer's


BAD_CALL = {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{nope"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "get_wether"}}}, "tool_choice"),
        ({"messages": [{"role": "assistant", "tool_calls": [BAD_CALL]}]}, "messages"),
    ],
)
def test_tool_requests_refused_with_the_reason(tool_server, body: dict, param: str) -> None:
    req = {"messages": HISTORY, "tools": TOOLS, "max_tokens": 2} | body
    r = httpx.post(f"{tool_server.url}/v1/chat/completions", json=req, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tools_without_a_parser_or_a_template_for_them_are_refused() -> None:
    """The embedded default: its template takes no tools and its family names no parser (a
    forced choice needs neither: its answer is the call's JSON)."""
    s = Server()
    try:
        body = {"messages": HISTORY[:1], "tools": TOOLS, "max_tokens": 2}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"], r.text
        none = httpx.post(
            f"{s.url}/v1/chat/completions",
            json={"messages": HISTORY[:1], "tools": TOOLS, "tool_choice": "none", "max_tokens": 2},
            timeout=30,
        )
        assert none.status_code == 200, none.text  # tool_choice none: the tools are not offered
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = httpx.post(
            f"{s.url}/v1/chat/completions",
            # greedy: a sampled call (temperature 1, no seed) may still be inside a string at 32 tokens
            json={
                "messages": HISTORY[:1],
                "tools": TOOLS,
                "tool_choice": named,
                "max_tokens": 32,
                "temperature": 0,
            },
            timeout=60,
        )
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and isinstance(
            json.loads(call["function"]["arguments"]), dict
        )
    finally:
        s.stop()


SCRIPT_SEED = 4242


# every format on a tiny checkpoint (a forward pass in milliseconds: the answers are long); the
# embedded default with one (a real tokenizer, the template by flag)
@pytest.mark.parametrize(("fmt", "model"), [(f, "tiny") for f in sorted(ANSWERS)] + [("hermes", "embedded")])
def test_calls_the_model_writes_come_back_as_tool_calls(tmp_path, fmt: str, model: str) -> None:
    """tool_choice auto end to end: the model's answer (scripted: tests/scripted_kernels.py
    replays ANSWERS[fmt] token by token for one seed) goes through the engine, the detokenizer
    and the format's parser into OpenAI tool_calls with finish_reason tool_calls, whole and
    streamed; the text before the calls is the content. A tiny checkpoint whose own
    chat_template.jinja takes tools, and the embedded default with a tools template given by flag."""
    from pathlib import Path

    from dayzero.sdk.parity.tiny import write_tiny

    template = Path(__file__).parent / "data" / "tools_template.jinja"
    flags = ["--chat-template", str(template)]
    served, eos = "SmolLM2-135M-Instruct", 2  # the embedded default's end of turn (<|im_end|>)
    if model == "tiny":
        # room for the template's tools and a whole answer in the tiny tokenizer's short tokens
        ckpt = write_tiny("llama", tmp_path / "tiny", seed=3, overrides={"max_position_embeddings": 2048})
        (ckpt / "chat_template.jinja").write_text(template.read_text())
        conf = json.loads((ckpt / "tokenizer_config.json").read_text())
        conf.pop("chat_template", None)  # the template is the file's
        (ckpt / "tokenizer_config.json").write_text(json.dumps(conf))
        flags, served = [str(ckpt)], "tiny"
        eos = json.loads((ckpt / "config.json").read_text())["eos_token_id"]
    script = tmp_path / "script.json"
    env = {
        "DAYZERO_KERNEL_MODULES": "scripted_kernels",
        "DAYZERO_KERNEL_SAMPLE": "scripted",
        "DAYZERO_SCRIPT_FILE": str(script),
        "PYTHONPATH": str(Path(__file__).parent),
    }
    script.write_text("{}")
    s = Server(*flags, "--tool-call-parser", fmt, env=env)
    try:
        ids = httpx.post(
            f"{s.url}/tokenize", json={"prompt": ANSWERS[fmt], "add_special_tokens": False}, timeout=30
        ).json()["tokens"]
        script.write_text(json.dumps({str(SCRIPT_SEED): [*ids, eos]}))
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused")
        served = client.models.list().data[0].id if model == "tiny" else served
        kw = dict(model=served, messages=HISTORY[:1], tools=TOOLS, seed=SCRIPT_SEED)
        r = client.chat.completions.create(**kw, max_tokens=len(ids) + 4, temperature=0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert (choice.message.content or "").strip() == "Let me check."
        calls = choice.message.tool_calls
        assert [c.function.name for c in calls] == ["weather", "time"]
        assert (
            json.loads(calls[0].function.arguments) == WEATHER
            and json.loads(calls[1].function.arguments) == {}
        )
        stream = client.chat.completions.create(**kw, max_tokens=len(ids) + 4, temperature=0, stream=True)
        names, args, content, finish = {}, {}, "", None
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.function and tc.function.name:
                    names[tc.index] = tc.function.name
                args[tc.index] = args.get(tc.index, "") + ((tc.function and tc.function.arguments) or "")
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and content.strip() == "Let me check."
        assert [names[i] for i in sorted(names)] == ["weather", "time"]
        assert json.loads(args[0]) == WEATHER and json.loads(args[1]) == {}
    finally:
        s.stop()
