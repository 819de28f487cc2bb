"""Reference sampler: a loop over the sampled rows, one multinomial draw each (greedy rows:
argmax), with the rows' seeded generators."""

from __future__ import annotations

import torch

from dayzero.kernels.ops import Penalties, SamplingBatch
from dayzero.kernels.registry import register


def allowed_only(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, V] with the tokens a row's bitmask [S, ceil(V / 32)] int32 leaves out at -inf."""
    s, v = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    ok = ((bitmask[:, :, None] >> shifts) & 1).reshape(s, -1)[:, :v].bool()
    return logits.masked_fill(~ok, float("-inf"))


def rewritten(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits the sampler draws from: the grammar's mask, then the penalties."""
    if batch.allowed is not None:
        logits = allowed_only(logits, batch.allowed)
    if batch.penalties is not None:
        logits = penalized(logits, batch.penalties)
    return logits


def penalized(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """logits [S, V] fp32 rewritten in vLLM's order: + logit bias; then, over the tokens a row has
    seen (prompt or output), z / r where z > 0 and z * r elsewhere (repetition r); minus
    frequency * count + presence * [count > 0] over its output tokens; its banned tokens -inf.
    Only the rows p.rows have seen / output tokens; on a row whose penalty is off the rewrite
    is the identity, bit for bit (z / 1, z * 1, z - 0 * c - 0)."""
    z = logits.clone()
    if p.bias_rows.numel():
        z.index_put_((p.bias_rows, p.bias_toks), p.bias_vals, accumulate=True)
    if p.rows.numel():
        zr = z[p.rows]  # [P, V]
        counts = p.counts.float()  # exact: a count is at most the output length
        seen = p.prompt | (p.counts > 0)
        r = p.repetition[p.rows, None]
        zr = torch.where(seen, torch.where(zr > 0, zr / r, zr * r), zr)
        zr = zr - p.frequency[p.rows, None] * counts - p.presence[p.rows, None] * (counts > 0).float()
        z[p.rows] = zr
    if p.ban_rows.numel():
        z[p.ban_rows, p.ban_toks] = float("-inf")
    return z


def filtered(z: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The logits z [V] (already divided by the temperature) with the tokens min-p, top-k and
    top-p rule out set to -inf, in vLLM's order: min_p drops p < min_p * max(p); top_k keeps the
    k largest (ties at the k-th kept); top_p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p (renormalised after top-k)."""
    if min_p > 0.0:
        p = z.softmax(-1)
        z = z.masked_fill(p < min_p * p.max(), float("-inf"))
    if 0 < top_k < z.shape[0]:
        z = z.masked_fill(z < z.topk(top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        sz, order = z.sort(descending=True)
        p = sz.softmax(-1)
        drop = p.cumsum(-1) - p >= top_p  # tokens after the prefix reaching top_p
        z = z.scatter(0, order, sz.masked_fill(drop, float("-inf")))
    return z


@register("sample", "reference")
def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits [S, V]: with z = rewritten(logits), argmax(z) where the
    temperature is 0, else a draw from softmax(filtered(z / T)) with the row's generator.
    Returns (tokens [S] int64, the logprob of each token under the model's distribution
    log_softmax(logits) [S], before any penalty: vLLM's raw logprobs)."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)  # of the logits as the model gave them
    logits = rewritten(logits, batch)
    tokens = logits.argmax(dim=-1)
    temp, top_k = batch.temperature.tolist(), batch.top_k.tolist()
    top_p, min_p = batch.top_p.tolist(), batch.min_p.tolist()
    for s in batch.sampled_rows:
        if not torch.isfinite(logits[s]).any():  # no token left (a grammar that allows none): the
            continue  # argmax, as a greedy row and the batched sampler give; the engine refuses it
        z = filtered(logits[s] / temp[s], int(top_k[s]), top_p[s], min_p[s])
        tokens[s] = torch.multinomial(z.softmax(-1), 1, generator=batch.generators[s]).squeeze(0)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
