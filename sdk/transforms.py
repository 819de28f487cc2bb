"""Weight transforms a spec's weight rules may name: a small registry of composable kinds.

A rule's `transform` is one `{kind: ..., args: {...}}` or a list of them, applied in order to
the checkpoint tensor before it is written. Each kind is a pure tensor function with its
arguments' schema (`params`): the spec reader validates a rule's arguments against it when the
spec loads (a bad one is a SpecError naming the rule), and again once their `$symbol`s and
`= expressions` are resolved against a checkpoint's config. A kind that `splits` returns
several tensors; it is the last of its rule, whose `to` then lists one target per piece.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from pydantic import BaseModel, Field, model_validator

from dayzero.kernels.registry import Registry
from dayzero.sdk.config.options import Formula, Ref, Strict

# a transform argument: a literal, a `$symbol` or an `= expression` over symbols
IntE = int | Ref | Formula
FloatE = float | Ref | Formula

Out = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class TransformDef:
    fn: Callable[..., Out]  # fn(tensor, **args)
    params: type[BaseModel]  # the arguments' schema (spec literals, then resolved values)
    doc: str
    # a splitting kind: how many tensors it returns for its arguments (one per target)
    pieces: Callable[[BaseModel], int] | None = None

    @property
    def splits(self) -> bool:
        return self.pieces is not None


TRANSFORMS: Registry[TransformDef] = Registry("weight transform")


def _transform(kind: str, params: type[BaseModel], pieces: Callable[[BaseModel], int] | None = None):
    def add(fn: Callable[..., Out]) -> Callable[..., Out]:
        TRANSFORMS.add(kind, TransformDef(fn, params, inspect.getdoc(fn) or "", pieces))
        return fn

    return add


def _literal(v: object) -> bool:
    """A literal whole number: checks on values run when the spec loads for literals, and
    for `$symbol`s and `= expressions` once resolved (`bind`)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _positive(name: str, v: object) -> None:
    if _literal(v) and v <= 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be > 0, got {v}")


class Heads(Strict):
    heads: IntE

    @model_validator(mode="after")
    def _check(self) -> Heads:
        _positive("heads", self.heads)
        return self


@_transform("rope_unpermute", Heads)
def rope_unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """GGUF (llama.cpp) stores each head's q / k rows as interleaved rotary pairs; back to the
    rotate-half order: per head, rows (0, 2, 4, ..., 1, 3, 5, ...)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class Shape(Strict):
    shape: list[IntE] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Shape:
        dims = [d for d in self.shape if _literal(d)]
        if sum(d == -1 for d in dims) > 1:
            raise ValueError(f"at most one -1 in shape, got {self.shape}")
        if bad := [d for d in dims if d < -1 or d == 0]:
            raise ValueError(f"shape sizes must be > 0 (or one -1), got {bad[0]} in {self.shape}")
        return self


@_transform("reshape", Shape)
def reshape(w: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """The tensor's elements in a new shape (one size may be -1: inferred), e.g. a stored
    `[1, 1, H, 1]` to `[H]` with `shape: [$heads]`; the element count must not change."""
    return w.reshape(shape)


class Dims(Strict):
    dims: list[int] = Field(min_length=2, max_length=2)

    @model_validator(mode="after")
    def _check(self) -> Dims:
        if self.dims[0] == self.dims[1]:
            raise ValueError(f"dims must be two different dims, got {self.dims}")
        return self


@_transform("transpose", Dims)
def transpose(w: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """Two dims swapped (negative dims count from the end), e.g. stacked experts stored
    `[E, K, N]` to `[E, N, K]` with `dims: [1, 2]`."""
    return w.transpose(dims[0], dims[1])


class Interleave(Strict):
    dim: int = 0
    parts: IntE = 2

    @model_validator(mode="after")
    def _check(self) -> Interleave:
        if _literal(self.parts) and self.parts < 2:  # type: ignore[operator]
            raise ValueError(f"parts must be >= 2, got {self.parts}")
        return self


@_transform("deinterleave", Interleave)
def deinterleave(w: torch.Tensor, dim: int = 0, parts: int = 2) -> torch.Tensor:
    """A strided de-interleave along `dim`: indices 0, p, 2p, ... first, then 1, p+1, ...,
    (p = `parts`), e.g. a fused gate/up stored with gate and up rows alternating (0, 2, 4, ...
    gate; 1, 3, 5, ... up) to all gate rows, then all up rows."""
    d = dim % w.dim()
    if w.shape[d] % parts:
        raise ValueError(f"dim {dim} has {w.shape[d]} entries, not a multiple of {parts}")
    return w.unflatten(d, (-1, parts)).movedim(d + 1, d).flatten(d, d + 1)


class HeadSplit(Strict):
    heads: IntE
    sizes: list[IntE] = Field(min_length=2)
    dim: int = 0

    @model_validator(mode="after")
    def _check(self) -> HeadSplit:
        _positive("heads", self.heads)
        for s in self.sizes:
            _positive("sizes", s)
        return self


@_transform("split_heads", HeadSplit, pieces=lambda a: len(a.sizes))
def split_heads(w: torch.Tensor, heads: int, sizes: list[int], dim: int = 0) -> tuple[torch.Tensor, ...]:
    """A projection packed per head, `[H * (s_0 + s_1 + ...), K]` with head h's rows
    `[piece_0 (s_0 rows); piece_1 (s_1 rows); ...]`, to one contiguous tensor per piece,
    `[H * s_j, K]` (heads in order): Qwen3-Next / Qwen3.5 gated attention's `q_proj`, each head's
    query then its output gate (`sizes: [$head_dim, $head_dim]`), to `[q]` and `[gate]`."""
    d = dim % w.dim()
    if w.shape[d] != heads * sum(sizes):
        raise ValueError(f"dim {dim} has {w.shape[d]} entries, not heads {heads} x {sum(sizes)} ({sizes})")
    per_head = w.unflatten(d, (heads, sum(sizes)))
    return tuple(p.flatten(d, d + 1) for p in per_head.split(sizes, dim=d + 1))


class Constant(Strict):
    value: FloatE


@_transform("add", Constant)
def add(w: torch.Tensor, value: float) -> torch.Tensor:
    """w + value (in the tensor's dtype), e.g. `value: 1` for a zero-centred norm weight stored
    as w - 1 (a norm computing x * (1 + w)) into a norm computing x * w."""
    return w + value


class Head(Strict):
    length: IntE
    dim: int = 0
    zero_padding: bool = True  # the entries past `length` must be zeros

    @model_validator(mode="after")
    def _check(self) -> Head:
        _positive("length", self.length)
        return self


@_transform("head", Head)
def head(w: torch.Tensor, length: int, dim: int = 0, zero_padding: bool = True) -> torch.Tensor:
    """The first `length` entries along `dim`; the rest is padding the checkpoint stores (Kimi
    K3's A_log: [128] of which the first num_heads are read). zero_padding: a non-zero entry
    past `length` is an error (the padding carried data after all); false: they are not read."""
    if w.shape[dim] < length:
        raise ValueError(f"dim {dim} has {w.shape[dim]} entries, fewer than {length}")
    rest = w.narrow(dim, length, w.shape[dim] - length)
    if zero_padding and rest.numel() and bool(rest.ne(0).any()):
        raise ValueError(f"{int(rest.ne(0).sum())} non-zero entries past the first {length} along dim {dim}")
    return w.narrow(dim, 0, length)


class Splits(Strict):
    sizes: list[IntE] = Field(min_length=2)
    dim: int = 0

    @model_validator(mode="after")
    def _check(self) -> Splits:
        for s in self.sizes:
            _positive("sizes", s)
        return self


@_transform("split", Splits, pieces=lambda a: len(a.sizes))
def split(w: torch.Tensor, sizes: list[int], dim: int = 0) -> tuple[torch.Tensor, ...]:
    """Consecutive pieces of `sizes` along `dim`, one per target: a fused projection stored
    whole (`qkv_proj`: `sizes: [= heads * head_dim, = kv_heads * head_dim, = kv_heads * head_dim]`)."""
    if w.shape[dim] != sum(sizes):
        raise ValueError(f"dim {dim} has {w.shape[dim]} entries, not {' + '.join(map(str, sizes))}")
    return tuple(w.split(sizes, dim=dim))


def bind(kind: str, args: dict) -> Callable[[torch.Tensor], Out]:
    """A kind with its resolved arguments (numbers, lists of numbers), checked by its schema
    (ValueError naming the problem); returns w -> the transformed tensor(s)."""
    d = TRANSFORMS.get(kind)
    kw = d.params.model_validate(args).model_dump()
    for k, v in kw.items():
        if any(isinstance(x, str) for x in (v if isinstance(v, list) else [v])):
            raise ValueError(f"{kind}: {k} must resolve to numbers, got {v!r}")
    return lambda w: d.fn(w, **kw)
