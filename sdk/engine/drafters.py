"""The drafters of speculative decoding (sdk/engine/speculative.py has the verify step and its
math) and vLLM's --speculative-config that picks one: `ngram` (prompt lookup, from the request's
own tokens) and `mtp` (the model's NextN head, chained on the device), in one registry."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import numpy as np
import torch

from dayzero.kernels.registry import Registry, UnknownKeyError
from dayzero.sdk.engine.context import fill_tokens, upload
from dayzero.sdk.engine.speculative import (
    DRAFT,
    OBSERVE,
    Behind,
    DeviceDrafts,
    VerifyRows,
    flat_plan,
    kept_rows,
)


class Drafter(Protocol):
    """What proposes drafts: for the plan's rows `rows` (decode rows of drafting requests) up to
    k tokens each, as host lists or `DeviceDrafts` (behind: rows planned behind a verify row in
    flight, moved back on the device); `hidden`: it reads the target's final hidden states and
    `observe`s each verify step from its VerifyRows (z, the sampled tokens and the drafts kept,
    on the device): with overlap as soon as its tokens are sampled, else once they are read back
    (kept: each row's new tokens, known on the host then); `drop` forgets a finished request."""

    hidden: bool

    def draft(
        self, engine, plan, rows: list[int], k: int, behind: Behind | None = None
    ) -> list[list[int]] | DeviceDrafts: ...

    def observe(self, engine, plan, verify: VerifyRows, kept: np.ndarray | None = None) -> None: ...

    def drop(self, rid: int) -> None: ...


class TokenDrafter:
    """A drafter that reads the request's tokens alone: propose(tokens, k) -> up to k drafts."""

    hidden = False

    def __init__(self, propose: Callable[[list[int], int], list[int]]) -> None:
        self.propose = propose

    def draft(self, engine, plan, rows: list[int], k: int, behind: Behind | None = None) -> list[list[int]]:
        out = []
        for r in rows:
            req = engine.requests[int(plan.req_ids[r])]
            out.append(self.propose(req.prompt_ids + req.token_ids, k)[:k])
        return out

    def observe(self, engine, plan, verify: VerifyRows, kept: np.ndarray | None = None) -> None:
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


@DRAFTERS.register("mtp")
class MtpDrafter:
    """Greedy drafts from the model's NextN layer (sdk/blocks/decoder.py NextN; the model built
    with it: ModelConfig.mtp).

    `observe`, with overlap as soon as a step's tokens are sampled (before the host reads them),
    else once they are read back: the layer runs over every position i of the step whose next
    token is known or sampled, with the target's final hidden z_i and that token t_{i+1} (a
    prefill chunk: all its positions, the last one's next token the prompt's, or the one just
    sampled; a decode row: x_p, d_1, .., d_k with next tokens y_0, .., y_k, or, read back, its
    kept inputs x_p, .., d_a only), writing its KV at i. Its output at a row's last kept
    position q = p + a (a: `accept_on_device`) gives d_1 = argmax of its logits and y_q.
    Positions past q hold outputs of rejected drafts: no later pass reads them before the next
    observe (or chain) writes them again (a head layer with recurrent state would carry them:
    such a head observes only once read back, `Engine._observe`). `draft` chains the rest at the
    next verify row's positions p' = q + 1, .., p' + k - 2:
        d_{j+1} = argmax head(rmsnorm_s(y_{p'+j-1})),  y_{p'+j-1} = layer(W_eh [e(d_j) ; h(y_{p'+j-2})])
    (the previous output fed back as the hidden, as DeepSeek's and TokenSpeed's NextN chain).
    The chain's KV at p'.. is rewritten by the next observe from the target's z. The drafts stay
    on the device (`DeviceDrafts`): the only host sync of a drafting step is its readback."""

    hidden = True

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.next: Heads = {}
        self.dropped: list[int] = []  # finished since the last observe (the other ranks' copies go)
        self.table: HeadTable | None = None  # the state by slot, where a drafting graph reads it

    def observe(self, engine, plan, verify: VerifyRows, kept: np.ndarray | None = None) -> None:
        ids, keep, src = observe_inputs(engine, plan, verify, kept)
        on_device = verify.device is not None and kept is None  # rows whose last token is a's
        rows = np.asarray(verify.device.rows if on_device else [], dtype=np.int64)
        if engine.leader is not None:  # every rank runs the pass on its shard (ranks.py)
            dropped = np.asarray(self.dropped, dtype=np.int64)
            engine.leader.pass_(OBSERVE, ids, keep, src, verify.first, rows, dropped)
            if len(verify.sampled):
                engine.leader.share(verify.sampled)
        self.dropped = []
        v = verify
        a = v.a if on_device else None
        out = observe_pass(engine, plan, v.z, v.sampled, a, ids, keep, src, rows, v.behind)
        remember(self.next, out, self.table)

    def draft(
        self, engine, plan, rows: list[int], k: int, behind: Behind | None = None
    ) -> list[list[int]] | DeviceDrafts:
        have = [r for r in rows if int(plan.req_ids[r]) in self.next]
        if not have:
            return [[] for _ in rows]
        keep = np.zeros(len(plan.kv_lens), dtype=np.int64)
        keep[have] = 1
        hidden, drafts = chain_start(self.next, plan, keep)
        ids = np.asarray(plan.input_ids)
        for j in range(1, k):  # d_{j+1} from position p' + j - 1
            if engine.leader is not None:
                engine.leader.pass_(DRAFT, ids, keep, np.asarray([j - 1], dtype=np.int64))
            hidden = chain(engine, plan, ids, keep, j - 1, hidden, drafts, behind)
        out = DeviceDrafts(have, torch.stack(drafts, dim=1))  # [R', k]
        out.copy_to_host()
        return out

    def drop(self, rid: int) -> None:
        if self.next.pop(rid, None) is not None:
            self.dropped.append(rid)
        if self.table is not None:
            self.table.drop(rid)


# the MTP head's state by request, on every rank: (y at its last known position [Dm], d_1 [1])
Heads = dict[int, tuple[torch.Tensor, torch.Tensor]]


class HeadTable:
    """The MTP head's state by request slot on the device, where one graph of a whole drafting
    step reads and writes it (sdk/engine/drafting_graphs.py): y [N + 2, *row] (the head's output
    at the request's last kept position), d1 [N + 2] (the next draft d_1), last [N + 2] (y_a, the
    next row's x_p) and shift [N + 2] (k - a: how far a row planned behind the request's verify
    row in flight moves back). Entry N (`pad`): the padding rows' reads and writes; N + 1
    (`zero`, the last: a graph's rows that do not move): shift 0, never written. A request takes
    a slot at its first observe while one is free (else its state stays out of the table, and
    its steps out of the drafting graphs)."""

    def __init__(self, capacity: int, row: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        n = capacity
        self.y = torch.zeros((n + 2, *row), dtype=dtype, device=device)
        self.d1, self.last, self.shift = (
            torch.zeros(n + 2, dtype=torch.int64, device=device) for _ in range(3)
        )
        self.pad, self.zero = n, n + 1
        self.free = list(range(n - 1, -1, -1))
        self.slot: dict[int, int] = {}

    def take(self, rid: int) -> int | None:
        if rid not in self.slot and self.free:
            self.slot[rid] = self.free.pop()
        return self.slot.get(rid)

    def drop(self, rid: int) -> None:
        if (s := self.slot.pop(rid, None)) is not None:
            self.free.append(s)


def remember(heads: Heads, out, table: HeadTable | None = None) -> None:
    """An `observe_pass` result into `heads` (and `table`: there, by slot, `heads` viewing it)."""
    if out is None:
        return
    y, rids, d1 = out
    slots = [table.take(rid) for rid in rids] if table is not None else [None] * len(rids)
    for j, (rid, s) in enumerate(zip(rids, slots, strict=True)):
        heads[rid] = (y[j], d1[j : j + 1]) if s is None else (table.y[s], table.d1[s : s + 1])
    rows = [j for j, s in enumerate(slots) if s is not None]
    if rows:
        idx = upload(np.asarray([rows, [slots[j] for j in rows]], dtype=np.int64), y.device)
        table.y[idx[1]] = y[idx[0]]
        table.d1[idx[1]] = d1[idx[0]]


def chain_start(heads: Heads, plan, keep: np.ndarray) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the last observed outputs [R', Dm], [d_1 [R']]) of the plan rows with keep[r] > 0."""
    got = [heads[r] for r in np.asarray(plan.req_ids)[keep > 0].tolist()]
    return torch.stack([y for y, _ in got]), [torch.cat([d for _, d in got])]


def chain(
    engine, plan, ids, keep: np.ndarray, start: int, hidden: torch.Tensor, drafts: list, behind=None
) -> torch.Tensor:
    """One chained draft (`draft_pass` from drafts[-1]): its argmax appended to `drafts`, its
    output [R', Dm] returned (the next pass's hidden)."""
    logits, hidden = draft_pass(engine, plan, ids, keep, start, hidden, drafts[-1], behind)
    drafts.append(logits.argmax(-1))
    return hidden


def observe_inputs(
    engine, plan, verify: VerifyRows, kept: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The observe pass's host arrays: (each plan token's next token ids [T] (-1: sampled, on
    the device), the tokens each row keeps keep [R] (0: none, its request gone; a decode row:
    all it sampled, or kept[r] where known), the index in the step's sampled tokens of each -1
    of ids src [T] (-1 elsewhere))."""
    qs, kv = np.asarray(plan.query_start), np.asarray(plan.kv_lens)
    prefill, ids = np.asarray(plan.is_prefill, dtype=bool), np.asarray(plan.input_ids, dtype=np.int64).copy()
    keep = np.zeros(len(kv), dtype=np.int64)
    src = np.full(len(ids), -1, dtype=np.int64)
    for r, rid in enumerate(np.asarray(plan.req_ids).tolist()):
        a, b, c = qs[r], qs[r + 1], int(verify.count[r])
        if rid not in engine.params:  # finished or aborted: nothing more to draft
            continue
        if prefill[r]:  # each position's next token: the prompt's, after the last the sampled one
            req = engine.requests[rid]
            known = req.prompt_ids + req.token_ids
            ids[a : b - 1] = ids[a + 1 : b]
            if kv[r] < len(known):
                ids[b - 1] = known[kv[r]]
            elif c:
                ids[b - 1], src[b - 1] = -1, verify.first[r]
            else:
                continue
            keep[r] = b - a
        elif c:  # a decode row: the next tokens of x_p, d_1, .. are its samples y_0, ..
            c = c if kept is None else int(kept[r])
            ids[a : a + c] = -1
            src[a : a + c] = verify.first[r] + np.arange(c)
            keep[r] = c
    return ids, keep, src


def observe_pass(
    engine, plan, z, sampled, a, ids: np.ndarray, keep: np.ndarray, src: np.ndarray, drafted, behind=None
):
    """The NextN layer over the plan's rows with keep[r] > 0, their first keep[r] tokens with
    next tokens ids [T] (-1: sampled[src[t]], on the device) and the target's z [T, Dm]: (y at
    each row's last kept token [R', Dm], the rows' request ids, d_1 [R'] = the argmax of the
    logits there); a row of `drafted` ends at its token a[r] (on the device; a: None with no
    such row), another at its last. None: no row. In the engine's head graphs, each kept token
    a row (`flat_plan`), when they fit (behind: rows moved back on the device, always in
    graphs)."""
    if not keep.any():
        return None
    sub = kept_rows(plan, ids, keep)
    rows = np.flatnonzero(keep > 0)
    n = keep[rows]
    base = np.cumsum(n) - np.where(np.isin(rows, drafted), n, 1)  # a drafted row's first token
    index = upload(np.concatenate((sub.token, base, rows)), z.device)
    t = len(sub.token)
    last = index[t : t + len(rows)]  # [R']
    if a is not None:
        last = last + a[index[t + len(rows) :]]
    dst = np.flatnonzero(sub.input_ids < 0)
    fill = (dst, src[sub.token[dst]], sampled) if dst.size else None
    zs = z[index[:t]]  # [T', Dm]
    m, graphs = engine.model, engine.head_graphs
    if graphs is not None and graphs.fits(flat := flat_plan(sub, sub.input_ids)):
        engine.stats["head_graph_passes"] += 1
        shift = behind.per_token(rows, n) if behind is not None else None
        logits, y = graphs.run(flat, fill, feed=zs, shift=shift)  # [T', V], [T', Dm]
        logits = logits[last]
    else:
        ctx = engine.context(sub)
        if fill is not None:
            fill_tokens(ctx.input_ids, *fill)
        ctx.sample_index = last
        logits, y = m.mtp(ctx.input_ids, zs, ctx, m.embed, m.head)
    return y[last], sub.req_ids.tolist(), logits.argmax(-1)


def draft_pass(
    engine,
    plan,
    ids: np.ndarray,
    keep: np.ndarray,
    start: int,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    behind: Behind | None = None,
):
    """A chained draft: the NextN layer at token `start` of each row with keep[r] > 0, its input
    the previous draft tokens [R'] (on the device) and the previous output `hidden` [R', Dm] ->
    (logits [R', V], its output [R', Dm]); in the engine's head graphs when they fit (behind:
    rows moved back on the device, always in graphs)."""
    sub = kept_rows(plan, ids, keep, np.full(len(keep), start, dtype=np.int64))
    m, graphs, rows = engine.model, engine.head_graphs, np.arange(len(sub.num_tokens), dtype=np.int64)
    if graphs is not None and graphs.fits(flat := flat_plan(sub, sub.input_ids)):
        engine.stats["head_graph_passes"] += 1
        shift = behind.per_token(np.flatnonzero(keep > 0), sub.num_tokens) if behind is not None else None
        return graphs.run(flat, (rows, rows, tokens), feed=hidden, shift=shift)
    ctx = engine.context(sub)
    ctx.input_ids.copy_(tokens)
    ctx.sample_index = torch.arange(len(sub.num_tokens), device=hidden.device)
    return m.mtp(ctx.input_ids, hidden, ctx, m.embed, m.head)
