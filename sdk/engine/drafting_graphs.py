"""A whole greedy drafting step in one CUDA graph (the MTP head, overlap): what the engine
otherwise launches pass by pass, each with its host work (sdk/engine/speculative.py for the
math of a verify step, drafters.py for the head's passes).

A step of R decode rows, each k + 1 tokens at positions p..p+k (flat rows, `flat_plan`), every
request greedy and drafting, in bucket B = (k + 1) R_b >= (k + 1) R; the request's head state
is read and written by its slot of the `HeadTable` (s_r):
    rows behind a verify row in flight: positions, KV lengths, slots less shift[s_r] = k - a
        (`DecodeGraphs` movable), x_p = last[s_r] = y_a of that row
    d_1 = d1[s_r];  h = y[s_r]
    d_{j+1} = argmax head(rmsnorm_s(h')),  h' = layer(W_eh [e(d_j) ; h]),  h <- h'
        at position p + j - 1, j = 1..k-1 (the head's chained drafts)
    logits_i, z_i = target([x_p, d_1, .., d_k]) at p + i;  y_i = argmax logits_i (+ its logprob)
    a = the leading i with y_{i-1} = d_i;  the row keeps y_0..y_a
    the head over every position p + i with next token y_i and z_i (its observe): at p + a,
        y[s_r] = its output, d1[s_r] = the argmax of its logits; last[s_r] = y_a, shift[s_r] = k - a
The host stages the plan once, replays the graph and copies the tokens, their logprobs and the
drafts back in one copy: about as many launches as a plain decode step. A step that does not fit
(a prefill row, a sampled or penalised request, top logprobs, recurrent state, a request whose
head state is outside the table) runs pass by pass as before; the two kinds mix freely, a step
in graph writing the table that the next one reads.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from dayzero.kernels.ops import PagedMeta, SamplingBatch
from dayzero.sdk.engine.context import StepContext, upload
from dayzero.sdk.engine.drafters import HeadTable
from dayzero.sdk.engine.graphs import DEFAULT_SIZES, DecodeGraphs, request_buckets
from dayzero.sdk.engine.sampling import Pending
from dayzero.sdk.engine.speculative import DeviceDrafts, VerifyRows, behind_rows, flat_plan, rows_in_flight


class DraftingGraphs:
    """The drafting step's graphs, one a bucket of whole requests, and the table they share."""

    def __init__(self, engine, k: int, row: tuple[int, ...], max_blocks: int, capture: bool) -> None:
        cfg, dev = engine.config, engine.device
        self.k, self.model, self.ops, self.drafter = k, engine.model, engine.ops, engine.drafter
        sizes = request_buckets(k + 1, min(cfg.max_batch_size, DEFAULT_SIZES[-1] // (k + 1)))
        self.table = HeadTable(2 * cfg.max_batch_size, row, engine.dtype, dev)
        b = sizes[-1]
        self.greedy = SamplingBatch(
            temperature=torch.zeros(b, device=dev),
            top_k=torch.zeros(b, dtype=torch.int64, device=dev),
            top_p=torch.ones(b, device=dev),
            min_p=torch.zeros(b, device=dev),
            generators=(None,) * b,
            sampled_rows=(),
        )
        pin = dev.type == "cuda"
        n = 2 * b + (b // (k + 1)) * k  # tokens, logprobs, drafts
        # in turn: a step's until it is read back, with overlap one step after it launched
        self.host = [torch.zeros(n, dtype=torch.float64, pin_memory=pin) for _ in range(3)]
        self.turn = 0
        self.graphs = DecodeGraphs(
            self._forward, engine.pool, cfg.block_size, max_blocks, sizes, dev, False,
            name="drafting step", state=False, movable=True, shift_table=self.table.shift,
            extras=(self.table.pad,),
        )  # fmt: skip
        if capture:  # (the forward reads self.graphs' buffers)
            self.graphs.capture()

    def fits(self, engine, plan) -> bool:
        """Every row a decode row of k + 1 tokens, within the buckets, of a live greedy request
        that drafts with no top logprobs, its head state in the table."""
        n = np.asarray(plan.num_tokens)
        if not plan.rows or not (n == self.k + 1).all() or np.asarray(plan.is_prefill, dtype=bool).any():
            return False
        if not np.asarray(plan.sample, dtype=bool).all() or int(n.sum()) > self.graphs.sizes[-1]:
            return False
        if engine.drafter is not self.drafter:  # (another drafter put in its place)
            return False
        for rid in np.asarray(plan.req_ids).tolist():
            p = engine.params.get(rid)
            if p is None or not p.verifies_drafts or p.temperature > 0 or p.top_logprobs:
                return False
            if rid not in self.table.slot:
                return False
        return True

    def launch(self, engine, plan, prev):
        """Queue the step (`fits`); prev: the step in flight, whose rows this plan's rows are
        placed behind, or None (the plan's rows then at their places). Returns (pending, verify,
        y_a [R] on the device)."""
        k, t = self.k, self.table
        k1, r = k + 1, plan.rows
        rids = np.asarray(plan.req_ids)
        slots = np.asarray([t.slot[int(x)] for x in rids], dtype=np.int64)
        moved = np.full(r, t.zero, dtype=np.int64)
        late = behind_rows(plan, k) if prev is not None else np.zeros(0, dtype=np.int64)
        if late.size:
            moved[late] = slots[late]
            engine.stats["rows_moved_on_device"] += len(late)
            if not prev.verify.in_graph:  # its a and y_a into the table first
                back = rows_in_flight(plan, late, prev.req_ids)
                idx = upload(np.stack((slots[late], back)), engine.device)
                t.shift[idx[0]] = k - prev.verify.a[idx[1]]
                t.last[idx[0]] = prev.last[idx[1]]
        flat = flat_plan(plan, np.asarray(plan.input_ids, dtype=np.int64))
        packed, a, last, tokens, drafts = self.graphs.run(
            flat, moved=np.repeat(moved, k1), extras=(np.repeat(slots, k1),)
        )
        b = tokens.shape[0]
        host = self.host[self.turn]
        self.turn = (self.turn + 1) % len(self.host)
        host[: packed.shape[0]].copy_(packed, non_blocking=host.is_pinned())
        event = None
        if host.is_pinned():
            event = torch.cuda.Event()
            event.record()
        s = r * k1
        pending = Pending(tokens[:s], host[: 2 * b].view(2, b)[:, :s], event, None)
        verify = VerifyRows(
            np.arange(r, dtype=np.int64) * k1, np.full(r, k1, dtype=np.int64), [[-1] * k for _ in range(r)]
        )
        verify.device = DeviceDrafts(list(range(r)), drafts[:r], host[2 * b : 2 * b + r * k].view(r, k))
        verify.sampled, verify.a, verify.in_graph = tokens[:s], a[:r], True
        return pending, verify, last[:r]

    # ---- the graph ------------------------------------------------------------------------
    def _forward(self, ctx: StepContext, feed) -> tuple[torch.Tensor, ...]:
        """The step over bucket B's flat rows (the module docstring): (tokens, logprobs and
        drafts packed [2 B + R_b k] fp64, a [R_b], y_a [R_b], tokens [B], drafts [R_b, k])."""
        k, k1, t, m = self.k, self.k + 1, self.table, self.model
        b = ctx.input_ids.shape[0]
        rb = b // k1
        slot = self.graphs.extra(0, b).view(rb, k1)[:, 0]  # [R_b]
        behind = self.graphs.moved(b).view(rb, k1)[:, 0] != t.zero
        ids = ctx.input_ids.view(rb, k1)
        ids[:, 0] = torch.where(behind, t.last[slot], ids[:, 0])
        h, drafts = t.y[slot], [t.d1[slot]]  # [R_b, *row], [R_b]
        for j in range(1, k):  # d_{j+1} at position p + j - 1
            sub = _every(ctx, j - 1, k1, drafts[-1])
            logits, h = m.mtp(drafts[-1], h, sub, m.embed, m.head)  # [R_b, V]
            drafts.append(logits.argmax(-1))
        d = torch.stack(drafts, dim=1)  # [R_b, k]
        ids[:, 1:] = d
        logits, z = m(ctx, hidden=True)  # [B, V] fp32, [B, ...]
        tokens, logprobs = self.ops.sample(logits, _first(self.greedy, b))  # [B]
        y = tokens.view(rb, k1)
        a = (y[:, :k] == d).cumprod(-1).sum(-1)  # [R_b]
        last = y.gather(1, a[:, None])[:, 0]  # y_a
        at = torch.arange(rb, device=a.device) * k1 + a  # each row's last kept token
        seen = replace(ctx, input_ids=tokens, sample_index=at, shared={})
        head_logits, out = m.mtp(tokens, z, seen, m.embed, m.head)  # [R_b, V], [B, ...]
        t.y[slot] = out[at]
        t.d1[slot] = head_logits.argmax(-1)
        t.last[slot] = last
        t.shift[slot] = k - a
        packed = torch.cat((tokens.double(), logprobs.double(), d.double().flatten()))
        return packed, a, last, tokens, d


def _first(batch: SamplingBatch, n: int) -> SamplingBatch:
    """The greedy batch's first n rows."""
    return replace(
        batch, temperature=batch.temperature[:n], top_k=batch.top_k[:n], top_p=batch.top_p[:n],
        min_p=batch.min_p[:n], generators=batch.generators[:n],
    )  # fmt: skip


def _every(ctx: StepContext, j: int, k1: int, ids: torch.Tensor) -> StepContext:
    """The context of flat rows j, j + k1, j + 2 k1, .. of ctx (token j of each request's k1),
    each a single-token row attending to its first position + 1 keys (a padding row to none),
    its input ids [R_b]. Its per-token tensors are contiguous copies: kernels index them flat."""
    pos = ctx.positions[j::k1].contiguous()  # [R_b]
    rb = pos.shape[0]
    paged: list[PagedMeta | None] = []
    for meta in ctx.paged:
        if meta is None:
            paged.append(None)
            continue
        paged.append(
            PagedMeta(
                query_start=meta.query_start[: rb + 1],
                kv_lens=meta.kv_lens[j::k1].contiguous(),  # p + j + 1 (a padding row: 0)
                positions=pos,
                block_table=meta.block_table[j::k1].contiguous(),
                slots=meta.slots[j::k1].contiguous(),
                block_size=meta.block_size,
                query_start_cpu=tuple(range(rb + 1)),
                kv_lens_cpu=meta.kv_lens_cpu[j::k1],
                scratch=meta.scratch,
            )
        )
    index = ctx.sample_index[:rb]
    return StepContext(input_ids=ids, positions=pos, paged=paged, caches=ctx.caches, sample_index=index)
