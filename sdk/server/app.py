"""FastAPI routes of the OpenAI-compatible server.

Each request is tokenized off the engine thread, split into `n` engine requests, and answered
from their update queues: whole (JSON) or streamed (server-sent events). A client that goes
away aborts its engine requests at once; user errors are 4xx with an OpenAI-style body.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from dayzero.sdk.engine.engine import SamplingParams
from dayzero.sdk.engine.grammar import GrammarCompiler, GrammarError
from dayzero.sdk.loader.detok import Detokenizer
from dayzero.sdk.server.async_engine import AsyncEngine, Overloaded, ShuttingDown, Update
from dayzero.sdk.server.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    REFUSED,
    BodyLimit,
    longest_token_bytes,
    off_loop_json_route,
    text_too_long,
)
from dayzero.sdk.server.metrics import Metrics
from dayzero.sdk.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Sampling,
    TokenizeRequest,
    error_body,
    validation_error,
)
from dayzero.sdk.server.tool_choice import CallReader, ForcedChoice, ToolsError, forced_choice
from dayzero.sdk.server.tools import ToolParser, ToolStream
from dayzero.sdk.server.workers import Busy, OneThread, Trimmer, WorkPool

log = logging.getLogger("dayzero.server")

DISCONNECT_POLL_S = 0.25
MAX_CHOICES = 64  # prompts x n in one completion request
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})  # served without an API key


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.headers = status, kind, param, headers or {}


@dataclass
class Choice:
    """One of the `n` answers: its engine request, detokenizer and what it produced."""

    index: int
    rid: int
    queue: asyncio.Queue
    detok: Detokenizer
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish: str | None = None
    cached: int = 0  # prompt tokens its request found in the prefix cache
    error: str | None = None  # a failed engine step aborted it
    tools: ToolStream | None = None  # the request offered tools: calls are parsed out of the text
    forced: CallReader | None = None  # tool_choice required / named: the text is the calls
    prompt_tokens: int = 0
    echo: str = ""  # the prompt's text, sent before the answer (completions' echo)


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: object
    model_name: str
    max_model_len: int | None
    chat_template: str | None
    metrics: Metrics
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    sampling_defaults: dict = field(default_factory=dict)  # for fields a request leaves unset
    tool_parser: ToolParser | None = None  # how this model writes tool calls (sdk/server/tools.py)
    grammars: Callable[[], GrammarCompiler] | None = None  # structured output (made on first use)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a longer body gets 413 unread
    max_token_bytes: int = 0  # the tokenizer's longest token in bytes (0: measured by build_app)
    pool: WorkPool = field(default_factory=WorkPool)  # tokenizing off the event loop, bounded
    trimmer: Trimmer = field(default_factory=Trimmer)  # free C heap back to the system, now and then
    parser: OneThread = field(default_factory=OneThread)  # a big body's JSON, parsed off the loop
    created: int = field(default_factory=lambda: int(time.time()))


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="dayzero", version="0.1.0")
    app.router.route_class = off_loop_json_route(state.parser.run)  # before any route is added
    app.state.dz = state
    state.max_token_bytes = state.max_token_bytes or longest_token_bytes(state.tokenizer)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        """With API keys, every route but OPEN_PATHS wants `Authorization: Bearer <key>`."""
        if state.api_keys and request.url.path not in OPEN_PATHS:
            got = request.headers.get("authorization", "")
            token = got[7:].strip() if got[:7].lower() == "bearer " else ""
            if not any(hmac.compare_digest(token.encode(), k.encode()) for k in state.api_keys):
                state.metrics.requests.labels("error_401").inc()
                msg = "invalid or missing API key: send `Authorization: Bearer <key>`"
                return JSONResponse(error_body(msg, code="invalid_api_key"), status_code=401)
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, e: ApiError) -> JSONResponse:
        state.metrics.requests.labels(f"error_{e.status}").inc()
        return JSONResponse(
            error_body(str(e), e.kind, e.param, e.status), status_code=e.status, headers=e.headers
        )

    @app.exception_handler(Busy)
    async def _busy(_req: Request, e: Busy) -> JSONResponse:
        state.metrics.requests.labels("error_503").inc()
        body = error_body(str(e), "service_unavailable", code=503)
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_error(list(e.errors()), e.body)
        state.metrics.requests.labels("error_400").inc()
        return JSONResponse(error_body(message, param=param, code=400), status_code=400)

    @app.exception_handler(Exception)
    async def _bug(_req: Request, e: Exception) -> JSONResponse:
        """A bug, not the client's: counted, answered in OpenAI's shape (the traceback is logged)."""
        state.metrics.requests.labels("error_500").inc()
        msg = f"internal error: {type(e).__name__}: {e}"
        return JSONResponse(error_body(msg, "internal_server_error", code=500), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, e: StarletteHTTPException) -> JSONResponse:
        if not req.scope.get(REFUSED):  # else counted (and answered) as a 413
            state.metrics.requests.labels(f"error_{e.status_code}").inc()
        return JSONResponse(error_body(str(e.detail), code=e.status_code), status_code=e.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while the engine serves; 503 while draining, when the engine thread is gone, or
        after async_engine.FAILED_STEPS_UNHEALTHY failed steps in a row (a wedged device)."""
        eng = state.engine
        status = eng.health()
        return JSONResponse(
            {"status": status} | eng.health_detail(), status_code=200 if status == "ok" else 503
        )

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "dayzero",
            "max_model_len": state.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/version")
    async def version() -> dict:
        return {"version": importlib.metadata.version("dayzero")}

    @app.post("/tokenize")
    async def tokenize_route(req: TokenizeRequest) -> dict:
        """vLLM's: a prompt, or chat messages through the template -> token ids."""
        check_all_unicode(req)
        if req.messages is not None:
            try:
                messages = [m.for_template() for m in req.messages]
            except ValueError as e:
                raise ApiError(400, str(e), param="messages") from None
            check_text(state, [m["content"] for m in messages], "messages")
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = await apply_template(state, messages, tools, req.chat_template_kwargs)
        else:
            check_text(state, [req.prompt or ""], "prompt")
            ids = await state.pool.run(
                state.tokenizer.encode, req.prompt or "", add_special_tokens=req.add_special_tokens
            )
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize_route(req: DetokenizeRequest) -> dict:
        vocab = state.engine.engine.cfg.embedding.vocab
        if bad := [t for t in req.tokens if not 0 <= t < vocab]:
            raise ApiError(400, f"tokens out of the vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
        return {"prompt": state.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.observe_memory()
        return Response(generate_latest(state.metrics.registry), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_all_unicode(req)
        check_model(state, req)
        check_unicode(req.stops(), "stop")
        prompts = normalise_prompt(req.prompt)
        check_text(state, prompts, "prompt")
        if not prompts or len(prompts) * req.n > MAX_CHOICES:
            raise ApiError(
                400, f"1..{MAX_CHOICES} prompts x n per request, got {len(prompts)} x {req.n}", param="prompt"
            )
        if req.echo and req.logprobs is not None:
            raise ApiError(
                400, "echo with logprobs (the prompt's logprobs) is not supported yet", param="echo"
            )
        ids = [await tokenize(state, p) for p in prompts]
        return await respond(
            state,
            req,
            request,
            ids,
            chat=False,
            top_logprobs=req.logprobs or 0,
            want_logprobs=req.logprobs is not None,
        )

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        check_all_unicode(req)
        check_model(state, req)
        check_unicode(req.stops(), "stop")
        try:
            messages = [m.for_template() for m in req.messages]
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
        check_text(state, [m["content"] for m in messages], "messages")
        forced = forced_tools(req)
        tools = offered_tools(state, req, forced is not None)
        grammar = await state.pool.run(tool_grammar, state, forced) if forced else None
        ids = await apply_template(state, messages, tools, req.chat_template_kwargs)
        if req.max_completion_tokens is not None and req.max_tokens is None:
            req.max_tokens = req.max_completion_tokens
        return await respond(
            state,
            req,
            request,
            [ids],
            chat=True,
            top_logprobs=req.top_logprobs or 0,
            want_logprobs=req.logprobs,
            tools=tools is not None and forced is None,
            grammar=grammar,
            calls=forced.reader if forced else None,
        )

    count_413 = state.metrics.requests.labels("error_413").inc
    app.add_middleware(
        BodyLimit,
        max_bytes=state.max_request_bytes,
        on_refuse=count_413,
        on_answered=state.trimmer.answered,
    )
    return app


# ---- request handling ------------------------------------------------------------------------------


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


async def start_choices(
    state: ServerState,
    req: Sampling,
    prompts: list[list[int]],
    top: int,
    tools: bool = False,
    grammar=None,
    calls: Callable[[], CallReader] | None = None,
    name: str = "",
) -> list[Choice]:
    """n choices a prompt; choice index = prompt index * n + i (vLLM's order). tools: calls are
    parsed out of the text (tool_choice auto); grammar and calls: a forced tool choice's grammar
    and a new reader of the calls an answer is. name: the request's OpenAI id (the log's)."""
    choices: list[Choice] = []
    echo = getattr(req, "echo", False)
    many = len(prompts) * req.n > 1
    try:
        for p, ids in enumerate(prompts):
            for i in range(req.n):
                params = sampling_params(state, req, len(ids), i, top, grammar)
                label = f"{name} choice {p * req.n + i}" if many else name
                rid, q = await state.engine.submit(ids, params, name=label)
                parser = state.tool_parser if tools else None
                keep = parser.markers if parser else ()
                detok = Detokenizer(state.tokenizer, ids, req.stops(), keep_special=keep)
                c = Choice(p * req.n + i, rid, q, detok, tools=ToolStream(parser) if parser else None)
                c.forced = calls() if calls else None
                c.prompt_tokens = len(ids)
                c.echo = state.tokenizer.decode(ids) if echo else ""
                choices.append(c)
    except Overloaded as e:
        abort_all(state, choices)
        raise ApiError(429, str(e), kind="rate_limit_error", headers={"Retry-After": "1"}) from None
    except ShuttingDown as e:
        abort_all(state, choices)
        raise ApiError(503, str(e), kind="service_unavailable", headers={"Retry-After": "5"}) from None
    except ValueError as e:
        abort_all(state, choices)
        raise ApiError(400, str(e), param=value_param(req, str(e))) from None
    except BaseException:
        abort_all(state, choices)
        raise
    state.metrics.tokens_in.inc(len(ids))
    return choices


def abort_all(state: ServerState, choices: list[Choice]) -> None:
    for c in choices:
        if c.finish is None:
            state.engine.abort(c.rid)


def apply_update(state: ServerState, c: Choice, u: Update) -> None:
    """Apply one engine update to a choice; a stop string ends it (and its engine request)."""
    if u.error:
        c.finish, c.error = "abort", u.error
        return
    c.cached = max(c.cached, u.cached_tokens)
    c.tokens += u.token_ids
    c.logprobs += u.logprobs
    c.top += u.top_logprobs
    state.metrics.tokens_out.inc(len(u.token_ids))
    c.detok.add(u.token_ids)
    if c.detok.stopped and c.finish is None:
        c.finish = "stop"
        if u.finish_reason is None:
            state.engine.abort(c.rid)
    elif u.finish_reason is not None and c.finish is None:
        c.finish = u.finish_reason


async def next_update(c: Choice, request: Request) -> Update | None:
    """The choice's next update; None when the client has gone away."""
    while True:
        try:
            return await asyncio.wait_for(c.queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                return None


async def respond(
    state: ServerState,
    req: Sampling,
    request: Request,
    ids: list[list[int]],  # each prompt's tokens
    chat: bool,
    top_logprobs: int,
    want_logprobs: bool,
    tools: bool = False,
    grammar=None,
    calls: Callable[[], CallReader] | None = None,
):
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    choices = await start_choices(state, req, ids, top_logprobs, tools, grammar, calls, name=rid)
    if req.stream:
        gen = stream(state, req, request, choices, ids, rid, chat, want_logprobs)
        return StreamingResponse(gen, media_type="text/event-stream")
    try:
        for c in choices:
            while c.finish is None:
                u = await next_update(c, request)
                if u is None:
                    client_gone(state, choices, rid)
                    return Response(status_code=499)
                apply_update(state, c, u)
    except BaseException:
        abort_all(state, choices)
        raise
    if failed := next((c.error for c in choices if c.error), None):
        state.metrics.requests.labels("error_500").inc()
        return JSONResponse(error_body(failed, "internal_server_error", code=500), status_code=500)
    count_outcome(state, choices)
    body = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
        "choices": [whole_choice(state, c, chat, want_logprobs, req.return_token_ids) for c in choices],
        "usage": usage(ids, choices),
    }
    return JSONResponse(body)


def client_gone(state: ServerState, choices: list[Choice], rid: str) -> None:
    """The client went away before the answer was done: its requests are aborted, counted as
    aborted by the client, and logged by the request's OpenAI id."""
    live = [c for c in choices if c.finish is None]
    abort_all(state, choices)
    state.metrics.requests.labels("abort").inc()
    state.metrics.aborted.labels("client").inc()
    log.info(
        "request %s aborted (the client disconnected): %d prompt tokens, %d generated, "
        "%d of %d choices unfinished",
        rid,
        sum(c.prompt_tokens for c in choices),
        sum(len(c.tokens) for c in choices),
        len(live),
        len(choices),
    )


def count_outcome(state: ServerState, choices: list[Choice]) -> None:
    label = outcome(choices)
    state.metrics.requests.labels(label).inc()
    if label == "abort":
        state.metrics.aborted.labels("server").inc()


def outcome(choices: list[Choice]) -> str:
    """The request's /metrics label: error_500 when a failed step aborted a choice, abort when the
    server aborted one (shutdown), else ok."""
    if any(c.error for c in choices):
        return "error_500"
    return "abort" if any(c.finish == "abort" for c in choices) else "ok"


def usage(prompts: list[list[int]], choices: list[Choice]) -> dict:
    """OpenAI's usage over every prompt; prompt_tokens_details.cached_tokens: the prompt tokens
    each prompt's first choice found in the prefix cache (the others may also hit the blocks it
    computed)."""
    out = sum(len(c.tokens) for c in choices)
    n = len(choices) // max(1, len(prompts))
    prompt = sum(len(ids) for ids in prompts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": out,
        "total_tokens": prompt + out,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached for c in choices if c.index % n == 0)},
    }


def token_text(state: ServerState, t: int) -> str:
    return state.tokenizer.decode([t])


def logprob_block(state: ServerState, c: Choice, start: int, stop: int, chat: bool) -> dict:
    toks, lps = c.tokens[start:stop], c.logprobs[start:stop]
    tops = c.top[start:stop] if c.top else [[] for _ in toks]
    if chat:

        def entry(t: int, lp: float) -> dict:
            text = token_text(state, t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        content = [
            entry(t, lp) | {"top_logprobs": [entry(a, b) for a, b in top]}
            for t, lp, top in zip(toks, lps, tops, strict=True)
        ]
        return {"content": content}
    return {
        "tokens": [token_text(state, t) for t in toks],
        "token_logprobs": lps,
        "top_logprobs": [{token_text(state, a): b for a, b in top} for top in tops],
        "text_offset": [],
    }


def whole_choice(state: ServerState, c: Choice, chat: bool, want_logprobs: bool, token_ids: bool) -> dict:
    text = c.echo + c.detok.take(final=True)
    lp = logprob_block(state, c, 0, len(c.tokens), chat) if want_logprobs else None
    ids = {"token_ids": list(c.tokens)} if token_ids else {}
    if chat:
        message: dict = {"role": "assistant", "content": text}
        finish = c.finish
        if c.forced is not None:  # the whole answer is the calls
            calls = [call.openai() for call in c.forced.whole(text)]
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            finish = c.forced.finish(finish)
        elif c.tools is not None:
            content, calls = c.tools.parser.parse(text)
            if calls:
                message = {"role": "assistant", "content": content or None}
                message["tool_calls"] = [call.openai() for call in calls]
                finish = "tool_calls" if finish == "stop" else finish
        return {"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish} | ids
    return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish} | ids


async def stream(
    state: ServerState,
    req: Sampling,
    request: Request,
    choices: list[Choice],
    ids: list[list[int]],
    rid: str,
    chat: bool,
    want_logprobs: bool,
) -> AsyncIterator[str]:
    """ids: each prompt's tokens (usage)."""
    created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

    def chunk(
        index: int, text: str, finish: str | None, lp: dict | None, first: bool = False, ids=(), calls=()
    ) -> str:
        if chat:
            delta = (
                ({"role": "assistant", "content": text} if first else {"content": text})
                if text or first
                else {}
            )
            if calls:
                delta["tool_calls"] = list(calls)
            choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        if req.return_token_ids:
            choice["token_ids"] = list(ids)
        body = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    try:
        for c in choices:
            if chat:
                yield chunk(c.index, "", None, None, first=True)
            elif c.echo:
                yield chunk(c.index, c.echo, None, None)
        pending = {c.index: c for c in choices}
        while pending:
            waits = {asyncio.ensure_future(c.queue.get()): c for c in pending.values()}
            done, rest = await asyncio.wait(
                waits, timeout=DISCONNECT_POLL_S, return_when=asyncio.FIRST_COMPLETED
            )
            for f in rest:
                f.cancel()
            if not done:
                if await request.is_disconnected():
                    raise asyncio.CancelledError
                continue
            for f in done:
                c = waits[f]
                before = len(c.tokens)
                apply_update(state, c, f.result())
                text = c.detok.take(final=c.finish is not None)
                lp = logprob_block(state, c, before, len(c.tokens), chat) if want_logprobs else None
                finish, calls = c.finish, []
                if c.forced is not None:  # the text is the calls: they go out as they grow
                    calls = c.forced.feed(text, final=c.finish is not None)
                    text, finish = "", c.forced.finish(finish)
                elif c.tools is not None:  # content until a call begins, then each complete call
                    done_before = c.tools.emitted
                    text, new = c.tools.feed(text, final=c.finish is not None)
                    calls = [call.openai(done_before + j) for j, call in enumerate(new)]
                    if finish == "stop" and c.tools.emitted:
                        finish = "tool_calls"
                if text or finish or lp or calls or (req.return_token_ids and len(c.tokens) > before):
                    yield chunk(c.index, text, finish, lp, ids=c.tokens[before:], calls=calls)
                if c.error:  # after its final chunk, the reason, as OpenAI streams an error
                    yield f"data: {json.dumps(error_body(c.error, 'internal_server_error', code=500))}\n\n"
                if c.finish is not None:
                    del pending[c.index]
        if req.stream_options and req.stream_options.include_usage:
            body = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": state.model_name,
                "choices": [],
                "usage": usage(ids, choices),
            }
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
        count_outcome(state, choices)
    except (asyncio.CancelledError, GeneratorExit):
        client_gone(state, choices, rid)
        raise
    finally:
        abort_all(state, [c for c in choices if c.finish is None])
