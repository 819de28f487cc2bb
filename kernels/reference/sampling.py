"""Reference sampler: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from dayzero.kernels.registry import register


@register("sample", "reference")
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits [S, V].

    temperature[s] == 0 picks argmax. Otherwise p = softmax(logits / T) restricted to the top_k
    largest (top_k <= 0: all) and to the smallest prefix of the sorted distribution whose mass
    reaches top_p, renormalised, sampled with the row's generator (None: the global one).
    Returns (tokens [S] int64, logprob of each token under the unmodified distribution [S]).
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    for s in (temperature > 0).nonzero().flatten().tolist():
        z = logits[s] / temperature[s]
        k = int(top_k[s])
        if 0 < k < z.shape[0]:
            z = z.masked_fill(z < z.topk(k).values[-1], float("-inf"))
        if float(top_p[s]) < 1.0:
            sz, order = z.sort(descending=True)
            mass = sz.softmax(-1).cumsum(-1)
            drop = mass - sz.softmax(-1) >= top_p[s]  # tokens after the prefix reaching top_p
            z = z.scatter(0, order, sz.masked_fill(drop, float("-inf")))
        tokens[s] = torch.multinomial(z.softmax(-1), 1, generator=generators[s]).squeeze(0)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)
