"""PagedMeta for kernel tests: rows of (new tokens, KV length after the step) on shuffled blocks;
a sliding group's view of them; a QSA step's raw and pooled key caches."""

from __future__ import annotations

import itertools
from dataclasses import replace

import torch

from dayzero.kernels.ops import PagedMeta


def paged_meta(
    rows: list[tuple[int, int]],
    bs: int,
    g: torch.Generator,
    blocks: int | None = None,
    freed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[PagedMeta, int]:
    """(meta, blocks in the pool). The rows' blocks are a random permutation of the pool's
    (default: exactly as many as the rows need); the first `freed` blocks of the last row are
    given back (-1), as a sliding window does."""
    need = sum(-(-kv // bs) for _, kv in rows)
    blocks = blocks or need
    perm = torch.randperm(blocks, generator=g)
    table = torch.full((len(rows), max(-(-kv // bs) for _, kv in rows)), -1, dtype=torch.int64)
    qs, pos, slots, used = [0], [], [], 0
    for r, (n, kv) in enumerate(rows):
        nb = -(-kv // bs)
        table[r, :nb], used = perm[used : used + nb], used + nb
        qs.append(qs[-1] + n)
        pos += range(kv - n, kv)
        slots += [int(table[r, p // bs]) * bs + p % bs for p in range(kv - n, kv)]
    table[-1, :freed] = -1
    lens = tuple(kv for _, kv in rows)
    meta = PagedMeta(
        torch.tensor(qs, device=device), torch.tensor(lens, device=device), torch.tensor(pos, device=device),
        table.to(device), torch.tensor(slots, device=device), bs, tuple(qs), lens,
    )  # fmt: skip
    return meta, blocks


def selection(g: torch.Generator, meta: PagedMeta, k: int) -> torch.Tensor:
    """[T, k] distinct random positions in random order (an indexer's contract), below the token's
    row length (later ones than the query too), -1 for the draws past the row and a fifth of the
    rest, the last token selecting nothing; on the host whatever the meta's device."""
    t, longest = meta.positions.shape[0], max(meta.kv_lens_cpu)
    qs = meta.query_start_cpu
    lens = torch.repeat_interleave(
        torch.tensor(meta.kv_lens_cpu), torch.tensor([b - a for a, b in itertools.pairwise(qs)])
    )
    sel = torch.rand(t, max(longest, k), generator=g).argsort(-1)[:, :k]
    sel = torch.where((sel >= lens[:, None]) | (torch.rand(t, k, generator=g) < 0.2), -1, sel)
    sel[-1] = -1
    return sel


def sliding(meta: PagedMeta, window: int) -> PagedMeta:
    """The same rows in a sliding-window group: each row's blocks wholly before its first query
    position - window given back (-1), as the scheduler frees them."""
    table = meta.block_table.clone()
    qs, bs = meta.query_start_cpu, meta.block_size
    for r, kv in enumerate(meta.kv_lens_cpu):
        first = kv - (qs[r + 1] - qs[r])
        table[r, : max(0, first - window) // bs] = -1
    return replace(meta, block_table=table, memo={})


def qsa_step(rows: list[tuple[int, int]], pool: int, di: int, g: torch.Generator, device="cpu"):
    """A QSA step's caches on blocks of 4: (raw keys [N, Di] (a strided view, as the cache is),
    their sliding group's meta (window `pool`), the pooled cache [N + 1, ceil(Di / P)] holding
    stale values for the blocks of earlier steps, its meta (scratch: the last row))."""
    meta, blocks = paged_meta(rows, 4, g, device=device)
    raw = torch.randn(blocks * 4, di + 3, generator=g)[:, :di].to(device)
    pooled = torch.randn(blocks * 4 + 1, -(-di // pool), generator=g).to(device)
    return raw, sliding(meta, pool), pooled, replace(meta, scratch=blocks * 4)
