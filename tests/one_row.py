"""A one-request step context for running a single attention block outside the engine.

The request's T tokens are all new (a prefill from position 0) and sit in one cache block per
group (and a scratch row past it), so a block can be compared with a reference module on the
same hidden states.
"""

from __future__ import annotations

import torch

from dayzero.kernels.ops import PagedMeta
from dayzero.sdk.engine.context import StateMeta, StepContext


def context(t: int, groups) -> StepContext:
    """groups: the model's CacheGroupCfg list (paged rows in elements, state rows in bytes)."""
    pos = torch.arange(t)
    meta = PagedMeta(
        query_start=torch.tensor([0, t]),
        kv_lens=torch.tensor([t]),
        positions=pos,
        block_table=torch.zeros(1, 1, dtype=torch.int64),
        slots=pos.clone(),
        block_size=t,
        query_start_cpu=(0, t),
        kv_lens_cpu=(t,),
        scratch=t,
    )
    state_bytes = sum(g.row for g in groups if g.kind == "state")
    state = None
    if state_bytes:
        state = StateMeta(torch.zeros(1, state_bytes, dtype=torch.uint8), (0,), (False,), (0, t))
    return StepContext(
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=pos,
        paged=[None if g.kind == "state" else meta for g in groups],
        caches=[None if g.kind == "state" else torch.zeros(t + 1, g.row) for g in groups],  # + scratch
        sample_index=torch.tensor([t - 1]),
        state=state,
    )


@torch.no_grad()
def nextn_logits(model, cfg, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A model built with its MTP head, one request of ids[:T] (T = len(ids) - 1): (its logits
    [T, V], its final hidden z [T, Dm], the head's logits [T, V] at each position i with the next
    token ids[i + 1])."""
    t = ids.shape[0] - 1
    ctx = context(t, cfg.cache_groups)
    ctx.input_ids = ids[:t].clone()
    ctx.sample_index = torch.arange(t)
    logits, z = model(ctx, hidden=True)
    return logits, z, model.mtp(ids[1:], z, ctx, model.embed, model.head)[0]
