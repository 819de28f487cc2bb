"""Data-parallel attention (`enable_dp_attention`, sdk/engine/dp.py) on 2 and 4 CPU ranks (gloo):
GLM-5.3 (MLA + DSA, MoE), GLM-5.3-Flash (MLA + KPool, KDA, hyper-connections) and Kimi K3 (gated
MLA, KDA, attention residuals, the latent MoE) give one rank's logits (fp32, within 1e-5 of the
largest |logit|; Kimi K3 2e-5, below) and its greedy tokens through the
whole engine: 16-token prefill chunks, prefix-cache hits (the first prompt alone, then all),
retraction (each rank's pool of 96 tokens holds its own requests only). Each rank runs the
engine with its one scheduler per attention rank, so the plans agree; the LLM test drives the
follower from rank 0's plans instead. Unsupported combinations are refused by name. The ranks
first check the MLP's reduce-scatter of rows on its own (`scatter_rows`).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dayzero.kernels.collective import TpGroup
from dayzero.sdk.api import LLM
from dayzero.sdk.config.model import Parallel
from dayzero.sdk.engine.engine import Engine, EngineConfig, SamplingParams
from dayzero.sdk.engine.geometry import scheduler_groups
from dayzero.sdk.engine.parallel import end_group, init_group, run_ranks
from dayzero.sdk.families import build
from dayzero.sdk.loader import load_weights, open_checkpoint
from dayzero.sdk.parity.parallel import check_prompts, compare_ranks
from dayzero.sdk.parity.tiny import write_tiny

TOL = 1e-5  # relative to the largest |logit|
# Kimi K3's tiny config is noisier in fp32: its logits sit 2.1e-5 to 3.1e-5 of max|logit| from an
# fp64 run of the independent reference (prompts of seeds 5, 6, 7), and one rank and 2 DP ranks
# (which batch the attention otherwise) differ by 1.41e-5 / 1.0e-5 / 4.7e-6 on them while landing
# as close to fp64 (3.3e-5 / 2.7e-5 / 2.2e-5) with the same tokens: summation order (2026-12-05)
TOLS = {"kimi_k3": 2e-5}
SEEDS = {"glm53": 3, "glm53_flash": 4, "kimi_k3": 5}  # the prompts' recorded seed, one a family (CI time)
# top-k past the longest sequence (63 + 12 tokens): every visible key selected. A pruning top-k
# breaks the ReLU scores' exact-zero ties by position, differently for other batch shapes
# (docs/architecture.md, "Sparse attention and ties"), and DP attention batches the requests
# otherwise than one rank does; tests/test_tensor_parallel.py prunes, on identical plans.
PRUNING = {
    "glm53": {"index_topk": 128},
    "glm53_flash": {"text_config": {"index_topk": 128, "index_kpool": 4}},
    "kimi_k3": None,  # no indexer
}
ENGINE = dict(block_size=4, chunk_size=16, max_tokens_per_step=48, max_batch_size=4, host_cache_bytes=0)
# a rank's pool: too few for its share of the prompts at once (retraction); on 4 ranks a rank
# holds one or two of the five requests: a smaller pool (the largest request takes 76 tokens)
KV_TOKENS = {1: 96, 2: 96, 4: 80}


def outputs(rank: int, size: int, port: int, cases: list[tuple[str, list[list[int]]]], out: str) -> None:
    """Rank `rank` of `size` (run_ranks' signature; size 1: in this process, no group): for each
    (checkpoint, prompts), every position's logits (one prefill) and greedy tokens through the
    engine."""
    tp = init_group(size, rank, port=port, timeout_s=60) if size > 1 else TpGroup()
    try:
        if size > 1:
            scatter_rows(tp)
        got = [one(rank, size, tp, path, prompts) for path, prompts in cases]
        if rank == 0:
            torch.save(got, out)
    finally:
        if size > 1:
            end_group(tp)


def scatter_rows(tp: TpGroup) -> None:
    """The MLP's reduce-scatter (TpGroup.scatter_rows): each rank gets its rows of the sum of
    every rank's partial sums (random, recorded seeds 0 and 1), within 1e-6; uneven rows and a
    rank with none."""
    for seed, counts in enumerate(((3, 1, 2, 0)[: tp.size], (0, 2, 1, 3)[: tp.size])):
        parts = torch.randn(tp.size, sum(counts), 5, generator=torch.Generator().manual_seed(seed))
        got = tp.scatter_rows(parts[tp.rank].clone(), counts)  # rank q's partial sums: parts[q]
        start = sum(counts[: tp.rank])
        want = parts.sum(0)[start : start + counts[tp.rank]]
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6), (tp.rank, counts)


def one(rank: int, size: int, tp: TpGroup, path: str, ps: list[list[int]]) -> dict:
    """One checkpoint on this rank: the prompts' logits, then greedy tokens through the engine."""
    ckpt = open_checkpoint(Path(path))
    cfg = ckpt.family.config(ckpt.hf, str(ckpt.path), Parallel(size, rank, size > 1, size > 1))
    model, ops = build(ckpt.family, cfg, ckpt.hf, torch.device("cpu"), torch.float32, tp=tp)
    load_weights(model, ckpt, progress=False)
    groups = scheduler_groups(cfg, 4)
    states = 2 * ENGINE["max_batch_size"] * sum(g.state_bytes for g in groups)
    kv = KV_TOKENS[size] * sum(g.bytes_per_token for g in groups) + states
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with torch.inference_mode():
        whole = EngineConfig(max_tokens_per_step=max(map(len, ps)) * len(ps))
        logits = Engine(model, cfg, ops, whole).prompt_logits(ps)
        eng = Engine(model, cfg, ops, EngineConfig(kv_cache_bytes=kv, **ENGINE))
        outs = eng.generate(ps[:1], greedy) + eng.generate(ps, greedy)  # then: prefix hits
    return {
        "logits": logits,
        "tokens": [o.token_ids for o in outs],
        "logprobs": [o.logprobs for o in outs],
        "cached": [o.cached_tokens for o in outs],
        "stats": dict(eng.stats),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("dp")
    return {f: write_tiny(f, base / f, seed=13, overrides=PRUNING[f]) for f in PRUNING}


@pytest.fixture(scope="module")
def cases(checkpoints) -> list[tuple[str, list[list[int]]]]:
    return [(str(checkpoints[f]), check_prompts(512, SEEDS[f])) for f in PRUNING]


@pytest.fixture(scope="module")
def one_rank(cases, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dp-one") / "one.pt"
    outputs(0, 1, 0, cases, str(out))  # in this process
    return torch.load(out)


@pytest.mark.parametrize("size", [2, 4])
def test_dp_attention_gives_the_logits_and_tokens_of_one_rank(tmp_path, cases, one_rank, size):
    """Every family in one launch of the ranks."""
    run_ranks(outputs, size, (cases, str(tmp_path / "many.pt")), timeout_s=300)
    one, two = one_rank, torch.load(tmp_path / "many.pt")
    for family, a, b in zip(PRUNING, one, two, strict=True):
        seed = SEEDS[family]
        scale = max(t.abs().max().item() for t in a["logits"])
        err = max((x - y).abs().max().item() for x, y in zip(a["logits"], b["logits"], strict=True))
        lp = max(
            abs(x - y)
            for p, q in zip(a["logprobs"], b["logprobs"], strict=True)
            for x, y in zip(p, q, strict=True)
        )
        print(f"{family} seed {seed}, DP attention x{size}: logits {err:.2e} of {scale:.2f}", end=" ")
        print(f"logprobs {lp:.2e}")
        assert err <= TOLS.get(family, TOL) * scale, (err, scale)
        assert b["tokens"] == a["tokens"] and lp <= 1e-4
        assert b["stats"]["retracted"] > 0 and max(b["cached"]) > 0  # the paths under test ran


def test_llm_with_dp_attention_answers_as_one_rank(checkpoints, caplog):
    """Rank 0 plans both ranks' parts and sends them (ranks.py's PARTS message); the follower
    runs its own; the KV report says per rank."""
    path = str(checkpoints["glm53"])
    ps = [{"prompt_token_ids": p} for p in check_prompts(512, 5)[:3]]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [
        c.outputs[0].token_ids
        for c in LLM(path, device="cpu", dtype="float32", progress=False).generate(ps, greedy)
    ]
    with caplog.at_level(logging.INFO, logger="dayzero.sdk.engine.memory"):
        llm = LLM(
            path,
            device="cpu",
            dtype="float32",
            progress=False,
            tensor_parallel_size=2,
            enable_dp_attention=True,
        )
    try:
        got = [c.outputs[0].token_ids for c in llm.generate(ps, greedy)]
        looked_up = [s.prefix_stats()["lookup_tokens"] for s in llm.engine.scheduler.parts]
    finally:
        llm.close()
    assert got == want and min(looked_up) > 0  # both ranks' schedulers admitted requests
    assert (
        "tokens per rank, for that rank's own requests (data-parallel attention over 2 ranks" in caplog.text
    )


def test_dp_attention_needs_several_ranks(checkpoints):
    with pytest.raises(ValueError, match=r"enable_dp_attention .* needs tensor_parallel_size >= 2, got 1"):
        LLM(
            str(checkpoints["glm53"]), device="cpu", dtype="float32", progress=False, enable_dp_attention=True
        )


def test_dp_attention_keeps_attention_whole_and_refuses_overlap(checkpoints):
    """Rank 0 of 2 with DP attention: every MLA and indexer head (no all-reduce in attention),
    the experts split; its engine refuses overlap (device-filled inputs are not sent yet)."""
    ckpt = open_checkpoint(checkpoints["glm53"])
    whole = ckpt.family.config(ckpt.hf)
    cfg = ckpt.family.config(ckpt.hf, par=Parallel(2, 0, True, True))
    attn, moe = cfg.layers[-1].attn, cfg.layers[-1].mlp
    assert attn == whole.layers[-1].attn and attn.par.size == 1
    assert moe.experts * 2 == whole.layers[-1].mlp.experts and moe.par.experts
    model, ops = build(ckpt.family, cfg, ckpt.hf, torch.device("cpu"), torch.float32, tp=TpGroup(2, 0))
    with pytest.raises(ValueError, match="data-parallel attention runs without overlap"):
        Engine(model, cfg, ops, EngineConfig(overlap="on"))


def test_dp_scheduler_gives_each_rank_its_requests():
    """One scheduler per attention rank: requests go to the rank with the fewest live ones and
    stay there; a step's plan is the ranks' rows in rank order, its copies this rank's; the
    sampled tokens feed each request's own scheduler; finished requests leave the map."""
    import numpy as np

    from dayzero.sdk.engine.dp import DpScheduler
    from dayzero.sdk.scheduler import CacheGroup, GroupKind, SchedulerError, make_config

    cfg = make_config(
        [CacheGroup("kv", GroupKind.Paged, bytes_per_token=64)], device_bytes=1 << 16, block_size=4
    )
    dp = DpScheduler(cfg, 2, rank=1)
    for rid, n in ((7, 5), (8, 3), (9, 6)):
        dp.submit(rid, np.arange(n, dtype=np.int32), max_new_tokens=2)
    assert dp.owner == {7: 0, 8: 1, 9: 0}
    plan = dp.step()
    assert plan.req_ids.tolist() == [7, 9, 8] and plan.query_start.tolist() == [0, 5, 11, 14]
    assert plan.rows == 3 and plan.num_input_tokens == 14 and plan.copies is plan.parts[1].copies
    dp.feed(plan.req_ids, plan.sample.astype(np.int32), np.asarray([70, 90, 80], dtype=np.int32))
    assert dp.parts[0].tokens_of(9)[-1] == 90 and dp.parts[1].tokens_of(8)[-1] == 80
    plan = dp.step()  # each decodes its token
    assert plan.input_ids.tolist() == [70, 90, 80]
    dp.feed(plan.req_ids, plan.sample.astype(np.int32), np.asarray([1, 2, 3], dtype=np.int32))
    assert sorted(dp.step().finished_ids.tolist()) == [7, 8, 9] and dp.owner == {}
    with pytest.raises(SchedulerError, match="unknown request 7"):
        dp.abort(7)


def test_the_parity_rank_check_runs_dp_attention(checkpoints, tmp_path):
    """`dayzero parity --tensor-parallel-size 2 --enable-dp-attention` (compare_ranks, gloo):
    logits within 1e-5 of max|logit| and the same greedy tokens as one rank (each rank's pool
    has its own prefix hits and retractions, not compared); without ranks it is refused."""
    ok, lines = compare_ranks(str(checkpoints["glm53"]), 2, False, 3, 512, str(tmp_path), dp_attention=True)
    assert ok and "2 ranks on CPUs, gloo, data-parallel attention" in lines[0], lines
    assert lines[0].endswith("greedy tokens identical; PASSED"), lines
    r = subprocess.run(
        [sys.executable, "-m", "dayzero.sdk.cli", "parity", "llama", "--enable-dp-attention"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2 and "--enable-dp-attention needs --tensor-parallel-size >= 2" in r.stderr
