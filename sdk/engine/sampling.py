"""Sampling a step's rows on the device, with one readback.

`Sampler.launch` moves the rows' parameters to the device in one copy (from pinned memory on
CUDA), runs the selected `sample` kernel for the whole batch, and queues one device-to-host copy
of (tokens, logprobs) into pinned memory behind it; `Pending.result()` waits for that copy only,
so a step planned meanwhile can already be running on the device (engine overlap). Rows that
asked for top logprobs get them in a second copy queued the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dayzero.kernels.ops import SamplingBatch

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

    def __post_init__(self) -> None:
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

    def launch(
        self, logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]
    ) -> Pending:
        """Sample one token per row of logits [S, V] fp32 (row s under params[s])."""
        host = torch.tensor(
            [[p.temperature for p in params], [p.top_k for p in params], [p.top_p for p in params],
             [p.min_p for p in params]],
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
