"""The MLA attention kernels against the reference op (kernels/reference/mla.py `mla_attention`)
on random inputs from the recorded seeds: the batched backend (kernels/batched/mla.py: absorbed
decode, sparse selections, expanded prefill) in-process, the Triton kernel (kernels/triton/mla.py)
in Triton's CPU interpreter in a fresh process (see check_triton), and the Triton lightning
and pooled (KPool) indexers (kernels/triton/indexer.py) against the reference `dsa_scores` /
`dsa_index` / `kpool_scores` / `kpool_index` there too, and their top-k's radix select
(kernels/triton/topk.py) against the reference `index_topk` on scores full of exact ties.

Each step mixes decode rows, prefill chunks with a cached prefix and fresh prompts, on shuffled
blocks of a strided cache view (as the pool's rows are); with RoPE keys and fully NoPE (Dr = 0);
dense and with a top-k selection below the context (random positions, some unused (-1), some
after the query (causal), in random order, queries that select nothing: 0). fp32 tolerance: 1e-5
of the output's scale (the same numbers summed in another order; measured up to 6e-7). bf16 is
judged against the fp32 reference, next to the reference's own bf16 error.

Memory: a 2,048-token chunk against 8,192 cached keys with top-k 256 (the reference's mask alone
would be [2048, 256, 8192] booleans, 4.3 GB) peaks within MEMORY_BUDGET on the CPU allocator
(torch's profiler, every allocation and free in order).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools

import pytest
import torch
from conftest import SEEDS
from interpreter import main, run_checks
from paged_meta import paged_meta, selection

from dayzero.kernels.batched import mla as batched
from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.reference.mla import mla_attention as reference

TOL = 1e-5
MEMORY_BUDGET = 128 << 20
# decode, a chunk after a prefix, a fresh prompt, a row with no token this step, decode, a chunk
MIXED = [(1, 13), (7, 9), (5, 5), (0, 8), (1, 40), (16, 36)]
STEPS = {"mixed": MIXED, "fresh": [(12, 12)], "decode": [(1, 5), (1, 30), (0, 9), (1, 17)]}


def inputs(g: torch.Generator, rows, h: int = 3, dn: int = 8, dr: int = 4, dv: int = 12, lat: int = 16):
    """(q_nope, q_rope, cache, w_k, w_v, meta): block size 4, the cache a strided [N, L + Dr] view."""
    meta, blocks = paged_meta(rows, 4, g)
    t = sum(n for n, _ in rows)
    qn, qr = torch.randn(t, h, dn, generator=g), torch.randn(t, h, dr, generator=g)
    cache = torch.randn(blocks * 4, lat + dr + 5, generator=g)[:, : lat + dr]
    w = torch.randn(h, dn + dv, lat, generator=g) / lat**0.5
    return qn, qr, cache, w[:, :dn], w[:, dn:], meta


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("step", sorted(STEPS))
@pytest.mark.parametrize("rope_dim", [4, 0], ids=["rope", "nope"])
def test_batched_matches_reference(seed: int, step: str, rope_dim: int) -> None:
    g = torch.Generator().manual_seed(seed)
    args = inputs(g, STEPS[step], dr=rope_dim)
    assert _err(batched.mla_attention(*args, 0.3), reference(*args, 0.3)) < TOL
    for k in (6, 3):  # two selections on one step: the memoised layout is the current one's
        sel = selection(g, args[-1], k)
        want, got = reference(*args, 0.3, sel), batched.mla_attention(*args, 0.3, sel)
        assert _err(got, want) < TOL
        none = want.abs().amax((1, 2)) == 0  # queries whose selection allows no key
        assert none[-1] and got[none].abs().max() == 0


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_batched_bf16_is_as_close_as_the_reference(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    args = inputs(g, MIXED)
    low = [a.bfloat16() if torch.is_tensor(a) and a.is_floating_point() else a for a in args]
    sel = selection(g, args[-1], 6)
    for s in (None, sel):
        want = reference(*args, 0.3, s)
        ours, theirs = _err(batched.mla_attention(*low, 0.3, s), want), _err(reference(*low, 0.3, s), want)
        assert ours <= 2 * theirs + 1e-3, (ours, theirs)


def _peak_bytes(fn) -> tuple[int, object]:
    """Peak of the CPU allocator's live bytes while fn runs: every op's own allocations and the
    frees, in time order (torch.profiler with profile_memory)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return max(itertools.accumulate(e.self_cpu_memory_usage for e in events)), out


def test_sparse_memory_is_tokens_times_topk() -> None:
    """A 2,048-token chunk after 6,144 cached tokens (8,192 keys), top-k 256, two heads: peak
    within MEMORY_BUDGET; three of its queries against the reference run as one-token rows."""
    g = torch.Generator().manual_seed(SEEDS[0])
    n, kv, topk, h, dn, dr, lat = 2048, 8192, 256, 2, 16, 8, 32
    qn, qr, cache, w_k, w_v, meta = inputs(g, [(n, kv)], h=h, dn=dn, dr=dr, dv=16, lat=lat)
    pos = meta.positions
    back = torch.rand(n, kv, generator=g).argsort(-1)[:, :topk]  # [n, topk] distinct
    sel = torch.where(back <= pos[:, None], pos[:, None] - back, -1)  # distinct positions <= p_t
    peak, out = _peak_bytes(lambda: batched.mla_attention(qn, qr, cache, w_k, w_v, meta, 0.3, sel))
    print(f"sparse MLA peak {peak / 2**20:.1f} MiB (budget {MEMORY_BUDGET >> 20} MiB)")
    assert peak < MEMORY_BUDGET
    assert batched.token_chunk(topk, lat + dr, h) * topk * (2 * (lat + dr) + 3 * h) * 4 <= batched.CHUNK_BYTES
    for t in (0, 1000, n - 1):  # one query at position p_t, the same cached keys and selection
        one = PagedMeta(
            torch.tensor([0, 1]), pos[t : t + 1] + 1, pos[t : t + 1], meta.block_table, meta.slots[t : t + 1],
            meta.block_size, (0, 1), (int(pos[t]) + 1,),
        )  # fmt: skip
        want = reference(qn[t : t + 1], qr[t : t + 1], cache, w_k, w_v, one, 0.3, sel[t : t + 1])
        assert _err(out[t : t + 1], want) < TOL


def test_batched_is_selected_over_the_reference_on_cpu() -> None:
    from dayzero.kernels.selection import Need, select

    need = Need("mla_attention", frozenset({"causal", "select"}))
    assert select(need, torch.device("cpu"), torch.float32).backend == "batched"


def check_triton(seed: int) -> list[str]:
    """The Triton kernel (kernels/triton/mla.py) in the interpreter: one line per case, the
    error last. Decode-only steps and a mixed one (decode rows here, prefill rows through the
    batched expanded form; with a selection every token is a program), RoPE and NoPE, 5 heads
    (one padded head group), keys split over 1 and 3 programs; long rows over several key tiles,
    dense and selected, split with one tile a split and with four (a short row's later splits
    empty)."""
    from dayzero.kernels.triton import mla

    g = torch.Generator().manual_seed(seed)
    out = []
    for dr in (4, 0):
        for step in ("decode", "mixed"):
            args = inputs(g, STEPS[step], h=5, dr=dr)
            sel = selection(g, args[-1], 6)
            for s in (None, sel):
                want = reference(*args, 0.3, s)
                for splits in (1, 3):
                    got = mla.mla_attention(*args, 0.3, s, splits=splits)
                    out.append(
                        f"triton {step} dr={dr} select={s is not None} splits={splits} {_err(got, want):.2e}"
                    )
    args = inputs(g, [(1, 300), (1, 70)], h=2, dr=4)  # key tiles of 64
    sel = selection(g, args[-1], 150)  # three key tiles of selected positions
    for s in (None, sel):
        want = reference(*args, 0.3, s)
        for splits, tiles in ((3, 1), (4, 4)):
            got = mla.mla_attention(*args, 0.3, s, splits=splits, min_split_tiles=tiles)
            out.append(
                f"triton long rows select={s is not None} splits={splits} tiles={tiles} {_err(got, want):.2e}"
            )
    return out + check_indexer(g) + check_topk(g)


def topk_scores(g: torch.Generator, t: int, n: int, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [t, n], positions [t]): integers 0..3 (ties everywhere) or normal draws with a
    fifth set to +0 and another to -0 (ReLU's zeros, equal as floats), a third -inf; positions
    from 0 to 2n (rows that see part of the columns, and all of them)."""
    if ties:
        s = torch.randint(0, 4, (t, n), generator=g).float()
    else:
        s = torch.randn(t, n, generator=g)
        zero = torch.rand(t, n, generator=g)
        s[zero < 0.2], s[zero > 0.8] = 0.0, -0.0
    s[torch.rand(t, n, generator=g) < 0.3] = float("-inf")
    return s, torch.randint(0, 2 * n, (t,), generator=g)


def check_topk(g: torch.Generator) -> list[str]:
    """index_topk's radix select against the reference, exact: one row block (40 columns) and
    two (1,500), single keys and pools of 4 with and without the tail, k from 4 (several radix
    passes) to past the visible columns (all taken). The last field: positions that differ."""
    from dayzero.kernels.reference.mla import index_topk as ref
    from dayzero.kernels.triton.topk import index_topk

    out = []
    for n, ties in ((40, False), (1500, True), (1500, False)):
        s, pos = topk_scores(g, 7, n, ties)
        for pool, tail in ((1, False), (4, True), (4, False)):
            bad = sum(
                int((ref(s, pos, k, pool, tail) != index_topk(s, pos, k, pool, tail)).sum())
                for k in (4, 64, 2048)
            )
            out.append(f"triton topk n={n} ties={ties} pool={pool} tail={tail} {bad:.2e}")
    return out


def indexer_inputs(g: torch.Generator, rows, hi: int, di: int, pool: int = 0):
    """(q [T, Hi, Di], weights [T, Hi], cache, meta) for DSA (pool 0: the cache a strided [N, Di]
    view of index keys) or (q, weights, cache, ape [P, Di], meta) for KPool (a [N, 2 Di] view of
    keys and pooling gates)."""
    meta, blocks = paged_meta(rows, 4, g)
    t = meta.positions.shape[0]
    q, w = torch.randn(t, hi, di, generator=g), torch.rand(t, hi, generator=g)
    width = di * (2 if pool else 1)
    cache = torch.randn(blocks * 4, width + 3, generator=g)[:, :width]
    if not pool:
        return q, w, cache, meta
    return q, w, cache, torch.randn(pool, di, generator=g), meta


def indexer_errors(args, topks=(6, 64), pool: int = 0, tail: bool = True, indexer=None) -> tuple[float, bool]:
    """The Triton (or another fixed-width) indexer's scores against the reference's (relative to
    their scale; the columns past the reference's width must be -inf, and the -inf pattern
    equal), and whether every top-k selection is the reference's set (DSA, or KPool with `pool`
    keys a pool)."""
    from dayzero.kernels.reference import mla as ref

    if indexer is None:
        from dayzero.kernels.triton import indexer

    if pool:
        want = ref.kpool_scores(*args, pool, 0.2).cpu()
        got = indexer.kpool_scores(*args, pool, 0.2).cpu()
        pick = [
            (ref.kpool_index(*args, k, pool, 0.2, tail), indexer.kpool_index(*args, k, pool, 0.2, tail))
            for k in topks
        ]
    else:
        want, got = ref.dsa_scores(*args, 0.2).cpu(), indexer.dsa_scores(*args, 0.2).cpu()
        pick = [(ref.dsa_index(*args, k, 0.2), indexer.dsa_index(*args, k, 0.2)) for k in topks]
    width = want.shape[1]
    assert (got[:, width:] == float("-inf")).all()
    seen = torch.isfinite(want)
    assert torch.equal(seen, torch.isfinite(got[:, :width]))
    err = _err(got[:, :width][seen], want[seen]) if seen.any() else 0.0
    same = all(torch.equal(a.sort(-1).values, b.sort(-1).values) for a, b in pick)
    return err, same


def check_indexer(g: torch.Generator) -> list[str]:
    """The indexers in the interpreter: decode-only and mixed steps, 5 heads of 24 (padded to
    16 x 32), and long rows over several 64-key / 16-pool tiles; scores and top-k selections
    (DSA top-6 / top-64; KPool pools of 4 (one block) and 8 (two blocks) with and without the
    tail, top-8 / top-64 positions)."""
    out = []
    for step, rows in (("decode", STEPS["decode"]), ("mixed", MIXED), ("long", [(1, 300), (2, 70)])):
        err, same = indexer_errors(indexer_inputs(g, rows, 5, 24))
        out.append(f"triton indexer dsa {step} same-selection={same} {err if same else 1.0:.2e}")
        for pool, tail in ((4, True), (8, False)):
            err, same = indexer_errors(indexer_inputs(g, rows, 5, 24, pool), (8, 64), pool, tail)
            out.append(f"triton indexer kpool={pool} {step} same-selection={same} {err if same else 1.0:.2e}")
    return out


def _widened(meta: PagedMeta, g: torch.Generator, extra: int, blocks: int) -> PagedMeta:
    """meta with `extra` more block-table columns holding stale block ids or -1 (what a CUDA
    graph's table [B, max blocks] holds past a row's blocks)."""
    stale = torch.randint(-1, blocks, (meta.block_table.shape[0], extra), generator=g)
    return dataclasses.replace(meta, block_table=torch.cat((meta.block_table, stale), dim=1), memo={})


@pytest.mark.parametrize("seed", SEEDS)
def test_batched_indexer_matches_reference_at_any_width(seed: int) -> None:
    """kernels/batched/indexer.py (graph-safe, scores over the block table's width) against the
    reference's scores (fp32, relative 1e-5, -inf past the reference's width) and selections
    (the same sets: DSA top-6 / top-64, KPool pools of 4 and 8 with and without the tail) on
    decode, mixed and long steps; then with the table widened by 9 columns of stale block ids
    or -1 (a graph's width): the same selections, tensor for tensor."""
    from dayzero.kernels.batched import indexer

    g = torch.Generator().manual_seed(seed)
    for rows in (STEPS["decode"], MIXED, [(1, 300), (2, 70)]):
        for pool, tail, topks in ((0, True, (6, 64)), (4, True, (8, 64)), (8, False, (8, 64))):
            args = indexer_inputs(g, rows, 5, 24, pool)
            err, same = indexer_errors(args, topks, pool, tail, indexer)
            assert same and err < TOL, (rows, pool, err)
            meta = args[-1]
            blocks = int(meta.block_table.max()) + 1
            wide = (*args[:-1], _widened(meta, g, 9, blocks))
            for k in topks:
                if pool:
                    a = indexer.kpool_index(*args, k, pool, 0.2, tail)
                    b = indexer.kpool_index(*wide, k, pool, 0.2, tail)
                else:
                    a, b = indexer.dsa_index(*args, k, 0.2), indexer.dsa_index(*wide, k, 0.2)
                assert torch.equal(a, b), (rows, pool, k)


@pytest.mark.parametrize("seed", SEEDS)
def test_index_topk_breaks_ties_by_position_at_any_width(seed: int) -> None:
    """index_topk on scores with many exact ties (integers 0..3, a third of them -inf) equals its
    definition (a stable sort by score, best first: ties to the lowest positions; the chosen
    positions in increasing order, -1 padded), and appending 40 columns of -inf changes nothing."""
    from dayzero.kernels.reference.mla import index_topk

    g = torch.Generator().manual_seed(seed)
    t, n = 12, 30
    scores = torch.randint(0, 4, (t, n), generator=g).float()
    scores[torch.rand(t, n, generator=g) < 0.3] = float("-inf")
    positions = torch.full((t,), n - 1)
    for k in (1, 5, 13, 40):
        got = index_topk(scores, positions, k)
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        keep = torch.isfinite(scores.gather(1, order))
        want = torch.where(keep, order, n).sort(-1).values
        want = torch.nn.functional.pad(torch.where(want < n, want, -1), (0, k - want.shape[1]), value=-1)
        assert torch.equal(got, want), k
        wide = torch.cat((scores, torch.full((t, 40), float("-inf"))), dim=1)
        assert torch.equal(index_topk(wide, positions, k), got), k


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("seed", SEEDS[:2])
def test_triton_matches_reference_in_the_interpreter(seed: int) -> None:
    """In a fresh process: the interpreter must be chosen before Triton compiles anything."""
    lines = [ln for ln in run_checks(__file__, seed, timeout=300) if ln.startswith("triton ")]
    assert len(lines) == 2 * 2 * 2 * 2 + 2 * 2 + 3 * 3 + 3 * 3, lines
    for ln in lines:
        assert float(ln.split()[-1]) < TOL, ln


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference_on_cuda(dtype: torch.dtype) -> None:
    """Compiled on the GPU at GLM-5.3's latent widths (L 512, Dr 64; 16 heads), decode rows and a
    mixed step, dense and selected, default splits: fp32 within TOL, bf16 within 2e-2 of the fp32
    reference's scale (kernels/triton/mla.py)."""
    from dayzero.kernels.triton import mla

    g = torch.Generator().manual_seed(SEEDS[0])
    for step in ([(1, 700), (1, 90), (1, 2000)], MIXED):
        args = inputs(g, step, h=16, dn=128, dr=64, dv=128, lat=512)
        sel = selection(g, args[-1], 256)
        for s in (None, sel):
            want = reference(*args, 0.1, s)
            dev = [a.cuda() if torch.is_tensor(a) else a for a in args]
            dev = [a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in dev]
            fields = ("query_start", "kv_lens", "positions", "block_table", "slots")
            meta = dataclasses.replace(args[-1], memo={}, **{f: getattr(args[-1], f).cuda() for f in fields})
            got = mla.mla_attention(*dev[:-1], meta, 0.1, None if s is None else s.cuda()).cpu()
            assert _err(got, want) < (TOL if dtype == torch.float32 else 2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_indexer_on_cuda(dtype: torch.dtype) -> None:
    """Compiled on the GPU at GLM-5.3's indexer widths (32 heads of 128), DSA and KPool (pools of
    16): fp32 within TOL with the reference's selections; bf16 within 1e-2 (DSA: both sum the
    same exact bf16 products in fp32; KPool: the reference rounds the pool's softmax and its
    weighted keys to bf16, the kernel keeps them fp32 until the dot; a near-tie may then swap a
    selected position)."""
    g = torch.Generator().manual_seed(SEEDS[0])
    fields = ("query_start", "kv_lens", "positions", "block_table", "slots")
    for pool in (0, 16):
        *x, meta = indexer_inputs(g, [(1, 700), (1, 90), (3, 40), (1, 2000)], 32, 128, pool)
        meta = dataclasses.replace(meta, memo={}, **{f: getattr(meta, f).cuda() for f in fields})
        x = [a.cuda().to(dtype) if i != 1 else a.cuda() for i, a in enumerate(x)]  # weights stay fp32
        err, same = indexer_errors((*x, meta), topks=(256,), pool=pool)
        assert err < (TOL if dtype == torch.float32 else 1e-2), (pool, err)
        assert same or dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_topk_on_cuda() -> None:
    """Compiled on the GPU at GLM-5.3's top-k (2,048) over rows of up to 12,000 columns (several
    1,024-column blocks, all four radix passes), ties and zeros of both signs: the reference's
    positions exactly; QSA-like pools of 16 with the tail too."""
    from dayzero.kernels.reference.mla import index_topk as ref
    from dayzero.kernels.triton.topk import index_topk

    g = torch.Generator().manual_seed(SEEDS[0])
    for ties in (True, False):
        s, pos = topk_scores(g, 64, 6000, ties)
        for k, pool, tail in ((2048, 1, False), (256, 1, False), (4096, 16, True)):
            want = ref(s, pos, k, pool, tail)
            assert torch.equal(index_topk(s.cuda(), pos.cuda(), k, pool, tail).cpu(), want), (ties, k, pool)


if __name__ == "__main__":
    main(check_triton)
