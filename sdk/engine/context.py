"""One step's typed batch context, built from a scheduler `Plan`."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dayzero.kernels.ops import PagedMeta


@dataclass
class StateMeta:
    """The rows' fixed-size states (linear attention): one slot per running request.

    pool [num_slots, slot_bytes] uint8 (a layer views its byte range in its own dtypes);
    slots_cpu[r] the slot of row r; has_initial_state_cpu[r]: the row continues an earlier step's
    state; False for a row starting at position 0, whose state starts from zeros (not whatever the
    slot held before).
    The same on the device (what a graph-safe kernel reads; None where a caller gives host
    copies only): slots [R] int64, fresh [R] int64 (1: the row starts from zeros). decode: every
    row has exactly one token, token r being row r's (a decode step: the kernels' vectorised
    one-token path over `slots` / `fresh`, no host copy read).
    A decode step of `steps` tokens a row (a speculative verify step of k + 1 tokens): row r's
    tokens are r * steps .. r * steps + steps - 1, run in order; the state after its token t is
    written to slot checkpoints[r, t] ([R, steps] int64, on the device) and slots[r] is only
    read, so the step's state at any of its tokens is kept (the speculative rollback). Without
    checkpoints (steps 1) the state goes back to slots[r]."""

    pool: torch.Tensor
    slots_cpu: tuple[int, ...]
    has_initial_state_cpu: tuple[bool, ...]
    query_start_cpu: tuple[int, ...]
    slots: torch.Tensor | None = None
    fresh: torch.Tensor | None = None
    decode: bool = False
    steps: int = 1
    checkpoints: torch.Tensor | None = None


@dataclass(frozen=True)
class DpStep:
    """Data-parallel attention (sdk/engine/dp.py): this step's rows are split by request over
    the ranks, each attending for its own; the MLPs (and the vocab-parallel embedding and LM
    head) run on every rank's tokens, gathered in rank order."""

    rank: int
    tokens: tuple[int, ...]  # [P] tokens of each rank's rows
    sampled: tuple[int, ...]  # [P] sampling rows of each rank (the logits come back in rank order)
    input_ids: torch.Tensor  # [sum(tokens)] int64: every rank's input tokens, rank by rank

    @property
    def start(self) -> int:
        """This rank's first token among all ranks' tokens."""
        return sum(self.tokens[: self.rank])


@dataclass
class StepContext:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    paged: list[PagedMeta | None]  # per cache group (None: a State group)
    caches: list[torch.Tensor | None]  # per cache group: [N slots, row] in the cache dtype (None: State)
    sample_index: torch.Tensor  # [S] token index of each sampling row's last token
    state: StateMeta | None = None  # when the model has a State group
    # step-scoped values one layer hands to a later one (e.g. a sparse-attention selection
    # that following layers reuse); cleared with the context
    shared: dict = field(default_factory=dict)
    dp: DpStep | None = None  # data-parallel attention: this rank's share of the batch


def build_context(
    plan, caches: list[torch.Tensor | None], block_size: int, device: torch.device, state_pool=None
) -> StepContext:
    num_tokens = np.asarray(plan.num_tokens)
    qs = np.asarray(plan.query_start)
    positions = torch.from_numpy(np.asarray(plan.positions, dtype=np.int64))
    row_of_token = torch.from_numpy(np.repeat(np.arange(len(num_tokens)), num_tokens))
    kv_lens = tuple(int(x) for x in plan.kv_lens)
    # row-level tensors are the same for every group: made (and copied to the device) once
    query_start = torch.from_numpy(qs.astype(np.int64)).to(device)
    kv_lens_dev = torch.tensor(kv_lens, device=device)
    positions_dev = positions.to(device)
    qs_cpu = tuple(int(x) for x in qs)
    paged = []
    for table_np, cache in zip(plan.block_tables, caches, strict=True):
        if cache is None:  # State group: no block table
            paged.append(None)
            continue
        table = torch.from_numpy(np.asarray(table_np, dtype=np.int64))  # [R, W]
        slots = table[row_of_token, positions // block_size] * block_size + positions % block_size  # [T]
        paged.append(
            PagedMeta(
                query_start=query_start,
                kv_lens=kv_lens_dev,
                positions=positions_dev,
                block_table=table.to(device),
                slots=slots.to(device),
                block_size=block_size,
                query_start_cpu=qs_cpu,
                kv_lens_cpu=kv_lens,
                scratch=cache.shape[0] - 1,  # a KvPool view's last row lies in its scratch page
            )
        )
    sample_rows = np.nonzero(np.asarray(plan.sample))[0]
    state = None
    if state_pool is not None and state_pool.numel():
        slots = np.asarray(plan.state_slots, dtype=np.int64)
        first = np.asarray(plan.kv_lens) - num_tokens  # position of each row's first token
        dev = torch.from_numpy(np.concatenate((slots, first == 0)).astype(np.int64)).to(device)  # [2R]
        state = StateMeta(
            pool=state_pool,
            slots_cpu=tuple(slots.tolist()),
            has_initial_state_cpu=tuple(bool(f > 0) for f in first),
            query_start_cpu=qs_cpu,
            slots=dev[: len(slots)],
            fresh=dev[len(slots) :],
            decode=bool((num_tokens == 1).all()),
        )
    return StepContext(
        input_ids=torch.from_numpy(np.asarray(plan.input_ids, dtype=np.int64)).to(device),
        positions=positions_dev,
        paged=paged,
        caches=caches,
        sample_index=torch.from_numpy((qs[sample_rows + 1] - 1).astype(np.int64)).to(device),
        state=state,
    )


class PinnedRing:
    """Host-to-device copies through one pinned buffer, slice after slice (8-byte aligned): a
    `pin_memory()` a copy cost tens of microseconds of host time each (profiled on an H100 host:
    a drafting step made ten). The buffer is two halves, filled in turn; leaving a half records
    an event on the stream (every copy from it is queued before), and entering one waits for the
    event recorded when it was left last, half a lap ago, so no copy still reads a slice written
    again (and the wait is over long before, not a stall of the overlapped steps)."""

    def __init__(self, device: torch.device, nbytes: int = 4 << 20, pin: bool = True) -> None:
        self.device, self.half, self.pin = device, nbytes // 2, pin  # (pin: off only in a CPU test)
        self.buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.h, self.at = 0, 0  # the half being filled, the next free byte in it
        self.left: list[torch.cuda.Event | None] = [None, None]

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        if 4 * n > self.half:  # a large one: a pinned copy of its own
            return (t.pin_memory() if self.pin else t).to(self.device, non_blocking=True)
        if self.at + n > self.half:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.left[self.h], self.h, self.at = event, 1 - self.h, 0
            if self.left[self.h] is not None:
                self.left[self.h].synchronize()
        start = self.h * self.half + self.at
        dst = self.buf[start : start + n].view(t.dtype).view(t.shape)
        self.at = -(-(self.at + n) // 8) * 8
        dst.copy_(t)
        return dst.to(self.device, non_blocking=True)


_RINGS: dict[torch.device, PinnedRing] = {}


def upload(arr: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array (or CPU tensor) on `device` without waiting for the work queued there (on
    CUDA through the device's `PinnedRing`, non-blocking: a pageable copy would wait for the
    stream, e.g. a graph's replay)."""
    t = arr if isinstance(arr, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(arr))
    if device.type != "cuda":
        return t.to(device)
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = PinnedRing(device)
    return ring.upload(t.contiguous())


def fill_tokens(ids: torch.Tensor, dst: np.ndarray, src: np.ndarray, tokens: torch.Tensor) -> None:
    """ids[dst] = tokens[src] on the device (the indices travel in one copy)."""
    idx = upload(np.stack((dst, src)), ids.device)
    ids[idx[0]] = tokens[idx[1]].to(ids.dtype)


def device_fill(plan, sample_ids: list[int], tokens: torch.Tensor | None):
    """(token indices, indices into the previous step's sampled rows, its device tokens [S]) for
    the plan's inputs the scheduler left to the device (-1: the token the previous step
    samples), or None when it left none. sample_ids: the request of each row the previous step
    sampled (its tokens' order)."""
    ids = np.asarray(plan.input_ids)
    dst = np.flatnonzero(ids < 0)
    if not dst.size:
        return None
    if tokens is None:
        raise RuntimeError("the plan asks for device-filled tokens but no step is in flight")
    row = np.repeat(np.arange(len(plan.num_tokens)), np.asarray(plan.num_tokens))[dst]
    where = {rid: j for j, rid in enumerate(sample_ids)}
    src = np.asarray([where[int(r)] for r in np.asarray(plan.req_ids)[row]], dtype=np.int64)
    return dst.astype(np.int64), src, tokens
