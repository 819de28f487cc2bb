"""Weight transforms a spec's weight rules may name (`transform: {kind: ..., args: {...}}`).

A transform is `fn(tensor, **args) -> tensor`, applied to a checkpoint tensor before it is
written; its arguments are literals or `$symbol`s of the spec. The spec reader checks a rule's
kind and arguments against this registry; the loader applies them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dayzero.kernels.registry import Registry

TRANSFORMS: Registry[Callable[..., torch.Tensor]] = Registry("weight transform")


@TRANSFORMS.register("rope_unpermute")
def rope_unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """GGUF stores q/k rows of each head interleaved (pairs); back to rotate-half order."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
