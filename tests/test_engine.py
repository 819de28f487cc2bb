"""The engine on a tiny checkpoint: request errors, aborts, stop tokens, seeded sampling, memory."""

from __future__ import annotations

import pytest
import torch
from conftest import SEEDS

from dayzero.sdk.api import LLM
from dayzero.sdk.blocks.mlp import MoE, MoeCfg
from dayzero.sdk.engine.engine import EngineConfig, SamplingParams
from dayzero.sdk.families import FAMILIES, build
from dayzero.sdk.parity.tiny import write_tiny
from dayzero.sdk.spec.reference import reference_config


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    path = write_tiny("beam", tmp_path_factory.mktemp("beam") / "ckpt", seed=1)
    return LLM(path, device="cpu", progress=False, engine=EngineConfig(block_size=8, kv_cache_bytes=8 << 20))


def free(llm: LLM) -> list[int]:
    s = llm.engine.scheduler
    s.flush_prefix_cache()
    return [s.free_blocks(g) for g in range(len(llm.engine.groups))]


def test_bad_requests_are_refused_and_change_nothing(llm: LLM) -> None:
    eng, before = llm.engine, free(llm)
    with pytest.raises(ValueError, match="empty"):
        eng.add([], SamplingParams())
    with pytest.raises(ValueError, match="out of the vocabulary"):
        eng.add([1, 2, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the maximum model length 512"):
        eng.add(list(range(1, 500)), SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert not eng.has_work() and free(llm) == before
    (out,) = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_abort_mid_decode_returns_every_block(llm: LLM) -> None:
    eng, before = llm.engine, free(llm)
    ids = [eng.add(list(range(3, 40)), SamplingParams(max_tokens=50, temperature=0)) for _ in range(3)]
    for _ in range(6):
        eng.step()
    assert all(0 < len(eng.requests[i].token_ids) < 50 for i in ids)
    for i in ids:
        eng.abort(i)
    while eng.has_work():
        eng.step()
    assert [eng.release(i).finish_reason for i in ids] == ["abort"] * 3
    assert free(llm) == before


def test_stop_token_finishes_with_stop(llm: LLM) -> None:
    eng = llm.engine
    (greedy,) = eng.generate([[9, 8, 7, 6]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stop = greedy.token_ids[2]
    for ignore_eos in (False, True):  # ignore_eos drops EOS only, never the request's own stop tokens
        p = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop,), ignore_eos=ignore_eos)
        (out,) = eng.generate([[9, 8, 7, 6]], p)
        assert out.finish_reason == "stop"
        assert out.token_ids == greedy.token_ids[: greedy.token_ids.index(stop) + 1]


@pytest.mark.parametrize("seed", SEEDS)
def test_seeded_sampling_is_reproducible_per_request(llm: LLM, seed: int) -> None:
    eng = llm.engine
    p = SamplingParams(max_tokens=12, temperature=1.5, top_k=50, top_p=0.95, seed=seed)
    a, b = eng.generate([[4, 5, 6], [4, 5, 6]], [p, p])  # same seed, same batch: same tokens
    (c,) = eng.generate([[4, 5, 6]], p)  # alone: still the same
    d = eng.generate([[4, 5, 6]], SamplingParams(max_tokens=12, temperature=1.5, seed=seed + 1000))[0]
    assert a.token_ids == b.token_ids == c.token_ids
    assert d.token_ids != a.token_ids


def test_moe_shared_expert_with_gate_matches_the_formula() -> None:
    """y = routed_scale * sum_k w_k E_k(x) + sigmoid(x w_g) * S(x), softmax routing, 2 seeds."""
    fam = FAMILIES.get("beam")  # any family: only its op table is borrowed
    cfg = fam.config(reference_config(fam.spec.spec.reference, dict(fam.spec.spec.tiny)))
    _, ops = build(fam, cfg, {}, torch.device("cpu"), torch.float32)
    mc = MoeCfg(
        hidden=32,
        experts=6,
        top_k=2,
        intermediate=16,
        score="softmax",
        correction_bias=False,
        groups=1,
        topk_groups=1,
        renormalize=False,
        routed_scale=1.5,
        shared_intermediate=24,
        shared_gate=True,
        fp32=False,
    )
    for seed in SEEDS[:2]:
        g = torch.Generator().manual_seed(seed)
        moe = MoE(mc, ops)
        with torch.no_grad():
            for prm in moe.parameters():
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.3)
        x = torch.randn(9, 32, generator=g)
        probs = (x @ moe.router.T).softmax(-1)
        w, ids = probs.topk(2, dim=-1)
        want = torch.zeros_like(x)
        for t in range(9):
            for j in range(2):
                e = int(ids[t, j])
                gate, up = (moe.gate_up[e] @ x[t]).chunk(2)
                want[t] += w[t, j] * (moe.down[e] @ (torch.nn.functional.silu(gate) * up))
        sg, su = (x @ moe.shared.gate_up.T).chunk(2, -1)
        shared = (torch.nn.functional.silu(sg) * su) @ moe.shared.down.T
        want = 1.5 * want + torch.sigmoid(x @ moe.shared_gate.T) * shared
        torch.testing.assert_close(moe(x), want, atol=1e-5, rtol=1e-5)


def test_cached_tokens_count_the_prefix_hit(llm: LLM) -> None:
    """A request's cached_tokens are the prompt tokens found in the prefix cache at admission:
    whole blocks (8 tokens) of an earlier request's prompt; none for a fresh prompt."""
    eng = llm.engine
    eng.scheduler.flush_prefix_cache()
    prompt = list(range(3, 30))  # 27 tokens: 3 whole blocks
    (first,) = eng.generate([prompt], SamplingParams(max_tokens=2, temperature=0))
    (second,) = eng.generate([[*prompt, 5, 6]], SamplingParams(max_tokens=2, temperature=0))
    assert first.cached_tokens == 0 and second.cached_tokens == 24


def test_a_model_with_no_position_limit_is_bounded_by_its_kv_pool(llm: LLM) -> None:
    """No max_position (a NoPE / linear-attention model) and no --max-model-len: the longest
    request is what the KV pool holds, so a longer one is refused at the door (and decode graphs,
    which need a bound, still capture on CUDA)."""
    from dataclasses import replace

    from dayzero.sdk.engine.engine import Engine

    eng = llm.engine
    cfg = replace(eng.cfg, max_position=None)
    bare = Engine(eng.model, cfg, eng.ops, replace(eng.config, max_model_len=None))
    pages = bare.scheduler.layout["num_pages"]
    assert bare.max_model_len == pages * bare.config.block_size > 512
    with pytest.raises(ValueError, match=f"exceeds the maximum model length {bare.max_model_len}"):
        bare.add([7] * bare.max_model_len, SamplingParams(max_tokens=1))
    (out,) = bare.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    assert len(out.token_ids) == 3
