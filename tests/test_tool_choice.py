"""tool_choice "required" and a named function (sdk/server/tool_choice.py): the schemas a request
asks for and their refusals, the readers of the calls an answer is (whole, and streamed at every
split), and end to end through the real server and the openai client: the embedded default
(SmolLM2) held by the grammar writes calls whose arguments validate against the tool's schema,
whole and streamed, and a call plus its result round-trip through the chat template."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from dayzero.sdk.server.tool_choice import CallArray, NamedCall, ToolsError, forced_choice

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer"}},
    "required": ["city"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}}, "required": ["zone"]}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s}}
    for n, s in SCHEMAS.items()
]
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_a_named_choice_is_held_to_its_parameters() -> None:
    forced = forced_choice(NAMED, TOOLS)
    assert (forced.name, forced.schema) == ("get_weather", WEATHER)
    assert forced_choice({"type": "function", "function": {"name": "ping"}}, [*TOOLS, PING]).schema == {
        "type": "object",
        "properties": {},
    }  # no parameters: the empty object
    for choice in (None, "none", "auto"):
        assert forced_choice(choice, TOOLS) is None


def test_required_is_an_array_of_the_tools_calls() -> None:
    schema = forced_choice("required", [*TOOLS, PING]).schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    items = schema["items"]["anyOf"]
    assert [i["properties"]["name"]["enum"] for i in items] == [["get_weather"], ["get_time"], ["ping"]]
    jsonschema.validate(
        [{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "ping", "parameters": {}}], schema
    )
    with pytest.raises(jsonschema.ValidationError):  # get_weather's parameters under get_time's name
        jsonschema.validate([{"name": "get_time", "parameters": {"city": "Paris"}}], schema)
    assert forced_choice("required", TOOLS, parallel=False).schema["maxItems"] == 1


def test_required_moves_each_tools_defs_to_the_root() -> None:
    def tool(name: str, unit: dict) -> dict:
        params = {"type": "object", "properties": {"u": {"$ref": "#/$defs/Unit"}}, "$defs": {"Unit": unit}}
        return {"type": "function", "function": {"name": name, "parameters": params}}

    unit = {"type": "string", "enum": ["C", "F"]}
    schema = forced_choice("required", [tool("a", unit), tool("b", unit)]).schema
    assert schema["$defs"] == {"Unit": unit}
    jsonschema.validate([{"name": "b", "parameters": {"u": "C"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "parameters": {"u": "K"}}], schema)
    with pytest.raises(ToolsError, match="Unit"):
        forced_choice("required", [tool("a", unit), tool("b", {"type": "integer"})])


@pytest.mark.parametrize(
    ("choice", "tools", "says"),
    [
        ({"type": "function", "function": {"name": "get_wether"}}, TOOLS, "'get_wether'"),
        ({"type": "function", "function": {}}, TOOLS, "tool_choice must be"),
        ({"type": "tool", "function": {"name": "get_weather"}}, TOOLS, "tool_choice must be"),
        ("required", None, "needs `tools`"),
        (NAMED, [], "needs `tools`"),
    ],
)
def test_bad_choices_say_what_is_wrong(choice, tools, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        forced_choice(choice, tools)


ARRAY = (
    '[\n {"name": "get_weather", "parameters": {"city": "Pa\\"ris}]", "days": 3}},'
    '{"name":"ping","parameters":{}} ,{"name": "get_time", "parameters": {"zone": "[UTC]{"}}]'
)


def calls_of(deltas: list[dict]) -> dict[int, dict]:
    """OpenAI tool-call deltas -> whole calls by index (as a client assembles them)."""
    out: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in out:
            assert d["id"] and d["type"] == "function" and d["function"]["name"]  # the first delta
            out[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
        out[d["index"]]["arguments"] += d["function"]["arguments"]
    return out


def test_a_call_array_reads_whole() -> None:
    calls = CallArray().whole(ARRAY)
    assert [c.name for c in calls] == ["get_weather", "ping", "get_time"]
    assert [json.loads(c.arguments) for c in calls] == [
        {"city": 'Pa"ris}]', "days": 3},
        {},
        {"zone": "[UTC]{"},
    ]
    cut = CallArray().whole(ARRAY[: ARRAY.index('"days') + 3])  # cut by max_tokens: what was written
    assert [(c.name, c.arguments) for c in cut] == [("get_weather", '{"city": "Pa\\"ris}]", "da')]
    (bad,) = CallArray().whole('[{"name": "a\\q", "parameters": {}}]')  # not JSON's escape: kept as written
    assert (bad.name, bad.arguments) == ("a\\q", "{}")


@pytest.mark.parametrize("step", [1, 2, 3, 5, 11])
def test_a_call_array_streams_the_same_calls_at_any_split(step: int) -> None:
    reader, deltas = CallArray(), []
    for i in range(0, len(ARRAY), step):
        deltas += reader.feed(ARRAY[i : i + step], final=i + step >= len(ARRAY))
    got = calls_of(deltas)
    want = CallArray().whole(ARRAY)
    assert [got[i]["name"] for i in sorted(got)] == [c.name for c in want]
    assert [json.loads(got[i]["arguments"]) for i in sorted(got)] == [json.loads(c.arguments) for c in want]


def test_a_named_call_streams_its_arguments() -> None:
    reader, text = NamedCall("get_weather"), '{"city": "Paris", "days": 2}'
    deltas = reader.feed("") + [d for i in range(0, len(text), 4) for d in reader.feed(text[i : i + 4])]
    got = calls_of(deltas)
    assert list(got) == [0] and got[0]["name"] == "get_weather" and got[0]["arguments"] == text
    assert (reader.finish("stop"), CallArray().finish("stop"), CallArray().finish("length")) == (
        "stop",
        "tool_calls",
        "length",
    )  # OpenAI's and vLLM's finish reasons


# ---- end to end: the embedded default, held by the grammar, through the server --------------------

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def client(tool_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="unused")


def check_call(name: str, arguments: str) -> None:
    """A call of an offered tool whose arguments validate against its schema (held strictly)."""
    schema = SCHEMAS[name]
    args = json.loads(arguments)
    jsonschema.validate(args, schema)
    assert set(args) <= set(schema.get("properties", {})), args


def streamed(client: openai.OpenAI, **kw) -> tuple[dict[int, dict], str | None, str]:
    """(the calls by index, the finish reason, the content) of a streamed answer."""
    deltas, finish, content = [], None, ""
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        deltas += [t.model_dump(exclude_none=True) for t in choice.delta.tool_calls or []]
        finish = choice.finish_reason or finish
    for d in deltas:
        d.setdefault("function", {}).setdefault("arguments", "")
    return calls_of(deltas), finish, content


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (1.0, 1), (1.0, 2)])
def test_a_named_choice_answers_with_that_call(client, temperature: float, seed: int | None) -> None:
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=96, temperature=temperature, seed=seed)
    choice = client.chat.completions.create(model=MODEL, **kw).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI's for a named call
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    check_call("get_weather", call.function.arguments)
    calls, finish, content = streamed(client, **kw)
    assert finish == "stop" and content == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)  # the same answer


def test_required_answers_with_calls_of_the_tools(client) -> None:
    """Greedy and sampled: every call is of an offered tool, its arguments valid, the stream the
    same calls; some sampled answer makes several (the stream's later indices)."""
    most = 0
    for temperature, seed in [(0.0, None), (1.0, 5), (1.0, 13), (1.0, 15)]:
        kw = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=160, temperature=temperature)
        kw["seed"] = seed
        choice = client.chat.completions.create(model=MODEL, **kw).choices[0]
        calls = choice.message.tool_calls
        assert choice.message.content is None and calls
        assert choice.finish_reason == "tool_calls" or (seed and choice.finish_reason == "length")
        complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # cut: the last is partial
        for call in complete:
            check_call(call.function.name, call.function.arguments)
        most = max(most, len(complete))
        got, finish, content = streamed(client, **kw)
        assert finish == choice.finish_reason and content == ""
        assert [got[i]["name"] for i in sorted(got)] == [c.function.name for c in calls]
        assert [json.loads(got[i]["arguments"]) for i in sorted(got)][: len(complete)] == [
            json.loads(c.function.arguments) for c in complete
        ]
    assert most >= 2


def test_without_parallel_calls_required_makes_one(client) -> None:
    for seed in (1, 2, 3):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=120, temperature=1.0, seed=seed,
        )  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1


def test_a_call_and_its_result_round_trip(tool_server, client) -> None:
    """The forced call goes back as the assistant's message with the tool's result: the template
    renders both and the model answers."""
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=96, temperature=0
    ).choices[0]
    (call,) = first.message.tool_calls
    history = [
        *ASK,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    r = httpx.post(f"{tool_server.url}/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30)
    assert r.status_code == 200, r.text
    prompt = httpx.post(f"{tool_server.url}/detokenize", json=r.json(), timeout=30).json()["prompt"]
    args = json.dumps(json.loads(call.function.arguments))  # the template's tojson spacing
    assert f'<tool_call>{{"name": "get_weather", "arguments": {args}}}</tool_call>' in prompt
    assert "<tool_response>18 C and sunny</tool_response>" in prompt
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=24, temperature=0
    ).choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls


def test_tool_choice_none_calls_nothing(client) -> None:
    for stream in (False, True):
        kw = dict(messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=24, temperature=0)
        if stream:
            calls, finish, content = streamed(client, **kw)
            assert not calls and finish in ("stop", "length") and content
        else:
            choice = client.chat.completions.create(model=MODEL, **kw).choices[0]
            assert choice.message.tool_calls is None and choice.message.content
            assert choice.finish_reason in ("stop", "length")


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "wether"}}}, "tool_choice", "'wether'"),
        ({"tool_choice": {"type": "function"}}, "tool_choice", "tool_choice must be"),
        ({"tool_choice": "required", "tools": None}, "tool_choice", "needs `tools`"),
        ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format", "give one"),
        ({"tool_choice": "required", "tools": [BAD_TOOL]}, "tools", "parameters"),
    ],
)
def test_bad_tool_choices_are_a_400_naming_the_reason(tool_server, body: dict, param: str, says: str) -> None:
    url, req = f"{tool_server.url}/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 4}
    r = httpx.post(url, json=req | body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    ok = httpx.post(url, json={"messages": ASK, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the server is unaffected
