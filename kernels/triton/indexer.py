"""The sparse-attention indexers in Triton, reading the paged index-key cache in place: DeepSeek's
lightning indexer (DSA), the pooled one (KPool) and Qwen's block-mean one (QSA); their top-k by
kernels/triton/topk.py.
Graph-safe: the grid and every shape come from the tensors (the block table's width), never from
a row's length read back to the host.

DSA (kernels/reference/mla.py `dsa_scores`): query token t at position p_t of row r, indexer
heads h < Hi, cached index keys k_j [Di]:
    I[t, j] = sum_h w[t, h] relu(scale <q[t, h], k_j>)      j <= p_t, j < kv_len[r] (fp32)
KPool (`kpool_scores`): cache rows [k_j ; g_j] (key and pooling gate), pools of P positions;
complete pool m (m P + P <= kv_len[r]) has the key
    K_m = sum_{i < P} softmax_i(g[mP + i] + ape[i]) k[mP + i]      (softmax per channel, fp32)
    I[t, m] = sum_h w[t, h] relu(scale <q[t, h], K_m>)      m P + P - 1 <= p_t
QSA (kernels/reference/qsa.py): raw index keys k_j, blocks of P positions; `qsa_pool` forms the
key of each block the step completes, one program a completing token (each stage rounded to the
cache's dtype, as the reference; RoPE pairs a channel with its partner, loaded as a second
vector: d +- R/2 rotate-half, d xor 1 GPT-J), spread over the block's rows (ops.qsa_row)
    K_m = rope(rmsnorm(mean_{i < P} k[m P + i]) w_k, position m P)
and `qsa_scores` reads them back
    I[t, m] = scale sum_h relu(<q[t, h], K_m>)              m P + P - 1 <= p_t
and -inf elsewhere. The reference's scores are [T, L] with L the step's longest row (in
keys or pools); these are [T, W B] keys or [T, W B / P] pools (W the block table's width, B the
block size): the same columns, then -inf, so the top-k picks the same positions.

A program takes one query token and BL keys (or BM pools): their block ids, the [BL, Di] key
tile (a pool's keys and gates one position at a time, its softmax online per channel), [Hi, BL]
dot products (tensor cores; fp32 inputs in IEEE fp32) and the weighted sum over heads. A tile past
the row is written -inf without loading a key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.triton.attention import token_rows
from dayzero.kernels.triton.topk import index_topk


# the block table's width and the output's change with the step's rows: not specialised on,
# so a served step never compiles a new variant
@triton.jit(do_not_specialize=["stride_tr", "stride_ot", "width"])
def _dsa_scores(
    q_ptr,  # [T, Hi, Di] indexer queries
    w_ptr,  # [T, Hi] fp32 head weights
    k_ptr,  # [N, >= Di] index-key cache rows, strided
    out_ptr,  # [T, WIDTH] fp32 scores
    rows_ptr,  # [T] the token's row
    pos_ptr,
    kv_lens_ptr,
    table_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kn,
    stride_tr,
    stride_ot,
    scale,
    block_size,
    width,
    HI: tl.constexpr,
    BHI: tl.constexpr,
    DI: tl.constexpr,
    BDI: tl.constexpr,
    BL: tl.constexpr,
    IEEE: tl.constexpr,
):
    t, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r = tl.load(rows_ptr + t).to(tl.int64)
    n_keys = tl.minimum(tl.load(pos_ptr + t) + 1, tl.load(kv_lens_ptr + r))
    j = tile * BL + tl.arange(0, BL)
    ok = j < n_keys
    dst = out_ptr + t * stride_ot + j
    if tile * BL >= n_keys:  # every position of the tile is past the query (or the row)
        tl.store(dst, tl.full((BL,), float("-inf"), tl.float32), mask=j < width)
        return
    blk = tl.load(table_ptr + r * stride_tr + j // block_size, mask=ok, other=-1)
    ok &= blk >= 0
    slot = blk.to(tl.int64) * block_size + j % block_size
    h = tl.arange(0, BHI)
    d = tl.arange(0, BDI)
    q = tl.load(
        q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
        mask=(h[:, None] < HI) & (d[None, :] < DI),
        other=0.0,
    )  # [BHI, BDI]
    kmask = ok[:, None] & (d[None, :] < DI)
    k = tl.load(k_ptr + slot[:, None] * stride_kn + d[None, :], mask=kmask, other=0.0).to(q.dtype)  # [BL, DI]
    if IEEE:  # noqa: SIM108  (a compile-time branch in Triton)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BHI, BL] fp32
    else:
        s = tl.dot(q, tl.trans(k))
    w = tl.load(w_ptr + t * stride_wt + h, mask=h < HI, other=0.0).to(tl.float32)  # [BHI]
    score = tl.sum(w[:, None] * tl.maximum(s * scale, 0.0), 0)  # [BL]
    tl.store(dst, tl.where(ok, score, float("-inf")), mask=j < width)


@triton.jit(do_not_specialize=["stride_tr", "stride_ot", "width"])
def _kpool_scores(
    q_ptr,  # [T, Hi, Di] indexer queries
    w_ptr,  # [T, Hi] fp32 head weights
    c_ptr,  # [N, >= 2 Di] cache rows [k ; g], strided
    ape_ptr,  # [P, Di] the pool's position bias
    out_ptr,  # [T, WIDTH] fp32 scores by pool
    rows_ptr,
    pos_ptr,
    kv_lens_ptr,
    table_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_cn,
    stride_ape,
    stride_tr,
    stride_ot,
    scale,
    block_size,
    width,
    P: tl.constexpr,
    HI: tl.constexpr,
    BHI: tl.constexpr,
    DI: tl.constexpr,
    BDI: tl.constexpr,
    BM: tl.constexpr,
    IEEE: tl.constexpr,
):
    t, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r = tl.load(rows_ptr + t).to(tl.int64)
    # pools that are complete in the row and end at or before the query
    n_pools = tl.minimum(tl.load(kv_lens_ptr + r), tl.load(pos_ptr + t) + 1) // P
    m = tile * BM + tl.arange(0, BM)
    dst = out_ptr + t * stride_ot + m
    if tile * BM >= n_pools:
        tl.store(dst, tl.full((BM,), float("-inf"), tl.float32), mask=m < width)
        return
    ok = m < n_pools
    d = tl.arange(0, BDI)
    dm = d < DI
    mx = tl.full((BM, BDI), float("-inf"), tl.float32)
    den = tl.zeros((BM, BDI), tl.float32)
    acc = tl.zeros((BM, BDI), tl.float32)
    for i in range(P):  # the pool's i-th positions, online softmax over i per channel
        j = m * P + i
        blk = tl.load(table_ptr + r * stride_tr + j // block_size, mask=ok, other=-1)
        seen = ok & (blk >= 0)
        row = c_ptr + (blk.to(tl.int64) * block_size + j % block_size)[:, None] * stride_cn + d[None, :]
        msk = seen[:, None] & dm[None, :]
        k = tl.load(row, mask=msk, other=0.0).to(tl.float32)  # [BM, BDI]
        g = tl.load(row + DI, mask=msk, other=0.0).to(tl.float32)
        g += tl.load(ape_ptr + i * stride_ape + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        new = tl.maximum(mx, g)
        alpha, e = tl.exp(mx - new), tl.exp(g - new)
        den = den * alpha + e
        acc = acc * alpha + e * k
        mx = new
    h = tl.arange(0, BHI)
    q = tl.load(
        q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
        mask=(h[:, None] < HI) & dm[None, :],
        other=0.0,
    )  # [BHI, BDI]
    key = (acc / den).to(q.dtype)  # [BM, BDI] K_m
    if IEEE:  # noqa: SIM108  (a compile-time branch in Triton)
        s = tl.dot(q, tl.trans(key), input_precision="ieee")  # [BHI, BM] fp32
    else:
        s = tl.dot(q, tl.trans(key))
    w = tl.load(w_ptr + t * stride_wt + h, mask=h < HI, other=0.0).to(tl.float32)
    score = tl.sum(w[:, None] * tl.maximum(s * scale, 0.0), 0)  # [BM]
    tl.store(dst, tl.where(ok, score, float("-inf")), mask=m < width)


@triton.jit(do_not_specialize=["stride_tr", "stride_ot", "width"])
def _qsa_scores(
    q_ptr,  # [T, Hi, Di] indexer queries (normed and roped)
    c_ptr,  # [N, >= R] pooled keys spread over their blocks' positions, rows strided
    out_ptr,  # [T, WIDTH] fp32 scores by block of P positions
    rows_ptr,
    pos_ptr,
    kv_lens_ptr,
    table_ptr,
    stride_qt,
    stride_qh,
    stride_cn,
    stride_tr,
    stride_ot,
    scale,
    block_size,
    width,
    P: tl.constexpr,
    R: tl.constexpr,
    HI: tl.constexpr,
    BHI: tl.constexpr,
    DI: tl.constexpr,
    BDI: tl.constexpr,
    BM: tl.constexpr,
    IEEE: tl.constexpr,
):
    t, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    r = tl.load(rows_ptr + t).to(tl.int64)
    # blocks complete in the row that end at or before the query
    n_pools = tl.minimum(tl.load(kv_lens_ptr + r), tl.load(pos_ptr + t) + 1) // P
    m = tile * BM + tl.arange(0, BM)
    dst = out_ptr + t * stride_ot + m
    if tile * BM >= n_pools:
        tl.store(dst, tl.full((BM,), float("-inf"), tl.float32), mask=m < width)
        return
    ok = m < n_pools
    d = tl.arange(0, BDI)
    # channel d of K_m lies in the row of position m P + d // R, column d % R (ops.qsa_row)
    j = m[:, None] * P + (d // R)[None, :]  # [BM, BDI]
    msk = ok[:, None] & (d < DI)[None, :]
    blk = tl.load(table_ptr + r * stride_tr + j // block_size, mask=msk, other=-1)
    row = (blk.to(tl.int64) * block_size + j % block_size) * stride_cn
    key = tl.load(c_ptr + row + (d % R)[None, :], mask=msk & (blk >= 0), other=0.0)  # [BM, BDI] K_m
    last = m * P + P - 1  # the block's last position must be held (the batched op's visibility)
    ok &= tl.load(table_ptr + r * stride_tr + last // block_size, mask=ok, other=-1) >= 0
    h = tl.arange(0, BHI)
    q = tl.load(
        q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
        mask=(h[:, None] < HI) & (d < DI)[None, :],
        other=0.0,
    )  # [BHI, BDI]
    key = key.to(q.dtype)
    if IEEE:  # noqa: SIM108  (a compile-time branch in Triton)
        s = tl.dot(q, tl.trans(key), input_precision="ieee")  # [BHI, BM] fp32
    else:
        s = tl.dot(q, tl.trans(key))
    score = tl.sum(tl.maximum(s, 0.0), 0) * scale  # [BM]
    tl.store(dst, tl.where(ok, score, float("-inf")), mask=m < width)


@triton.jit(do_not_specialize=["stride_rr", "stride_pr"])
def _qsa_pool(
    raw_ptr,  # [N, >= Di] raw index keys (the sliding group), rows strided
    c_ptr,  # [N', >= R] pooled keys, rows strided
    w_ptr,  # [Di] the key norm's weight (as the op multiplies by it)
    freq_ptr,  # [RoT / 2] RoPE inverse frequencies (read when ROT)
    rows_ptr,
    pos_ptr,
    kv_lens_ptr,
    raw_table_ptr,
    table_ptr,
    stride_rn,
    stride_cn,
    stride_rr,
    stride_pr,
    eps,
    block_size,
    P: tl.constexpr,
    R: tl.constexpr,
    DI: tl.constexpr,
    BDI: tl.constexpr,
    ROT: tl.constexpr,
    NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + t).to(tl.int64)
    p = tl.load(pos_ptr + t).to(tl.int64)
    if ((p + 1) % P != 0) | (p >= tl.load(kv_lens_ptr + r)):  # completes no block
        return
    start = p + 1 - P  # the block's first position
    d = tl.arange(0, BDI)
    dm = d < DI
    # RoPE's partner of channel d (rotate-half: d +- RoT/2; GPT-J: d xor 1) and its frequency
    if NEOX:
        half = ROT // 2
        pd = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
        f, first = d % half, d < half
    else:
        pd = tl.where(d < ROT, d ^ 1, d)
        f, first = d // 2, d % 2 == 0
    acc = tl.zeros((BDI,), tl.float32)  # sum_i k[start + i] by channel
    acc_p = tl.zeros((BDI,), tl.float32)  # the same at each channel's partner
    for i in range(P):
        j = start + i
        blk = tl.load(raw_table_ptr + r * stride_rr + j // block_size).to(tl.int64)
        row = raw_ptr + (blk * block_size + j % block_size) * stride_rn
        acc += tl.load(row + d, mask=dm, other=0.0).to(tl.float32)
        acc_p += tl.load(row + pd, mask=dm, other=0.0).to(tl.float32)
    dt = raw_ptr.dtype.element_ty  # each stage rounded to the cache's dtype, as the reference
    x = (acc / P).to(dt).to(tl.float32)  # [BDI] the mean key
    xp = (acc_p / P).to(dt).to(tl.float32)
    rs = 1.0 / tl.sqrt(tl.sum(x * x, 0) / DI + eps)
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + pd, mask=dm, other=0.0).to(tl.float32)
    y = (x * rs * w).to(dt).to(tl.float32)
    if ROT:  # rotated at the block's first position
        yp = (xp * rs * wp).to(dt).to(tl.float32)
        ang = start.to(tl.float32) * tl.load(freq_ptr + f, mask=d < ROT, other=0.0).to(tl.float32)
        rot = y * tl.cos(ang) + tl.where(first, -1.0, 1.0) * yp * tl.sin(ang)
        y = tl.where(d < ROT, rot.to(dt).to(tl.float32), y)
    # channel d to the row of position start + d // R, column d % R (zeros past Di)
    j = start + d // R
    keep = d < (DI + R - 1) // R * R
    blk = tl.load(table_ptr + r * stride_pr + j // block_size, mask=keep, other=0).to(tl.int64)
    dst = c_ptr + (blk * block_size + j % block_size) * stride_cn + d % R
    tl.store(dst, tl.where(dm, y, 0.0).to(c_ptr.dtype.element_ty), mask=keep)


def _heads(hi: int, di: int) -> dict:
    """The head and channel tiles: powers of two, at least 16 (tl.dot's smallest)."""
    return dict(
        HI=hi, BHI=max(16, triton.next_power_of_2(hi)), DI=di, BDI=max(16, triton.next_power_of_2(di))
    )


def dsa_scores(
    q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, meta: PagedMeta, scale: float
) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi] fp32, k_cache [N, Di] (a view of the paged pool) -> [T, W B]
    fp32 scores by key position, -inf where a position is not visible."""
    t, hi, di = q.shape
    width = meta.block_table.shape[1] * meta.block_size
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    bl = 64
    _dsa_scores[(t, triton.cdiv(width, bl))](
        q, weights, k_cache, out, token_rows(meta, t), meta.positions, meta.kv_lens, meta.block_table,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), meta.block_table.stride(0),
        out.stride(0), scale, meta.block_size, width,
        **_heads(hi, di), BL=bl, IEEE=q.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    return out


def kpool_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    ape: torch.Tensor,
    meta: PagedMeta,
    pool: int,
    scale: float,
) -> torch.Tensor:
    """q [T, Hi, Di], weights [T, Hi] fp32, cache [N, 2 Di] rows [k ; g], ape [P, Di] -> [T, W B / P]
    fp32 scores by pool, -inf where a pool is not complete before the query."""
    t, hi, di = q.shape
    width = meta.block_table.shape[1] * meta.block_size // pool
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    bm = 16
    _kpool_scores[(t, triton.cdiv(width, bm))](
        q, weights, cache, ape, out, token_rows(meta, t), meta.positions, meta.kv_lens,
        meta.block_table, q.stride(0), q.stride(1), weights.stride(0), cache.stride(0), ape.stride(0),
        meta.block_table.stride(0), out.stride(0), scale, meta.block_size, width,
        P=pool, **_heads(hi, di), BM=bm, IEEE=q.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    return out


def qsa_pool(
    raw: torch.Tensor,
    raw_meta: PagedMeta,
    pooled: torch.Tensor,
    meta: PagedMeta,
    k_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor | None,
    neox: bool,
    pool: int,
) -> None:
    """raw [N, Di] raw index keys (raw_meta: their sliding group's rows), pooled [N', r] ->
    the key of every block this step completes, spread over its positions' rows (ops.qsa_row);
    one program a token, those that complete no block return at once."""
    t, di, r = meta.positions.shape[0], raw.shape[1], pooled.shape[1]
    if t == 0:
        return
    rot = 0 if inv_freq is None else 2 * inv_freq.shape[0]
    _qsa_pool[(t,)](
        raw, pooled, k_weight, k_weight if inv_freq is None else inv_freq, token_rows(meta, t),
        meta.positions, meta.kv_lens, raw_meta.block_table, meta.block_table, raw.stride(0),
        pooled.stride(0), raw_meta.block_table.stride(0), meta.block_table.stride(0), eps,
        meta.block_size, P=pool, R=r, DI=di, BDI=max(16, triton.next_power_of_2(di)), ROT=rot,
        NEOX=neox and rot > 0, num_warps=4,
    )  # fmt: skip


def qsa_scores(
    q: torch.Tensor, pooled: torch.Tensor, meta: PagedMeta, pool: int, scale: float
) -> torch.Tensor:
    """q [T, Hi, Di] (normed and roped), pooled [N, r] the blocks' keys spread over their
    positions (ops.qsa_row) -> [T, W B / P] fp32 scores by block of `pool` positions, -inf where
    a block is not complete before the query."""
    t, hi, di = q.shape
    width = meta.block_table.shape[1] * meta.block_size // pool
    out = torch.empty(t, width, dtype=torch.float32, device=q.device)
    if t == 0 or width == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    bm = 16
    _qsa_scores[(t, triton.cdiv(width, bm))](
        q, pooled, out, token_rows(meta, t), meta.positions, meta.kv_lens, meta.block_table,
        q.stride(0), q.stride(1), pooled.stride(0), meta.block_table.stride(0), out.stride(0), scale,
        meta.block_size, width, P=pool, R=pooled.shape[1], **_heads(hi, di), BM=bm,
        IEEE=q.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    return out


def dsa_index(
    q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, meta: PagedMeta, topk: int, scale: float
) -> torch.Tensor:
    """The lightning indexer's selection: the positions of each query's top-k scores [T, topk],
    -1 where fewer are visible (the reference op's contract)."""
    return index_topk(dsa_scores(q, weights, k_cache, meta, scale), meta.positions, topk)


def kpool_index(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    ape: torch.Tensor,
    meta: PagedMeta,
    topk: int,
    pool: int,
    scale: float,
    tail: bool = True,
) -> torch.Tensor:
    """The pooled indexer's selection: the topk / P best pools' positions (+ with `tail` the
    query's incomplete pool) [T, topk (+ P - 1)], -1 padded (the reference op's contract)."""
    scores = kpool_scores(q, weights, cache, ape, meta, pool, scale)
    return index_topk(scores, meta.positions, topk, pool, tail)
