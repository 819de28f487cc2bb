"""Speculative decoding: k drafted tokens a decode row, verified by one forward pass (the drafters
and the config that picks one: sdk/engine/drafters.py).

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

Recurrent state (KDA, Gated DeltaNet, short convolutions, n-gram history) must end at position
p + a, as without drafts. In the verify graphs (a step of decode rows only) each token's state is
kept in a checkpoint slot of the pool (StateMeta.checkpoints; the row's own slot only read), and
the kept token's is copied to the row's slot. Otherwise the state has advanced through all
k + 1 inputs by the end of the pass: each decode row's slot is copied before it, and a row that
keeps fewer than k + 1 tokens gets the copy back and its kept inputs x_p, d_1, .., d_a run once
more (`kept_rows`: KV and index caches of those positions are written again, same values).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from dayzero.sdk.engine.context import fill_tokens, upload


@dataclass
class DeviceDrafts:
    """Drafts that stay on the device until the step's one readback: tokens [R', k] int64 of the
    plan rows `rows` (the MTP head's chain: no host sync between its passes and the verify pass,
    which takes them in on the device); `host` their pinned copy, queued behind the passes and
    read once the step's sampled tokens are."""

    rows: list[int]
    tokens: torch.Tensor
    host: torch.Tensor | None = None

    def copy_to_host(self) -> None:
        t = self.tokens
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        self.host.copy_(t, non_blocking=t.is_cuda)


# a speculative step's passes, as rank 0 sends them to the other ranks (ranks.py)
VERIFY, ROLLBACK, OBSERVE, DRAFT, END = 1, 2, 3, 4, 5


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
    z: object = None  # the target's final hidden states [T, Dm], for a drafter that reads them
    device: DeviceDrafts | None = None  # drafts still on the device (their rows' `drafts`: -1s)

    def read_drafts(self) -> None:
        """The device drafts' values into `drafts` (after the step's readback: their copy is done)."""
        if self.device is not None:
            for r, d in zip(self.device.rows, self.device.host.tolist(), strict=True):
                self.drafts[r] = d

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


def verify_inputs(plan, k: int, decode: np.ndarray, proposed, verify: VerifyRows):
    """The verify pass's inputs [T] (each decode row's k slots: its drafts; a row not drafted, or
    drafted short: its last token again, rolled back) and the fill of device drafts (`fill_tokens`
    arguments, or None); sets verify.drafts (and .device)."""
    ids, qs = np.asarray(plan.input_ids), np.asarray(plan.query_start)
    inputs = ids.copy()
    dev = proposed if isinstance(proposed, DeviceDrafts) else None
    on_device = set(dev.rows) if dev is not None else set()
    host = {} if dev is not None else proposed
    for r in decode.tolist():
        drafts = host.get(r, [])[:k]
        inputs[qs[r] + 1 : qs[r] + 1 + k] = (drafts + [int(ids[qs[r]])] * k)[:k]
        if r in on_device or r in host:  # on the device: -1s until the step's readback
            verify.drafts[r] = drafts + [-1] * (k - len(drafts))
    if dev is None:
        return inputs, None
    verify.device = dev
    dst = np.concatenate([np.arange(qs[r] + 1, qs[r] + 1 + k) for r in dev.rows]).astype(np.int64)
    return inputs, (dst, np.arange(len(dst), dtype=np.int64), dev.tokens.reshape(-1))


def kept_rows(plan, inputs: np.ndarray, keep: np.ndarray, start: np.ndarray | None = None) -> SimpleNamespace:
    """The rows of `plan` with keep[r] > 0, each cut to its tokens [start[r], start[r] + keep[r])
    (start: 0 by default), their ids from inputs [T] (by the plan's token index), sampling
    nothing: what `build_context` reads of a plan."""
    rows = np.flatnonzero(keep > 0)
    start = np.zeros(len(keep), dtype=np.int64) if start is None else start
    qs, n = np.asarray(plan.query_start), keep[rows]
    token = (
        np.concatenate([np.arange(qs[r] + start[r], qs[r] + start[r] + keep[r]) for r in rows])
        if rows.size
        else rows
    )
    first = np.asarray(plan.kv_lens)[rows] - np.asarray(plan.num_tokens)[rows] + start[rows]
    return SimpleNamespace(
        num_tokens=n,
        query_start=np.concatenate(([0], np.cumsum(n))),
        positions=np.asarray(plan.positions)[token],
        kv_lens=first + n,
        input_ids=inputs[token],
        sample=np.zeros(len(rows), dtype=np.int32),
        state_slots=np.asarray(plan.state_slots)[rows],
        block_tables=[t[rows] if t.size else t for t in map(np.asarray, plan.block_tables)],
        req_ids=np.asarray(plan.req_ids)[rows],
        token=token,  # the plan's index of each kept token
    )


def flat_plan(plan, inputs: np.ndarray) -> SimpleNamespace:
    """A pass's rows as single-token decode rows (`DecodeGraphs`): token t of row r at position
    p_t reads r's block table, attends to its first p_t + 1 keys and is sampled. Its attention
    equals the row's causal attention over the pass (every key of the pass is written before
    any is read). Recurrent state stays by row of `plan` (state_slots): graphs of `steps` tokens
    a state row run those rows' tokens in order. (A verify step with no prefill row; the MTP
    head's observe and draft passes.)"""
    n = np.asarray(plan.num_tokens)
    row_of = np.repeat(np.arange(len(n)), n)
    positions = np.asarray(plan.positions, dtype=np.int64)
    t = len(positions)
    return SimpleNamespace(
        rows=t,
        num_tokens=np.ones(t, dtype=np.int32),
        input_ids=inputs,
        positions=positions,
        kv_lens=positions + 1,
        sample=np.ones(t, dtype=np.int32),
        block_tables=[tb[row_of] if tb.size else tb for tb in map(np.asarray, plan.block_tables)],
        state_slots=np.asarray(plan.state_slots),  # per row of `plan` (graphs of `steps` tokens a row)
    )


def verify_graph_plan(engine, plan, inputs: np.ndarray) -> SimpleNamespace | None:
    """The verify step as the flat rows the engine's verify graphs run, or None where it runs as
    a varlen step: a prefill row, too many rows, or (a stateful model's graphs, `steps` = k + 1
    tokens a state row) a row of another length. Every rank decides the same."""
    graphs = engine.graphs
    n = np.asarray(plan.num_tokens)
    if graphs is None or np.asarray(plan.is_prefill, dtype=bool).any():
        return None
    if graphs.steps > 1 and not (n == graphs.steps).all():
        return None
    flat = flat_plan(plan, inputs)
    return flat if graphs.fits(flat) else None


def verify_forward(engine, plan, inputs: np.ndarray, index: np.ndarray, hidden: bool, fill=None, flat=None):
    """The verify pass over `inputs` [T] (the plan's inputs with the drafts; fill: the device
    drafts, `verify_inputs`): (logits [S, V] fp32 at the tokens `index`, the final hidden states
    of every token or None). In the engine's verify graphs over `flat` (`verify_graph_plan`),
    else as a varlen step."""
    sel = upload(index, engine.device)
    if flat is not None:
        engine.stats["graph_steps"] += 1
        out = engine.graphs.run(flat, fill)  # flat rows keep the plan's token order
        return (out[0][sel], out[1]) if hidden else (out[sel], None)
    ctx = engine.context(plan)
    ctx.input_ids.copy_(torch.from_numpy(inputs))
    if fill is not None:
        fill_tokens(ctx.input_ids, *fill)
    ctx.sample_index = sel
    if hidden:
        return engine.model(ctx, hidden=True)  # [S, V] fp32, [T, Dm]
    return engine.model(ctx), None


@dataclass
class SavedStates:
    """The decode rows' recurrent states around a verify pass (`roll_back`): the pass's inputs
    [T] (the device drafts written in once read back), the decode rows [D], their state slots
    (host [D], and on the device with a copy of those slots from before the pass [D, bytes]), or
    no copy (slots and before None) where the pass kept each token's state in the pool's
    checkpoint slots (the verify graphs: plan token i's at checkpoint i)."""

    inputs: np.ndarray
    decode: np.ndarray
    slots_host: np.ndarray
    slots: torch.Tensor | None
    before: torch.Tensor | None


def save_states(
    engine, plan, inputs: np.ndarray, decode: np.ndarray, checkpointed: bool
) -> SavedStates | None:
    """The decode rows' states before the verify pass (checkpointed: the graphs keep them, no
    copy); None: the model keeps no state."""
    if not engine.pool.state_bytes:
        return None
    host = np.asarray(plan.state_slots, dtype=np.int64)[decode]
    if checkpointed:
        return SavedStates(inputs, decode, host, None, None)
    slots = upload(host, engine.device)
    return SavedStates(inputs, decode, host, slots, engine.pool.slots[slots])  # index_select: a copy


def roll_back(engine, plan, saved: SavedStates, kept: np.ndarray) -> None:
    """Each decode row's state at its last kept token (kept[r]: the tokens plan row r keeps, 0:
    none, its request gone): from its checkpoint, or, without checkpoints, for a row that keeps
    fewer than all its tokens, its state from before the pass and its kept inputs once more (the
    module docstring)."""
    qs, n = np.asarray(plan.query_start), np.asarray(plan.num_tokens)
    rows = kept[saved.decode]
    if saved.before is None:
        use = np.flatnonzero(rows > 0)
        if use.size:
            src = [engine.pool.checkpoint_slot(int(qs[r] + kept[r] - 1)) for r in saved.decode[use]]
            idx = upload(np.stack((saved.slots_host[use], np.asarray(src, dtype=np.int64))), engine.device)
            engine.pool.slots[idx[0]] = engine.pool.slots[idx[1]]
        return
    back = (rows > 0) & (rows < n[saved.decode])
    if not back.any():
        return
    i = upload(np.flatnonzero(back), engine.device)
    engine.pool.slots[saved.slots[i]] = saved.before[i]
    keep = np.where((kept > 0) & (kept < n), kept, 0)
    engine.model(engine.context(kept_rows(plan, saved.inputs, keep)))
