"""The normalised model configuration: frozen dataclasses built once from spec + HF config.

Nothing below this boundary reads the HF config; layers receive their own frozen config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dayzero.sdk.blocks.norm import EmbeddingCfg, HeadCfg, NormCfg, ResidualCfg


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
