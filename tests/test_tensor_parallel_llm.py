"""`LLM(..., tensor_parallel_size=N)` on CPU ranks (gloo): rank 0 (this process) holds the
scheduler and the sampler and sends each step's plan to the ranks it started (sdk/engine/ranks.py);
the answers equal one rank's, greedy and seeded, through chunked prefill, prefix-cache hits and
retraction (a KV pool too small for the prompts at once); a rank that dies is named. The model
math on N ranks is tests/test_tensor_parallel.py's; this file checks the driving of the ranks.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import numpy as np
import pytest

from dayzero.sdk.api import LLM
from dayzero.sdk.engine.engine import EngineConfig, SamplingParams
from dayzero.sdk.engine.geometry import scheduler_groups
from dayzero.sdk.engine.parallel import RankError
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


def sized(tokens: int):
    """An engine whose KV pool holds `tokens` tokens of the (rank's, sharded) model it is sized
    for: LLM calls it with its config once the weights are resident."""

    def engine(cfg) -> EngineConfig:
        groups = scheduler_groups(cfg, 4)
        states = 2 * ENGINE.max_batch_size * sum(g.state_bytes for g in groups)
        return replace(ENGINE, kv_cache_bytes=tokens * sum(g.bytes_per_token for g in groups) + states)

    return engine


@pytest.mark.parametrize(("family", "size", "experts", "seed"), CASES)
def test_ranks_driven_by_rank_0_answer_as_one_rank(checkpoints, family, size, experts, seed):
    path = str(checkpoints[family])
    one = LLM(path, device="cpu", dtype="float32", engine=sized(80), progress=False)
    want = answers(one, seed)
    many = LLM(
        path, device="cpu", dtype="float32", engine=sized(80), progress=False,
        tensor_parallel_size=size, enable_expert_parallel=experts,
    )  # fmt: skip
    try:
        got = answers(many, seed)
        stats = dict(many.engine.stats)
    finally:
        many.close()
    assert got == want
    assert stats["retracted"] > 0 and stats["steps"] > 10  # retraction and many plans were sent
    assert one.engine.stats["retracted"] == stats["retracted"]


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
