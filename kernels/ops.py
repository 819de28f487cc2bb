"""The portable op API: every op a block may call, and the features a block may ask of it.

Shapes: T tokens in the step (all rows, flattened), R rows (requests), H query heads, Hk KV
heads, D head size, E experts, V vocabulary. A paged cache view of one layer is [N, Hk, D],
indexed by slot = block * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dayzero.kernels.registry import declare_op


@dataclass(frozen=True)
class PagedMeta:
    """Where one step's rows live in one paged cache group.

    query_start [R + 1], kv_lens [R] (KV length after this step), positions [T],
    block_table [R, W] (group-local block ids, -1 where a sliding window freed a block),
    slots [T] (cache slot each new token is written to), block_size.
    Host copies (`*_cpu`) let the reference backend loop over rows without syncing.
    `memo` holds what a kernel derives from this metadata once per step (index and mask tensors
    every layer of the group shares). `scratch`: a slot of the group that no request owns (the
    pool's scratch page), where a graph-safe op sends the writes a token does not make; -1: none.
    """

    query_start: torch.Tensor
    kv_lens: torch.Tensor
    positions: torch.Tensor
    block_table: torch.Tensor
    slots: torch.Tensor
    block_size: int
    query_start_cpu: tuple[int, ...]
    kv_lens_cpu: tuple[int, ...]
    memo: dict = field(default_factory=dict, compare=False, repr=False)
    scratch: int = -1


def qsa_row(di: int, pool: int) -> int:
    """Channels of a QSA pooled key that each position of its block holds: r = ceil(Di / P).
    Block m's key K_m [Di] lies in the pooled cache's rows of positions m P + i, channels
    [i r, (i + 1) r) in row i (zeros past Di): a paged group of r elements a token holds one
    key per P positions, as a group with a token stride of P would."""
    return -(-di // pool)


@dataclass(frozen=True)
class HeadPrep:
    """norm_rope's parameters for a layer's queries and keys (qk_norm_rope_write): q / k RMSNorm
    weights (None: no norm), RoPE inverse frequencies [R/2] (None: no rotation), the queries'
    log-position scaling (base, exponent)."""

    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float
    weight_in_fp32: bool
    inv_freq: torch.Tensor | None
    neox: bool
    log_scaling: tuple[float, float] | None
    rope_factor: float


@dataclass(frozen=True)
class Penalties:
    """What rewrites a step's logits [S, V] before sampling (S rows index the batch, P of them
    with presence / frequency / repetition penalties): vLLM's penalties over dense per-row
    tensors gathered from the requests' device state (sdk/engine/sampling.py `TokenCounts`,
    updated on the device from each step's sampled tokens; no per-step copy of token lists):
    presence / frequency over the output-token counts, repetition over the tokens seen in the
    prompt or the output; plus additive logit biases and the tokens a row may not produce yet
    (its stop tokens under min_tokens), short index lists whose length does not grow."""

    presence: torch.Tensor  # [S] fp32, 0: off
    frequency: torch.Tensor  # [S] fp32, 0: off
    repetition: torch.Tensor  # [S] fp32, 1: off
    rows: torch.Tensor  # [P] int64: the batch rows counts / prompt describe (distinct)
    counts: torch.Tensor  # [P, V] int32: how often each token is in the row's output so far
    prompt: torch.Tensor  # [P, V] bool: the token is in the row's prompt
    bias_rows: torch.Tensor  # [B] int64, bias_toks [B] int64, bias_vals [B] fp32
    bias_toks: torch.Tensor
    bias_vals: torch.Tensor
    ban_rows: torch.Tensor  # [K] int64
    ban_toks: torch.Tensor


@dataclass(frozen=True)
class SamplingBatch:
    """One step's per-row sampling parameters [S] on the logits' device, and what the host knows
    of them: a kernel decides its work from the host fields, never by reading the device back.

    temperature 0: greedy; top_k <= 0, top_p 1, min_p 0: off. generators[s]: the row's seeded
    generator (None: the default one)."""

    temperature: torch.Tensor  # [S] fp32
    top_k: torch.Tensor  # [S] int64
    top_p: torch.Tensor  # [S] fp32
    min_p: torch.Tensor  # [S] fp32
    generators: tuple[torch.Generator | None, ...]
    sampled_rows: tuple[int, ...]  # rows with temperature > 0
    top_k_on: bool = False
    top_p_on: bool = False
    min_p_on: bool = False
    penalties: Penalties | None = None  # None: the logits are sampled as they are
    # structured output: [S, ceil(V / 32)] int32, bit v % 32 of word v // 32 set where token v is
    # allowed (every bit set for an unconstrained row); None: no row is constrained
    allowed: torch.Tensor | None = None


declare_op("embedding", "ids [T] -> weight[ids] [T, Dm]")
declare_op(
    "linear",
    "x [.., K] @ w[N, K]^T (+ b) -> [.., N] in w's dtype, x read in it (fp32 routers: fp32 logits)",
    features={"bias"},
    packed="linear_packed",
)
PACKED_FORMATS = ("nvfp4", "mxfp4", "fp8_block")  # kernels/packed.py
declare_op(
    "linear_packed",
    "linear with w a PackedWeight [N, K]; features: the formats, and nvfp4 activation quantization",
    features={"bias", "act_quant", *PACKED_FORMATS},
)
declare_op("layer_norm", "(x - mean) / sqrt(var + eps) * w + b over the last dim")
declare_op("rms_norm", "x / rms(x) * w over the last dim, in fp32", features={"weight_in_fp32"})
OUTPUT_GATES = ("silu", "sigmoid")  # rms_norm_gated's act
declare_op(
    "rms_norm_gated",
    "rms_norm(x, w) * act(z) over [T, H, D], act silu or sigmoid, the product in fp32 (a linear attention's "
    "output gate)",
)
declare_op(
    "add_rms_norm",
    "x' = x + y (y <- rms_norm(y) first: sandwich; scaled: depth-scaled) -> (x', rms_norm(x'))",
    features={"weight_in_fp32", "post_norm", "scaled"},
)
declare_op("sigmoid_gate", "o * sigmoid(gate (+ bias[h])) over [T, H, D]", features={"bias"})
declare_op(
    "hc_pre",
    "manifold-constrained hyper-connections' weights from the streams x [T, N, D] and their projection "
    "fn -> (block input sum_i pre_i x_i [T, D], post [T, N], Sinkhorn comb [T, N, N])",
)
declare_op("hc_post", "the streams after a block: x'_j = post_j y + sum_i comb_ij x_i -> [T, N, D]")
declare_op(
    "hc_lowrank_norm",
    "low-rank hyper-connections: x' = x + inject_j y (when y is given), then each stream of x' [T, N, D] "
    "RMSNormed by its own weight (1 + w: zero-centred) -> (x', Xn [T, N D])",
)
declare_op(
    "hc_lowrank_mix",
    "low-rank hyper-connections' block input mean_i sigmoid(u_i) Xn_i [T, D] and inject weights "
    "2 sigmoid(i / N) [T, N]",
)
declare_op(
    "rope", "rotate the first rotary_dim channels of [T, H, D] by position", features={"partial", "neox"}
)
declare_op("kv_write", "write new keys/values [T, Hk, D] into their cache slots")
declare_op(
    "qk_norm_rope_write",
    "norm_rope of q [T, H, D] and k [T, Hk, D], then k and v into their cache slots -> q",
    features={"norm", "weight_in_fp32", "rope", "partial", "neox", "log_scaling"},
)
declare_op(
    "gqa_attention",
    "causal attention of q [T, H, D] over the paged K/V of each row -> [T, H, D]; sinks: a learned "
    "logit per head [H] joins each softmax's denominator; select: only the key positions of a "
    "sparse indexer's selection [T, K] (-1 padded)",
    features={"causal", "sliding_window", "softcap", "sinks", "select"},
)
declare_op("cache_write", "write rows [T, W] into their cache slots of a [N, W] cache view")
declare_op(
    "mla_attention",
    "latent attention: q (nope [T, H, Dn], rope [T, H, Dr]) over the paged latent + rope key -> [T, H, Dv]",
    features={"causal", "select"},
)
declare_op(
    "dsa_index",
    "lightning indexer: per-token scores over the row's cached index keys -> top-k positions [T, K]",
)
declare_op(
    "kpool_index",
    "pooled indexer: scores over pooled groups of cached keys -> top groups (+ tail) positions [T, K]",
    features={"tail"},
)
# the indexers' two halves, for heads split over tensor-parallel ranks: partial scores, summed
# over the ranks (all-reduce), then the same top-k on every rank
declare_op("dsa_scores", "lightning indexer scores [T, L] fp32 by key position (-inf: not visible)")
declare_op("kpool_scores", "pooled indexer scores [T, M] fp32 by pool of keys (-inf: not visible)")
declare_op(
    "qsa_pool",
    "QSA: each block of P raw index keys [N, Di] this step completes -> its pooled, normed, roped key, "
    "written across the block's first rows of the pooled cache [N', ceil(Di / P)]",
)
declare_op("qsa_scores", "QSA indexer scores [T, M] fp32 by block over the pooled keys (-inf: not visible)")
declare_op(
    "index_topk",
    "indexer scores [T, M] over groups of P keys -> the top groups' positions (+ tail) [T, K]",
    features={"tail"},
)
declare_op("short_conv", "causal depthwise conv over each row, continuing its state; silu", features={"silu"})
declare_op(
    "ngram_ids",
    "hashed n-gram ids [T, (n - 1) Hg] of each token from its row's token history (kept in the state slot)",
)
declare_op("dilated_conv", "causal depthwise conv with dilation over each row, continuing its state; silu")
declare_op(
    "kda_recurrence",
    "Kimi delta attention over each row, continuing its fp32 state -> [T, H, Dv]",
    features={"chunked"},
)
declare_op(
    "kda_gates",
    "KDA's gates from f [T, H D] and b [T, H]: (g = lb sigmoid(exp(A_log) (f + dt_bias)), or "
    "-exp(A_log) softplus(f + dt_bias) with no bound lb, fp32 [T, H, D]; beta = sigmoid(b))",
)
declare_op(
    "gdn_gates",
    "Gated DeltaNet's gates from b, a [T, HV]: (g = -exp(A_log) softplus(a + dt_bias) fp32, "
    "beta = sigmoid(b))",
)
declare_op(
    "gated_delta_rule",
    "Gated DeltaNet (a log decay per head and token) over each row, continuing its fp32 state -> [T, HV, Dv]",
    features={"chunked"},
)
# the gated activations past silu: kernels/reference/basic.py ACTIVATIONS (silu needs no feature)
GATED_ACTS = ("gelu_pytorch_tanh", "clamped_swiglu", "situ")
# an activation's constants (c0, c1), the ops' `consts`: clamped_swiglu (alpha, unused), situ (beta,
# the linear beta or 0 for none); silu and gelu read none
DEFAULT_CONSTS = (1.702, 0.0)
ACTIVATIONS = ("silu", *GATED_ACTS)
declare_op("swiglu", "act(gate) * up, optionally in fp32", features={"fp32", "limit", *GATED_ACTS})
declare_op(
    "moe_route",
    "router logits [T, E] -> (weights [T, k], expert ids [T, k])",
    features={"sigmoid", "softmax", "correction_bias", "grouped", "renormalize"},
)
# an expert id of -1 is no expert: the (token, slot) pair adds nothing and no expert's weights
# are read for it (an expert-parallel rank's picks of the other ranks' experts); a kernel that
# honours it states the feature "skip", which a block asks for when its ids may hold -1
declare_op(
    "moe_experts",
    "sum_k w_k * expert_{id_k}(x) over stacked SwiGLU experts -> [T, Dm], id -1 skipped (skip); "
    "bias: gate_up / down biases [E, N]",
    features={"fp32", "limit", "bias", "skip", *GATED_ACTS},
    packed="moe_experts_packed",
)
declare_op(
    "moe_experts_packed",
    "moe_experts with gate_up / down PackedWeights [E, N, K]",
    features={"fp32", "limit", "act_quant", "skip", *GATED_ACTS, *PACKED_FORMATS},
)
declare_op("softcap", "cap * tanh(x / cap), in fp32")
declare_op(
    "sample",
    "logits [S, V], SamplingBatch -> (token ids [S], chosen-token logprobs [S])",
    features={"greedy", "temperature", "top_k", "top_p", "min_p", "seed", "penalties", "grammar"},
)
