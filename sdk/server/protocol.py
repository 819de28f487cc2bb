"""Request schemas of the OpenAI-compatible API (the fields dayzero honours) and error bodies.

Unknown fields are ignored with one warning in the log, as vLLM does; fields dayzero knows of but
does not implement are refused with a 400 naming them, rather than silently ignored. JSON types are
strict, as OpenAI's API has them ("8" is not an integer, true is not a number, NaN and Infinity are
no floats), and every number is bounded by the range of the type it finally reaches (the C++
scheduler's int32 token ids and counts, a torch generator's int64 seed).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 16
INT32_MAX = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the scheduler's int32 (the vocabulary: app.py)
Count = Annotated[int, Field(ge=1, le=INT32_MAX)]  # a token count reaching C++ (the context: app.py)
# parameters dayzero does not implement, with the values that ask for nothing (accepted)
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    # vLLM's extra fields that change the answer (guided decoding: response_format does it here)
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None, []),
    "guided_grammar": (None,),
    "structured_outputs": (None, {}),
    "skip_special_tokens": (None, True),  # special tokens are always skipped in the text
    "include_stop_str_in_output": (None, False),  # the text ends before the stop string
    "spaces_between_special_tokens": (None, True),
}
WARN_NAMES = 256  # distinct unknown field names warned about, at most (a client may send any)


class Strict(BaseModel):
    """JSON types as OpenAI's API has them: no coercion from strings or bools, finite floats."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class JsonSchemaFormat(Strict):
    model_config = ConfigDict(extra="allow")

    name: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    """OpenAI's: text (no constraint), json_object (any JSON object), json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs json_schema")
        return self


_WARNED: set[str] = set()
log = logging.getLogger("dayzero.server")


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0, le=100)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = 0
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0  # vLLM's: drop tokens with p < min_p * max p
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0  # vLLM's
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id -> bias
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0  # vLLM's
    response_format: ResponseFormat | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # a torch generator's range
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] = []
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's: each choice (and stream chunk) also lists its token ids
    user: str | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> Sampling:
        """A parameter dayzero knows of but does not implement is refused unless it asks for
        nothing; any other unknown field is ignored, with one warning a field name (vLLM's way)."""
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            if name in extra and extra[name] not in neutral:
                raise ValueError(f"parameter {name!r} is not supported by this server")
        for name in extra.keys() - UNSUPPORTED.keys() - _WARNED:
            if len(_WARNED) >= WARN_NAMES:
                break
            _WARNED.add(name)
            log.warning("ignoring the unknown request field %r (warned once)", name[:80])
        return self

    def bias(self) -> tuple[tuple[int, float], ...]:
        """logit_bias with its keys as token ids (OpenAI sends them as strings)."""
        out = []
        for k, v in (self.logit_bias or {}).items():
            if not k.lstrip("-").isdigit() or not 0 <= int(k) <= INT32_MAX:
                raise ValueError(f"logit_bias key {k!r} is not a token id")
            out.append((int(k), float(v)))
        return tuple(out)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]  # several prompts: their choices in turn
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False  # the prompt's text before each answer


class ToolCallFunction(Strict):
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


class ToolCallIn(Strict):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Strict):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates take it: tool-call arguments as mappings (vLLM's)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError:
                    raise ValueError(f"tool call {c.id!r}: arguments are not JSON") from None
                calls.append(
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
                )
            out["tool_calls"] = calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is supported
            parts = []
            for p in self.content:
                if p.get("type") != "text":
                    raise ValueError(f"content part of type {p.get('type')!r} is not supported (text only)")
                parts.append(str(p.get("text", "")))
            return "".join(parts)
        return self.content or ""


class FunctionDef(Strict):
    model_config = ConfigDict(extra="allow")

    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


# what a request's chat_template_kwargs may not set: the rendering's own arguments
TEMPLATE_RESERVED = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
     "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)  # fmt: skip


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    # vLLM's: more variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Count | None = None

    @model_validator(mode="after")
    def _template_kwargs(self) -> ChatRequest:
        if bad := sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_RESERVED):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)}")
        return self


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None  # with messages: rendered by the chat template too
    chat_template_kwargs: dict[str, Any] | None = None  # as ChatRequest's
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        if bad := sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_RESERVED):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)}")
        return self


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]


def error_body(
    message: str, kind: str = "invalid_request_error", param: str | None = None, code: int | str | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_tag(key: object) -> bool:
    """A union member's tag in pydantic's error location (`str`, `list[int]`, `ChatMessage`)."""
    s = str(key)
    return "[" in s or s in TYPE_TAGS or s[:1].isupper() or s.startswith("function-")


def client_param(loc: tuple, body: object) -> str | None:
    """The field as the client wrote it (`stop`, not `stop.str`): pydantic's location walked
    against the body that was sent, union tags dropped."""
    path: list[str] = []
    node = body
    for key in loc[1:] if loc[:1] == ("body",) else loc:
        in_dict = isinstance(node, dict) and isinstance(key, str) and key in node
        if in_dict or (isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node)):
            node = node[key]
        elif _is_tag(key):
            continue
        else:
            node = None
        path.append(str(key))
    return ".".join(path) or None


def validation_error(errors: list[dict], body: object) -> tuple[str, str | None]:
    """A 400's message and param for pydantic's errors: the first field named as the client wrote
    it, with each union member's complaint; a JSON syntax error with its line and column."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        pos = first["loc"][-1] if isinstance(first["loc"][-1], int) else 0
        doc = body if isinstance(body, str) else ""
        e = json.JSONDecodeError(first.get("ctx", {}).get("error", "invalid JSON"), doc, pos)
        return f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", None
    params = [client_param(tuple(e.get("loc", ())), body) or "" for e in errors]
    top = params[0].split(".")[0]  # the first field at fault; of its union's members, the deepest
    param = max((p for p in params if p.split(".")[0] == top), key=lambda p: p.count(".")) or None
    msgs = [e["msg"] for e, p in zip(errors, params, strict=True) if p == (param or "")]
    why = "; or ".join(dict.fromkeys(msgs))
    return f"{param or 'body'}: {why}", param
