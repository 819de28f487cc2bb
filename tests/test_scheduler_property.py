"""Randomized property test of the control plane.

Thousands of random operations (submit, step, results, abort, stop-string
finish, remote fills, memory pressure with retraction and restore, prefix
hits), for several configurations and recorded seeds. After every operation:
each block's reference count equals its references from block tables and the
prefix cache, no block is both free and referenced, host pages and state slots
add up (Scheduler.check_invariants). Throughout: no live request waits longer
than a fixed number of steps without being scheduled. At the end: once every
request has finished and the prefix cache is flushed, every block is free.
"""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
from conftest import SEEDS

from dayzero.sdk.scheduler import CacheGroup, GroupKind, Scheduler, SchedulerError, make_config

BLOCK = 8
STOP = 3
MAX_LIVE = 14  # clients in flight; with the batch cap of 6, some always wait
STARVATION_BOUND = 80  # steps a live request may go unscheduled (worst seen over all seeds: 51)

CONFIGS = {
    "paged+host": dict(
        groups=[CacheGroup("kv", GroupKind.Paged, bytes_per_token=4)],
        device_bytes=20 * BLOCK * 4,
        host_bytes=30 * BLOCK * 4,
    ),
    "paged-no-host": dict(
        groups=[CacheGroup("kv", GroupKind.Paged, bytes_per_token=4)],
        device_bytes=20 * BLOCK * 4,
    ),
    "overlap": dict(
        groups=[CacheGroup("kv", GroupKind.Paged, bytes_per_token=4)],
        device_bytes=22 * BLOCK * 4,
        host_bytes=20 * BLOCK * 4,
        overlap=True,
    ),
    "speculative": dict(
        groups=[CacheGroup("kv", GroupKind.Paged, bytes_per_token=4)],
        device_bytes=22 * BLOCK * 4,
        host_bytes=20 * BLOCK * 4,
        spec_tokens=3,
    ),
    "hybrid": dict(
        groups=[
            CacheGroup("latent", GroupKind.Paged, bytes_per_token=16),
            CacheGroup("index", GroupKind.Paged, bytes_per_token=4),
            CacheGroup("swa", GroupKind.SlidingWindow, bytes_per_token=8, window=12),
            CacheGroup("ssm", GroupKind.State, state_bytes=256),
        ],
        device_bytes=40 * BLOCK * 16 + 10 * 256,
        host_bytes=60 * BLOCK * 16,
        snapshot_slots=4,
    ),
}


class Harness:
    def __init__(self, name: str, seed: int) -> None:
        kw = dict(CONFIGS[name])
        self.overlap = kw.get("overlap", False)
        self.spec = kw.get("spec_tokens", 0)
        self.s = Scheduler(
            make_config(
                kw.pop("groups"),
                block_size=BLOCK,
                max_batch_size=6,
                max_tokens_per_step=48,
                chunk_size=20,
                **kw,
            )
        )
        self.rng = random.Random(seed)
        self.next_id = 0
        self.plans: deque = deque()
        self.last_seen: dict[int, int] = {}  # request -> step it was last scheduled or became waiting
        self.remote_pending: set[int] = set()  # remote requests not yet bootstrapped
        self.step_no = 0
        self.totals = [self.s.total_blocks(g) for g in range(len(CONFIGS[name]["groups"]))]
        self.finished: set[int] = set()
        self.retractions = 0

    def submit(self) -> None:
        if self.s.num_live >= MAX_LIVE:  # bounded load: waiting must then be bounded too
            return
        rid = self.next_id
        self.next_id += 1
        shared = self.rng.choice([0, 0, 8, 16, 24])  # common prefixes make prefix hits
        tail = self.rng.randint(1, 30)
        prompt = [1 + (i % 50) for i in range(shared)] + [self.rng.randint(4, 500) for _ in range(tail)]
        remote = self.rng.random() < 0.1
        self.s.submit(
            rid,
            np.array(prompt, dtype=np.int32),
            max_new_tokens=self.rng.randint(1, 24),
            stop_ids=[STOP],
            remote=remote,
        )
        if remote:
            self.remote_pending.add(rid)
        else:
            self.last_seen[rid] = self.step_no

    def step(self) -> None:
        p = self.s.step()
        self.step_no += 1
        self.retractions += len(p.retracted_ids)
        for rid in p.req_ids.tolist():
            self.last_seen[rid] = self.step_no
        for rid in p.finished_ids.tolist():
            self.finished.add(rid)
            self.last_seen.pop(rid, None)
        if p.rows:
            self.plans.append(p)
        depth = 2 if self.overlap else 1
        while self.plans and (len(self.plans) >= depth or self.rng.random() < 0.5):
            self.results(self.plans.popleft())

    def results(self, p) -> None:
        counts = p.sample.astype(np.int32)
        if self.spec:
            counts = np.where(counts > 0, np.array([self.rng.randint(1, 1 + self.spec) for _ in counts]), 0)
        tokens = np.array(
            [
                STOP if self.rng.random() < 0.04 else self.rng.randint(4, 500)
                for _ in range(int(counts.sum()))
            ],
            dtype=np.int32,
        )
        self.s.feed(p.req_ids, counts.astype(np.int32), tokens)

    def stop(self, rid: int) -> str | None:
        """The request's stop, or None once it has finished (reported in a later plan)."""
        try:
            return self.s.phase_of(rid)
        except SchedulerError as e:
            assert "is not live" in str(e)
            self.last_seen.pop(rid, None)
            self.finished.add(rid)
            return None

    def remote_event(self) -> None:
        if self.remote_pending:
            rid = self.remote_pending.pop()
            self.s.bootstrap_done(rid)
            self.last_seen[rid] = self.step_no
        for rid in list(self.last_seen):
            if self.stop(rid) == "RemoteFill" and self.rng.random() < 0.5:
                self.s.remote_fill_done(rid, self.rng.randint(4, 500))
                self.last_seen[rid] = self.step_no

    def abort_or_finish(self) -> None:
        live = list(self.last_seen)
        if not live:
            return
        rid = self.rng.choice(live)
        if self.stop(rid) is None:
            with pytest.raises(SchedulerError, match="is not live"):
                self.s.abort(rid)  # a client abort that races the request's end
            return
        if self.rng.random() < 0.5:
            self.s.abort(rid)
            self.last_seen.pop(rid)
        else:
            try:  # a stop string: legal only while decoding
                self.s.finish(rid)
                self.last_seen.pop(rid)
            except SchedulerError as e:
                assert "not legal in phase" in str(e)

    def check(self) -> None:
        self.s.check_invariants()
        for rid, seen in list(self.last_seen.items()):
            if self.stop(rid) in (None, "RemoteFill"):  # RemoteFill waits on the remote node, not on us
                continue
            waited = self.step_no - seen
            assert waited <= STARVATION_BOUND, (
                f"request {rid} unscheduled for {waited} steps ({self.s.phase_of(rid)})"
            )

    def drain(self) -> None:
        for rid in list(self.remote_pending):
            self.s.bootstrap_done(rid)
            self.last_seen[rid] = self.step_no
        self.remote_pending.clear()
        for _ in range(5000):
            if not self.s.num_live and not self.plans:
                break
            for rid in list(self.last_seen):
                if self.stop(rid) == "RemoteFill":
                    self.s.remote_fill_done(rid, 9)
            self.step()
            self.check()
        while self.plans:
            self.results(self.plans.popleft())
        assert self.s.num_live == 0
        self.s.flush_prefix_cache()
        self.s.step()  # host pages read by the last copies come back
        for g, total in enumerate(self.totals):
            assert self.s.free_blocks(g) == total, f"group {g}: {self.s.free_blocks(g)} free of {total}"
        self.s.check_invariants()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_random_operations_keep_every_invariant(name: str, seed: int):
    h = Harness(name, seed)
    ops = [h.submit] * 3 + [h.step] * 6 + [h.abort_or_finish, h.remote_event]
    for _ in range(3000):
        h.rng.choice(ops)()
        h.check()
    assert h.s.prefix_stats()["hit_tokens"] > 0, "the workload should produce prefix hits"
    assert h.retractions > 0, "the workload should put memory under pressure"
    h.drain()
