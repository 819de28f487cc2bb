"""The benches' roofline: the device's copy bandwidth and the bytes a decode step must read.
A decode step's roofline rate is the copy bandwidth (bytes read + written a second) over those
bytes: every weight but the embedding table, the experts the batch's tokens use, each request's
cache rows and recurrent state."""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from dayzero.kernels.packed import PackedWeight
from dayzero.sdk.blocks.mlp import MoE


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Device-to-device copy of nbytes (default 2 GiB on a GPU, 256 MiB on the host, past any
    cache), bytes read + written per second (median of 20 after 5 warm-ups)."""
    n = nbytes or (256 << 20 if device.type == "cpu" else 2 << 30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst, times = torch.empty_like(src), []
    for i in range(25):
        if device.type == "cpu":  # memory-to-memory, timed on the host
            t0 = time.perf_counter()
            dst.copy_(src)
            dt = time.perf_counter() - t0
        else:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            torch.cuda.synchronize()
            dt = a.elapsed_time(b) / 1e3
        if i >= 5:
            times.append(dt)
    return 2 * n / float(np.median(times))


def bytes_per_step(
    cfg, model: torch.nn.Module, prompt_len: int, batch: int = 1
) -> tuple[float, float, float]:
    """(bytes a decode step at `batch` must read, total params, active params per token).
    Every weight but the embedding table at its stored size (packed weights: codes and scales),
    each expert the batch's tokens use once (expected distinct experts of `batch` tokens picking
    k of E at random: E (1 - (1 - k/E)^batch)), and each request's cache: paged rows over
    min(prompt, window) positions and recurrent state read and written, in bf16."""
    packed = [m for m in model.modules() if isinstance(m, PackedWeight)]
    total = sum(p.numel() for p in model.parameters()) + sum(math.prod(w.shape) for w in packed)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(w.nbytes() for w in packed)
    embed = model.embed.weight
    weights, active = nbytes - embed.numel() * embed.element_size(), total - embed.numel()
    for m in model.modules():
        if isinstance(m, MoE):
            e, k = m.cfg.experts, m.cfg.top_k
            expert = (math.prod(m.gate_up.shape) + math.prod(m.down.shape)) // e
            expert_bytes = sum(_bytes(w) for w in (m.gate_up, m.down)) / e
            active -= (e - k) * expert
            weights -= (e - e * (1 - (1 - k / e) ** batch)) * expert_bytes
    cache = 0
    for g in cfg.cache_groups:
        if g.kind == "state":
            cache += 2 * g.row
        else:
            cache += g.row * 2 * (min(prompt_len, g.window) if g.window else prompt_len)
    return weights + batch * cache, total, active


def _bytes(w: torch.Tensor | PackedWeight) -> int:
    return w.nbytes() if isinstance(w, PackedWeight) else w.numel() * w.element_size()
