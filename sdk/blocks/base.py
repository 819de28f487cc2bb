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

from dayzero.sdk.registry import Registry

Role = Literal["attention", "mlp"]


@dataclass(frozen=True)
class CacheDecl:
    """What one attention layer keeps per token: `row` elements (all of its tensors) in a
    paged group of `kind`; layers with equal (kind, window) share one scheduler cache group."""

    kind: Literal["paged", "sliding"]
    row: int
    window: int | None = None


@dataclass(frozen=True)
class BlockDef:
    kind: str
    role: Role
    options: type[BaseModel]
    resolve: Callable[[Any, Callable[[Any], Any]], Any]  # (options, value-of) -> frozen config
    module: type
    needs: Callable[[Any], list[tuple[str, frozenset[str], int | None]]]
    cache: Callable[[Any], CacheDecl] | None = None
    # codegen: (cache kind, sharing key) from the unresolved options; equal keys share a group
    static_cache: Callable[[Any], tuple[str, str]] | None = None
    doc: str = ""


BLOCKS: Registry[BlockDef] = Registry("block kind")
