"""`dayzero bench decode --tensor-parallel-size N`: decode on N ranks (one GPU each over NCCL,
or CPU ranks over gloo with --device cpu --model), through `LLM` as `dayzero serve` runs it.

The model: --model's checkpoint, or --family's bench config (--release: the release's shapes;
+ --set) with random weights (`--load-format dummy` on every rank, no checkpoint on disk) and a
tokenizer (the embedded default's, or --tokenizer's folder) held by the config's vocabulary.
--tensor-parallel-size 1 runs the same path on one GPU: the baseline of the ranks' efficiency.
Each batch of --batches decodes --new-tokens after --prompt-len random tokens (chat prompts with
--model), timed on rank 0, whose engine sends every step's plan to the other ranks. The
roofline is a rank's: the bytes its shard reads a step (its slices of every weight, the experts
it holds that the batch picks, its KV heads) over one device's copy bandwidth, since the ranks
read in parallel; a step's collectives are part of the difference: --profile gives their time a
step (rank 0's NCCL kernels, or its gloo collectives), from 8 profiled steps a batch. Last line:
`decode_tp{N}_{family} b1=... roofline_b1=...`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from dayzero.sdk.api import LLM
from dayzero.sdk.bench.agentic import random_model
from dayzero.sdk.bench.decode import bench_prompts
from dayzero.sdk.bench.roofline import bytes_per_step, copy_bandwidth
from dayzero.sdk.bench.timing import CPU_KV_BYTES, KV_BYTES, end_rows, time_ours, warm_rows
from dayzero.sdk.engine.config import EngineConfig
from dayzero.sdk.engine.engine import Engine, SamplingParams


def main(args: argparse.Namespace) -> int:
    size = args.tensor_parallel_size
    dev = torch.device(args.device or "cuda")
    refused = _refused(args, dev)
    if refused:
        print(f"dayzero bench decode --tensor-parallel-size {size}: {refused}")
        return 2
    batches = [int(x) for x in args.batches.split(",")]
    engine = EngineConfig(
        kv_cache_bytes=KV_BYTES if dev.type == "cuda" else CPU_KV_BYTES,
        host_cache_bytes=0,
        block_size=64 if dev.type == "cuda" else 16,
        max_batch_size=max(batches),
        max_tokens_per_step=8192,
        decode_graphs="off" if args.enforce_eager else "auto",
        overlap="off" if args.disable_overlap_schedule else "auto",
    )
    with tempfile.TemporaryDirectory() as tmp:
        context = args.prompt_len + args.new_tokens + 128
        out = Path(tmp) / "model"
        kw = dict(release=args.release, keep_vocab=True)  # the vocabulary of the one-rank bench
        folder = args.model or random_model(args.family, args.set, out, context, args.tokenizer, **kw)
        llm = LLM(
            str(folder),
            device=dev.type,
            dtype=args.dtype,
            engine=engine,
            load_format="auto" if args.model else "dummy",
            tensor_parallel_size=size,
            enable_expert_parallel=args.enable_expert_parallel,
        )
        try:
            return _time(llm, args, batches, dev)
        finally:
            llm.close()


def _refused(args: argparse.Namespace, dev: torch.device) -> str | None:
    """What this run cannot time, said before any rank starts (None: it can)."""
    if args.tensor_parallel_size < 1:
        return "needs at least 1 rank"
    if dev.type == "cuda" and torch.cuda.device_count() < args.tensor_parallel_size:
        return f"needs {args.tensor_parallel_size} GPUs; {torch.cuda.device_count()} visible"
    if dev.type == "cpu" and not args.model:
        return "on the CPU it times a checkpoint (--model PATH), not a GPU-sized config"
    if args.quantization or args.speculative_config:
        return (
            "--quantization and --speculative-config run on one rank only (leave out --tensor-parallel-size)"
        )
    return None


def _time(llm: LLM, args: argparse.Namespace, batches: list[int], dev: torch.device) -> int:
    cfg, size, vocab = llm.config, args.tensor_parallel_size, llm.config.embedding.vocab
    layout = "expert" if args.enable_expert_parallel else "tensor"
    print(f"{size} ranks ({layout} parallel MoE) on {'GPUs, NCCL' if dev.type == 'cuda' else 'CPUs, gloo'}")
    print("not run on this path: transformers' rate, the prefill timing (bench decode without the flag)")
    bw = copy_bandwidth(dev)
    prompts = bench_prompts(llm.tokenizer) if args.model else None
    rows = []
    for b in batches:
        tps, step_ms = time_ours(llm.engine, b, args.prompt_len, args.new_tokens, vocab, prompts)
        roof = b * bw / bytes_per_step(cfg, llm.model, args.prompt_len, b)[0]  # rank 0's shard
        rows.append((b, tps, step_ms, roof))
        print(f"batch {b}: {tps:.1f} tok/s ({step_ms:.2f} ms a step)")
    print(f"{'batch':>5} {'tok/s':>10} {'step ms':>8} {'rank roofline tok/s':>20} {'of the roofline':>16}")
    for b, tps, ms, roof in rows:
        print(f"{b:>5} {tps:>10.1f} {ms:>8.2f} {roof:>20.0f} {tps / roof:>16.3f}")
    if args.profile:
        print(f"{'batch':>5} {'step ms (profiled)':>19} {'collectives ms':>15} {'share':>6}")
        rng = np.random.default_rng(0)
        some = prompts or [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(max(batches))]
        for b in batches:
            wall, coll = collectives_ms(llm.engine, b, some, dev)
            print(f"{b:>5} {wall:>19.2f} {coll:>15.2f} {coll / wall:>6.1%}")
    line = " ".join(f"b{b}={t:.1f} roofline_b{b}={r:.0f}" for b, t, _, r in rows)
    print(f"decode_tp{size}_{cfg.family} {line}")
    return 0


def collectives_ms(
    eng: Engine, batch: int, prompts: list[list[int]], dev: torch.device, steps: int = 8
) -> tuple[float, float]:
    """(wall ms a decode step under the profiler, ms of it in collectives) over `steps` decode
    steps of `batch` of the prompts on rank 0: its NCCL kernels' device time on CUDA, its gloo
    collectives' time on the CPU (the plan's broadcast to the other ranks included)."""
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    ids = warm_rows(eng, [prompts[i % len(prompts)] for i in range(batch)], params)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    events = prof.key_averages()
    if cuda:
        us = sum(e.device_time_total for e in events if "nccl" in e.key.lower())
    else:
        us = sum(e.cpu_time_total for e in events if e.key.startswith("gloo:"))
    end_rows(eng, ids)
    return wall, us / 1e3 / steps
