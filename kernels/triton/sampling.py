"""The greedy batch in Triton: a step whose rows are all greedy, unpenalized and unconstrained
(the common decode step) takes two launches where the batched sampler
(kernels/batched/sampling.py) takes about ten; any other batch goes to that sampler.

  token[s] = argmax_v z[s, v] (the lowest v of equal maxima)      z: logits [S, V] as fp32
  logprob[s] = z[s, token] - logsumexp_v z[s, v] = -log sum_v exp(z[s, v] - max_v z[s, v])

Pass 1: program (s, c) reduces chunk c of row s to (max, sum exp(z - max), argmax); pass 2
merges a row's chunks: M = max_c m_c, sum = sum_c s_c exp(m_c - M), the token from the first
chunk reaching M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.batched import sampling as batched
from dayzero.kernels.ops import SamplingBatch

CHUNK = 4096  # vocabulary entries a program (37 programs a row for a 151,936-token vocabulary)


@triton.jit
def _chunk(z_ptr, part_ptr, V, stride_z, C, BV: tl.constexpr):
    s, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    v = c * BV + tl.arange(0, BV)
    z = tl.load(z_ptr + s * stride_z + v, mask=v < V, other=float("-inf")).to(tl.float32)
    m = tl.max(z, 0)
    i = tl.argmax(z, 0, tie_break_left=True) + c * BV
    e = tl.sum(tl.exp(z - m), 0)
    base = part_ptr + (s * C + c) * 3
    tl.store(base, m)
    tl.store(base + 1, e)
    tl.store(base + 2, i.to(tl.float32))  # exact: V < 2^24


@triton.jit
def _merge(part_ptr, tok_ptr, lp_ptr, C, BC: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BC)
    ok = c < C
    base = part_ptr + (s * C + c) * 3
    m = tl.load(base, mask=ok, other=float("-inf"))
    e = tl.load(base + 1, mask=ok, other=0.0)
    i = tl.load(base + 2, mask=ok, other=0.0)
    mx = tl.max(m, 0)
    first = tl.argmax(m, 0, tie_break_left=True)
    tl.store(tok_ptr + s, tl.sum(tl.where(c == first, i, 0.0), 0).to(tl.int64))
    tl.store(lp_ptr + s, -tl.log(tl.sum(tl.where(ok, e * tl.exp(m - mx), 0.0), 0)))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    greedy = not batch.sampled_rows and batch.penalties is None and batch.allowed is None
    if not greedy or logits.stride(-1) != 1:
        return batched.sample(logits, batch)
    s, v = logits.shape
    c = triton.cdiv(v, CHUNK)
    part = torch.empty(s, c, 3, dtype=torch.float32, device=logits.device)
    tokens = torch.empty(s, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(s, dtype=torch.float32, device=logits.device)
    if s:
        _chunk[(s, c)](logits, part, v, logits.stride(0), c, BV=CHUNK, num_warps=8)
        _merge[(s,)](part, tokens, logprobs, c, BC=triton.next_power_of_2(c), num_warps=1)
    return tokens, logprobs
