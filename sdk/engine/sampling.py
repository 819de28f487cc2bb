"""Sampling a step's rows on the device, with one readback.

`Sampler.launch` moves the rows' parameters to the device in one copy (from pinned memory on
CUDA), runs the selected `sample` kernel for the whole batch, and queues one device-to-host copy
of (tokens, logprobs) into pinned memory behind it; `Pending.result()` waits for that copy only,
so a step planned meanwhile can already be running on the device (engine overlap). Rows that
asked for top logprobs get them in a second copy queued the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dayzero.kernels.ops import Penalties, SamplingBatch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # <= 0: off
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens with p < min_p * max p (0: off)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # also return this many most likely tokens per step
    presence_penalty: float = 0.0  # OpenAI's: minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # vLLM's: z / r (z > 0) or z * r over prompt + output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) added to its logit
    min_tokens: int = 0  # the stop tokens (EOS, stop_token_ids) are masked until this many
    # structured output: a compiled grammar (sdk/engine/grammar.py GrammarCompiler.json)
    grammar: object | None = field(default=None, compare=False, repr=False)
    # offline API (LLM.generate) and server, not the engine: answers per prompt (seed + i each),
    # and stop strings (the text ends before the first; its request is ended there)
    n: int = 1
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, dict):
            object.__setattr__(
                self, "logit_bias", tuple((int(k), float(v)) for k, v in self.logit_bias.items())
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if bad := [b for _, b in self.logit_bias if not -100 <= b <= 100]:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bad[:3]}")
        if isinstance(self.stop, str | list):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        if not 1 <= self.n <= 64:
            raise ValueError(f"n must be in 1..64, got {self.n}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def counts_output(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def rewrites(self) -> bool:
        """Some penalty, bias or min_tokens may change this request's logits."""
        return (
            self.counts_output or self.repetition_penalty != 1 or bool(self.logit_bias) or self.min_tokens > 0
        )


@dataclass
class Pending:
    """A step's sampled rows, on their way to the host."""

    tokens: torch.Tensor  # [S] int64 on the device (the next step's device-filled inputs)
    host: torch.Tensor  # [2, S] float64: tokens, logprobs (pinned on CUDA)
    event: torch.cuda.Event | None
    tops: tuple[torch.Tensor, torch.Tensor, dict[int, int]] | None  # (logprobs, ids, row -> k)

    def result(self) -> tuple[np.ndarray, np.ndarray, dict[int, list[tuple[int, float]]]]:
        """(tokens [S] int64, logprobs [S] fp32, row -> its top (token, logprob) pairs)."""
        if self.event is not None:
            self.event.synchronize()
        out = self.host.numpy()
        tops = {}
        if self.tops is not None:
            lp, tok, want = self.tops
            lp, tok = lp.tolist(), tok.tolist()
            tops = {r: list(zip(tok[j][:k], lp[j][:k], strict=True)) for j, (r, k) in enumerate(want.items())}
        return out[0].astype(np.int64), out[1].astype(np.float32), tops


class Sampler:
    def __init__(self, ops, device: torch.device) -> None:
        self.ops, self.device = ops, device
        self.pin = device.type == "cuda"

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.pin)
        host.copy_(x, non_blocking=self.pin)
        return host

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return (host.pin_memory() if self.pin else host).to(self.device, non_blocking=self.pin)

    def _index(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Host int64 arrays -> device tensors, in one copy."""
        flat = (
            torch.from_numpy(np.concatenate(arrays).astype(np.int64))
            if arrays
            else torch.zeros(0, dtype=torch.int64)
        )
        dev = (flat.pin_memory() if self.pin else flat).to(self.device, non_blocking=self.pin)
        return list(dev.split([len(a) for a in arrays]))

    def penalties(
        self,
        params: list[SamplingParams],
        history: list[tuple[list[int], list[int]]],
        stops: list[tuple[int, ...]],
        extra: tuple[np.ndarray, np.ndarray, torch.Tensor] | None,
        dev: torch.Tensor,
    ) -> Penalties | None:
        """The rows' penalties as device index lists, in one copy; history[s] = (prompt, the
        output tokens the host knows); extra = (rows, where in `last` their latest token is, last:
        the tokens the step before sampled, still on the device: overlap); dev = the rows'
        parameters on the device (see `launch`)."""
        if not any(p.rewrites for p in params):
            return None
        none = np.zeros(0, np.int64)
        rows_extra, src_extra, last = extra if extra is not None else (none, none, None)
        has_extra = np.zeros(len(params), dtype=bool)
        has_extra[rows_extra] = True
        lists: dict[str, list[np.ndarray]] = {
            k: [] for k in ("out_r", "out_t", "seen_r", "seen_t", "bias_r", "bias_t", "ban_r", "ban_t")
        }
        bias_v: list[float] = []

        def add(rows: str, toks: str, s: int, values) -> None:
            arr = np.asarray(values, dtype=np.int64)
            lists[rows].append(np.full(len(arr), s, dtype=np.int64))
            lists[toks].append(arr)

        for s, (p, (prompt, out)) in enumerate(zip(params, history, strict=True)):
            if p.counts_output:
                add("out_r", "out_t", s, out)
            if p.repetition_penalty != 1:
                add("seen_r", "seen_t", s, [*prompt, *out])
            if p.logit_bias:
                add("bias_r", "bias_t", s, [t for t, _ in p.logit_bias])
                bias_v.extend(b for _, b in p.logit_bias)
            if p.min_tokens > len(out) + int(has_extra[s]) and stops[s]:
                add("ban_r", "ban_t", s, stops[s])
        cat = [np.concatenate(v) if v else np.zeros(0, np.int64) for v in lists.values()]
        # which extra rows count output tokens / have a repetition penalty, as indices into extra
        count = np.flatnonzero([params[r].counts_output for r in rows_extra.tolist()])
        rep = np.flatnonzero([params[r].repetition_penalty != 1 for r in rows_extra.tolist()])
        bits = np.asarray(bias_v, dtype=np.float64).view(np.int64)  # travels in the same copy
        o_r, o_t, s_r, s_t, b_r, b_t, k_r, k_t, e_r, e_s, e_c, e_p, b_v = self._index(
            [*cat, rows_extra, src_extra, count, rep, bits]
        )
        if last is not None and len(rows_extra):
            toks_extra = last[e_s]
            o_r, o_t = torch.cat((o_r, e_r[e_c])), torch.cat((o_t, toks_extra[e_c]))
            s_r, s_t = torch.cat((s_r, e_r[e_p])), torch.cat((s_t, toks_extra[e_p]))
        return Penalties(
            presence=dev[4], frequency=dev[5], repetition=dev[6],
            out_rows=o_r, out_toks=o_t, seen_rows=s_r, seen_toks=s_t,
            bias_rows=b_r, bias_toks=b_t, bias_vals=b_v.view(torch.float64).float(),
            ban_rows=k_r, ban_toks=k_t,
        )  # fmt: skip

    def launch(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        gens: list[torch.Generator | None],
        history: list[tuple[list[int], list[int]]] | None = None,
        stops: list[tuple[int, ...]] | None = None,
        extra: tuple[np.ndarray, np.ndarray, torch.Tensor] | None = None,
        allowed: torch.Tensor | None = None,
    ) -> Pending:
        """Sample one token per row of logits [S, V] fp32 (row s under params[s]; history, stops
        and extra feed the penalties, see `penalties`; allowed: the grammars' bitmasks on the host)."""
        host = torch.tensor(
            [[p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
             [p.min_p for p in params], [p.presence_penalty for p in params],
             [p.frequency_penalty for p in params], [p.repetition_penalty for p in params]],
            dtype=torch.float32,
        )  # fmt: skip
        dev = (host.pin_memory() if self.pin else host).to(self.device, non_blocking=self.pin)
        batch = SamplingBatch(
            temperature=dev[0],
            top_k=dev[1].long(),
            top_p=dev[2],
            min_p=dev[3],
            generators=tuple(gens),
            sampled_rows=tuple(s for s, p in enumerate(params) if p.temperature > 0),
            top_k_on=any(p.top_k > 0 and p.temperature > 0 for p in params),
            top_p_on=any(p.top_p < 1 and p.temperature > 0 for p in params),
            min_p_on=any(p.min_p > 0 and p.temperature > 0 for p in params),
            penalties=self.penalties(
                params, history or [([], [])] * len(params), stops or [()] * len(params), extra, dev
            ),
            allowed=None if allowed is None else self._to_device(allowed),
        )
        tokens, logprobs = self.ops.sample(logits, batch)
        out = self._to_host(torch.stack((tokens.double(), logprobs.double())))
        tops = None
        want = {s: p.top_logprobs for s, p in enumerate(params) if p.top_logprobs}
        if want:
            rows = torch.tensor(list(want), device=logits.device)
            lp, ids = torch.log_softmax(logits[rows].float(), -1).topk(max(want.values()), dim=-1)
            tops = (self._to_host(lp), self._to_host(ids), want)
        event = None
        if self.pin:
            event = torch.cuda.Event()
            event.record()
        return Pending(tokens, out, event, tops)
