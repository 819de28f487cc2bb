"""FastAPI routes of the OpenAI-compatible server.

Each request is checked and tokenized off the engine thread (validate.py), split into `n`
engine requests and answered from their update queues, whole or streamed (respond.py). User
errors are 4xx with an OpenAI-style body; API keys, body limits and the error handlers are here.
"""

from __future__ import annotations

import hmac
import importlib.metadata

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from dayzero.sdk.server.limits import REFUSED, BodyLimit, longest_token_bytes, off_loop_json_route
from dayzero.sdk.server.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    validation_error,
)
from dayzero.sdk.server.respond import respond
from dayzero.sdk.server.state import ApiError, ServerState
from dayzero.sdk.server.validate import (
    apply_template,
    check_all_unicode,
    check_model,
    check_text,
    check_unicode,
    forced_tools,
    normalise_prompt,
    offered_tools,
    tokenize,
    tool_grammar,
)
from dayzero.sdk.server.workers import Busy

MAX_CHOICES = 64  # prompts x n in one completion request
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})  # served without an API key


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
