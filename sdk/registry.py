"""The one kind of registry dayzero uses: families, blocks, kernels, weight transforms.

A registry maps a key to an entry. Registering a key twice is a programming error; looking up
an unknown key raises `UnknownKeyError` listing every known key, so a typo in a spec or an
environment variable tells the user what would have worked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

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
