"""The server refuses bad input at the door, through a real `dayzero serve` over HTTP: strict JSON
types and value ranges (a 400 naming the field as written), the body-size cap (413 before the body
is read), text too long for the context refused untokenized, and /metrics counting errors as such."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_fixture import Server

MAX_LEN = 512
CAP = 4 * 2**20  # --max-request-bytes
OK = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    s = Server(
        *("--max-num-seqs", "4", "--kv-cache-memory", "128MiB", "--max-model-len", str(MAX_LEN)),
        *("--max-request-bytes", "4MiB"),
    )
    yield s
    s.stop()


def post(server: Server, path: str, body, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    return httpx.post(
        f"{server.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=timeout
    )


CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hi"}]
WRONG = [  # (path, body, the param the 400 names)
    ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": True}, "n"),
    ("/v1/completions", {"prompt": "x", "temperature": True}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "x", "top_p": Infinity}', "top_p"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"5": -Infinity}}', "logit_bias.5"),
    ("/v1/completions", {"prompt": "x", "stream": "true"}, "stream"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", 5]}, "stop.1"),
    ("/v1/completions", {"prompt": [2**31], "max_tokens": 2}, "prompt.0"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": "x", "seed": "7"}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2**70}, "logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (CHAT, {"messages": USER, "max_completion_tokens": "4"}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "top_logprobs": 2**64}, "top_logprobs"),
    (CHAT, {"messages": USER, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("/detokenize", {"tokens": [2**40]}, "tokens.0"),
]


@pytest.mark.parametrize(("path", "body", "param"), WRONG, ids=[w[2] for w in WRONG])
def test_wrong_types_and_ranges_are_400_naming_the_field(server, path: str, body, param: str) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err
    assert post(server, "/v1/completions", OK).json()["choices"][0]["finish_reason"] == "length"


def test_a_json_syntax_error_gives_line_and_column(server) -> None:
    r = post(server, "/v1/completions", b'{\n  "prompt": "x",\n  "max_tokens": 3,,\n}')
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "not valid JSON" in msg and "line 3 column 19" in msg, msg


def raw_request(server: Server, head: str, chunks: list[bytes]) -> tuple[bytes, float]:
    """Sends head then chunks (stopping when the server answers or closes); the reply and the
    seconds it took."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head.encode())
        try:
            for c in chunks:
                s.sendall(c)
        except OSError:  # the server answered and closed before taking all of it
            pass
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            got = s.recv(65536)
            if not got:
                break
            reply += got
    return reply, time.monotonic() - t0


def test_a_body_over_the_cap_is_413_before_it_is_read(server) -> None:

    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10 * CAP}\r\n\r\n"
    )
    reply, took = raw_request(server, head, [b'{"prompt": "'])  # the rest is never sent
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert str(CAP) in err["message"] and err["code"] == 413
    assert took < 1, took
    chunk = b"a" * 2**20
    body = [b'{"prompt": "'] + [chunk] * (CAP // len(chunk) + 2)
    framed = [f"{len(c):x}\r\n".encode() + c + b"\r\n" for c in body]
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    reply, took = raw_request(server, head, framed)  # counted as it streams in
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert took < 1, took
    padded = json.dumps(OK).encode() + b" " * (CAP - 200)  # just under the cap: served
    assert post(server, "/v1/completions", padded).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", lambda t: {"prompt": t, "max_tokens": 2}),
        ("/v1/completions", lambda t: {"prompt": ["Hi", t], "max_tokens": 2}),
        (CHAT, lambda t: {"messages": [{"role": "user", "content": t}], "max_tokens": 2}),
        (CHAT, lambda t: {"messages": [{"role": "user", "content": [{"type": "text", "text": t}]}]}),
        ("/tokenize", lambda t: {"prompt": t}),
    ],
    ids=["prompt", "prompts", "chat", "parts", "tokenize"],
)
def test_text_too_long_for_the_context_is_refused_untokenized(server, path: str, body) -> None:
    text = "word " * 700_000  # 3.5 MB, under the body cap: tokenizing it takes seconds on CPU
    t0 = time.monotonic()
    r = post(server, path, body(text))
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    assert "too long" in r.json()["error"]["message"] and r.json()["error"]["param"] in ("prompt", "messages")
    assert took < 1.5, took
    assert post(server, "/v1/completions", OK).status_code == 200


def test_metrics_count_errors_as_errors(server) -> None:
    def count(outcome: str) -> float:
        try:
            return server.metric("dayzero_requests_total", f'{{outcome="{outcome}"}}')
        except KeyError:
            return 0.0

    ok, e404, e413, e400 = count("ok"), count("error_404"), count("error_413"), count("error_400")
    assert httpx.get(f"{server.url}/v1/nothing", timeout=10).status_code == 404
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {CAP + 1}\r\n\r\n"
    )
    assert raw_request(server, head, [])[0].startswith(b"HTTP/1.1 413")
    assert post(server, "/v1/completions", b"{oops").status_code == 400
    assert count("error_404") == e404 + 1 and count("error_413") == e413 + 1
    assert count("error_400") == e400 + 1 and count("ok") == ok
