"""The block library's registry: a block kind = an option schema, a resolver and a module.

`options` is the pydantic schema of the block's section in a spec; `resolve` turns validated
options plus a symbol lookup into the frozen config the module is built from; `module` is the
nn.Module class the generated code instantiates. A block also states the ops it needs (checked
against the kernel registry when a model is built) and, for attention kinds, the cache it keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from dayzero.kernels.registry import Registry
from dayzero.sdk.config.model import Parallel

Role = Literal["attention", "mlp"]


@dataclass(frozen=True)
class CacheDecl:
    """One part of what an attention layer keeps.

    paged / sliding: `row` elements per token (all of the part's tensors), in the model dtype;
    state: `row` bytes per request (a fixed-size recurrent state). Layers whose parts share
    (kind, window) and a codegen sharing key share one scheduler cache group."""

    part: str
    kind: Literal["paged", "sliding", "state"]
    row: int
    window: int | None = None


@dataclass(frozen=True)
class StaticCache:
    """A cache part as codegen sees it, before any HF config: parts with equal (kind, key)
    share a group, named `name` (suffixed when several groups would take the same name)."""

    part: str
    kind: Literal["paged", "sliding", "state"]
    key: str
    name: str


@dataclass(frozen=True)
class BlockDef:
    kind: str
    role: Role
    options: type[BaseModel]
    resolve: Callable[[Any, Callable[[Any], Any]], Any]  # (options, value-of) -> frozen config
    module: type
    needs: Callable[[Any], list[tuple[str, frozenset[str], int | None]]]
    # attention kinds: the parts a layer keeps (resolved), and as codegen sees them (unresolved),
    # in the same order; the module receives one (group, offset) per part in that order
    cache: Callable[[Any], tuple[CacheDecl, ...]] | None = None
    static_cache: Callable[[Any], tuple[StaticCache, ...]] | None = None
    doc: str = ""
    # tensor parallelism: (resolved config, Parallel) -> this rank's config (its module then
    # builds its shard and states the slices it loads: `shards`); None: not shardable yet
    shard: Callable[[Any, Parallel], Any] | None = None


BLOCKS: Registry[BlockDef] = Registry("block kind")
