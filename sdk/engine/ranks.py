"""Rank 0 drives the others: it holds the C++ scheduler and the sampler, and sends each step's
plan (its arrays, already flat) to the other ranks over a gloo group of torch.distributed; every
rank then applies the plan's KV copies and runs its shard of the model on the same inputs, so the
model's collectives line up. Only rank 0 samples; the others' logits are dropped. A plan that
runs in a decode graph's bucket (`GRAPH`) runs in it on every rank (the bucket's padded shapes
are the collectives'). With overlap (`SHARE`) a plan's inputs may be -1, the token the step
before samples: rank 0 broadcasts each step's sampled tokens over the model's group once drawn
(on the device: no host sync), and every rank fills them in from there.

The wire: one int64 tensor a message, sent as its length then its words:
  [kind, flags, number of block tables, (ndim, dims...) per array, the arrays' values...]
the arrays in FIELDS' order, then the plan's copies in COPIES' order, then the block tables.
With data-parallel attention (dp.py) a step is every attention rank's plan:
  [PARTS, P, the length of each part's message..., each part's message]
and each rank runs its own part, knowing the others' sizes.
Speculative decoding (`PASSES`): a step's forward passes wait for what only rank 0 knows (the
drafts, then which of them were kept), so the plan is followed by messages
  [PASS, mode, number of arrays, (ndim, dims...) per array, the arrays' values...]
in rank 0's order: DRAFT (a chained pass of the MTP head: the inputs, the rows, the token), VERIFY
(the inputs with the host's drafts, the sampled token index, the decode rows, whether the
drafter reads the hidden states, the input slots of the device drafts and their rows), ROLLBACK
(the tokens each row keeps, the inputs with the drafts read back), OBSERVE (the MTP head over the
step's kept tokens once read back: their next tokens, -1 where sampled, the tokens each row
keeps, the sampled row of each -1, each row's first sampled row, the rows whose last kept token
the device counts (none once read back), the requests finished since; the sampled tokens follow
over the model's group), then END (several ranks draft without overlap); each rank
runs rank 0's pass (speculative.py) on its shard and keeps its own copy of the MTP head's last
outputs and first drafts by request: the head's logits are whole on every rank, so each chains
the drafts rank 0 does, and counts the drafts kept, on its device.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from dayzero.kernels.collective import TpGroup
from dayzero.sdk.engine.context import build_context, device_fill, fill_tokens
from dayzero.sdk.engine.dp import dp_context
from dayzero.sdk.engine.drafters import Heads, chain, chain_start, observe_pass, remember
from dayzero.sdk.engine.speculative import (
    DRAFT,
    END,
    OBSERVE,
    ROLLBACK,
    VERIFY,
    accept_on_device,
    roll_back,
    save_states,
    verify_forward,
    verify_graph_plan,
)

STEP, STOP, PARTS, PASS = 1, 2, 3, 4
# a step's flags: it runs in a decode graph's bucket; its tokens are broadcast; passes follow
GRAPH, SHARE, PASSES = 1, 2, 4
FIELDS = (
    "num_tokens", "query_start", "positions", "kv_lens", "input_ids", "sample", "state_slots", "req_ids",
    "is_prefill",
)  # fmt: skip
COPIES = (
    "to_host_group", "to_host_src", "to_host_dst", "to_device_group", "to_device_src", "to_device_dst",
    "state_to_host_slot", "state_to_host_pages", "state_to_device_slot", "state_to_device_pages",
    "restore_src", "restore_dst", "snapshot_src", "snapshot_dst",
)  # fmt: skip


def _pack(head: list[int], arrays) -> torch.Tensor:
    """head, then (ndim, dims...) of each array, then the arrays' values, as one int64 tensor."""
    arrays = [np.asarray(a).astype(np.int64, copy=False) for a in arrays]
    for a in arrays:
        head = [*head, a.ndim, *a.shape]
    return torch.from_numpy(np.concatenate([np.asarray(head, dtype=np.int64), *(a.ravel() for a in arrays)]))


def _unpack(w: np.ndarray, at: int, count: int) -> list[np.ndarray]:
    """The `count` arrays `_pack` wrote from word `at` on."""
    shapes = []
    for _ in range(count):
        ndim = int(w[at])
        shapes.append(tuple(int(d) for d in w[at + 1 : at + 1 + ndim]))
        at += 1 + ndim
    arrays = []
    for shape in shapes:
        size = int(np.prod(shape, dtype=np.int64))
        arrays.append(w[at : at + size].reshape(shape))
        at += size
    return arrays


def encode(kind: int, plan=None, flags: int = 0) -> torch.Tensor:
    """The message of a plan (or of `kind` alone) as one int64 tensor."""
    if plan is None:
        return torch.tensor([kind, 0], dtype=torch.int64)
    if hasattr(plan, "parts"):  # data-parallel attention: every rank's plan
        msgs = [encode(kind, p, flags) for p in plan.parts]
        head = torch.tensor([PARTS, len(msgs), *(m.numel() for m in msgs)], dtype=torch.int64)
        return torch.cat([head, *msgs])
    arrays = [getattr(plan, f) for f in FIELDS] + [getattr(plan.copies, f) for f in COPIES]
    tables = list(plan.block_tables)
    return _pack([kind, flags, len(tables)], arrays + tables)


def encode_pass(mode: int, *arrays: np.ndarray) -> torch.Tensor:
    """A speculative step's pass: its mode and int64 arrays."""
    return _pack([PASS, mode, len(arrays)], arrays)


def decode_pass(words: torch.Tensor) -> tuple[int, list[np.ndarray]]:
    """(mode, arrays) of a PASS message."""
    w = words.numpy()
    if int(w[0]) != PASS:
        raise RuntimeError(f"expected a speculative step's pass from rank 0, got message kind {int(w[0])}")
    return int(w[1]), _unpack(w, 3, int(w[2]))


def decode(words: torch.Tensor) -> tuple[int, SimpleNamespace | None]:
    """(kind, a plan with the arrays build_context and the KV pool read, and its `flags`) of a
    message."""
    w = words.numpy()
    kind = int(w[0])
    if kind == PARTS:
        n = int(w[1])
        ends = np.cumsum([2 + n, *w[2 : 2 + n]])
        parts = [decode(words[a:b])[1] for a, b in itertools.pairwise(ends)]
        return STEP, SimpleNamespace(parts=parts, rows=sum(p.rows for p in parts), flags=parts[0].flags)
    if kind != STEP:
        return kind, None
    flags, n_tables = int(w[1]), int(w[2])
    arrays = _unpack(w, 3, len(FIELDS) + len(COPIES) + n_tables)
    k = len(FIELDS)
    plan = SimpleNamespace(**dict(zip(FIELDS, arrays[:k], strict=True)))
    plan.copies = SimpleNamespace(**dict(zip(COPIES, arrays[k : k + len(COPIES)], strict=True)))
    plan.block_tables = arrays[k + len(COPIES) :]
    plan.rows, plan.flags = len(plan.num_tokens), flags
    return kind, plan


class StepFailed(RuntimeError):
    """A rank other than 0 failed to run a plan (its own error, not a lost rank 0); the message
    names the rank, the step and the error."""


class Leader:
    """Rank 0's end: `send(plan)` before rank 0 runs it, `stop()` once (the others return). A
    send that fails (a rank is gone), or a failure of rank 0's part of a step (`lockstep`), is
    reported to on_failure, then raised; every later step fails the same way."""

    def __init__(
        self, group, on_failure: Callable[[str], str | None] | None = None, tp: TpGroup | None = None
    ) -> None:
        self.group, self.on_failure = group, on_failure  # on_failure may name the cause better
        self.tp = tp or TpGroup()  # the model's group: sampled tokens go over it (`share`)
        self.stopped = False
        self.broken: str | None = None  # why the ranks are no longer in step

    def fail(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
            if self.on_failure is not None:
                self.broken = self.on_failure(why) or why

    @contextlib.contextmanager
    def lockstep(self) -> Iterator[None]:
        """Rank 0's part of a step that every rank runs (its KV copies, its forward pass). One
        that raises leaves the others in a collective rank 0 never joins (or rank 0's
        collective failed: a rank is gone), so the ranks are out of step for good: the failure
        is reported (the server stops and ends the ranks), then raised."""
        try:
            yield
        except Exception as e:
            self.fail(f"tensor-parallel rank 0's step failed: {type(e).__name__}: {e}".splitlines()[0])
            raise

    def _broadcast(self, msg: torch.Tensor) -> None:
        try:
            dist.broadcast(torch.tensor([msg.numel()], dtype=torch.int64), 0, group=self.group)
            dist.broadcast(msg, 0, group=self.group)
        except Exception as e:  # gloo: a peer closed the connection, or the wait timed out
            self.fail(f"a tensor-parallel rank stopped answering rank 0: {e}".splitlines()[0])
            raise RuntimeError(self.broken) from None

    def send(self, plan, graph: bool = False, share: bool = False, passes: bool = False) -> None:
        """Send a plan; graph: it runs in a decode graph's bucket; share: its sampled tokens
        follow (`share`), as every rank's next inputs; passes: a speculative step's passes
        follow (`pass_`), then END."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        self._broadcast(encode(STEP, plan, GRAPH * graph | SHARE * share | PASSES * passes))

    def pass_(self, mode: int, *arrays: np.ndarray) -> None:
        """A speculative step's pass, before rank 0 runs it (END: none follows)."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        self._broadcast(encode_pass(mode, *arrays))

    def share(self, tokens: torch.Tensor) -> None:
        """The step's sampled tokens [S] int64 (on the device) to every rank (S > 0)."""
        self.tp.broadcast(tokens)

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self._broadcast(encode(STOP))

    def release(self) -> None:
        """Drop the control group's handle once stopped and the group destroyed (`end_group`;
        its TpGroup is released there by its owner)."""
        self.group = None


def from_leader(obj, group):
    """Rank 0's `obj` (picklable), on every rank of `group`."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def smallest(values: tuple[int, ...], group) -> tuple[tuple[int, ...], int]:
    """The minimum over the ranks of `group` of each of values (non-negative, each rank its own),
    and the rank that holds the first one's (the lowest of them at a tie): one all-reduce."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    t = torch.tensor([v * size + rank for v in values], dtype=torch.int64)  # the rank in the low digit
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    low = t.tolist()
    return tuple(v // size for v in low), low[0] % size


def _words(group) -> torch.Tensor:
    n = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(n, 0, group=group)
    words = torch.empty(int(n.item()), dtype=torch.int64)
    dist.broadcast(words, 0, group=group)
    return words


def receive(group) -> tuple[int, SimpleNamespace | None]:
    return decode(_words(group))


@torch.inference_mode()
def follow(engine, group, tp: TpGroup | None = None) -> int:
    """A rank other than 0: run every plan rank 0 sends on this rank's shard (its KV copies, the
    forward pass: in the decode graph's bucket when rank 0's runs there; with overlap, the
    sampled tokens rank 0 broadcasts over `tp`, the model's group, kept for the next plan's
    inputs) until it sends STOP; returns the steps run. `engine` is this rank's Engine (its KV
    pool, model and decode graphs; its own scheduler is never stepped). A plan that fails here
    raises StepFailed: rank 0 waits in a collective this rank never joins, so it must exit
    (which ends rank 0's wait at once on gloo) rather than go on."""
    tp = tp or TpGroup()
    steps, sampled, tokens = 0, [], None  # the last step's sampled requests and their device tokens
    # speculative, MTP: each request's last head output [Dm] and its first draft [1]
    heads: Heads = {}
    while True:
        kind, plan = receive(group)
        if kind == STOP:
            return steps
        try:
            rank = dist.get_rank(group)
            mine = plan.parts[rank] if hasattr(plan, "parts") else plan  # data-parallel attention
            engine.pool.apply(mine.copies)
            if plan.flags & PASSES:  # speculative: rank 0's passes, the step's end copies after verify
                _passes(engine, plan, group, heads, tp)
                steps += 1
                continue
            if plan.rows:  # every rank runs a step with rows somewhere (the MLPs gather them all)
                _forward(engine, plan, mine, rank, device_fill(mine, sampled, tokens))
            if plan.rows and plan.flags & SHARE:
                sampled = np.asarray(mine.req_ids)[np.asarray(mine.sample, dtype=bool)].tolist()
                tokens = torch.empty(len(sampled), dtype=torch.int64, device=engine.device)
                if sampled:
                    tp.broadcast(tokens)
            engine.pool.apply_after(mine.copies)
        except Exception as e:
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            rank = dist.get_rank(group)
            raise StepFailed(f"tensor-parallel rank {rank} failed in step {steps + 1}: {why}") from e
        steps += 1


def _passes(engine, plan, group, heads: Heads, tp: TpGroup) -> None:
    """A speculative step's passes as rank 0 runs them (sdk/engine/speculative.py): the MTP
    head's chained drafts, the verify pass on the inputs with the drafts (the decode rows' states
    saved first; the step's end copies after it, as on rank 0), a rollback of the rows that keep
    fewer tokens, the MTP head over the step's kept tokens with the sampled ones rank 0
    broadcasts over `tp` (`heads`: its output and d_1 by request). The head's drafts never leave the
    device: each rank chains its own (the head's logits are every rank's, whole) and counts
    the drafts kept from them, as rank 0 does."""
    saved, z, hidden, drafts, sampled = None, None, None, [], 0
    while True:
        mode, arrays = decode_pass(_words(group))
        if mode == END:
            return
        if mode == DRAFT:
            ids, keep, start = arrays
            if int(start[0]) == 0:  # the chain starts from each row's last observed output
                hidden, drafts = chain_start(heads, plan, keep)
            hidden = chain(engine, plan, ids, keep, int(start[0]), hidden, drafts)
        elif mode == VERIFY:
            inputs, index, decode_rows, reads_hidden, on_device, drafted = arrays
            fill = None
            if on_device.size:  # rank 0's drafts from the device: this rank's chain (k = 1: d_1 alone)
                if not drafts:
                    keep = np.zeros(len(plan.num_tokens), dtype=np.int64)
                    keep[drafted] = 1
                    drafts = chain_start(heads, plan, keep)[1]
                tokens = torch.stack(drafts, dim=1).reshape(-1)
                fill = (on_device, np.arange(len(on_device), dtype=np.int64), tokens)
            sampled = len(index)
            flat = verify_graph_plan(engine, plan, inputs)
            saved = save_states(engine, plan, inputs, decode_rows, checkpointed=flat is not None)
            _, z = verify_forward(engine, plan, inputs, index, bool(reads_hidden[0]), fill, flat)
            engine.pool.apply_after(plan.copies)
        elif mode == ROLLBACK:
            if saved is None:
                raise RuntimeError("a rollback pass of a step whose states were not saved")
            kept, inputs = arrays  # the inputs with the drafts rank 0 read back
            roll_back(engine, plan, replace(saved, inputs=inputs), kept)
        elif mode == OBSERVE:
            ids, keep, src, first, rows, dropped = arrays
            for rid in dropped.tolist():
                heads.pop(rid, None)
            tokens = torch.empty(sampled, dtype=torch.int64, device=engine.device)
            if sampled:
                tp.broadcast(tokens)
            a = accept_on_device(first, rows.tolist(), torch.stack(drafts, 1), tokens) if rows.size else None
            remember(heads, observe_pass(engine, plan, z, tokens, a, ids, keep, src, rows))
        else:
            raise RuntimeError(f"unknown speculative pass mode {mode}")


def _forward(engine, plan, mine, rank: int, fill) -> None:
    """This rank's forward pass of a step (the collectives of rank 0's; its logits are rank
    0's to use); fill: the inputs filled in on the device (`device_fill`)."""
    if plan.flags & GRAPH:
        if engine.graphs is None:
            raise RuntimeError("rank 0 runs this step in a decode graph, this rank has none")
        engine.graphs.run(plan, fill)
        return
    views, block, slots = engine.pool.views, engine.config.block_size, engine.pool.slots
    if mine is plan:
        ctx = build_context(plan, views, block, engine.device, slots)
    else:
        ctx = dp_context(plan, rank, views, block, engine.device, slots)
    if fill is not None:
        fill_tokens(ctx.input_ids, *fill)
    engine.model(ctx)
