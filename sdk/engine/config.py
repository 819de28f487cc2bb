"""The engine's settings: memory budgets, batch limits, CUDA graphs, overlap, speculative decoding."""

from __future__ import annotations

from dataclasses import dataclass

from dayzero.sdk.engine.drafters import SpeculativeConfig

GRAPH_MODES = ("auto", "off", "buffers")
OVERLAP_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    kv_cache_bytes: int = 256 << 20
    host_cache_bytes: int = 256 << 20
    block_size: int = 16
    max_batch_size: int = 64
    max_tokens_per_step: int = 2048
    chunk_size: int | None = None  # default: max_tokens_per_step
    prefix_cache: bool = True
    max_model_len: int | None = None  # default: the model's max_position
    # recurrent-state snapshots kept for prefix-cache hits (models with a State cache group);
    # default: one per batch slot
    snapshot_slots: int | None = None
    # decode steps from CUDA graphs (sdk/engine/graphs.py): auto = captured on CUDA when every
    # kernel of the model is graph-safe; off = eager (vLLM's --enforce-eager); buffers = the
    # graphs' static buffers run eagerly (any device: what the CPU tests check)
    decode_graphs: str = "auto"
    # plan step N+1 and launch it before reading step N's tokens back (the scheduler's overlap;
    # a decode row's input token is filled in on the device): auto = on CUDA (speculative: with
    # the MTP head's drafts, no recurrent state, one rank; sdk/engine/speculative.py)
    overlap: str = "auto"
    # speculative decoding (sdk/engine/speculative.py; vLLM's --speculative-config): drafted
    # tokens verified a step; None: off
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.decode_graphs not in GRAPH_MODES:
            raise ValueError(f"decode_graphs {self.decode_graphs!r}; known: {', '.join(GRAPH_MODES)}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap {self.overlap!r}; known: {', '.join(OVERLAP_MODES)}")


DEFAULTS = EngineConfig()
