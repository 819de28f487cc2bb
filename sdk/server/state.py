"""What every route shares: the server's state and the error a request gets back."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dayzero.sdk.engine.grammar import GrammarCompiler
from dayzero.sdk.server.async_engine import AsyncEngine
from dayzero.sdk.server.limits import DEFAULT_MAX_REQUEST_BYTES
from dayzero.sdk.server.metrics import Metrics
from dayzero.sdk.server.tools import ToolParser
from dayzero.sdk.server.workers import OneThread, Trimmer, WorkPool


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
