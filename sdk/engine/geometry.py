"""Cache geometry: the generated declaration of cache groups, and the scheduler groups it becomes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dayzero.sdk.config.model import ModelConfig
from dayzero.sdk.engine.kv_pool import ROW_ALIGN
from dayzero.sdk.scheduler import CacheGroup, GroupKind


@dataclass(frozen=True)
class GroupDecl:
    """A cache group as codegen declares it: the attention-block cache parts (`block.part`)
    whose layers share it."""

    name: str
    kind: Literal["paged", "sliding", "state"]
    members: tuple[str, ...]


def scheduler_groups(cfg: ModelConfig, elem_bytes: int) -> list[CacheGroup]:
    """One scheduler group per resolved cache group; rows padded to ROW_ALIGN bytes."""
    out = []
    for g in cfg.cache_groups:
        if g.kind == "state":  # row is already bytes per request
            out.append(CacheGroup(g.name, GroupKind.State, state_bytes=-(-g.row // ROW_ALIGN) * ROW_ALIGN))
            continue
        row = -(-g.row * elem_bytes // ROW_ALIGN) * ROW_ALIGN
        if g.kind == "sliding":
            out.append(CacheGroup(g.name, GroupKind.SlidingWindow, bytes_per_token=row, window=g.window))
        else:
            out.append(CacheGroup(g.name, GroupKind.Paged, bytes_per_token=row))
    return out
