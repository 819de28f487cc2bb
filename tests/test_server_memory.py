"""The server's memory and its work off the event loop, through a real `dayzero serve` over HTTP:
large requests in parallel keep its RSS under a stated bound and give the memory back; the
tokenizer pool is bounded (503 in OpenAI's shape when full, never an unbounded queue); a few
hundred requests after a warm-up grow RSS by less than a stated bound a request; a client that
disconnects mid-stream is counted as an abort and logged by its OpenAI id; a stream keeps flowing
while a large body is parsed (off the event loop)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_fixture import Server

from dayzero.sdk.server import workers

CAP = 4 * 2**20  # the parallel bodies' size
BIG_MB = 48  # one body this large, while a stream runs (--max-request-bytes 64MiB)
OK = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
ROOT = Path(__file__).resolve().parents[1]

# The bounds, in MiB over the RSS after warm-up. A 4 MiB body costs the server its bytes, the
# decoded str, the parsed JSON and pydantic's copy (more for a list of token ids: a Python int a
# number); four at once peaked at +250 MiB (2026-12-02, CPython 3.11, CPU).
PEAK_BOUND_MIB = 400
# 1 s after they are answered their buffers are back with the system (malloc_trim, and fixed
# malloc thresholds: workers.fix_malloc_thresholds): measured +0.2 to +0.7 MiB with two other
# processes busy on the 2 cores; without the trim the C heap kept +28 MiB of them, and with the
# trim but glibc's moving thresholds a thread arena's free top kept +11 to +17 MiB.
AFTER_BOUND_MIB = 12
GROWTH_BOUND = 8192  # bytes a request after warm-up; measured +52 (2026-12-02, 300 requests)


@pytest.fixture(scope="module")
def server():
    s = Server(
        *("--max-num-seqs", "4", "--max-request-bytes", "64MiB"),
        *("--tokenizer-workers", "1", "--tokenizer-queue", "1"),
    )
    yield s
    s.stop()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def post(server: Server, path: str, body: dict | bytes, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=timeout
    )


def big_bodies() -> list[tuple[str, bytes]]:
    """Four bodies just under the cap, each refused: text too long for the context (untokenized)
    as a prompt, chat content and /tokenize's prompt, and a list of token ids longer than the
    context (parsed, then refused)."""
    room = CAP - 4096
    text = "word " * (room // 5)
    ids = "[" + ",".join(["1000"] * (room // 5)) + "]"
    return [
        ("/v1/completions", json.dumps({"prompt": text, "max_tokens": 2}).encode()),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": text}]}).encode()),
        ("/tokenize", json.dumps({"prompt": text}).encode()),
        ("/v1/completions", f'{{"prompt": {ids}, "max_tokens": 2}}'.encode()),
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc")
def test_malloc_thresholds_are_fixed_unless_the_user_set_them() -> None:
    # (the thresholds are process-wide: setting them in this test process is harmless)
    for name in workers.MALLOC_ENV:
        assert not workers.fix_malloc_thresholds({name: "1"}), name  # the user's own choice stands
    assert not workers.fix_malloc_thresholds({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert workers.fix_malloc_thresholds({"PATH": "/bin"})  # glibc's mallopt took both


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_large_requests_in_parallel_keep_rss_bounded_and_give_it_back(server) -> None:
    if not Path(f"/proc/{server.proc.pid}/status").exists():
        pytest.skip("no /proc")
    expected = post(server, "/v1/completions", OK).json()["choices"][0]["text"]
    bodies = big_bodies()
    assert all(len(b) <= CAP for _, b in bodies)
    for path, body in bodies:  # warm-up: each kind once, alone
        assert post(server, path, body).status_code == 400
    time.sleep(1)
    base = rss_mib(server.proc.pid)
    peak, stop = [base], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.append(rss_mib(server.proc.pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for _round in range(2):
            with ThreadPoolExecutor(len(bodies)) as ex:
                answers = list(ex.map(lambda pb: post(server, *pb), bodies))
            for r in answers:
                assert r.status_code == 400, r.text[:300]
                assert "too long" in r.json()["error"]["message"] or "maximum model length" in r.text
    finally:
        stop.set()
        sampler.join()
    time.sleep(1)
    after = rss_mib(server.proc.pid)
    assert max(peak) - base < PEAK_BOUND_MIB, (base, max(peak))
    assert after - base < AFTER_BOUND_MIB, (base, max(peak), after)
    r = post(server, "/v1/completions", OK)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected


def test_the_tokenizer_pool_is_bounded_503_when_full(server) -> None:
    """One tokenizer thread and a queue of one: of twelve /tokenize requests at once, each with
    about 1 MB of text (hundreds of ms to tokenize on CPU), those past the two the pool holds are
    refused at once with 503 and Retry-After in OpenAI's shape; the rest are tokenized in full."""
    text = "lorem ipsum dolor sit amet " * 40_000  # 1.08 MB, under the text bound at 8192 tokens
    want = len(post(server, "/tokenize", {"prompt": text}).json()["tokens"])
    with ThreadPoolExecutor(12) as ex:
        answers = list(ex.map(lambda _: post(server, "/tokenize", {"prompt": text}), range(12)))
    codes = sorted(r.status_code for r in answers)
    assert set(codes) == {200, 503} and codes.count(200) >= 1, codes
    for r in answers:
        if r.status_code == 200:
            assert r.json()["count"] == want
        else:
            err = r.json()["error"]
            assert r.headers["retry-after"] == "1" and err["code"] == 503, r.text
            assert err["type"] == "service_unavailable" and "overloaded" in err["message"], err
    assert server.metric("dayzero_requests_total", '{outcome="error_503"}') >= codes.count(503)
    assert post(server, "/v1/completions", OK).status_code == 200
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_rss_growth_per_request_after_warmup_is_bounded(server) -> None:
    """scripts/soak.py against the server: 100 requests of warm-up, then 200 (completions, chat,
    streams over 60 prompts, so that the bounded caches are warm: the tokenizer's word cache
    and the prefix cache); the least-squares RSS slope over samples every 40 requests stays
    under GROWTH_BOUND bytes a request (what was measured: see docs/serving.md)."""
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "soak.py"),
        *("--url", server.url, "--pid", str(server.proc.pid)),
        *("--requests", "300", "--warmup", "100", "--every", "40", "--concurrency", "2"),
        *("--max-tokens", "1", "--distinct", "60", "--max-growth", str(GROWTH_BOUND), "--no-trim-probe"),
        *("--max-heap-growth", str(GROWTH_BOUND)),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    end = [ln for ln in run.stdout.splitlines() if ln.lstrip().startswith("end")]
    assert end and "failures 0" in end[-1], run.stdout[-2000:]
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.splitlines()[-1].startswith("PASS: "), run.stdout[-2000:]
    assert "of C heap in use" in run.stdout.splitlines()[-1], run.stdout[-2000:]  # /metrics' mallinfo2 read


def test_a_client_gone_mid_stream_is_counted_abort_and_logged_by_its_openai_id(server) -> None:
    def count(name: str, labels: str) -> float:
        try:
            return server.metric(name, labels)
        except KeyError:
            return 0.0

    aborts = count("dayzero_requests_total", '{outcome="abort"}')
    by_client = count("dayzero_requests_aborted_total", '{by="client"}')
    body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{server.url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        chunks = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
            if len(chunks) >= 3:
                break  # and the connection is closed with the stream half read
    rid = chunks[0]["id"]
    assert rid.startswith("cmpl-")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and count("dayzero_requests_total", '{outcome="abort"}') == aborts:
        time.sleep(0.1)
    assert count("dayzero_requests_total", '{outcome="abort"}') == aborts + 1
    assert count("dayzero_requests_aborted_total", '{by="client"}') == by_client + 1
    lines = [ln for ln in server.output().splitlines() if "aborted (the client disconnected)" in ln]
    assert any(f"request {rid} aborted" in ln for ln in lines), lines[-5:]
    deadline = time.monotonic() + 10  # the engine thread applies the abort between steps
    while time.monotonic() < deadline and httpx.get(f"{server.url}/health", timeout=10).json()["running"]:
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/health", timeout=10).json()["running"] == 0
    assert post(server, "/v1/completions", OK).status_code == 200


# A 48 MB body's JSON takes about 0.1 s to parse, holding the GIL wherever it runs (json.loads is
# one C call), so the parse off the loop (and the text checks skipping ASCII text) shortens the
# stall but cannot remove it. Measured 2026-12-02 (CPU, 2 shared cores, tokens every ~0.085 s):
# the longest gap around a 48-50 MB body 0.37-0.53 s with the parse and the checks on the loop,
# 0.25-0.42 s now (0.29-0.48 s for three at once), mostly the two cores' contention (the body's
# arrival, the engine's threads). The bound: STALL_BOUND_S over the median gap, which a loop held
# for the body's whole handling (its tokenizing: tens of seconds) would be far past; it does not
# tell a parse on the loop from one off it.
STALL_BOUND_S = 0.75


def test_a_stream_keeps_flowing_while_a_large_body_is_parsed(server) -> None:
    """A stream's chunks keep coming while two 48 MB bodies (text too long for the context,
    refused untokenized) are read, parsed and refused one after the other: no gap between two
    chunks overlapping them is more than STALL_BOUND_S over the stream's median gap."""
    big = json.dumps({"prompt": "word " * (BIG_MB * 10**6 // 5), "max_tokens": 1}).encode()
    body = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
    arrivals: list[float] = []
    spans: list[tuple[float, float, int]] = []

    def post_big() -> None:
        for _ in range(2):
            t0 = time.monotonic()
            code = post(server, "/v1/completions", big).status_code
            spans.append((t0, time.monotonic(), code))
            time.sleep(0.5)

    poster = threading.Thread(target=post_big)
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{server.url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
                if len(arrivals) == 20:
                    poster.start()
    poster.join()
    assert [code for *_, code in spans] == [400, 400], spans
    assert spans[-1][1] < arrivals[-1], "the stream ended before the big bodies were answered"
    gaps = [(a, b - a) for a, b in itertools.pairwise(arrivals)]
    median = sorted(g for _, g in gaps[1:19])[9]  # before the big bodies (the first: prefill)
    during = [g for a, g in gaps if any(a <= t1 and a + g >= t0 for t0, t1, _ in spans)]
    assert during, (spans, arrivals[:3], arrivals[-3:])
    assert max(during) < median + STALL_BOUND_S, (median, sorted(during)[-5:])
