# generated from spec.yaml@49ccdfb43573, do not edit
"""GLM-5.3-Flash: the execution-plane model, composed from the block library."""

from __future__ import annotations

import torch
from torch import nn

from dayzero.kernels.registry import OpTable
from dayzero.sdk.blocks import Embedding, LMHead, RMSNorm, Streams, residual
from dayzero.sdk.blocks.kda import KdaAttention
from dayzero.sdk.blocks.mla import MlaAttention
from dayzero.sdk.blocks.mlp import MoE, SwiGLU
from dayzero.sdk.engine.context import StepContext
from dayzero.sdk.spec.config import LayerCfg, ModelConfig

ATTENTION = {"kda": KdaAttention, "mla": MlaAttention}  # block kind -> module
MLP = {"swiglu": SwiGLU, "moe": MoE}


class Layer(nn.Module):
    """One decoder layer: N residual streams mixed by hyper-connections around attn, then the MLP."""

    def __init__(self, cfg: LayerCfg, ops: OpTable) -> None:
        super().__init__()
        self.attn_res = residual(cfg.attn_res, ops)
        self.attn = ATTENTION[cfg.attn_kind](cfg.attn, ops, cfg.caches)
        self.mlp_res = residual(cfg.mlp_res, ops)
        self.mlp = MLP[cfg.mlp_kind](cfg.mlp, ops)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        h, carry = self.attn_res.pre(x)  # x: [T, Dm], or [T, N, Dm] with N residual streams
        x = self.attn_res.post(x, self.attn(h, ctx), carry)
        h, carry = self.mlp_res.pre(x)
        return self.mlp_res.post(x, self.mlp(h), carry)


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: OpTable) -> None:
        super().__init__()
        self.embed = Embedding(cfg.embedding, ops)
        self.streams = Streams(cfg.streams)
        self.layers = nn.ModuleList(Layer(layer, ops) for layer in cfg.layers)
        self.norm = RMSNorm(cfg.final_norm, ops)
        self.head = LMHead(cfg.head, ops, self.embed)

    def forward(self, ctx: StepContext, capture: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = self.streams.open(self.embed(ctx.input_ids))  # [T, Dm] or [T, N, Dm]
        for layer in self.layers:
            x = layer(x, ctx)
            if capture is not None:
                capture.append(x)
        return self.head(self.norm(self.streams.close(x[ctx.sample_index])))  # [S, V] fp32
