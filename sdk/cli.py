"""The `dayzero` command: one small handler per verb; the work lives in the modules they call.

Each handler imports its verb's modules when it runs, so `dayzero --help` and a bad flag answer
at once, without loading torch (the cli is the top floor: nothing imports it)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dayzero.kernels.registry import Registry
    from dayzero.sdk.families import Family


def _use_spec(args: argparse.Namespace) -> None:
    """`--spec PATH`: that spec's family is registered for this process (and the processes it
    starts) and is the verb's family."""
    if args.spec is not None:
        from dayzero.sdk.families import spec_family

        args.family = spec_family(args.spec, args.family)


def _bench(args: argparse.Namespace) -> int:
    _use_spec(args)
    args.family = args.family or "beam"
    if args.part != "decode" and (args.tensor_parallel_size is not None or args.enable_expert_parallel):
        print(
            f"dayzero bench {args.part}: --tensor-parallel-size and --enable-expert-parallel are decode's "
            "(agentic: --serve-flags)",
            file=sys.stderr,
        )
        return 2
    if args.enable_expert_parallel and args.tensor_parallel_size is None:
        print("dayzero bench decode: --enable-expert-parallel needs --tensor-parallel-size", file=sys.stderr)
        return 2
    if args.part == "scheduler":
        from dayzero.sdk.bench import scheduler

        scheduler.run(tuple(int(x) for x in args.sizes.split(",")), args.steps)
        return 0
    if args.part == "agentic":
        from dayzero.sdk.bench import agentic

        if args.spec is not None:  # the server it starts serves that family too
            args.serve_flags = f"{args.serve_flags} --spec {args.spec}"
        return agentic.main(args)
    if args.tensor_parallel_size is not None:
        from dayzero.sdk.bench import parallel

        return parallel.main(args)
    from dayzero.sdk.bench import decode

    return decode.main(args)


def _generate(args: argparse.Namespace) -> int:
    from dayzero.sdk.api import LLM
    from dayzero.sdk.engine.engine import SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype, family=args.family, spec=args.spec)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    for c in llm.generate(args.prompt, params):
        print(c.text if not args.show_prompt else c.prompt + c.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from dayzero.sdk.server.serve import serve

    _use_spec(args)
    return serve(args)


def _specs(args: argparse.Namespace) -> int:
    from dayzero.sdk.families import FAMILIES

    _use_spec(args)
    rows, broken = specs_table(FAMILIES)
    print("\n".join(rows))
    for line in broken:
        print(f"dayzero specs: {line}", file=sys.stderr)
    return 1 if broken else 0


def specs_table(families: Registry[Family]) -> tuple[list[str], list[str]]:
    """(the table: a header and a row per family that loads, what is wrong with each that does
    not): one invalid spec under models/ leaves the others listed."""
    from dayzero.sdk.codegen.support import device_support

    rows = [f"{'family':<12} {'serves':<34} {'blocks':<34} {'mtp':<12} {'cpu':<26} {'cuda':<26} origin"]
    broken = []
    for name, fam in families.items():
        try:
            s = fam.spec.spec
            blocks = ", ".join(sorted({o.kind for o in fam.spec.blocks.values()}))
            dev = device_support(fam)
        except (ValueError, ImportError, KeyError) as e:  # a bad spec, or its code not generated yet
            broken.append(f"{name}: left out, invalid: {e}")
            continue
        rows.append(
            f"{name:<12} {'/'.join(s.architectures):<34} {blocks:<34} "
            f"{s.mtp.kind + ' (soon)' if s.mtp else '-':<12} {dev['cpu']:<26} {dev['cuda']:<26} "
            f"{fam.origin if fam.in_tree else f'{fam.origin}: {fam.spec_path}'}"
        )
    return rows, broken


def _new(args: argparse.Namespace) -> int:
    from dayzero.sdk.families import MODELS_DIR
    from dayzero.sdk.spec.draft import write_draft

    hf = json.loads(Path(args.from_config).read_text())
    out = Path(args.out) if args.out else MODELS_DIR / args.name
    path = write_draft(args.name, hf, out)
    then = (
        f"dayzero codegen {args.name}"
        if out.resolve().is_relative_to(MODELS_DIR)
        else f"dayzero codegen --spec {path}"
    )
    print(f"wrote {path} (validated); review the '# check:' lines, then run `{then}`")
    return 0


def _codegen(args: argparse.Namespace) -> int:
    from dayzero.sdk import codegen
    from dayzero.sdk.families import FAMILIES, register_spec

    if args.spec and args.family:
        print("dayzero codegen: give FAMILY or --spec, not both", file=sys.stderr)
        return 2
    if args.spec:  # out-of-tree specs: their files, written next to each
        names = [register_spec(p).name for p in args.spec]
    else:  # installed packages' families are written by name or --spec, never all at once
        names = [args.family] if args.family else [n for n, f in FAMILIES.items() if f.in_tree]
    stale = []
    for name in names:
        fam = FAMILIES.get(name)
        if args.check:
            stale += codegen.stale(fam)
        else:
            changed = codegen.write(fam)
            print(f"codegen {name}: spec.yaml@{fam.spec.hash} -> {len(changed)} file(s) written")
    if args.family is None and not args.spec:
        stale += codegen.stale_docs() if args.check else []
        if not args.check and codegen.write_docs():
            print(f"codegen: {codegen.SPEC_DOC} written")
    if args.check:
        for p in stale:
            fix = f" --spec {p.parent / 'spec.yaml'}" if args.spec else ""
            print(f"stale: {p} (run `dayzero codegen{fix}`)", file=sys.stderr)
        print(f"codegen --check: {len(stale)} stale file(s) in {len(names)} family spec(s)")
        return 1 if stale else 0
    return 0


def _coverage(args: argparse.Namespace) -> int:
    from dayzero.sdk.codegen import coverage

    if args.check:
        found = coverage.problems(coverage.survey(), coverage.load_records())
    else:
        found = coverage.update(args.family or None, args.jobs, _say)
    for line in found:
        print(f"coverage: {line}", file=sys.stderr)
    print(f"coverage{' --check' if args.check else ''}: {len(found)} problem(s); table {coverage.TABLE}")
    return 1 if found else 0


def _tiny(args: argparse.Namespace) -> int:
    from dayzero.sdk.parity.quantized_tiny import write_quantized_tiny
    from dayzero.sdk.parity.tiny import write_tiny

    _use_spec(args)
    if args.family is None:
        print("dayzero tiny: give FAMILY or --spec", file=sys.stderr)
        return 2
    overrides = json.loads(args.set) if args.set else None
    if args.quantization is None:
        print(write_tiny(args.family, args.out, seed=args.seed, overrides=overrides))
    else:
        q, layout = args.quantization, args.layout
        print(write_quantized_tiny(args.family, args.out, q, layout, seed=args.seed, overrides=overrides))
    return 0


def _parity(args: argparse.Namespace) -> int:
    from dayzero.sdk.parity.runner import run_parity
    from dayzero.sdk.parity.tiny import write_tiny

    _use_spec(args)
    if args.checkpoint is None and args.family is None:
        print("dayzero parity: give FAMILY, --spec PATH, --checkpoint DIR, or both", file=sys.stderr)
        return 2
    if args.enable_dp_attention and args.tensor_parallel_size < 2:
        print("dayzero parity: --enable-dp-attention needs --tensor-parallel-size >= 2", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or write_tiny(args.family, Path(tmp) / "tiny", seed=args.seed)
        report = run_parity(
            ckpt, device=args.device, dtype=args.dtype, seed=args.seed, family=args.family, progress=_say
        )
    print(report.table())
    ok = report.ok
    if args.tensor_parallel_size > 1:
        from dayzero.sdk.api import default_device
        from dayzero.sdk.loader import open_checkpoint
        from dayzero.sdk.parity.parallel import compare_ranks

        with tempfile.TemporaryDirectory() as tmp:
            ckpt = args.checkpoint or write_tiny(args.family, Path(tmp) / "tiny", seed=args.seed)
            vocab = open_checkpoint(ckpt).hf["vocab_size"]
            device = "cuda" if (args.device or default_device()) == "cuda" else "cpu"
            where = "one GPU a rank, NCCL" if device == "cuda" else "CPU ranks, gloo"
            _say(f"tensor parallel: {args.tensor_parallel_size} ranks against one ({where}, fp32)")
            size, experts = args.tensor_parallel_size, args.enable_expert_parallel
            tol = 1e-4 if device == "cuda" else 1e-5  # GPU fp32 sums in other orders (issue 21's bound)
            tp_ok, lines = compare_ranks(
                str(ckpt), size, experts, args.seed, vocab, tmp, tol, device, args.enable_dp_attention
            )
        print("\n".join(lines))
        ok = ok and tp_ok
    return 0 if ok else 1


def _say(line: str) -> None:
    """Progress on stderr, at once (stdout keeps the verb's table)."""
    print(line, file=sys.stderr, flush=True)


def _kernels(args: argparse.Namespace) -> int:
    import torch

    from dayzero.kernels.registry import KERNELS, OPS
    from dayzero.kernels.selection import KernelSelectionError, Need, load_plugins, select
    from dayzero.sdk.api import default_device, parse_dtype

    load_plugins()
    dev = torch.device(args.device or default_device())
    dtype = parse_dtype(args.dtype, dev)
    print(f"kernels on {dev.type}/{str(dtype).removeprefix('torch.')}")
    # selected: the best kernel for the op itself; a model needing a feature (registered
    # column) may get another, named when it is built
    print(f"{'op':<14} {'selected':<10} registered (backend: devices; features)")
    for op, _ in OPS.items():
        try:
            chosen = select(Need(op, frozenset()), dev, dtype).backend
        except KernelSelectionError:
            chosen = "(none)"
        regs = [
            f"{k.backend}: {','.join(sorted(k.caps.devices))}; {','.join(sorted(k.caps.features)) or '-'}"
            for _, k in KERNELS.items()
            if k.op == op
        ]
        print(f"{op:<14} {chosen:<10} {' | '.join(regs)}")
    print("override one op with DAYZERO_KERNEL_<OP>=<backend>")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dayzero", description="dayzero: Day-0 model enablement from a declarative spec."
    )
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True

    def spec_flag(q: argparse.ArgumentParser) -> None:
        q.add_argument(
            "--spec",
            default=None,
            metavar="PATH",
            help="a spec.yaml outside models/ (or its folder): its family, generated next to it by "
            "`dayzero codegen --spec PATH`, is this run's family",
        )

    def device_flags(q: argparse.ArgumentParser) -> None:
        q.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
        q.add_argument(
            "--dtype", default=None, help="float32, bfloat16, float16 (default: fp32 on CPU, bf16 on GPU)"
        )

    b = sub.add_parser("bench", help="measure a part of dayzero (prints a table and a summary line)")
    b.add_argument(
        "part",
        choices=["scheduler", "decode", "agentic"],
        help=(
            "scheduler: control plane vs TokenSpeed; decode: GPU (a checkpoint on the CPU: --device cpu "
            "--model); agentic: agents through the server"
        ),
    )
    b.add_argument("--sizes", default="32,256,1024", help="scheduler: live request counts (comma separated)")
    b.add_argument("--steps", type=int, default=1000, help="scheduler: timed decode steps per size")
    b.add_argument(
        "--family",
        default=None,
        help="decode, agentic --random-weights: the family (its bench config; default beam)",
    )
    spec_flag(b)
    b.add_argument(
        "--set", default=None, help="decode, agentic --random-weights: JSON overrides of the bench config"
    )
    b.add_argument("--batches", default="1,32", help="decode: batch sizes")
    b.add_argument("--prompt-len", type=int, default=512, help="decode: prompt tokens before timing")
    b.add_argument("--new-tokens", type=int, default=64, help="decode: timed tokens per request")
    b.add_argument(
        "--no-reference",
        dest="reference",
        action="store_false",
        help="decode: skip transformers (random weights, dayzero timing only)",
    )
    b.add_argument(
        "--profile", action="store_true", help="decode: profile steps at each of --batches (torch.profiler)"
    )
    b.add_argument(
        "--prefill-len", type=int, default=8192, help="decode: prefill tokens timed at batch 1 (0: skip)"
    )
    b.add_argument(
        "--prefill-chunk", type=int, default=8192, help="decode: tokens a step of that prefill (chunked)"
    )
    b.add_argument("--enforce-eager", action="store_true", help="decode: no CUDA graphs (as vLLM's flag)")
    b.add_argument(
        "--speculative-config",
        default=None,
        help="decode: also time each batch drafting so (vLLM's JSON; method mtp: the bench config's "
        "MTP head, random weights, where the config has one (else --set its layer count); with --model "
        "the checkpoint's, or the head folder of 'model'): tok/s, acceptance length, break-even",
    )
    b.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        help="decode: through LLM on N ranks (one GPU each over NCCL; CPU ranks over gloo with --device "
        "cpu --model); 1: the same path on one rank, the ranks' baseline",
    )
    b.add_argument(
        "--release",
        action="store_true",
        help="decode --tensor-parallel-size, agentic --random-weights: the release config's shapes "
        "(random weights) instead of the bench config",
    )
    b.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="decode, with --tensor-parallel-size: experts whole per rank",
    )
    b.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="decode: read each step's tokens back before planning the next (as SGLang's flag)",
    )
    b.add_argument(
        "--quantization",
        default=None,
        help="decode: nvfp4, mxfp4 or fp8_block weights for dayzero (ModelOpt layout; transformers: bf16)",
    )
    b.add_argument(
        "--model",
        default=None,
        help="decode: a real checkpoint instead of --family's bench config (chat prompts, no transformers "
        "run); agentic: MODEL for dayzero serve (default: the embedded one)",
    )
    b.add_argument("--agents", type=int, default=1, help="agentic: concurrent agents")
    b.add_argument("--turns", default="10-15", help="agentic: turns per agent, N or LO-HI (seeded)")
    b.add_argument("--first-turn", type=int, default=50_000, help="agentic: tokens of the first prompt")
    b.add_argument("--turn-tokens", type=int, default=800, help="agentic: new tokens each later turn")
    b.add_argument("--max-output", type=int, default=500, help="agentic: answer tokens at most")
    b.add_argument("--seed", type=int, default=0, help="agentic: seeds the token content and turn counts")
    b.add_argument("--port", type=int, default=0, help="agentic: server port (0: a free one)")
    b.add_argument("--serve-flags", default="", help="agentic: more `dayzero serve` flags, as one string")
    b.add_argument(
        "--random-weights",
        action="store_true",
        help="agentic: serve --family's bench config (+ --set) with random weights instead of MODEL",
    )
    b.add_argument(
        "--tokenizer",
        default=None,
        help="agentic --random-weights: a tokenizer folder (default: the embedded default's, from its GGUF)",
    )
    device_flags(b)
    b.set_defaults(fn=_bench)

    g = sub.add_parser(
        "generate", help="generate text offline (no MODEL: the embedded SmolLM2-135M-Instruct)"
    )
    g.add_argument("model", nargs="?", default=None, help="checkpoint folder or .gguf file")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--family",
        default=None,
        help="force a family instead of detecting it (also a config.json whose architectures is wrong)",
    )
    g.add_argument("--show-prompt", action="store_true", help="print the prompt before the continuation")
    spec_flag(g)
    device_flags(g)
    g.set_defaults(fn=_generate)

    sv = sub.add_parser(
        "serve", help="an OpenAI-compatible server (no MODEL: the embedded SmolLM2-135M-Instruct)"
    )
    from dayzero.sdk.server.serve import add_arguments

    add_arguments(sv)
    spec_flag(sv)
    sv.set_defaults(fn=_serve)

    s = sub.add_parser("specs", help="list the model families and what they support")
    spec_flag(s)
    s.set_defaults(fn=_specs)

    n = sub.add_parser("new", help="draft models/NAME/spec.yaml from an HF config.json")
    n.add_argument("name")
    n.add_argument("--from-config", required=True, help="path of an HF config.json")
    n.add_argument("--out", default=None, help="folder for spec.yaml (default: models/NAME)")
    n.set_defaults(fn=_new)

    c = sub.add_parser("codegen", help="render templates/ into models/<family>/ from each spec")
    c.add_argument("family", nargs="?", default=None)
    c.add_argument(
        "--spec",
        action="append",
        metavar="PATH",
        help="a spec.yaml outside models/ (repeatable): its files are written (or checked) next to it",
    )
    c.add_argument(
        "--check", action="store_true", help="exit 1 when a generated file is stale; write nothing"
    )
    c.set_defaults(fn=_codegen)

    cv = sub.add_parser(
        "coverage",
        help="measure the surveyed architectures' families (light parity) into docs/coverage.md",
    )
    cv.add_argument("family", nargs="*", help="measure these families (default: those whose record is stale)")
    cv.add_argument(
        "--check", action="store_true", help="exit 1 when the table or a record is stale; run nothing"
    )
    cv.add_argument("--jobs", type=int, default=1, help="families measured at a time (one process each)")
    cv.set_defaults(fn=_coverage)

    t = sub.add_parser(
        "tiny", help="write a small random HF checkpoint of FAMILY through its reference class"
    )
    t.add_argument("family", nargs="?", default=None, help="family (or --spec)")
    t.add_argument("out")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--set", default=None, help="JSON object of HF config overrides")
    t.add_argument(
        "--quantization",
        default=None,
        help="nvfp4, mxfp4, fp8 or mixed (FP8-block attention, NVFP4 elsewhere), by NVIDIA ModelOpt",
    )
    t.add_argument(
        "--layout",
        default="modelopt",
        help="checkpoint convention: modelopt; fp8 also deepseek; mxfp4 also gpt_oss, compressed_tensors",
    )
    spec_flag(t)
    t.set_defaults(fn=_tiny)

    q = sub.add_parser("parity", help="compare dayzero with the reference implementation on one checkpoint")
    q.add_argument("family", nargs="?", default=None, help="family (optional with --checkpoint or --spec)")
    spec_flag(q)
    q.add_argument("--checkpoint", default=None, help="checkpoint folder (default: a tiny random one)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="also run the checkpoint on N ranks against one, fp32 (CPU ranks over gloo; --device cuda: "
        "one GPU a rank over NCCL)",
    )
    q.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size: experts whole per rank",
    )
    q.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="with --tensor-parallel-size: each rank attends for its own requests (experts whole a rank)",
    )
    device_flags(q)
    q.set_defaults(fn=_parity)

    k = sub.add_parser("kernels", help="show registered kernels and what this device would select")
    device_flags(k)
    k.set_defaults(fn=_kernels)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args))
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError, KeyError) as e:
        print(f"dayzero {args.verb}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
