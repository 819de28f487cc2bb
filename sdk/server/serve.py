"""`dayzero serve`: check the flags, take the port, load the model, serve until SIGTERM/SIGINT.

Start-up fails before the model loads on a bad flag, a busy port or a chat template that cannot
render (`startup.py`); "serving" is said once the socket listens. Shutdown drains: uvicorn stops
accepting connections and in-flight requests may finish for --shutdown-timeout seconds; then
every request still running is aborted, so that each stream ends with a final chunk
(`finish_reason` "abort") and `[DONE]`; then the engine thread stops and the process exits 0.
The flags (`add_arguments`, read by the cli to build its parser) need no torch: the engine, the
model and the app are imported when `load` / `serve` run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
from typing import TYPE_CHECKING

from dayzero.sdk.server import startup
from dayzero.sdk.server.startup import parse_gib, parse_size
from dayzero.sdk.server.workers import DEFAULT_QUEUE, DEFAULT_WORKERS, WorkPool, fix_malloc_thresholds

if TYPE_CHECKING:
    import uvicorn

    from dayzero.sdk.server.state import ServerState

log = logging.getLogger("dayzero.server")

ABORT_GRACE_S = 10.0  # after the aborts, for the streams' final chunks before uvicorn cancels them


def refuse_unsupported_flags(args: argparse.Namespace) -> None:
    """Flags this build cannot honour fail at start with the reason, never silently."""
    if args.kv_cache_dtype not in ("auto",):
        raise ValueError(
            f"--kv-cache-dtype {args.kv_cache_dtype}: only 'auto' (the model dtype) is supported yet"
        )
    from dayzero.sdk.engine.drafters import SpeculativeConfig

    try:
        SpeculativeConfig.parse(args.speculative_config)
    except ValueError as e:  # json.JSONDecodeError is one
        raise ValueError(f"--speculative-config: {e}") from None


def engine_config(args: argparse.Namespace, device: str, _cfg=None):
    """The flags' engine; as LLM's `engine` (called with the model config, `_cfg`) every
    tensor-parallel rank evaluates it, so each measures its own free device memory."""
    import torch

    from dayzero.sdk.engine.engine import EngineConfig

    if args.kv_cache_memory:
        kv = parse_size(args.kv_cache_memory)
    elif device == "cuda":
        free, total = torch.cuda.mem_get_info()
        kv = int(free - (1 - args.gpu_memory_utilization) * total)  # weights are already resident
        if kv <= 0:
            raise ValueError(f"--gpu-memory-utilization {args.gpu_memory_utilization} leaves no KV memory")
    else:
        kv = 512 << 20
    chunk = args.chunked_prefill_size or None
    return EngineConfig(
        kv_cache_bytes=kv,
        host_cache_bytes=parse_gib(args.swap_space),
        max_batch_size=args.max_num_seqs,
        max_tokens_per_step=max(args.max_num_batched_tokens, chunk or 0),
        chunk_size=chunk,
        prefix_cache=args.enable_prefix_caching,
        max_model_len=args.max_model_len,
        decode_graphs="off" if args.enforce_eager else "auto",
        overlap="off" if args.disable_overlap_schedule else "auto",
    )


def launch_of(args: argparse.Namespace):
    """Where this process sits among the tensor-parallel ranks (torchrun's environment, else the
    --nnodes / --node-rank / --master-addr / --master-port flags)."""
    from dayzero.sdk.engine.parallel import Launch

    kw = dict(nnodes=args.nnodes, node_rank=args.node_rank, addr=args.master_addr, port=args.master_port)
    return Launch.from_env(args.tensor_parallel_size, **kw)


def load(args: argparse.Namespace, template: str | None = None, launch=None):
    """(the loaded LLM, the server state) for the command line's model and flags; `template`:
    the --chat-template file's text; `launch`: this process's place among tensor-parallel ranks
    (a rank other than 0 gets no server state)."""
    refuse_unsupported_flags(args)
    from dayzero.sdk.api import LLM, default_device
    from dayzero.sdk.loader.tokenizer import fill_word_cache
    from dayzero.sdk.server.async_engine import AsyncEngine
    from dayzero.sdk.server.metrics import Metrics
    from dayzero.sdk.server.state import ServerState

    device = args.device or default_device()

    def before_weights(llm: LLM) -> None:
        limit = llm.config.max_position
        if args.max_model_len and limit and args.max_model_len > limit:
            raise ValueError(f"--max-model-len {args.max_model_len} exceeds the model's {limit}")
        startup.probe_template(llm.tokenizer, template)

    llm = LLM(
        args.model,
        device=device,
        dtype=args.dtype,
        # called by every rank once its weights are resident (its free device memory is known)
        engine=functools.partial(engine_config, args, device),
        family=args.family,
        quantization=args.quantization,
        quantize_activations=args.quantize_activations,
        before_weights=before_weights,
        load_format=args.load_format,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        enable_dp_attention=args.enable_dp_attention,
        speculative_config=args.speculative_config,  # method mtp: its head built and loaded
        launch=launch,
    )
    if llm.rank != 0:
        return llm, None
    max_len = llm.engine.max_model_len
    name = args.served_model_name or (str(args.model) if args.model else "SmolLM2-135M-Instruct")
    metrics = Metrics()
    state = ServerState(
        AsyncEngine(llm.engine, args.max_waiting, metrics),
        llm.tokenizer,
        name,
        max_len,
        template,
        metrics,
        api_keys=api_keys(args),
        sampling_defaults=llm.sampling_defaults if args.generation_config == "auto" else {},
        tool_parser=tool_parser(args, llm),
        grammars=lambda: llm.grammars,
        max_request_bytes=parse_size(args.max_request_bytes),
        # each tokenizer thread fills its own word cache (HF tokenizers keep one a thread)
        pool=WorkPool(
            args.tokenizer_workers, args.tokenizer_queue, functools.partial(fill_word_cache, llm.tokenizer)
        ),
    )
    return llm, state


def tool_parser(args: argparse.Namespace, llm):
    """--tool-call-parser, else the family spec's `tool_parser` (None: tools are refused)."""
    from dayzero.sdk.server.tools import TOOL_PARSERS  # like torch above: not at CLI start-up

    name = args.tool_call_parser or llm.checkpoint.family.spec.spec.tool_parser
    return TOOL_PARSERS.get(name) if name else None


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key (repeatable), DAYZERO_API_KEY and vLLM's VLLM_API_KEY (comma-separated): any of
    them is accepted."""
    env = [*os.environ.get("DAYZERO_API_KEY", "").split(","), *os.environ.get("VLLM_API_KEY", "").split(",")]
    keys = [*(args.api_key or []), *env]
    return tuple(k.strip() for k in keys if k.strip())


def follow(args: argparse.Namespace, launch) -> int:
    """A tensor-parallel rank other than 0 (another host's first rank, or under torchrun): load
    this rank's shard (and start this host's other ranks), run rank 0's plans until it stops."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # rank 0 drains on them, then sends the stop
        signal.signal(sig, signal.SIG_IGN)
    llm, _ = load(args, None, launch)
    log.info("tensor-parallel rank %d of %d: following rank 0", llm.rank, launch.size)
    from dayzero.sdk.engine.parallel import RankError  # like torch: not at CLI start-up

    try:
        steps = llm.follow()
    except RankError:  # a step failed on this rank: logged and reported to rank 0 already
        return 1
    except RuntimeError as e:  # gloo: rank 0's connection closed (its host died) or timed out
        log.error("tensor-parallel rank %d: lost rank 0: %s", llm.rank, str(e).splitlines()[0])
        return 1
    log.info("tensor-parallel rank %d: stopped by rank 0 after %d steps", llm.rank, steps)
    return 0


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    template = startup.check_flags(args)  # before torch is imported: a bad flag answers at once
    launch = launch_of(args)
    if launch.this_rank != 0:
        return follow(args, launch)
    sock = startup.bind(args.host, args.port)
    fix_malloc_thresholds()  # a big request's memory goes back to the system (workers.py says why)
    where = startup.url(args.host, sock.getsockname()[1])
    log.info("%s is reserved; loading the model (connections are refused until it serves)", where)
    startup.warn_if_open(args.host, api_keys(args))
    import uvicorn

    from dayzero.sdk.server.app import build_app

    startup.check_names(args)
    llm, state = load(args, template, launch)
    startup.listen(sock, args.host)
    app = build_app(state)
    loop: list[asyncio.AbstractEventLoop] = []

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loop.append(asyncio.get_running_loop())
        state.engine.start()
        yield
        state.engine.accepting = False
        state.engine.stop()
        state.pool.shutdown()
        state.parser.shutdown()

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=args.shutdown_timeout + ABORT_GRACE_S
    )
    served = f"serving {state.model_name} on {where} (load {llm.load_seconds:.1f} s)"
    server = _draining_server_class()(config, state, args.shutdown_timeout, served)

    def rank_failed(why: str) -> None:  # a rank is gone: every request ends, the server stops
        if loop and not loop[0].is_closed():
            loop[0].call_soon_threadsafe(state.engine.abort_all, why)
        server.should_exit = True

    llm.on_rank_failure = rank_failed
    try:
        server.run(sockets=[sock])
    finally:
        llm.close()  # the other ranks stop (rank 0 sends the stop; this host's ranks are joined)
    if llm.rank_failure is not None:
        log.error("stopped: %s", llm.rank_failure)
        return 1
    return 0


def _draining_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn with dayzero's start and stop: "serving" once the socket listens; on SIGTERM /
        SIGINT /health turns 503, requests may finish for `timeout` s, then the rest are aborted
        (each stream ends well-formed) and the process exits 0 (uvicorn itself re-raises the
        signal after draining, which would end the process with it)."""

        def __init__(self, config: uvicorn.Config, state: ServerState, timeout: float, served: str) -> None:
            super().__init__(config)
            self.state, self.timeout, self.served = state, timeout, served

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                log.info("%s", self.served)

        async def shutdown(self, sockets=None) -> None:
            engine = self.state.engine
            engine.accepting = False
            why = f"still running {self.timeout:g} s after the shutdown signal (--shutdown-timeout)"
            deadline = asyncio.get_running_loop().call_later(self.timeout, engine.abort_all, why)
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()

    return DrainingServer


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default=None, help="checkpoint folder, .gguf file or hub id (default: SmolLM2)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="how the model writes tool calls: hermes, glm45, kimi_k2 (default: the family spec's)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM command lines: tool_choice auto is on whenever a tool-call parser is known",
    )
    p.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        default="auto",
        help="auto: a request's unset temperature / top_k / top_p / min_p take the checkpoint's "
        "generation_config.json values (vLLM's default); vllm: OpenAI's defaults",
    )
    p.add_argument(
        "--api-key",
        action="append",
        help="require `Authorization: Bearer KEY` on the API (repeatable; also DAYZERO_API_KEY, "
        "comma-separated); /health and /metrics stay open",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--family",
        default=None,
        help="force a family instead of detecting it (also a config.json whose architectures is wrong)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="auto, float32, bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per step")
    p.add_argument(
        "--chunked-prefill-size",
        "--long-prefill-token-threshold",
        dest="chunked_prefill_size",
        type=int,
        default=None,
        help="largest prefill chunk (SGLang's name; vLLM's --long-prefill-token-threshold)",
    )
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    p.add_argument(
        "--tokenizer-workers",
        type=int,
        default=DEFAULT_WORKERS,
        help="threads that tokenize and render chat templates off the event loop",
    )
    p.add_argument(
        "--tokenizer-queue",
        type=int,
        default=DEFAULT_QUEUE,
        help="requests that may wait for a tokenizer thread; one more is answered 503 with Retry-After",
    )
    p.add_argument(
        "--max-request-bytes",
        default="32MiB",
        help="largest request body: bytes, or with a unit (a larger one gets 413 before it is read)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory",
        default=None,
        help="KV cache size: bytes, or with a unit, e.g. 2GiB (vLLM's --kv-cache-memory-bytes; "
        "default on CPU: 512MiB)",
    )
    p.add_argument(
        "--swap-space",
        default="0.25",
        help="host memory for retracted requests: GiB as in vLLM (4 = 4 GiB), or with a unit (256MiB)",
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--chat-template", default=None, help="a jinja2 file replacing the model's chat template")
    p.add_argument(
        "--quantization",
        default=None,
        help="the checkpoint's format, checked at start: nvfp4, mxfp4, fp8_block (fp8), none",
    )
    p.add_argument(
        "--quantize-activations",
        action="store_true",
        help="NVFP4 activation quantization with the checkpoint's input scales (default: weight-only)",
    )
    p.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default="auto",
        help="dummy: random weights, nothing read (config.json and a tokenizer suffice; benchmarks)",
    )
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument(
        "--enforce-eager", action="store_true", help="no CUDA graphs: every decode step runs eagerly"
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help="speculative decoding as vLLM spells it, e.g. "
        '\'{"method": "mtp", "num_speculative_tokens": 3}\' (methods: ngram, prompt lookup; mtp, the '
        "model's MTP head, or a head folder as \"model\"; each step's drafts verified in one pass, the "
        "output distribution unchanged)",
    )
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="plan each step after the previous step's tokens are back (no CPU/GPU overlap)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks the model is sharded over (one a device); rank 0 serves and drives the others",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="with --tensor-parallel-size: whole experts a rank",
    )
    p.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="with --tensor-parallel-size: data-parallel attention (each rank attends for its own "
        "requests, its KV cache holds only theirs), MoE experts split over the ranks",
    )
    p.add_argument(
        "--nnodes", type=int, default=1, help="hosts the ranks span (tensor-parallel-size / nnodes a host)"
    )
    p.add_argument("--node-rank", type=int, default=0, help="this host's index (0 serves)")
    p.add_argument("--master-addr", default="127.0.0.1", help="host 0's address (several hosts)")
    p.add_argument("--master-port", type=int, default=None, help="the ranks' rendezvous port on host 0")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to drain on SIGTERM")
