"""The tensor-parallel group a model's collectives run over: torch.distributed (NCCL on GPUs,
gloo on CPUs). A block calls these where its math crosses shards: after a row-parallel product
(the partial sums of every rank add up: all_reduce, or with data-parallel attention each rank's
rows of the sum: scatter_rows) and after a vocab-parallel LM head (each rank holds a slice of
the vocabulary: all_gather). With one rank every call returns its input, so the one-device path
runs no collective and makes no copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# a reduce-scatter of one tensor in equal parts; torch 2.13 renamed reduce_scatter_tensor (the old
# name warns). gloo has it on CPU (checked with torch 2.13; inside, an all-reduce of the whole
# tensor of which each rank keeps its part, so the CPU ranks check its result, not its traffic)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TpGroup:
    """`size` ranks, this one `rank`, over `group`; `store`: the group's key-value store (rank 0
    serves it), where a rank whose step fails leaves word of why (sdk/engine/parallel.py)."""

    def __init__(
        self,
        size: int = 1,
        rank: int = 0,
        group: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} out of size {size}")
        self.size, self.rank, self.group, self.store = size, rank, group, store

    def release(self) -> None:
        """Drop the group and store handles, the process group destroyed (`end_group` in
        sdk/engine/parallel.py); a collective after it fails (no group)."""
        self.group = self.store = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """sum over ranks of x (in place; x as it is on one rank)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """rank src's x on every rank (in place; on the device, no host sync)."""
        if self.size > 1:
            dist.broadcast(x, dist.get_global_rank(self.group, src), group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., N] on each rank -> [..., size * N], rank r's slice at r * N."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def gather_rows(self, x: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """[counts[rank], ...] on each rank -> [sum(counts), ...], rank r's rows after those of
        the ranks before it (data-parallel attention: each rank's tokens before the MoE). The
        rows travel padded to the largest count (all_gather takes equal shapes)."""
        if self.size == 1:
            return x
        top = max(counts)
        if top == 0:
            return x
        pad = x.new_zeros((top, *x.shape[1:]))
        pad[: x.shape[0]] = x
        parts = [torch.empty_like(pad) for _ in range(self.size)]
        dist.all_gather(parts, pad, group=self.group)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])

    def scatter_rows(self, x: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        """[sum(counts), ...] partial sums of every rank's rows on each rank (rank r's counts[r]
        rows after those of the ranks before it) -> [counts[rank], ...]: this rank's rows of the
        sum over ranks (data-parallel attention: the MLP's output for this rank's tokens;
        gather_rows' inverse). A reduce-scatter of the rows padded to the largest count (it takes
        equal parts): a rank receives its own rows' sums, not every rank's."""
        if self.size == 1:
            return x
        top = max(counts)
        if top == 0:
            return x
        pad = x.new_empty((self.size, top, *x.shape[1:]))  # [P, top, ...]: rows past counts[r] unread
        for r, part in enumerate(x.split(list(counts))):
            pad[r, : counts[r]] = part
        out = x.new_empty((top, *x.shape[1:]))
        _reduce_scatter(out, pad.flatten(0, 1), group=self.group)
        return out[: counts[self.rank]]

    def reduce(self, x: torch.Tensor, rows: tuple[int, ...] | None = None) -> torch.Tensor:
        """The sum over ranks of x: all of it (rows None: all_reduce), or this rank's rows of it
        (rows: every rank's row count, x their rows in rank order: scatter_rows)."""
        return self.all_reduce(x) if rows is None else self.scatter_rows(x, rows)
