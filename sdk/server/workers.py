"""CPU work of a request that must not run on the event loop (tokenizing, rendering the chat
template, compiling a tool grammar), in a bounded pool; and giving memory back after a big
request.

The pool has `workers` threads and holds at most `workers + queue` jobs (running or waiting):
one more is refused at once with `Busy` (the app answers 503 with Retry-After, in OpenAI's error
shape), so a burst of large prompts cannot queue without bound behind the tokenizer. A job
counts until its thread is done with it, even when the client that asked has gone away.
`start` (e.g. the tokenizer's `fill_word_cache`) runs once on every worker thread before the
pool takes jobs: HF tokenizers keep their word cache per thread (filled by a thread's first
~10,000 distinct words, ~460 bytes of C heap each, then fixed), so each worker fills its own.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger("dayzero.server")

T = TypeVar("T")

DEFAULT_WORKERS = 2
DEFAULT_QUEUE = 64
TRIM_AFTER_BYTES = 1 << 20  # a request body at least this large gives its memory back after it
# ... and every this many requests, whatever their size: small requests leave freed chunks all
# over the C heap that glibc keeps (a 3,000-request soak: +42 MiB, 32.5 of it given back by one
# malloc_trim; docs/serving.md). A trim takes ~5-10 ms, on its own thread.
TRIM_EVERY_REQUESTS = 500


class Busy(RuntimeError):
    """Every worker is busy and the queue is full: retry later (HTTP 503)."""


class WorkPool:
    def __init__(
        self,
        workers: int = DEFAULT_WORKERS,
        queue: int = DEFAULT_QUEUE,
        start: Callable[[], object] | None = None,
    ) -> None:
        if workers < 1 or queue < 0:
            raise ValueError(f"a work pool needs a worker and a queue >= 0, got {workers}, {queue}")
        self.workers, self.limit = workers, workers + queue
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="dayzero-tokenize")
        self._held = 0
        self._lock = threading.Lock()
        if start is not None:  # one job a thread: each waits for the others, so none takes two
            met = threading.Barrier(workers)
            for f in [self._executor.submit(_started, start, met) for _ in range(workers)]:
                f.result()

    @property
    def held(self) -> int:
        """Jobs running or waiting."""
        return self._held

    async def run(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on a worker thread; Busy when the pool is full."""
        with self._lock:
            if self._held >= self.limit:
                raise Busy(
                    f"the server is overloaded: {self._held} tokenizing jobs are running or waiting "
                    f"(limit {self.limit}); retry later"
                )
            self._held += 1
        try:
            fut = self._executor.submit(fn, *args, **kwargs)
        except BaseException:
            self._release()
            raise
        fut.add_done_callback(self._release)  # done or cancelled (its client gone before it ran)
        return await asyncio.wrap_future(fut)

    def _release(self, _fut=None) -> None:
        with self._lock:
            self._held -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _started(start: Callable[[], object], met: threading.Barrier) -> None:
    start()
    met.wait()


@functools.cache
def _glibc(name: str, argtypes: tuple, restype) -> Callable | None:
    """glibc's function `name`, typed (None elsewhere: macOS, musl, Windows; or a glibc too old
    to have it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def _malloc_trim() -> Callable[[int], int] | None:
    return _glibc("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


class _Mallinfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (2.33+): byte counts summed over every malloc arena."""

    _fields_ = [
        ("arena", ctypes.c_size_t),
        ("ordblks", ctypes.c_size_t),
        ("smblks", ctypes.c_size_t),
        ("hblks", ctypes.c_size_t),
        ("hblkhd", ctypes.c_size_t),  # mmap'd chunks
        ("usmblks", ctypes.c_size_t),
        ("fsmblks", ctypes.c_size_t),
        ("uordblks", ctypes.c_size_t),  # in use
        ("fordblks", ctypes.c_size_t),  # free
        ("keepcost", ctypes.c_size_t),
    ]


def _mallinfo2() -> Callable[[], _Mallinfo2] | None:
    return _glibc("mallinfo2", (), _Mallinfo2)  # glibc 2.33+


def heap_bytes() -> tuple[int, int] | None:
    """(bytes malloc has handed out and not had back: uordblks + hblkhd, the memory in use; bytes
    of freed chunks it keeps for reuse: fordblks, whose whole pages stay resident until a
    malloc_trim), over every arena; None where there is no glibc mallinfo2. A growing first
    number is a leak (C or C++ objects never freed, or a cache filling); a growing RSS with a flat
    first number is the allocator keeping pages. Python's small objects live in pymalloc's own
    arenas, outside both (sys.getallocatedblocks)."""
    info = _mallinfo2()
    if info is None:
        return None
    m = info()
    return m.uordblks + m.hblkhd, m.fordblks


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for its moving threshold (64-bit)
TRIM_THRESHOLD_BYTES = 4 << 20
MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def fix_malloc_thresholds(environ: dict[str, str] | None = None) -> bool:
    """Fixed glibc thresholds for the server: allocations under 32 MiB from the heap, larger ones
    mmap'd (and unmapped at free), and a heap's free top given back once it reaches 4 MiB.

    glibc's defaults move: each mmap'd chunk freed raises the mmap threshold to its size (up to
    32 MiB) and the trim threshold to twice that. After a few MiB-sized request bodies a thread's
    malloc arena then keeps its free top, up to 64 MiB, resident; malloc_trim gives back free
    chunks inside every arena but not a thread arena's top. Measured: four 4 MiB bodies at once,
    twice, left +11 to +17 MiB of RSS in one thread arena after the trim; with these thresholds
    +0.2 to +0.7 MiB. Nothing is changed where the user set malloc's own environment variables,
    or where there is no glibc."""
    env = os.environ if environ is None else environ
    mallopt = _glibc("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is None or any(k in env for k in MALLOC_ENV):
        return False
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def give_memory_back() -> bool:
    """Return the C heap's free pages to the system (glibc malloc_trim(0)): a big request's
    buffers, once freed, otherwise stay in the process's RSS. False where there is no glibc."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class Trimmer:
    """Runs give_memory_back on a thread after a big request and every `every` requests, at most
    one at a time (a request for one during a trim asks for one more after it)."""

    def __init__(self, large: int = TRIM_AFTER_BYTES, every: int = TRIM_EVERY_REQUESTS) -> None:
        self.large, self.every = large, every
        self._since = 0  # requests answered since the last trim asked for
        self._running = False
        self._again = False
        self._lock = threading.Lock()
        self.trims = 0

    def answered(self, body_bytes: int) -> None:
        """One request answered (on the event loop), whose body was body_bytes long."""
        self._since += 1
        if body_bytes >= self.large or self._since >= self.every:
            self._since = 0
            self.request()

    def request(self) -> None:
        with self._lock:
            if self._running:
                self._again = True
                return
            self._running = True
        threading.Thread(target=self._run, name="dayzero-trim", daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                give_memory_back()
            except Exception:  # never worth a request: log and go on
                log.exception("malloc_trim failed")
            with self._lock:
                self.trims += 1
                if not self._again:
                    self._running = False
                    return
                self._again = False


class OneThread:
    """One dedicated thread for a big body's JSON parse: the event loop goes on meanwhile, and
    big parses queue behind each other instead of each taking a new thread (and with it, in
    glibc, possibly a new malloc arena whose memory malloc_trim cannot all give back)."""

    def __init__(self, name: str = "dayzero-json") -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
