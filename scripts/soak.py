"""Soak a dayzero server: many small requests over HTTP, the server's RSS printed at intervals.

    .venv/bin/python scripts/soak.py --requests 20000 --concurrency 8 --max-tokens 2
    .venv/bin/python scripts/soak.py --url http://127.0.0.1:8000 --pid 1234   # a running server

Without --url it starts `dayzero serve` (the embedded default on CPU, plus --serve-flags) on a
free port and stops it at the end. Requests cycle through completions, chat completions and a
streamed completion, each with its own prompt (--distinct K: K prompts over and over, so that
after the warm-up the bounded caches, the tokenizer's word cache and the prefix cache, hold
them all and what still grows is the server's own). RSS is read from /proc/PID/status (Linux); it is
printed at the start, after --warmup requests, every --every requests and at the end, with the
growth per request since the warm-up (a least-squares slope over the samples), then PASS or FAIL
against --max-growth (bytes a request; exit status 1 on FAIL).

After the warm-up and at the end (unless --no-trim-probe; the requests wait meanwhile) one 1.1 MB
body is sent, which the server refuses untokenized and after which it calls malloc_trim(0): RSS
after it is what the process holds, less the free pages glibc would otherwise keep (the server
trims every 500 requests too, so RSS between two trims saws up and down by some MiB). The bound
is then held against the growth of that RSS from the warm-up to the end; without the probe,
against the least-squares slope.

The leak itself is read from the server's /metrics at each sample: the C heap in use (glibc's
mallinfo2: what malloc handed out and never got back) and Python's allocated blocks. The bound
--max-heap-growth holds against the least-squares slope of the heap in use from the warm-up on.
Every prompt new (the default), each request brings one word the tokenizer has not seen (its
number, " 12345", one pre-tokenized word). HF tokenizers keep a cache of 10,000 words a thread
(about 460 bytes of C heap each) that requests used to fill on each tokenizer worker: up to
request 21,000 in one run. Each worker now fills its own at start-up (sdk/server/workers.py,
sdk/loader/tokenizer.py), so the warm-up (default 3,000 requests) only settles the prefix cache
and malloc's arenas.

--big MB first sends one completion whose prompt is MB megabytes of text and prints its status,
the time to the answer and the server's peak RSS while it ran (sampled every 5 ms), e.g.

    .venv/bin/python scripts/soak.py --big 50 --requests 0 --serve-flags "--max-request-bytes 64MiB"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

MAX_GROWTH = 1024.0  # bytes a request after the warm-up (docs/serving.md: what was measured)
MAX_HEAP_GROWTH = 256.0  # bytes a request of malloc'd memory still in use (docs/serving.md)


def heap(url: str) -> tuple[float, float, float] | None:
    """The server's /metrics heap gauges: (C heap in use, C heap held free, in bytes; Python
    blocks), None where the server has no mallinfo2 (not glibc)."""
    want = {'dayzero_heap_bytes{state="in_use"}': 0, 'dayzero_heap_bytes{state="free"}': 1}
    got: list[float | None] = [None, None, None]
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in want:
            got[want[name]] = float(value)
        elif name == "dayzero_python_allocated_blocks":
            got[2] = float(value)
    return None if None in got else (got[0], got[1], got[2])  # type: ignore[return-value]


def rss_kib(pid: int) -> int:
    """The resident set of process pid in KiB (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares growth in bytes a request over (requests done, RSS KiB) samples."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return 1024 * sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def start_server(flags: list[str], timeout: float = 300) -> tuple[subprocess.Popen, str, object]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.NamedTemporaryFile("w+", prefix="soak-server-", suffix=".log", delete=False)  # noqa: SIM115
    cmd = [sys.executable, "-m", "dayzero.sdk.cli", "serve", "--port", str(port), "--device", "cpu", *flags]
    print(f"starting: {shlex.join(cmd)} (log {log.name})", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"the server exited:\n{log.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server was not healthy after {timeout:.0f} s")


async def one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, distinct: int = 0) -> None:
    """Request i: a completion, a chat completion or a streamed completion (i mod 3); its number
    in the prompt is i, or i mod distinct."""
    kind = i % 3
    i = i % distinct if distinct else i
    if kind == 0:
        body = {"prompt": f"Request {i}: the number after {i} is", "max_tokens": max_tokens, "temperature": 0}
        r = await client.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
    elif kind == 1:
        msgs = [{"role": "user", "content": f"Say the number {i}."}]
        r = await client.post(f"{url}/v1/chat/completions", json={"messages": msgs, "max_tokens": max_tokens})
        r.raise_for_status()
        assert r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
    else:
        body = {"prompt": f"Story {i}:", "max_tokens": max_tokens, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            last = ""
            async for line in r.aiter_lines():
                last = line or last
            assert last == "data: [DONE]", last


def trim_probe(url: str, pid: int) -> int:
    """A body of 1.1 MB (over the server's 1 MiB mark: it calls malloc_trim(0) once it has
    answered), refused untokenized; RSS before and 2 s after (returned, KiB)."""
    before = rss_kib(pid)
    body = json.dumps({"prompt": "word " * 220_000, "max_tokens": 1}).encode()
    r = httpx.post(
        f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    time.sleep(2)
    after = rss_kib(pid)
    print(
        f"trim probe ({r.status_code}): RSS {before / 1024:.1f} MiB before, {after / 1024:.1f} MiB "
        f"after the server's malloc_trim ({(after - before) / 1024:+.1f} MiB)",
        flush=True,
    )
    return after


def big_request(url: str, pid: int | None, megabytes: float) -> None:
    """One completion with a prompt of `megabytes` MB of text: status, seconds, peak RSS."""
    body = json.dumps({"prompt": "word " * int(megabytes * 1e6 / 5), "max_tokens": 1}).encode()
    before = rss_kib(pid) if pid else 0
    peak, stop = [before], threading.Event()

    def sample() -> None:
        while pid and not stop.is_set():
            peak.append(rss_kib(pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    r = httpx.post(
        f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=600
    )
    took = time.monotonic() - t0
    time.sleep(1)
    stop.set()
    sampler.join()
    after = rss_kib(pid) if pid else 0
    print(
        f"big request: {len(body) / 1e6:.1f} MB body -> {r.status_code} in {took:.2f} s "
        f"({r.text[:160]}); RSS before {before / 1024:.1f} MiB, peak {max(peak) / 1024:.1f} MiB, "
        f"1 s after {after / 1024:.1f} MiB",
        flush=True,
    )


async def soak(
    args: argparse.Namespace, url: str, pid: int | None
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """The requests; (requests done, RSS KiB) samples from the warm-up on, with the trim probe
    (requests done, RSS KiB after a malloc_trim) at the warm-up and at the end (the workers wait
    meanwhile), and (requests done, C heap in use KiB) samples from the warm-up on."""
    done = 0
    failures = 0
    samples: list[tuple[int, int]] = []
    floors: list[tuple[int, int]] = []
    in_use: list[tuple[int, int]] = []
    t0 = time.monotonic()
    next_report = args.warmup
    probe = bool(pid) and not args.no_trim_probe

    def report(label: str) -> None:
        rss = rss_kib(pid) if pid else 0
        rate = done / max(time.monotonic() - t0, 1e-9)
        h = heap(url)
        mem = "" if h is None else f"  heap {h[0] / 2**20:7.1f} MiB in use, {h[1] / 2**20:6.1f} free"
        mem += "" if h is None else f"  py blocks {h[2]:,.0f}"
        print(
            f"{label:>9} {done:>7} requests  {time.monotonic() - t0:7.1f} s  {rate:6.1f} req/s  "
            f"RSS {rss / 1024:8.1f} MiB{mem}  failures {failures}",
            flush=True,
        )
        if done >= args.warmup and pid:
            samples.append((done, rss))
        if done >= args.warmup and h is not None:
            in_use.append((done, int(h[0] // 1024)))

    report("start")
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:

        async def worker(ids) -> None:
            nonlocal done, failures, next_report
            for i in ids:
                try:
                    await one(client, url, i, args.max_tokens, args.distinct)
                except (httpx.HTTPError, AssertionError, json.JSONDecodeError) as e:
                    failures += 1
                    if failures <= 5:
                        print(f"request {i} failed: {type(e).__name__}: {e}", flush=True)
                done += 1
                if done >= next_report:
                    report("warm-up" if next_report == args.warmup else "")
                    next_report += args.every

        phases = [(0, min(args.warmup, args.requests)), (min(args.warmup, args.requests), args.requests)]
        for lo, hi in phases:
            ids = iter(range(lo, hi))
            await asyncio.gather(*(worker(ids) for _ in range(args.concurrency)))
            if probe and hi > lo:
                floors.append((done, await asyncio.to_thread(trim_probe, url, pid)))
    report("end")
    if failures:
        print(f"{failures} requests failed", flush=True)
    return samples, floors, in_use


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--distinct", type=int, default=0, help="cycle through this many prompts (0: all new)")
    p.add_argument(
        "--warmup",
        type=int,
        default=3000,
        help="requests before the growth is measured (the prefix cache and malloc's arenas settle)",
    )
    p.add_argument("--every", type=int, default=1000, help="print RSS every this many requests")
    p.add_argument("--timeout", type=float, default=120, help="seconds a request may take")
    p.add_argument("--url", default=None, help="a running server (else one is started)")
    p.add_argument("--pid", type=int, default=None, help="the running server's pid, for its RSS")
    p.add_argument("--big", type=float, default=None, help="first, one request of this many MB of text")
    p.add_argument("--serve-flags", default="", help="more `dayzero serve` flags when one is started")
    p.add_argument(
        "--max-growth",
        type=float,
        default=MAX_GROWTH,
        help=f"the bound: FAIL (exit 1) when RSS grows faster, bytes a request (default {MAX_GROWTH})",
    )
    p.add_argument(
        "--max-heap-growth",
        type=float,
        default=MAX_HEAP_GROWTH,
        help="the leak bound: FAIL when the C heap in use (malloc's, from /metrics) grows faster, bytes a "
        f"request (default {MAX_HEAP_GROWTH})",
    )
    p.add_argument("--no-trim-probe", action="store_true", help="no 1.1 MB body at the end")
    args = p.parse_args(argv)
    proc = log = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url, log = start_server(shlex.split(args.serve_flags))
        pid = proc.pid
    if pid is None:
        print("no --pid: RSS is not measured", flush=True)
    try:
        if args.big:
            big_request(url, pid, args.big)
        samples, floors, in_use = asyncio.run(soak(args, url, pid)) if args.requests else ([], [], [])
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
            os.unlink(log.name)
    if len(samples) < 2:
        return 0
    growth = slope(samples)
    (n0, r0), (n1, r1) = samples[0], samples[-1]
    late = samples[len(samples) // 2 :]
    print(
        f"RSS after warm-up {r0 / 1024:.1f} MiB at {n0} requests, {r1 / 1024:.1f} MiB at {n1}, at most "
        f"{max(r for _, r in samples) / 1024:.1f}: {growth:+.1f} bytes a request (least squares over "
        f"{len(samples)} samples; {slope(late):+.1f} over the last {len(late)})",
        flush=True,
    )
    if len(floors) == 2 and floors[1][0] > floors[0][0]:  # the bound holds for what a trim leaves
        (m0, f0), (m1, f1) = floors
        growth = 1024 * (f1 - f0) / (m1 - m0)
        print(
            f"RSS after a malloc_trim {f0 / 1024:.1f} MiB at {m0} requests, {f1 / 1024:.1f} MiB at {m1}: "
            f"{growth:+.1f} bytes a request",
            flush=True,
        )
    ok = growth <= args.max_growth
    verdict = f"{growth:+.1f} bytes a request of RSS, bound {args.max_growth:g}"
    if len(in_use) >= 2:  # the leak itself: memory malloc handed out and never got back
        leak = slope(in_use)
        print(
            f"C heap in use {in_use[0][1] / 1024:.1f} MiB at {in_use[0][0]} requests, "
            f"{in_use[-1][1] / 1024:.1f} MiB at {in_use[-1][0]}: {leak:+.1f} bytes a request "
            f"(least squares over {len(in_use)} samples)",
            flush=True,
        )
        ok = ok and leak <= args.max_heap_growth
        verdict += f"; {leak:+.1f} of C heap in use, bound {args.max_heap_growth:g}"
    print(f"{'PASS' if ok else 'FAIL'}: {verdict}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
