"""Decode steps through the CUDA graphs' static buffers (sdk/engine/graphs.py), run eagerly on the
CPU: padded buckets, staged inputs, scratch slots for the padding rows' keys. The same requests
decode to the same tokens, with logprobs within 1e-5 (fp32; the padding rows only add rows),
as the plain path; prefill and mixed steps still take the plain path. The GPU test
(tests/test_triton_cuda.py) checks that capture and replay equal these buffers run eagerly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import SEEDS

from dayzero.sdk.api import LLM
from dayzero.sdk.engine.engine import EngineConfig, SamplingParams
from dayzero.sdk.engine.graphs import decode_only
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
    """A decode row run alone (bucket 1), then again padded to bucket 2: outside the scratch page
    the second run changes only the row's own new-token slots (the same keys up to rounding:
    a 2-row matmul sums in another order)."""
    eng = _llm(checkpoint, "buffers").engine
    eng.add([5, 6, 7, 8, 9], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    eng.step()  # the prefill (plain path)
    plan = eng.scheduler.step()
    assert decode_only(plan) and plan.rows == 1
    eng.graphs.run(plan)
    before = eng.pool.pool.clone()
    eng.graphs._fill(plan, 2)
    with torch.inference_mode():
        eng.model(eng.graphs._context(2, (int(plan.kv_lens[0]), 0)))
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
    changed = eng.pool.pool != before
    assert bool(changed[scratch:].any()), "the padding row wrote no key"
    assert not bool((changed & ~allowed).any()), (changed & ~allowed).nonzero()[:8]


def test_decode_graphs_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="decode_graphs 'on'; known: auto, off, buffers"):
        EngineConfig(decode_graphs="on")
