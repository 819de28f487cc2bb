"""Limits a request meets before the server spends work on it: the body's size (413 in OpenAI's
error shape: Content-Length checked before the body is read, a chunked body counted as it comes
in) and the text's length (a text that cannot fit the context is refused untokenized)."""

from __future__ import annotations

import json
from collections.abc import Callable

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
        size += len(t.encode("utf-8", "surrogatepass"))
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
    on_large is called once a request whose body reached `large` bytes is answered (or refused):
    its buffers are free then, and can go back to the system."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        on_refuse: Callable[[], None],
        large: int | None = None,
        on_large: Callable[[], None] | None = None,
    ) -> None:
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse
        self.large, self.on_large = large, on_large

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
            if self.on_large is not None and self.large is not None and seen >= self.large:
                self.on_large()
