"""What `dayzero parity` counts as a pass: the bounds, and how greedy sequences are compared.

fp32: dayzero's logits are within `logits` (absolute) of the reference's, and its greedy tokens
are the reference's with chosen-token logprobs within `logprobs`. fp32 is not exact math: a deep
model amplifies its rounding, and past the bound both sides are judged against the same weights
in fp64 (`second_opinion`): dayzero passes when its error there is at most `ratio` x the fp32
reference's own (a Kimi K3 config of width 1,024 and 8 layers: the fp32 reference is 1.2e-4 off
fp64 on the CPU, dayzero 6.9e-5).

Low precision (bf16, fp16): dayzero and the reference in that dtype are both judged against the
reference in fp32. Logits: dayzero's error within `ratio` x the reference's own + `slack`.
Greedy tokens, two measures against the fp32 sequence:
  agreement  the mean fraction of each sequence matched before its first different token;
  gap        at each sequence's first different token i, how far the token taken is from the
             fp32 choice under the fp32 model, lp32_i(fp32 token) - lp32_i(token taken) >= 0
             (the worst over the sequences; a token outside fp32's `TOP` likeliest: infinite).
A check passes on either: agreement at least half the reference's, or a finite worst gap within
`ratio` x the reference's worst gap + `gap_slack`. A finite gap is dayzero's half of vLLM's rule
for low-precision greedy outputs (at the first different token, each side's token is among the
other's likeliest; here dayzero's among fp32's); the reference's own gap tightens it where the
reference keeps to fp32's TOP itself. Where it does not (a medium Qwen3.8 or Kimi K3 in bf16 on
an H200 takes a token outside fp32's 20 likeliest), the bound is that rule alone. On random
weights the logits are nearly flat and the reference itself leaves the fp32 sequence within its
first few tokens (agreement 0.035 on a Qwen3.8 config of width 1,024, bf16): agreement then
counts a handful of tokens, and one token more or less decides it; the gap still tells a
near-tie taken the other way (what the dtype does) from a token the model does not predict
(what a bug does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dayzero.sdk.engine.engine import RequestOutput

TOP = 20  # fp32 logprobs kept at each greedy position (the gap's candidates)

# a greedy sequence: (tokens, their logprobs)
Sequence = tuple[list[int], list[float]]


@dataclass(frozen=True)
class Tolerance:
    """The bounds above; `exact`: fp32 (else judged against fp32, as low precision is)."""

    logits: float = 1e-4
    logprobs: float = 1e-4
    ratio: float = 2.0
    slack: float = 1e-2
    gap_slack: float = 1e-2
    exact: bool = True

    @staticmethod
    def for_dtype(dtype: torch.dtype) -> Tolerance:
        return Tolerance() if dtype == torch.float32 else Tolerance(exact=False)

    def second_opinion(self, ours_vs_fp64: float, reference_vs_fp64: float) -> bool:
        """fp32 past `logits`: dayzero's error against fp64 within the fp32 reference's own."""
        return ours_vs_fp64 <= max(self.logits, self.ratio * reference_vs_fp64)


@dataclass
class Row:
    check: str
    ok: bool
    logit_err: float | None = None  # None: the check does not measure it
    logprob_err: float | None = None
    agreement: float | None = None
    note: str = ""


@dataclass
class Expected:
    tokens: list[Sequence]  # greedy tokens + logprobs dayzero should give
    # low precision: each fp32 position's TOP likeliest tokens -> logprob, per sequence
    top: list[list[dict[int, float]]] | None = None
    reference_agreement: float | None = None  # low precision: the reference's own measures
    reference_gap: float | None = None


def _sequence(out: RequestOutput | Sequence) -> Sequence:
    return (out.token_ids, out.logprobs) if isinstance(out, RequestOutput) else out


def _first_difference(got: list[int], want: list[int]) -> int:
    return next(
        (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
    )


def agreement(outs: list, ref: list[Sequence]) -> tuple[float, float]:
    """(mean fraction of each expected sequence matched before the first difference,
    max |logprob difference| over the matched tokens)."""
    agree, lp_err = [], 0.0
    for out, (toks, lps) in zip(outs, ref, strict=True):
        got, got_lp = _sequence(out)
        n = _first_difference(got, toks)
        agree.append(n / len(toks))
        if n:
            lp_err = max(lp_err, float(np.max(np.abs(np.array(got_lp[:n]) - np.array(lps[:n])))))
    return float(np.mean(agree)), lp_err


def divergence_gap(outs: list, ref: list[Sequence], top: list[list[dict[int, float]]]) -> float:
    """The worst gap over the sequences that leave `ref` (0.0: none does; see the module)."""
    worst = 0.0
    for out, (toks, _), likely in zip(outs, ref, top, strict=True):
        got = _sequence(out)[0]
        i = _first_difference(got, toks)
        if i < min(len(got), len(toks)):
            taken = likely[i].get(got[i])
            worst = max(worst, math.inf if taken is None else likely[i][toks[i]] - taken)
    return worst


def compare(outs: list, exp: Expected, tol: Tolerance, name: str, note: str = "") -> Row:
    a, lp_err = agreement(outs, exp.tokens)
    if tol.exact:
        return Row(name, a == 1.0 and lp_err <= tol.logprobs, logprob_err=lp_err, agreement=a, note=note)
    gap = divergence_gap(outs, exp.tokens, exp.top)
    # the reference's gap infinite (it takes a token fp32 does not rank): the bound is finiteness alone
    ok = a >= 0.5 * exp.reference_agreement or (
        math.isfinite(gap) and gap <= tol.ratio * exp.reference_gap + tol.gap_slack
    )
    said = (
        f"vs fp32; reference {exp.reference_agreement:.3f}, gap {gap:.3f} (reference {exp.reference_gap:.3f})"
    )
    return Row(name, ok, logprob_err=lp_err, agreement=a, note=said + (f"; {note}" if note else ""))
