"""On a CUDA GPU (scripts/gpu_bringup.sh runs it; skipped elsewhere): the Triton paged attention and
bf16 expert GEMVs at Beam's real widths against the reference backend, and decode steps replayed
from CUDA graphs against the same static buffers run eagerly (bit-identical) and against the
plain eager path (fp32, the graphs with overlap: the same tokens, logprobs within 1e-4), drafting
steps with overlap moving their rows on the device, and the fused small ops and routing in bf16.

bf16 tolerance: the kernel's error against the fp32 reference is at most twice the reference's
own bf16 error plus 1e-3 (relative to the output's largest value)."""

from __future__ import annotations

import pytest
import torch
from paged_meta import paged_meta
from test_mtp import KITS, record_drafts  # the tiny checkpoints with a NextN layer
from test_speculative import Oracle
from test_speculative_overlap import DeviceOracle, _drafts_by_request, _same

from dayzero.kernels.reference.attention import gqa_attention as reference_attention
from dayzero.kernels.reference.moe import moe_experts as reference_moe
from dayzero.kernels.triton import attention, moe
from dayzero.sdk.api import LLM
from dayzero.sdk.engine.drafters import TokenDrafter
from dayzero.sdk.engine.engine import EngineConfig, SamplingParams
from dayzero.sdk.engine.graphs import decode_only
from dayzero.sdk.parity.tiny import write_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("window,cap", [(None, None), (512, None), (None, 30.0)])
def test_paged_attention_at_beam_widths(seed: int, window, cap) -> None:
    g = torch.Generator().manual_seed(seed)
    h, hk, d, bs = 48, 8, 128, 64
    for rows in ([(1, 517), (1, 3000)], [(1, 40), (700, 800), (300, 300)]):  # decode; mixed
        meta, blocks = paged_meta(rows, bs, g, device=CUDA)
        t = sum(n for n, _ in rows)
        q = torch.randn(t, h, d, generator=g).to(CUDA)
        kc = torch.randn(blocks * bs, hk, d, generator=g).to(CUDA)
        vc = torch.randn(blocks * bs, hk, d, generator=g).to(CUDA)
        want = reference_attention(q, kc, vc, meta, d**-0.5, window, cap)
        b16 = [x.bfloat16() for x in (q, kc, vc)]
        own = _rel(reference_attention(*b16, meta, d**-0.5, window, cap), want)
        got = _rel(attention.gqa_attention(*b16, meta, d**-0.5, window, cap), want)
        assert got <= 2 * own + 1e-3, (rows, got, own)
        fp32 = _rel(attention.gqa_attention(q, kc, vc, meta, d**-0.5, window, cap), want)
        assert fp32 <= 1e-5, (rows, fp32)


@pytest.mark.parametrize("t", [1, 4, 16, 64])  # GEMVs, GEMVs, sorted-pair tiles, grouped GEMM
def test_expert_gemvs_at_beam_widths(t: int) -> None:
    g = torch.Generator().manual_seed(t)
    e, k, dm, i = 16, 8, 5120, 2560
    x = torch.randn(t, dm, generator=g).to(CUDA)
    up = (torch.randn(e, 2 * i, dm, generator=g) / dm**0.5).to(CUDA)
    down = (torch.randn(e, dm, i, generator=g) / i**0.5).to(CUDA)
    ids = torch.rand(t, e, generator=g).topk(k, dim=-1).indices.to(CUDA)
    wts = torch.rand(t, k, generator=g).to(CUDA)
    want = reference_moe(x, up, down, wts, ids, True, None)
    b16 = [v.bfloat16() for v in (x, up, down)]
    own = _rel(reference_moe(b16[0], b16[1], b16[2], wts, ids, True, None), want)
    got = _rel(moe.moe_experts(b16[0], b16[1], b16[2], wts, ids, True, None), want)
    assert got <= 2 * own + 1e-3, (got, own)


@pytest.mark.parametrize("rows", [1, 32])
def test_greedy_sampler_at_beam_vocab(rows: int) -> None:
    """The Triton greedy sampler on bf16 logits over 151,936 tokens: the batched sampler's tokens,
    logprobs within 1e-5 (both fp32 sums, another order); a non-greedy batch falls back to it."""
    from dayzero.kernels.batched import sampling as batched
    from dayzero.kernels.ops import SamplingBatch
    from dayzero.kernels.triton import sampling

    g = torch.Generator(device=CUDA).manual_seed(rows)
    z = (torch.randn(rows, 151936, generator=g, device=CUDA) * 4).bfloat16()
    zero = torch.zeros(rows, device=CUDA)
    b = SamplingBatch(zero, zero.long(), zero + 1, zero, (None,) * rows, ())
    (tg, lg), (tw, lw) = sampling.sample(z, b), batched.sample(z, b)
    assert torch.equal(tg, tw) and (lg - lw).abs().max().item() <= 1e-5
    hot = SamplingBatch(zero + 0.7, zero.long(), zero + 1, zero, (None,) * rows, tuple(range(rows)))
    torch.manual_seed(0)
    t1, _ = sampling.sample(z, hot)
    torch.manual_seed(0)
    assert torch.equal(t1, batched.sample(z, hot)[0])


def test_norm_and_rope_bf16() -> None:
    from dayzero.kernels.reference import basic
    from dayzero.kernels.triton import fused, norm

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 48, 128, generator=g).to(CUDA), torch.randn(128, generator=g).to(CUDA)
    for fp32 in (False, True):
        want = basic.rms_norm(x, w, 1e-6, fp32)
        own = _rel(basic.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6, fp32), want)
        assert _rel(norm.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6, fp32), want) <= 2 * own + 1e-3
    pos = torch.randint(0, 8192, (64,), generator=g).to(CUDA)
    inv = (1.0 / (10000 ** (torch.arange(32) / 32))).to(CUDA)
    want = basic.rope(x, pos, inv, True)
    own = _rel(basic.rope(x.bfloat16(), pos, inv, True), want)
    assert _rel(fused.rope(x.bfloat16(), pos, inv, True), want) <= 2 * own + 1e-3


def test_fused_ops_bf16() -> None:
    """The fused small ops and routing at Beam's widths in bf16 against the fp32 reference."""
    from dayzero.kernels.ops import HeadPrep
    from dayzero.kernels.reference import attention as ref_attention
    from dayzero.kernels.reference import basic
    from dayzero.kernels.reference.moe import moe_route as reference_route
    from dayzero.kernels.triton import fused, routing

    g = torch.Generator().manual_seed(1)

    def both(fn_ref, fn, *args):  # (kernel's bf16 error, the reference's own bf16 error)
        want = fn_ref(*[a.to(CUDA) if isinstance(a, torch.Tensor) else a for a in args])
        b16 = [a.to(CUDA).bfloat16() if isinstance(a, torch.Tensor) else a for a in args]
        return _rel(fn(*b16), want), _rel(fn_ref(*b16), want)

    x, y, w, pw = (
        torch.randn(8, 5120, generator=g),
        torch.randn(8, 5120, generator=g),
        *torch.randn(2, 5120, generator=g),
    )
    for scales in (None, (0.8, 0.6)):
        for i in range(2):
            ref, ours = (lambda *a, i=i, f=f: f(*a)[i] for f in (basic.add_rms_norm, fused.add_rms_norm))
            got, own = both(ref, ours, x, y, w, 1e-6, True, pw, scales)
            assert got <= 2 * own + 1e-3, (scales, i, got, own)
    q, pos = torch.randn(8, 48, 128, generator=g), torch.randint(0, 8192, (8,), generator=g)
    qw, inv = torch.randn(128, generator=g), 1.0 / (10000 ** (torch.arange(64) / 64))
    pos, inv = pos.to(CUDA), inv.to(CUDA)
    got, own = both(
        lambda q, w: basic.norm_rope(q, pos, w, 1e-6, True, inv, True, (2048.0, 0.1)),
        lambda q, w: fused.norm_rope(q, pos, w, 1e-6, True, inv, True, (2048.0, 0.1)),
        q, qw,
    )  # fmt: skip
    assert got <= 2 * own + 1e-3, (got, own)
    k, v = torch.randn(8, 8, 128, generator=g), torch.randn(8, 8, 128, generator=g)
    slots = torch.randperm(64, generator=g)[:8].to(CUDA)
    for fn in (ref_attention.qk_norm_rope_write, fused.qk_norm_rope_write):
        q16, k16, v16, w16 = (a.to(CUDA).bfloat16() for a in (q, k, v, qw))
        kc, vc = torch.zeros(2, 64, 8, 128, dtype=torch.bfloat16, device=CUDA)
        prep = HeadPrep(w16, w16, 1e-6, True, inv, True, (2048.0, 0.1), 1.0)
        got = fn(q16, k16, v16, pos, prep, kc, vc, slots)
        want_q = basic.norm_rope(q16, pos, w16, 1e-6, True, inv, True, (2048.0, 0.1))
        want_k = basic.norm_rope(k16, pos, w16, 1e-6, True, inv, True, None)
        assert _rel(got, want_q) <= 1e-2 and _rel(kc[slots], want_k) <= 1e-2, fn
        assert torch.equal(vc[slots], v16) and not kc[~torch.isin(torch.arange(64, device=CUDA), slots)].any()
    o, gate, bias = (
        torch.randn(8, 48, 128, generator=g),
        torch.randn(8, 48, 128, generator=g),
        torch.randn(48),
    )
    got, own = both(basic.sigmoid_gate, fused.sigmoid_gate, o, gate, bias)
    assert got <= 2 * own + 1e-3, (got, own)
    gt, up = torch.randn(8, 12288, generator=g), torch.randn(8, 12288, generator=g)
    got, own = both(basic.swiglu, fused.swiglu, gt, up, True, None)
    assert got <= 2 * own + 1e-3, (got, own)
    logits, bias = torch.randn(64, 256, generator=g).to(CUDA), (torch.rand(256, generator=g) * 0.1).to(CUDA)
    ww, wi = reference_route(logits, 8, "sigmoid", bias, 8, 4, True, 2.5)
    gw, gi = routing.moe_route(logits, 8, "sigmoid", bias, 8, 4, True, 2.5)
    assert torch.equal(gi, wi) and _rel(gw, ww) <= 1e-6


MEDIUM = {
    "beam": {
        "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
        "moe_intermediate_size": 128, "intermediate_size": 512, "num_experts": 16,
        "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "sliding_window": 32,
    }
}  # fmt: skip


@pytest.fixture(scope="module", params=["llama", "beam"])
def checkpoint(request, tmp_path_factory):
    fam = request.param
    return write_tiny(fam, tmp_path_factory.mktemp(fam) / "ckpt", seed=5, overrides=MEDIUM.get(fam, {}))


# every cache group a decode graph holds: paged KV, MLA latents with DSA / KPool indexers, the state
# slots of KDA / Gated DeltaNet / short convolutions, QSA's pooled keys, n-gram histories
FAMILIES = ["llama", "beam", "glm53", "glm53_flash", "qwen38", "qwen38_flash_next"]


@pytest.fixture(scope="module", params=FAMILIES)
def any_checkpoint(request, tmp_path_factory):
    fam = request.param
    return fam, write_tiny(fam, tmp_path_factory.mktemp(fam) / "ckpt", seed=5, overrides=MEDIUM.get(fam, {}))


def _engine(path, dtype: str, mode: str, overlap: str = "auto") -> LLM:
    cfg = EngineConfig(
        block_size=16, kv_cache_bytes=256 << 20, max_batch_size=8, decode_graphs=mode, overlap=overlap
    )
    return LLM(path, device="cuda", dtype=dtype, progress=False, engine=cfg)


def test_replay_equals_the_buffers_run_eagerly(checkpoint) -> None:
    eng = _engine(checkpoint, "bfloat16", "auto", "off").engine  # the plan below is read by hand
    assert eng.graphs is not None and eng.graphs.buckets[1].graph is not None, eng.ops.not_graph_safe()
    ids = [
        eng.add(list(range(3, 3 + n)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        for n in (5, 40, 90)
    ]
    while any(len(eng.requests[i].token_ids) < 2 for i in ids):  # every prompt prefilled
        eng.step()
    plan = eng.scheduler.step()
    assert decode_only(plan) and plan.rows == 3
    replayed = eng.graphs.run(plan).clone()  # bucket 4: 3 rows + 1 padding row
    size = next(s for s in eng.graphs.sizes if s >= plan.rows)
    lens = tuple(int(x) for x in plan.kv_lens) + (0,) * (size - plan.rows)
    with torch.inference_mode():
        eager = eng.model(eng.graphs._context(size, lens))[: plan.rows]
    assert torch.equal(replayed, eager)


def test_graph_decode_equals_the_eager_path(any_checkpoint) -> None:
    prompts = [list(range(3, 3 + n)) for n in (7, 33, 64, 2)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (20, 6, 14, 9)]
    params[1] = SamplingParams(max_tokens=6, temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, seed=7)
    outs = {}
    fam, path = any_checkpoint
    for mode in ("off", "auto"):  # eager and synchronous; graphs with overlap (device-filled inputs)
        llm = _engine(path, "float32", mode, "off" if mode == "off" else "on")
        outs[mode] = llm.engine.generate(prompts, params)
        assert (llm.engine.stats["graph_steps"] > 0) == (mode == "auto"), fam
        assert (llm.engine.stats["device_inputs"] > 0) == (mode == "auto")
    for a, b in zip(outs["off"], outs["auto"], strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("family", ["llama", "glm53", "qwen38_flash_next"])
def test_verify_graphs_answer_as_the_eager_verify(tmp_path, family: str) -> None:
    """Speculative decoding (3 drafts a step, the first 2 of each right: `Oracle` over the
    greedy answers) on CUDA: verify steps replayed from the graphs (each token a row,
    speculative.flat_plan; Qwen3.8-Flash-Next's Gated DeltaNet and n-gram states kept after each
    token in checkpoint slots, the kept one copied back) give the tokens, logprobs and
    acceptance counts of the eager varlen verify (its rollback recomputing the kept tokens)."""
    path = write_tiny(family, tmp_path / "ckpt", seed=5)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (25, 49)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(
        path, device="cuda", dtype="float32", progress=False, engine=EngineConfig(decode_graphs="off")
    )
    base = plain.engine.generate(prompts, [params] * len(prompts))
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    outs, stats = {}, {}
    for mode in ("off", "auto"):
        cfg = EngineConfig(block_size=16, kv_cache_bytes=256 << 20, max_batch_size=8, decode_graphs=mode)
        llm = LLM(path, device="cuda", dtype="float32", progress=False, engine=cfg, speculative_config=spec)
        llm.engine.drafter = TokenDrafter(Oracle(prompts, base, 2))
        outs[mode] = llm.engine.generate(prompts, [params] * len(prompts))
        stats[mode] = dict(llm.engine.stats)
    assert stats["auto"]["graph_steps"] > 0 and stats["off"]["graph_steps"] == 0
    assert stats["auto"]["accepted_at"] == stats["off"]["accepted_at"]
    assert stats["off"]["accepted_at"][1] > 0
    for a, b, want in zip(outs["off"], outs["auto"], base, strict=True):
        assert a.token_ids == b.token_ids == want.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("family", ["glm53", "qwen38", "glm53_flash"])
def test_mtp_head_graphs_draft_as_the_eager_head(tmp_path, family: str) -> None:
    """MTP drafting (k = 2, fp32) on CUDA: the head's observe and draft passes replayed from its
    graphs (GLM-5.3: the verify steps too; Qwen3.8 and GLM-5.3-Flash keep recurrent state, so
    their verify runs eagerly) give the drafts, tokens and logprobs of the eager head."""
    kit = KITS[family](tmp_path, 0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, kit.vocab, (n,), generator=g).tolist() for n in (7, 40, 23)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    outs, stats, drafts = {}, {}, {}
    for mode in ("off", "auto"):
        cfg = EngineConfig(
            block_size=16, kv_cache_bytes=256 << 20, max_batch_size=8, decode_graphs=mode, overlap="off"
        )
        llm = LLM(
            kit.path, device="cuda", dtype="float32", progress=False, engine=cfg, speculative_config=spec
        )
        if mode == "auto":
            heads = llm.engine.head_graphs
            assert heads is not None and heads.buckets[1].graph is not None, heads and heads.report
        seen = record_drafts(llm.engine)
        outs[mode], drafts[mode] = llm.engine.generate(prompts, [params] * len(prompts)), seen
        stats[mode] = dict(llm.engine.stats)
    assert stats["auto"]["head_graph_passes"] > 0 and stats["off"]["head_graph_passes"] == 0
    assert drafts["auto"] == drafts["off"] and len(drafts["off"]) > 3  # random heads: few accepted
    for a, b in zip(outs["off"], outs["auto"], strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("drafter", ["oracle", "head"])
def test_drafting_steps_overlap_in_the_captured_graphs(tmp_path, drafter: str) -> None:
    """MTP drafting with overlap on CUDA (GLM-5.3's NextN over MLA + DSA, fp32, graphs captured):
    each step's rows, planned before the step in flight is read back, move back on the device by
    its rejected drafts. A device oracle (3 drafts, the first right) and the model's own head (2
    drafts): the tokens of a run without drafts; the head's tokens and logprobs also those of
    overlap off, its greedy steps run whole in the captured drafting graphs
    (sdk/engine/drafting_graphs.py)."""
    kit = KITS["glm53"](tmp_path, 0)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, kit.vocab, (n,), generator=g).tolist() for n in (7, 40, 23)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(kit.path, device="cuda", dtype="float32", progress=False)
    base = plain.engine.generate(prompts, [params] * len(prompts))
    k = 3 if drafter == "oracle" else 2
    outs, stats = {}, {}
    for overlap in ("off", "on"):
        cfg = EngineConfig(block_size=16, kv_cache_bytes=256 << 20, max_batch_size=8, overlap=overlap)
        spec = {"method": "mtp", "num_speculative_tokens": k}
        llm = LLM(
            kit.path, device="cuda", dtype="float32", progress=False, engine=cfg, speculative_config=spec
        )
        graphs = llm.engine.graphs
        assert graphs.captured, graphs.report
        if drafter == "oracle":
            llm.engine.drafter = DeviceOracle(prompts, base, 1)
        elif overlap == "on":
            drafting = llm.engine.drafting.graphs
            assert drafting.captured, drafting.report
        outs[overlap] = llm.engine.generate(prompts, [params] * len(prompts))
        stats[overlap] = dict(llm.engine.stats)
    assert stats["on"]["rows_moved_on_device"] > 0 and stats["off"]["rows_moved_on_device"] == 0
    assert (stats["on"]["drafting_graph_steps"] > 0) == (drafter == "head")
    for a, b, want in zip(outs["off"], outs["on"], base, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
        if drafter == "oracle":
            assert b.token_ids == want.token_ids
    if drafter == "oracle":
        assert stats["on"]["accepted_at"][0] > 0 and stats["on"]["accepted_at"][1] == 0


def test_drafting_graphs_draft_as_pass_by_pass_on_cuda(tmp_path) -> None:
    """The whole drafting step in captured graphs (sdk/engine/drafting_graphs.py; GLM-5.3's
    NextN over MLA + DSA, fp32, 3 drafts, 3 requests: the chained drafts' rows are every fourth
    flat row, which the Triton kernels index flat) against the same engine drafting pass by
    pass: the same drafts a step, tokens, and logprobs within 1e-4."""
    kit = KITS["glm53"](tmp_path, 0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, kit.vocab, (n,), generator=g).tolist() for n in (9, 33, 20)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    cfg = EngineConfig(block_size=16, kv_cache_bytes=256 << 20, max_batch_size=8, overlap="on")
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    runs = {}
    for in_graph in (True, False):
        eng = LLM(
            kit.path, device="cuda", dtype="float32", progress=False, engine=cfg, speculative_config=spec
        ).engine
        assert eng.drafting is not None and eng.drafting.graphs.captured  # (a failed capture: in the log)
        if not in_graph:
            eng.drafting = eng.drafter.table = None
        seen = _drafts_by_request(eng)
        outs = eng.generate(prompts, [params] * len(prompts))
        runs[in_graph] = (outs, seen, dict(eng.stats))
    (g_outs, g_seen, g_stats), (p_outs, p_seen, p_stats) = runs[True], runs[False]
    assert g_stats["drafting_graph_steps"] > 0 and p_stats["drafting_graph_steps"] == 0
    assert g_seen == p_seen and g_stats["accepted_at"] == p_stats["accepted_at"]
    _same(p_outs, g_outs, 1e-4)
