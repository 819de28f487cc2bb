"""Norms, residual topologies, the token embedding and the LM head."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dayzero.kernels.selection import OpTable
from dayzero.sdk.config.model import EmbeddingCfg, HeadCfg, NormCfg, ResidualCfg, Slice


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, or * (1 + w) in fp32 when zero-centred (Gemma: the checkpoint stores
    w - 1, and (1 + w) is formed in fp32 before the product, never rounded to the model dtype)."""

    def __init__(self, cfg: NormCfg, ops: OpTable) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.weight = nn.Parameter(torch.empty(cfg.dim))

    def scale(self) -> torch.Tensor:
        """The weight the norm multiplies by: w, or 1 + w in fp32 (zero-centred)."""
        return zero_centred(self.weight) if self.cfg.zero_centred else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.scale(), self.cfg.eps, self.cfg.weight_in_fp32)


def zero_centred(w: torch.Tensor) -> torch.Tensor:
    """1 + w in fp32: a zero-centred norm weight as the ops multiply by it (with weight_in_fp32).

    Formed once per weight and kept on it: a step reads it without the two launches that form
    it. It is formed again, into the same buffer (a captured CUDA graph reads that address),
    whenever the weight was written since (its version counter counts every in-place write: the
    loader's, a parity test's) or moved. A constant to autograd: dayzero runs inference."""
    try:
        key = (w._version, w.data_ptr())
    except RuntimeError:  # an inference-mode tensor keeps no version: form it each time
        return w.float() + 1.0
    hit = getattr(w, "_dz_one_plus", None)  # (key, 1 + w)
    if hit is not None and hit[0] == key:
        return hit[1]
    # a plain tensor, outside any inference mode and autograd: usable (and refreshable) in both
    with torch.inference_mode(False), torch.no_grad():
        if hit is not None and hit[1].shape == w.shape and hit[1].device == w.device:
            out = hit[1].copy_(w).add_(1.0)
        else:
            out = w.float() + 1.0
    w._dz_one_plus = (key, out)
    return out


class Residual(nn.Module):
    """`h, carry = pre(x)` is the block's input; `post(x, f(h), carry)` the next residual state;
    `post_pre(x, y, carry, nxt)` is post, then the next residual's pre (one fused add + norm
    where both are plain residuals with the same norm)."""

    def __init__(self, cfg: ResidualCfg, ops: OpTable) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.norm = RMSNorm(cfg.norm, ops) if cfg.kind != "postnorm" else None  # [Dm] before f
        self.post_norm = RMSNorm(cfg.norm, ops) if cfg.kind in ("sandwich", "postnorm") else None
        k, m = cfg.add_index, cfg.branch_scale
        # x' = x a + y b: depth-scaled adds and the branch's scale
        self.scales = (math.sqrt((k - 1) / k), m / math.sqrt(k)) if k else ((1.0, m) if m != 1.0 else None)

    def pre(self, x: torch.Tensor, ctx=None) -> tuple[torch.Tensor, None]:
        return (x if self.norm is None else self.norm(x)), None

    def post(self, x: torch.Tensor, y: torch.Tensor, carry: None = None) -> torch.Tensor:
        if self.post_norm is not None:
            y = self.post_norm(y)
        if self.scales is None:
            return x + y
        return y * self.scales[1] + x * self.scales[0]

    def post_pre(self, x: torch.Tensor, y: torch.Tensor, carry: None, nxt: nn.Module, ctx=None):
        """(x', h, carry) = (post(x, y), *nxt.pre(x', ctx))."""
        if not isinstance(nxt, Residual) or nxt.norm is None or nxt.cfg.norm != self.cfg.norm:
            x = self.post(x, y, carry)
            return (x, *nxt.pre(x, ctx))
        n = self.cfg.norm
        post = None if self.post_norm is None else self.post_norm.scale()
        x, h = self.ops.add_rms_norm(x, y, nxt.norm.scale(), n.eps, n.weight_in_fp32, post, self.scales)
        return x, h, None


class HyperResidual(nn.Module):
    """Manifold-constrained hyper-connections: the residual is N streams X [T, N, D].

    z = rmsnorm(flatten(X)) W^T  (fp32, no weight)                    [T, (2 + N) N]
    pre  = sigmoid(a_pre z_pre + b_pre) + eps                         [T, N]
    post = 2 sigmoid(a_post z_post + b_post)                          [T, N]
    C = softmax_rows(a_comb z_comb + b_comb) + eps                    [T, N, N]
        then Sinkhorn: columns, then (rows, columns) x (iters - 1), each / (sum + eps)
    block input h = norm(sum_i pre_i X_i)                             [T, D]
    next X_j = post_j f(h) + sum_i C_ij X_i                           [T, N, D]
    The projection, the weights and h are one op (`hc_pre`), the next streams another (`hc_post`):
    kernels/reference/hyper.py states their rounding.
    """

    fp32_params = ("fn", "base", "scale")  # the projection runs in fp32 (the checkpoint's values widened)

    def __init__(self, cfg: ResidualCfg, ops: OpTable) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        hc, n, d = cfg.hyper, cfg.hyper.streams, cfg.norm.dim
        self.norm = RMSNorm(cfg.norm, ops)
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * d))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))
        self.hc = hc

    def pre(self, x: torch.Tensor, ctx=None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        hc = self.hc
        h, post, comb = self.ops.hc_pre(
            x, self.fn, self.base, self.scale, hc.sinkhorn_iters, hc.eps, hc.norm_eps
        )
        return self.norm(h), (post, comb)

    def post(
        self, x: torch.Tensor, y: torch.Tensor, carry: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        post, comb = carry
        return self.ops.hc_post(x, y, post, comb)

    def post_pre(self, x: torch.Tensor, y: torch.Tensor, carry, nxt: nn.Module, ctx=None):
        x = self.post(x, y, carry)
        return (x, *nxt.pre(x, ctx))


def spread(w: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """X'_j = w_j y + X_j: the block's output y [T, D] into each stream of x [T, N, D] by its
    weight w [T, N] (the hyper-connections' post weights)."""
    return w.to(x.dtype)[..., None] * y[:, None, :] + x


class LowRankHyperResidual(nn.Module):
    """Qwen4-Exp's hyper-connections: N streams X [T, N, D] and a low-rank dynamic mixer.

    Xn = rmsnorm_D(X) per stream (zero-centred: 1 + w, w [N D])           [T, N, D]
    m = sigmoid(W_up silu(W_down flatten(Xn) / N))      W_down [R, N D], W_up [N D, R] -> [T, N, D]
    block input h = mean_i m_i * Xn_i                                     [T, D]
    inject = 2 sigmoid(W_inj flatten(Xn) / N)           W_inj [N, N D]    [T, N]
    next X_j = X_j + inject_j f(h)
    With `ngram` (per-layer n-gram embeddings, sdk/blocks/ngram.py) X <- X + ngram(X) first.
    The collapse after the last layer (`combine` False) is the same mixer's h, with no final norm.

    Where it differs from GLM-5.3-Flash's `HyperResidual` (whose stream copy, `Streams.open`,
    and post add, `spread`, it shares): the mixing weights are per channel (m [N, D], a low-rank
    function of the normed streams) rather than one scalar per stream, the block input is formed
    from the normed streams and is not normed again, the post weights are 2 sigmoid(z / N) with
    no learned scale or bias, and the streams are not mixed with each other (C = I, no Sinkhorn);
    the final collapse is this mixer rather than the streams' mean and a norm.
    """

    linear_weights = ("down", "up", "inject")  # may be packed

    def __init__(self, cfg: ResidualCfg, ops: OpTable, combine: bool = True, ngram: nn.Module | None = None):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        n, d, r = cfg.hyper.streams, cfg.norm.dim, cfg.hyper.rank
        self.norm = nn.Parameter(torch.empty(n * d))
        self.down = nn.Parameter(torch.empty(r, n * d))
        self.up = nn.Parameter(torch.empty(n * d, r))
        self.inject = nn.Parameter(torch.empty(n, n * d)) if combine else None
        self.ngram = ngram

    def norm_streams(
        self, x: torch.Tensor, y: torch.Tensor | None = None, inject: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x' = x + inject_j y (y given: the previous block's output), flatten(Xn) [T, N D])."""
        n = self.cfg.norm
        return self.ops.hc_lowrank_norm(x, self.norm, n.eps, n.zero_centred, n.weight_in_fp32, y, inject)

    def mix(self, xn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """flatten(Xn) [T, N D] -> (h [T, D], inject [T, N]; None for the collapse)."""
        ops, n = self.ops, self.cfg.hyper.streams
        u = ops.linear(F.silu(ops.linear(xn, self.down) / n), self.up)  # [T, N D]
        return ops.hc_lowrank_mix(u, xn, None if self.inject is None else ops.linear(xn, self.inject), n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The collapse: x [T, N, D] -> h [T, D]."""
        return self.mix(self.norm_streams(x)[1])[0]

    def pre(self, x: torch.Tensor, ctx=None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if self.ngram is not None:
            x = self.ngram(x, ctx)  # [T, N, D]
        h, inject = self.mix(self.norm_streams(x)[1])
        return h, (x, inject)

    def post(
        self, x: torch.Tensor, y: torch.Tensor, carry: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x, inject = carry  # the streams pre saw (after the n-gram injection)
        return spread(inject, y, x)

    def post_pre(self, x: torch.Tensor, y: torch.Tensor, carry, nxt: nn.Module, ctx=None):
        """post, then nxt's pre; where nxt is a low-rank mixer with no n-gram injection, the spread
        and nxt's norm are one op."""
        if not isinstance(nxt, LowRankHyperResidual) or nxt.ngram is not None:
            x = self.post(x, y, carry)
            return (x, *nxt.pre(x, ctx))
        x, xn = nxt.norm_streams(carry[0], y, carry[1])
        h, inject = nxt.mix(xn)
        return x, h, (x, inject)


class AttnResidual(nn.Module):
    """Attention residuals (Kimi K3): the stream is x [T, S, D] = snapshots R_0 .. R_{S-2} and
    the partial sum p = x[:, -1] (a [T, D] x is p alone: S = 1). Every B layers the partial sum
    becomes a snapshot: R_0 the embedding, R_j the sum of the outputs of layers
    [(j - 1) B, j B). A block's input is a learned softmax mix of all of x, then the block's norm:
        mix(x; u)_t = sum_n a[t, n] x[t, n],   a[t] = softmax_n(<x[t, n], u> / rms(x[t, n]))
        u = w_rn * w_rp (its RMSNorm weight, which only enters the score, times its projection
        [1, D]); rms(v) = sqrt(mean(v^2) + eps); in fp32, the mix rounded to the model dtype
        h = norm(mix(x; u))
    post: p <- p + f(h); a residual that starts a block (`append`) first keeps p as a snapshot
    and starts p at 0 (x grows by one slot). The output mix (`forward`, the collapse) is the
    final norm of mix(x; u_out).
    The snapshots are activations of the tokens of this step, like the residual stream itself,
    never cached: a chunked prefill or a decode step recomputes them from its own tokens (each
    token's mix reads only its own row)."""

    def __init__(self, cfg: ResidualCfg, ops: OpTable) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.norm = RMSNorm(cfg.norm, ops)
        self.res_norm = nn.Parameter(torch.empty(cfg.norm.dim))
        self.res_proj = nn.Parameter(torch.empty(1, cfg.norm.dim))

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, S, D] -> [T, D]: the softmax mix of the S slots (above)."""
        c = x.float()
        u = self.res_norm.float() * self.res_proj[0].float()  # [D]
        score = (c @ u) * torch.rsqrt(c.square().mean(-1) + self.cfg.norm.eps)  # [T, S]
        return (torch.softmax(score, dim=-1)[..., None] * c).sum(1).to(x.dtype)

    def pre(self, x: torch.Tensor, ctx=None) -> tuple[torch.Tensor, None]:
        return self(x), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """norm(mix(x)): a block's input, or the output mix's (the final norm's)."""
        return self.norm(self.mix(x if x.dim() == 3 else x[:, None]))

    def post(self, x: torch.Tensor, y: torch.Tensor, carry: None = None) -> torch.Tensor:
        x = x if x.dim() == 3 else x[:, None]  # [T, S, D]
        if self.cfg.attn_res.append:  # p becomes a snapshot, the new p is f(h)
            return torch.cat((x, y[:, None]), dim=1)
        return torch.cat((x[:, :-1], (x[:, -1] + y)[:, None]), dim=1)  # out of place: x may be kept

    def post_pre(self, x: torch.Tensor, y: torch.Tensor, carry: None, nxt: nn.Module, ctx=None):
        x = self.post(x, y, carry)
        return (x, *nxt.pre(x, ctx))


def residual(cfg: ResidualCfg, ops: OpTable, ngram: nn.Module | None = None) -> nn.Module:
    if cfg.kind == "attn_res":
        if ngram is not None:
            raise ValueError("n-gram embeddings are injected into low-rank hyper-connection streams only")
        return AttnResidual(cfg, ops)
    if cfg.kind == "hyper" and cfg.hyper.mixer == "lowrank":
        return LowRankHyperResidual(cfg, ops, ngram=ngram)
    if ngram is not None:
        raise ValueError("n-gram embeddings are injected into low-rank hyper-connection streams only")
    return HyperResidual(cfg, ops) if cfg.kind == "hyper" else Residual(cfg, ops)


class Streams(nn.Module):
    """The residual stream(s) around the decoder stack: with N > 1 (hyper-connections) the
    embedding is copied into N streams [T, N, D] and they are averaged before the final norm."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def open(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.n == 1 else x[:, None, :].expand(-1, self.n, -1).contiguous()

    def close(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.n == 1 else x.mean(dim=1)


class Embedding(nn.Module):
    """x = W[ids] (* s: the scale, e.g. sqrt(Dm) for Gemma, rounded to the model dtype first as
    transformers rounds its fp32 `embed_scale`); vocab-parallel over P ranks: rank r holds rows
    [r V / P, (r + 1) V / P), looks up the ids in its range (the others give 0) and the ranks'
    rows are summed."""

    def __init__(self, cfg: EmbeddingCfg, ops: OpTable) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.rows = cfg.par.even(cfg.vocab, "the vocabulary")  # [V / P, Dm] on each rank
        self.start = cfg.par.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, cfg.dim))
        scale = None if cfg.scale is None else torch.tensor(cfg.scale, dtype=torch.float32)
        self.register_buffer("scale", scale, persistent=False)  # fp32; rounded to x's dtype when used

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self._lookup(ids)  # [T, Dm]
        return x if self.scale is None else x * self.scale.to(x.dtype)

    @staticmethod
    def shards(cfg: EmbeddingCfg) -> dict[str, dict[str, Slice]]:
        rows = cfg.vocab // cfg.par.size
        return {"weight": {"": Slice(-2, cfg.par.rank * rows, rows)}} if cfg.par.size > 1 else {}

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.par.size == 1:
            return self.ops.embedding(ids, self.weight)  # [T, Dm]
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        x = self.ops.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None]
        return self.ops.tp.all_reduce(x)


class LMHead(nn.Module):
    """logits = h W^T (W = the embedding when tied) times scale, then cap * tanh(logits / cap);
    fp32 out.
    Vocab-parallel: each rank's [S, V / P] logits for its rows, gathered to [S, V]."""

    linear_weights = ("weight",)  # may be packed (untied)

    def __init__(self, cfg: HeadCfg, ops: OpTable, embed: Embedding) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.tied = [embed] if cfg.tie else None  # a list: not a second registered parameter
        rows = cfg.par.even(cfg.vocab, "the vocabulary")
        self.weight = None if cfg.tie else nn.Parameter(torch.empty(rows, cfg.dim))

    @staticmethod
    def shards(cfg: HeadCfg) -> dict[str, dict[str, Slice]]:
        rows = cfg.vocab // cfg.par.size
        return (
            {"weight": {"": Slice(-2, cfg.par.rank * rows, rows)}} if cfg.par.size > 1 and not cfg.tie else {}
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = self.tied[0].weight if self.tied else self.weight
        logits = self.ops.tp.all_gather(self.ops.linear(h, w))  # [S, V]
        if self.cfg.scale != 1.0:
            logits = logits.float() * self.cfg.scale
        if self.cfg.softcap is not None:
            return self.ops.softcap(logits, self.cfg.softcap)
        return logits.float()
