"""`dayzero bench decode`: decode tokens/s on a GPU for a family's scaled config.

The config is the reference config class's defaults (the real model's widths and head shapes)
with the spec's `bench` overrides (fewer layers and experts, so it fits one GPU), plus `--set`.
Random bf16 weights are made once, in the reference class on the GPU, and handed to dayzero
through the spec's weight rules (under their checkpoint names), so both run the same weights in
the same process. transformers is timed first and then parked in host memory before dayzero's
copy is built, so the two copies never share the GPU (Beam's 20B bench config: 41 GB of bf16
weights at a time instead of both copies' 82 GB). Each batch decodes after a prompt of
--prompt-len random tokens.
Roofline: bytes a decode step must read (every weight except the embedding table and the
experts no token of the batch uses, plus each request's cache: KV rows and latent / index keys
it attends to, recurrent state read and written) over the device-to-device copy bandwidth
measured in the same run (bytes read + written).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import torch

from dayzero.kernels.packed import FORMATS
from dayzero.kernels.selection import OpTable
from dayzero.sdk.api import parse_dtype
from dayzero.sdk.bench.packed_weights import bench_packing, packable, quantized_stream, random_packed
from dayzero.sdk.bench.roofline import bytes_per_step, copy_bandwidth
from dayzero.sdk.bench.timing import (
    CPU_KV_BYTES,
    KV_BYTES,
    gpu_step_ms,
    prefill_tokens,
    print_drafting,
    profile_decode,
    time_drafting,
    time_ours,
    time_prefill_ours,
    time_reference,
)
from dayzero.sdk.engine.drafters import SpeculativeConfig
from dayzero.sdk.engine.engine import Engine, EngineConfig
from dayzero.sdk.families import FAMILIES, born_as, build, kernel_needs
from dayzero.sdk.loader import Checkpoint, load_weights, open_checkpoint, open_mtp_head
from dayzero.sdk.loader.tokenizer import chat_ids, load_tokenizer
from dayzero.sdk.quant.packing import PackedParam
from dayzero.sdk.spec.reference import merge, reference_class, spec_config

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


def bench_model(args: argparse.Namespace, mtp: bool, dev: torch.device, dtype: torch.dtype):
    """(family, config, model, ops, the weight format, transformers' tok/s by batch, its prefill
    seconds): the family's bench config with random weights, made in the reference class when it
    runs (timed there first, then parked on the host and copied into dayzero's model)."""
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
