"""Kernel selection: the built-in backends and third-party ones, and the choice per need.

`select` picks, for one `Need` (op + features + head size), the registered kernel with the
highest priority that supports the device and dtype; `DAYZERO_KERNEL_<OP>=<backend>` overrides
the choice. A model is built only after every need it has is selected (`OpTable.resolve`), so a
spec this device cannot run fails before serving, naming the op and what is missing.

Importing this module registers the built-in backends (reference, batched, triton, fla); third-party
backends register through the entry-point group `dayzero.kernels`, or as modules named in
`DAYZERO_KERNEL_MODULES` (comma-separated, importable), loaded on the first choice.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import entry_points

import torch

from dayzero.kernels import batched, fla, reference, triton  # noqa: F401  (register on import)
from dayzero.kernels.collective import TpGroup
from dayzero.kernels.packed import PackedWeight
from dayzero.kernels.registry import KERNELS, OPS, Kernel, UnknownKeyError

ENTRY_POINT_GROUP = "dayzero.kernels"


@dataclass(frozen=True)
class Need:
    """What one block asks of one op."""

    op: str
    features: frozenset[str] = frozenset()
    head_dims: frozenset[int] = frozenset()  # every head size the model runs the op at


class KernelSelectionError(RuntimeError):
    pass


_plugins_loaded = False


def load_plugins() -> None:
    """Import the third-party backends (entry-point group `dayzero.kernels`, then the modules
    in DAYZERO_KERNEL_MODULES), once."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()
    for name in filter(None, (m.strip() for m in os.environ.get("DAYZERO_KERNEL_MODULES", "").split(","))):
        importlib.import_module(name)


def _missing(k: Kernel, need: Need, device: torch.device, dtype: torch.dtype) -> list[str]:
    c, out = k.caps, []
    if device.type not in c.devices:
        out.append(f"device {device.type} (has {', '.join(sorted(c.devices))})")
    if dtype not in c.dtypes:
        out.append(f"dtype {str(dtype).removeprefix('torch.')}")
    if lacking := need.features - c.features:
        out.append(f"features {', '.join(sorted(lacking))}")
    if c.head_dims is not None and (lacking_dims := need.head_dims - c.head_dims):
        out.append(f"head size {', '.join(map(str, sorted(lacking_dims)))}")
    if c.min_capability is not None and device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        if cc < c.min_capability:
            out.append(f"compute capability {cc} < {c.min_capability}")
    return out


def select(need: Need, device: torch.device, dtype: torch.dtype) -> Kernel:
    load_plugins()
    decl = OPS.get(need.op)
    if unknown := need.features - decl.features:
        raise KernelSelectionError(
            f"op {need.op!r} has no feature {', '.join(sorted(unknown))}; "
            f"known: {', '.join(sorted(decl.features)) or '(none)'}"
        )
    candidates = [k for _, k in KERNELS.items() if k.op == need.op]
    override = os.environ.get(f"DAYZERO_KERNEL_{need.op.upper()}")
    if override:
        by_name = {k.backend: k for k in candidates}
        if override not in by_name:
            raise UnknownKeyError(f"backend for op {need.op!r}", override, sorted(by_name))
        candidates = [by_name[override]]
    fits = [k for k in candidates if not _missing(k, need, device, dtype)]
    if not fits:
        why = "; ".join(
            f"{k.backend}: lacks {', '.join(_missing(k, need, device, dtype))}" for k in candidates
        )
        raise KernelSelectionError(f"no kernel for op {need.op!r} on {device.type}/{dtype}: {why}")
    return max(fits, key=lambda k: k.caps.priority)


def _by_weight(dense: Callable, packed: Callable) -> Callable:
    """Call `packed` when the op's weight (its second argument) is a PackedWeight."""

    def call(x, w, *args, **kw):
        return (packed if isinstance(w, PackedWeight) else dense)(x, w, *args, **kw)

    return call


class OpTable:
    """The kernels one model was built with: `ops.rms_norm(...)` calls the selected function.
    An op with a packed twin (`linear` -> `linear_packed`) runs the twin for packed weights when
    the model needed it."""

    def __init__(self, device: torch.device, dtype: torch.dtype, tp: TpGroup | None = None) -> None:
        self.device, self.dtype = device, dtype
        self.tp = tp or TpGroup()  # the collectives of a sharded model (one rank: none)
        self._chosen: dict[str, Kernel] = {}
        self._needs: dict[str, Need] = {}

    def need(self, op: str, features: Iterable[str] = (), head_dim: int | None = None) -> None:
        """Record a need; the union of features over all blocks is what gets selected."""
        prev = self._needs.get(op, Need(op))
        dims = prev.head_dims | ({head_dim} if head_dim else set())
        self._needs[op] = Need(op, prev.features | frozenset(features), frozenset(dims))

    def resolve(self) -> OpTable:
        for op, need in self._needs.items():
            self._chosen[op] = select(need, self.device, self.dtype)
        self._calls = {op: k.fn for op, k in self._chosen.items()}
        for op, k in self._chosen.items():
            twin = OPS.get(op).packed
            if twin in self._chosen:
                self._calls[op] = _by_weight(k.fn, self._chosen[twin].fn)
        return self

    def needs(self) -> dict[str, Need]:
        return dict(self._needs)

    def not_graph_safe(self) -> list[str]:
        """The model's ops whose selected kernel cannot run inside a CUDA graph (sampling runs
        outside the graph and is not counted)."""
        return sorted(op for op, k in self._chosen.items() if op != "sample" and not k.caps.graphs)

    def chosen(self) -> dict[str, str]:
        return {op: k.backend for op, k in sorted(self._chosen.items())}

    def __getattr__(self, op: str) -> Callable:
        calls, chosen = self.__dict__.get("_calls", {}), self.__dict__.get("_chosen", {})
        if op in calls:
            return calls[op]
        raise AttributeError(f"op {op!r} was not selected for this model (needs: {', '.join(chosen)})")
