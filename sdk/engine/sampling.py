"""Sampling a step's rows on the device, with one readback.

`Sampler.launch` moves the rows' parameters to the device in one copy (from pinned memory on
CUDA), runs the selected `sample` kernel for the whole batch, and queues one device-to-host copy
of (tokens, logprobs) into pinned memory behind it; `Pending.result()` waits for that copy only,
so a step planned meanwhile can already be running on the device (engine overlap). Rows that
asked for top logprobs get them in a second copy queued the same way.

Presence, frequency and repetition penalties read per-request state that lives on the device
(`TokenCounts`): the request's prompt is written once when it starts sampling, and each step's
sampled tokens are counted there on the device, in stream order, before the readback; no token
list crosses to the device per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dayzero.kernels.ops import Penalties, SamplingBatch
from dayzero.sdk.engine.context import upload

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
    def counts_tokens(self) -> bool:
        """Presence, frequency or repetition: the request keeps a `TokenCounts` slot."""
        return self.counts_output or self.repetition_penalty != 1

    @property
    def rewrites(self) -> bool:
        """Some penalty, bias or min_tokens may change this request's logits."""
        return (
            self.counts_output or self.repetition_penalty != 1 or bool(self.logit_bias) or self.min_tokens > 0
        )

    @property
    def verifies_drafts(self) -> bool:
        """Its decode rows can verify drafts: no sampling that reads its own earlier tokens
        (penalties, bias, min_tokens, a grammar), which drafts would pass through one at a time."""
        return not self.rewrites and self.grammar is None


def only_among(bitmask: torch.Tensor, tokens: tuple[int, ...], vocab: int) -> bool:
    """The grammar's bitmask row [ceil(V / 32)] int32 (host) allows no token but `tokens`.

    min_tokens bans a request's stop tokens (EOS, stop_token_ids) until it has produced that
    many; a grammar that is complete (a JSON value closed) allows nothing but those stop tokens.
    Both at once would leave the row no token at all: every logit -inf, an argmax of token 0 that
    the grammar then rejects. The grammar wins there, as the output's validity is what the client
    asked for: the stop tokens stay allowed, and the request ends ("stop") once its grammar is
    complete, shorter than min_tokens. While the grammar allows anything else, the ban holds."""
    words = bitmask.numpy().view(np.uint32).copy()
    if vocab % 32:  # bits past the vocabulary are not tokens
        words[vocab // 32] &= np.uint32((1 << (vocab % 32)) - 1)
    words[vocab // 32 + (vocab % 32 > 0) :] = 0
    idx = np.asarray(tokens, dtype=np.int64)
    np.bitwise_and.at(words, idx // 32, ~(np.uint32(1) << (idx % 32).astype(np.uint32)))
    return not words.any()


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


class TokenCounts:
    """The device state of the requests with a presence, frequency or repetition penalty: one
    slot each in two persistent buffers, counts [slots, V] int32 (how often each token is in
    the request's output so far) and prompt [slots, V] bool (the token is in its prompt).

    A slot is taken when the request first samples (`start`: zeroed, its prompt written in one
    copy for every request starting that step), counted into from each step's sampled tokens
    on the device (`count`, a scatter_add queued after the sampling kernel, so a step launched
    before the last one is read back (overlap) sees that step's tokens), and given back when the
    request finishes or is aborted (`drop`). A retracted request keeps its slot: its output stays
    counted while it waits and when it recomputes. Both buffers are released when no slot is in
    use.

    Memory: 5 bytes x V a penalized request (V = 49,152: 240 KiB; V = 151,936: 742 KiB), the
    slot count doubling as needed (high-water mark of the penalized requests alive at once)."""

    MIN_SLOTS = 4

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.slots: dict[int, int] = {}  # request id -> slot
        self._free: list[int] = []
        self._empty()

    def _empty(self) -> None:
        self.counts = torch.zeros(0, self.vocab, dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros(0, self.vocab, dtype=torch.bool, device=self.device)
        self._free = []

    def __contains__(self, rid: int) -> bool:
        return rid in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes + self.prompt.nbytes

    def _grow(self, need: int) -> None:
        have = self.counts.shape[0]
        size = max(self.MIN_SLOTS, 2 * have, have + need)
        pad = size - have
        self.counts = torch.cat((self.counts, self.counts.new_zeros(pad, self.vocab)))
        self.prompt = torch.cat((self.prompt, self.prompt.new_zeros(pad, self.vocab)))
        self._free.extend(range(size - 1, have - 1, -1))  # lowest slot first

    def start(self, rids: list[int], prompts: list[list[int]], to_device) -> None:
        """Take a slot for each request (none held yet), zeroed, its prompt marked."""
        if len(self._free) < len(rids):
            self._grow(len(rids) - len(self._free))
        slots = [self._free.pop() for _ in rids]
        for rid, s in zip(rids, slots, strict=True):
            self.slots[rid] = s
        at = np.asarray(slots, dtype=np.int64)
        rows = np.repeat(at, [len(p) for p in prompts])
        toks = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
        # one copy (slots, then each prompt token's slot and id), once a request
        dev = to_device(torch.from_numpy(np.concatenate((at, rows, toks))))
        at_d, rows_d, toks_d = dev.split([len(at), len(rows), len(toks)])
        self.counts.index_fill_(0, at_d, 0)  # a slot given back still holds its last counts
        self.prompt.index_fill_(0, at_d, False)
        self.prompt[rows_d, toks_d] = True

    def drop(self, rid: int) -> None:
        """Give the request's slot back (nothing when it holds none)."""
        s = self.slots.pop(rid, None)
        if s is None:
            return
        self._free.append(s)
        if not self.slots:  # the device work queued on the buffers keeps their memory alive
            self._empty()

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts [P, V] int32, prompt [P, V] bool) of the slots [P] (device int64)."""
        return self.counts.index_select(0, slots), self.prompt.index_select(0, slots)

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """counts[slots[i], tokens[i]] += 1 on the device (slots [P], tokens [P] int64)."""
        flat = slots * self.vocab + tokens
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


class Sampler:
    def __init__(self, ops, device: torch.device, vocab: int) -> None:
        self.ops, self.device = ops, device
        self.pin = device.type == "cuda"
        self.state = TokenCounts(vocab, device)

    def _to_host(self, x: torch.Tensor) -> torch.Tensor:
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.pin)
        host.copy_(x, non_blocking=self.pin)
        return host

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        return upload(host, self.device)

    def _index(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Host int64 arrays -> device tensors, in one copy."""
        flat = (
            torch.from_numpy(np.concatenate(arrays).astype(np.int64))
            if arrays
            else torch.zeros(0, dtype=torch.int64)
        )
        return list(upload(flat, self.device).split([len(a) for a in arrays]))

    def start(self, rids: list[int], prompts: list[list[int]]) -> None:
        """A `TokenCounts` slot for each request (holding none yet), its prompt marked."""
        self.state.start(rids, prompts, self._to_device)

    def penalties(
        self,
        params: list[SamplingParams],
        rids: list[int],
        produced: list[int],
        stops: list[tuple[int, ...]],
        dev: torch.Tensor,
        allowed: torch.Tensor | None = None,
    ) -> tuple[Penalties, torch.Tensor] | None:
        """The rows' penalties, and the slots [P] of Penalties.rows (to count the tokens sampled
        into); rids[s]: row s's request, its `TokenCounts` slot taken (`start`) when it counts
        tokens; produced[s]: the output tokens it has so far, also one still on the device (for
        min_tokens); dev = the rows' parameters on the device (see `launch`); allowed: the
        grammars' bitmasks on the host (a row whose grammar allows only its stop tokens keeps
        them: min_tokens does not ban them there). The index lists (rows, slots, biases, bans)
        travel in one copy; none grows with the sequence."""
        if not any(p.rewrites for p in params):
            return None
        rows = [s for s, p in enumerate(params) if p.counts_tokens]
        slots = [self.state.slots[rids[s]] for s in rows]
        lists: dict[str, list[np.ndarray]] = {k: [] for k in ("bias_r", "bias_t", "ban_r", "ban_t")}
        bias_v: list[float] = []

        def add(rows: str, toks: str, s: int, values) -> None:
            arr = np.asarray(values, dtype=np.int64)
            lists[rows].append(np.full(len(arr), s, dtype=np.int64))
            lists[toks].append(arr)

        for s, p in enumerate(params):
            if p.logit_bias:
                add("bias_r", "bias_t", s, [t for t, _ in p.logit_bias])
                bias_v.extend(b for _, b in p.logit_bias)
            if p.min_tokens > produced[s] and stops[s]:
                if allowed is not None and only_among(allowed[s], stops[s], self.state.vocab):
                    continue  # the grammar wins over min_tokens: see `only_among`
                add("ban_r", "ban_t", s, stops[s])
        cat = [np.concatenate(v) if v else np.zeros(0, np.int64) for v in lists.values()]
        bits = np.asarray(bias_v, dtype=np.float64).view(np.int64)  # travels in the same copy
        rows_d, slots_d, b_r, b_t, k_r, k_t, b_v = self._index(
            [np.asarray(rows, np.int64), np.asarray(slots, np.int64), *cat, bits]
        )
        counts, prompt = self.state.gather(slots_d)
        pen = Penalties(
            presence=dev[4], frequency=dev[5], repetition=dev[6], rows=rows_d, counts=counts,
            prompt=prompt, bias_rows=b_r, bias_toks=b_t, bias_vals=b_v.view(torch.float64).float(),
            ban_rows=k_r, ban_toks=k_t,
        )  # fmt: skip
        return pen, slots_d

    def launch(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        gens: list[torch.Generator | None],
        rids: list[int] | None = None,
        produced: list[int] | None = None,
        stops: list[tuple[int, ...]] | None = None,
        allowed: torch.Tensor | None = None,
    ) -> Pending:
        """Sample one token per row of logits [S, V] fp32 (row s under params[s]; rids, produced
        and stops feed the penalties, see `penalties`; allowed: the grammars' bitmasks on the
        host). The tokens of the rows with a `TokenCounts` slot are counted into it on the device."""
        host = torch.tensor(
            [[p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
             [p.min_p for p in params], [p.presence_penalty for p in params],
             [p.frequency_penalty for p in params], [p.repetition_penalty for p in params]],
            dtype=torch.float32,
        )  # fmt: skip
        dev = upload(host, self.device)
        n = len(params)
        pen = self.penalties(params, rids or [-1] * n, produced or [0] * n, stops or [()] * n, dev, allowed)
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
            penalties=None if pen is None else pen[0],
            allowed=None if allowed is None else self._to_device(allowed),
        )
        tokens, logprobs = self.ops.sample(logits, batch)
        if pen is not None and pen[0].rows.numel():
            self.state.count(pen[1], tokens[pen[0].rows])  # on the device, before the readback
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
