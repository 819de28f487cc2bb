"""Prometheus metrics of one server (its own registry)."""

from __future__ import annotations

import sys

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dayzero.sdk.server.workers import heap_bytes

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dayzero_requests", "Requests by outcome", ["outcome"], registry=r)
        self.aborted = Counter(
            "dayzero_requests_aborted",
            "Aborted requests by who ended them (client, server)",
            ["by"],
            registry=r,
        )
        self.ttft = Histogram(
            "dayzero_time_to_first_token_seconds", "Submission to first token", buckets=LATENCY, registry=r
        )
        self.tpot = Histogram(
            "dayzero_time_per_output_token_seconds",
            "Mean time between output tokens",
            buckets=LATENCY,
            registry=r,
        )
        self.running = Gauge("dayzero_requests_running", "Requests the scheduler runs", registry=r)
        self.waiting = Gauge("dayzero_requests_waiting", "Requests waiting for admission", registry=r)
        self.blocks = Gauge("dayzero_kv_blocks_used", "KV blocks in use", ["group"], registry=r)
        self.cached = Gauge(
            "dayzero_prefix_cache_blocks", "Blocks held only by the prefix cache (device)", registry=r
        )
        self.hit_rate = Gauge(
            "dayzero_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache", registry=r
        )
        self.tokens_in = Counter("dayzero_prompt_tokens", "Prompt tokens", registry=r)
        self.tokens_out = Counter("dayzero_generation_tokens", "Generated tokens", registry=r)
        self.heap = Gauge(
            "dayzero_heap_bytes",
            "The C heap (glibc malloc, every arena): in_use = handed out and not freed (a leak grows "
            "it), free = freed chunks malloc keeps for reuse (their whole pages stay resident until "
            "a malloc_trim)",
            ["state"],
            registry=r,
        )
        self.drafted = Gauge(
            "dayzero_spec_draft_tokens", "Draft tokens verified (speculative decoding)", registry=r
        )
        self.accepted = Gauge(
            "dayzero_spec_accepted_tokens",
            "Draft tokens accepted, by draft position (0: the first draft of a step)",
            ["position"],
            registry=r,
        )
        self.acceptance = Gauge(
            "dayzero_spec_mean_acceptance_length",
            "Tokens a drafted decode row keeps a step: 1 + its accepted drafts, averaged",
            registry=r,
        )
        self.python_blocks = Gauge(
            "dayzero_python_allocated_blocks",
            "Python objects' memory blocks (sys.getallocatedblocks)",
            registry=r,
        )

    def observe_memory(self) -> None:
        """The heap gauges, read when /metrics is scraped (mallinfo2: a walk of malloc's free lists)."""
        if (heap := heap_bytes()) is not None:
            self.heap.labels("in_use").set(heap[0])
            self.heap.labels("free").set(heap[1])
        self.python_blocks.set(sys.getallocatedblocks())

    def observe_engine(self, engine) -> None:
        s = engine.scheduler
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        for g, group in enumerate(engine.groups):
            self.blocks.labels(group.name).set(s.total_blocks(g) - s.free_blocks(g))
        st = s.prefix_stats()
        stats = engine.stats
        if stats["verify_rows"]:
            self.drafted.set(stats["drafted"])
            for i, n in enumerate(stats["accepted_at"]):
                self.accepted.labels(str(i)).set(n)
            self.acceptance.set(1 + sum(stats["accepted_at"]) / stats["verify_rows"])
        self.cached.set(st["device_entries"])
        if st["lookup_tokens"]:
            self.hit_rate.set(st["hit_tokens"] / st["lookup_tokens"])
