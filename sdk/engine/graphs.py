"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step (every row one new token) of R rows runs in the smallest captured bucket
B >= R. The step's inputs live in static device buffers that the graph reads: token ids,
positions, KV lengths, per paged cache group each row's new-token slot and block table, and with
a State group each row's state slot and fresh flag (1: it starts from zeros, at position 0).
The host fills a pinned staging copy of them and moves it with one host-to-device copy (plus one
2-D copy of each group's used table columns), then replays the graph; the logits [B, V] come
out in a static buffer and the first R rows are sampled outside the graph. Rows R..B-1 are
padding: KV length 0 (they attend to nothing), their keys go to the pool's scratch slot, their
recurrent states start from zeros and are written to the pool's scratch state slot. The plan's
state copies (restores before the step, snapshots after) stay outside the graph: the engine
runs them around `run`, in stream order.

Lengths are data, not shapes: the graph's kernels (Capabilities.graphs) size their grids from
the row count alone, so one capture serves every context length. On the CPU (or with
`capture=False`) the same buffers run the model eagerly: the path CI tests.

A speculative verify step runs here too, each of its tokens a row of its own for attention
(`speculative.flat_plan`: the token at position p attends to the row's first p + 1 keys, those
of the drafts before it written in the same pass); with recurrent state each request is a state
row of its k + 1 tokens (`steps`), run in order, the state after each kept in a checkpoint slot
of the pool; its forward also hands back the final hidden states the MTP head drafts from. The
MTP head's passes run in graphs of their own (the same buffers, the head as the forward, the
hidden states it reads fed in a static buffer `feed` [B, ...]): its observe pass over a step's
tokens (flat rows again) and each chained draft. With overlap a drafting engine's graphs are
`movable`: a row planned behind a verify row in flight moves back by the drafts that row
rejected, inside the graph (positions and KV lengths less a shift read from a static buffer by
each row's staged index, new-token slots from the block tables again), so the host stages the
plan as the scheduler made it.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dayzero.kernels.ops import PagedMeta
from dayzero.sdk.engine.context import StateMeta, StepContext, fill_tokens
from dayzero.sdk.engine.kv_pool import KvPool

log = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# forward(ctx, feed rows or None) -> logits [B, V] fp32, or a tuple led by them (+ hidden states)
Forward = Callable[[StepContext, torch.Tensor | None], torch.Tensor | tuple[torch.Tensor, ...]]


def request_buckets(per: int, most: int) -> tuple[int, ...]:
    """Bucket sizes of whole requests of `per` rows each, up to `most` requests (DEFAULT_SIZES)."""
    return tuple(per * s for s in (*(s for s in DEFAULT_SIZES if s < most), most))


def decode_only(plan) -> bool:
    """Every row of the plan computes one new token and samples it."""
    n = np.asarray(plan.num_tokens)
    return plan.rows > 0 and bool((n == 1).all()) and bool(np.asarray(plan.sample, dtype=bool).all())


@dataclass
class _Bucket:
    size: int
    ctx: StepContext
    graph: torch.cuda.CUDAGraph | None = None
    # the graph's outputs: logits [B, V] fp32 (and hidden states [B, Dm] or streams [B, N, Dm])
    out: torch.Tensor | tuple[torch.Tensor, ...] | None = None


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        pool: KvPool,
        block_size: int,
        max_blocks: int,
        sizes: tuple[int, ...],
        device: torch.device,
        capture: bool,
        feed: tuple[tuple[int, ...], torch.dtype] | None = None,
        name: str = "decode",
        state: bool = True,
        steps: int = 1,
        movable: bool = False,
        shift_table: torch.Tensor | None = None,
        extras: tuple[int, ...] = (),
    ) -> None:
        """max_blocks: the widest block table a request can have (max model length / block size);
        feed: (the shape of a row, dtype) of the input `forward` reads beside the tokens (the MTP
        head's hidden states), None: it reads none; name: what runs in them (the report's); state:
        whether the forward reads the pool's recurrent states (the MTP head's layer does not);
        steps: the tokens of a state row (a stateful model's verify steps: k + 1, each token a
        row of its own for attention, each request a state row whose state after each token goes
        to the pool's checkpoint slots, flat row i's to checkpoint i; sizes are multiples);
        movable: rows may be moved back on the device (`run`'s shift), inside the graph, by
        shift_rows[i] at each row's staged index i: a table of the graphs' own [B + 1] written by
        `run`, or shift_table [N + 1] written by the forward itself (its last entry 0: rows that
        do not move); extras: the padding rows' values of further int64 fields a row, staged
        from `run`'s extras and read by the forward (`extra`)."""
        self.forward, self.pool, self.block_size, self.device = forward, pool, block_size, device
        self.name = name
        self.sizes = tuple(sorted(set(sizes)))
        b, w = self.sizes[-1], max_blocks
        self.feed = None if feed is None else torch.zeros((b, *feed[0]), dtype=feed[1], device=device)
        self.groups = [g for g, v in enumerate(pool.views) if v is not None]  # paged groups
        n = len(self.groups)
        self.state = state and pool.state_bytes > 0  # a State group: the rows' state slots and fresh flags
        self.steps = steps
        if steps > 1:  # flat row i's state to checkpoint slot i
            assert all(s % steps == 0 for s in self.sizes) and pool.checkpoints >= b, (self.sizes, steps)
            self.checkpoints = torch.arange(b, device=device).view(-1, steps) + pool.checkpoint_slot(0)
        self.state_field = 3 + n  # its fields' index: [slots | fresh]
        self.movable = movable
        self.shift_field = 3 + n + 2 * self.state  # each row's index into shift_rows
        own = torch.zeros(b + 1, dtype=torch.int64, device=device)
        self.shift_rows = own if shift_table is None else shift_table
        self.no_shift = len(self.shift_rows) - 1  # the entry that stays 0
        self.extras, self.extra_field = extras, self.shift_field + movable
        pin = device.type == "cuda"
        # [ids | positions | kv_lens | slots of each paged group (| state slots | fresh)
        # (| shift index) | extras], B each; one copy a step
        fields = 3 + n + 2 * self.state + movable + len(extras)
        self.staging = torch.zeros(fields * b, dtype=torch.int64, pin_memory=pin)
        self.vec = torch.zeros(fields * b, dtype=torch.int64, device=device)
        self.tables_host = [torch.zeros(b, w, dtype=torch.int32, pin_memory=pin) for _ in self.groups]
        self.tables = [torch.zeros(b, w, dtype=torch.int32, device=device) for _ in self.groups]
        self.query_start = torch.arange(b + 1, device=device)
        self.sample_index = torch.arange(b, device=device)
        self.scratch = [pool.scratch_slot(g) for g in self.groups]
        self.buckets = {s: _Bucket(s, self._context(s)) for s in self.sizes}
        self._copied = torch.cuda.Event() if pin else None  # the last staging copy is done
        self.report = f"{name} buffers for batch sizes {', '.join(map(str, self.sizes))} (not captured)"
        if capture:
            self.capture()

    def _field(self, i: int, size: int) -> torch.Tensor:
        b = self.sizes[-1]
        return self.vec[i * b : i * b + size]

    def extra(self, i: int, size: int) -> torch.Tensor:
        """Extra field i of the first `size` rows [size] int64 (the forward's own inputs)."""
        return self._field(self.extra_field + i, size)

    def moved(self, size: int) -> torch.Tensor:
        """Each row's index into shift_rows [size] (no_shift: the row does not move)."""
        return self._field(self.shift_field, size)

    def _context(self, size: int, kv_lens_cpu: tuple[int, ...] | None = None, plan=None) -> StepContext:
        """The step context of bucket `size` over the static buffers. kv_lens_cpu (and the state
        slots of `plan`): the host copies the reference kernels read when the buffers run eagerly
        (graph-safe kernels never do)."""
        ids, pos, kv = self._field(0, size), self._field(1, size), self._field(2, size)
        paged: list[PagedMeta | None] = [None] * len(self.pool.views)
        for j, g in enumerate(self.groups):
            paged[g] = PagedMeta(
                query_start=self.query_start[: size + 1],
                kv_lens=kv,
                positions=pos,
                block_table=self.tables[j][:size],
                slots=self._field(3 + j, size),
                block_size=self.block_size,
                query_start_cpu=tuple(range(size + 1)),
                kv_lens_cpu=kv_lens_cpu or (0,) * size,
                scratch=self.scratch[j],
            )
        return StepContext(
            input_ids=ids,
            positions=pos,
            paged=paged,
            caches=self.pool.views,
            sample_index=self.sample_index[:size],
            state=self._state_meta(size, plan) if self.state else None,
        )

    def _state_meta(self, size: int, plan) -> StateMeta:
        """The state rows' slots and fresh flags in the static buffers (size / steps rows); the
        host copies only for a plan run eagerly (padding rows: the scratch slot, fresh)."""
        n, rows = self.steps, size // self.steps
        slots, fresh = (self._field(self.state_field + i, rows) for i in range(2))
        host_slots, host_init = (self.pool.scratch_state_slot(),) * rows, (False,) * rows
        if plan is not None:
            r = plan.rows // n
            host_slots = tuple(int(x) for x in plan.state_slots) + host_slots[r:]
            host_init = tuple(bool(p > 0) for p in plan.positions[::n]) + host_init[r:]
        return StateMeta(
            pool=self.pool.slots,
            slots_cpu=host_slots,
            has_initial_state_cpu=host_init,
            query_start_cpu=tuple(range(0, size + 1, n)),
            slots=slots,
            fresh=fresh,
            decode=True,
            steps=n,
            checkpoints=self.checkpoints[:rows] if n > 1 else None,
        )

    def fits(self, plan) -> bool:
        return plan.rows <= self.sizes[-1] and plan.rows % self.steps == 0 and decode_only(plan)

    def _fill(self, plan, size: int, moved: np.ndarray | None = None, extras=()) -> None:
        """Stage the plan's rows (and padding up to `size`) and copy them to the device; moved
        [R]: each row's index into shift_rows (`run`); extras: the rows' extra fields [R] each."""
        r, b = plan.rows, self.sizes[-1]
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffers are free again
        s = self.staging.numpy()
        s[:] = 0
        if self.movable:
            f = self.shift_field * b
            s[f : f + size] = self.no_shift
            if moved is not None:
                s[f : f + r] = moved
        for i, (pad, values) in enumerate(zip(self.extras, extras, strict=True)):
            f = (self.extra_field + i) * b
            s[f : f + r], s[f + r : f + size] = values, pad
        s[0:r] = np.maximum(plan.input_ids, 0)  # -1: filled in on the device
        s[b : b + r] = plan.positions
        s[2 * b : 2 * b + r] = plan.kv_lens
        width = 0
        for j, g in enumerate(self.groups):
            table = np.asarray(plan.block_tables[g])  # [R, w] int32, -1: freed
            pos = np.asarray(plan.positions, dtype=np.int64)
            blocks = table[np.arange(r), pos // self.block_size].astype(np.int64)
            s[(3 + j) * b : (3 + j) * b + r] = blocks * self.block_size + pos % self.block_size
            s[(3 + j) * b + r : (3 + j) * b + size] = self.scratch[j]
            width = max(width, table.shape[1])
            self.tables_host[j].numpy()[:r, : table.shape[1]] = table
        if self.state:  # a state row at position 0 (a one-token prompt) starts from zeros
            f, rs, n = self.state_field * b, r // self.steps, size // self.steps
            s[f : f + rs] = plan.state_slots
            s[f + rs : f + n] = self.pool.scratch_state_slot()
            s[f + b : f + b + rs] = np.asarray(plan.positions)[:: self.steps] == 0
            s[f + b + rs : f + b + n] = 1
        self.vec.copy_(self.staging, non_blocking=True)
        for j in range(len(self.groups)):
            self.tables[j][:r, :width].copy_(self.tables_host[j][:r, :width], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def _feed(self, size: int) -> torch.Tensor | None:
        return None if self.feed is None else self.feed[:size]

    def _move_back(self, size: int) -> None:
        """The rows' positions and KV lengths less their shift (shift_rows at each row's index),
        and a moved row's new-token slots from its block tables again: inside the graph."""
        shift = self.shift_rows[self._field(self.shift_field, size)]  # [size]
        pos, kv, bs = self._field(1, size), self._field(2, size), self.block_size
        pos.sub_(shift)
        kv.sub_(shift)
        col, moved = (pos // bs)[:, None], shift != 0
        for j in range(len(self.groups)):
            slots = self._field(3 + j, size)
            blocks = self.tables[j][:size].gather(1, col)[:, 0].to(torch.int64)  # [size]
            slots.copy_(torch.where(moved, blocks * bs + pos % bs, slots))

    def _forward(self, ctx: StepContext, size: int):
        if self.movable:
            self._move_back(size)
        return self.forward(ctx, self._feed(size))

    @torch.inference_mode()
    def run(self, plan, fill=None, feed: torch.Tensor | None = None, shift=None, moved=None, extras=()):
        """The forward's outputs for the R rows of a decode-only plan that `fits`: logits [R, V]
        fp32 (and hidden states); fill: the inputs the device fills in (overlap; see
        `fill_tokens`); feed: the rows of the fed input [R, ...] (graphs built with `feed`);
        shift: (rows [R] on the host, by_row [R'] on the device): row i moves back by
        by_row[rows[i]] positions (speculative.Behind; graphs built `movable`); or moved [R]:
        each row's index into a shift table the forward writes (graphs built with one);
        extras: the rows' extra fields. Graphs with extras give their whole buckets' outputs
        (the forward's rows are its own), others their first R rows."""
        size = next(s for s in self.sizes if s >= plan.rows)
        bucket = self.buckets[size]
        if (shift is not None or moved is not None) and not self.movable:
            raise RuntimeError(f"{self.name} graphs were built without moving rows")
        if shift is not None:
            self.shift_rows[: len(shift[1])].copy_(shift[1])
            moved = shift[0]
        self._fill(plan, size, moved, extras)
        if fill is not None:
            fill_tokens(self._field(0, size), *fill)
        r = plan.rows
        if self.feed is not None:
            self.feed[:r].copy_(feed)  # padding rows keep what they held: their outputs are not read
        out = bucket.out
        if bucket.graph is None:  # eager over the same buffers (CPU, or capture off)
            lens = np.asarray(plan.kv_lens, dtype=np.int64)
            if moved is not None:  # the host copies the eager kernels read (a sync off the CPU)
                lens = lens - self.shift_rows.cpu().numpy()[moved]
            lens = tuple(int(x) for x in lens) + (0,) * (size - r)
            out = self._forward(self._context(size, lens, plan), size)
        else:
            bucket.graph.replay()
        if self.extras:
            return out
        return tuple(o[:r] for o in out) if isinstance(out, tuple) else out[:r]

    def replay_ms(self, size: int, n: int) -> list[float]:
        """Device milliseconds of n replays of bucket `size` on the buffers as they are (benchmarks)."""
        graph, out = self.buckets[size].graph, []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        return out

    @property
    def captured(self) -> bool:
        """Every bucket replays a captured graph (none where capture was not asked, or failed)."""
        return all(b.graph is not None for b in self.buckets.values())

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, in one memory pool. A capture that
        fails (a kernel that syncs with the host after all) leaves every bucket eager, said so
        in the log and the report: serving goes on without graphs rather than not at all."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        try:
            for size in reversed(self.sizes):
                self._capture_one(self.buckets[size], pool, stream)
        except RuntimeError as e:
            torch.cuda.synchronize(self.device)
            for bucket in self.buckets.values():
                bucket.graph, bucket.out = None, None
            self.report = (
                f"CUDA graph capture failed, {self.name} runs eagerly: {str(e).splitlines()[0]} ({_where(e)})"
            )
            log.warning(self.report)
            return
        torch.cuda.synchronize(self.device)
        used = _pool_bytes(self.device, pool)
        self.report = (
            f"CUDA graphs ({self.name}): batch sizes {', '.join(map(str, self.sizes))} captured in "
            f"{time.perf_counter() - t0:.1f} s, {used / 2**20:.0f} MiB"
        )
        log.info(self.report)

    def _capture_one(self, bucket: _Bucket, pool, stream: torch.cuda.Stream) -> None:
        self._pad_all(bucket.size)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile the Triton kernels, settle the allocator
                self._forward(bucket.ctx, bucket.size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            bucket.out = self._forward(bucket.ctx, bucket.size)
        bucket.graph = graph

    def _pad_all(self, size: int) -> None:
        """Inputs of `size` padding rows (what capture runs on): nothing read, keys to scratch."""
        b = self.sizes[-1]
        s = self.staging.numpy()
        s[:] = 0
        for j in range(len(self.groups)):
            s[(3 + j) * b : (3 + j) * b + size] = self.scratch[j]
        if self.state:
            f, n = self.state_field * b, size // self.steps
            s[f : f + n] = self.pool.scratch_state_slot()
            s[f + b : f + b + n] = 1
        if self.movable:
            s[self.shift_field * b : self.shift_field * b + size] = self.no_shift
        for i, pad in enumerate(self.extras):
            s[(self.extra_field + i) * b : (self.extra_field + i) * b + size] = pad
        self.vec.copy_(self.staging)


def _where(e: BaseException) -> str:
    """The innermost frame of the failing call outside torch (the op that is not capturable)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" not in f.filename]
    if not frames:
        return "in torch"
    f = frames[-1]
    return f"at {'/'.join(Path(f.filename).parts[-2:])}:{f.lineno} in {f.name}"


def _pool_bytes(device: torch.device, pool) -> int:
    """The device memory the graphs' private pool holds: its segments in the allocator's snapshot
    (the allocator's reserved total moves with everything else on the device, e.g. a reference
    model freed meanwhile, and printed negative sizes)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return sum(
        s["total_size"]
        for s in torch.cuda.memory_snapshot()
        if s["device"] == index and tuple(s.get("segment_pool_id", ())) == tuple(pool)
    )
