"""Paged GQA attention in Triton, reading K/V in place from the paged cache (no gathered or padded
copies): prefill chunks, decode rows and mixed batches in one kernel, lengths as data.

Math (the reference's, kernels/reference/attention.py): for query token t at position p_t of
row r, key position j < kv_lens[r], kv head g = h // (H / Hk):
    s[t, h, j] = scale * <q[t, h], K_r[j, g]>              (cap * tanh(s / cap) with a softcap)
    allowed iff j <= p_t, j's block is held (table >= 0), and j > p_t - window when windowed
    out[t, h] = sum_j softmax_j(s)[j] * V_r[j, g]
    (with sinks [H]: exp(sinks[h]) joins every softmax's denominator, a logit without a value)
in fp32 with an online softmax over key tiles; a sink enters the first key split's running max
and sum once (m = sinks[h], l = 1 before its first tile), so the merge counts it once; the
probabilities are rounded to V's dtype before the V product, as the reference does.

A program takes one kv head, BM (query, head) pairs of one row (BQ queries x the G query heads
sharing that kv head, so every key tile is loaded once for all of them) and one split of the
row's keys. Decode rows have one query, so a step of few rows splits each row's keys over
several programs (flash-decoding); the splits' partial results (normalised output and
log-sum-exp) are merged by `_merge`. The grid depends only on the row count, the longest query
of the step and the split count, never on the context lengths, so a decode step can be captured
in a CUDA graph and replayed at any lengths.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.triton.packed import _sms


@triton.jit
def _start(sinks_ptr, h, hm, split, BM: tl.constexpr, BD: tl.constexpr, SINKS: tl.constexpr):
    """An online softmax's running max, sum and output ([BM], [BM], [BM, BD]) for BM (query, head)
    rows of heads h; with sinks [H] the sink's logit starts split 0's max and sum (a logit without
    a value, counted once by the merge)."""
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    if SINKS:
        sink = tl.load(sinks_ptr + h, mask=hm, other=0.0).to(tl.float32)
        first_split = (tl.zeros((BM,), tl.int32) + split) == 0
        m_i = tl.where(first_split, sink, m_i)
        l_i = tl.where(first_split, 1.0, l_i)
    return m_i, l_i, tl.zeros((BM, BD), tl.float32)


@triton.jit
def _tile(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key tile of the online softmax: scores s [BM, BN] fp32 (-inf: not allowed), values
    v [BN, BD] -> the new running max, sum and unnormalised output (m, l, acc); the probabilities
    are rounded to V's dtype before the product, as the reference does."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:  # a compile-time branch in Triton
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _finish(o_ptr, lse_ptr, row, d, acc, m_i, l_i, rows_ok, cols_ok, D: tl.constexpr):
    """A split's normalised output o[row] = acc / l ([BM, D] of [.., D] rows) and its log-sum-exp
    m + log l (-inf where the split allowed no key)."""
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    tl.store(o_ptr + row[:, None] * D + d[None, :], out, mask=rows_ok[:, None] & cols_ok[None, :])
    lse = m_i + tl.log(tl.where(seen, l_i, 1.0))
    tl.store(lse_ptr + row, tl.where(seen, lse, float("-inf")), mask=rows_ok)


# ints that change with the step's lengths are not specialized on (Triton compiles a variant per
# value class, == 1 / divisible by 16: seconds of compiling in a served step, as prompts grow)
@triton.jit(do_not_specialize=["stride_tr", "window", "q_tiles"])
def _paged_attention(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,  # [T, H, S, D] fp32: each split's normalised output
    lse_ptr,  # [T, H, S] fp32: each split's log-sum-exp (-inf: no key allowed)
    sinks_ptr,  # [H]: per-head sink logits (read when SINKS)
    qs_ptr,
    kv_lens_ptr,
    table_ptr,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_tr,
    scale,
    softcap,
    window,
    q_tiles,
    block_size,
    H: tl.constexpr,
    S: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BQ: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
    IEEE: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    pid, kh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r, qt = pid // q_tiles, pid % q_tiles
    q0 = tl.load(qs_ptr + r)
    n_q = tl.load(qs_ptr + r + 1) - q0
    if qt * BQ >= n_q:
        return
    kv_len = tl.load(kv_lens_ptr + r)
    m = tl.arange(0, BM)
    i = qt * BQ + m // G  # query of the row
    h = kh * G + m % G  # query head
    valid = (m < BQ * G) & (i < n_q)
    tok = (q0 + i).to(tl.int64)
    pos = kv_len - n_q + i  # [BM] query positions
    d = tl.arange(0, BD)
    dm = d < D
    qmask = valid[:, None] & dm[None, :]
    row = (tok * H + h) * S + split  # [BM] index into [T, H, S]
    first = kv_len - n_q + qt * BQ  # the tile's first query position
    hi = tl.minimum(kv_len, first + BQ)  # keys past the tile's last query are never allowed
    lo = 0
    if WINDOW:
        lo = tl.maximum(first - window + 1, 0)
    # this split's key range, whole BN tiles, at least MIN_TILES of them (a short row leaves the
    # later splits empty: they write only lse -inf, and the merge reads no output of theirs)
    per = tl.maximum(tl.cdiv(tl.cdiv(hi - lo, S), BN), MIN_TILES) * BN
    start = lo + split * per
    stop = tl.minimum(start + per, hi)
    if S > 1:  # noqa: SIM102  (a compile-time branch in Triton)
        if start >= stop:
            tl.store(lse_ptr + row, tl.full((BM,), float("-inf"), tl.float32), mask=valid)
            return
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
    m_i, l_i, acc = _start(sinks_ptr, h, valid, split, BM, BD, SINKS)
    for j0 in range(start, stop, BN):
        j = j0 + tl.arange(0, BN)
        jm = j < stop
        blk = tl.load(table_ptr + r * stride_tr + j // block_size, mask=jm, other=-1)
        held = jm & (blk >= 0)
        slot = blk.to(tl.int64) * block_size + j % block_size
        kvm = held[:, None] & dm[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kn + kh * stride_kh + d[None, :], mask=kvm, other=0.0)
        if IEEE:  # noqa: SIM108  (a compile-time branch in Triton)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        if SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        allowed = held[None, :] & (j[None, :] <= pos[:, None])
        if WINDOW:
            allowed &= j[None, :] > pos[:, None] - window
        s = tl.where(allowed, s, float("-inf"))
        v = tl.load(v_ptr + slot[:, None] * stride_vn + kh * stride_vh + d[None, :], mask=kvm, other=0.0)
        m_i, l_i, acc = _tile(s, v, m_i, l_i, acc, IEEE)
    _finish(o_ptr, lse_ptr, row, d, acc, m_i, l_i, valid, dm, D)


def token_ids(meta: PagedMeta, t: int) -> torch.Tensor:
    """[T] 0..T-1 on the device; once a step (meta.memo)."""
    ids = meta.memo.get(("tokens", t))
    if ids is None:
        ids = meta.memo[("tokens", t)] = torch.arange(t, device=meta.query_start.device)
    return ids


def token_rows(meta: PagedMeta, t: int) -> torch.Tensor:
    """[T] each token's row, from query_start on the device; once a step for every layer of the
    group that asks (meta.memo)."""
    rows = meta.memo.get(("token_rows", t))
    if rows is None:
        rows = meta.memo[("token_rows", t)] = (
            torch.searchsorted(meta.query_start, token_ids(meta, t), right=True) - 1
        )
    return rows


# decode splits: up to MAX_SPLITS a row, so that a step has PROGRAMS_PER_SM programs an SM; each
# split takes at least MIN_SPLIT_TILES key tiles. A key tile's loop step is latency-bound (block
# table, then K, then V), so more splits of fewer tiles win: on the H200 at 60k keys, batch 1,
# 16 splits read 1.2 TB/s, 128 splits 2.3 TB/s; at 512 keys one tile a split beats four
# (12.4 against 21.3 us) (scripts/tune_decode_attention.py)
MAX_SPLITS, PROGRAMS_PER_SM, MIN_SPLIT_TILES = 128, 8, 1
# decode steps' key tile and warps (`tune_decode_attention.py geometry`, H200, 48 / 8 heads of 128:
# at 60k keys, batch 1, 128 x 4 warps 82.0 us against 64 x 4 110.7; at 512 keys 12.7 against 13.9)
DECODE_TILE, DECODE_WARPS = 128, 4


def _splits(rows: int, kv_heads: int, q_max: int, device: torch.device) -> int:
    """Key splits per row: enough programs to fill the GPU when the step has few decode rows
    (a long context then reads its keys from every SM, a short one from as many as it needs)."""
    if q_max > 1 or device.type != "cuda":
        return 1
    want = PROGRAMS_PER_SM * _sms(device.index or 0)
    return max(1, min(MAX_SPLITS, triton.cdiv(want, rows * kv_heads)))


@triton.jit
def _merge_splits(
    o_ptr, lse_ptr, y_ptr, S: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, BD: tl.constexpr
):
    """One (token, head): y = sum_s exp(lse_s - logsumexp(lse)) o_s; 0 when no split saw a key."""
    r = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BS)
    lse = tl.load(lse_ptr + r * S + s, mask=s < S, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - tl.where(top == float("-inf"), 0.0, top)))
    d = tl.arange(0, BD)
    live = (s < S) & (lse > float("-inf"))  # an empty split's output is never read
    o = tl.load(
        o_ptr + (r * S + s[:, None]) * D + d[None, :], mask=live[:, None] & (d[None, :] < D), other=0.0
    )
    total = tl.sum(w, 0)
    y = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(y_ptr + r * D + d, y.to(y_ptr.dtype.element_ty), mask=d < D)


def _merge(o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """o [T, H, S, D], lse [T, H, S] -> [T, H, D]: the splits' outputs weighted by their share
    of the softmax mass, exp(lse_s - logsumexp(lse)); a query with no allowed key gives 0."""
    t, h, splits, d = o.shape
    if splits == 1:
        return o[:, :, 0].to(dtype)
    y = torch.empty(t, h, d, dtype=dtype, device=o.device)
    _merge_splits[(t * h,)](
        o, lse, y, S=splits, BS=triton.next_power_of_2(splits), D=d, BD=triton.next_power_of_2(d)
    )
    return y


def gqa_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    splits: int | None = None,
    min_split_tiles: int = MIN_SPLIT_TILES,
    key_tile: int | None = None,
    warps: int | None = None,
    stages: int = 2,
) -> torch.Tensor:
    """q [T, H, D], caches [N, Hk, D] (views of the paged pool; rows may be strided), sinks [H]
    (or None) -> [T, H, D].
    `splits`: key splits per row (default: by the GPU's size for decode steps, else 1), each of
    at least `min_split_tiles` key tiles; `key_tile` (keys a tile), `warps`, `stages`: the
    geometry (the tuning script's knobs)."""
    t, h, dh = q.shape
    hk = k_cache.shape[1]
    g = h // hk
    qs = meta.query_start_cpu
    rows = len(qs) - 1
    q_max = max((b - a for a, b in itertools.pairwise(qs)), default=0)
    bd = triton.next_power_of_2(dh)
    decode = q_max <= 1
    bm = max(16, triton.next_power_of_2(g)) if decode else (32 if bd > 128 else 64)
    bm = max(bm, triton.next_power_of_2(g))
    bq = max(1, bm // g)
    bn = key_tile or (32 if bd > 128 else DECODE_TILE if decode else 64)
    warps = warps or (DECODE_WARPS if decode else 4)
    splits = splits or _splits(rows, hk, q_max, q.device)
    q_tiles = max(1, triton.cdiv(q_max, bq))
    if t == 0 or rows == 0:
        return q.new_zeros(t, h, dh)
    q = q if q.stride(-1) == 1 else q.contiguous()
    o = torch.empty(t, h, splits, dh, dtype=torch.float32, device=q.device)
    lse = torch.empty(t, h, splits, dtype=torch.float32, device=q.device)
    table = meta.block_table
    _paged_attention[(rows * q_tiles, hk, splits)](
        q, k_cache, v_cache, o, lse, lse if sinks is None else sinks, meta.query_start, meta.kv_lens, table,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        table.stride(0), scale, softcap or 1.0, window or 0, q_tiles, meta.block_size,
        H=h, S=splits, G=g, D=dh, BD=bd, BQ=bq, BM=bm, BN=bn,
        SOFTCAP=softcap is not None, WINDOW=window is not None, SINKS=sinks is not None,
        IEEE=q.dtype == torch.float32,
        MIN_TILES=min_split_tiles if splits > 1 else 1, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return _merge(o, lse, q.dtype)
