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
from dayzero.sdk.blocks.ngram import NgramInjection
from dayzero.sdk.blocks.norm import (
    AttnResidual,
    Embedding,
    LMHead,
    LowRankHyperResidual,
    RMSNorm,
    Streams,
    residual,
)

if TYPE_CHECKING:
    from dayzero.sdk.config.model import LayerCfg, ModelConfig, MtpCfg
    from dayzero.sdk.engine.context import StepContext


class Layer(nn.Module):
    """x <- post(x, attn(h), carry) with (h, carry) = pre(x), then the same around the MLP;
    pre/post are the spec's residual topology (prenorm, sandwich, postnorm, depth-scaled, hyper,
    attention residuals). A layer
    takes its first block's input already normed (h, carry) and hands the next layer's on: each
    residual's post and the next one's pre run as one fused add + norm. With data-parallel
    attention the layer attends for this rank's rows; the MLP gets every rank's rows gathered
    (all-gather) and hands back this rank's rows of its sum over ranks (reduce-scatter)."""

    def __init__(self, cfg: LayerCfg, ops: OpTable, attention: dict[str, type], mlp: dict[str, type]) -> None:
        super().__init__()
        # per-layer n-gram embeddings enter the streams before the attention's hyper-connection
        ngram = (
            None
            if cfg.ngram is None
            else NgramInjection(cfg.ngram, ops, tuple(o for _, o in cfg.ngram_caches))
        )
        self.attn_res = residual(cfg.attn_res, ops, ngram)
        self.attn = attention[cfg.attn_kind](cfg.attn, ops, cfg.caches)
        self.mlp_res = residual(cfg.mlp_res, ops)
        self.mlp = mlp[cfg.mlp_kind](cfg.mlp, ops)
        self.tp = ops.tp

    def forward(self, x: torch.Tensor, h: torch.Tensor, carry, ctx: StepContext, nxt: nn.Module | None):
        """x: [T, Dm], or [T, N, Dm] with N residual streams; h [T, Dm] = attn_res.pre(x);
        nxt: the next layer's attention residual (None: last layer) -> (x', h', carry')."""
        if ctx.dp is None:
            x, h, carry = self.attn_res.post_pre(x, self.attn(h, ctx), carry, self.mlp_res, ctx)
            y = self.mlp(h)
        else:  # data-parallel attention: the MLP (split over the ranks) sees every rank's tokens
            a = self.attn(h, ctx) if h.shape[0] else torch.zeros_like(h)  # a rank with no rows now
            x, h, carry = self.attn_res.post_pre(x, a, carry, self.mlp_res, ctx)
            d = ctx.dp
            y = self.mlp(self.tp.gather_rows(h, d.tokens), d.tokens)  # [T_r, Dm]
        if nxt is None:
            return self.mlp_res.post(x, y, carry), None, None
        return self.mlp_res.post_pre(x, y, carry, nxt, ctx)


class Decoder(nn.Module):
    ATTENTION: ClassVar[dict[str, type]] = {}  # block kind -> module, set by the generated model
    MLP: ClassVar[dict[str, type]] = {}

    def __init__(self, cfg: ModelConfig, ops: OpTable) -> None:
        super().__init__()
        self.embed = Embedding(cfg.embedding, ops)
        self.streams = Streams(cfg.streams)
        self.layers = nn.ModuleList(Layer(layer, ops, self.ATTENTION, self.MLP) for layer in cfg.layers)
        # the streams' low-rank collapse replaces their mean and the final norm; the attention
        # residuals' output mix comes with the final norm (its `norm`)
        self.collapse = _collapse(cfg.collapse, ops)
        self.norm = RMSNorm(cfg.final_norm, ops) if cfg.collapse is None else None
        self.head = LMHead(cfg.head, ops, self.embed)
        self.tp, self.attention_dp = ops.tp, cfg.parallel.attention_dp and cfg.parallel.size > 1
        self.mtp = None if cfg.mtp is None else NextN(cfg.mtp, ops, self.ATTENTION, self.MLP)

    def forward(self, ctx: StepContext, hidden: bool = False):
        """[S, V] fp32 logits of the sampling rows; with data-parallel attention (ctx.dp) those
        of every rank's sampling rows, rank by rank (the same on every rank). hidden: (logits,
        what the MTP head drafts from: the final normed hidden z of every token [T, Dm], or with
        hyper-connections the streams before their collapse [T, N, Dm])."""
        d = ctx.dp
        if d is None and self.attention_dp:
            raise RuntimeError("a data-parallel-attention model runs on steps split over its ranks (ctx.dp)")
        if d is None:
            x = self.embed(ctx.input_ids)  # [T, Dm]
        else:  # the vocab-parallel lookup of every rank's tokens, then this rank's rows
            x = self.embed(d.input_ids)[d.start : d.start + ctx.input_ids.shape[0]]
        x = self.streams.open(x)  # [T, Dm] or [T, N, Dm]
        h, carry = self.layers[0].attn_res.pre(x, ctx)
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].attn_res if i + 1 < len(self.layers) else None
            x, h, carry = layer(x, h, carry, ctx, nxt)
        if hidden:
            if d is not None:
                raise RuntimeError("the hidden states of data-parallel attention's rows are not gathered")
            if self.mtp is not None and self.mtp.streams.n > 1:  # the head reads the streams
                z = self.norm(self.streams.close(x[ctx.sample_index]))  # [S, Dm]
                return self.head(z), x
            z = self.norm(self.streams.close(x)) if self.collapse is None else self.collapse(x)  # [T, Dm]
            return self.head(z[ctx.sample_index]), z
        x = x[ctx.sample_index]  # [S, Dm] or [S, N, Dm]
        z = self.norm(self.streams.close(x)) if self.collapse is None else self.collapse(x)  # [S, Dm]
        if d is not None:
            z = self.tp.gather_rows(z, d.sampled)  # every rank's sampling rows
        return self.head(z)  # [S, V] fp32


class NextN(nn.Module):
    """The multi-token-prediction layer (sdk/config/model.py MtpCfg; nextn and qwen_mtp):
        x_0 = W_eh [rmsnorm_e(emb(t_{i+1})) ; rmsnorm_h(z_i)]      W_eh [Dm, 2 Dm]
        y = layer(x_0)        (the family's blocks at layer index L, pre-norm; its own KV slice)
        logits = head(rmsnorm_s(y))
    at the positions i of the hidden states z it is given; the embedding and the head are the
    main model's (passed in, not held: one copy of each). A chained draft's next z: y, or
    rmsnorm_s(y) (feed_normed). With N residual streams z and y are [T, N, Dm]: x_0 is formed
    for each stream (the embedding's half shared), the layer runs its hyper-connections, and
    the head reads rmsnorm_s of the streams' mean (the model's collapse)."""

    linear_weights = ("eh_proj",)  # read through ops.linear: a quantized checkpoint may pack it

    def __init__(self, cfg: MtpCfg, ops: OpTable, attention: dict[str, type], mlp: dict[str, type]) -> None:
        super().__init__()
        d = cfg.norm.dim
        self.enorm, self.hnorm, self.norm = (
            RMSNorm(cfg.norm, ops),
            RMSNorm(cfg.norm, ops),
            RMSNorm(cfg.norm, ops),
        )
        self.eh_proj = nn.Parameter(torch.empty(d, 2 * d))
        self.layer = Layer(cfg.layer, ops, attention, mlp)
        self.streams = Streams(cfg.streams)
        self.ops, self.feed_normed = ops, cfg.feed_normed

    def forward(
        self, ids: torch.Tensor, z: torch.Tensor, ctx: StepContext, embed: nn.Module, head: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] (each position's next token), z [T, Dm] or [T, N, Dm] -> (logits [S, V] fp32
        of the sampling rows, what a chained draft feeds back as z, z's shape)."""
        e = self.enorm(embed(ids))  # [T, Dm]
        if z.dim() == 3:  # each stream: [e ; rmsnorm_h(Z_n)]            [T * N, 2 Dm]
            t, n, d = z.shape
            e = e[:, None, :].expand(t, n, d).reshape(t * n, d)
            x = self.ops.linear(torch.cat((e, self.hnorm(z.reshape(t * n, d))), dim=-1), self.eh_proj)
            x = x.view(t, n, d)
        else:
            x = self.ops.linear(torch.cat((e, self.hnorm(z)), dim=-1), self.eh_proj)
        h, carry = self.layer.attn_res.pre(x, ctx)
        y, _, _ = self.layer(x, h, carry, ctx, None)
        if self.feed_normed:
            y = self.norm(y)
            return head(y[ctx.sample_index]), y
        return head(self.norm(self.streams.close(y[ctx.sample_index]))), y


def _collapse(cfg, ops: OpTable) -> nn.Module | None:
    if cfg is None:
        return None
    if cfg.kind == "attn_res":
        return AttnResidual(cfg, ops)
    return LowRankHyperResidual(cfg, ops, combine=False)
