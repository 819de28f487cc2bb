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
    cache_group: int
    cache_offset: int  # elements into the group's per-token row


@dataclass(frozen=True)
class CacheGroupCfg:
    """One scheduler cache group: `row` elements per token, summed over its `layers`."""

    name: str
    kind: Literal["paged", "sliding"]
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
    head: HeadCfg
    cache_groups: tuple[CacheGroupCfg, ...]
    max_position: int | None
    eos_token_ids: tuple[int, ...]
    symbols: tuple[tuple[str, Any], ...]  # every resolved symbol (for inspection and debugging)
