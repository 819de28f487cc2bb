"""Per-layer n-gram embeddings (Qwen4-Exp's PLE): hashed n-grams of each request's own token
history, looked up in a per-layer table and injected into every hyper-connection stream."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.base import CacheDecl, StaticCache
from dayzero.sdk.blocks.norm import zero_centred
from dayzero.sdk.config.model import ONE_RANK, Parallel, Slice
from dayzero.sdk.config.options import IntV, Ref, Strict

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_LAYER_PRIME = 10007


class NgramOpts(Strict):
    """The spec's `embedding.ngram`: which layers inject n-gram embeddings and their hashing."""

    layers: Ref | list[int]  # the layers that inject, numbered from `counted_from`
    counted_from: Literal[0, 1] = 0  # 1: the list counts layers from one (Qwen4-Exp's ple_layer_ids)
    size: IntV = 3  # n: the largest n-gram (orders 2..n)
    heads_per_order: IntV = 8  # Hg hashed heads per order
    dim: IntV  # E: the concatenated embedding of the (n - 1) Hg heads
    vocab_base: IntV  # each head's table size is a distinct prime above this
    divisible_by: IntV = 128  # the concatenated tables padded to a multiple of this
    seed: IntV = 1234
    parts: IntV = 1  # the checkpoint stores each table in this many row shards (stacked here)
    conv_kernel: IntV = 4  # K of the dilated (d = n) depthwise conv
    eos: IntV  # the token that ends a document (the first, of a list): no n-gram reaches across it


@dataclass(frozen=True)
class NgramCfg:
    vocab: int  # V, the token vocabulary (bounds the hash multipliers)
    hidden: int  # D
    streams: int  # N residual streams
    dim: int  # E
    size: int  # n
    heads_per_order: int  # Hg
    vocab_base: int
    divisible_by: int
    seed: int
    index: int  # this layer's place among the n-gram layers (which primes and multipliers)
    parts: int
    conv_kernel: int
    eos: int
    norm_eps: float
    par: Parallel = ONE_RANK  # tensor parallel: the table's rows split over the ranks

    @property
    def heads(self) -> int:  # Hn = (n - 1) Hg
        return (self.size - 1) * self.heads_per_order


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _MASK64
    v = ((v ^ (v >> 30)) * _M1) & _MASK64
    v = ((v ^ (v >> 27)) * _M2) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def _is_prime(v: int) -> bool:
    if v < 2 or v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


def hash_tables(c: NgramCfg) -> tuple[list[int], list[int], list[int], int]:
    """(multipliers [n], head sizes [Hn], head offsets [Hn], padded table rows).

    m_s = 2 (splitmix64(seed + 10007 index + gamma (s + 1)) mod floor(floor((2^63 - 1) / V) / 2)) + 1
    size of global head g = index Hn + j: the (g + 1)-th prime above vocab_base - 1; the heads'
    tables are concatenated (offsets), padded to a multiple of divisible_by rows."""
    half = max(1, ((1 << 63) - 1) // max(c.vocab, 1) // 2)
    base = c.seed + _LAYER_PRIME * c.index
    mults = [2 * (_splitmix64((base + _GAMMA * (s + 1)) & _MASK64) % half) + 1 for s in range(c.size)]
    primes, p = [], c.vocab_base - 1
    while len(primes) < (c.index + 1) * c.heads:
        p += 1
        if _is_prime(p):
            primes.append(p)
    sizes = primes[c.index * c.heads :]
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    rows = -(-sum(sizes) // c.divisible_by) * c.divisible_by
    return mults, sizes, offsets, rows


class NgramInjection(nn.Module):
    """Per-layer n-gram embedding (PLE) added to the N residual streams X [T, N, D] before the
    layer's attention hyper-connection.

    ids(t) = ngram_ids(token history): order k = 2..n, head j: (xor_{s < k} tok[t - s] m_s) mod
             P_kj + offset_kj, tok[t - s] = eos across a document end or before the request
    e = concat_heads table[ids(t)]                                    [T, E] (E / Hn per head)
    key = rmsnorm_D(e W_key) (per stream)   [T, N, D];  value = e W_value   [T, D]
    q = rmsnorm_D(X) (per stream)           [T, N, D]
    a = <key, q> / sqrt(D);  a <- sign(a) sqrt(max(|a|, 1e-6))         [T, N]
    u = sigmoid(a) value                                              [T, N, D]
    X <- X + u + silu(conv_{K, d = n}(rmsnorm_D(u)))   (depthwise over the N D channels, dilated
                                                        by n, causal over the request's tokens)
    Every RMSNorm is zero-centred: (1 + w) in fp32. The request's last n - 1 tokens and the
    conv's last (K - 1) n inputs live in its state slot (two state parts): chunked prefill,
    prefix hits (the slot's snapshot) and retraction continue the same history.
    Tensor parallel over P ranks: the table (the release's largest tensor) is split by rows, each
    of its checkpoint parts [R, E / Hn] into P runs of R / P rows; a rank looks up the ids in its
    runs (the others give 0) and the ranks' lookups are summed (one all-reduce of [T, E]); the
    rest is replicated.
    """

    linear_weights = ("key_proj", "value_proj")  # may be packed

    def __init__(self, cfg: NgramCfg, ops: OpTable, offsets: tuple[int, int]) -> None:
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.history_off, self.conv_off = offsets  # bytes into the request's state slot
        mults, sizes, offs, rows = hash_tables(cfg)
        if rows % cfg.parts:
            raise ValueError(f"n-gram table rows {rows} do not split into {cfg.parts} checkpoint parts")
        nd = cfg.streams * cfg.hidden
        self.part_rows = rows // cfg.parts  # R: rows of a checkpoint part
        self.rows = cfg.par.even(self.part_rows, "n-gram table rows of a part")  # this rank's of each
        self.table = nn.Parameter(torch.empty(cfg.parts, self.rows, cfg.dim // cfg.heads))
        self.key_proj = nn.Parameter(torch.empty(nd, cfg.dim))
        self.value_proj = nn.Parameter(torch.empty(cfg.hidden, cfg.dim))
        self.norm_key = nn.Parameter(torch.empty(nd))
        self.norm_query = nn.Parameter(torch.empty(nd))
        self.norm_conv = nn.Parameter(torch.empty(nd))
        self.conv = nn.Parameter(torch.empty(nd, 1, cfg.conv_kernel))
        self.register_buffer("multipliers", torch.tensor(mults, dtype=torch.long), persistent=False)
        self.register_buffer("sizes", torch.tensor(sizes, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor(offs, dtype=torch.long), persistent=False)

    @staticmethod
    def shards(cfg: NgramCfg) -> dict[str, dict[str, Slice]]:
        if cfg.par.size == 1:
            return {}
        rows = hash_tables(cfg)[3] // cfg.parts // cfg.par.size
        return {"table": {"": Slice(-2, cfg.par.rank * rows, rows)}}

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, Hn] into the whole (concatenated) table -> [T, Hn, E / Hn]."""
        table = self.table.flatten(0, 1)  # [parts R / P, E / Hn]
        par = self.cfg.par
        if par.size == 1:
            return self.ops.embedding(ids.flatten(), table).view(*ids.shape, -1)
        part, row = ids // self.part_rows, ids % self.part_rows - par.rank * self.rows
        mine = (row >= 0) & (row < self.rows)
        e = self.ops.embedding(torch.where(mine, part * self.rows + row, 0).flatten(), table)
        return self.ops.tp.all_reduce(e.view(*ids.shape, -1) * mine[..., None])

    def _state(self, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the token history [slots, n - 1] int64 and the conv inputs [slots, N D,
        (K - 1) n] in the model dtype."""
        c, pool = self.cfg, ctx.state.pool
        h = pool[:, self.history_off : self.history_off + 8 * (c.size - 1)].view(torch.int64)
        dt = self.conv.dtype  # the model dtype (the projections may be packed)
        span = (c.conv_kernel - 1) * c.size
        n_conv = c.streams * c.hidden * span * dt.itemsize
        conv = pool[:, self.conv_off : self.conv_off + n_conv].view(dt).view(-1, c.streams * c.hidden, span)
        return h, conv

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Per-stream zero-centred RMSNorm: x [T, N, D], w [N D]."""
        return self.ops.rms_norm(x, zero_centred(w).view(self.cfg.streams, -1), self.cfg.norm_eps, True)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        """x [T, N, D] -> x + the injection, [T, N, D]."""
        c, ops, t = self.cfg, self.ops, x.shape[0]
        history, conv_state = self._state(ctx)
        tables = (self.multipliers, self.sizes, self.offsets)
        ids = ops.ngram_ids(ctx.input_ids, history, *tables, c.heads_per_order, c.eos, ctx.state)  # [T, Hn]
        e = self._lookup(ids).reshape(t, c.dim).to(x.dtype)  # [T, E]
        key = self._norm(ops.linear(e, self.key_proj).view(t, c.streams, c.hidden), self.norm_key)
        value = ops.linear(e, self.value_proj)  # [T, D]
        q = self._norm(x, self.norm_query)  # [T, N, D]
        a = (key * q).sum(-1, keepdim=True) / math.sqrt(c.hidden)  # [T, N, 1]
        a = a.abs().clamp_min(1e-6).sqrt() * a.sign()
        u = torch.sigmoid(a) * value[:, None, :]  # [T, N, D]
        un = self._norm(u, self.norm_conv).reshape(t, -1)  # [T, N D]
        y = ops.dilated_conv(un, self.conv, c.size, conv_state, ctx.state)  # [T, N D]
        return x + u + y.view(t, c.streams, c.hidden)


def ngram_cache(c: NgramCfg) -> tuple[CacheDecl, CacheDecl]:
    """The two state parts: the last n - 1 tokens (int64) and the conv's last (K - 1) n inputs
    (sized for fp32, the widest model dtype)."""
    return (
        CacheDecl("ngram_tokens", "state", 8 * (c.size - 1)),
        CacheDecl("ngram_conv", "state", 4 * c.streams * c.hidden * (c.conv_kernel - 1) * c.size),
    )


PREFIX = "ngram"  # its cache parts' names in the geometry: ngram.ngram_tokens, ngram.ngram_conv


def static_ngram_cache() -> tuple[StaticCache, StaticCache]:
    """The parts as codegen sees them: in the request's state slot, with the linear-attention
    blocks' state (one slot a request)."""
    return StaticCache("ngram_tokens", "state", "", "state"), StaticCache("ngram_conv", "state", "", "state")


def resolve_ngram(
    o: NgramOpts,
    val: Callable[[Any], Any],
    *,
    vocab: int,
    hidden: int,
    streams: int,
    norm_eps: float,
    n_layers: int,
    par: Parallel = ONE_RANK,
) -> dict[int, NgramCfg]:
    """Each injecting layer's (zero-based) config; its place among them picks its hash tables."""
    listed = val(o.layers)
    if listed is None:
        listed = []
    if not isinstance(listed, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in listed
    ):
        raise ValueError(f"ngram layers must be a list of layer numbers, got {listed!r}")
    layers = sorted({i - o.counted_from for i in listed})
    if bad := [i + o.counted_from for i in layers if not 0 <= i < n_layers]:
        raise ValueError(
            f"ngram layers {bad} are not layers of this model ({n_layers}, counted from {o.counted_from})"
        )
    if layers and streams < 2:
        raise ValueError(
            "n-gram embeddings are injected into hyper-connection streams: residual streams must be >= 2"
        )
    eos = val(o.eos)
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if layers and not isinstance(eos, int):
        raise ValueError(f"n-gram embeddings need the end-of-document token (eos), got {eos!r}")
    out = {}
    for index, layer in enumerate(layers):
        out[layer] = check_ngram(
            NgramCfg(
                vocab=vocab,
                hidden=hidden,
                streams=streams,
                dim=int(val(o.dim)),
                size=int(val(o.size)),
                heads_per_order=int(val(o.heads_per_order)),
                vocab_base=int(val(o.vocab_base)),
                divisible_by=int(val(o.divisible_by)),
                seed=int(val(o.seed)),
                index=index,
                parts=int(val(o.parts)),
                conv_kernel=int(val(o.conv_kernel)),
                eos=eos,
                norm_eps=norm_eps,
                par=par,
            )
        )
    return out


def ngram_needs(c: NgramCfg) -> list[tuple[str, frozenset[str], int | None]]:
    return [
        ("ngram_ids", frozenset(), None),
        ("embedding", frozenset(), None),
        ("linear", frozenset(), None),
        ("rms_norm", frozenset({"weight_in_fp32"}), None),
        ("dilated_conv", frozenset(), None),
    ]


def check_ngram(c: NgramCfg) -> NgramCfg:
    """Refuse what the block does not implement, by name."""
    if c.size < 2 or c.heads_per_order < 1:
        raise ValueError(f"n-gram size {c.size} must be >= 2 with heads_per_order >= 1")
    if c.dim % c.heads:
        raise ValueError(f"n-gram dim {c.dim} is not a multiple of (size - 1) heads_per_order = {c.heads}")
    if c.conv_kernel < 1:
        raise ValueError(f"n-gram conv_kernel must be >= 1, got {c.conv_kernel}")
    return c
