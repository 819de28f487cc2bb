"""Norms, residual topologies, the token embedding and the LM head."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from dayzero.kernels.registry import OpTable


@dataclass(frozen=True)
class NormCfg:
    dim: int
    eps: float
    weight_in_fp32: bool


class RMSNorm(nn.Module):
    def __init__(self, cfg: NormCfg, ops: OpTable) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.weight = nn.Parameter(torch.empty(cfg.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.cfg.eps, self.cfg.weight_in_fp32)


@dataclass(frozen=True)
class ResidualCfg:
    """One residual add around f. kind prenorm: x + f(n(x)); sandwich: x + post(f(n(x))).
    add_index k > 0 (depth-scaled): x * sqrt((k - 1) / k) + y / sqrt(k)."""

    kind: str
    norm: NormCfg
    add_index: int = 0


class Residual(nn.Module):
    def __init__(self, cfg: ResidualCfg, ops: OpTable) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm = RMSNorm(cfg.norm, ops)
        self.post_norm = RMSNorm(cfg.norm, ops) if cfg.kind == "sandwich" else None
        k = cfg.add_index
        self.scales = (math.sqrt((k - 1) / k), 1 / math.sqrt(k)) if k else None

    def pre(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def post(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.post_norm is not None:
            y = self.post_norm(y)
        if self.scales is None:
            return x + y
        return y * self.scales[1] + x * self.scales[0]


@dataclass(frozen=True)
class EmbeddingCfg:
    vocab: int
    dim: int


class Embedding(nn.Module):
    def __init__(self, cfg: EmbeddingCfg, ops: OpTable) -> None:
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(cfg.vocab, cfg.dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.embedding(ids, self.weight)  # [T, Dm]


@dataclass(frozen=True)
class HeadCfg:
    vocab: int
    dim: int
    tie: bool
    softcap: float | None


class LMHead(nn.Module):
    """logits = h W^T (W = the embedding when tied), then cap * tanh(logits / cap); fp32 out."""

    def __init__(self, cfg: HeadCfg, ops: OpTable, embed: Embedding) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.tied = [embed] if cfg.tie else None  # a list: not a second registered parameter
        self.weight = None if cfg.tie else nn.Parameter(torch.empty(cfg.vocab, cfg.dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = self.tied[0].weight if self.tied else self.weight
        logits = self.ops.linear(h, w)  # [S, V]
        if self.cfg.softcap is not None:
            return self.ops.softcap(logits, self.cfg.softcap)
        return logits.float()
