"""The decoder stack every generated model is: embedding, residual stream(s), N layers
(attention, then MLP, each inside its residual), final norm, LM head.

A family's generated module only maps its spec's block kinds to modules (`ATTENTION`, `MLP`);
the per-layer choice, sizes and cache slots come from the resolved `ModelConfig`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.norm import Embedding, LMHead, RMSNorm, Streams, residual

if TYPE_CHECKING:
    from dayzero.sdk.config.model import LayerCfg, ModelConfig
    from dayzero.sdk.engine.context import StepContext


class Layer(nn.Module):
    """x <- post(x, attn(h), carry) with (h, carry) = pre(x), then the same around the MLP;
    pre/post are the spec's residual topology (prenorm, sandwich, depth-scaled, hyper)."""

    def __init__(self, cfg: LayerCfg, ops: OpTable, attention: dict[str, type], mlp: dict[str, type]) -> None:
        super().__init__()
        self.attn_res = residual(cfg.attn_res, ops)
        self.attn = attention[cfg.attn_kind](cfg.attn, ops, cfg.caches)
        self.mlp_res = residual(cfg.mlp_res, ops)
        self.mlp = mlp[cfg.mlp_kind](cfg.mlp, ops)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        h, carry = self.attn_res.pre(x)  # x: [T, Dm], or [T, N, Dm] with N residual streams
        x = self.attn_res.post(x, self.attn(h, ctx), carry)
        h, carry = self.mlp_res.pre(x)
        return self.mlp_res.post(x, self.mlp(h), carry)


class Decoder(nn.Module):
    ATTENTION: ClassVar[dict[str, type]] = {}  # block kind -> module, set by the generated model
    MLP: ClassVar[dict[str, type]] = {}

    def __init__(self, cfg: ModelConfig, ops: OpTable) -> None:
        super().__init__()
        self.embed = Embedding(cfg.embedding, ops)
        self.streams = Streams(cfg.streams)
        self.layers = nn.ModuleList(Layer(layer, ops, self.ATTENTION, self.MLP) for layer in cfg.layers)
        self.norm = RMSNorm(cfg.final_norm, ops)
        self.head = LMHead(cfg.head, ops, self.embed)

    def forward(self, ctx: StepContext) -> torch.Tensor:
        x = self.streams.open(self.embed(ctx.input_ids))  # [T, Dm] or [T, N, Dm]
        for layer in self.layers:
            x = layer(x, ctx)
        return self.head(self.norm(self.streams.close(x[ctx.sample_index])))  # [S, V] fp32
