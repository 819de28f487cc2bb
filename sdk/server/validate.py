"""A request checked and turned into the engine's inputs: the model name, valid Unicode, the
text's length, the prompt's tokens (chat templates, offered and forced tools), the grammar the
answer is held to, and SamplingParams. Each refusal is an ApiError naming the field."""

from __future__ import annotations

from dayzero.sdk.engine.engine import SamplingParams
from dayzero.sdk.engine.grammar import GrammarError
from dayzero.sdk.server.limits import text_too_long
from dayzero.sdk.server.protocol import ChatRequest, Sampling
from dayzero.sdk.server.state import ApiError, ServerState
from dayzero.sdk.server.tool_choice import ForcedChoice, ToolsError, forced_choice


def check_model(state: ServerState, req: Sampling) -> None:
    if req.model not in (None, "", state.model_name):
        raise ApiError(
            404,
            f"model {req.model!r} does not exist; this server serves {state.model_name!r}",
            kind="not_found_error",
            param="model",
        )


def check_unicode(value, param: str) -> None:
    """A JSON string may hold a lone surrogate escape ("\\ud800"), which no UTF-8 text holds."""
    texts = [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)]
    for t in texts:
        if t.isascii():  # O(1) (CPython keeps the flag): no surrogate, and no 30 ms for 50 MB
            continue
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            why = f"{param}: not valid Unicode (a lone surrogate escape)"
            raise ApiError(400, why, param=param) from None


def lone_surrogate(value, path: str = "") -> str | None:
    """The path (`tools.0.function.description`) of the first string in value (dicts and lists
    walked) holding a lone surrogate escape, which no UTF-8 text holds; None when there is none."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list | tuple)
        else ()
    )
    for key, v in items:
        if (found := lone_surrogate(v, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


def check_all_unicode(req) -> None:
    """Every string of a request (tool descriptions, tool-call arguments, names...) is valid
    Unicode before any of it reaches a template or the tokenizer: a 400 naming the field."""
    if (where := lone_surrogate(req.model_dump(exclude_unset=True))) is not None:
        raise ApiError(400, f"{where}: not valid Unicode (a lone surrogate escape)", param=where)


def check_text(state: ServerState, value: list, param: str) -> None:
    """Valid Unicode, and short enough to fit the context, before any of it is tokenized."""
    check_unicode(value, param)
    texts = [v for v in value if isinstance(v, str)]
    if why := text_too_long(texts, state.max_model_len, state.max_token_bytes):
        raise ApiError(400, why, param=param)


def normalise_prompt(p) -> list[str | list[int]]:
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [list(p)]
    return list(p)


async def tokenize(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    return await state.pool.run(state.tokenizer.encode, prompt, add_special_tokens=True)


def forced_tools(req: ChatRequest) -> ForcedChoice | None:
    """tool_choice "required" or a named function: what the answer is held to (None: auto, none)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        forced = forced_choice(req.tool_choice, tools, req.parallel_tool_calls)
    except ToolsError as e:
        raise ApiError(400, str(e), param="tools") from None
    except ValueError as e:
        raise ApiError(400, str(e), param="tool_choice") from None
    if forced and req.response_format is not None and req.response_format.type != "text":
        raise ApiError(
            400,
            "response_format and tool_choice 'required' or a named function both constrain the answer; "
            "give one",
            param="response_format",
        )
    return forced


def tool_grammar(state: ServerState, forced: ForcedChoice):
    """The compiled grammar of a forced tool choice (the tools' schemas, held strictly)."""
    if state.grammars is None:
        raise ApiError(
            400, "tool_choice 'required' or a named function needs structured output", param="tool_choice"
        )
    try:
        compiler = state.grammars()
    except GrammarError as e:
        raise ApiError(400, str(e), param="tool_choice") from None
    try:
        return compiler.json(forced.schema, strict=True)
    except GrammarError as e:
        raise ApiError(400, f"the tools' parameters: {e}", param="tools") from None


def offered_tools(state: ServerState, req: ChatRequest, forced: bool = False) -> list[dict] | None:
    """The tools the template gets, or None (none offered, or tool_choice "none"). A forced choice
    needs no parser (its answer is JSON) and is offered even to a template that shows no tools."""
    if not req.tools or req.tool_choice == "none":
        return None
    if forced:
        return [t.model_dump(exclude_none=True) for t in req.tools]
    if state.tool_parser is None:
        raise ApiError(
            400,
            "this model has no tool-call parser: start the server with --tool-call-parser "
            "(hermes, glm45, kimi_k2)",
            param="tools",
        )
    template = state.chat_template or getattr(state.tokenizer, "chat_template", None) or ""
    if "tools" not in template:
        raise ApiError(400, "the model's chat template takes no tools (see --chat-template)", param="tools")
    return [t.model_dump(exclude_none=True) for t in req.tools]


async def apply_template(
    state: ServerState, messages: list[dict], tools: list[dict] | None = None, extra: dict | None = None
) -> list[int]:
    """The chat template's rendering, tokenized; extra: the request's chat_template_kwargs."""

    def render() -> list[int]:
        try:
            text = state.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=state.chat_template,
                add_generation_prompt=True,
                tokenize=False,
                **(extra or {}),
            )
        except Exception as e:  # template errors are about the request's messages
            raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        return state.tokenizer.encode(text, add_special_tokens=False)

    return await state.pool.run(render)


def response_grammar(state: ServerState, req: Sampling):
    """The compiled grammar of the request's response_format (None: unconstrained)."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if state.grammars is None:
        raise ApiError(400, "structured output is not available on this server", param="response_format")
    try:
        compiler = state.grammars()
        if rf.type == "json_object":
            return compiler.json()
        return compiler.json(rf.json_schema.schema_, bool(rf.json_schema.strict))
    except GrammarError as e:
        raise ApiError(400, str(e), param="response_format") from None


def sampling_params(
    state: ServerState, req: Sampling, prompt_len: int, index: int, top: int, grammar=None
) -> SamplingParams:
    """grammar: a compiled grammar the answer is held to (else the request's response_format's)."""
    limit = state.max_model_len
    max_tokens = (
        req.max_tokens if req.max_tokens is not None else (max(1, limit - prompt_len) if limit else 256)
    )
    if limit and prompt_len + max_tokens > limit:
        if prompt_len >= limit:
            raise ApiError(
                400,
                f"the prompt has {prompt_len} tokens; the maximum model length is {limit}",
                param="prompt",
            )
        raise ApiError(
            400,
            f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the maximum "
            f"model length {limit}",
            param="max_tokens",
        )
    seed = None if req.seed is None else req.seed + index
    given = req.model_fields_set
    grammar = grammar or response_grammar(state, req)

    def pick(name: str):  # the request's value, else the checkpoint's default, else OpenAI's
        return getattr(req, name) if name in given else state.sampling_defaults.get(name, getattr(req, name))

    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature"),
            top_k=max(int(pick("top_k")), 0),
            top_p=pick("top_p"),
            min_p=pick("min_p"),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=pick("repetition_penalty"),
            logit_bias=req.bias(),
            min_tokens=req.min_tokens,
            grammar=grammar,
            seed=seed,
            stop_token_ids=tuple(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
            top_logprobs=top,
        )
    except ValueError as e:
        raise ApiError(400, str(e), param=value_param(req, str(e))) from None


def value_param(req: Sampling, message: str) -> str | None:
    """The field an engine ValueError is about: its message begins with the field's name, or
    speaks of the prompt (a chat request's messages)."""
    first = message.split(" ", 1)[0]
    if first in type(req).model_fields:
        return first
    if "prompt" in message.split(" (", 1)[0]:
        return "messages" if isinstance(req, ChatRequest) else "prompt"
    return None
