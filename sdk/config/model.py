"""The normalised model configuration: frozen dataclasses built once from spec + HF config.

Nothing below this boundary reads the HF config; a layer receives only its own `LayerCfg`
(its blocks' frozen configs come from each block's `resolve`, in sdk/blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Parallel:
    """This process's place in tensor parallelism: `size` ranks, this one `rank`; `experts`:
    whole experts placed on ranks (expert parallel) rather than every expert split;
    `attention_dp`: data-parallel attention (SGLang's --enable-dp-attention): the attention
    blocks are whole on every rank, each attending for its own requests (sdk/engine/dp.py);
    MLPs, embedding and LM head are split as above over the whole batch's tokens."""

    size: int = 1
    rank: int = 0
    experts: bool = False
    attention_dp: bool = False

    def even(self, n: int, what: str) -> int:
        """n / size, refused by name when it does not divide."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) does not split over tensor-parallel size {self.size}")
        return n // self.size


ONE_RANK = Parallel()  # no tensor parallelism


@dataclass(frozen=True)
class Slice:
    """The part of a checkpoint tensor one rank holds: `length` indices from `start` along `dim`,
    counted from the end (-1 columns, -2 rows, -3 the expert index of a stacked tensor), so a
    slice means the same for one expert's tensor and for all experts stacked."""

    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class NormCfg:
    dim: int
    eps: float
    weight_in_fp32: bool
    zero_centred: bool = False  # the weight is applied as (1 + w) in fp32 (Gemma)


@dataclass(frozen=True)
class HyperCfg:
    streams: int  # N
    sinkhorn_iters: int
    eps: float  # floor on pre / comb weights and on Sinkhorn sums
    norm_eps: float  # the unweighted RMS norm over the flattened streams
    # "sinkhorn": manifold-constrained (GLM-5.3-Flash); "lowrank": Qwen4-Exp's low-rank dynamic
    # mixer with per-stream injection weights and no stream mixing (sdk/blocks/norm.py)
    mixer: Literal["sinkhorn", "lowrank"] = "sinkhorn"
    rank: int = 0  # lowrank: R of the mixer's down / up projections


@dataclass(frozen=True)
class AttnResCfg:
    block: int  # B: layers a block of attention residuals spans
    append: bool  # this residual starts a block: the partial sum becomes a snapshot first


@dataclass(frozen=True)
class ResidualCfg:
    """One residual add around f. kind prenorm: x + f(n(x)); sandwich: x + post(f(n(x)));
    postnorm: x + post(f(x));
    hyper: see HyperResidual; attn_res: see AttnResidual. add_index k > 0 (depth-scaled):
    x * sqrt((k - 1) / k) + y / sqrt(k). branch_scale m: y is m f (m 1: none)."""

    kind: str
    norm: NormCfg
    add_index: int = 0
    hyper: HyperCfg | None = None
    branch_scale: float = 1.0
    attn_res: AttnResCfg | None = None


@dataclass(frozen=True)
class EmbeddingCfg:
    vocab: int
    dim: int
    par: Parallel = ONE_RANK  # vocab-parallel over par.size ranks: rows [rank V / size, ...)
    scale: float | None = None  # x = W[ids] * scale (Gemma: sqrt(dim))


@dataclass(frozen=True)
class HeadCfg:
    vocab: int
    dim: int
    tie: bool
    softcap: float | None
    par: Parallel = ONE_RANK  # vocab-parallel: each rank's logits for its rows, then gathered
    scale: float = 1.0  # logits times this before the softcap


@dataclass(frozen=True)
class LayerCfg:
    index: int
    attn_kind: str  # block kind (registry key)
    attn: Any  # that kind's frozen config
    mlp_kind: str
    mlp: Any
    attn_res: ResidualCfg
    mlp_res: ResidualCfg
    caches: tuple[tuple[int, int], ...]  # per cache part of the attention block: (group, offset)
    # offset: elements into the group's per-token row (paged), bytes into the request's slot (state)
    ngram: Any = None  # n-gram embeddings injected before this layer (sdk/blocks/ngram.py NgramCfg)
    ngram_caches: tuple[tuple[int, int], ...] = ()  # their state parts: (group, byte offset)


@dataclass(frozen=True)
class CacheGroupCfg:
    """One scheduler cache group: `row` elements per token summed over its `layers` (paged,
    sliding), or `row` bytes per request (state)."""

    name: str
    kind: Literal["paged", "sliding", "state"]
    window: int | None
    row: int
    layers: tuple[int, ...]


@dataclass(frozen=True)
class MtpCfg:
    """The NextN multi-token-prediction layer (DeepSeek / GLM / Kimi form), decoder layer L (the
    main stack's count) built by the spec's layer rules, with a pre-norm residual:
        x_0 = W_eh [rmsnorm_e(emb(t_{i+1})) ; rmsnorm_h(z_i)]      z_i: the target's final hidden
        y = layer(x_0) at position i         (its own KV, in the main groups' rows)
        logits = head(rmsnorm_s(y))          (the main LM head and embedding, shared)
    A chained draft feeds y back as z (nextn), or rmsnorm_s(y) (qwen_mtp: Qwen3.5's mtp.*, whose
    output is normed before the head and the next step).
    With N > 1 residual streams (Sinkhorn hyper-connections, DeepSeek-V4's MTP form) z is the
    target's streams Z [T, N, Dm] before their collapse and the layer keeps the stack's residual:
        X_0[:, n] = W_eh [rmsnorm_e(emb(t_{i+1})) ; rmsnorm_h(Z[:, n])]    each stream n
        Y = layer(X_0)                       (its hyper-connections)         [T, N, Dm]
        logits = head(rmsnorm_s(mean_n Y[:, n]))                            (the model's collapse)
    and a chained draft feeds Y back."""

    layer: LayerCfg
    norm: NormCfg  # enorm, hnorm and the shared head's norm: the model's width and eps
    feed_normed: bool = False
    streams: int = 1  # N: the residual streams the head reads and gives back


@dataclass(frozen=True)
class ModelConfig:
    family: str
    spec_hash: str
    embedding: EmbeddingCfg
    layers: tuple[LayerCfg, ...]
    final_norm: NormCfg
    streams: int  # residual streams (hyper-connections); 1 = one plain residual stream
    head: HeadCfg
    cache_groups: tuple[CacheGroupCfg, ...]
    max_position: int | None
    eos_token_ids: tuple[int, ...]
    symbols: tuple[tuple[str, Any], ...]  # every resolved symbol (for inspection and debugging)
    parallel: Parallel = ONE_RANK  # the blocks' configs are this rank's shards
    # what replaces the final norm: the streams' low-rank collapse (hyper-connections, mixer
    # lowrank), or the attention residuals' output mix and the final norm (attn_res)
    collapse: ResidualCfg | None = None
    mtp: MtpCfg | None = None  # built when speculative decoding drafts with it (method mtp)
