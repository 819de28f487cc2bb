"""Kernel registry selection, and the reference kernels against independent formulas."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from conftest import SEEDS

from dayzero.kernels.batched.attention import gqa_attention as batched_attention
from dayzero.kernels.batched.sampling import sample as batched_sample
from dayzero.kernels.ops import PagedMeta, Penalties, SamplingBatch
from dayzero.kernels.reference.attention import gqa_attention as reference_attention
from dayzero.kernels.reference.attention import kv_write
from dayzero.kernels.reference.basic import SMALL_M, linear, rms_norm, rope
from dayzero.kernels.reference.moe import moe_route
from dayzero.kernels.reference.sampling import sample as reference_sample
from dayzero.kernels.registry import KERNELS, OPS, Capabilities, UnknownKeyError, declare_op, register
from dayzero.kernels.selection import KernelSelectionError, Need, OpTable, select

CPU = torch.device("cpu")

# ---- registry ----------------------------------------------------------------------------------


def test_select_returns_the_reference_kernel_on_cpu() -> None:
    k = select(Need("rms_norm", frozenset({"weight_in_fp32"})), CPU, torch.float32)
    assert (k.op, k.backend, k.key) == ("rms_norm", "reference", "rms_norm/reference")
    assert k.fn is rms_norm


def test_unknown_feature_lists_the_known_ones() -> None:
    with pytest.raises(KernelSelectionError) as info:
        select(Need("gqa_attention", frozenset({"causal", "alibi"})), CPU, torch.float32)
    known = "causal, select, sinks, sliding_window, softcap"
    assert str(info.value) == f"op 'gqa_attention' has no feature alibi; known: {known}"


def test_unknown_op_lists_the_ops() -> None:
    with pytest.raises(UnknownKeyError) as info:
        select(Need("flash_attention"), CPU, torch.float32)
    msg = str(info.value)
    assert msg.startswith("unknown op 'flash_attention'; known: ")
    for op in ("embedding", "gqa_attention", "moe_route", "rms_norm", "rope", "sample"):
        assert op in msg


def test_env_override_with_unknown_backend_lists_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAYZERO_KERNEL_RMS_NORM", "nope")
    with pytest.raises(UnknownKeyError) as info:
        select(Need("rms_norm"), CPU, torch.float32)
    known = sorted(k.backend for _, k in KERNELS.items() if k.op == "rms_norm")  # triton too where it imports
    assert "reference" in known
    assert str(info.value) == f"unknown backend for op 'rms_norm' 'nope'; known: {', '.join(known)}"


def test_env_override_naming_reference_selects_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAYZERO_KERNEL_RMS_NORM", "reference")
    assert select(Need("rms_norm"), CPU, torch.float32).fn is rms_norm


@pytest.fixture
def scratch_op() -> Iterator[str]:
    """A test-only op with features {f, g}; removed (with its kernels) afterwards."""
    name = f"test_op_{uuid.uuid4().hex[:10]}"
    declare_op(name, "test-only op", features={"f", "g"})
    yield name
    # the registries have no public removal; drop the test entries so real ops are undisturbed
    OPS._items.pop(name, None)
    for key in [k for k, _ in KERNELS.items() if k.startswith(f"{name}/")]:
        KERNELS._items.pop(key)


def fake(tag: str) -> Callable[[], str]:
    return lambda: tag


def caps(**kw: object) -> Capabilities:
    return Capabilities(**({"features": frozenset({"f", "g"})} | kw))  # type: ignore[arg-type]


def test_highest_priority_fitting_kernel_wins(scratch_op: str) -> None:
    register(scratch_op, "slow", caps(priority=0))(fake("slow"))
    register(scratch_op, "fast", caps(priority=5))(fake("fast"))
    register(scratch_op, "gpu", caps(priority=10, devices=frozenset({"cuda"})))(fake("gpu"))
    k = select(Need(scratch_op, frozenset({"f"})), CPU, torch.float32)
    assert k.backend == "fast"
    assert k.fn() == "fast"


@pytest.mark.parametrize(
    ("best", "need", "dtype"),
    [
        (caps(priority=9, dtypes=frozenset({torch.bfloat16})), Need("?", frozenset({"f"})), torch.float32),
        (caps(priority=9, features=frozenset({"f"})), Need("?", frozenset({"f", "g"})), torch.float32),
        (
            caps(priority=9, head_dims=frozenset({64, 128})),
            Need("?", frozenset(), frozenset({80})),
            torch.float32,
        ),
    ],
    ids=["dtype", "feature", "head_dim"],
)
def test_a_kernel_lacking_a_capability_is_skipped(
    scratch_op: str, best: Capabilities, need: Need, dtype: torch.dtype
) -> None:
    """The high-priority kernel lacks one capability of the need; the plain one is picked instead."""
    register(scratch_op, "plain", caps())(fake("plain"))
    register(scratch_op, "special", best)(fake("special"))
    k = select(Need(scratch_op, need.features, need.head_dims), CPU, dtype)
    assert k.backend == "plain"


def test_no_fitting_kernel_says_what_each_lacks(scratch_op: str) -> None:
    register(scratch_op, "gpu", caps(devices=frozenset({"cuda"})))(fake("gpu"))
    register(scratch_op, "half", caps(dtypes=frozenset({torch.float16})))(fake("half"))
    with pytest.raises(KernelSelectionError) as info:
        select(Need(scratch_op), CPU, torch.float32)
    assert str(info.value) == (
        f"no kernel for op {scratch_op!r} on cpu/torch.float32: "
        "gpu: lacks device cpu (has cuda); half: lacks dtype float32"
    )


def test_env_override_beats_priority(scratch_op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    register(scratch_op, "slow", caps(priority=0))(fake("slow"))
    register(scratch_op, "fast", caps(priority=5))(fake("fast"))
    monkeypatch.setenv(f"DAYZERO_KERNEL_{scratch_op.upper()}", "slow")
    assert select(Need(scratch_op), CPU, torch.float32).backend == "slow"


def test_registering_a_kernel_twice_is_refused(scratch_op: str) -> None:
    register(scratch_op, "one", caps())(fake("one"))
    with pytest.raises(ValueError, match=rf"kernel '{scratch_op}/one' is registered twice"):
        register(scratch_op, "one", caps())(fake("again"))


def test_op_table_unions_needs_and_refuses_unselected_ops() -> None:
    ops = OpTable(CPU, torch.float32)
    ops.need("rms_norm")
    ops.need("rms_norm", {"weight_in_fp32"})
    ops.need("rope", {"neox"})
    ops.resolve()
    assert ops._needs["rms_norm"].features == frozenset({"weight_in_fp32"})
    assert ops.chosen() == {"rms_norm": "reference", "rope": "reference"}
    assert ops.rms_norm is rms_norm
    with pytest.raises(AttributeError, match="op 'softcap' was not selected for this model"):
        _ = ops.softcap


# ---- linear ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_reference_linear_few_rows_equal_the_matmul(seed: int) -> None:
    """The fp32 CPU linear's few-rows form (W @ x^T, one row padded to two) against F.linear in
    fp64, for 1 .. SMALL_M + 1 rows, with and without a bias: within fp32 rounding of a K = 576
    dot product (2e-5 of the rows' scale), a contiguous [M, N]; bf16 rows take F.linear as is."""
    g = torch.Generator().manual_seed(seed)
    w, b = torch.randn(1536, 576, generator=g), torch.randn(1536, generator=g)
    for m in range(1, SMALL_M + 2):
        x = torch.randn(m, 576, generator=g)
        for bias in (None, b):
            want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
            got = linear(x, w, bias)
            assert got.shape == (m, 1536) and got.is_contiguous() and got.dtype == torch.float32
            assert (got.double() - want).abs().max() <= 2e-5 * want.abs().max(), (m, bias is None)
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(linear(xb, wb), F.linear(xb, wb))


# ---- paged GQA attention ---------------------------------------------------------------------

H, HK, D, BS = 6, 2, 8, 4
ROWS = [(7, 7), (3, 12), (1, 9), (1, 1), (5, 14)]  # (new tokens, kv length): prefill, prefix+chunk, decode


def paged_case(
    rows: list[tuple[int, int]], window: int | None, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedMeta, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Random per-row K/V sequences scattered into a paged cache through shuffled block tables.

    Slots no query may read (spare blocks, block tails past kv_len, blocks a sliding window has
    freed, marked -1 in the table) hold NaN, so any stray read poisons the output."""
    blocks_per_row = [math.ceil(kv / BS) for _, kv in rows]
    n_blocks = sum(blocks_per_row) + 3
    perm = torch.randperm(n_blocks, generator=gen).tolist()
    k_cache = torch.full((n_blocks * BS, HK, D), float("nan"))
    v_cache = torch.full((n_blocks * BS, HK, D), float("nan"))
    table = torch.full((len(rows), max(blocks_per_row) + 1), -1, dtype=torch.int32)
    seqs, positions, slots, starts = [], [], [], [0]
    for r, (n, kv) in enumerate(rows):
        ks, vs = torch.randn(kv, HK, D, generator=gen), torch.randn(kv, HK, D, generator=gen)
        seqs.append((ks, vs))
        first = kv - n
        lo = 0 if window is None else max(0, first - window + 1)
        for b in range(blocks_per_row[r]):
            block = perm.pop()
            if (b + 1) * BS <= lo:
                continue  # freed by the window: stays -1, its slots stay NaN
            table[r, b] = block
            for j in range(max(b * BS, lo), min((b + 1) * BS, kv)):
                k_cache[block * BS + j % BS], v_cache[block * BS + j % BS] = ks[j], vs[j]
        pos = torch.arange(first, kv)
        positions.append(pos)
        slots.append(table[r, pos // BS].long() * BS + pos % BS)
        starts.append(starts[-1] + n)
    t = starts[-1]
    q = torch.randn(t, H, D, generator=gen)
    meta = PagedMeta(
        query_start=torch.tensor(starts, dtype=torch.int32),
        kv_lens=torch.tensor([kv for _, kv in rows], dtype=torch.int32),
        positions=torch.cat(positions),
        block_table=table,
        slots=torch.cat(slots),
        block_size=BS,
        query_start_cpu=tuple(starts),
        kv_lens_cpu=tuple(kv for _, kv in rows),
    )
    return q, k_cache, v_cache, meta, seqs


def allowed(first: int, n: int, kv: int, window: int | None) -> torch.Tensor:
    """[n, kv] bool: query at position p sees keys j with p - window < j <= p."""
    p = torch.arange(first, first + n)[:, None]
    j = torch.arange(kv)[None, :]
    m = j <= p
    return m if window is None else m & (j > p - window)


ATTENTION = {"reference": reference_attention, "batched": batched_attention}
DECODE_ROWS = [(1, 9), (1, 1), (1, 14), (1, 6)]  # decode only: the batched kernel's matmul path


@pytest.mark.parametrize("rows", [ROWS, DECODE_ROWS], ids=["mixed", "decode"])
@pytest.mark.parametrize("backend", ATTENTION)
@pytest.mark.parametrize("window", [None, 4, 1], ids=["causal", "window4", "window1"])
@pytest.mark.parametrize("seed", SEEDS)
def test_gqa_attention_matches_sdpa(seed: int, window: int | None, backend: str, rows: list) -> None:
    """fp32 kernel vs fp64 SDPA (enable_gqa, explicit boolean mask) on each row's logical sequence; 1e-5."""
    gen = torch.Generator().manual_seed(seed)
    q, kc, vc, meta, seqs = paged_case(rows, window, gen)
    scale = 0.3
    out = ATTENTION[backend](q, kc, vc, meta, scale, window)
    assert out.shape == q.shape and torch.isfinite(out).all()
    for r, (n, kv) in enumerate(rows):
        a, b = meta.query_start_cpu[r], meta.query_start_cpu[r + 1]
        ks, vs = seqs[r]
        want = F.scaled_dot_product_attention(
            q[a:b].double().transpose(0, 1),  # [H, n, D]
            ks.double().transpose(0, 1),  # [Hk, kv, D]
            vs.double().transpose(0, 1),
            attn_mask=allowed(kv - n, n, kv, window),
            scale=scale,
            enable_gqa=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[a:b].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ATTENTION)
@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
@pytest.mark.parametrize("seed", SEEDS)
def test_gqa_attention_softcap_matches_manual_formula(seed: int, window: int | None, backend: str) -> None:
    """s = cap * tanh(scale * q.k / cap), masked softmax, @ V; query head h reads kv head h // (H / Hk)."""
    gen = torch.Generator().manual_seed(seed)
    q, kc, vc, meta, seqs = paged_case(ROWS, window, gen)
    q = q * 4  # scores of several units, so the cap bends them
    scale, cap = D**-0.5, 2.5
    out = ATTENTION[backend](q, kc, vc, meta, scale, window, cap)
    uncapped = ATTENTION[backend](q, kc, vc, meta, scale, window)
    assert not torch.allclose(out, uncapped, atol=1e-3)  # the cap is not a no-op here
    kv_head = torch.arange(H) // (H // HK)
    for r, (n, kv) in enumerate(ROWS):
        a, b = meta.query_start_cpu[r], meta.query_start_cpu[r + 1]
        ks, vs = (x.double()[:, kv_head] for x in seqs[r])  # [kv, H, D]
        s = torch.einsum("nhd,jhd->hnj", q[a:b].double(), ks) * scale
        s = cap * torch.tanh(s / cap)
        s = s.masked_fill(~allowed(kv - n, n, kv, window), float("-inf"))
        want = torch.einsum("hnj,jhd->nhd", s.softmax(-1), vs)
        torch.testing.assert_close(out[a:b].double(), want, atol=1e-5, rtol=1e-5)


def test_kv_write_puts_each_token_at_its_slot() -> None:
    gen = torch.Generator().manual_seed(SEEDS[2])
    kc, vc = torch.zeros(16, HK, D), torch.zeros(16, HK, D)
    k, v = torch.randn(5, HK, D, generator=gen), torch.randn(5, HK, D, generator=gen)
    slots = torch.tensor([9, 2, 15, 0, 4])
    kv_write(k, v, kc, vc, slots)
    assert torch.equal(kc[slots], k) and torch.equal(vc[slots], v)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert (kc[untouched] == 0).all() and (vc[untouched] == 0).all()


# ---- MoE routing ----------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
def test_moe_route_matches_beam_router(seed: int, renormalize: bool) -> None:
    """Grouped sigmoid routing with a correction bias vs transformers' BeamTopKRouter: same expert
    sets per token, weights within 1e-6."""
    from transformers import BeamConfig
    from transformers.models.beam.modeling_beam import BeamTopKRouter

    e, k, groups, topk_groups, hidden, t = 16, 4, 4, 2, 32, 40
    cfg = BeamConfig(
        hidden_size=hidden,
        num_experts=e,
        num_experts_per_tok=k,
        n_group=groups,
        topk_group=topk_groups,
        norm_topk_prob=renormalize,
    )
    gen = torch.Generator().manual_seed(seed)
    router = BeamTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, hidden, generator=gen) / hidden**0.5)
        router.e_score_correction_bias.copy_(0.3 * torch.randn(e, generator=gen))
    x = torch.randn(t, hidden, generator=gen)
    with torch.no_grad():
        logits, want_w, want_ids = router(x)
    w, ids = moe_route(logits, k, "sigmoid", router.e_score_correction_bias, groups, topk_groups, renormalize)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and w.shape == (t, k)
    for i in range(t):
        assert set(ids[i].tolist()) == set(want_ids[i].tolist()), i
    got_sorted = w.gather(1, ids.argsort(dim=1))
    want_sorted = want_w.gather(1, want_ids.argsort(dim=1))
    torch.testing.assert_close(got_sorted, want_sorted, atol=1e-6, rtol=0)
    groups_used = (ids // (e // groups)).tolist()
    assert all(len(set(g)) <= topk_groups for g in groups_used)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
def test_moe_route_softmax_without_groups(seed: int, renormalize: bool) -> None:
    """Softmax routing, one group, no bias: the top-k of softmax(logits), optionally renormalised."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(24, 12, generator=gen)
    w, ids = moe_route(logits, 3, "softmax", None, 1, 1, renormalize)
    probs = logits.double().softmax(-1)
    top = probs.topk(3, dim=-1)
    want_w = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
    for i in range(logits.shape[0]):
        assert set(ids[i].tolist()) == set(top.indices[i].tolist()), i
    torch.testing.assert_close(
        w.double().gather(1, ids.argsort(1)), want_w.gather(1, top.indices.argsort(1)), atol=1e-6, rtol=0
    )
    if renormalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(24), atol=1e-6, rtol=0)


# ---- RoPE ----------------------------------------------------------------------------------


def hf_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """transformers' llama apply_rotary_pos_emb on x [T, H, R], cos/sin built as LlamaRotaryEmbedding does."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, R]
    out, _ = apply_rotary_pos_emb(x, x, emb.cos(), emb.sin(), unsqueeze_dim=1)
    return out


def inv_freq_of(rotary_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)).float()


@pytest.mark.parametrize("seed", SEEDS)
def test_rope_neox_matches_transformers(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(20, 3, 32, generator=gen)
    positions = torch.randint(0, 4096, (20,), generator=gen)
    inv = inv_freq_of(32, 10000.0)
    torch.testing.assert_close(
        rope(x, positions, inv, True), hf_rope(x, positions, inv), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_partial_rope_rotates_the_head_and_keeps_the_tail(seed: int) -> None:
    """rotary_dim 8 of head 24: the first 8 channels as transformers rotates them, the other 16 untouched."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(11, 4, 24, generator=gen)
    positions = torch.randint(0, 2048, (11,), generator=gen)
    inv = inv_freq_of(8, 500000.0)
    out = rope(x, positions, inv, True)
    torch.testing.assert_close(out[..., :8], hf_rope(x[..., :8], positions, inv), atol=1e-5, rtol=1e-5)
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert not torch.allclose(out[..., :8], x[..., :8])


@pytest.mark.parametrize("seed", SEEDS)
def test_interleaved_rope_is_neox_on_permuted_channels(seed: int) -> None:
    """GPT-J pairs (2j, 2j+1) = neox pairs (j, j + R/2) after gathering even then odd channels."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 2, 16, generator=gen)
    positions = torch.randint(0, 1000, (9,), generator=gen)
    inv = inv_freq_of(16, 10000.0)
    perm = torch.cat((torch.arange(0, 16, 2), torch.arange(1, 16, 2)))
    torch.testing.assert_close(
        rope(x, positions, inv, False)[..., perm],
        rope(x[..., perm], positions, inv, True),
        atol=1e-6,
        rtol=1e-6,
    )


# ---- sampling ------------------------------------------------------------------------------

V = 50


SAMPLERS = {"reference": reference_sample, "batched": batched_sample}


@pytest.fixture(params=sorted(SAMPLERS))
def sample(request) -> Callable:
    """sample(logits, temperature, top_k, top_p, generators, min_p=None) through one backend."""
    fn = SAMPLERS[request.param]

    def call(logits, temp, top_k, top_p, gens, min_p=None):
        min_p = torch.zeros_like(temp) if min_p is None else min_p
        on = temp > 0
        batch = SamplingBatch(
            temperature=temp.float(),
            top_k=top_k.long(),
            top_p=top_p.float(),
            min_p=min_p.float(),
            generators=tuple(gens),
            sampled_rows=tuple(on.nonzero().flatten().tolist()),
            top_k_on=bool(((top_k > 0) & on).any()),
            top_p_on=bool(((top_p < 1) & on).any()),
            min_p_on=bool(((min_p > 0) & on).any()),
        )
        return fn(logits, batch)

    return call


def rows(n: int, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((n,), value, dtype=dtype)


def logits_for(seed: int, s: int = 8) -> torch.Tensor:
    return 3 * torch.randn(s, V, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", SEEDS)
def test_temperature_zero_is_argmax(seed: int, sample) -> None:
    logits = logits_for(seed)
    tokens, _ = sample(logits, rows(8, 0.0), rows(8, 0, torch.int64), rows(8, 1.0), [None] * 8)
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("seed", SEEDS)
def test_top_k_one_is_argmax_at_any_temperature(seed: int, sample) -> None:
    logits = logits_for(seed)
    temps = torch.tensor([0.05, 0.3, 1.0, 2.0, 5.0, 20.0, 100.0, 1e4])
    gens = [torch.Generator().manual_seed(seed * 100 + i) for i in range(8)]
    tokens, _ = sample(logits, temps, rows(8, 1, torch.int64), rows(8, 1.0), gens)
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("seed", SEEDS)
def test_tiny_top_p_keeps_only_the_top_token(seed: int, sample) -> None:
    logits = logits_for(seed)
    gens = [torch.Generator().manual_seed(seed + i) for i in range(8)]
    tokens, _ = sample(logits, rows(8, 50.0), rows(8, 0, torch.int64), rows(8, 1e-6), gens)
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("seed", SEEDS)
def test_top_k_draws_stay_in_the_top_k(seed: int, sample) -> None:
    """256 draws at temperature 3 with top_k 3: every token is one of the 3 largest logits."""
    logits = logits_for(seed, 1).expand(256, V)
    gens = [torch.Generator().manual_seed(seed + 1000 * i) for i in range(256)]
    tokens, _ = sample(logits, rows(256, 3.0), rows(256, 3, torch.int64), rows(256, 1.0), gens)
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(tokens.tolist()) <= top3
    assert len(set(tokens.tolist())) > 1  # really sampled, not greedy


@pytest.mark.parametrize("seed", SEEDS)
def test_top_p_draws_stay_in_the_nucleus(seed: int, sample) -> None:
    """top_p 0.6: every token lies in the smallest prefix of the sorted distribution with mass >= 0.6."""
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed)).expand(256, V)
    probs, order = logits[0].softmax(-1).sort(descending=True)
    nucleus = set(order[: int((probs.cumsum(-1) < 0.6).sum()) + 1].tolist())
    gens = [torch.Generator().manual_seed(seed + 1000 * i) for i in range(256)]
    tokens, _ = sample(logits, rows(256, 1.0), rows(256, 0, torch.int64), rows(256, 0.6), gens)
    assert set(tokens.tolist()) <= nucleus
    assert len(set(tokens.tolist())) > 1


def draws(sample, logits: torch.Tensor, gen_seed: int, n: int = 64) -> list[int]:
    g = torch.Generator().manual_seed(gen_seed)
    one = (rows(1, 1.0), rows(1, 0, torch.int64), rows(1, 1.0))
    return [int(sample(logits, *one, [g])[0]) for _ in range(n)]


@pytest.mark.parametrize("seed", SEEDS)
def test_seeded_generators_reproduce_and_differ(seed: int, sample) -> None:
    """Same generator seed -> the same 64 tokens; another seed -> a different sequence."""
    gen = torch.Generator().manual_seed(seed)
    logits = 0.5 * torch.randn(1, V, generator=gen)  # flat-ish: many candidate tokens
    a, b, c = draws(sample, logits, seed), draws(sample, logits, seed), draws(sample, logits, seed + 1)
    assert a == b
    assert a != c
    assert len(set(a)) > 5


@pytest.mark.parametrize("seed", SEEDS)
def test_logprobs_are_log_softmax_at_the_chosen_token(seed: int, sample) -> None:
    """Greedy and sampled rows alike report log_softmax(logits)[token] (the unmodified distribution), 1e-6."""
    logits = logits_for(seed)
    temps = torch.tensor([0.0, 0.7, 1.0, 1.5, 0.0, 2.0, 0.3, 1.0])
    top_k = torch.tensor([0, 5, 0, 10, 0, 0, 2, 0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 1.0, 1.0, 0.5])
    gens = [torch.Generator().manual_seed(seed + i) for i in range(8)]
    tokens, logprobs = sample(logits, temps, top_k, top_p, gens)
    assert tokens.dtype == torch.int64
    want = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_min_p_draws_stay_above_the_threshold(seed: int, sample) -> None:
    """min_p 0.2: every token has p >= 0.2 * max p (p at the temperature), and draws vary."""
    logits = 0.5 * torch.randn(1, V, generator=torch.Generator().manual_seed(seed)).expand(256, V)
    p = (logits[0] / 0.8).softmax(-1)
    allowed = set((p >= 0.2 * p.max()).nonzero().flatten().tolist())
    gens = [torch.Generator().manual_seed(seed + 1000 * i) for i in range(256)]
    tokens, _ = sample(
        logits, rows(256, 0.8), rows(256, 0, torch.int64), rows(256, 1.0), gens, rows(256, 0.2)
    )
    assert set(tokens.tolist()) <= allowed
    assert len(set(tokens.tolist())) > 1


@pytest.mark.parametrize("seed", SEEDS)
def test_batched_draws_follow_the_distribution(seed: int) -> None:
    """4,000 seeded draws of the batched sampler at temperature 1.3, top_k 6, top_p 0.9 against
    the filtered distribution the reference defines (reference.filtered): every token inside its
    support, each token's frequency within 5 standard errors of its probability."""
    from dayzero.kernels.reference.sampling import filtered

    n = 4000
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed)).expand(n, V)
    want = filtered(logits[0] / 1.3, 6, 0.9, 0.0).softmax(-1)
    batch = SamplingBatch(
        temperature=rows(n, 1.3), top_k=rows(n, 6, torch.int64), top_p=rows(n, 0.9), min_p=rows(n, 0.0),
        generators=tuple(torch.Generator().manual_seed(seed * 10_000 + i) for i in range(n)),
        sampled_rows=tuple(range(n)), top_k_on=True, top_p_on=True,
    )  # fmt: skip
    tokens, _ = batched_sample(logits, batch)
    freq = torch.bincount(tokens, minlength=V).double() / n
    assert set(tokens.tolist()) <= set(want.nonzero().flatten().tolist())
    se = (want.double() * (1 - want.double()) / n).sqrt()
    assert ((freq - want.double()).abs() <= 5 * se + 1e-9).all(), (freq, want)


# ---- batched MoE (grouped GEMM) against the reference loop --------------------------------------


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
@pytest.mark.parametrize("tokens", [37, 3], ids=["grouped_gemm", "gathered"])
@pytest.mark.parametrize("fp32", [True, False], ids=["fp32_act", "native_act"])
@pytest.mark.parametrize("seed", SEEDS)
def test_grouped_moe_experts_match_the_reference_loop(seed: int, fp32: bool, tokens: int) -> None:
    """Same routed tokens through both: fp32 within 1e-5; bf16 within 2e-2 of the fp32 result
    (the grouped kernel sums the k expert outputs in fp32, the loop in bf16)."""
    from dayzero.kernels.batched.moe import moe_experts as grouped
    from dayzero.kernels.reference.moe import moe_experts as loop

    gen = torch.Generator().manual_seed(seed)
    t, e, k, dm, inter = tokens, 12, 3, 64, 32  # 3 tokens x 3 = 9 pairs: the gather path
    x = torch.randn(t, dm, generator=gen)
    gate_up = torch.randn(e, 2 * inter, dm, generator=gen) / dm**0.5
    down = torch.randn(e, dm, inter, generator=gen) / inter**0.5
    logits = torch.randn(t, e, generator=gen)
    w, ids = moe_route(logits, k, "sigmoid")
    ids[0] = torch.tensor([0, 5, 11])  # experts at both ends of the range, some experts unused
    want = loop(x, gate_up, down, w, ids, fp32)
    got = grouped(x, gate_up, down, w, ids, fp32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got16 = grouped(x.bfloat16(), gate_up.bfloat16(), down.bfloat16(), w, ids, fp32)
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("seed", SEEDS)
def test_swiglu_limit_clamps_gate_above_and_up_both_ways(seed: int) -> None:
    from dayzero.kernels.reference.basic import swiglu

    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(64, 32, generator=g) * 4, torch.randn(64, 32, generator=g) * 4
    want = F.silu(gate.clamp(max=2.5)) * up.clamp(-2.5, 2.5)  # GLM-5.3-Flash's SwiGLU limit
    assert torch.allclose(swiglu(gate, up, limit=2.5), want, atol=0, rtol=0)
    assert torch.allclose(swiglu(gate, up, fp32=True, limit=2.5), want, atol=1e-6)
    assert (gate < -2.5).any()  # the gate is not clamped from below: silu handles it


def _penalties(s: int, out=None, prompt=None, **kw) -> Penalties:
    """Penalties of s rows; out / prompt: {row: its output / prompt tokens} for the rows with
    token state (dense counts and prompt masks, as the engine's device state holds them)."""
    empty = torch.zeros(0, dtype=torch.int64)
    have = sorted(set(out or {}) | set(prompt or {}))
    counts = torch.zeros(len(have), V, dtype=torch.int32)
    seen = torch.zeros(len(have), V, dtype=torch.bool)
    for j, r in enumerate(have):
        for t in (out or {}).get(r, []):
            counts[j, t] += 1
        seen[j, (prompt or {}).get(r, [])] = True
    base = dict(
        presence=rows(s, 0.0), frequency=rows(s, 0.0), repetition=rows(s, 1.0),
        rows=torch.tensor(have, dtype=torch.int64), counts=counts, prompt=seen,
        bias_rows=empty, bias_toks=empty, bias_vals=torch.zeros(0), ban_rows=empty, ban_toks=empty,
    )  # fmt: skip
    return Penalties(**(base | kw))


@pytest.mark.parametrize("seed", SEEDS)
def test_penalized_logits_match_a_loop_over_tokens(seed: int) -> None:
    """penalized() against the per-token definitions: bias added; repetition divides positive and
    multiplies negative logits of seen tokens (prompt or output); frequency * count + presence
    subtracted for output tokens; banned tokens -inf (3 rows, tokens repeated, row 1 with no
    token state)."""
    from dayzero.kernels.reference.sampling import penalized

    g = torch.Generator().manual_seed(seed)
    logits = logits_for(seed, 3)
    out = {0: [3, 3, 7, 9], 2: [1, 1, 1]}
    prompt = {0: [2, 3, 11], 2: [5]}
    seen = {r: prompt[r] + out[r] for r in out}
    bias = [(0, 4, 2.5), (2, 6, -3.0), (0, 3, 1.0), (1, 8, 0.5)]
    ban = [(2, 8), (2, 9), (1, 0)]
    pres, freq = torch.tensor([0.5, 0.7, -0.3]), torch.tensor([0.25, 0.6, 1.0])
    rep = torch.rand(3, generator=g) + 1.0
    p = _penalties(
        3, out, prompt, presence=pres, frequency=freq, repetition=rep,
        bias_rows=torch.tensor([b[0] for b in bias]), bias_toks=torch.tensor([b[1] for b in bias]),
        bias_vals=torch.tensor([b[2] for b in bias]),
        ban_rows=torch.tensor([b[0] for b in ban]), ban_toks=torch.tensor([b[1] for b in ban]),
    )  # fmt: skip
    want = logits.clone()
    for r, t, v in bias:
        want[r, t] += v
    for r in out:
        for t in set(seen[r]):
            z = want[r, t]
            want[r, t] = z / rep[r] if z > 0 else z * rep[r]
        for t in set(out[r]):
            want[r, t] -= freq[r] * out[r].count(t) + pres[r]
    for r, t in ban:
        want[r, t] = float("-inf")
    torch.testing.assert_close(penalized(logits, p), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", sorted(SAMPLERS))
@pytest.mark.parametrize("seed", SEEDS)
def test_penalties_steer_both_samplers_alike(seed: int, backend: str) -> None:
    """Greedy under penalties is argmax of the penalized logits (both backends), and the
    reported logprob is the model's, before the penalties."""
    from dayzero.kernels.reference.sampling import penalized

    logits = logits_for(seed)
    top = logits.argmax(-1)
    s = logits.shape[0]
    p = _penalties(s, {r: [int(top[r])] for r in range(s)}, frequency=rows(s, 2.0))
    batch = SamplingBatch(
        temperature=rows(s, 0.0), top_k=rows(s, 0, torch.int64), top_p=rows(s, 1.0), min_p=rows(s, 0.0),
        generators=(None,) * s, sampled_rows=(), penalties=p,
    )  # fmt: skip
    fn = SAMPLERS[backend]
    tokens, lp = fn(logits, batch)
    assert torch.equal(tokens, penalized(logits, p).argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))
