"""`LLM(..., tensor_parallel_size=N)` on CPU ranks (gloo): rank 0 (this process) holds the
scheduler and the sampler and sends each step's plan to the ranks it started (sdk/engine/ranks.py);
the answers equal one rank's, greedy and seeded, through chunked prefill, prefix-cache hits and
retraction (a KV pool too small for the prompts at once), every rank's pool the size the
smallest rank's memory holds; a rank that dies, or whose step fails alone, is named. The model
math on N ranks is tests/test_tensor_parallel.py's; this file checks the driving of the ranks.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from dataclasses import replace

import faulty_kernels  # noqa: F401  (registers the "faulty" backend in this process)
import numpy as np
import pytest

from dayzero.sdk.api import LLM
from dayzero.sdk.config.model import Parallel
from dayzero.sdk.engine.drafters import TokenDrafter
from dayzero.sdk.engine.engine import EngineConfig, SamplingParams
from dayzero.sdk.engine.geometry import scheduler_groups
from dayzero.sdk.engine.memory import kv_capacity
from dayzero.sdk.engine.parallel import RankError
from dayzero.sdk.loader import open_checkpoint
from dayzero.sdk.parity.tiny import write_tiny

# 16-token chunks, 4-token blocks; `sized(80)`: a pool of 80 tokens, in which the three prompts
# below (9 + 57 + 45 tokens, two sharing 40) and their answers cannot all stay resident
ENGINE = EngineConfig(
    block_size=4, chunk_size=16, max_tokens_per_step=48, max_batch_size=4, host_cache_bytes=0
)


def prompts(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 500, 40).tolist()
    return [
        {"prompt_token_ids": ids}
        for ids in (
            rng.integers(0, 500, 9).tolist(),
            shared + rng.integers(0, 500, 17).tolist(),
            shared + [7] * 5,
        )
    ]


def answers(llm: LLM, seed: int) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=seed, ignore_eos=True)
    ps = prompts(seed)
    return [c.outputs[0].token_ids for c in llm.generate(ps, greedy) + llm.generate(ps, seeded)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("tp-llm")
    return {f: write_tiny(f, base / f, seed=5) for f in ("llama", "beam", "glm53_flash")}


# (family, ranks, expert parallel, seed)
CASES = [("llama", 2, False, 0), ("beam", 2, True, 1), ("glm53_flash", 2, False, 2)]


def _sized(tokens: tuple[int, ...], base: EngineConfig, cfg) -> EngineConfig:
    groups = scheduler_groups(cfg, 4)
    states = 2 * base.max_batch_size * sum(g.state_bytes for g in groups)
    mine = tokens[cfg.parallel.rank]
    return replace(base, kv_cache_bytes=mine * sum(g.bytes_per_token for g in groups) + states)


def sized(*tokens: int, base: EngineConfig = ENGINE):
    """An engine (base's settings) whose KV pool holds tokens[r] tokens of rank r's (sharded)
    model: LLM calls it on every rank with that rank's config once its weights are resident (a
    partial: it pickles to the spawned ranks)."""
    return functools.partial(_sized, tokens, base)


@pytest.mark.parametrize(("family", "size", "experts", "seed"), CASES)
def test_ranks_driven_by_rank_0_answer_as_one_rank(checkpoints, family, size, experts, seed, caplog):
    """Rank 0's memory holds 200 tokens, rank 1's 80: every pool and rank 0's scheduler hold
    what rank 1's holds (the min over the ranks, logged), and the answers and retractions are
    those of one rank of 80 tokens."""
    path = str(checkpoints[family])
    one = LLM(path, device="cpu", dtype="float32", engine=sized(80), progress=False)
    want = answers(one, seed)
    with caplog.at_level(logging.INFO, logger="dayzero.sdk.engine.memory"):
        many = LLM(
            path, device="cpu", dtype="float32", engine=sized(200, 80), progress=False,
            tensor_parallel_size=size, enable_expert_parallel=experts,
        )  # fmt: skip
    try:
        got = answers(many, seed)
        stats = dict(many.engine.stats)
    finally:
        many.close()
    ckpt = open_checkpoint(path)
    cfgs = [ckpt.family.config(ckpt.hf, par=Parallel(size, r, experts)) for r in range(size)]
    alone = [kv_capacity(c, 4, sized(200, 80)(c)).pages for c in cfgs]  # what each rank's memory holds
    assert alone[1] < alone[0] and many.engine.scheduler.layout["num_pages"] == alone[1]
    assert f"KV blocks: {alone[1]} of 4 tokens on every rank (tensor-parallel rank 1's memory" in caplog.text
    assert got == want
    assert stats["retracted"] > 0 and stats["steps"] > 10  # retraction and many plans were sent
    assert one.engine.stats["retracted"] == stats["retracted"]


@pytest.mark.parametrize(("family", "seed"), [("llama", 3), ("glm53_flash", 4)])
def test_overlap_and_decode_graph_buffers_on_ranks_answer_as_one_rank(checkpoints, family, seed):
    """Overlap (a decode row's input token is the step before's, filled in on the device: rank
    0 broadcasts each step's sampled tokens over the model's group, every rank fills them in)
    and decode steps in the graphs' static buffers (every rank runs the bucket's padded rows)
    on 2 ranks: the answers are one rank's without either, through chunked prefill, prefix
    hits and retraction; glm53_flash's KDA layers keep their recurrent state in the buffers'
    state slots."""
    path = str(checkpoints[family])
    one = LLM(path, device="cpu", dtype="float32", engine=sized(80), progress=False)
    want = answers(one, seed)
    fast = replace(ENGINE, overlap="on", decode_graphs="buffers")
    many = LLM(path, device="cpu", dtype="float32", engine=sized(80, 80, base=fast), progress=False,
               tensor_parallel_size=2)  # fmt: skip
    try:
        got = answers(many, seed)
        stats = dict(many.engine.stats)
    finally:
        many.close()
    assert got == want
    assert stats["graph_steps"] > 10 and stats["device_inputs"] > 10 and stats["retracted"] > 0, stats


def test_a_rank_that_dies_is_named(checkpoints):
    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", engine=ENGINE, progress=False,
              tensor_parallel_size=2)  # fmt: skip
    try:
        pid = llm.followers.ctx.processes[0].pid
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"tensor-parallel rank 1 exited with code -9"):
            while time.monotonic() - t0 < 30:
                answers(llm, 0)
        assert time.monotonic() - t0 < 30
    finally:
        llm.close()


@pytest.mark.parametrize(("rank", "named", "exit_code"), [
    (1, r"tensor-parallel rank 1 failed in step \d+: InjectedFault: injected fault", 1),
    (0, r"tensor-parallel rank 0's step failed: InjectedFault: injected fault", -signal.SIGKILL),
])  # fmt: skip
def test_a_step_failing_on_one_rank_ends_the_ranks_naming_it(
    checkpoints, monkeypatch, tmp_path, rank, named, exit_code
):
    """A fault in one rank's forward only (tests/faulty_kernels.py, on that rank): the other
    rank, left in a collective, does not wait for the group's 300 s timeout. Rank 1's fault:
    it logs it, reports it through the group's store and exits 1, which ends rank 0's
    collective; rank 0's fault: rank 0 ends rank 1. Either way generate raises within seconds,
    naming the rank, the step and the error."""
    fault = tmp_path / "fault"
    monkeypatch.setenv("DAYZERO_KERNEL_MODULES", "faulty_kernels")  # for the spawned rank
    monkeypatch.setenv("DAYZERO_KERNEL_ADD_RMS_NORM", "faulty")
    monkeypatch.setenv("DAYZERO_FAULT_FILE", str(fault))
    monkeypatch.setenv("DAYZERO_FAULT_RANK", str(rank))
    llm = LLM(str(checkpoints["llama"]), device="cpu", dtype="float32", engine=ENGINE, progress=False,
              tensor_parallel_size=2)  # fmt: skip
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        assert llm.ops.chosen()["add_rms_norm"] == "faulty"
        assert len(llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy)[0].outputs[0].token_ids) == 4
        fault.touch()
        t0 = time.monotonic()
        with pytest.raises(RankError, match=named):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], greedy)
        took = time.monotonic() - t0
    finally:
        follower = llm.followers.ctx.processes[0] if llm.followers else None
        llm.close()
    print(f"rank {rank}'s fault named in {took:.2f} s")
    assert took < 10, took
    assert follower is not None and follower.exitcode == exit_code


def test_a_rank_that_fails_while_loading_is_named_with_its_error(checkpoints, tmp_path):
    """A checkpoint whose slice for rank 1 is corrupt (NaN in the second half of layer 0's
    query heads, which only rank 1 reads): rank 1's strict writer refuses it, rank 1 leaves
    its error in the group's store and exits; rank 0 raises naming the rank and the error, in
    seconds, and can start again (its group is gone)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["llama"], bad)
    tensors = load_file(bad / "model.safetensors")
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    q[q.shape[0] // 2 :] = torch.nan  # rank 1's heads of 2
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    t0 = time.monotonic()
    with pytest.raises(
        RankError,
        match=r"^tensor-parallel rank 1 failed while loading: WeightError: checkpoint tensor "
        r"model\.layers\.0\.self_attn\.q_proj\.weight holds NaN or inf$",
    ):
        LLM(str(bad), device="cpu", dtype="float32", engine=ENGINE, progress=False, tensor_parallel_size=2)
    took = time.monotonic() - t0
    print(f"rank 1's load failure named in {took:.1f} s")
    assert took < 60, took
    assert not torch.distributed.is_initialized()  # rank 0 left the group: a new LLM may start


def first_right(ps: list[dict], outs: list[list[int]], right: int = 2) -> TokenDrafter:
    """Drafts from the known greedy answers: the first `right` of a step's right, the rest off
    by one; none once a request leaves them (its seeded answer)."""
    full = [p["prompt_token_ids"] + o for p, o in zip(ps, outs, strict=True)]

    def propose(tokens: list[int], k: int) -> list[int]:
        known = next((f for f in full if f[: len(tokens)] == tokens), [])
        return [t if i < right else t + 1 for i, t in enumerate(known[len(tokens) : len(tokens) + k])]

    return TokenDrafter(propose)


@pytest.mark.parametrize(("family", "seed"), [("llama", 6), ("glm53_flash", 7)])
def test_drafting_on_ranks_answers_as_one_rank(checkpoints, family, seed):
    """Speculative decoding (3 drafts a step, the first 2 right) on 2 ranks: rank 0 sends each
    step's verify pass (the inputs with the drafts) and rollback pass (glm53_flash's KDA states
    restored and the kept inputs run again) after the plan; through chunked prefill, prefix hits
    and retraction, the answers (greedy and seeded) equal one rank's with the same drafts, and
    the greedy ones one rank's without drafts."""
    path = str(checkpoints[family])
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    plain = answers(LLM(path, device="cpu", dtype="float32", engine=sized(80), progress=False), seed)
    one = LLM(path, device="cpu", dtype="float32", engine=sized(80), progress=False, speculative_config=spec)
    one.engine.drafter = first_right(prompts(seed), plain[:3])
    want = answers(one, seed)
    many = LLM(path, device="cpu", dtype="float32", engine=sized(80, 80), progress=False,
               tensor_parallel_size=2, speculative_config=spec)  # fmt: skip
    many.engine.drafter = first_right(prompts(seed), plain[:3])  # drafts are rank 0's alone
    try:
        got = answers(many, seed)
        stats = dict(many.engine.stats)
    finally:
        many.close()
    assert got == want and got[:3] == plain[:3]
    assert stats["accepted_at"][1] > 0 and stats["accepted_at"][2] == 0 and stats["retracted"] > 0, stats
    assert stats["accepted_at"] == one.engine.stats["accepted_at"]


def test_drafting_with_data_parallel_attention_is_refused_by_name(checkpoints):
    with pytest.raises(ValueError, match=r"\(ngram\) is not implemented with data-parallel attention"):
        LLM(str(checkpoints["llama"]), device="cpu", tensor_parallel_size=2, enable_dp_attention=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})  # fmt: skip
