"""SIGTERM with requests running past --shutdown-timeout: each one stopped ends well-formed (a
stream's final chunk with finish_reason "abort", then [DONE]; a whole answer with "abort"), the
log gets one line per aborted request (per choice of an n > 1 request), naming the OpenAI id its
client received, and no traceback, and the process exits 0."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time

import httpx
from server_fixture import Server

TIMEOUT_S = 1.0
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}  # minutes of decoding on a CPU
ABORTED = re.compile(r"request (\S+?)(?: choice (\d+))? aborted \(still running 1 s after the shutdown")


async def _stream(http: httpx.AsyncClient, path: str, body: dict, started: asyncio.Event) -> list[str]:
    """Every `data:` payload of one stream, up to the server closing it."""
    lines: list[str] = []
    async with http.stream("POST", path, json=body | LONG | {"stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        try:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    if len(lines) >= 3:
                        started.set()
        except httpx.HTTPError as e:  # cut mid-body: what a stream must never see
            lines.append(f"cut: {type(e).__name__}: {e}")
    return lines


def _check_well_formed(lines: list[str], n: int) -> None:
    assert lines and lines[-1] == "[DONE]", lines[-3:]
    chunks = [json.loads(x) for x in lines[:-1]]
    finals = {c["index"]: c["finish_reason"] for ch in chunks for c in ch["choices"] if c["finish_reason"]}
    assert finals == dict.fromkeys(range(n), "abort"), lines[-4:]


def test_sigterm_past_the_shutdown_timeout_ends_every_stream_well_formed() -> None:
    srv = Server("--shutdown-timeout", str(TIMEOUT_S), "--max-model-len", "4096")
    chat = {"messages": [{"role": "user", "content": "Tell me a very long story."}]}
    jobs = [
        ("/v1/chat/completions", chat, 1),
        ("/v1/chat/completions", chat | {"n": 2, "stream_options": {"include_usage": True}}, 2),
        ("/v1/completions", {"prompt": "Once upon a time"}, 1),
    ]

    async def run() -> tuple[list[list[str]], httpx.Response, float]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            started = [asyncio.Event() for _ in jobs]
            pairs = zip(jobs, started, strict=True)
            streams = [asyncio.create_task(_stream(http, p, b, e)) for (p, b, _), e in pairs]
            whole = asyncio.create_task(http.post("/v1/completions", json={"prompt": "Hello"} | LONG))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            got = await asyncio.gather(*streams)
            return got, await whole, time.monotonic() - t0

    try:
        streams, whole, took = asyncio.run(run())
        assert srv.proc.wait(60) == 0
    finally:
        log = srv.output()
        srv.stop()
    for lines, (_, _, n) in zip(streams, jobs, strict=True):
        _check_well_formed(lines, n)
    assert json.loads(streams[1][-2])["usage"]["completion_tokens"] > 0  # usage, after the finals
    assert whole.status_code == 200 and whole.json()["choices"][0]["finish_reason"] == "abort"
    assert TIMEOUT_S <= took < TIMEOUT_S + 10, took
    aborted = [ln for ln in log.splitlines() if "aborted (still running 1 s after the shutdown signal" in ln]
    assert len(aborted) == 5, log[-3000:]  # 1 + 2 (n=2) + 1 streamed, 1 whole: one per request
    logged = sorted((m[1], m[2] or "") for ln in aborted if (m := ABORTED.search(ln)))
    assert len(logged) == len(aborted), aborted
    ids = [{json.loads(x)["id"] for x in lines[:-1]} for lines in streams]
    assert all(len(one) == 1 for one in ids), ids  # every chunk of a stream carries its one id
    (chat, chat_n2, completion), whole_id = (one.pop() for one in ids), whole.json()["id"]
    assert chat.startswith("chatcmpl-") and chat_n2.startswith("chatcmpl-"), (chat, chat_n2)
    assert completion.startswith("cmpl-") and whole_id.startswith("cmpl-"), (completion, whole_id)
    want = sorted([(chat, ""), (chat_n2, "0"), (chat_n2, "1"), (completion, ""), (whole_id, "")])
    assert logged == want, (logged, want)  # the ids the clients got, each request (choice) once
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
