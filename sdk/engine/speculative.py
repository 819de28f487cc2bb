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

Recurrent state (KDA, Gated DeltaNet, short convolutions, n-gram history) must end at position
p + a, as without drafts. In the verify graphs (a step of decode rows only) each token's state is
kept in a checkpoint slot of the pool (StateMeta.checkpoints; the row's own slot only read), and
the kept token's is copied to the row's slot. Otherwise the state has advanced through all
k + 1 inputs by the end of the pass: each decode row's slot is copied before it, and a row that
keeps fewer than k + 1 tokens gets the copy back and its kept inputs x_p, d_1, .., d_a run once
more (`kept_rows`: KV and index caches of those positions are written again, same values).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Protocol

import numpy as np
import torch

from dayzero.kernels.registry import Registry, UnknownKeyError
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


class Drafter(Protocol):
    """What proposes drafts: for the plan's rows `rows` (decode rows of drafting requests) up to
    k tokens each, as host lists or `DeviceDrafts`; `observe` sees each step's new tokens (and
    the target's final hidden states when `hidden` asks for them) before the scheduler does;
    `drop` forgets a finished request."""

    hidden: bool

    def draft(self, engine, plan, rows: list[int], k: int) -> list[list[int]] | DeviceDrafts: ...

    def observe(self, engine, plan, z, news: list[list[int]]) -> None: ...

    def drop(self, rid: int) -> None: ...


class TokenDrafter:
    """A drafter that reads the request's tokens alone: propose(tokens, k) -> up to k drafts."""

    hidden = False

    def __init__(self, propose: Callable[[list[int], int], list[int]]) -> None:
        self.propose = propose

    def draft(self, engine, plan, rows: list[int], k: int) -> list[list[int]]:
        out = []
        for r in rows:
            req = engine.requests[int(plan.req_ids[r])]
            out.append(self.propose(req.prompt_ids + req.token_ids, k)[:k])
        return out

    def observe(self, engine, plan, z, news: list[list[int]]) -> None:
        return None

    def drop(self, rid: int) -> None:
        return None


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config: {"method": "ngram", "num_speculative_tokens": k, ...}."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: the longest suffix matched
    prompt_lookup_min: int = 1  # ngram: the shortest
    # mtp: a folder holding the NextN head in its own checkpoint (config.json + safetensors), for
    # a model whose checkpoint carries none (sdk/loader open_mtp_head; scripts/train_nextn.py)
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in DRAFTERS:  # named with the known ones
            raise ValueError(str(UnknownKeyError(DRAFTERS.what, self.method, DRAFTERS.keys())))
        if self.model is not None and self.method != "mtp":
            raise ValueError(
                f"speculative config: 'model' (an MTP head's folder) goes with method mtp, not {self.method}"
            )
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
# a speculative step's passes, as rank 0 sends them to the other ranks (ranks.py)
VERIFY, ROLLBACK, OBSERVE, DRAFT, END = 1, 2, 3, 4, 5


def check_parallel(spec: SpeculativeConfig, size: int, attention_dp: bool) -> None:
    """Refuse, by name, what drafting does not run with on `size` ranks yet: data-parallel
    attention. With tensor parallelism a step's passes (the MTP head's, the verify and the
    rollback pass) follow the plan to every rank (ranks.py)."""
    if size > 1 and attention_dp:
        raise ValueError(
            f"speculative decoding ({spec.method}) is not implemented with data-parallel attention "
            f"({size} ranks)"
        )


@DRAFTERS.register("ngram")
def ngram(cfg: SpeculativeConfig) -> Drafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's last
    n tokens, for the largest n in [prompt_lookup_min, prompt_lookup_max] that occurs."""
    return TokenDrafter(prompt_lookup(cfg))


def prompt_lookup(cfg: SpeculativeConfig) -> Callable[[list[int], int], list[int]]:
    """ngram's proposal function (see `ngram`)."""

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
    any is read); only for layers without recurrent state, whose tokens of one row would share
    a state slot. (A verify step with no prefill row; the MTP head's observe and draft passes.)"""
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
    (host [D] and device), and a copy of those slots from before the pass [D, bytes], or None
    where the pass kept each token's state in the pool's checkpoint slots (the verify graphs:
    plan token i's at checkpoint i)."""

    inputs: np.ndarray
    decode: np.ndarray
    slots_host: np.ndarray
    slots: torch.Tensor
    before: torch.Tensor | None


def save_states(
    engine, plan, inputs: np.ndarray, decode: np.ndarray, checkpointed: bool
) -> SavedStates | None:
    """The decode rows' states before the verify pass (checkpointed: the graphs keep them, no
    copy); None: the model keeps no state."""
    if not engine.pool.state_bytes:
        return None
    host = np.asarray(plan.state_slots, dtype=np.int64)[decode]
    slots = upload(host, engine.device)
    before = None if checkpointed else engine.pool.slots[slots]  # index_select: a copy
    return SavedStates(inputs, decode, host, slots, before)


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


@DRAFTERS.register("mtp")
class MtpDrafter:
    """Greedy drafts from the model's NextN layer (sdk/blocks/decoder.py NextN; the model built
    with it: ModelConfig.mtp).

    `observe`, after each step: the layer runs over every position i of the step whose next
    token is now known, with the target's final hidden z_i and that token t_{i+1} (a prefill
    chunk: all its positions, the last one's next token the prompt's, or the one just sampled; a
    decode row: x_p .. x_{p+a}, the kept inputs), writing its KV at i; its output at a row's last
    such position q gives d_1 = argmax of its logits and y_q. `draft` chains the rest at the next
    verify row's positions p' = q + 1, .., p' + k - 2:
        d_{j+1} = argmax head(rmsnorm_s(y_{p'+j-1})),  y_{p'+j-1} = layer(W_eh [e(d_j) ; h(y_{p'+j-2})])
    (the previous output fed back as the hidden, as DeepSeek's and TokenSpeed's NextN chain).
    The chain's KV at p'.. is rewritten by the next observe from the target's z. The drafts stay
    on the device (`DeviceDrafts`): the only host sync of a drafting step is its readback."""

    hidden = True

    def __init__(self, cfg: SpeculativeConfig) -> None:
        # rid -> (y at its last known position [Dm], d_1 [1] on the device)
        self.next: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.dropped: list[int] = []  # finished since the last observe (the other ranks' copies go)

    def observe(self, engine, plan, z, news: list[list[int]]) -> None:
        qs, kv = np.asarray(plan.query_start), np.asarray(plan.kv_lens)
        prefill, ids = np.asarray(plan.is_prefill, dtype=bool), np.asarray(plan.input_ids).copy()
        keep = np.zeros(len(kv), dtype=np.int64)
        for r, rid in enumerate(np.asarray(plan.req_ids).tolist()):
            if rid not in engine.params:  # finished or aborted: nothing more to draft
                continue
            if prefill[r]:  # each position's next token: the prompt's, after the last the sampled one
                req = engine.requests[rid]
                known = req.prompt_ids + req.token_ids
                ids[qs[r] : qs[r + 1] - 1] = ids[qs[r] + 1 : qs[r + 1]]
                ids[qs[r + 1] - 1] = known[kv[r]] if kv[r] < len(known) else (news[r] or [-1])[0]
                keep[r] = qs[r + 1] - qs[r] if ids[qs[r + 1] - 1] >= 0 else 0
            elif news[r]:  # a decode row: its kept inputs' next tokens are its new tokens
                ids[qs[r] : qs[r] + len(news[r])] = news[r]
                keep[r] = len(news[r])
        if engine.leader is not None:  # every rank runs the pass on its shard (ranks.py)
            engine.leader.pass_(OBSERVE, ids, keep, np.asarray(self.dropped, dtype=np.int64))
        self.dropped = []
        out = observe_pass(engine, plan, z, ids, keep)
        if out is None:
            return
        _, y, rids, last, d1 = out
        for j, rid in enumerate(rids):  # views would pin the pass's [T', Dm]
            self.next[rid] = (y[int(last[j])].clone(), d1[j : j + 1].clone())

    def draft(self, engine, plan, rows: list[int], k: int) -> list[list[int]] | DeviceDrafts:
        have = [r for r in rows if int(plan.req_ids[r]) in self.next]
        if not have:
            return [[] for _ in rows]
        heads = [self.next[int(plan.req_ids[r])] for r in have]
        hidden = torch.stack([y for y, _ in heads])  # [R', Dm]
        drafts = [torch.cat([d for _, d in heads])]  # d_1 of each row [R']
        keep = np.zeros(len(plan.kv_lens), dtype=np.int64)
        keep[have] = 1
        ids = np.asarray(plan.input_ids)
        for j in range(1, k):  # d_{j+1} from position p' + j - 1
            if engine.leader is not None:
                engine.leader.pass_(DRAFT, ids, keep, np.asarray([j - 1], dtype=np.int64))
            logits, hidden = draft_pass(engine, plan, ids, keep, j - 1, hidden, drafts[-1])
            drafts.append(logits.argmax(-1))
        out = DeviceDrafts(have, torch.stack(drafts, dim=1))  # [R', k]
        out.copy_to_host()
        return out

    def drop(self, rid: int) -> None:
        if self.next.pop(rid, None) is not None:
            self.dropped.append(rid)


def observe_pass(engine, plan, z: torch.Tensor, ids: np.ndarray, keep: np.ndarray):
    """The NextN layer over the plan's rows with keep[r] > 0, their first keep[r] tokens with
    next tokens ids [T] and the target's z [T, Dm]: (logits [R', V] at each row's last kept
    token, y [T', Dm], the rows' request ids, each row's last index in y, d_1 [R'] = the argmax
    of the logits, on the device); None: no row. In the engine's head graphs, each kept token a
    row (`flat_plan`), when they fit."""
    if not keep.any():
        return None
    sub = kept_rows(plan, ids, keep)
    last = np.cumsum(sub.num_tokens) - 1
    index = upload(np.stack((sub.token, np.pad(last, (0, len(sub.token) - len(last))))), z.device)
    zs = z[index[0]]  # [T', Dm]
    m, graphs = engine.model, engine.head_graphs
    if graphs is not None and graphs.fits(flat := flat_plan(sub, sub.input_ids)):
        engine.stats["head_graph_passes"] += 1
        logits, y = graphs.run(flat, feed=zs)  # [T', V], [T', Dm]
        logits = logits[index[1, : len(last)]]
    else:
        ctx = engine.context(sub)
        ctx.sample_index = index[1, : len(last)]
        logits, y = m.mtp(ctx.input_ids, zs, ctx, m.embed, m.head)
    return logits, y, sub.req_ids.tolist(), last, logits.argmax(-1)


def draft_pass(
    engine, plan, ids: np.ndarray, keep: np.ndarray, start: int, hidden: torch.Tensor, tokens: torch.Tensor
):
    """A chained draft: the NextN layer at token `start` of each row with keep[r] > 0, its input
    the previous draft tokens [R'] (on the device) and the previous output `hidden` [R', Dm] ->
    (logits [R', V], its output [R', Dm]); in the engine's head graphs when they fit."""
    sub = kept_rows(plan, ids, keep, np.full(len(keep), start, dtype=np.int64))
    m, graphs, rows = engine.model, engine.head_graphs, np.arange(len(sub.num_tokens), dtype=np.int64)
    if graphs is not None and graphs.fits(flat := flat_plan(sub, sub.input_ids)):
        engine.stats["head_graph_passes"] += 1
        return graphs.run(flat, (rows, rows, tokens), feed=hidden)
    ctx = engine.context(sub)
    ctx.input_ids.copy_(tokens)
    ctx.sample_index = torch.arange(len(sub.num_tokens), device=hidden.device)
    return m.mtp(ctx.input_ids, hidden, ctx, m.embed, m.head)
