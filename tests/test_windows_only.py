"""A model whose every layer has a sliding window (Mistral 7B v0.1): a request's KV is bounded by
the window, not its length (csrc/src/kv_manager.cc, KvManager::window_blocks), so it is served
with less KV memory than its tokens take; without a window (sliding_window: null, Mistral v0.2
on) the spec's one sliding group resolves to a paged group."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dayzero.sdk.engine.engine import EngineConfig, SamplingParams
from dayzero.sdk.engine.memory import kv_capacity
from dayzero.sdk.families import FAMILIES
from dayzero.sdk.loader import open_checkpoint
from dayzero.sdk.parity.criteria import Tolerance
from dayzero.sdk.parity.runner import Ours, Reference
from dayzero.sdk.parity.tiny import write_tiny
from dayzero.sdk.spec.reference import reference_class

SEED = 3
WINDOW, BLOCK, CHUNK = 8, 4, 8
TOL = Tolerance()  # fp32: tokens identical, |dlogprob| <= 1e-4


def test_mistral_window_gives_one_sliding_group_and_null_a_paged_one() -> None:
    fam = FAMILIES.get("mistral")
    config_class = reference_class(fam.spec.spec.reference).config_class

    def groups(window: int | None) -> tuple:
        return fam.config(
            config_class(**(dict(fam.spec.spec.tiny) | {"sliding_window": window})).to_dict()
        ).cache_groups

    (swa,) = groups(WINDOW)
    assert (swa.kind, swa.window) == ("sliding", WINDOW)
    (full,) = groups(None)
    assert (full.kind, full.window) == ("paged", None)


def test_windows_only_request_outgrows_the_kv_memory_and_matches_transformers(tmp_path: Path) -> None:
    ckpt = open_checkpoint(
        write_tiny("mistral", tmp_path / "ckpt", seed=SEED, overrides={"sliding_window": WINDOW})
    )
    cpu = torch.device("cpu")
    torch.manual_seed(SEED)
    ours = Ours(ckpt, cpu, torch.float32)
    ref = Reference(ckpt, ckpt.folder, cpu, torch.float32)
    prompt = np.random.default_rng(SEED).integers(0, ours.cfg.embedding.vocab, size=40).tolist()
    new = 16
    # One request holds ceil((window + chunk) / block) + 1 = 5 blocks at most: 6 pages of 4
    # tokens (24 tokens of KV) serve its 56.
    base = EngineConfig(block_size=BLOCK, chunk_size=CHUNK, max_tokens_per_step=CHUNK, max_batch_size=1)
    page = kv_capacity(ours.cfg, 4, base).page_bytes
    eng = ours.engine(
        block_size=BLOCK,
        chunk_size=CHUNK,
        max_tokens_per_step=CHUNK,
        max_batch_size=1,
        kv_cache_bytes=6 * page,
    )
    assert eng.scheduler.layout["num_pages"] * BLOCK < len(prompt) + new
    (out,) = eng.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    toks, lps = ref.greedy(prompt, new)
    assert out.token_ids == toks
    err = float(np.max(np.abs(np.array(out.logprobs) - np.array(lps))))
    assert err <= TOL.logprobs, f"max |dlogprob| {err:.3e} > {TOL.logprobs}"
    pages = eng.scheduler.layout["num_pages"]
    print(f"windows only: {len(prompt)} + {new} tokens in {pages} pages, max |dlogprob| {err:.2e}")
