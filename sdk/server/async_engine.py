"""The engine on its own thread, driven from asyncio.

The event loop never touches the engine or the scheduler: it posts ("add" | "abort") messages
to an inbox; the engine thread applies them between steps, runs steps while there is work, and
posts each request's new tokens to that request's asyncio queue. A request that cannot be
served is refused through its submission future (ValueError), and nothing of it is kept.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from dayzero.sdk.engine.engine import Engine, SamplingParams

log = logging.getLogger("dayzero.server")


FAILED_STEPS_UNHEALTHY = 3  # failed engine steps in a row after which /health answers 503


class Overloaded(RuntimeError):
    """Too many requests waiting: the client should retry later (HTTP 429)."""


class ShuttingDown(RuntimeError):
    """The server is draining (HTTP 503)."""


@dataclass
class Update:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    name: str = ""  # how the client knows the request (its OpenAI id, and the choice)
    sent: int = 0
    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int = 256, metrics=None) -> None:
        self.engine, self.max_waiting, self.metrics = engine, max_waiting, metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._pending = 0  # submitted, not yet admitted by the engine thread
        self._lock = threading.Lock()
        self.accepting = True
        self._closing: str | None = None  # set by abort_all: why later adds are refused
        self._thread = threading.Thread(target=self._run, name="dayzero-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    def health(self) -> str:
        """ok | draining | engine thread stopped | failing (FAILED_STEPS_UNHEALTHY failed steps
        in a row)."""
        if not self._thread.is_alive():
            return "engine thread stopped"
        if not self.accepting:
            return "draining"
        if self.engine.failures >= FAILED_STEPS_UNHEALTHY:
            return "failing"
        return "ok"

    def health_detail(self) -> dict:
        e = self.engine
        return {
            "running": e.scheduler.num_running,
            "waiting": self.waiting,
            "failed_steps": e.stats["failed_steps"],
            "failed_in_a_row": e.failures,
        }

    @property
    def waiting(self) -> int:
        return self.engine.scheduler.num_waiting + self._pending

    # ---- asyncio side ------------------------------------------------------------------------
    async def submit(
        self, prompt_ids: list[int], params: SamplingParams, name: str = ""
    ) -> tuple[int, asyncio.Queue]:
        """name: how the client knows the request (its OpenAI id), for the log."""
        if not self.accepting:
            raise ShuttingDown("the server is shutting down")
        if self.waiting >= self.max_waiting:
            raise Overloaded(f"{self.waiting} requests are waiting (limit {self.max_waiting})")
        loop = asyncio.get_running_loop()
        rid, fut, q = next(self._ids), loop.create_future(), asyncio.Queue()
        with self._lock:
            self._pending += 1
        self._inbox.put(("add", rid, prompt_ids, params, fut, _Stream(loop, q, name)))
        self._wake.set()
        await fut  # ValueError when the engine refuses it
        return rid, q

    def abort(self, rid: int) -> None:
        self._inbox.put(("abort", rid))
        self._wake.set()

    def abort_all(self, why: str) -> None:
        """Abort every live request (each stream then ends with finish_reason "abort") and refuse
        later ones; one log line per request. Thread-safe: the shutdown deadline calls it."""
        self.accepting = False
        self._inbox.put(("abort_all", why))
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "abort":
                self.engine.abort(msg[1])
                continue
            if msg[0] == "abort_all":
                self._abort_live(msg[1])
                continue
            _, rid, prompt, params, fut, stream = msg
            with self._lock:
                self._pending -= 1
            if self._closing is not None:
                stream.loop.call_soon_threadsafe(_set_exception, fut, ShuttingDown(self._closing))
                continue
            try:
                self.engine.add(prompt, params, req_id=rid)
            except ValueError as e:
                stream.loop.call_soon_threadsafe(_set_exception, fut, e)
                continue
            self._streams[rid] = stream
            stream.loop.call_soon_threadsafe(_set_result, fut, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # a bug, not a user error: fail the live requests, keep serving
                log.exception("engine step failed")
                self._fail_all(f"internal error in the engine step: {e}")
                continue
            now = time.monotonic()
            for out in outs:
                s = self._streams.get(out.id)
                if s is None:
                    continue
                new = slice(s.sent, len(out.token_ids))
                if new.start < new.stop and s.first_token is None:
                    s.first_token = now
                    if self.metrics:
                        self.metrics.ttft.observe(now - s.submitted)
                upd = Update(
                    out.token_ids[new], out.logprobs[new], out.top_logprobs[new], out.finish_reason,
                    error=out.error, cached_tokens=out.cached_tokens,
                )  # fmt: skip
                s.sent = len(out.token_ids)
                s.loop.call_soon_threadsafe(s.queue.put_nowait, upd)
                if out.finished:
                    self.engine.release(out.id)
                    del self._streams[out.id]
                    if self.metrics and s.first_token is not None and s.sent > 1:
                        self.metrics.tpot.observe((now - s.first_token) / (s.sent - 1))
            if self.metrics:
                self.metrics.observe_engine(self.engine)

    def _abort_live(self, why: str) -> None:
        self._closing = why
        for rid, s in self._streams.items():
            out = self.engine.requests.get(rid)
            if out is None or out.finished:
                continue
            self.engine.abort(rid)  # the next step reports it: its stream's final chunk
            log.warning(
                "request %s aborted (%s): %d prompt tokens, %d generated",
                s.name or rid,
                why,
                len(out.prompt_ids),
                len(out.token_ids),
            )

    def _fail_all(self, why: str) -> None:
        for rid, s in list(self._streams.items()):
            self.engine.abort(rid)
            s.loop.call_soon_threadsafe(s.queue.put_nowait, Update([], [], [], "abort", error=why))
        self._streams.clear()


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
