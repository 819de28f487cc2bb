"""The normalised model configuration: frozen dataclasses built once from spec + HF config.

Nothing below this boundary reads the HF config; a layer receives only its own `LayerCfg`
(its blocks' frozen configs come from each block's `resolve`, in sdk/blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class NormCfg:
    dim: int
    eps: float
    weight_in_fp32: bool


@dataclass(frozen=True)
class HyperCfg:
    streams: int  # N
    sinkhorn_iters: int
    eps: float  # floor on pre / comb weights and on Sinkhorn sums
    norm_eps: float  # the unweighted RMS norm over the flattened streams


@dataclass(frozen=True)
class ResidualCfg:
    """One residual add around f. kind prenorm: x + f(n(x)); sandwich: x + post(f(n(x)));
    hyper: see HyperResidual. add_index k > 0 (depth-scaled): x * sqrt((k - 1) / k) + y / sqrt(k)."""

    kind: str
    norm: NormCfg
    add_index: int = 0
    hyper: HyperCfg | None = None


@dataclass(frozen=True)
class EmbeddingCfg:
    vocab: int
    dim: int


@dataclass(frozen=True)
class HeadCfg:
    vocab: int
    dim: int
    tie: bool
    softcap: float | None


@dataclass(frozen=True)
class LayerCfg:
    index: int
    attn_kind: str  # block kind (registry key)
    attn: Any  # that kind's frozen config
    mlp_kind: str
    mlp: Any
    attn_res: ResidualCfg
    mlp_res: ResidualCfg
    caches: tuple[tuple[int, int], ...]  # per cache part of the attention block: (group, offset)
    # offset: elements into the group's per-token row (paged), bytes into the request's slot (state)


@dataclass(frozen=True)
class CacheGroupCfg:
    """One scheduler cache group: `row` elements per token summed over its `layers` (paged,
    sliding), or `row` bytes per request (state)."""

    name: str
    kind: Literal["paged", "sliding", "state"]
    window: int | None
    row: int
    layers: tuple[int, ...]


@dataclass(frozen=True)
class ModelConfig:
    family: str
    spec_hash: str
    embedding: EmbeddingCfg
    layers: tuple[LayerCfg, ...]
    final_norm: NormCfg
    streams: int  # residual streams (hyper-connections); 1 = one plain residual stream
    head: HeadCfg
    cache_groups: tuple[CacheGroupCfg, ...]
    max_position: int | None
    eos_token_ids: tuple[int, ...]
    symbols: tuple[tuple[str, Any], ...]  # every resolved symbol (for inspection and debugging)
