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


def make_config(
    groups: list[CacheGroup],
    *,
    device_bytes: int,
    block_size: int = 64,
    host_bytes: int = 0,
    max_batch_size: int = 256,
    max_tokens_per_step: int = 8192,
    chunk_size: int | None = None,
    snapshot_slots: int = 0,
    spec_tokens: int = 0,
    overlap: bool = False,
    prefix_cache: bool = True,
) -> SchedulerConfig:
    """A SchedulerConfig from keyword arguments (the C++ struct has no keyword constructor)."""
    cfg = SchedulerConfig()
    cfg.groups = groups
    cfg.device_bytes = device_bytes
    cfg.block_size = block_size
    cfg.host_bytes = host_bytes
    cfg.max_batch_size = max_batch_size
    cfg.max_tokens_per_step = max_tokens_per_step
    cfg.chunk_size = chunk_size if chunk_size is not None else max_tokens_per_step
    cfg.snapshot_slots = snapshot_slots
    cfg.spec_tokens = spec_tokens
    cfg.overlap = overlap
    cfg.prefix_cache = prefix_cache
    return cfg
