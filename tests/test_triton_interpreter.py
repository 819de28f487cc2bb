"""The Triton kernels run in Triton's CPU interpreter against the reference backend, so CI checks
their indexing without a GPU: the packed-weight GEMMs (kernels/triton/packed.py: both paths, one
row a program and tensor-core tiles with experts sorted and padded, every format), paged
attention (kernels/triton/attention.py: decode rows, prefill chunks longer than a query tile and
a fresh prompt in one step, GQA groups of 3 and 1, head sizes 24 and 32 (padded tiles), sliding
windows, softcaps, attention sinks, a freed block before the window, keys split over 1 and 3
programs), the stacked experts (kernels/triton/moe.py: the decode GEMVs and the sorted-pair
tensor-core tiles, with the gated activations and expert biases; expert id -1 (no expert) in
both, dense and packed), RMSNorm, RoPE and the splits'
merge (kernels/triton/norm.py, attention.py), the fused small ops (the q/k norm + RoPE + K/V
write among them, the gated activations), MoE routing and the greedy sampler
(kernels/triton/fused.py, routing.py, sampling.py; see check_fused), the dense decode GEMV
(kernels/triton/linear.py). fp32 activations (the
interpreter emulates bf16 wrongly in general). Tolerance 1e-5 of the output scale: the same fp32
numbers, summed in another order. The one exception, rows named `bf16`: the packed decode GEMV's
fp16 path (bf16 x, fp16 sums of 16 products, bf16 out) against the reference's bf16 weights,
2e-2 of the output scale (a few bf16 ulps; measured about 7e-3). The interpreter must be chosen
before Triton compiles anything, so the check runs in a fresh process."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from interpreter import main, run_checks
from paged_meta import paged_meta

SEEDS = (0, 3)


def check_attention(g: torch.Generator) -> list[str]:
    from dayzero.kernels.reference.attention import gqa_attention as reference
    from dayzero.kernels.triton import attention

    out = []
    for h, hk, d in ((6, 2, 24), (4, 4, 32)):
        rows = [(1, 13), (7, 9), (5, 5), (1, 40)]  # decode, a chunk of 2 query tiles, a fresh prompt, decode
        t, bs, blocks = sum(n for n, _ in rows), 4, 40
        q = torch.randn(t, h, d, generator=g)
        kc, vc = torch.randn(blocks * bs, hk, d, generator=g), torch.randn(blocks * bs, hk, d, generator=g)
        for window, cap in ((None, None), (6, None), (None, 3.0), (6, 2.0)):
            meta, _ = paged_meta(
                rows, bs, g, blocks, freed=8 if window else 0
            )  # keys 0..31: before the window
            want = reference(q, kc, vc, meta, 0.3, window, cap)
            for splits in (1, 3):
                got = attention.gqa_attention(q, kc, vc, meta, 0.3, window, cap, splits=splits)
                err = (got - want).abs().max() / want.abs().max()
                out.append(
                    f"attention h={h} hk={hk} d={d} window={window} cap={cap} splits={splits} {err:.2e}"
                )
        sinks = torch.randn(h, generator=g) * 2  # per-head logits joining the softmax (gpt-oss)
        for window, cap in ((None, None), (6, 2.0)):
            meta, _ = paged_meta(rows, bs, g, blocks, freed=8 if window else 0)
            want = reference(q, kc, vc, meta, 0.3, window, cap, sinks)
            for splits in (1, 3):
                got = attention.gqa_attention(q, kc, vc, meta, 0.3, window, cap, sinks, splits=splits)
                err = (got - want).abs().max() / want.abs().max()
                out.append(f"attention sinks h={h} d={d} window={window} cap={cap} splits={splits} {err:.2e}")
    # decode rows longer than a key tile (128 at decode): the splits each see keys and are merged; with the
    # default minimum of key tiles a split, the short row leaves its later splits empty
    h, hk, d, rows = 4, 2, 16, [(1, 300), (1, 70)]
    meta, blocks = paged_meta(rows, 16, g)
    q = torch.randn(2, h, d, generator=g)
    kc, vc = torch.randn(blocks * 16, hk, d, generator=g), torch.randn(blocks * 16, hk, d, generator=g)
    for window in (None, 200):
        want = reference(q, kc, vc, meta, 0.3, window, None)
        for splits, tiles in ((3, 1), (5, 1), (4, 4)):
            got = attention.gqa_attention(q, kc, vc, meta, 0.3, window, splits=splits, min_split_tiles=tiles)
            err = (got - want).abs().max() / want.abs().max()
            out.append(f"attention long rows window={window} splits={splits} min tiles={tiles} {err:.2e}")
    sinks = torch.randn(h, generator=g)  # a sink counted once over 5 splits (two of them empty)
    want = reference(q, kc, vc, meta, 0.3, None, None, sinks)
    got = attention.gqa_attention(q, kc, vc, meta, 0.3, None, None, sinks, splits=5)
    out.append(f"attention long rows sinks splits=5 {((got - want).abs().max() / want.abs().max()):.2e}")
    return out


def check_moe(g: torch.Generator) -> list[str]:
    from dayzero.kernels.reference.moe import moe_experts as reference
    from dayzero.kernels.triton import moe

    out = []
    for t in (1, 3, 20):  # 2, 6 pairs of 8 experts: the GEMVs; 40: sorted pairs, tensor-core tiles
        x = torch.randn(t, 96, generator=g)
        up, down = (
            torch.randn(8, 80, 96, generator=g) / 96**0.5,
            torch.randn(8, 96, 40, generator=g) / 40**0.5,
        )
        ids, wts = torch.rand(t, 8, generator=g).topk(2, dim=-1).indices, torch.rand(t, 2, generator=g)
        for fp32, limit in ((False, None), (True, 0.7)):
            want = reference(x, up, down, wts, ids, fp32, limit)
            err = (moe.moe_experts(x, up, down, wts, ids, fp32, limit) - want).abs().max() / want.abs().max()
            out.append(f"moe t={t} fp32={fp32} limit={limit} {err:.2e}")
        gub, db = torch.randn(8, 80, generator=g), torch.randn(8, 96, generator=g)  # expert biases
        for act, consts in (
            ("gelu_pytorch_tanh", (0.0, 0.0)),
            ("clamped_swiglu", (1.702, 0.0)),
            ("situ", (4.0, 25.0)),
        ):
            limit = 0.7 if act == "clamped_swiglu" else None
            args = (x, up, down, wts, ids, False, limit, act, consts, gub, db)
            err = (moe.moe_experts(*args) - reference(*args)).abs().max() / reference(*args).abs().max()
            out.append(f"moe t={t} act={act} biases {err:.2e}")
    return out


def check_moe_skip(g: torch.Generator) -> list[str]:
    """Expert id -1 (no expert: an expert-parallel rank's pick of another rank's expert): rank r
    of 2 runs its 4 of 8 experts with the others' picks -1, against the reference over all 8
    experts with those picks weighed 0 (the full result restricted to rank r's experts); the
    GEMVs (6 pairs) and the sorted-pair tiles (40 pairs)."""
    from dayzero.kernels.reference.moe import moe_experts as reference
    from dayzero.kernels.triton import moe

    out = []
    for t in (3, 20):
        x = torch.randn(t, 96, generator=g)
        up = torch.randn(8, 80, 96, generator=g) / 96**0.5  # [E, 2I, Dm]
        down = torch.randn(8, 96, 40, generator=g) / 40**0.5  # [E, Dm, I]
        ids, wts = torch.rand(t, 8, generator=g).topk(2, dim=-1).indices, torch.rand(t, 2, generator=g)
        ids[0] = torch.tensor([1, 6])  # a pick on each rank at least
        for r in (0, 1):
            mine = ids // 4 == r  # [T, 2]
            want = reference(x, up, down, torch.where(mine, wts, 0.0), ids)
            local = torch.where(mine, ids - 4 * r, -1)
            got = moe.moe_experts(x, up[4 * r : 4 * r + 4], down[4 * r : 4 * r + 4], wts, local)
            out.append(f"moe skip t={t} rank={r} {_rel(got, want):.2e}")
    return out


def check_norm(g: torch.Generator) -> list[str]:
    """RMSNorm (both weight orders, [T, D] and [T, H, D], a weight a head), RoPE (neox and
    interleaved, full and partial, on a strided view), the attention splits' merge (a query no
    split saw gives 0)."""
    from dayzero.kernels.reference import basic
    from dayzero.kernels.triton import attention, fused, norm

    out = []
    for shape in ((5, 24), (3, 4, 32)):
        x, w = torch.randn(*shape, generator=g), torch.randn(shape[-1], generator=g)
        for fp32 in (False, True):
            want = basic.rms_norm(x, w, 1e-6, fp32)
            err = (norm.rms_norm(x, w, 1e-6, fp32) - want).abs().max() / want.abs().max()
            out.append(f"rms_norm {shape} weight_in_fp32={fp32} {err:.2e}")
    x = torch.randn(2, 5, 3, 24, generator=g)[:, :, :, :16]  # strided, one more leading dim
    w = torch.randn(3, 16, generator=g)  # a weight a stream (low-rank hyper-connections)
    for fp32 in (False, True):
        want = basic.rms_norm(x, w, 1e-6, fp32)
        err = (norm.rms_norm(x, w, 1e-6, fp32) - want).abs().max() / want.abs().max()
        out.append(f"rms_norm per head weight_in_fp32={fp32} {err:.2e}")
    x = torch.randn(7, 3, 40, generator=g)[:, :, :32]  # a q-like view: rows strided
    pos = torch.randint(0, 500, (7,), generator=g)
    for half in (16, 12, 5):  # 12, 5: partial rotary dims, 5 not a power of 2
        inv = 1.0 / (10000 ** (torch.arange(half) / half))
        for neox in (True, False):
            want = basic.rope(x, pos, inv, neox)
            err = (fused.rope(x, pos, inv, neox) - want).abs().max() / want.abs().max()
            out.append(f"rope half={half} neox={neox} {err:.2e}")
    o, lse = torch.randn(4, 3, 5, 24, generator=g), torch.randn(4, 3, 5, generator=g)
    lse[0, 0], lse[1, 1, 2] = float("-inf"), float("-inf")
    total = torch.logsumexp(lse, -1, keepdim=True)
    w = torch.exp(lse - torch.where(torch.isinf(total), 0.0, total)).nan_to_num(0.0)
    want = (o * w[..., None]).sum(2)
    out.append(
        f"merge {((attention._merge(o, lse, torch.float32) - want).abs().max() / want.abs().max()):.2e}"
    )
    return out


def check_linear(g: torch.Generator) -> list[str]:
    """The dense decode GEMV (kernels/triton/linear.py): 1-2 rows, with and without a bias, at
    the default geometry and at one row / a 16-wide reduction tile a program (K = 100: ragged
    tiles), and a bf16 x against fp32 weights (exact: x widened); 3 rows take F.linear."""
    from dayzero.kernels.triton import linear

    out = []
    w, b = torch.randn(37, 100, generator=g) / 10, torch.randn(37, generator=g)
    for m in (1, 2, 3):
        x = torch.randn(m, 100, generator=g)
        for bias in (None, b):
            want = torch.nn.functional.linear(x, w, bias)
            for tiles in (None, (1, 16)):
                err = _rel(linear.linear(x, w, bias, tiles=tiles), want)
                out.append(f"linear m={m} bias={bias is not None} tiles={tiles} {err:.2e}")
        # a bf16 x against fp32 weights (a router): widened inside the GEMV, fp32 out
        xb = x.bfloat16()
        got = linear.linear(xb, w, b)
        assert got.dtype == torch.float32
        out.append(f"linear bf16-x m={m} {_rel(got, torch.nn.functional.linear(xb.float(), w, b)):.2e}")
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check_fused(g: torch.Generator) -> list[str]:
    """The fused small ops (kernels/triton/fused.py) and the routing kernel (routing.py) against
    the reference's compositions: residual add + norm (plain, sandwich, depth-scaled, both
    weight orders; a strided y), head norm + RoPE + query scaling on a strided q view (each part
    alone and together, partial interleaved RoPE), the output gate (with and without a head
    bias, a strided gate), SwiGLU (fp32, limit), routing (sigmoid + bias + groups, softmax,
    renormalized or not, a routed scale; ids must equal, weights within the tolerance), the K/V
    cache write (strided k / v into padded cache rows: bit-equal)."""
    from dayzero.kernels.reference import basic
    from dayzero.kernels.reference.moe import moe_route as reference_route
    from dayzero.kernels.triton import fused, routing

    out = []
    x = torch.randn(5, 48, generator=g)
    y = torch.randn(5, 64, generator=g)[:, 8:56]  # rows strided
    w, pw = torch.randn(48, generator=g), torch.randn(48, generator=g)
    for post, scales, fp32 in (
        (None, None, False),
        (pw, None, True),
        (pw, (0.8, 0.6), False),
        (None, (0.9, 0.4), True),
    ):
        want = basic.add_rms_norm(x, y, w, 1e-6, fp32, post, scales)
        got = fused.add_rms_norm(x, y, w, 1e-6, fp32, post, scales)
        err = max(_rel(a, b) for a, b in zip(got, want, strict=True))
        out.append(f"add_rms_norm post={post is not None} scales={scales} w32={fp32} {err:.2e}")
    q = torch.randn(7, 5, 40, generator=g)[:, :, :32]  # [T, H, D] strided, like a q slice
    pos = torch.randint(0, 500, (7,), generator=g)
    qw = torch.randn(32, generator=g)
    for norm, half, neox, scaling, factor in (
        (True, 16, True, None, 1.0), (False, 16, True, None, 1.0), (True, None, True, (64.0, 0.1), 1.0),
        (True, 12, False, (64.0, 0.1), 1.3), (False, None, True, (100.0, 0.3), 1.0),
        (False, 12, True, None, 0.8),
    ):  # fmt: skip
        inv = None if half is None else 1.0 / (10000 ** (torch.arange(half) / half))
        wt = qw if norm else None
        want = basic.norm_rope(q, pos, wt, 1e-6, True, inv, neox, scaling, factor)
        got = fused.norm_rope(q, pos, wt, 1e-6, True, inv, neox, scaling, factor)
        err = _rel(got, want)
        out.append(f"norm_rope norm={norm} half={half} neox={neox} scaling={scaling} a={factor} {err:.2e}")
    o = torch.randn(3, 4, 24, generator=g)
    gate = torch.randn(3, 4, 30, generator=g)[:, :, 3:27]
    for bias in (None, torch.randn(4, generator=g)):
        err = _rel(fused.sigmoid_gate(o, gate, bias), basic.sigmoid_gate(o, gate, bias))
        out.append(f"sigmoid_gate bias={bias is not None} {err:.2e}")
    gu = torch.randn(4, 2 * 1100, generator=g) * 3  # two column tiles
    gt, up = gu.chunk(2, dim=-1)
    for fp32, limit in ((False, None), (True, 2.0)):
        err = _rel(fused.swiglu(gt, up, fp32, limit), basic.swiglu(gt, up, fp32, limit))
        out.append(f"swiglu fp32={fp32} limit={limit} {err:.2e}")
    for act, fp32, limit, consts in (
        ("gelu_pytorch_tanh", False, None, (0.0, 0.0)), ("clamped_swiglu", True, 7.0, (1.702, 0.0)),
        ("situ", True, None, (4.0, 25.0)), ("situ", True, 7.0, (3.0, 0.0)),
    ):  # fmt: skip
        want = basic.swiglu(gt * 4, up * 10, fp32, limit, act, consts)  # past situ's bounds too
        err = _rel(fused.swiglu(gt * 4, up * 10, fp32, limit, act, consts), want)
        out.append(f"swiglu act={act} fp32={fp32} limit={limit} consts={consts} {err:.2e}")
    for e, k, score, bias, groups, topg, renorm, scale in (
        (64, 8, "sigmoid", True, 8, 4, True, 2.5), (12, 3, "softmax", False, 1, 1, False, 1.0),
        (32, 6, "sigmoid", False, 4, 2, False, 1.0), (40, 5, "softmax", True, 1, 1, True, 0.5),
    ):  # fmt: skip
        logits = torch.randn(9, e, generator=g)
        b = torch.rand(e, generator=g) * 0.1 if bias else None
        ww, wi = reference_route(logits, k, score, b, groups, topg, renorm, scale)
        gw, gi = routing.moe_route(logits, k, score, b, groups, topg, renorm, scale)
        err = _rel(gw, ww) if torch.equal(gi, wi) else float("inf")
        out.append(f"moe_route e={e} k={k} {score} groups={groups} renorm={renorm} {err:.2e}")
    from dayzero.kernels.reference.attention import kv_write

    proj = torch.randn(6, 3 * 2 * 24, generator=g)  # k, v: strided views of one projection
    k, v = proj[:, :48].view(6, 2, 24), proj[:, 48:96].view(6, 2, 24)
    pool = torch.randn(40, 2 * 2 * 24 + 8, generator=g)  # padded cache rows, like the KV pool's
    slots = torch.randperm(40, generator=g)[:6]
    want, got = pool.clone(), pool.clone()
    for p in (want, got):
        kv = p[:, :96].view(40, 2, 2, 24)
        (kv_write if p is want else fused.kv_write)(k, v, kv[:, 0], kv[:, 1], slots)
    out.append(f"kv_write {float(not torch.equal(got, want)):.2e}")
    from dayzero.kernels.ops import HeadPrep
    from dayzero.kernels.reference.attention import qk_norm_rope_write

    qkv = torch.randn(6, 5 * 24 + 96, generator=g)  # q [T, 5, 24], then k, v: views of one projection
    q, k, v = qkv[:, :120].view(6, 5, 24), qkv[:, 120:168].view(6, 2, 24), qkv[:, 168:].view(6, 2, 24)
    kw = torch.randn(24, generator=g)
    for norm, half, neox, scaling, factor in (
        (True, 12, True, (64.0, 0.1), 1.0),
        (False, 8, False, None, 1.3),
    ):
        inv = 1.0 / (10000 ** (torch.arange(half) / half))
        ws = (qw[:24], kw) if norm else (None, None)
        prep = HeadPrep(*ws, 1e-6, True, inv, neox, scaling, factor)
        want, got = pool.clone(), pool.clone()
        res = []
        for p, fn in ((want, qk_norm_rope_write), (got, fused.qk_norm_rope_write)):
            kv = p[:, :96].view(40, 2, 2, 24)
            res.append(fn(q, k, v, pos[:6], prep, kv[:, 0], kv[:, 1], slots))
        err = max(_rel(res[1], res[0]), _rel(got, want))
        out.append(f"qk_norm_rope_write norm={norm} neox={neox} scaling={scaling} {err:.2e}")
    from dayzero.kernels.batched import sampling as batched_sampling
    from dayzero.kernels.ops import SamplingBatch
    from dayzero.kernels.triton import sampling

    for rows, vocab in ((3, 9000), (1, 4096)):  # 3 chunks with a partial one; exactly one chunk
        z = torch.randn(rows, vocab, generator=g) * 3
        z[0, 5] = z[0, vocab - 1] = z[0].max() + 1  # a tie across chunks: the lower id wins
        b = SamplingBatch(
            temperature=torch.zeros(rows), top_k=torch.zeros(rows, dtype=torch.int64),
            top_p=torch.ones(rows), min_p=torch.zeros(rows), generators=(None,) * rows, sampled_rows=(),
        )  # fmt: skip
        (tg, lg), (tw, lw) = sampling.sample(z, b), batched_sampling.sample(z, b)
        err = _rel(lg, lw) if torch.equal(tg, tw) and tg[0] == 5 else float("inf")
        out.append(f"sample greedy rows={rows} vocab={vocab} {err:.2e}")
    return out


def check(seed: int) -> list[str]:
    from dayzero.kernels.packed import PackedWeight
    from dayzero.kernels.reference import packed as ref
    from dayzero.kernels.triton import packed as tp
    from dayzero.sdk.bench.quantize import quantize

    tp._sms = lambda _device: 4  # no GPU to ask; small, so partial column tiles are exercised
    tp.torch.cuda.current_device = lambda: 0
    g = torch.Generator().manual_seed(seed)

    def weight(fmt: str, shape: tuple[int, ...]) -> PackedWeight:
        *_, n, k = shape
        w = PackedWeight(fmt, shape)
        parts = [quantize(d, fmt) for d in (torch.randn(*shape, generator=g) / k**0.5).reshape(-1, n, k)]
        for name, buf in w.named_buffers():
            buf.copy_(torch.stack([p[name] for p in parts]).reshape(buf.shape))
        return w

    # K: two fp8 blocks (128) and several 4-bit blocks, so the K loop runs twice; N: 72 outputs,
    # a partial column tile of 16 (the interpreter's 4 "SMs" shrink the tiles to 16 columns)
    n, k, inter = 72, 256, 32
    out = []
    for fmt in ("nvfp4", "mxfp4", "fp8_block"):
        w = weight(fmt, (n, k))
        for m in (1, 2, 5, 40):  # 1-2: one row a program; then 16- and 32-row tiles
            x = torch.randn(m, k, generator=g)
            want = ref.linear_packed(x, w)
            err = (tp.linear_packed(x, w) - want).abs().max() / want.abs().max()
            out.append(f"{fmt} linear m={m} {err.item():.2e}")
        up, down = weight(fmt, (8, 2 * inter, k)), weight(fmt, (8, k, inter))
        for t in (1, 3, 40):  # pairs <= 2 per expert: one a program; else sorted by expert
            x = torch.randn(t, k, generator=g)
            ids = torch.rand(t, 8, generator=g).topk(2, dim=-1).indices
            wts = torch.rand(t, 2, generator=g)
            want = ref.moe_experts_packed(x, up, down, wts, ids, True, 3.0)
            err = (
                tp.moe_experts_packed(x, up, down, wts, ids, True, 3.0) - want
            ).abs().max() / want.abs().max()
            out.append(f"{fmt} moe t={t} {err.item():.2e}")
            if t != 3:  # SiTU (Kimi K3's experts), both paths
                want = ref.moe_experts_packed(x, up, down, wts, ids, True, None, "situ", (4.0, 25.0))
                got = tp.moe_experts_packed(x, up, down, wts, ids, True, None, "situ", (4.0, 25.0))
                out.append(f"{fmt} moe situ t={t} {_rel(got, want):.2e}")
        for m in (1, 2):  # the decode GEMV's fp16 sums (bf16 activations): bf16-level error
            x = torch.randn(m, k, generator=g).bfloat16()
            want = ref.linear_packed(x, w).float()
            err = (tp.linear_packed(x, w).float() - want).abs().max() / want.abs().max()
            out.append(f"{fmt} linear bf16 m={m} {err.item():.2e}")
    out += check_attention(g) + check_moe(g) + check_norm(g) + check_fused(g) + check_linear(g)
    # expert id -1 (no expert) in about half the pairs; one format (the skip is format-free: a
    # GEMV program exits before its first load, `_align` and `combine` never read a weight)
    up, down = weight("nvfp4", (8, 64, 128)), weight("nvfp4", (8, 128, 32))
    for t in (3, 40):  # 6 pairs: a pair a program; 80: sorted by expert
        x = torch.randn(t, 128, generator=g)
        ids = torch.rand(t, 8, generator=g).topk(2, dim=-1).indices
        skip = torch.rand(t, 2, generator=g) < 0.5
        skip[0, 0] = False  # one pair at least has an expert
        ids, wts = torch.where(skip, -1, ids), torch.rand(t, 2, generator=g)
        want = ref.moe_experts_packed(x, up, down, wts, ids, True, 3.0)
        got = tp.moe_experts_packed(x, up, down, wts, ids, True, 3.0)
        out.append(f"nvfp4 moe skip t={t} {_rel(got, want):.2e}")
    return out + check_moe_skip(g)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("seed", SEEDS)
def test_triton_kernels_in_the_interpreter(seed: int) -> None:
    lines = run_checks(__file__, seed)
    fixed = (
        3 * 9 + 2 * 4 * 2 + 2 * 2 * 2 + 6 + 1 + 3 * 2 + 3 * 2 + 2 + 4 + 6 + 1 + 4 + 6 + 2 + 2 + 4 + 1 + 2 + 2
    )
    # SiTU: the expert kernels (3 shapes), the fused SwiGLU (2 constant pairs), packed experts (3 x 2)
    situ = 3 + 2 + 3 * 2
    skip = 2 + 2 * 2  # expert id -1: packed (2 shapes), dense (2 shapes x 2 ranks)
    per_head = 2  # rms_norm with a weight a head (both weight orders)
    assert len(lines) == fixed + 3 * (2 * 2 + 1) + skip + per_head + situ, lines  # + check_linear
    for ln in lines:  # bf16 rows: a few bf16 ulps of the output's scale
        assert float(ln.split()[-1]) <= (2e-2 if " bf16 " in ln else 1e-5), ln


if __name__ == "__main__":
    main(check)
