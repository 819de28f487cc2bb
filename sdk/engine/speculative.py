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

With overlap the scheduler plans step N+1 before step N's tokens are read back: a request's row
in N+1 is placed as if N's row kept all its drafts (at p + k + 1). The device knows better:
a = the leading matches of N's samples and drafts (`accept_on_device`), so the row moves back by
k - a positions there (`Behind`: positions, KV lengths and new-token slots rewritten in the
graphs' buffers, `DecodeGraphs.run`) and takes y_a as its x_p. A step that cannot run so (a
prefill row in it, rows past the graphs, recurrent state to roll back, host drafts) first reads
N back and moves its rows on the host (`moved_back`).
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
    sampled: torch.Tensor | None = None  # the step's sampled tokens [S] int64, on the device
    a: torch.Tensor | None = None  # [R] int64 drafts kept by each row, on the device (accept_on_device)
    behind: Behind | None = None  # rows planned behind a verify row in flight
    in_graph: bool = False  # the step ran whole in one graph (drafting_graphs.py)

    def read_drafts(self) -> None:
        """The device drafts' values into `drafts` (after the step's readback: their copy is done)."""
        if self.device is not None:
            for r, d in zip(self.device.rows, self.device.host.long().tolist(), strict=True):
                self.drafts[r] = d

    def tokens(self, r: int, sampled: np.ndarray) -> list[int]:
        """Plan row r's new tokens from the step's sampled tokens [S]: y_0..y_a."""
        ys = sampled[self.first[r] : self.first[r] + self.count[r]].tolist()
        return ys[: accepted(self.drafts[r], ys) + 1] if self.drafts[r] else ys[:1]


def accept_on_device(
    first: np.ndarray, rows: list[int], drafts: torch.Tensor | None, sampled: torch.Tensor
) -> torch.Tensor:
    """a [R] int64 on the device (R = len(first)): the leading drafts drafts [R', k] of plan rows
    `rows` that the samples sampled[first[r] ..] confirm (`accepted`, on the device); 0 for every
    other row."""
    a = torch.zeros(len(first), dtype=torch.int64, device=sampled.device)
    if rows:
        n, k = drafts.shape
        idx = upload(np.concatenate((rows, (first[rows][:, None] + np.arange(k)).ravel())), sampled.device)
        same = sampled[idx[n:]].view(n, k) == drafts  # y_{i-1} == d_i
        a[idx[:n]] = same.cumprod(-1).sum(-1)
    return a


@dataclass
class Behind:
    """The decode rows of a plan placed behind a verify row still in flight (overlap): rows [n]
    (plan rows) and their rows `prev` [n] in the step in flight. On the device each moves back
    by k - a of its row in flight (`shift` [R], 0 for the plan's other rows) and takes y_a as
    its x_p (`first_inputs`: a `fill_tokens` over the plan's tokens)."""

    rows: np.ndarray
    prev: np.ndarray
    shift: torch.Tensor

    def per_token(self, rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """A pass over plan rows `rows`, counts[i] tokens each, as `DecodeGraphs.run` moves it:
        (the plan row of each token, the shift by plan row)."""
        return np.repeat(rows, counts).astype(np.int64), self.shift


def decode_rows(plan, k: int) -> np.ndarray:
    """The plan's decode rows: x_p and k draft slots (-1)."""
    n = np.asarray(plan.num_tokens)
    return np.flatnonzero((n == k + 1) & ~np.asarray(plan.is_prefill, dtype=bool))


def behind_rows(plan, k: int) -> np.ndarray:
    """The plan's decode rows whose x_p is left to the device: planned behind a row in flight."""
    decode = decode_rows(plan, k)
    qs = np.asarray(plan.query_start)
    return decode[np.asarray(plan.input_ids)[qs[decode]] < 0] if decode.size else decode


def rows_in_flight(plan, rows: np.ndarray, prev_ids: np.ndarray) -> np.ndarray:
    """Each plan row of `rows`' row [n] in the step in flight, whose rows are requests prev_ids."""
    where = {int(rid): j for j, rid in enumerate(prev_ids.tolist())}
    return np.asarray([where[int(rid)] for rid in np.asarray(plan.req_ids)[rows]], dtype=np.int64)


def behind(plan, rows: np.ndarray, prev_ids: np.ndarray, a: torch.Tensor, k: int) -> Behind:
    """`Behind` of plan rows `rows`, the step in flight's rows being requests prev_ids [R'] that
    kept a [R'] drafts (on the device)."""
    prev = rows_in_flight(plan, rows, prev_ids)
    idx = upload(np.concatenate((rows, prev)).astype(np.int64), a.device)
    shift = torch.zeros(len(plan.num_tokens), dtype=torch.int64, device=a.device)
    shift[idx[: len(rows)]] = k - a[idx[len(rows) :]]
    return Behind(rows, prev, shift)


def first_inputs(fill, dst: np.ndarray, prev: np.ndarray, last: torch.Tensor):
    """`verify_inputs`' device fill (or None) with the moved rows' x_p: token dst[i] gets
    last[prev[i]] (y_a of its row in flight)."""
    if fill is None:
        return dst.astype(np.int64), prev, last
    d, s, t = fill
    return np.concatenate((d, dst)), np.concatenate((s, prev + len(t))), torch.cat((t, last))


def moved_back(plan, rows: np.ndarray, shift: np.ndarray, first: np.ndarray) -> SimpleNamespace:
    """The plan with rows `rows` moved back by shift [n] positions (their KV lengths with them)
    and x_p = first [n]: `Behind` done on the host, once the step in flight is read back."""
    qs, n = np.asarray(plan.query_start), np.asarray(plan.num_tokens)
    by_row = np.zeros(len(n), dtype=np.int64)
    by_row[rows] = shift
    pos, kv, ids = (np.array(x, dtype=np.int64) for x in (plan.positions, plan.kv_lens, plan.input_ids))
    pos -= np.repeat(by_row, n)
    kv -= by_row
    ids[qs[rows]] = first
    fields = ("num_tokens", "query_start", "sample", "state_slots", "req_ids", "is_prefill", "block_tables")
    out = SimpleNamespace(**{f: getattr(plan, f) for f in fields})
    out.positions, out.kv_lens, out.input_ids, out.rows = pos, kv, ids, plan.rows
    out.num_input_tokens, out.copies = plan.num_input_tokens, plan.copies
    return out


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
    return flat_plan(plan, inputs) if runs_in_graphs(engine, plan) else None


def runs_in_graphs(engine, plan) -> bool:
    """Whether the plan's verify step runs in the engine's verify graphs (`verify_graph_plan`)."""
    graphs = engine.graphs
    n = np.asarray(plan.num_tokens)
    if graphs is None or np.asarray(plan.is_prefill, dtype=bool).any():
        return False
    if graphs.steps > 1 and not (n == graphs.steps).all():
        return False
    t = int(n.sum())
    return 0 < t <= graphs.sizes[-1] and t % graphs.steps == 0


def verify_forward(
    engine, plan, inputs: np.ndarray, index: np.ndarray, hidden: bool, fill=None, flat=None, shift=None
):
    """The verify pass over `inputs` [T] (the plan's inputs with the drafts; fill: the device
    drafts, `verify_inputs`): (logits [S, V] fp32 at the tokens `index`, the final hidden states
    of every token or None). In the engine's verify graphs over `flat` (`verify_graph_plan`;
    shift: `Behind.per_token` of its tokens, moved back in the graphs), else as a varlen step."""
    sel = upload(index, engine.device)
    if flat is not None:
        engine.stats["graph_steps"] += 1
        out = engine.graphs.run(flat, fill, shift=shift)  # flat rows keep the plan's token order
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
