"""The engine loop: scheduler plan -> batch context -> model -> sampler -> scheduler feed.

One `Engine` owns a scheduler, the physical KV pool and a built model. `step()` runs one
scheduler step and returns what each request gained; `generate()` is the offline loop.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.profiler import record_function

from dayzero.sdk.config.model import ModelConfig
from dayzero.sdk.engine.config import DEFAULTS, EngineConfig
from dayzero.sdk.engine.context import StepContext, build_context, device_fill, fill_tokens, upload
from dayzero.sdk.engine.dp import DpScheduler, dp_context
from dayzero.sdk.engine.drafters import MtpDrafter, check_parallel
from dayzero.sdk.engine.drafting_graphs import DraftingGraphs
from dayzero.sdk.engine.geometry import scheduler_groups
from dayzero.sdk.engine.grammar import Matchers
from dayzero.sdk.engine.graphs import DEFAULT_SIZES, DecodeGraphs, request_buckets
from dayzero.sdk.engine.kv_pool import KvPool
from dayzero.sdk.engine.memory import checkpoint_slots, scheduler_fields
from dayzero.sdk.engine.ranks import Leader
from dayzero.sdk.engine.sampling import Pending, Sampler, SamplingParams
from dayzero.sdk.engine.speculative import (
    END,
    ROLLBACK,
    VERIFY,
    SavedStates,
    VerifyRows,
    accept_on_device,
    behind,
    behind_rows,
    decode_rows,
    first_inputs,
    moved_back,
    roll_back,
    runs_in_graphs,
    save_states,
    verify_forward,
    verify_graph_plan,
    verify_inputs,
    verify_rows,
)
from dayzero.sdk.scheduler import FinishReason, Scheduler, SchedulerError, make_config

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    id: int
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # when asked for
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    cached_tokens: int = 0  # prompt tokens the prefix cache held when the request was admitted
    error: str | None = None  # why it was aborted, when a failed engine step aborted it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_REASONS = {
    int(FinishReason.STOP): "stop",
    int(FinishReason.LENGTH): "length",
    int(FinishReason.ABORT): "abort",
}


@dataclass
class _Launched:
    """A step whose forward and sampling are queued on the device, its tokens not yet fed."""

    plan: object
    req_ids: np.ndarray  # [R]
    sample: np.ndarray  # [R] int32
    sample_ids: list[int]  # request of each sampled row
    prefill_tokens: int
    pending: Pending
    verify: VerifyRows | None = None  # speculative: which sampled rows are whose, and the drafts
    saved: SavedStates | None = None  # speculative, with recurrent state: for the rollback
    last: torch.Tensor | None = None  # speculative, MTP: y_a of each row [R] (the next row's x_p)


_ENDED = SamplingParams(max_tokens=1, temperature=0)  # a row whose request ended after its plan


def _head_state(cfg: ModelConfig) -> bool:
    """Whether the model's MTP layer keeps recurrent state (a State cache group of its own)."""
    mtp = cfg.mtp
    groups = [g for g, _ in (*mtp.layer.caches, *mtp.layer.ngram_caches)] if mtp is not None else []
    return any(cfg.cache_groups[g].kind == "state" for g in groups)


def _sampled(plan) -> list[int]:
    """The request of each row of the plan that samples a token."""
    return np.asarray(plan.req_ids)[np.asarray(plan.sample, dtype=bool)].tolist()


class Engine:
    def __init__(
        self, model: torch.nn.Module, cfg: ModelConfig, ops, config: EngineConfig = DEFAULTS
    ) -> None:
        self.model, self.cfg, self.ops, self.config = model, cfg, ops, config
        self.device, self.dtype = ops.device, ops.dtype
        checkpoints = checkpoint_slots(cfg, config, self.device)
        fields = scheduler_fields(cfg, config, checkpoints)
        self.groups = scheduler_groups(cfg, self.dtype.itemsize)
        par = cfg.parallel
        self.dp = par.attention_dp and par.size > 1  # one scheduler per attention rank (dp.py)
        if self.dp and config.overlap == "on":
            raise ValueError("data-parallel attention runs without overlap (yet)")
        self.spec = config.speculative
        if self.spec is not None:
            self.drafter = self.spec.drafter()
            check_parallel(self.spec, par.size, par.attention_dp)
            if self.drafter.hidden and getattr(model, "mtp", None) is None:
                raise ValueError(
                    f"speculative method {self.spec.method} drafts with the model's MTP layer, which this "
                    "model was built without (LLM builds it when speculative_config asks for mtp)"
                )
        auto = config.overlap == "auto" and self.device.type == "cuda" and not self.dp
        if self.spec is not None:  # drafting steps overlap where the device moves their rows back
            state = any(g.kind == "state" for g in cfg.cache_groups)  # rolled back from the host
            auto = auto and self.drafter.hidden and not state and par.size == 1
            if config.overlap == "on" and par.size > 1:
                raise ValueError(
                    f"speculative decoding ({self.spec.method}) runs without overlap on {par.size} "
                    "ranks (yet)"
                )
        self.overlap = fields["overlap"] = config.overlap == "on" or auto
        # the MTP head observes a step at its launch (overlap: the next step drafts first), unless
        # its layer keeps recurrent state (rejected drafts would stay in it): then once read back
        hidden = self.spec is not None and self.drafter.hidden
        self.head_state = hidden and _head_state(cfg)
        self.observe_early = self.overlap and hidden and not self.head_state
        # the prefix cache's key chain starts from a secret of this engine (see SchedulerConfig)
        fields["cache_salt_hi"], fields["cache_salt_lo"] = secrets.randbits(64), secrets.randbits(64)
        sched = make_config(self.groups, **fields)
        self.scheduler = DpScheduler(sched, par.size, par.rank) if self.dp else Scheduler(sched)
        self.pool = KvPool(self.scheduler.layout, config.block_size, self.dtype, self.device, checkpoints)
        # a model with no position limit (no RoPE) is bounded by what one request's KV can take
        self.max_model_len = (
            config.max_model_len or cfg.max_position or self.scheduler.layout["num_pages"] * config.block_size
        )
        self.requests: dict[int, RequestOutput] = {}
        self.params: dict[int, SamplingParams] = {}  # live requests only
        self.generators: dict[int, torch.Generator] = {}
        self._ids = itertools.count()
        self.sampler = Sampler(ops, self.device, cfg.embedding.vocab)  # + the penalties' device state
        self.matchers = Matchers(cfg.embedding.vocab)  # structured output, per constrained request
        self._inflight: _Launched | None = None  # overlap: the step launched last, not yet fed
        # requests the engine reported finished itself (`_fail_request`) whose end the scheduler
        # reports in a later plan: that report is theirs, not a new request's of the same id
        self._reported: set[int] = set()
        self.stats = {"steps": 0, "retracted": 0, "prefill_tokens": 0, "decode_tokens": 0, "graph_steps": 0}
        self.stats["device_inputs"] = 0  # input tokens filled in on the device (overlap)
        self.stats["failed_steps"] = 0
        self.stats["failed_requests"] = 0  # aborted alone by a failure after their step (_collect)
        k = self.spec.num_speculative_tokens if self.spec is not None else 0
        self.stats["drafted"] = 0  # draft tokens verified (speculative decoding)
        self.stats["accepted_at"] = [0] * k  # drafts accepted at each draft position
        self.stats["verify_rows"] = 0  # decode rows that verified drafts
        self.stats["head_graph_passes"] = 0  # the MTP head's passes run in its graphs (or their buffers)
        # overlap: decode rows planned behind a verify row in flight, moved back on the device, or
        # on the host after waiting for that row's readback (speculative.py)
        self.stats["rows_moved_on_device"] = self.stats["rows_moved_on_host"] = 0
        self.stats["drafting_graph_steps"] = 0  # whole drafting steps in one graph (drafting_graphs.py)
        self.failures = 0  # failed steps in a row (the server's health turns 503 at a few)
        self.graphs = self._decode_graphs()
        self.head_graphs = self._head_graphs()  # the MTP head's observe and draft passes
        self.drafting = self._drafting_graphs()  # greedy drafting steps in one graph each
        # tensor parallel: rank 0 sends each plan to the other ranks before running it (ranks.py)
        self.leader: Leader | None = None

    def lead(self, leader: Leader) -> None:
        """Drive the other ranks of a tensor-parallel model: each plan goes to them first, saying
        whether it runs in a decode graph's bucket (every rank then runs the bucket's padded
        shapes) and, with overlap, that rank 0 broadcasts the step's sampled tokens once drawn
        (the next plan's device-filled inputs on every rank). Every rank has rank 0's engine
        config (`agree_kv`), so their graphs and overlap agree; the flags make a follower do
        what rank 0 does, or fail naming why, rather than hang on mismatched shapes. A failed
        send, or a failure of this rank's KV copies, forward or broadcast (their collectives are
        the others'), is the leader's on_failure: the ranks are out of step, every later step
        fails."""
        self.leader = leader

    def _lockstep(self) -> contextlib.AbstractContextManager:
        """Around rank 0's part of a step the other tensor-parallel ranks run too: a failure
        there ends them all (Leader.lockstep); nothing on one rank."""
        return self.leader.lockstep() if self.leader is not None else contextlib.nullcontext()

    def context(self, plan, every_token: bool = False) -> StepContext:
        """The plan's batch context on this rank (with data-parallel attention: its part's rows,
        and the split); every_token: logits at every token, not the plan's sampling rows."""
        if self.dp:
            views, block, slots = self.pool.views, self.config.block_size, self.pool.slots
            return dp_context(plan, self.cfg.parallel.rank, views, block, self.device, slots, every_token)
        ctx = build_context(plan, self.pool.views, self.config.block_size, self.device, self.pool.slots)
        if every_token:
            ctx.sample_index = torch.arange(plan.num_input_tokens, device=self.device)
        return ctx

    def _graph_blockers(self) -> list[str] | None:
        """Why decode steps (and the MTP head's passes) cannot run in graphs; None: graphs are
        off (or auto off CUDA)."""
        mode, cfg = self.config.decode_graphs, self.cfg
        if mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return None
        why = []
        if cfg.parallel.attention_dp and cfg.parallel.size > 1:
            why.append("data-parallel attention")
        if not self.max_model_len:
            why.append("no maximum model length")
        if mode == "auto" and (unsafe := self.ops.not_graph_safe()):
            why.append(f"kernels not graph-safe: {', '.join(unsafe)}")
        return why

    def _graphs(
        self, what: str, forward, why: list[str] | None, feed=None, state: bool = True, steps: int = 1
    ) -> DecodeGraphs | None:
        """Graphs of `forward` unless `why` (None: off); with overlap, a drafting engine's graphs
        move rows planned behind a verify row in flight (speculative.Behind)."""
        if why is None:
            return None
        if why:
            log.info("%s runs eagerly (no CUDA graphs): %s", what, "; ".join(why))
            return None
        # speculative: verify steps and the head's observe passes, each token a row
        # (speculative.flat_plan): up to k + 1 rows a request (`steps` = k + 1: exactly)
        if steps > 1:  # buckets of whole requests, as many as the state checkpoints hold
            b = min(self.config.max_batch_size, DEFAULT_SIZES[-1], self.pool.checkpoints // steps)
            sizes = request_buckets(steps, b)
        else:
            per = 1 if self.spec is None else self.spec.num_speculative_tokens + 1
            top = self.config.max_batch_size * per
            sizes = (*(s for s in DEFAULT_SIZES if s < top), min(top, DEFAULT_SIZES[-1]))
        capture, block, dev = self.config.decode_graphs == "auto", self.config.block_size, self.device
        movable = self.observe_early  # rows behind a verify row in flight move on the device
        w = self._max_blocks()
        return DecodeGraphs(
            forward, self.pool, block, w, sizes, dev, capture, feed, what, state, steps, movable
        )

    def _max_blocks(self) -> int:
        """The graphs' block table width: a verify row reaches k past its request's limit, one
        planned behind it k + 1 more."""
        extra = 2 * self.spec.num_speculative_tokens + 1 if self.spec is not None else 0
        return -(-(self.max_model_len + extra) // self.config.block_size)

    def _decode_graphs(self) -> DecodeGraphs | None:
        why, steps = self._graph_blockers(), 1
        if why is not None and self.spec is not None and self.pool.state_bytes:
            steps = self.spec.num_speculative_tokens + 1  # each request a state row of k + 1 tokens
            held = self.pool.checkpoints // steps
            if not held:
                why.append("half the KV budget holds no request's k + 1 state checkpoints")
            elif held < self.config.max_batch_size:
                log.info(
                    "verify steps of up to %d requests run in graphs (their state checkpoints: half the "
                    "KV budget at most); larger ones run varlen", held,
                )  # fmt: skip
        hidden = self.spec is not None and self.drafter.hidden
        model = self.model
        return self._graphs("decode", lambda ctx, _: model(ctx, hidden=hidden), why, steps=steps)

    def _head_graphs(self) -> DecodeGraphs | None:
        """The MTP head's passes in graphs (drafters.observe_pass, draft_pass), unless its
        layer keeps recurrent state (its kept tokens would share a state slot as flat rows)."""
        if self.spec is None or not self.drafter.hidden:
            return None
        why, m, mtp = self._graph_blockers(), self.model, self.cfg.mtp
        if why is not None and self.head_state:
            why.append("the MTP layer keeps recurrent state")
        # the z a row feeds in: its streams [N, Dm], or [Dm]
        row = (mtp.streams, mtp.norm.dim) if mtp.streams > 1 else (mtp.norm.dim,)

        def head(ctx: StepContext, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return m.mtp(ctx.input_ids, z, ctx, m.embed, m.head)  # (logits [B, V], y)

        return self._graphs("MTP head", head, why, (row, self.dtype), state=False)

    def _drafting_graphs(self) -> DraftingGraphs | None:
        """Whole greedy drafting steps in one graph each (drafting_graphs.py), where the MTP head
        observes each step at its launch and runs in graphs, and no state is rolled back."""
        head = self.head_graphs
        if head is None or self.graphs is None or not self.observe_early or self.pool.state_bytes:
            return None
        if not isinstance(self.drafter, MtpDrafter):
            return None
        capture, row = self.config.decode_graphs == "auto", tuple(head.feed.shape[1:])
        out = DraftingGraphs(self, self.spec.num_speculative_tokens, row, self._max_blocks(), capture)
        if capture and not out.graphs.captured:  # (said in the log) eagerly it would be slower pass by pass
            return None
        self.drafter.table = out.table
        return out

    # ---- requests ------------------------------------------------------------------------
    def add(
        self, prompt_ids: list[int], params: SamplingParams | None = None, req_id: int | None = None
    ) -> int:
        """Queue a request; raises ValueError (and keeps nothing) when it cannot be served."""
        params = params or SamplingParams()
        rid = next(self._ids) if req_id is None else req_id
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.cfg.embedding.vocab
        if bad := [t for t in prompt_ids if not 0 <= t < vocab]:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if bad := [t for t in params.stop_token_ids if not 0 <= t < vocab]:
            raise ValueError(f"stop_token_ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        if bad := [t for t, _ in params.logit_bias if not 0 <= t < vocab]:
            raise ValueError(f"logit_bias token ids out of the vocabulary [0, {vocab}): {bad[:5]}")
        total = len(prompt_ids) + params.max_tokens
        if self.max_model_len and total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the maximum model length {self.max_model_len}"
            )
        stops = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.cfg.eos_token_ids))
        try:
            self.scheduler.submit(
                rid,
                np.asarray(prompt_ids, dtype=np.int32),
                max_new_tokens=params.max_tokens,
                stop_ids=stops,
                ignore_eos=False,  # EOS is already left out of `stops` when ignore_eos
            )
        except SchedulerError as e:
            raise ValueError(str(e)) from None
        if params.grammar is not None:
            self.matchers.add(rid, params.grammar)
        self.requests[rid] = RequestOutput(rid, list(prompt_ids))
        self.params[rid] = params
        if params.seed is not None:
            self.generators[rid] = torch.Generator(self.device).manual_seed(params.seed)
        return rid

    def abort(self, rid: int) -> None:
        """Abort a live request; one the scheduler already finished is reported by the next step."""
        if rid in self.requests and not self.requests[rid].finished:
            with contextlib.suppress(SchedulerError):  # finished by its last token: the next plan says so
                self.scheduler.abort(rid)

    def has_work(self) -> bool:
        return bool(self.params) or self._inflight is not None

    def release(self, rid: int) -> RequestOutput:
        """Hand over a finished request's output and forget it."""
        if rid in self.params:
            raise ValueError(f"request {rid} is still running")
        return self.requests.pop(rid)

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests that gained a token or finished. With
        overlap the tokens a call returns are the previous call's step: this call's step is
        planned and queued on the device first, then the previous one is read back and fed.

        A step that raises (out of device memory, a kernel error) aborts the requests of the
        plans in flight, with the error in `RequestOutput.error`; their blocks go back and none
        of the KV those plans were to write stays in the prefix cache (`discard_inflight`).
        Every other request goes on (on several tensor-parallel ranks, a failure of rank 0's
        copies or forward leaves the ranks out of step: every later step fails, see `lead`).
        `failures` counts failed steps in a row. A failure of one
        request's own bookkeeping once its token is fed (its grammar rejects the token) aborts
        that request alone, with the error (`_fail_request`); the step does not fail."""
        touched: dict[int, RequestOutput] = {}
        try:
            self._step(touched)
        except Exception as e:  # any failure of the device work is contained here
            self._fail(e, touched)
        else:
            self.failures = 0
        return list(touched.values())

    def _step(self, touched: dict[int, RequestOutput]) -> None:
        with record_function("dayzero.schedule"):
            plan = self.scheduler.step()
        self.stats["steps"] += 1
        self.stats["retracted"] += len(plan.retracted_ids)
        touched |= self._finished(plan)
        # (a speculative engine's graphs run its verify steps: speculative.verify_forward)
        graph = self.spec is None and self.graphs is not None and self.graphs.fits(plan)
        passes = self.leader is not None and self.spec is not None and plan.rows > 0
        if self.leader is not None:
            self.leader.send(plan, graph=graph, share=self.overlap, passes=passes)
        try:
            self._run(plan, graph, touched)
        finally:
            if passes and self.leader.broken is None:  # the others wait for the step's last pass
                with contextlib.suppress(RuntimeError):  # a lost rank: the leader is broken, said once
                    self.leader.pass_(END)

    def _run(self, plan, graph: bool, touched: dict[int, RequestOutput]) -> None:
        """A step's copies, forward pass and sampling, and the collection of what is done."""
        with self._lockstep():
            self.pool.apply(plan.copies)  # a plan may carry copies (restores) and no rows
        prev = self._inflight if self.overlap else None
        if prev is not None and (
            (self.matchers and self.matchers.constrains(_sampled(plan)))  # a mask needs the token drawn
            or (self.spec is not None and self._waits(plan))
        ):
            touched |= self._collect(prev)
            self._inflight = None
        launched = self._launch(plan, prev, graph) if plan.rows else None
        self.pool.apply_after(plan.copies)
        if not self.overlap:
            done = launched
        else:
            done, self._inflight = self._inflight, launched
        if done is not None:
            touched |= self._collect(done)

    def _fail(self, err: Exception, touched: dict[int, RequestOutput]) -> None:
        if self.leader is not None and self.leader.broken is not None:  # said once, by the leader
            log.error("engine step failed (%s); aborting the requests of the plans in flight", err)
        else:
            log.exception("engine step failed; aborting the requests of the plans in flight")
        why = f"internal error in the engine step: {type(err).__name__}: {err}"
        if self.leader is not None and self.leader.broken is not None:  # the failing rank, named
            why = f"internal error in the engine step: {self.leader.broken}"
        self._inflight = None
        self.failures += 1
        self.stats["failed_steps"] += 1
        for rid in self.scheduler.discard_inflight():
            if rid in self.requests:
                out = self.requests[rid]
                out.finish_reason, out.error = "abort", why
                touched[rid] = out
                self._reported.add(rid)  # the scheduler's next plan lists it too
            self._forget(rid)

    def _launch(self, plan, prev: _Launched | None, graph: bool) -> _Launched:
        """Queue the plan's forward pass and sampling on the device (prev: the step before, still
        in flight or just collected, whose device tokens fill the plan's -1 inputs; graph: the
        plan runs in a decode graph's bucket)."""
        if self.spec is not None:
            return self._launch_verify(plan, prev)
        fill = self._device_inputs(plan, prev)
        if graph:
            with self._lockstep():
                logits = self.graphs.run(plan, fill)  # [R, V] fp32
            self.stats["graph_steps"] += 1
        else:
            with self._lockstep():
                ctx = self.context(plan)
                if fill is not None:
                    fill_tokens(ctx.input_ids, *fill)
                logits = self.model(ctx)  # [S, V] fp32
        sample = np.asarray(plan.sample, dtype=np.int32).copy()
        req_ids = np.asarray(plan.req_ids).copy()
        sample_ids = req_ids[sample.astype(bool)].tolist()
        pending = self._sample(logits, sample_ids)
        if self.leader is not None and self.overlap and sample_ids:  # the others' next inputs
            with self._lockstep():
                self.leader.share(pending.tokens)
        prefill = int(np.asarray(plan.num_tokens)[np.asarray(plan.is_prefill, dtype=bool)].sum())
        return _Launched(plan, req_ids, sample, sample_ids, prefill, pending)

    def _waits(self, plan) -> bool:
        """Whether a speculative plan must wait for the step in flight to be read back: it has rows
        placed behind that step's verify rows and cannot move them on the device (speculative.py)."""
        if not behind_rows(plan, self.spec.num_speculative_tokens).size:
            return False
        # (a plan the drafting graphs fit runs in the verify graphs' buckets too: it never waits)
        on_device = self.observe_early and self.head_graphs is not None and not self.pool.state_bytes
        return not (on_device and runs_in_graphs(self, plan))

    def _behind(self, plan, prev: _Launched | None):
        """(the plan, its rows behind the step in flight or None): moved back on the host when
        that step was read back (`_waits`), else `Behind` for the device."""
        k = self.spec.num_speculative_tokens
        rows = behind_rows(plan, k)
        if not rows.size:
            return plan, None
        if prev is not None and self._inflight is prev:  # still in flight: the device moves them
            self.stats["rows_moved_on_device"] += len(rows)
            return plan, behind(plan, rows, prev.req_ids, prev.verify.a, k)
        self.stats["rows_moved_on_host"] += len(rows)
        at = np.asarray(plan.positions, dtype=np.int64)[np.asarray(plan.query_start)[rows]]
        start, first = at.copy(), np.zeros(len(rows), dtype=np.int64)
        for i, rid in enumerate(np.asarray(plan.req_ids)[rows].tolist()):
            out = self.requests.get(rid)  # (an aborted one's too: its last token's KV is committed)
            if out is not None and out.token_ids:
                start[i], first[i] = len(out.prompt_ids) + len(out.token_ids) - 1, out.token_ids[-1]
        return moved_back(plan, rows, at - start, first), None

    def _launch_verify(self, plan, prev: _Launched | None) -> _Launched:
        """Queue a speculative step (sdk/engine/speculative.py): each drafted decode row's -1
        inputs get its request's drafts (a row that is not drafted: its last token again), the
        model gives logits at all k + 1 positions of a drafted row and at the last token of every
        other sampling row, and each is sampled under its request's parameters; for a drafter
        that reads the hidden states, the drafts kept are counted on the device (`_observe`).
        A greedy step of the MTP head's drafts runs whole in one graph (`_launch_in_graph`)."""
        if self.drafting is not None and self.drafting.fits(self, plan):
            return self._launch_in_graph(plan, prev)
        k = self.spec.num_speculative_tokens
        plan, late = self._behind(plan, prev)
        verify, index = verify_rows(plan, k, self._drafts)
        verify.behind = late
        n, prefill = np.asarray(plan.num_tokens), np.asarray(plan.is_prefill, dtype=bool)
        decode = decode_rows(plan, k)
        drafted = [r for r in decode.tolist() if verify.count[r] > 1]
        # (record_function: the phases a profile of drafting steps names, `bench decode --profile`)
        with self._lockstep(), record_function("dayzero.draft"):  # the head's passes on every rank
            proposed = self.drafter.draft(self, plan, drafted, k, late) if drafted else []
        if isinstance(proposed, list):
            proposed = dict(zip(drafted, proposed, strict=True))
        inputs, fill = verify_inputs(plan, k, decode, proposed, verify)
        if late is not None:  # each moved row's x_p: y_a of its row in flight
            qs = np.asarray(plan.query_start)
            fill = first_inputs(fill, qs[late.rows], late.prev, prev.last)
        flat = verify_graph_plan(self, plan, inputs)  # None: a varlen step
        saved = save_states(self, plan, inputs, decode, checkpointed=flat is not None)
        if self.leader is not None:  # (the other ranks fill in the device drafts of their own chain)
            none = np.zeros(0, dtype=np.int64)
            on_device = (fill[0], np.asarray(verify.device.rows, dtype=np.int64)) if fill else (none, none)
            self.leader.pass_(
                VERIFY, inputs, index, decode, np.asarray([int(self.drafter.hidden)]), *on_device
            )
        shift = late.per_token(np.arange(len(n)), n) if late is not None else None
        with self._lockstep(), record_function("dayzero.verify"):  # the MTP head reads z of every token
            hidden = self.drafter.hidden
            logits, verify.z = verify_forward(self, plan, inputs, index, hidden, fill, flat, shift)
        req_ids = np.asarray(plan.req_ids).copy()
        sample_ids = np.repeat(req_ids, verify.count).tolist()
        with record_function("dayzero.sample"):
            pending = self._sample(logits, sample_ids)
        sample = np.asarray(plan.sample, dtype=np.int32).copy()
        done = _Launched(plan, req_ids, sample, sample_ids, int(n[prefill].sum()), pending, verify, saved)
        if self.drafter.hidden:
            verify.sampled = pending.tokens
        if self.observe_early:  # the drafts kept, on the device: the next step's rows move by them
            dev = verify.device
            rows, drafts = (dev.rows, dev.tokens) if dev is not None else ([], None)
            verify.a = accept_on_device(verify.first, rows, drafts, pending.tokens)
            s = len(pending.tokens)  # (a row that samples nothing: any token, never read)
            at = (upload(verify.first, self.device) + verify.a).clamp(max=max(s - 1, 0))
            done.last = pending.tokens[at] if s else verify.a  # y_a [R]
            self._observe(done)  # its drafts start from the head's pass
        return done

    def _launch_in_graph(self, plan, prev: _Launched | None) -> _Launched:
        """Queue a greedy drafting step in one graph (drafting_graphs.py): its rows behind the
        step in flight move there, others were moved on the host when that step was read back."""
        if prev is None or self._inflight is not prev:
            plan, _ = self._behind(plan, prev)
            prev = None
        with record_function("dayzero.drafting_graph"):
            pending, verify, last = self.drafting.launch(self, plan, prev)
        self.stats["graph_steps"] += 1
        self.stats["drafting_graph_steps"] += 1
        req_ids = np.asarray(plan.req_ids).copy()
        sample = np.asarray(plan.sample, dtype=np.int32).copy()
        sample_ids = np.repeat(req_ids, verify.count).tolist()
        return _Launched(plan, req_ids, sample, sample_ids, 0, pending, verify, last=last)

    def _observe(self, done: _Launched, kept: np.ndarray | None = None) -> None:
        """The MTP head over a verify step, from its samples on the device: at its launch with
        overlap (the next step drafts before this one is read back), else once it is read back
        (kept: each row's new tokens; its device time then runs under the next step's host work,
        as without the head)."""
        with self._lockstep(), record_function("dayzero.observe"):
            self.drafter.observe(self, done.plan, done.verify, kept)

    def _roll_back_states(self, done: _Launched, rows: list[tuple[int, list[int]]]) -> None:
        """Each decode row's state at its last kept token (speculative.roll_back)."""
        saved, k, dev = done.saved, self.spec.num_speculative_tokens, done.verify.device
        kept = np.zeros(len(rows), dtype=np.int64)
        ids = done.req_ids
        for r in saved.decode.tolist():  # (a request gone: its slot and blocks may be another's by now)
            kept[r] = len(rows[r][1]) if int(ids[r]) in self.params else 0
        if saved.before is not None and dev is not None:  # a recompute reads the drafts, now known
            qs = np.asarray(done.plan.query_start)
            for r in dev.rows:
                saved.inputs[qs[r] + 1 : qs[r] + 1 + k] = done.verify.drafts[r]
        if self.leader is not None:
            self.leader.pass_(ROLLBACK, kept, saved.inputs)
        with self._lockstep(), record_function("dayzero.rollback"):
            roll_back(self, done.plan, saved, kept)

    def _drafts(self, rid: int) -> bool:
        """Whether a live request's decode rows verify drafts (SamplingParams.verifies_drafts)."""
        p = self.params.get(rid)
        return p is not None and p.verifies_drafts

    def _sample(self, logits: torch.Tensor, sample_ids: list[int]) -> Pending:
        """Queue the sampling of logits [S, V], row s under request sample_ids[s]'s parameters."""
        # a row of a request that ended after this plan was made (its grammar check failed in the
        # collect just before): sampled greedily, its token dropped (see `_collect`)
        params = [self.params.get(i, _ENDED) for i in sample_ids]
        gens = [self.generators.get(i) for i in sample_ids]
        allowed = self.matchers.bitmask(sample_ids) if self.matchers.constrains(sample_ids) else None
        if any(p.rewrites for p in params):
            # presence / frequency / repetition read the requests' token counts on the device
            # (a slot taken at a request's first sampled token, counted into by each launch);
            # min_tokens needs the output length, the token still on the device included
            state = self.sampler.state
            new = [i for i, p in zip(sample_ids, params, strict=True) if p.counts_tokens and i not in state]
            if new:
                self.sampler.start(new, [self.requests[i].prompt_ids for i in new])
            flying = set(self._inflight.sample_ids) if self._inflight is not None else set()
            produced = [
                len(self.requests[i].token_ids) + (i in flying) if i in self.params else 0 for i in sample_ids
            ]
            eos = list(self.cfg.eos_token_ids)
            stops = [tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(eos)) for p in params]
            return self.sampler.launch(logits, params, gens, sample_ids, produced, stops, allowed)
        return self.sampler.launch(logits, params, gens, allowed=allowed)

    def _device_inputs(self, plan, prev: _Launched | None):
        """The plan's inputs the device fills in from prev's sampled tokens (`device_fill`)."""
        fill = device_fill(plan, prev.sample_ids if prev else [], prev.pending.tokens if prev else None)
        if fill is not None:
            self.stats["device_inputs"] += len(fill[0])
        return fill

    def _collect(self, done: _Launched) -> dict[int, RequestOutput]:
        """Read a launched step's tokens back, feed them to the scheduler, record them."""
        with record_function("dayzero.readback"):
            tokens, logprobs, tops = done.pending.result()
        for rid in done.sample_ids:  # a request's first token: admitted, so its prefix hit is known
            if rid in self.params and not self.requests[rid].token_ids:
                self.requests[rid].cached_tokens = self.scheduler.cached_tokens_of(rid)
        if done.verify is not None:
            done.verify.read_drafts()  # copied before the sampling the readback waited for
        rows = self._new_tokens(done, tokens) if done.verify is not None else None
        if rows is not None and done.saved is not None:
            self._roll_back_states(done, rows)
        if rows is not None and self.drafter.hidden and not self.observe_early:
            self._observe(done, np.asarray([len(t) for _, t in rows], dtype=np.int64))
        if rows is None:
            self.scheduler.feed(done.req_ids, done.sample, tokens.astype(np.int32))
        else:
            counts = np.asarray([len(t) for _, t in rows], dtype=np.int32)
            flat = np.asarray([t for _, toks in rows for t in toks], dtype=np.int32)
            self.scheduler.feed(done.req_ids, counts, flat)
        self.stats["prefill_tokens"] += done.prefill_tokens
        self.stats["decode_tokens"] += done.plan.num_input_tokens - done.prefill_tokens
        # From here the scheduler holds the tokens: nothing may raise out of this loop (the
        # step's plan is no longer in flight, so a step failure could abort nobody, and every
        # later step would fail the same way). Each row's token is recorded first; a check of
        # one request that fails after that (its grammar rejects the token) aborts that request.
        touched: dict[int, RequestOutput] = {}
        lps = logprobs.tolist()
        if rows is None:  # sampled row s: one token
            rows = enumerate((t,) for t in tokens.tolist())
        for first, toks in rows:
            rid = done.sample_ids[first] if toks else -1
            if rid not in self.params:  # finished or aborted while this step ran (overlap)
                continue
            out = self.requests[rid]
            touched[rid] = out
            try:
                for s, tok in enumerate(toks, first):
                    out.token_ids.append(tok)
                    out.logprobs.append(lps[s])
                    if s in tops:
                        out.top_logprobs.append(tops[s])
                    self.matchers.accept(rid, tok)
                    if self.matchers.terminated(rid):
                        self._grammar_done(rid)
            except Exception as e:  # this request's failure, not the step's
                self._fail_request(rid, e)
        return touched

    def _new_tokens(self, done: _Launched, sampled: np.ndarray) -> list[tuple[int, list[int]]]:
        """A speculative step's (first sampled row, new tokens) of each plan row: the accepted
        drafts and the token after them (speculative.py), cut after a stop token of the request
        and at its max_tokens, as the scheduler cuts them."""
        v, out = done.verify, []
        sampled = sampled.astype(np.int64)
        for r, rid in enumerate(done.req_ids.tolist()):
            toks = v.tokens(r, sampled) if v.count[r] else []
            if len(v.drafts[r]) and rid in self.params:  # (not a row planned past its request's end)
                self.stats["verify_rows"] += 1
                self.stats["drafted"] += len(v.drafts[r])
                for i in range(len(toks) - 1):
                    self.stats["accepted_at"][i] += 1
            p = self.params.get(rid)
            if p is not None and toks:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.cfg.eos_token_ids))
                end = next((i + 1 for i, t in enumerate(toks) if t in stops), len(toks))
                toks = toks[: max(1, min(end, p.max_tokens - len(self.requests[rid].token_ids)))]
            out.append((int(v.first[r]), toks))
        return out

    def _grammar_done(self, rid: int) -> None:
        """A request whose grammar accepted its end (a stop token it allows only once complete)
        finishes "stop", also under ignore_eos (vLLM's rule: a terminated grammar ends the
        request; past it nothing would constrain the tokens). When the token was a stop of the
        request's own, the scheduler has finished it already (stop, or length on its last
        token)."""
        with contextlib.suppress(SchedulerError):  # finished by this very token: reported anyway
            self.scheduler.finish(rid)

    def _fail_request(self, rid: int, err: Exception) -> None:
        """Abort one request whose bookkeeping after its token was fed failed, with the error,
        reported finished ("abort") by this very step. The scheduler frees its blocks now and
        reports it in its next plan, which `_finished` then passes over (`_reported`); a plan
        made already may still hold a row of it (`_launch` samples it, `_collect` drops it)."""
        log.exception("request %s failed after its step, aborting it alone: %s", rid, err)
        self.stats["failed_requests"] += 1
        out = self.requests[rid]
        if out.error is None:
            out.error = f"internal error in the engine: {type(err).__name__}: {err}"
        with contextlib.suppress(SchedulerError):  # finished by this very token: reported anyway
            self.scheduler.abort(rid)
        out.finish_reason = "abort"
        self._reported.add(rid)
        self._forget(rid)

    def _forget(self, rid: int) -> None:
        """Drop a finished request's live state (its output stays until `release`)."""
        self.generators.pop(rid, None)
        self.params.pop(rid, None)
        self.matchers.drop(rid)
        self.sampler.state.drop(rid)  # its penalties' device counts
        if self.spec is not None:
            self.drafter.drop(rid)

    def _finished(self, plan) -> dict[int, RequestOutput]:
        """Mark the requests this plan reports finished; they are no longer live."""
        touched: dict[int, RequestOutput] = {}
        for rid, reason in zip(plan.finished_ids.tolist(), plan.finished_reasons.tolist(), strict=True):
            if rid in self._reported:  # reported already, by the step that failed it
                self._reported.discard(rid)
                continue
            if rid in self.requests:
                out = self.requests[rid]
                out.finish_reason = _REASONS.get(reason, "stop")
                touched[rid] = out
                self._forget(rid)
        return touched

    @torch.inference_mode()
    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Logits at every position of every prompt ([len, V] fp32 each), the prompts prefilled
        together (in one step, or in block-aligned chunks when the model keeps a recurrent
        state); the requests then end. The KV memory must hold them all (no retraction)."""
        self._drain()
        if self.has_work():
            raise RuntimeError("prompt_logits needs an idle engine")
        if self.leader is not None:  # its steps' shapes are not the plans the other ranks follow
            raise RuntimeError("prompt_logits runs on every rank itself, not from a leader")
        ids = [self.add(p, SamplingParams(max_tokens=1, temperature=0)) for p in prompts]
        got: dict[int, list[torch.Tensor]] = {i: [] for i in ids}
        left = {i: len(p) for i, p in zip(ids, prompts, strict=True)}  # prompt tokens not yet computed
        try:
            while any(left.values()):
                plan = self.scheduler.step()
                self._finished(plan)
                if len(plan.retracted_ids):
                    raise ValueError("the prompts do not fit in KV memory together (a request was retracted)")
                self.pool.apply(plan.copies)
                if plan.rows == 0:
                    self.pool.apply_after(plan.copies)
                    continue
                logits = self.model(self.context(plan, every_token=True))  # [T, V]
                self.pool.apply_after(plan.copies)
                qs = plan.query_start.tolist()
                for r, rid in enumerate(plan.req_ids.tolist()):
                    got[rid].append(logits[qs[r] : qs[r + 1]])
                    left[rid] -= qs[r + 1] - qs[r]
                sample = np.asarray(plan.sample, dtype=bool)
                last = torch.from_numpy(np.asarray(qs[1:], dtype=np.int64)[sample] - 1).to(self.device)
                self.scheduler.feed(
                    plan.req_ids, plan.sample.astype(np.int32), logits[last].argmax(-1).int().cpu().numpy()
                )
        finally:
            for i in ids:
                self.abort(i)
            while self.has_work():
                self.step()
            for i in ids:
                self.release(i)
        return [torch.cat(got[i]) for i in ids]

    # ---- offline -------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        while any(not self.requests[i].finished for i in ids):
            self.step()
        self._drain()
        return [self.release(i) for i in ids]

    def _drain(self) -> None:
        """With no live request left, feed the step still in flight (overlap) so the engine idles."""
        while self._inflight is not None and not self.params:
            self.step()
