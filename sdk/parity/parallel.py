"""One checkpoint on N tensor-parallel ranks against one rank (`dayzero parity
--tensor-parallel-size N` and the CPU tests): every rank builds its shard of the model (the
blocks' `shard` / `shards`), loads its slices and runs the same engine on the same requests;
the engine's plans agree on every rank (the scheduler is deterministic, the gathered logits
equal), so the collectives line up. Rank 0 saves what it computed: every prompt position's
logits (one prefill) and greedy tokens and logprobs through the whole engine (chunked prefill,
prefix-cache hits: the first prompt alone, then all of them; retraction under a small KV pool).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import numpy as np
import torch

from dayzero.kernels.collective import TpGroup
from dayzero.sdk.config.model import Parallel
from dayzero.sdk.engine.engine import Engine, EngineConfig, SamplingParams
from dayzero.sdk.engine.geometry import scheduler_groups
from dayzero.sdk.engine.parallel import end_group, init_group, run_ranks
from dayzero.sdk.families import build
from dayzero.sdk.loader import load_weights, open_checkpoint


def rank_outputs(
    rank: int,
    size: int,
    port: int,
    path: str,
    experts: bool,
    prompts: list[list[int]],
    new_tokens: int,
    engine_kw: dict,
    out: str,
    device: str = "cpu",
    dp_attention: bool = False,
) -> None:
    """Rank `rank` of `size` (run_ranks' signature); engine_kw: EngineConfig fields, with
    `kv_tokens` for a KV pool of that many tokens on every rank. device "cuda": rank r on GPU r,
    the group over NCCL (gloo on the CPU); fp32 either way. dp_attention: each rank attends for
    its own requests, the experts whole a rank (sdk/engine/dp.py)."""
    tp = init_group(size, rank, port=port, device=device) if size > 1 else TpGroup()
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    try:
        ckpt = open_checkpoint(Path(path))
        cfg = ckpt.family.config(
            ckpt.hf, str(ckpt.path), Parallel(size, rank, experts or dp_attention, dp_attention)
        )
        packed = ckpt.packing.params if ckpt.packing else None
        model, ops = build(ckpt.family, cfg, ckpt.hf, dev, torch.float32, packed, tp=tp)
        load_weights(model, ckpt, progress=False)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        whose = "" if size > 1 else " (this process's: one rank runs in the caller)"
        print(
            f"rank {rank} of {size}: loaded its shard; peak host memory {peak:.0f} MiB{whose}",
            file=sys.stderr,
        )
        kw = dict(engine_kw)
        if "kv_tokens" in kw:  # the same tokens on every rank: bytes of this rank's (sharded) rows
            groups = scheduler_groups(cfg, 4)
            per_token = sum(g.bytes_per_token for g in groups)  # rows as padded
            slots = 2 * kw.get("max_batch_size", 64)  # running requests + as many snapshots
            states = slots * sum(g.state_bytes for g in groups)  # recurrent state (KDA)
            kw["kv_cache_bytes"] = kw.pop("kv_tokens") * per_token + states
        with torch.inference_mode():
            whole = max(map(len, prompts)) * len(prompts)
            logits = Engine(model, cfg, ops, EngineConfig(max_tokens_per_step=whole)).prompt_logits(prompts)
            eng = Engine(model, cfg, ops, EngineConfig(**kw))
            greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            outs = eng.generate(prompts[:1], greedy) + eng.generate(prompts, greedy)  # then: prefix hits
        if rank == 0:
            torch.save(
                {
                    "logits": logits,
                    "tokens": [o.token_ids for o in outs],
                    "logprobs": [o.logprobs for o in outs],
                    "cached": [o.cached_tokens for o in outs],
                    "stats": dict(eng.stats),
                },
                out,
            )
    finally:
        if size > 1:
            end_group(tp)


# the engine of the check: 16-token prefill chunks, a KV pool of 128 tokens (too few for the
# prompts at once: retraction), small blocks
CHECK_ENGINE = {"block_size": 4, "chunk_size": 16, "max_tokens_per_step": 48, "max_batch_size": 4}
CHECK_ENGINE |= {"kv_tokens": 128, "host_cache_bytes": 0}
CHECK_TOKENS = 12


def check_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Five prompts of 9-63 tokens, two sharing a 40-token prefix."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, 40).tolist()
    return [shared + rng.integers(0, vocab, n).tolist() for n in (5, 23)] + [
        rng.integers(0, vocab, n).tolist() for n in (9, 57, 31)
    ]


def run_check(
    path: str,
    size: int,
    experts: bool,
    prompts: list[list[int]],
    out_dir: Path,
    device: str = "cpu",
    dp_attention: bool = False,
) -> dict:
    """rank_outputs on `size` ranks (one rank: in this process); rank 0's results, on the CPU."""
    out = out_dir / f"ranks-{size}-{int(experts)}-{int(dp_attention)}.pt"
    args = (path, experts, prompts, CHECK_TOKENS, CHECK_ENGINE, str(out), device, dp_attention)
    if size == 1:
        rank_outputs(0, 1, 0, *args)
    else:
        run_ranks(rank_outputs, size, args, timeout_s=900)
    return torch.load(out, map_location="cpu")


def compare_ranks(
    path: str,
    size: int,
    experts: bool,
    seed: int,
    vocab: int,
    out_dir: str,
    tol: float = 1e-5,
    device: str = "cpu",
    dp_attention: bool = False,
) -> tuple[bool, list[str]]:
    """The checkpoint on `size` ranks against one rank (fp32; CPU ranks over gloo, or one GPU a
    rank over NCCL): every prompt position's logits within tol x max|logit|, the same greedy
    tokens, cached-token counts and retractions. With dp_attention each rank's pool holds its
    own requests, so the prefix hits and retractions are its own: the logits and tokens are
    compared. (One rank is what the parity suite checks against the reference.)"""
    if device == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(f"{size} ranks on CUDA need {size} GPUs; {torch.cuda.device_count()} visible")
    prompts = check_prompts(vocab, seed)
    one, many = (
        run_check(path, n, experts and n > 1, prompts, Path(out_dir), device, dp_attention and n > 1)
        for n in (1, size)
    )
    scale = max(t.abs().max().item() for t in one["logits"])
    err = max((a - b).abs().max().item() for a, b in zip(one["logits"], many["logits"], strict=True))
    same = many["tokens"] == one["tokens"]
    if not dp_attention:
        same = (
            same
            and many["cached"] == one["cached"]
            and many["stats"]["retracted"] == one["stats"]["retracted"]
        )
    ok = err <= tol * scale and same
    layout = f"{size} ranks on {'GPUs, NCCL' if device == 'cuda' else 'CPUs, gloo'}, "
    layout += (
        "data-parallel attention" if dp_attention else f"{'expert' if experts else 'tensor'} parallel MoE"
    )
    lines = [
        f"tensor parallel ({layout}) vs one rank: logits max|diff| {err:.2e} (limit {tol * scale:.2e}); "
        f"greedy tokens{'' if dp_attention else ', prefix hits and retractions'} "
        f"{'identical' if same else 'DIFFER'}; "
        f"{'PASSED' if ok else 'FAILED'}"
    ]
    return ok, lines
