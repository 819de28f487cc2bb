"""Speculative decoding: k drafted tokens a decode row, verified by one forward pass.

The scheduler (`spec_tokens = k`) gives each decode row k + 1 slots: its last token x_p at
position p, then k positions whose inputs it leaves to the engine (-1). A drafter proposes
d_1..d_k for them; the target model runs the row [x_p, d_1, .., d_k] at positions p..p+k and the
sampler draws, independently at every position i (the request's own temperature, top-k/p, min-p,
seed),
    y_i ~ p_i            p_i: the target's next-token distribution after [x_p, d_1, .., d_i]
    a = the number of leading i with y_{i-1} = d_i          (0 <= a <= k)
    the row's new tokens: y_0, .., y_a  (= d_1, .., d_a, then y_a: a correction or a bonus token)
The drafts are deterministic (q_i one-hot at d_i), so this is rejection sampling exactly: d_i
is accepted with probability p_{i-1}(d_i), and on a rejection y_{i-1} follows p_{i-1} without
d_i, renormalised, which is (p - q)_+ normalised. Each new token therefore has the target's
distribution (greedy: y_i = argmax p_i, the tokens a run without drafts gives), whatever the
drafts are. The scheduler keeps a + 1 tokens and rolls the KV of the rest back.

A request whose sampling reads its earlier tokens (penalties, logit bias, min_tokens, a grammar)
samples only y_0 (a = 0): its drafts are verified as if all wrong.

Recurrent state (KDA, Gated DeltaNet, short convolutions, n-gram history) has advanced through
all k + 1 inputs by the end of the verify pass. Each decode row's state slot is copied before
it; a row that keeps fewer than k + 1 tokens gets the copy back and its kept inputs
x_p, d_1, .., d_a run once more (`kept_rows`: KV and index caches of those positions are
written again with the same values), so its state ends at position p + a as without drafts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import SimpleNamespace

import numpy as np

from dayzero.kernels.registry import Registry, UnknownKeyError

Drafter = Callable[[list[int], int], list[int]]  # (the request's tokens, k) -> up to k drafts


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config: {"method": "ngram", "num_speculative_tokens": k, ...}."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: the longest suffix matched
    prompt_lookup_min: int = 1  # ngram: the shortest

    def __post_init__(self) -> None:
        if self.method not in DRAFTERS:  # named with the known ones
            raise ValueError(str(UnknownKeyError(DRAFTERS.what, self.method, DRAFTERS.keys())))
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"want 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from vLLM's JSON (or its dict); a key dayzero does not implement is refused."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        raw = json.loads(value) if isinstance(value, str) else dict(value)
        known = {f.name for f in fields(cls)}
        if bad := sorted(set(raw) - known):
            raise ValueError(
                f"speculative config: unknown key(s) {', '.join(bad)}; known: {', '.join(sorted(known))}"
            )
        if "method" not in raw or "num_speculative_tokens" not in raw:
            raise ValueError("speculative config needs 'method' and 'num_speculative_tokens'")
        return cls(**raw)

    def drafter(self) -> Drafter:
        return DRAFTERS.get(self.method)(self)


DRAFTERS: Registry[Callable[[SpeculativeConfig], Drafter]] = Registry("speculative method")


@DRAFTERS.register("ngram")
def ngram(cfg: SpeculativeConfig) -> Drafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's last
    n tokens, for the largest n in [prompt_lookup_min, prompt_lookup_max] that occurs."""

    def propose(tokens: list[int], k: int) -> list[int]:
        arr = np.asarray(tokens)
        for n in range(min(cfg.prompt_lookup_max, len(arr) - 1), cfg.prompt_lookup_min - 1, -1):
            tail = arr[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # starts 0..len-1-n
            hits = np.flatnonzero((windows == tail).all(-1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start : start + k].tolist()
        return []

    return propose


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """a: the leading drafts the samples confirm (sampled[i - 1] == drafts[i - 1])."""
    a = 0
    while a < len(drafts) and a < len(sampled) - 1 and sampled[a] == drafts[a]:
        a += 1
    return a


@dataclass
class VerifyRows:
    """A plan's verify rows, as the sampler sees them: plan row r samples rows [first[r],
    first[r] + count[r]) of the step's logits (count k + 1 for a drafted row, 1 for a row sampled
    at its last token only, 0 for a prefill chunk that samples nothing); drafts[r]: its k inputs
    after x_p (empty for other rows)."""

    first: np.ndarray  # [R]
    count: np.ndarray  # [R]
    drafts: list[list[int]]

    def tokens(self, r: int, sampled: np.ndarray) -> list[int]:
        """Plan row r's new tokens from the step's sampled tokens [S]: y_0..y_a."""
        ys = sampled[self.first[r] : self.first[r] + self.count[r]].tolist()
        return ys[: accepted(self.drafts[r], ys) + 1] if self.drafts[r] else ys[:1]


def verify_rows(plan, k: int, drafted: Callable[[int], bool]) -> tuple[VerifyRows, np.ndarray]:
    """(the plan's VerifyRows, the token index [S] of each sampled row in the step). A decode row
    (k + 1 tokens, sampled) of a request with drafted(rid) samples all its k + 1 positions, one of
    another request its first (x_p: its draft slots are rolled back); a prefill chunk that samples,
    its last token."""
    n = np.asarray(plan.num_tokens)
    qs = np.asarray(plan.query_start)
    sample = np.asarray(plan.sample, dtype=bool)
    prefill = np.asarray(plan.is_prefill, dtype=bool)
    count = np.zeros(len(n), dtype=np.int64)
    index: list[np.ndarray] = []
    for r, rid in enumerate(np.asarray(plan.req_ids).tolist()):
        if not sample[r]:
            continue
        decode = not prefill[r] and n[r] == k + 1  # x_p, then k draft slots
        verify = decode and drafted(rid)
        count[r] = k + 1 if verify else 1
        if verify:
            index.append(np.arange(qs[r], qs[r + 1]))
        else:  # a decode row without drafts samples after x_p; a prefill chunk after its last token
            index.append(np.asarray([qs[r] if decode else qs[r + 1] - 1]))
    first = np.concatenate(([0], np.cumsum(count)[:-1]))
    drafts = [[] for _ in range(len(n))]
    return VerifyRows(first, count, drafts), (np.concatenate(index) if index else np.zeros(0, np.int64))


def kept_rows(plan, inputs: np.ndarray, keep: np.ndarray) -> SimpleNamespace:
    """The rows of `plan` with keep[r] > 0, each cut to its first keep[r] tokens (inputs: the
    plan's input ids as the verify pass ran them, drafts filled in), sampling nothing: what
    `build_context` reads of a plan."""
    rows = np.flatnonzero(keep > 0)
    qs, n = np.asarray(plan.query_start), keep[rows]
    token = np.concatenate([np.arange(qs[r], qs[r] + keep[r]) for r in rows]) if rows.size else rows
    first = np.asarray(plan.kv_lens)[rows] - np.asarray(plan.num_tokens)[rows]
    return SimpleNamespace(
        num_tokens=n,
        query_start=np.concatenate(([0], np.cumsum(n))),
        positions=np.asarray(plan.positions)[token],
        kv_lens=first + n,
        input_ids=inputs[token],
        sample=np.zeros(len(rows), dtype=np.int32),
        state_slots=np.asarray(plan.state_slots)[rows],
        block_tables=[
            np.asarray(t)[rows] if np.asarray(t).size else np.asarray(t) for t in plan.block_tables
        ],
        req_ids=np.asarray(plan.req_ids)[rows],
    )
