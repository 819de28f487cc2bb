"""The C++ control plane as seen from Python.

`dayzero._scheduler` is the pybind11 extension built from `csrc/`; this module
re-exports it and adds the helpers the engine and the tests share.
"""

from __future__ import annotations

from dayzero._scheduler import (
    CacheGroup,
    CopyOps,
    FinishReason,
    GroupKind,
    Plan,
    Scheduler,
    SchedulerConfig,
    SchedulerError,
)

__all__ = [
    "CacheGroup",
    "CopyOps",
    "FinishReason",
    "GroupKind",
    "Plan",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "make_config",
]


def make_config(groups: list[CacheGroup], **fields: int | bool) -> SchedulerConfig:
    """A SchedulerConfig from keyword arguments; fields left out keep the C++ defaults.

    chunk_size defaults to max_tokens_per_step (one chunk may fill a step).
    """
    cfg = SchedulerConfig()
    cfg.groups = groups
    fields.setdefault("chunk_size", fields.get("max_tokens_per_step", cfg.max_tokens_per_step))
    known = {k for k in dir(cfg) if not k.startswith("_") and k != "groups"}
    for name, value in fields.items():
        if name not in known:
            raise TypeError(f"unknown scheduler field {name!r}; known: {', '.join(sorted(known))}")
        setattr(cfg, name, value)
    return cfg
