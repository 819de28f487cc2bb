"""Decode steps through the CUDA graphs' static buffers (sdk/engine/graphs.py), run eagerly on the
CPU: padded buckets, staged inputs, scratch slots for the padding rows' keys (and recurrent
states). The same requests decode to the same tokens, with logprobs within 1e-5 (fp32; the
padding rows only add rows), as the plain path; prefill and mixed steps still take the plain
path. The GPU test (tests/test_triton_cuda.py) checks that capture and replay equal these
buffers run eagerly."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import SEEDS

from dayzero.sdk.api import LLM
from dayzero.sdk.engine.engine import EngineConfig, SamplingParams
from dayzero.sdk.engine.graphs import _where, decode_only
from dayzero.sdk.parity.runner import RETRACTION, retraction_budget
from dayzero.sdk.parity.tiny import write_tiny

LOGPROB_TOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "beam", "glm53"])
def checkpoint(request, tmp_path_factory):
    return write_tiny(request.param, tmp_path_factory.mktemp(request.param) / "ckpt", seed=3)


def _llm(path, mode: str) -> LLM:
    cfg = EngineConfig(block_size=4, kv_cache_bytes=4 << 20, max_batch_size=6, decode_graphs=mode)
    return LLM(path, device="cpu", progress=False, engine=cfg)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_buffered_decode_equals_the_plain_path(checkpoint, seed: int) -> None:
    if "glm53" in str(checkpoint) and seed != SEEDS[0]:  # MLA + the DSA indexer: the slowest engine
        pytest.skip("GLM-5.3 runs on the first seed only (CI time)")
    rng = np.random.default_rng(seed)
    vocab = 100
    prompts = [rng.integers(1, vocab, n).tolist() for n in (3, 9, 17, 6, 25)]  # 5 rows: bucket 6
    # staggered lengths: rows join and leave, so buckets 1..6 and block boundaries are crossed
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (12, 4, 9, 15, 1)]
    outs = {}
    for mode in ("off", "buffers"):
        llm = _llm(checkpoint, mode)
        outs[mode] = llm.engine.generate(prompts, params)
        steps = llm.engine.stats["graph_steps"]
        assert (steps > 0) == (mode == "buffers"), steps
    for plain, buffered in zip(outs["off"], outs["buffers"], strict=True):
        assert buffered.token_ids == plain.token_ids
        assert max(abs(a - b) for a, b in zip(buffered.logprobs, plain.logprobs, strict=True)) < LOGPROB_TOL


def test_padding_rows_write_only_the_scratch_page(checkpoint) -> None:
    _padding_rows_write_only_scratch(_llm(checkpoint, "buffers").engine)


def _padding_rows_write_only_scratch(eng) -> None:
    """A decode row run alone (bucket 1), then again padded to bucket 2: outside the scratch page
    (and scratch state slot) the second run changes only the row's own new-token slots and its
    own state slot (the same keys up to rounding: a 2-row matmul sums in another order)."""
    eng.add([5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    eng.step()  # the prefill (plain path)
    plan = eng.scheduler.step()
    assert decode_only(plan) and plan.rows == 1
    eng.graphs.run(plan)
    before = eng.pool.pool.clone()
    eng.graphs._fill(plan, 2)
    with torch.inference_mode():
        eng.model(eng.graphs._context(2, (int(plan.kv_lens[0]), 0), plan))
    lay, base = eng.pool.layout, eng.pool.state_bytes
    allowed = torch.zeros_like(before, dtype=torch.bool)
    scratch = base + lay["num_pages"] * lay["page_bytes"]
    allowed[scratch:] = True
    pos = int(plan.positions[0])
    for j, g in enumerate(eng.graphs.groups):
        slot = int(np.asarray(plan.block_tables[g])[0, pos // 4]) * 4 + pos % 4
        row = lay["padded_row_bytes"][g]
        allowed[base + slot * row : base + (slot + 1) * row] = True
        assert eng.graphs.vec[(3 + j) * 6 + 1] == eng.pool.scratch_slot(g)  # the padding row's slot
    if eng.graphs.state:  # the row's own state slot and the scratch one
        n = lay["state_slot_bytes"]
        for slot in (int(plan.state_slots[0]), eng.pool.scratch_state_slot()):
            allowed[slot * n : (slot + 1) * n] = True
        changed = eng.pool.pool != before
        own = int(plan.state_slots[0]) * n
        assert bool(changed[own : own + n].any()), "the row's state was not updated"
        scratch_state = eng.pool.scratch_state_slot() * n
        assert bool(changed[scratch_state : scratch_state + n].any()), "the padding row wrote no state"
    changed = eng.pool.pool != before
    assert bool(changed[scratch:].any()), "the padding row wrote no key"
    assert not bool((changed & ~allowed).any()), (changed & ~allowed).nonzero()[:8]


def test_decode_graphs_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="decode_graphs 'on'; known: auto, off, buffers"):
        EngineConfig(decode_graphs="on")


def test_a_failed_capture_names_the_op_outside_torch() -> None:
    """The capture report says which of our ops was not capturable (torch's frames skipped)."""

    def not_capturable(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x], dim=5)  # raises inside torch

    with pytest.raises(IndexError) as e:
        not_capturable(torch.ones(2))
    assert _where(e.value).startswith("at tests/test_decode_graphs.py:"), _where(e.value)
    assert _where(e.value).endswith(" in not_capturable")


# A padding row changes the step's matmul shapes and with them the rounding of the real rows
# (CPU sgemm: 3 rows vs 4 differ by ~4e-6 on these sizes); the recurrent states and the KV
# carry that into later steps. Measured: buckets without padding give the same bits; the tests
# below, |dlogit| <= 2.5e-5 / 3.4e-5 (seeds 0, 1), 1.0e-5 (retraction), 4.0e-6 (GLM-5.3's DSA)
# on logits up to 4.4.
FLASH_LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    """GLM-5.3-Flash with the KPool indexer's top-k (8 positions: two pools of 4) below most
    prompts: its selections are sparse in the tests below."""
    over = {"text_config": {"index_topk": 8, "index_kpool": 4}}
    return write_tiny("glm53_flash", tmp_path_factory.mktemp("flash") / "ckpt", seed=3, overrides=over)


def test_padding_rows_write_only_the_scratch_page_and_state_slot(flash) -> None:
    _padding_rows_write_only_scratch(_llm(flash, "buffers").engine)


def _logged(llm: LLM) -> list[torch.Tensor]:
    """The model's logits of every step, as the engine computed them ([rows (+ padding), V])."""
    logs: list[torch.Tensor] = []
    llm.engine.model.register_forward_hook(lambda _m, _i, out: logs.append(out.clone()))
    return logs


def _compare_modes(path, cfg: EngineConfig, waves, stat: str) -> None:
    """The same waves of requests through the plain path and the decode buffers: equal tokens,
    every step's logits within FLASH_LOGIT_TOL; the buffers ran padded decode steps, and
    stats[stat] (prefix hits or retractions; "graph_steps": nothing more) happened in both."""
    outs, logs, stats = {}, {}, {}
    for mode in ("off", "buffers"):
        llm = LLM(path, device="cpu", progress=False, engine=replace(cfg, decode_graphs=mode))
        logs[mode] = _logged(llm)
        outs[mode] = [llm.engine.generate(prompts, params) for prompts, params in waves]
        stats[mode] = dict(llm.engine.stats)
        stats[mode]["cached"] = sum(o.cached_tokens for wave in outs[mode] for o in wave)
    assert stats["buffers"]["graph_steps"] > 0 and stats["off"]["graph_steps"] == 0
    if stat != "graph_steps":
        assert stats["off"][stat] > 0 and stats["buffers"][stat] == stats["off"][stat], stats
    assert len(logs["off"]) == len(logs["buffers"])
    padded = 0
    for plain, buffered in zip(logs["off"], logs["buffers"], strict=True):
        padded += buffered.shape[0] > plain.shape[0]
        assert (buffered[: plain.shape[0]] - plain).abs().max().item() < FLASH_LOGIT_TOL
    assert padded > 0
    for wave_off, wave_buf in zip(outs["off"], outs["buffers"], strict=True):
        for plain, buffered in zip(wave_off, wave_buf, strict=True):
            assert buffered.token_ids == plain.token_ids


def _greedy(*lengths: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in lengths]


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_linear_attention_decodes_through_the_buffers(flash, seed: int) -> None:
    """GLM-5.3-Flash (KDA state slots, NoPE MLA with the KPool indexer): the rows' state slots
    and fresh flags in the graph's buffers, padding rows on the scratch state slot. A first wave
    (a one-token prompt: a fresh decode row; 9 tokens: its last prompt token a one-token step
    after the block-boundary snapshot), then a second whose prompts repeat or extend the
    first's (prefix hits restoring the snapshots, one whose only uncached token is a decode
    step)."""
    rng = np.random.default_rng(seed)
    first = [rng.integers(1, 100, n).tolist() for n in (1, 9, 17, 6, 13)]
    second = [first[1], first[2][:12] + rng.integers(1, 100, 3).tolist(), first[4] + [7]]
    waves = [(first, _greedy(12, 5, 9, 15, 2)), (second, _greedy(7, 4, 10))]
    cfg = EngineConfig(block_size=4, kv_cache_bytes=4 << 20, max_batch_size=6)
    _compare_modes(flash, cfg, waves, "cached")


def test_linear_attention_decodes_through_the_buffers_under_retraction(flash) -> None:
    """The same in a KV budget for the longest request alone (retraction_budget): requests are
    retracted (states to host and back) and resumed, with buckets padded (3 rows in 4)."""
    rng = np.random.default_rng(SEEDS[0])
    prompts = [rng.integers(1, 100, n).tolist() for n in (5, 11, 3, 8)]
    params = _greedy(14, 9, 16, 12)
    probe = LLM(flash, device="cpu", progress=False, engine=EngineConfig(decode_graphs="off")).engine
    lengths = [len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True)]
    budget = retraction_budget(probe.groups, lengths, len(prompts))
    kw = dict(RETRACTION, kv_cache_bytes=budget, host_cache_bytes=budget * len(prompts), prefix_cache=False)
    cfg = EngineConfig(max_batch_size=len(prompts), **kw)
    _compare_modes(flash, cfg, [(prompts, params)], "retracted")


def test_sparse_indexer_decodes_through_the_buffers(tmp_path) -> None:
    """GLM-5.3's DSA indexer with index_topk 6 below every prompt but one: decode steps through
    the buffers score the keys over the graph's fixed width (max model length / block size
    blocks: kernels/batched/indexer.py on the CPU, the Triton indexer's contract), the keys past
    each row's length masked; the eager path scores over the step's own table width. The same
    tokens, and logits within FLASH_LOGIT_TOL, with buckets padded (5 rows in 6, 3 in 4)."""
    path = write_tiny("glm53", tmp_path / "ckpt", seed=3, overrides={"index_topk": 6})
    rng = np.random.default_rng(SEEDS[0])
    prompts = [rng.integers(1, 100, n).tolist() for n in (3, 9, 17, 6, 25)]
    cfg = EngineConfig(block_size=4, kv_cache_bytes=4 << 20, max_batch_size=6, max_model_len=64)
    llm = LLM(path, device="cpu", progress=False, engine=replace(cfg, decode_graphs="buffers"))
    assert llm.engine.ops.chosen()["dsa_index"] == "batched"  # the fixed-width indexer
    assert llm.engine.graphs.tables[0].shape[1] == 16  # 64 tokens / 4
    _compare_modes(path, cfg, [(prompts, _greedy(12, 4, 9, 15, 1))], "graph_steps")


def test_qsa_and_ngram_embeddings_decode_through_the_buffers(tmp_path) -> None:
    """Qwen3.8-Flash-Next (Gated DeltaNet states, n-gram histories, QSA with a budget of two
    pools of 4 below most prompts): every op of its decode step has a graph-safe kernel (QSA's
    scores over the graph's fixed width, the attention over each token's selection, the n-gram
    ids and dilated conv as one step over the rows' slots; the CPU's expert loop aside: CUDA takes
    the Triton experts), and decode steps through the buffers give the plain path's tokens,
    logits within FLASH_LOGIT_TOL, with buckets padded and prefix hits in both."""
    over = {"indexer_budget": 8, "indexer_compress_ratio": 4}
    path = write_tiny("qwen38_flash_next", tmp_path / "ckpt", seed=3, overrides=over)
    rng = np.random.default_rng(SEEDS[0])
    prompts = [rng.integers(3, 100, n).tolist() for n in (3, 9, 17, 6, 25)]
    cfg = EngineConfig(block_size=4, kv_cache_bytes=4 << 20, max_batch_size=6, max_model_len=64)
    llm = LLM(path, device="cpu", progress=False, engine=replace(cfg, decode_graphs="buffers"))
    assert set(llm.engine.ops.not_graph_safe()) <= {"moe_experts"}, llm.engine.ops.not_graph_safe()
    chosen = llm.engine.ops.chosen()
    assert (chosen["gqa_attention"], chosen["qsa_scores"]) == ("batched_select", "batched"), chosen
    waves = [(prompts, _greedy(12, 4, 9, 15, 1)), (prompts[2:4], _greedy(6, 6))]
    _compare_modes(path, cfg, waves, "cached")
