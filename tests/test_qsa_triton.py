"""QSA's two kernels in Triton against the reference ops, in Triton's CPU interpreter in a fresh
process (and on a GPU where one is present).

Sparse GQA attention over an indexer's selection (kernels/triton/select_attention.py), with the
reference's selection: a mixed step (decode rows, a chunk after a prefix, a fresh prompt, a row
with no token) with 4 query heads on 2 kv heads of 16, plain, windowed, soft-capped and with
sinks, the selection's columns in 1 and 3 splits; a decode step, and 6 heads on 2 of 24 (G = 3,
D not a power of two), plain and with sinks. Distinct random positions (an indexer's contract)
with -1, positions past the query and past the row; fp32 within 1e-5 of the output scale; a
token that reads no key gives zeros. No selection: the paged kernel's dense attention.

The QSA indexer's scores (kernels/triton/indexer.py `qsa_scores`) over the block table's width
(as a CUDA graph holds it, widened by 5 columns of stale block ids or -1): mixed, decode and
long rows, blocks of 4 (one cache block) and 8 (two), no RoPE, rotate-half and GPT-J RoPE on
half of 12 channels (a head width not a power of two), a strided cache view: the reference's
-inf pattern, -inf past its width, finite scores within 1e-5 relative.

On a GPU: QSA's decode widths (16 heads on 2 of 256, 2,111 selected of up to 4,096) in bf16,
within twice the reference's own bf16 error + 1e-3, and fp32 within 1e-5; the scores at Flash-
Next's widths (16 index heads of 256, blocks of 64) in bf16 the same way."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
from interpreter import main, run_checks
from paged_meta import paged_meta, selection

SEEDS = (0, 7)  # two recorded seeds, as the other interpreter checks (each ~75 s in the interpreter)
EPS = 1e-6
TOL = 1e-5
ROWS = [(1, 13), (7, 9), (5, 5), (0, 8), (1, 40), (16, 36)]
DECODE = [(1, 5), (1, 30), (0, 9), (1, 17)]
VARIANTS = [
    (None, None, False),
    (6, None, False),
    (None, 20.0, False),
    (None, None, True),
]  # window, cap, sinks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def check(seed: int) -> list[str]:
    from dayzero.kernels.reference.attention import gqa_attention as reference
    from dayzero.kernels.triton.select_attention import gqa_attention_select

    g, out = torch.Generator().manual_seed(seed), []
    every = [(w, c, s, n) for w, c, s in VARIANTS for n in (1, 3)]
    for rows, (h, hk, d), cases in (
        (ROWS, (4, 2, 16), every),
        (DECODE, (4, 2, 16), [(None, None, False, 3), (None, None, True, 3)]),
        (ROWS, (6, 2, 24), [(None, None, False, 1), (None, None, True, 3)]),
    ):
        meta, blocks = paged_meta(rows, 4, g)
        t = meta.positions.shape[0]
        q = torch.randn(t, h, d + 2, generator=g)[..., :d]  # a strided view, as a fused projection's
        k, v = torch.randn(blocks * 4, hk, d, generator=g), torch.randn(blocks * 4, hk, d, generator=g)
        sel = selection(g, meta, 24)
        sinks = torch.randn(h, generator=g)
        for window, cap, with_sinks, splits in cases:
            sink = sinks if with_sinks else None
            want = reference(q, k, v, meta, 0.3, window, cap, sink, sel)
            fine = torch.isfinite(want).all(-1).all(-1)  # tokens that read at least one key
            meta.memo.clear()
            got = gqa_attention_select(q, k, v, meta, 0.3, window, cap, sink, sel, splits=splits)
            zeros = bool((got[~fine] == 0).all() and (got[-1] == 0).all())
            err = _rel(got[fine], want[fine])
            out.append(f"select h={h}/{hk} d={d} w={window} cap={cap} sinks={with_sinks} "
                       f"splits={splits} zeros={zeros} {err:.2e}")  # fmt: skip
    meta, blocks = paged_meta(ROWS, 4, g)
    t = meta.positions.shape[0]
    q = torch.randn(t, 4, 16, generator=g)
    k, v = torch.randn(blocks * 4, 2, 16, generator=g), torch.randn(blocks * 4, 2, 16, generator=g)
    err = _rel(gqa_attention_select(q, k, v, meta, 0.3), reference(q, k, v, meta, 0.3))
    out.append(f"dense zeros=True {err:.2e}")
    return out + _scores(g)


def _scores(g: torch.Generator) -> list[str]:
    from dayzero.kernels.reference.qsa import qsa_scores as reference
    from dayzero.kernels.triton.indexer import qsa_scores

    out, hi, di = [], 4, 12
    w = 1 + 0.1 * torch.randn(di, generator=g)
    inv = 1.0 / 10000 ** (torch.arange(di // 4) / (di // 4))  # RoPE on 6 of the 12 channels
    for rows in (ROWS, DECODE, [(1, 70), (3, 41)]):
        meta, blocks = paged_meta(rows, 4, g)
        q = torch.randn(meta.positions.shape[0], hi, di, generator=g)
        cache = torch.randn(blocks * 4, di + 3, generator=g)[:, :di]  # a strided view, as the cache is
        stale = torch.randint(-1, blocks, (meta.block_table.shape[0], 5), generator=g)
        wide = replace(meta, block_table=torch.cat((meta.block_table, stale), dim=1), memo={})
        for pool, freq, neox in ((4, None, True), (8, inv, True), (4, inv, False)):
            want = reference(q, cache, w, EPS, freq, neox, meta, pool, di**-0.5)
            got = qsa_scores(q, cache, w, EPS, freq, neox, wide, pool, di**-0.5)
            n, seen = want.shape[1], torch.isfinite(want)
            same = bool(torch.equal(seen, torch.isfinite(got[:, :n])) and (got[:, n:] == float("-inf")).all())
            err = _rel(got[:, :n][seen], want[seen]) if seen.any() else 0.0
            out.append(f"qsa pool={pool} rope={freq is not None} neox={neox} same_inf={same} {err:.2e}")
    return out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("seed", SEEDS)
def test_triton_qsa_kernels_in_the_interpreter(seed: int) -> None:
    lines = run_checks(__file__, seed)
    assert len(lines) == 8 + 2 + 2 + 1 + 9, lines
    for ln in lines:  # zeros where no key is read; the reference's -inf pattern for the scores
        assert ("zeros=True" in ln or "same_inf=True" in ln) and float(ln.split()[-1]) <= TOL, ln


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seed", [0, 1])
def test_triton_select_attention_on_cuda(seed: int) -> None:
    from dayzero.kernels.reference.attention import gqa_attention as reference
    from dayzero.kernels.triton.select_attention import gqa_attention_select

    cuda = torch.device("cuda")
    g = torch.Generator().manual_seed(seed)
    h, hk, d, bs = 16, 2, 256, 64
    meta, blocks = paged_meta([(1, 4096), (1, 700), (1, 3000)], bs, g, device=cuda)
    q = torch.randn(3, h, d, generator=g).to(cuda)
    k, v = (torch.randn(blocks * bs, hk, d, generator=g).to(cuda) for _ in range(2))
    sel = selection(g, meta, 2111).to(cuda)
    want = reference(q, k, v, meta, d**-0.5, None, None, None, sel)
    fine = torch.isfinite(want).all(-1).all(-1)
    b16 = [x.bfloat16() for x in (q, k, v)]
    own = _rel(reference(*b16, meta, d**-0.5, None, None, None, sel)[fine], want[fine])
    got = gqa_attention_select(*b16, meta, d**-0.5, select=sel)
    assert _rel(got[fine], want[fine]) <= 2 * own + 1e-3 and (got[~fine] == 0).all()
    meta.memo.clear()
    fp32 = gqa_attention_select(q, k, v, meta, d**-0.5, select=sel)
    assert _rel(fp32[fine], want[fine]) <= TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_qsa_scores_on_cuda() -> None:
    from dayzero.kernels.reference.qsa import qsa_scores as reference
    from dayzero.kernels.triton.indexer import qsa_scores

    cuda = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    hi, di, pool = 16, 256, 64
    meta, blocks = paged_meta([(1, 4096), (1, 700), (5, 3000)], 64, g, device=cuda)
    q = torch.randn(meta.positions.shape[0], hi, di, generator=g).to(cuda)
    cache = torch.randn(blocks * 64, di, generator=g).to(cuda)
    w = (1 + 0.1 * torch.randn(di, generator=g)).to(cuda)
    inv = (1.0 / 10000 ** (torch.arange(di // 4) / (di // 4))).to(cuda)
    want = reference(q, cache, w, EPS, inv, True, meta, pool, di**-0.5)
    seen = torch.isfinite(want)
    own = _rel(
        reference(q.bfloat16(), cache.bfloat16(), w, EPS, inv, True, meta, pool, di**-0.5)[seen], want[seen]
    )
    got = qsa_scores(q.bfloat16(), cache.bfloat16(), w, EPS, inv, True, meta, pool, di**-0.5)
    n = want.shape[1]
    assert torch.equal(seen, torch.isfinite(got[:, :n])) and (got[:, n:] == float("-inf")).all()
    assert _rel(got[:, :n][seen], want[seen]) <= 2 * own + 1e-3
    fp32 = qsa_scores(q, cache, w, EPS, inv, True, meta, pool, di**-0.5)
    assert _rel(fp32[:, :n][seen], want[seen]) <= TOL


if __name__ == "__main__":
    main(check)
