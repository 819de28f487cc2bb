"""A request's answers: its `n` choices submitted to the engine, their update queues read into
OpenAI's bodies, whole (JSON) or streamed (server-sent events). A client that goes away aborts
its engine requests at once; every way out of a request aborts what it left running."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from dayzero.sdk.loader.detok import Detokenizer
from dayzero.sdk.server.async_engine import Overloaded, ShuttingDown, Update
from dayzero.sdk.server.protocol import Sampling, error_body
from dayzero.sdk.server.state import ApiError, ServerState
from dayzero.sdk.server.tool_choice import CallReader
from dayzero.sdk.server.tools import ToolStream
from dayzero.sdk.server.validate import sampling_params, value_param

log = logging.getLogger("dayzero.server")

DISCONNECT_POLL_S = 0.25


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
