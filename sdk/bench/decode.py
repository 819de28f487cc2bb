"""`dayzero bench decode`: decode tokens/s on a GPU for a family's scaled config.

The config is the reference config class's defaults (the real model's widths and head shapes)
with the spec's `bench` overrides (fewer layers and experts, so it fits one GPU), plus `--set`.
Random bf16 weights are made once, in the reference class on the GPU, and handed to dayzero
through the spec's weight rules (under their checkpoint names), so both run the same weights in
the same process. transformers is timed first and then parked in host memory before dayzero's
copy is built, so the two copies never share the GPU (Beam's 20B bench config fits an 80 GB
card). Each batch decodes after a prompt of --prompt-len random tokens.
Roofline: bytes a decode step must read (every weight except the embedding table and the
experts no token of the batch uses, plus each request's cache: KV rows and latent / index keys
it attends to, recurrent state read and written) over the device-to-device copy bandwidth
measured in the same run (bytes read + written).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import torch

from dayzero.kernels.packed import FORMATS, PackedWeight
from dayzero.kernels.selection import OpTable
from dayzero.sdk.api import parse_dtype
from dayzero.sdk.bench.packed_weights import bench_packing, packable, quantized_stream, random_packed
from dayzero.sdk.blocks.mlp import MoE
from dayzero.sdk.engine.drafters import SpeculativeConfig
from dayzero.sdk.engine.engine import Engine, EngineConfig, SamplingParams
from dayzero.sdk.families import FAMILIES, born_as, build, kernel_needs
from dayzero.sdk.loader import Checkpoint, load_weights, open_checkpoint, open_mtp_head
from dayzero.sdk.loader.tokenizer import chat_ids, load_tokenizer
from dayzero.sdk.quant.packing import PackedParam
from dayzero.sdk.spec.reference import merge, reference_class, spec_config

KV_BYTES = 8 << 30  # the engines' KV pool: the budget a long prefill runs within
CPU_KV_BYTES = 1 << 30  # on the CPU (--device cpu: a checkpoint's decode, no long prefill)
# --model's chat prompts (none of them among scripts/train_nextn.py's training topics)
BENCH_TOPICS = (
    "the pyramids",
    "snowflakes",
    "kangaroos",
    "the piano",
    "lightning",
    "coral reefs",
    "maps",
    "soap",
)


def checkpoint_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The in-memory reference model under its checkpoint names (transformers' own reversal of
    its load-time conversions: stacked experts split per expert, renamed tensors...).
    The reversal copies the gate/up halves of every stacked expert tensor, so it runs one decoder
    layer at a time: the copies stay one layer's experts, not the model's."""
    import re

    from transformers.core_model_loading import revert_weight_conversion

    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in model.state_dict().items():
        m = re.search(r"\.layers\.\d+\.", name)
        groups.setdefault(name[: m.end()] if m else "", {})[name] = t
    for key in list(groups):
        yield from revert_weight_conversion(model, groups.pop(key)).items()


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Device-to-device copy of nbytes (default 2 GiB on a GPU, 256 MiB on the host, past any
    cache), bytes read + written per second (median of 20)."""
    if device.type == "cpu":  # memory-to-memory, timed on the host
        src = torch.randint(0, 255, (nbytes or 256 << 20,), dtype=torch.uint8)
        dst, times = torch.empty_like(src), []
        for _ in range(25):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return 2 * src.numel() / float(np.median(times[5:]))
    src = torch.randint(0, 255, (nbytes or 2 << 30,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        _sync()
        if i >= 5:
            times.append(a.elapsed_time(b) / 1e3)
    return 2 * nbytes / float(np.median(times))


def bytes_per_step(
    cfg, model: torch.nn.Module, prompt_len: int, batch: int = 1
) -> tuple[float, float, float]:
    """(bytes a decode step at `batch` must read, total params, active params per token).
    Every weight but the embedding table at its stored size (packed weights: codes and scales),
    each expert the batch's tokens use once (expected distinct experts of `batch` tokens picking
    k of E at random: E (1 - (1 - k/E)^batch)), and each request's cache: paged rows over
    min(prompt, window) positions and recurrent state read and written, in bf16."""
    packed = [m for m in model.modules() if isinstance(m, PackedWeight)]
    total = sum(p.numel() for p in model.parameters()) + sum(math.prod(w.shape) for w in packed)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(w.nbytes() for w in packed)
    embed = model.embed.weight
    weights, active = nbytes - embed.numel() * embed.element_size(), total - embed.numel()
    for m in model.modules():
        if isinstance(m, MoE):
            e, k = m.cfg.experts, m.cfg.top_k
            expert = (math.prod(m.gate_up.shape) + math.prod(m.down.shape)) // e
            expert_bytes = sum(_bytes(w) for w in (m.gate_up, m.down)) / e
            active -= (e - k) * expert
            weights -= (e - e * (1 - (1 - k / e) ** batch)) * expert_bytes
    cache = 0
    for g in cfg.cache_groups:
        if g.kind == "state":
            cache += 2 * g.row
        else:
            cache += g.row * 2 * (min(prompt_len, g.window) if g.window else prompt_len)
    return weights + batch * cache, total, active


def _bytes(w: torch.Tensor | PackedWeight) -> int:
    return w.nbytes() if isinstance(w, PackedWeight) else w.numel() * w.element_size()


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
    ids = [
        eng.add(prompts[i % len(prompts)] if prompts else rng.integers(0, vocab, prompt_len).tolist(), params)
        for i in range(batch)
    ]
    while any(len(eng.requests[i].token_ids) < 3 and not eng.requests[i].finished for i in ids):
        eng.step()  # prefill + two warm-up decodes
    _sync()
    t0, steps, before = time.perf_counter(), 0, sum(len(eng.requests[i].token_ids) for i in ids)
    while steps < new_tokens - 1 and all(not eng.requests[i].finished for i in ids):
        eng.step()
        steps += 1
    _sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(eng.requests[i].token_ids) for i in ids) - before
    for i in ids:
        eng.abort(i)
    while eng.has_work():
        eng.step()
    return tokens / dt, 1e3 * dt / max(steps, 1)


def _sync() -> None:
    if torch.cuda.is_available():  # the drafting rows' CPU test runs time_ours too
        torch.cuda.synchronize()


def time_drafting(
    model, cfg, ops, engine_cfg: EngineConfig, spec: SpeculativeConfig, batch: int, args, prompts=None
):
    """(tok/s, ms a step, mean acceptance length) of `batch` rows drafting by `spec`."""
    eng = Engine(model, cfg, ops, replace(engine_cfg, speculative=spec))
    for what, g in (("verify", eng.graphs), ("MTP head", eng.head_graphs)):
        if spec.method == "mtp" or what == "verify":
            print(f"batch {batch} drafting, {what}: {g.report if g else 'eager (no CUDA graphs)'}")
    tps, step_ms = time_ours(eng, batch, args.prompt_len, args.new_tokens, cfg.embedding.vocab, prompts)
    st = eng.stats
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
    rid = eng.add(
        np.random.default_rng(0).integers(0, vocab, prompt_len).tolist(),
        SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True),
    )
    while len(eng.requests[rid].token_ids) < 3:
        eng.step()
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
    eng.abort(rid)
    while eng.has_work():
        eng.step()
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
        ids = torch.randint(0, vocab, (1, n), generator=g).cuda()
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
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=g).cuda()

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
    from torch.profiler import ProfilerActivity, profile

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
    rids = [
        eng.add(
            rng.integers(0, vocab, prompt_len).tolist(),
            SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True),
        )
        for _ in range(batch)
    ]
    while min(len(eng.requests[r].token_ids) for r in rids) < 3:
        eng.step()
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
    for r in rids:
        eng.abort(r)
    while eng.has_work():
        eng.step()
    if prefill_len:
        eng.add(
            np.random.default_rng(1).integers(0, vocab, prefill_len).tolist(), SamplingParams(max_tokens=1)
        )
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            while eng.has_work():
                eng.step()
            _sync()
        print(f"prefill of {prefill_len} tokens:")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


def bench_model(args: argparse.Namespace, mtp: bool, dev: torch.device, dtype: torch.dtype):
    """(family, config, model, ops, the transformers reference or None, the weight format): the
    family's bench config with random weights, made in the reference class when it runs."""
    fam = FAMILIES.get(args.family)
    spec = fam.spec.spec
    overrides = merge(dict(spec.bench), json.loads(args.set) if args.set else {})
    hf = spec_config(spec, overrides)
    cls = reference_class(spec.reference) if args.reference else None
    print(f"building {spec.reference.rsplit('.', 1)[1]} with {json.dumps(overrides)}")
    torch.manual_seed(0)
    cfg = fam.config(hf, mtp=mtp)
    fmt = args.quantization and FORMATS.get(args.quantization).name  # unknown: fails listing the known
    ckpt = Checkpoint(fam.spec.folder / "<in-memory>", "safetensors", hf, fam)
    ref, packing = None, None
    theirs: dict[int, float] = {}
    theirs_prefill = float("nan")
    if cls is not None:
        with born_as(dev, dtype):
            ref = cls(cls.config_class(**hf)).eval()
        shapes = {n: (t.dtype, tuple(t.shape)) for n, t in checkpoint_tensors(ref)}
        theirs, theirs_prefill = time_reference(ref, args, cfg)
        ref.to("cpu")  # parked: dayzero's copy is built from it, one tensor at a time
        torch.cuda.empty_cache()
    if fmt:
        with born_as(torch.device("meta"), dtype):  # which parameters to pack: names only
            targets = packable(
                fam.module("model").Model(cfg, kernel_needs(cfg, OpTable(dev, dtype)).resolve())
            )
        if ref is not None:
            packing = bench_packing(shapes, ckpt.mapping, targets, fmt)
            packed = packing.params
        else:
            packed = {t: PackedParam(fmt, False) for t in targets}
    model, ops = build(fam, cfg, hf, dev, dtype, packed if fmt else None)
    print(f"kernels: {ops.chosen()}")
    if ref is not None:
        stream = ((name, t.to(dev)) for name, t in checkpoint_tensors(ref))
        if packing is not None:
            stream = quantized_stream(stream, ckpt.mapping, targets, fmt)
        n = (
            len(packing.tensors) + len(shapes) - len({w for w, _ in packing.tensors.values()})
            if packing
            else len(shapes)
        )
        head, model.mtp = model.mtp, None  # the reference builds no MTP layer: its head stays random
        load_weights(model, ckpt, tensors=stream, count=n, packing=packing)
        model.mtp = head
        with torch.no_grad():
            for p in head.parameters() if head is not None else ():
                p.normal_(0, 0.02)
    else:  # timing only: random weights of the same shapes, no reference model
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        random_packed(model)
    return fam, cfg, model, ops, fmt, theirs, theirs_prefill


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


def checkpoint_model(args: argparse.Namespace, spec: SpeculativeConfig | None, dev, dtype):
    """(family, config, model, ops, prompts) of a real checkpoint (--model), with the MTP head of
    spec's `model` folder when it names one; prompts: chat prompts on BENCH_TOPICS, real text for
    the drafts to be accepted on."""
    ckpt = open_checkpoint(args.model)
    head = open_mtp_head(spec.model, ckpt) if spec is not None and spec.model else None
    hf = head.hf if head is not None else ckpt.hf
    fam = ckpt.family
    cfg = fam.config(hf, str(ckpt.path), mtp=spec is not None and spec.method == "mtp")
    packing = ckpt.mtp_packing if cfg.mtp is not None and head is None else ckpt.packing
    model, ops = build(fam, cfg, hf, dev, dtype, packing.params if packing else None)
    print(f"kernels: {ops.chosen()}")
    load_weights(model, ckpt, head=head)
    tok = load_tokenizer(ckpt.path, ckpt.format)
    return fam, cfg, model, ops, bench_prompts(tok)


def bench_prompts(tok) -> list[list[int]]:
    """A checkpoint's timed prompts: `Tell me about X.` on BENCH_TOPICS, as chat ids."""
    return [chat_ids(tok, f"Tell me about {t}.") for t in BENCH_TOPICS]


def main(args: argparse.Namespace) -> int:
    dev = torch.device(args.device or "cuda")
    if args.release:
        print("dayzero bench decode: --release goes with --tensor-parallel-size N (the ranks' path)")
        return 2
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("dayzero bench decode: needs a CUDA GPU (none visible); on the CPU: --device cpu --model PATH")
        return 2
    if dev.type == "cpu" and not args.model:
        print("dayzero bench decode --device cpu: times a checkpoint (--model PATH), not a GPU-sized config")
        return 2
    if dev.type == "cpu" and (args.profile or args.quantization):
        print("dayzero bench decode --device cpu: --profile and --quantization are GPU-only")
        return 2
    dtype = parse_dtype(args.dtype, dev)  # default: bf16 on the GPU, fp32 on the CPU
    if dev.type == "cuda" and dtype != torch.bfloat16:
        print("dayzero bench decode: on CUDA it times bf16 (transformers' copy too); --dtype is for the CPU")
        return 2
    kv_bytes = KV_BYTES if dev.type == "cuda" else CPU_KV_BYTES
    speculative = SpeculativeConfig.parse(args.speculative_config)
    mtp = speculative is not None and speculative.method == "mtp"
    if args.model:
        fam, cfg, model, ops, prompts = checkpoint_model(args, speculative, dev, dtype)
        fmt, theirs, theirs_prefill = None, {}, float("nan")
    else:
        if speculative is not None and speculative.model:
            raise ValueError("--speculative-config 'model' (an MTP head's folder) goes with --model")
        fam, cfg, model, ops, fmt, theirs, theirs_prefill = bench_model(args, mtp, dev, dtype)
        prompts = None
    resident = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    where, stored = ("the GPU" if dev.type == "cuda" else "the CPU"), fmt or str(dtype).removeprefix("torch.")
    print(f"weights resident on {where}: {resident / 2**30:.2f} GiB ({stored})")
    bw = copy_bandwidth(dev)
    bpt, total, active = bytes_per_step(cfg, model, args.prompt_len)
    roofline = bw / bpt
    rate = f"{bw / 1e12:.2f} TB/s" if dev.type == "cuda" else f"{bw / 1e9:.1f} GB/s"
    print(
        f"params {total / 1e9:.2f}B, active {active / 1e9:.2f}B; copy bandwidth {rate}; "
        f"{bpt / 1e9:.2f} GB per decode step at batch 1 -> roofline {roofline:.0f} tok/s"
    )
    rows, host_gpu, drafted = [], None, []
    graphs = "off" if args.enforce_eager else "auto"
    for b in (int(x) for x in args.batches.split(",")):
        engine_cfg = EngineConfig(
            kv_cache_bytes=kv_bytes,
            host_cache_bytes=0,
            block_size=64,
            max_batch_size=b,
            max_tokens_per_step=8192,
            decode_graphs=graphs,
            overlap="off" if args.disable_overlap_schedule else "auto",
        )
        eng = Engine(model, cfg, ops, engine_cfg)
        print(f"batch {b}: {eng.graphs.report if eng.graphs else 'eager decode (no CUDA graphs)'}")
        ours, step_ms = time_ours(eng, b, args.prompt_len, args.new_tokens, cfg.embedding.vocab, prompts)
        if b == 1:
            on_gpu = dev.type == "cuda"
            host_gpu = (step_ms, gpu_step_ms(eng, args.prompt_len, cfg.embedding.vocab) if on_gpu else None)
        del eng
        torch.cuda.empty_cache()
        if speculative is not None:
            drafting = time_drafting(model, cfg, ops, engine_cfg, speculative, b, args, prompts)
            drafted.append((b, ours, step_ms, *drafting))
        rows.append((b, ours, theirs.get(b, float("nan"))))
        print(f"batch {b}: dayzero {ours:.1f} tok/s ({step_ms:.2f} ms a step)")
    prefill = None
    n, chunk = prefill_tokens(cfg, args)
    if args.prefill_len and dev.type == "cpu":
        print("prefill: timed on CUDA only (--device cpu times decode)")
    if args.prefill_len and dev.type == "cuda":
        base = torch.cuda.memory_allocated()  # the weights (transformers' copy is parked on the host)
        eng = Engine(
            model, cfg, ops,
            EngineConfig(kv_cache_bytes=KV_BYTES, host_cache_bytes=0, block_size=64, max_batch_size=1,
                         max_tokens_per_step=chunk, decode_graphs="off"),
        )  # fmt: skip
        ours_s, peak = time_prefill_ours(eng, n, cfg.embedding.vocab)
        print(
            f"prefill {n} tokens in chunks of {chunk}: peak device memory {peak / 2**30:.2f} GiB, of which "
            f"{base / 2**30:.2f} GiB before the engine and {KV_BYTES / 2**30:.2f} GiB the KV pool; "
            f"the rest (activations, state slots, workspace) {(peak - base - KV_BYTES) / 2**30:.2f} GiB"
        )
        del eng
        torch.cuda.empty_cache()
        prefill = (n, ours_s, theirs_prefill)
    if args.profile:  # each batch of --batches; the prefill once, after the first
        for i, b in enumerate(int(x) for x in args.batches.split(",")):
            vocab = cfg.embedding.vocab
            profile_decode(model, cfg, ops, args.prompt_len, vocab, b, 0 if i else n, chunk)
            if speculative is not None:
                graphs = not args.enforce_eager
                profile_decode(
                    model, cfg, ops, args.prompt_len, vocab, b, speculative=speculative, graphs=graphs
                )
    print(
        f"{'batch':>5} {'dayzero tok/s':>14} {'transformers tok/s':>19} {'ratio':>6} "
        f"{'roofline tok/s':>15} {'dayzero/roofline':>17}"
    )
    roofs = {}
    for b, ours, theirs in rows:
        roofs[b] = b * bw / bytes_per_step(cfg, model, args.prompt_len, b)[0]
        print(
            f"{b:>5} {ours:>14.1f} {theirs:>19.1f} {ours / theirs:>6.2f} "
            f"{roofs[b]:>15.0f} {ours / roofs[b]:>17.3f}"
        )
    if host_gpu is not None and host_gpu[1] is None:
        print(f"batch 1 decode step: {host_gpu[0]:.2f} ms wall")
    elif host_gpu is not None:
        print(
            f"batch 1 decode step: {host_gpu[0]:.2f} ms wall (host), {host_gpu[1]:.2f} ms forward on the GPU"
        )
    if speculative is not None:
        print_drafting(fam.name, speculative, drafted)
    if prefill is not None:
        n, o, t = prefill
        print(
            f"prefill {n} tokens, batch 1: dayzero {o:.3f} s ({n / o:.0f} tok/s), "
            f"transformers {t:.3f} s ({n / t:.0f} tok/s), transformers / dayzero {t / o:.2f}"
        )
    print(
        f"decode_{fam.name} "
        + " ".join(f"b{b}={o:.1f}" for b, o, _ in rows)
        + " "
        + " ".join(f"roofline_b{b}={roofs[b]:.0f}" for b, _, _ in rows)
        + " "
        + " ".join(f"hf_b{b}={t:.1f}" for b, _, t in rows)
    )
    print(
        "decode_vs_roofline "
        + " ".join(f"B{b}={o / roofs[b]:.3f}" for b, o, _ in rows)
        + f" prefill_vs_transformers P={prefill[2] / prefill[1] if prefill else float('nan'):.2f}"
    )
    return 0
