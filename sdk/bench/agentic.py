"""`dayzero bench agentic`: coding agents in the SWE-Smith shape, through the real server and the
OpenAI API.

Each of N agents runs T turns (seeded, between --turns' bounds): the first prompt is
--first-turn random token ids; every later prompt is the whole history (the previous prompt and
the model's answer) plus --turn-tokens new ids (the tool's output); each answer is greedy, at
most --max-output tokens, EOS ignored. The agents run concurrently, each waiting for its answer
before its next turn, against `dayzero serve MODEL` started in a subprocess; answers stream
(`stream_options.include_usage`, `return_token_ids`). With --random-weights the server runs the
--family's spec `bench` config (the decode benchmark's model) with random weights
(`--load-format dummy`) and the embedded default's tokenizer, so no checkpoint is needed.
Measured per turn: time to first token, decode rate (tokens after the first over the time after
it), and the prompt tokens the prefix cache served (`usage.prompt_tokens_details.cached_tokens`).
Printed: a table per turn, then per-user decode tok/s, TTFT p50 / p99, the prefix-cache hit rate
from turn 2 on and the total time, and a summary line. On a CUDA device the per-user rate is
set against the roofline as `dayzero bench decode` computes it (the device-to-device copy
bandwidth, measured before the server starts, over the bytes a step reads at --agents requests
of the turns' mean decode context: prompt + half the answer, weighted by answer tokens).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
import torch

from dayzero.kernels.selection import OpTable
from dayzero.sdk.api import embedded_default, resolve_model
from dayzero.sdk.bench.roofline import bytes_per_step, copy_bandwidth
from dayzero.sdk.families import FAMILIES, born_as, kernel_needs
from dayzero.sdk.loader import Checkpoint, open_checkpoint
from dayzero.sdk.loader.tokenizer import load_tokenizer
from dayzero.sdk.spec.reference import merge, spec_config

SERVER_START_S = 600  # loading a large checkpoint takes a while


@dataclass
class Turn:
    agent: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    decode_s: float  # from the first token to the last


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, flags: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dayzero.sdk.cli", "serve", *([model] if model else []), "--port", str(port)]
    proc = subprocess.Popen([*cmd, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {SERVER_START_S} s")


def agent(
    client: openai.OpenAI,
    name: str,
    idx: int,
    turns: int,
    args: argparse.Namespace,
    vocab: int,
    out: list[Turn],
) -> None:
    rng = np.random.default_rng([args.seed, idx])
    prompt = rng.integers(10, vocab, args.first_turn).tolist()
    for t in range(turns):
        t0, first, last, ids, use = time.perf_counter(), None, None, [], None
        stream = client.completions.create(
            model=name, prompt=prompt, max_tokens=args.max_output, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        for chunk in stream:
            new = (chunk.choices[0].model_extra or {}).get("token_ids") or [] if chunk.choices else []
            if new:
                last = time.perf_counter()
                first = first or last
                ids += new
            if chunk.usage is not None:
                use = chunk.usage
        cached = use.prompt_tokens_details.cached_tokens if use and use.prompt_tokens_details else 0
        out.append(
            Turn(idx, t + 1, len(prompt), cached, len(ids), (first or t0) - t0, (last or t0) - (first or t0))
        )
        prompt = prompt + ids + rng.integers(10, vocab, args.turn_tokens).tolist()


def _turns(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition("-")
    lo_n, hi_n = int(lo), int(hi or lo)
    if not 1 <= lo_n <= hi_n:
        raise ValueError(f"--turns {spec!r}: expected N or LO-HI with 1 <= LO <= HI")
    return lo_n, hi_n


def random_model(
    family: str,
    overrides: str | None,
    out: Path,
    context: int,
    tokenizer: str | None = None,
    release: bool = False,
    keep_vocab: bool = False,
) -> Path:
    """A folder serving FAMILY's spec `bench` config (release: the spec's own, the release
    checkpoint's shapes) + JSON overrides with random weights: its config.json (positions >=
    context; the tokenizer's vocabulary, or with keep_vocab the config's, which must hold it)
    beside a tokenizer: the embedded default's, saved from its GGUF, or the one in the folder
    `tokenizer`; served with --load-format dummy."""
    spec = FAMILIES.get(family).spec.spec
    tok = load_tokenizer(Path(tokenizer), "hf") if tokenizer else load_tokenizer(embedded_default(), "gguf")
    base = merge({} if release else dict(spec.bench), {"max_position_embeddings": context})
    if not keep_vocab:
        base = merge(base, {"vocab_size": len(tok)})
    hf = spec_config(spec, merge(base, json.loads(overrides) if overrides else {}))
    vocab = FAMILIES.get(family).config(hf).embedding.vocab
    if vocab < len(tok):
        raise ValueError(f"{family}'s vocabulary of {vocab} does not hold the tokenizer's {len(tok)} tokens")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    tok.save_pretrained(str(out))
    return out


def main(args: argparse.Namespace) -> int:
    lo, hi = _turns(args.turns)
    rng = np.random.default_rng(args.seed)
    plan = [int(rng.integers(lo, hi + 1)) for _ in range(args.agents)]
    longest = args.first_turn + max(plan) * (args.max_output + args.turn_tokens)
    if args.release and not args.random_weights:
        print("dayzero bench agentic: --release goes with --random-weights (the release config's shapes)")
        return 2
    with tempfile.TemporaryDirectory(prefix="dayzero-agentic-") as tmp:
        if args.random_weights:
            context = longest + args.max_output
            folder = random_model(args.family, args.set, Path(tmp), context, args.tokenizer, args.release)
            args.model = str(folder)
            args.serve_flags = f"{args.serve_flags} --load-format dummy"
            which = "release" if args.release else "bench"
            print(f"serving the {args.family} {which} config with random weights from {args.model}")
        return run(args, plan, longest)


def run(args: argparse.Namespace, plan: list[int], longest: int) -> int:
    path = resolve_model(args.model) if args.model else embedded_default()
    ckpt = open_checkpoint(path)
    vocab = ckpt.family.config(ckpt.hf).embedding.vocab
    flags = ["--max-model-len", str(longest + args.max_output), "--max-num-seqs", str(max(args.agents, 1))]
    flags += ["--device", args.device] if args.device else []
    flags += ["--dtype", args.dtype] if args.dtype else []
    flags += args.serve_flags.split() if args.serve_flags else []
    on_gpu = torch.cuda.is_available() and args.device in (None, "cuda")
    bw = copy_bandwidth(torch.device("cuda")) if on_gpu else None  # before the server holds the GPU
    torch.cuda.empty_cache()  # the server sizes its cache from the memory left
    port = args.port or _free_port()
    print(f"starting dayzero serve {args.model or '(embedded default)'} {' '.join(flags)} on port {port}")
    t_start = time.perf_counter()
    proc = start_server(args.model, port, flags)
    try:
        print(f"server up in {time.perf_counter() - t_start:.1f} s; {args.agents} agent(s), turns {plan}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=3600)
        name = client.models.list().data[0].id
        turns: list[Turn] = []
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=agent, args=(client, name, i, n, args, vocab, turns))
            for i, n in enumerate(plan)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        total = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if len(turns) != sum(plan):
        print(f"dayzero bench agentic: {sum(plan) - len(turns)} turn(s) did not complete", file=sys.stderr)
        return 1
    roof = roofline(ckpt, turns, args.agents, bw) if bw else None
    return report(sorted(turns, key=lambda r: (r.agent, r.turn)), total, roof)


def roofline(ckpt: Checkpoint, turns: list[Turn], agents: int, bw: float) -> float:
    """Per-user decode tok/s the copy bandwidth allows at `agents` requests of the turns' mean
    decode context (bf16 weights, the model built on the meta device: shapes only)."""
    cfg = ckpt.family.config(ckpt.hf)
    dtype = torch.bfloat16  # kernels chosen for the CPU: the parameters' shapes are the same
    with born_as(torch.device("meta"), dtype):
        model = ckpt.family.module("model").Model(
            cfg, kernel_needs(cfg, OpTable(torch.device("cpu"), dtype)).resolve()
        )
    decoded = sum(r.output_tokens for r in turns)
    ctx = sum((r.prompt_tokens + r.output_tokens / 2) * r.output_tokens for r in turns) / max(decoded, 1)
    nbytes, _, _ = bytes_per_step(cfg, model, int(ctx), batch=agents)
    print(f"roofline: {bw / 1e12:.2f} TB/s copy, {nbytes / 1e9:.2f} GB a step at {agents} x {ctx:.0f} tokens")
    return bw / nbytes


def report(turns: list[Turn], total: float, roof: float | None = None) -> int:
    print(
        f"{'agent':>5} {'turn':>4} {'prompt':>8} {'cached':>8} {'output':>6} {'ttft s':>8} "
        f"{'decode tok/s':>12}"
    )
    for r in turns:
        rate = (r.output_tokens - 1) / r.decode_s if r.output_tokens > 1 and r.decode_s > 0 else float("nan")
        print(
            f"{r.agent:>5} {r.turn:>4} {r.prompt_tokens:>8} {r.cached_tokens:>8} {r.output_tokens:>6} "
            f"{r.ttft_s:>8.3f} {rate:>12.1f}"
        )
    decode_tok = sum(max(r.output_tokens - 1, 0) for r in turns)
    decode_s = sum(r.decode_s for r in turns)
    per_user = decode_tok / decode_s if decode_s > 0 else float("nan")
    ttft = np.array([r.ttft_s for r in turns])
    later = [r for r in turns if r.turn > 1]
    hit = (
        sum(r.cached_tokens for r in later) / max(sum(r.prompt_tokens for r in later), 1)
        if later
        else float("nan")
    )
    p50, p99 = float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99))
    vs = f" = {per_user / roof:.3f} of the roofline ({roof:.0f} tok/s)" if roof else ""
    print(
        f"per-user decode {per_user:.1f} tok/s{vs}; TTFT p50 {p50:.3f} s, p99 {p99:.3f} s; "
        f"prefix-cache hit rate from turn 2 {hit:.3f}; {len(turns)} turns in {total:.1f} s"
    )
    print(
        f"agentic per_user_tok_s={per_user:.1f} ttft_p50={p50:.3f} ttft_p99={p99:.3f} "
        f"hit_rate={hit:.3f} total_s={total:.1f}" + (f" vs_roofline={per_user / roof:.3f}" if roof else "")
    )
    return 0
