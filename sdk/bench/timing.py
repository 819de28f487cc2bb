"""The benches' timers: dayzero's decode steps (plain and drafting), a batch-1 step's device time,
prefill, transformers' generate at the same shapes, and a profile of decode steps."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from dayzero.sdk.bench import kernel_groups
from dayzero.sdk.engine.drafters import SpeculativeConfig
from dayzero.sdk.engine.engine import Engine, EngineConfig, SamplingParams

KV_BYTES = 8 << 30  # the engines' KV pool: the budget a long prefill runs within
CPU_KV_BYTES = 1 << 30  # on the CPU (--device cpu: a checkpoint's decode, no long prefill)


def warm_rows(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> list[int]:
    """Submit the prompts and step until each has its prefill and two decoded tokens (or ended)."""
    ids = [eng.add(p, params) for p in prompts]
    while any(len(eng.requests[i].token_ids) < 3 and not eng.requests[i].finished for i in ids):
        eng.step()
    return ids


def end_rows(eng: Engine, ids: list[int]) -> None:
    """Abort the requests and step until the engine is idle (their blocks released)."""
    for i in ids:
        eng.abort(i)
    while eng.has_work():
        eng.step()


def time_ours(
    eng: Engine,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    vocab: int,
    prompts: list[list[int]] | None = None,
) -> tuple[float, float]:
    """(tokens/s, wall ms a decode step) over the timed steps (with drafts: the tokens kept).
    Prompts: random ids of prompt_len (EOS ignored), or `prompts` in turn (stopping at EOS)."""
    rng = np.random.default_rng(batch)
    k = eng.spec.num_speculative_tokens if eng.spec else 0
    params = SamplingParams(max_tokens=(new_tokens + 64) * (k + 1), temperature=0, ignore_eos=prompts is None)
    rows = [
        prompts[i % len(prompts)] if prompts else rng.integers(0, vocab, prompt_len).tolist()
        for i in range(batch)
    ]
    ids = warm_rows(eng, rows, params)
    _sync()
    t0, steps, before = time.perf_counter(), 0, sum(len(eng.requests[i].token_ids) for i in ids)
    while steps < new_tokens - 1 and all(not eng.requests[i].finished for i in ids):
        eng.step()
        steps += 1
    _sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(eng.requests[i].token_ids) for i in ids) - before
    end_rows(eng, ids)
    return tokens / dt, 1e3 * dt / max(steps, 1)


def _sync() -> None:
    if torch.cuda.is_available():  # the drafting rows' CPU test runs time_ours too
        torch.cuda.synchronize()


def time_drafting(
    model, cfg, ops, engine_cfg: EngineConfig, spec: SpeculativeConfig, batch: int, args, prompts=None
):
    """(tok/s, ms a step, mean acceptance length) of `batch` rows drafting by `spec`."""
    eng = Engine(model, cfg, ops, replace(engine_cfg, speculative=spec))
    whole = eng.drafting.graphs if eng.drafting is not None else None
    for what, g, none in (
        ("verify", eng.graphs, "eager (no CUDA graphs)"),
        ("MTP head", eng.head_graphs, "eager (no CUDA graphs)"),
        ("whole step", whole, "none: pass by pass"),
    ):
        if spec.method == "mtp" or what == "verify":
            print(f"batch {batch} drafting, {what}: {g.report if g else none}")
    tps, step_ms = time_ours(eng, batch, args.prompt_len, args.new_tokens, cfg.embedding.vocab, prompts)
    st = eng.stats
    print(f"batch {batch} drafting: {st['drafting_graph_steps']} of {st['steps']} steps whole in one graph")
    accept = 1 + sum(st["accepted_at"]) / max(1, st["verify_rows"])
    del eng
    torch.cuda.empty_cache()
    return tps, step_ms, accept


def print_drafting(name: str, spec: SpeculativeConfig, rows: list[tuple]) -> None:
    """Drafting's rows: a step's cost against a plain step's gives the break-even acceptance length
    (drafting pays when the mean acceptance length exceeds it)."""
    print(f"drafting: {spec.method}, {spec.num_speculative_tokens} tokens a step")
    print(
        f"{'batch':>5} {'plain tok/s':>12} {'drafting tok/s':>15} {'accept len':>11} "
        f"{'step ms':>16} {'break-even':>11}"
    )
    for b, plain, plain_ms, tps, ms, accept in rows:
        print(
            f"{b:>5} {plain:>12.1f} {tps:>15.1f} {accept:>11.2f} "
            f"{f'{ms:.2f} / {plain_ms:.2f}':>16} {ms / plain_ms:>11.2f}"
        )
    print(
        f"speculative_{name} "
        + " ".join(
            f"b{b}={t:.1f} accept_b{b}={a:.2f} breakeven_b{b}={ms / pm:.2f}" for b, _, pm, t, ms, a in rows
        )
    )


def gpu_step_ms(eng: Engine, prompt_len: int, vocab: int, steps: int = 16) -> float:
    """Device time of a batch-1 decode step's forward, median over `steps`: CUDA events around
    the bucket-1 graph's replay on the last step's inputs (it rewrites that step's key with the
    same values), or, without graphs, around the eager forward of each step (then the span
    includes the GPU's idle time while the host launches)."""
    prompt = np.random.default_rng(0).integers(0, vocab, prompt_len).tolist()
    ids = warm_rows(eng, [prompt], SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True))
    times = []
    if eng.graphs is not None:
        times = eng.graphs.replay_ms(1, steps)
    else:
        forward = eng.model.forward
        for _ in range(steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

            def timed(ctx, a=a, b=b):
                a.record()
                out = forward(ctx)
                b.record()
                return out

            eng.model.forward = timed
            eng.step()
            eng.model.forward = forward
            _sync()
            times.append(a.elapsed_time(b))
    end_rows(eng, ids)
    return float(np.median(times))


def time_prefill_ours(eng: Engine, n: int, vocab: int, runs: int = 3) -> tuple[float, int]:
    """Seconds from submitting one n-token prompt to its first token (median of runs), and the
    peak of allocated device memory over the runs (weights and the KV pool included), bytes."""
    rng, times = np.random.default_rng(n), []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(runs + 1):  # the first run warms the kernels up
        _sync()
        t0 = time.perf_counter()
        eng.generate([rng.integers(0, vocab, n).tolist()], SamplingParams(max_tokens=1, temperature=0))
        _sync()
        times.append(time.perf_counter() - t0)
        eng.scheduler.flush_prefix_cache()
    return float(np.median(times[1:])), torch.cuda.max_memory_allocated()


def time_prefill_transformers(ref: torch.nn.Module, n: int, vocab: int, runs: int = 3) -> float:
    """Seconds of transformers' generate for one n-token prompt and one new token (median)."""
    g, times = torch.Generator().manual_seed(n), []
    for _ in range(runs + 1):
        ids = torch.randint(0, vocab, (1, n), generator=g).to(ref.device)
        _sync()
        t0 = time.perf_counter()
        ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                     disable_compile=True, eos_token_id=None, pad_token_id=0)  # fmt: skip
        _sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))


def time_transformers(
    ref: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int, vocab: int
) -> float:
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=g).to(ref.device)

    def run(n: int) -> float:
        _sync()
        t0 = time.perf_counter()
        ref.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            # a static cache where the model has one (stateful linear-attention models do not)
            **({} if getattr(ref, "_is_stateful", False) else {"cache_implementation": "static"}),
            disable_compile=True,
            eos_token_id=None,
            pad_token_id=0,
        )
        _sync()
        return time.perf_counter() - t0

    run(2)  # warm-up
    t1, tn = run(1), run(new_tokens)
    return batch * (new_tokens - 1) / (tn - t1)


def prefill_tokens(cfg, args: argparse.Namespace) -> tuple[int, int]:
    """(the prefill's tokens, its chunk): --prefill-len cut to the config's positions (room for
    the one new token), in chunks of --prefill-chunk."""
    n = min(args.prefill_len, (cfg.max_position or args.prefill_len + 1) - 1)
    return n, min(n, args.prefill_chunk) or args.prefill_chunk


def time_reference(ref: torch.nn.Module, args: argparse.Namespace, cfg) -> tuple[dict[int, float], float]:
    """transformers' decode rate at each of --batches and its prefill seconds (nan where it runs
    out of GPU memory)."""
    vocab, theirs, prefill = cfg.embedding.vocab, {}, float("nan")
    for b in (int(x) for x in args.batches.split(",")):
        try:
            theirs[b] = time_transformers(ref, b, args.prompt_len, args.new_tokens, vocab)
        except torch.cuda.OutOfMemoryError:
            print(f"batch {b}: transformers ran out of GPU memory (reported as nan)")
            theirs[b] = float("nan")
            torch.cuda.empty_cache()
        print(f"batch {b}: transformers {theirs[b]:.1f} tok/s")
    n = prefill_tokens(cfg, args)[0]
    if args.prefill_len:
        try:
            prefill = time_prefill_transformers(ref, n, vocab)
        except torch.cuda.OutOfMemoryError:
            print(f"prefill {n}: transformers ran out of GPU memory (reported as nan)")
            torch.cuda.empty_cache()
    return theirs, prefill


def profile_decode(
    model,
    cfg,
    ops,
    prompt_len: int,
    vocab: int,
    batch: int = 1,
    prefill_len: int = 0,
    chunk: int = 8192,
    steps: int = 8,
    speculative: SpeculativeConfig | None = None,
    kv_bytes: int = KV_BYTES,
    graphs: bool = True,
) -> None:
    """Decode steps of `batch` rows under torch.profiler: the ops that cost most host and device
    time; then one prefill of prefill_len tokens (0: none): the kernels that cost most device time.
    speculative: the steps draft so, in CUDA graphs as served (graphs: False for eager steps),
    and their phases (dayzero.schedule, .draft, .verify, .sample, .readback, .rollback, .observe:
    the engine's record_function ranges) are listed first."""
    eng = Engine(
        model,
        cfg,
        ops,
        EngineConfig(
            kv_cache_bytes=kv_bytes,  # room for a long --prompt-len (60k tokens of Beam: 1.9 GB)
            host_cache_bytes=0,
            block_size=64,
            max_batch_size=batch,
            max_tokens_per_step=chunk,  # the prefill in chunks, as timed
            # plain steps: the kernels one by one (a graph replays them as one launch)
            decode_graphs="auto" if speculative is not None and graphs else "off",
            speculative=speculative,
        ),
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    rids = warm_rows(eng, [rng.integers(0, vocab, prompt_len).tolist() for _ in range(batch)], params)
    _sync()
    drafting = ""
    if speculative is not None:
        drafting = f", drafting {speculative.num_speculative_tokens} by {speculative.method}"
    print(f"profile: {steps} decode steps of batch {batch}{drafting}")
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        _sync()
    print(f"{1e3 * (time.perf_counter() - t0) / steps:.2f} ms a step under the profiler")
    avg = prof.key_averages()
    if speculative is not None:  # a range is two events: its host span, and its span on the GPU
        phases: dict[str, list[float]] = {}
        for e in avg:
            if e.key.startswith("dayzero."):
                row = phases.setdefault(e.key, [0, 0.0, 0.0])
                row[0] = max(row[0], e.count)
                row[1] += e.cpu_time_total / 1e3 / steps
                row[2] = max(row[2], e.device_time_total / 1e3 / steps)
        print(f"{'phase':<18} {'calls':>6} {'host ms a step':>15} {'GPU span ms a step':>19}")
        for key, (calls, host, span) in sorted(phases.items()):
            print(f"{key:<18} {calls:>6} {host:>15.2f} {span:>19.2f}")
    print(avg.table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=40))
    print(avg.table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
    print(f"the most frequent ops and kernels ({steps} steps):")
    print(avg.table(sort_by="count", row_limit=60, max_name_column_width=70))
    print(f"where a decode step's device time goes (the GPU kernels by kind, {steps} steps):")
    print(kernel_groups.table(kernel_groups.from_profile(avg, steps)))
    end_rows(eng, rids)
    if prefill_len:
        eng.add(
            np.random.default_rng(1).integers(0, vocab, prefill_len).tolist(), SamplingParams(max_tokens=1)
        )
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            while eng.has_work():
                eng.step()
            _sync()
        pre = prof.key_averages()
        print(f"prefill of {prefill_len} tokens:")
        print(pre.table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
        print(kernel_groups.table(kernel_groups.from_profile(pre, 1)))
