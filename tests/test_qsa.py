"""The QSA sparse indexer (sdk/blocks/attention.py, gqa `indexer: {kind: qsa}`) layer by layer
against the transformers module it mirrors, qwen4_exp's Qwen4ExpTextAttention with its
Qwen4ExpTextQSAIndexer, on random weights and inputs, fp32 on CPU.

The reference's ReLU scores tie at zero on small random weights and `topk` breaks ties by
position (docs/architecture.md, "Sparse attention and ties"), so here every query's pooled
scores are checked to be tie-free at the budget boundary before the selections (sets of key
positions) and the attention outputs are compared; the budget (2 blocks of 4) is far below the
48 tokens, so the layer really prunes. 2 seeds, tolerance 1e-5 absolute (outputs O(1)); the
budget at least the sequence (every key selected) equals dense attention.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from one_row import context
from paged_meta import paged_meta, qsa_step, selection

from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.blocks.attention import GqaAttention, GqaCfg, QsaCfg
from dayzero.sdk.blocks.rope import rope_table
from dayzero.sdk.config.model import CacheGroupCfg

T, TOL, SEEDS = 48, 1e-5, (0, 1)
HIDDEN, H, HK, D, HI, DI, EPS = 48, 4, 2, 16, 4, 12, 1e-6


def _pair(seed: int, budget: int, pool: int) -> tuple[GqaAttention, torch.nn.Module, torch.nn.Module]:
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (
        Qwen4ExpTextAttention,
        Qwen4ExpTextRotaryEmbedding,
    )

    hf = Qwen4ExpTextConfig(
        hidden_size=HIDDEN, num_attention_heads=H, num_key_value_heads=HK, head_dim=D, num_hidden_layers=1,
        layer_types=["indexed_attention"], rms_norm_eps=EPS, indexer_n_heads=HI, indexer_kv_heads=1,
        indexer_head_dim=DI, indexer_budget=budget, indexer_compress_ratio=pool,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    hf._attn_implementation = "eager"
    ref = Qwen4ExpTextAttention(hf, 0).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 1:  # zero-centred norms: applied as 1 + w
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    rot = D // 2
    cfg = GqaCfg(
        hidden=HIDDEN, heads=H, kv_heads=HK, head_dim=D, bias=False, qk_norm=True, norm_eps=EPS,
        norm_weight_in_fp32=True, rope_theta=10000.0, rotary_dim=rot, neox=True, rope_params=(),
        max_position=None, window=None, output_gate="sigmoid", query_scaling=None, softcap=None,
        scale=D**-0.5, qk_norm_zero_centred=True, indexer=QsaCfg(HI, DI, budget, pool),
    )  # fmt: skip
    ops = OpTable(torch.device("cpu"), torch.float32)
    for op, features, head_dim in BLOCKS.get("gqa").needs(cfg):
        ops.need(op, features, head_dim)
    ours = GqaAttention(cfg, ops.resolve(), ((0, 0), (1, 0), (2, 0)))
    q, gate = ref.q_proj.weight.view(H, 2, D, HIDDEN).unbind(1)
    with torch.no_grad():
        kv = (ref.k_proj.weight, ref.v_proj.weight)
        ours.in_proj.copy_(torch.cat((q.flatten(0, 1), *kv, gate.flatten(0, 1))))  # [q; k; v; gate]
        ours.o_proj.copy_(ref.o_proj.weight)
        ours.q_norm.copy_(ref.q_norm.weight)
        ours.k_norm.copy_(ref.k_norm.weight)
        ours.index_proj.copy_(ref.indexer.index_qk_proj.weight)
        ours.index_q_norm.copy_(ref.indexer.q_layernorm.weight)
        ours.index_k_norm.copy_(ref.indexer.k_layernorm.weight)
    assert torch.allclose(ours.inv_freq, rope_table(10000.0, rot, {"rope_type": "default"}, None)[0])
    return ours, ref, Qwen4ExpTextRotaryEmbedding(hf)


def _spy(module: GqaAttention, op: str) -> dict:
    """Record what an op of the block returns."""
    seen: dict = {}
    inner = getattr(module.ops, op)

    def spy(*args):
        seen["out"] = inner(*args)
        return seen["out"]

    module.ops._calls[op] = spy
    return seen


def _tie_free(score: torch.Tensor, k: int, gap: float = 2e-6) -> bool:
    """score [T, M] (-inf where not visible): every query with more than k visible blocks has a
    gap between its k-th and (k+1)-th best well above fp32 rounding."""
    best = score.sort(dim=-1, descending=True).values
    rows = torch.isfinite(best[:, k]) if best.shape[1] > k else torch.zeros(len(best), dtype=torch.bool)
    return bool((best[rows, k - 1] - best[rows, k] > gap).all())


def _run(seed: int, budget: int, pool: int):
    ours, ref, rotary = _pair(seed, budget, pool)
    scores, sel = _spy(ours, "qsa_scores"), _spy(ours, "index_topk")
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(100 + seed))
    groups = [
        CacheGroupCfg("kv", "paged", None, 2 * HK * D, (0,)),
        CacheGroupCfg("index_raw", "sliding", pool, DI, (0,)),
        CacheGroupCfg("index", "paged", None, -(-DI // pool), (0,)),
    ]
    with torch.no_grad():
        got = ours(x, context(T, groups))
        rope = rotary(x[None], torch.arange(T)[None])
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        want, _ = ref(x[None], rope, mask)
        want_mask = ref.indexer(x[None], rope, mask, None)[0, 0]  # [T, T] selected keys
    return got, want[0], scores["out"], sel["out"], want_mask


@pytest.mark.parametrize("seed", SEEDS)
def test_qsa_layer_selects_and_attends_like_the_reference(seed: int) -> None:
    budget, pool = 8, 4  # two blocks of four out of up to twelve, plus the query's incomplete block
    got, want, scores, sel, want_mask = _run(seed, budget, pool)
    assert _tie_free(scores, budget // pool), f"seed {seed}: pooled scores tie; pick another seed"
    ours_sets = [set(r[r >= 0].tolist()) for r in sel]
    ref_sets = [set(torch.nonzero(r).flatten().tolist()) for r in want_mask]
    assert ours_sets == ref_sets
    assert max(len(s) for s in ref_sets) <= budget + pool - 1 < T // 2  # the selection is really sparse
    assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("seed", SEEDS)
def test_qsa_with_the_budget_over_the_sequence_is_dense(seed: int) -> None:
    got, want, _, sel, _ = _run(seed, budget=T, pool=4)
    assert [set(r[r >= 0].tolist()) for r in sel] == [set(range(t + 1)) for t in range(T)]
    assert (got - want).abs().max().item() < TOL


# ---- the graph-safe batched kernels (kernels/batched) against the reference ops -------------
# decode, a chunk after a prefix, a fresh prompt, a row with no token this step, a long row
ROWS = [(1, 13), (7, 9), (5, 5), (0, 8), (1, 40), (16, 36)]
DECODE = [(1, 5), (1, 30), (0, 9), (1, 17)]
POOL_DECODE = [(1, 5), (1, 16), (0, 9), (1, 24), (1, 17)]  # two rows complete a block of 4 and of 8


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows", [ROWS, DECODE], ids=["mixed", "decode"])
def test_batched_sparse_gqa_equals_the_reference(seed: int, rows) -> None:
    """gqa_attention/batched_select against the reference with the same selection (repeats, -1,
    positions after the query), plain, windowed, soft-capped and with sinks: relative 1e-5; a
    token that reads no key gives zeros (the reference: NaN, or zeros with sinks)."""
    from dayzero.kernels.batched.attention import gqa_attention_select
    from dayzero.kernels.reference.attention import gqa_attention

    g = torch.Generator().manual_seed(seed)
    meta, blocks = paged_meta(rows, 4, g)
    t = meta.positions.shape[0]
    q = torch.randn(t, H, D, generator=g)
    k, v = torch.randn(blocks * 4, HK, D, generator=g), torch.randn(blocks * 4, HK, D, generator=g)
    sel = selection(g, meta, 24)
    sinks = torch.randn(H, generator=g)
    for window, cap, sink in ((None, None, None), (6, None, None), (None, 20.0, None), (None, None, sinks)):
        want = gqa_attention(q, k, v, meta, 0.3, window, cap, sink, sel)
        got = gqa_attention_select(q, k, v, meta, 0.3, window, cap, sink, sel)
        fine = torch.isfinite(want).all(-1).all(-1)  # tokens that read at least one key
        assert (got[-1] == 0).all() and (got[~fine] == 0).all() and (sink is not None or not fine[-1])
        err = (got[fine] - want[fine]).abs().max() / want[fine].abs().max()
        assert err < TOL, (window, cap, err)
        if sink is None:  # no selection: dense attention (the batched kernel's)
            dense = gqa_attention(q, k, v, meta, 0.3, window, cap)
            got = gqa_attention_select(q, k, v, meta, 0.3, window, cap)
            err = (got - dense).abs().max() / dense.abs().max()
            assert err < TOL, (window, cap, err)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("rows", [ROWS, POOL_DECODE, [(1, 70), (3, 41)]], ids=["mixed", "decode", "long"])
def test_batched_qsa_pool_and_scores_equal_the_reference_at_any_width(seed: int, rows) -> None:
    """qsa_pool/batched writes the pooled keys of the blocks the step completes as the reference
    does (the raw keys in a sliding group of window P, its freed blocks -1; every other row left
    as it was; the tokens that complete nothing to the scratch row), and qsa_scores/batched over
    the block table's width (as a CUDA graph holds it) gives the reference's -inf pattern, finite
    scores within 1e-5 relative, -inf past the reference's width, and the same budget selections
    (index_topk) with the table widened by 5 columns of stale block ids or -1. Pools of 4 (a
    block) and 8 (two), with and without RoPE; 12 channels, so 8 spread them 2 a position."""
    from dayzero.kernels.batched.indexer import qsa_pool, qsa_scores
    from dayzero.kernels.reference.mla import index_topk
    from dayzero.kernels.reference.qsa import qsa_pool as reference_pool
    from dayzero.kernels.reference.qsa import qsa_scores as reference

    g = torch.Generator().manual_seed(seed)
    w = 1 + 0.1 * torch.randn(DI, generator=g)
    for pool in (4, 8):
        raw, raw_meta, stale, meta = qsa_step(rows, pool, DI, g)
        t = meta.positions.shape[0]
        q = torch.randn(t, HI, DI, generator=g)
        completing = int(((meta.positions + 1) % pool == 0).sum())
        for inv in (None, 1.0 / 10000 ** (torch.arange(DI // 4) / (DI // 4))):
            want_keys, got_keys = stale.clone(), stale.clone()
            reference_pool(raw, raw_meta, want_keys, meta, w, EPS, inv, True, pool)
            qsa_pool(raw, raw_meta, got_keys, meta, w, EPS, inv, True, pool)
            written = (want_keys != stale).any(-1)
            assert int(written.sum()) == completing * -(-DI // want_keys.shape[1]) > 0
            assert torch.equal(got_keys[:-1][~written[:-1]], stale[:-1][~written[:-1]])
            assert (got_keys[written] - want_keys[written]).abs().max() <= TOL
            want = reference(q, want_keys, meta, pool, DI**-0.5)
            got = qsa_scores(q, got_keys, meta, pool, DI**-0.5)
            n = want.shape[1]
            assert (got[:, n:] == float("-inf")).all()
            seen = torch.isfinite(want)
            assert torch.equal(seen, torch.isfinite(got[:, :n])) and seen.any()
            err = (got[:, :n][seen] - want[seen]).abs().max() / want[seen].abs().max()
            assert err < TOL, (pool, err)
            stale_ids = torch.randint(
                -1, meta.block_table.max() + 1, (meta.block_table.shape[0], 5), generator=g
            )
            wide = replace(meta, block_table=torch.cat((meta.block_table, stale_ids), dim=1), memo={})
            got_wide = qsa_scores(q, got_keys, wide, pool, DI**-0.5)
            for budget in (pool, 2 * pool):
                a = index_topk(want, meta.positions, budget, pool, True)
                b = index_topk(got_wide, meta.positions, budget, pool, True)
                assert torch.equal(a.sort(-1).values, b.sort(-1).values), (pool, budget)


def test_sparse_kernels_are_selected_and_graph_safe() -> None:
    """On the CPU and on CUDA a QSA layer's selection and attention take the batched kernels,
    both graph-safe (a Flash-Next decode step can be captured)."""
    from dayzero.kernels.registry import KERNELS
    from dayzero.kernels.selection import Need, select

    for need, backend in (
        (Need("gqa_attention", frozenset({"causal", "select"})), "batched_select"),
        (Need("qsa_scores", frozenset()), "batched"),
        (Need("qsa_pool", frozenset()), "batched"),
    ):
        assert select(need, torch.device("cpu"), torch.float32).backend == backend
        assert KERNELS.get(f"{need.op}/{backend}").caps.graphs
    plain = Need("gqa_attention", frozenset({"causal"}))
    assert select(plain, torch.device("cpu"), torch.float32).backend == "batched"  # unchanged
