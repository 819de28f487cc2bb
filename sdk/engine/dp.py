"""Data-parallel attention (SGLang's --enable-dp-attention): each of P ranks attends, with the
whole attention block (every head, its own sparse indexer), for its own requests, and its KV
pool holds only theirs; the MLPs (experts split over the ranks), the embedding and the LM head
(vocab-parallel) run on every rank's tokens, gathered before each MLP (sdk/blocks/decoder.py).

Rank 0 holds one C++ scheduler per attention rank (SGLang gives each DP rank its own): a new
request goes to the one with the fewest live requests (the lowest rank at a tie) and stays
there, so each scheduler's prefix cache, retraction and KV blocks are its rank's own. A step
is every scheduler's plan, their rows rank after rank (`DpPlan`): rank r runs part r's KV
copies and attention rows; the logits of every part's sampling rows come back to every rank in
that order, and each part's tokens feed its own scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dayzero.sdk.engine.context import DpStep, StepContext, build_context
from dayzero.sdk.scheduler import Scheduler, SchedulerConfig, SchedulerError

ROWS = ("num_tokens", "positions", "kv_lens", "input_ids", "sample", "state_slots", "req_ids", "is_prefill")


@dataclass
class DpPlan:
    """Every attention rank's plan of one step, their rows concatenated in rank order (the
    arrays the engine reads of a plan); `copies` are this rank's part's."""

    parts: list  # [P] one Plan per attention rank
    rank: int

    def __post_init__(self) -> None:
        for name in ROWS:  # [sum of the parts' rows] or [sum of their tokens]
            setattr(self, name, np.concatenate([np.asarray(getattr(p, name)) for p in self.parts]))
        starts = np.cumsum([0] + [p.num_input_tokens for p in self.parts])
        qs = [np.asarray(p.query_start)[:-1] + s for p, s in zip(self.parts, starts, strict=False)]
        self.query_start = np.concatenate([*qs, starts[-1:]]).astype(np.int32)  # [R + 1]
        self.rows = sum(p.rows for p in self.parts)
        self.num_input_tokens = int(starts[-1])
        for name in ("retracted_ids", "finished_ids", "finished_reasons"):
            setattr(self, name, np.concatenate([np.asarray(getattr(p, name)) for p in self.parts]))
        self.copies = self.parts[self.rank].copies


def dp_context(
    plan, rank: int, caches, block_size: int, device: torch.device, state_pool=None, every_token: bool = False
) -> StepContext:
    """Rank `rank`'s context of a step of every attention rank's parts (a DpPlan, or the plan
    the other ranks decode from rank 0's message): its part's rows and caches, and the split
    (`ctx.dp`). every_token: every token samples (prompt logits), not the plan's last ones."""
    parts = plan.parts
    ctx = build_context(parts[rank], caches, block_size, device, state_pool)
    tokens = tuple(int(np.asarray(p.num_tokens).sum()) for p in parts)
    sampled = tokens if every_token else tuple(int(np.asarray(p.sample).astype(bool).sum()) for p in parts)
    if every_token:
        ctx.sample_index = torch.arange(tokens[rank], device=device)
    ids = np.concatenate([np.asarray(p.input_ids, dtype=np.int64) for p in parts])
    ctx.dp = DpStep(rank, tokens, sampled, torch.from_numpy(ids).to(device))
    return ctx


class DpScheduler:
    """P schedulers, one per attention rank, behind the one scheduler's interface the engine
    drives (`rank`: the rank whose copies the merged plans carry)."""

    def __init__(self, config: SchedulerConfig, size: int, rank: int = 0) -> None:
        self.parts = [Scheduler(config) for _ in range(size)]
        self.rank = rank
        self.owner: dict[int, int] = {}  # request -> its attention rank, until reported finished

    @property
    def layout(self) -> dict:
        return self.parts[0].layout  # every rank's pool: the same configuration

    def _of(self, rid: int) -> Scheduler:
        if rid not in self.owner:
            raise SchedulerError(f"unknown request {rid}")
        return self.parts[self.owner[rid]]

    def submit(self, rid: int, prompt: np.ndarray, **kw) -> None:
        r = min(range(len(self.parts)), key=lambda i: (self.parts[i].num_live, i))
        self.parts[r].submit(rid, prompt, **kw)
        self.owner[rid] = r

    def abort(self, rid: int) -> None:
        self._of(rid).abort(rid)

    def finish(self, rid: int) -> None:
        self._of(rid).finish(rid)

    def cached_tokens_of(self, rid: int) -> int:
        return self._of(rid).cached_tokens_of(rid)

    def step(self) -> DpPlan:
        plan = DpPlan([s.step() for s in self.parts], self.rank)
        for rid in plan.finished_ids.tolist():
            self.owner.pop(int(rid), None)
        return plan

    def feed(self, req_ids: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        """Each row's sampled tokens (counts[i] of them, in row order) to its request's scheduler."""
        req_ids, counts = np.asarray(req_ids), np.asarray(counts)
        own = np.asarray([self.owner[int(i)] for i in req_ids.tolist()])
        ends = np.cumsum(counts)
        for r, s in enumerate(self.parts):
            mine = own == r
            if mine.any():
                spans = [tokens[e - n : e] for e, n in zip(ends[mine], counts[mine], strict=True)]
                s.feed(req_ids[mine], counts[mine], np.concatenate(spans).astype(np.int32))

    def discard_inflight(self) -> list[int]:
        return [rid for s in self.parts for rid in s.discard_inflight()]

    @property
    def num_running(self) -> int:
        return sum(s.num_running for s in self.parts)

    @property
    def num_waiting(self) -> int:
        return sum(s.num_waiting for s in self.parts)

    @property
    def num_live(self) -> int:
        return sum(s.num_live for s in self.parts)

    def total_blocks(self, group: int = 0) -> int:
        return sum(s.total_blocks(group) for s in self.parts)

    def free_blocks(self, group: int = 0) -> int:
        return sum(s.free_blocks(group) for s in self.parts)

    def flush_prefix_cache(self) -> int:
        return sum(s.flush_prefix_cache() for s in self.parts)

    def prefix_stats(self) -> dict:
        stats = [s.prefix_stats() for s in self.parts]
        return {k: sum(st[k] for st in stats) for k in stats[0]}
