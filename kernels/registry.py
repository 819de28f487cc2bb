"""The one kind of registry dayzero uses (families, blocks, kernels, weight transforms, formats),
and the kernel registry built on it: ops, and kernels with their capabilities as data.

A registry maps a key to an entry. Registering a key twice is a programming error; looking up
an unknown key raises `UnknownKeyError` listing every known key, so a typo in a spec or an
environment variable tells the user what would have worked.

A kernel is (op, backend, function, capabilities). Capabilities are data: device kinds, dtypes,
minimum compute capability, head sizes and op features; `kernels/selection.py` picks among them.
This module is the floor of the package: it imports no other dayzero module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class UnknownKeyError(KeyError):
    """An unknown key; the message lists the known ones."""

    def __init__(self, what: str, key: str, known: list[str]) -> None:
        self.what, self.key, self.known = what, key, known
        super().__init__(f"unknown {what} {key!r}; known: {', '.join(known) or '(none)'}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class Registry(Generic[T]):
    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, T] = {}

    def add(self, key: str, item: T) -> T:
        if key in self._items:
            raise ValueError(f"{self.what} {key!r} is registered twice")
        self._items[key] = item
        return item

    def register(self, key: str) -> Callable[[T], T]:
        """Decorator form of `add`."""
        return lambda item: self.add(key, item)

    def get(self, key: str) -> T:
        try:
            return self._items[key]
        except KeyError:
            raise UnknownKeyError(self.what, key, self.keys()) from None

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def keys(self) -> list[str]:
        return sorted(self._items)

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(sorted(self._items.items()))

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True)
class OpDecl:
    """An op of the portable API and the features a caller may ask of it."""

    name: str
    doc: str
    features: frozenset[str] = frozenset()
    packed: str | None = None  # the op that runs this one when its weight is a PackedWeight


@dataclass(frozen=True)
class Capabilities:
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})
    features: frozenset[str] = frozenset()
    head_dims: frozenset[int] | None = None  # None: any
    min_capability: tuple[int, int] | None = None  # CUDA compute capability
    priority: int = 0  # higher wins among the kernels that fit
    # reads only the step's device tensors (no host copies of them, no host sync, shapes from the
    # row count alone): a decode step of kernels that all are can be captured in a CUDA graph
    graphs: bool = False


@dataclass(frozen=True)
class Kernel:
    op: str
    backend: str
    fn: Callable
    caps: Capabilities = field(default_factory=Capabilities)

    @property
    def key(self) -> str:
        return f"{self.op}/{self.backend}"


OPS: Registry[OpDecl] = Registry("op")
KERNELS: Registry[Kernel] = Registry("kernel")


def declare_op(name: str, doc: str, features: Iterable[str] = (), packed: str | None = None) -> None:
    OPS.add(name, OpDecl(name, doc, frozenset(features), packed))


def register(
    op: str, backend: str, caps: Capabilities | None = None, graphs: bool = False
) -> Callable[[Callable], Callable]:
    """`graphs` marks a kernel of default capabilities graph-safe (Capabilities.graphs)."""
    OPS.get(op)  # an unknown op fails here, listing the known ones

    def wrap(fn: Callable) -> Callable:
        c = caps or Capabilities(features=OPS.get(op).features, graphs=graphs)
        KERNELS.add(f"{op}/{backend}", Kernel(op, backend, fn, c))
        return fn

    return wrap
