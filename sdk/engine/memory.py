"""What an engine config's memory holds: the scheduler's settings of it, the KV pages and state
slots by the scheduler's own layout rules (csrc/src/memory.cc), the verify graphs' state
checkpoints, and the pages every tensor-parallel rank agrees on."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from dayzero.sdk.config.model import ModelConfig
from dayzero.sdk.engine.config import EngineConfig
from dayzero.sdk.engine.geometry import scheduler_groups
from dayzero.sdk.engine.kv_pool import ROW_ALIGN
from dayzero.sdk.engine.ranks import from_leader, smallest
from dayzero.sdk.scheduler import Scheduler, SchedulerError, make_config

log = logging.getLogger(__name__)


def _state_slot_bytes(cfg: ModelConfig) -> int:
    """A request's state slot, as the scheduler lays it out (csrc/src/memory.cc)."""
    return sum(-(-g.row // ROW_ALIGN) * ROW_ALIGN for g in cfg.cache_groups if g.kind == "state")


def checkpoint_slots(cfg: ModelConfig, config: EngineConfig, device: torch.device) -> int:
    """The state slots a stateful model's verify graphs keep their tokens' states in (KvPool,
    StateMeta.checkpoints): k + 1 for each row of the largest batch, within half the KV budget
    (rounded down to whole requests: verify steps of more requests run varlen); none without
    drafting, recurrent state or decode graphs."""
    mode, par = config.decode_graphs, cfg.parallel
    if config.speculative is None or not any(g.kind == "state" for g in cfg.cache_groups):
        return 0
    if mode == "off" or (mode == "auto" and device.type != "cuda") or (par.attention_dp and par.size > 1):
        return 0
    per = config.speculative.num_speculative_tokens + 1
    fit = config.kv_cache_bytes // 2 // (_state_slot_bytes(cfg) * per)
    return min(config.max_batch_size, fit) * per


def scheduler_fields(cfg: ModelConfig, config: EngineConfig, checkpoints: int = 0) -> dict[str, int | bool]:
    """The scheduler's settings of an engine config (its memory layout's among them), the device
    budget less `checkpoints` state slots (`checkpoint_slots`)."""
    slot = _state_slot_bytes(cfg)
    fields: dict[str, int | bool] = dict(
        block_size=config.block_size,
        device_bytes=config.kv_cache_bytes - checkpoints * slot,
        host_bytes=config.host_cache_bytes,
        max_batch_size=config.max_batch_size,
        max_tokens_per_step=config.max_tokens_per_step,
        prefix_cache=config.prefix_cache,
    )
    if config.chunk_size:
        fields["chunk_size"] = config.chunk_size
    if config.speculative is not None:
        fields["spec_tokens"] = config.speculative.num_speculative_tokens
    if any(g.kind == "state" for g in cfg.cache_groups):
        snaps = config.snapshot_slots
        fields["snapshot_slots"] = config.max_batch_size if snaps is None else snaps
    return fields


@dataclass(frozen=True)
class KvCapacity:
    """What an engine config's memory budgets hold of one rank's model: `pages` KV pages on the
    device (one block of `block_size` tokens of the widest cache group each) and `host_pages`
    in host memory, `page_bytes` each, after `state_bytes` of recurrent-state slots."""

    pages: int
    host_pages: int
    page_bytes: int
    state_bytes: int

    def budgets(self, config: EngineConfig, pages: int, host_pages: int) -> EngineConfig:
        """config with budgets of exactly `pages` device and `host_pages` host pages."""
        device = self.state_bytes + pages * self.page_bytes
        return replace(config, kv_cache_bytes=device, host_cache_bytes=host_pages * self.page_bytes)


def kv_capacity(cfg: ModelConfig, itemsize: int, config: EngineConfig) -> KvCapacity:
    """The KV pool the scheduler lays out for this model (cfg: this rank's shard) in config's
    budgets, by the scheduler's own rules (csrc/src/memory.cc); raises ValueError when the
    device budget holds too few pages."""
    try:
        layout = Scheduler(
            make_config(scheduler_groups(cfg, itemsize), **scheduler_fields(cfg, config))
        ).layout
    except SchedulerError as e:
        raise ValueError(str(e)) from None
    state = layout["num_slots"] * layout["state_slot_bytes"]
    return KvCapacity(layout["num_pages"], layout["num_host_pages"], layout["page_bytes"], state)


def agree_kv(own: EngineConfig, cfg: ModelConfig, itemsize: int, group) -> EngineConfig:
    """A tensor-parallel rank's engine config: rank 0's settings with the KV pool the smallest
    rank's memory holds, the same number of pages on every rank (`own`: this rank's budgets,
    found on this rank; cfg: its shard), so that every block rank 0's scheduler hands out exists
    on every rank. One broadcast (rank 0's config) and one all-reduce (min) on `group`."""
    mine = from_leader(own, group)
    mine = replace(mine, kv_cache_bytes=own.kv_cache_bytes, host_cache_bytes=own.host_cache_bytes)
    try:
        cap, why = kv_capacity(cfg, itemsize, mine), None
    except ValueError as e:  # said after the all-reduce: the other ranks must not wait for it
        cap, why = KvCapacity(0, 0, 0, 0), str(e)
    (pages, host_pages), rank = smallest((cap.pages, cap.host_pages), group)
    if pages < 2:
        raise ValueError(
            why
            or f"tensor-parallel rank {rank}'s KV memory holds {pages} pages of {mine.block_size} tokens; "
            "at least 2 are needed (that rank's error says why)"
        )
    if cfg.parallel.attention_dp:  # each rank's pool holds its own requests' KV alone
        log.info(
            "KV blocks: %d of %d tokens per rank, for that rank's own requests (data-parallel "
            "attention over %d ranks: %d blocks in all; rank %d's memory is the smallest; this "
            "rank's holds %d), host %d per rank",
            pages, mine.block_size, cfg.parallel.size, pages * cfg.parallel.size, rank, cap.pages,
            host_pages,
        )  # fmt: skip
    else:
        log.info(
            "KV blocks: %d of %d tokens on every rank (tensor-parallel rank %d's memory is the "
            "smallest; this rank's holds %d), host %d",
            pages, mine.block_size, rank, cap.pages, host_pages,
        )  # fmt: skip
    return cap.budgets(mine, pages, host_pages)
