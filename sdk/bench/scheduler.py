"""`dayzero bench scheduler`: the control plane alone, against TokenSpeed's scheduler.

Workload (the same for both): N live requests, each a 4,096-token prefix shared
by all plus 256 unique tokens, page size 64, a budget of 8,192 tokens per step.
Once every request decodes one token per step, 1,000 steps are timed. A step
counts the scheduler call and the Python side: reading the plan (ids, input
tokens, positions, block tables) and feeding one token per request back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from dayzero.sdk.scheduler import CacheGroup, GroupKind, Scheduler, make_config

PREFIX, UNIQUE, PAGE, BUDGET = 4096, 256, 64, 8192
PROMPT = PREFIX + UNIQUE
MAX_NEW = 4000  # outlives warm-up + the timed steps


def _prompts(n: int) -> list[np.ndarray]:
    prefix = np.arange(1, PREFIX + 1, dtype=np.int32)
    return [
        np.concatenate([prefix, 100_000 + i * UNIQUE + np.arange(UNIQUE, dtype=np.int32)]) for i in range(n)
    ]


def _pages(n: int) -> int:
    return n * 100 + 1000  # prompt (68 pages) + 1,000 decoded tokens (16 pages) each, with room


class Ours:
    name = "dayzero"

    def __init__(self, n: int) -> None:
        cfg = make_config(
            [CacheGroup("full_attention", GroupKind.Paged, bytes_per_token=2)],
            device_bytes=_pages(n) * PAGE * 2,
            block_size=PAGE,
            max_batch_size=n,
            max_tokens_per_step=BUDGET,
        )
        self.s = Scheduler(cfg)
        for i, p in enumerate(_prompts(n)):
            self.s.submit(i, p, max_new_tokens=MAX_NEW)
        self.n = n

    def step(self) -> int:
        plan = self.s.step()
        ids = plan.req_ids
        _ = plan.input_ids, plan.positions, plan.block_tables[0], plan.kv_lens
        counts = plan.sample.astype(np.int32)
        self.s.feed(ids, counts, np.full(int(counts.sum()), 7, dtype=np.int32))
        return len(ids)

    def all_decoding(self) -> bool:
        return self.s.phase_counts()["Decoding"] == self.n


class TokenSpeed:
    name = "tokenspeed"

    def __init__(self, n: int) -> None:
        import tokenspeed_scheduler as ts

        self.ts = ts
        cfg = ts.SchedulerConfig()
        cfg.max_scheduled_tokens = BUDGET
        cfg.max_batch_size = n
        cfg.num_device_pages = _pages(n)
        cfg.num_snapshot_pages = 1
        cfg.prefix_granularity = PAGE
        cfg.cache_groups = [ts.CacheGroupConfig("full_attention", PAGE, _pages(n), ts.AttnKind.Full)]
        self.s = ts.Scheduler(cfg)
        specs = []
        for i, p in enumerate(_prompts(n)):
            r = ts.RequestSpec()
            r.request_id = f"r{i}"
            r.tokens = p.tolist()
            r.max_new_tokens = MAX_NEW
            specs.append(r)
        self.s.submit_requests(specs)
        self.done = {f"r{i}": 0 for i in range(n)}
        self.n = n

    def step(self) -> int:
        ts = self.ts
        plan = self.s.next_execution_plan()
        ev = ts.ExecutionEvent()
        rows = 0
        for op in plan.forward:
            for rid, k in zip(op.request_ids, op.input_lengths, strict=True):
                e = ts.ForwardEvent.ExtendResult()
                e.request_id = rid
                d = self.done[rid]
                if d < PROMPT:  # a prefill chunk yields a token only when it is the last
                    d += k
                    self.done[rid] = d
                    e.tokens = [7] if d >= PROMPT else []
                else:
                    e.tokens = [7]
                ev.add_event(e)
                rows += 1
        self.s.advance(ev)
        return rows

    def all_decoding(self) -> bool:
        return self.s.decoding_size() == self.n


def _time(make: Callable[[int], Ours | TokenSpeed], n: int, steps: int) -> float:
    sched = make(n)
    warm = 0
    while not sched.all_decoding():
        sched.step()
        warm += 1
        if warm > 10_000:
            raise RuntimeError(f"{sched.name}: requests never all reached decoding")
    for _ in range(20):
        sched.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        rows = sched.step()
        if rows != n:
            raise RuntimeError(f"{sched.name}: a decode step scheduled {rows} rows, expected {n}")
    return (time.perf_counter() - t0) / steps


def run(sizes: tuple[int, ...] = (32, 256, 1024), steps: int = 1000) -> list[float | None]:
    try:
        import tokenspeed_scheduler  # noqa: F401

        have_ts = True
    except ImportError:
        have_ts = False
        print(
            "note: tokenspeed-scheduler is not installed (pip install tokenspeed-scheduler);"
            " its column is skipped"
        )
    print(f"{'live':>6} {'dayzero us/step':>16} {'tokenspeed us/step':>19} {'ratio':>7}", flush=True)
    ratios: list[float | None] = []
    for n in sizes:
        ours = _time(Ours, n, steps)
        theirs = _time(TokenSpeed, n, steps) if have_ts else None
        r = ours / theirs if theirs else None
        ratios.append(r)
        ts_col = f"{theirs * 1e6:19.1f}" if theirs else f"{'skipped':>19}"
        r_col = f"{r:7.3f}" if r is not None else f"{'n/a':>7}"
        print(f"{n:>6} {ours * 1e6:16.1f} {ts_col} {r_col}", flush=True)
    print("scheduler_vs_tokenspeed " + " ".join(f"{r:.3f}" if r is not None else "n/a" for r in ratios))
    return ratios
