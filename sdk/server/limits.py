"""Limits a request meets before the server spends work on it: the body's size (413 in OpenAI's
error shape: Content-Length checked before the body is read, a chunked body counted as it comes
in), the text's length (a text that cannot fit the context is refused untokenized), and where a
large body's JSON is parsed (off the event loop)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dayzero.sdk.server.protocol import error_body

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20  # 32 MiB: a full 128k context of text is about 0.5 MiB


def longest_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes one token stands for: its longest vocabulary entry's
    spelling in UTF-8 (a byte-level or SentencePiece spelling is never shorter than the bytes it
    decodes to: 'Ġ', '▁' and '<0x41>' each stand for one byte), and at least one character's 4."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=4) if vocab else 4


def text_too_long(texts: list[str], max_model_len: int | None, token_bytes: int) -> str | None:
    """Why texts of this many bytes cannot fit max_model_len tokens (None: they may): each token
    covers at most token_bytes bytes, so more than max_model_len * token_bytes bytes are more
    tokens than the context holds, whatever the tokenizer makes of them."""
    if not max_model_len:
        return None
    bound = max_model_len * max(token_bytes, 4)
    size = 0
    for t in texts:
        size += len(t) if t.isascii() else len(t.encode("utf-8", "surrogatepass"))  # (isascii: O(1))
        if size > bound:
            return (
                f"the text is too long: over {bound} bytes, more than the maximum model length of "
                f"{max_model_len} tokens holds (at most {token_bytes} bytes a token)"
            )
    return None


REFUSED = "dayzero.body_refused"  # set in the scope of a request answered 413


class BodyLimit:
    """ASGI middleware: a body over max_bytes is answered 413 before it is read in full. The app
    then sees the client gone (and its own answer, if any, is dropped); on_refuse counts it.
    on_answered(bytes) is called once each request is answered (or refused), with the bytes of
    body it read: a big body's buffers are free then, and can go back to the system."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        on_refuse: Callable[[], None],
        on_answered: Callable[[int], None] | None = None,
    ) -> None:
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse
        self.on_answered = on_answered

    async def refuse(self, scope: Scope, send: Send) -> None:
        scope[REFUSED] = True
        self.on_refuse()
        msg = f"the request body is over this server's limit of {self.max_bytes} bytes (--max-request-bytes)"
        body = json.dumps(error_body(msg, code=413)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self.refuse(scope, send)  # nothing was read: nothing to give back
        seen, started = 0, False

        async def counted() -> Message:
            nonlocal seen
            if scope.get(REFUSED):
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    if not started:  # (these routes read the whole body before they answer)
                        await self.refuse(scope, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: Message) -> None:
            nonlocal started
            if scope.get(REFUSED):
                return  # the 413 went out
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        finally:
            if self.on_answered is not None:
                self.on_answered(seen)


PARSE_OFF_LOOP_BYTES = 1 << 20  # a JSON body at least this large is joined and parsed off the loop


def off_loop_json_route(run: Callable[..., Awaitable[Any]], at: int = PARSE_OFF_LOOP_BYTES) -> type:
    """A route class whose requests' bodies of `at` bytes or more are joined and parsed by
    `run(fn, *args)` (on a thread: a 50 MB body took the event loop about 0.25 s to join, parse and
    check, stalling every stream meanwhile), smaller ones in place. A syntax error raises json's
    JSONDecodeError as FastAPI's own parse does (its 400 gives the line and column).

    What stays on the loop is the body's arrival, chunk by chunk. The join gives the GIL up while
    it copies; json.loads does not (it is one C call: ~0.1 s for 50 MB), so the loop still waits
    for the GIL about that long, once, where before it waited for the join, the parse and the
    checks in a row."""

    class OffLoopJsonRequest(Request):
        async def body(self) -> bytes:
            if not hasattr(self, "_body"):
                chunks: list[bytes] = []
                size = 0
                async with contextlib.aclosing(self.stream()) as stream:
                    async for chunk in stream:
                        chunks.append(chunk)
                        size += len(chunk)
                self._body = await run(b"".join, chunks) if size >= at else b"".join(chunks)
            return self._body

        async def json(self):
            if not hasattr(self, "_json"):
                body = await self.body()
                self._json = await run(json.loads, body) if len(body) >= at else json.loads(body)
            return self._json

    class OffLoopJsonRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def route(request: Request):
                return await handler(OffLoopJsonRequest(request.scope, request.receive))

            return route

    return OffLoopJsonRoute
