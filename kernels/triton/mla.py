"""Absorbed-MLA paged attention in Triton for decode rows and sparse selections, reading the
latent cache in place (no gathered copy, K and V never expanded).

Math (kernels/reference/mla.py `mla_attention`, in the absorbed form): cache rows [c_j ; k_r[j]]
(latent L, shared rope key Dr), w_k [H, Dn, L], w_v [H, Dv, L]. For query token t at p_t:
    q_lat[t, h] = w_k[h]^T q_n[t, h]                                   [T, H, L]   (torch)
    s[t, h, j]  = scale (<q_lat[t, h], c_j> + <q_r[t, h], k_r[j]>)      over j in S(t)
    o[t, h]     = w_v[h] sum_j softmax_j(s)[j] c_j                      [T, H, Dv]  (w_v: torch)
S(t): the cached j <= p_t (dense), or the selection select[t] ([T, K] distinct positions in any
order, -1 unused: an indexer's) with j <= p_t; 0 when S(t) allows nothing. Scores and the online softmax
in fp32; the probabilities are rounded to the latent's dtype before the c product.

A program takes one query token, BH heads of it (so each latent tile is loaded once for all of
them) and one split of its keys: a decode step of few rows splits the keys over several programs
and merges the splits by their log-sum-exp (kernels/triton/attention.py `_merge`). The grid is
(tokens, head groups, splits), the key ranges read on the device: a decode step can be captured
in a CUDA graph. Prefill rows of a dense step (more than one query) run the batched backend's
expanded form (SDPA), kernels/batched/mla.py.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from dayzero.kernels.batched import mla as batched
from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.triton.attention import (
    MIN_SPLIT_TILES,
    _finish,
    _merge,
    _splits,
    _start,
    _tile,
    token_ids,
    token_rows,
)


# the block table's row stride changes with an eager step's rows: not specialised on (no
# new variant compiled inside a served step)
@triton.jit(do_not_specialize=["stride_tr"])
def _mla_decode(
    ql_ptr,  # [T, H, L] q_lat
    qr_ptr,  # [T, H, Dr] q_rope
    c_ptr,  # [N, >= L + Dr] cache rows [c ; k_r], rows strided
    sel_ptr,  # [T, K] selected positions (-1: unused), SELECT only
    o_ptr,  # [n, H, S, L] fp32: each split's normalised latent output
    lse_ptr,  # [n, H, S] fp32: each split's log-sum-exp (-inf: no key allowed)
    toks_ptr,  # [n] the program's query token
    rows_ptr,  # [n] its row
    pos_ptr,
    kv_lens_ptr,
    table_ptr,
    stride_qlt,
    stride_qlh,
    stride_qrt,
    stride_qrh,
    stride_cn,
    stride_st,
    stride_tr,
    scale,
    block_size,
    n_sel,
    H: tl.constexpr,
    S: tl.constexpr,
    L: tl.constexpr,
    BL: tl.constexpr,
    DR: tl.constexpr,
    BDR: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
    SELECT: tl.constexpr,
    IEEE: tl.constexpr,
    MIN_TILES: tl.constexpr,
):
    pid, hg, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tl.load(toks_ptr + pid).to(tl.int64)
    r = tl.load(rows_ptr + pid).to(tl.int64)
    p_t = tl.load(pos_ptr + t)
    h = hg * BH + tl.arange(0, BH)
    hm = h < H
    row = (pid * H + h) * S + split  # [BH] index into [n, H, S]
    if SELECT:  # noqa: SIM108  (a compile-time branch in Triton)
        n_keys = n_sel
    else:
        n_keys = tl.minimum(p_t + 1, tl.load(kv_lens_ptr + r))
    # this split's keys, whole BN tiles, at least MIN_TILES of them (later splits may be empty)
    per = tl.maximum(tl.cdiv(tl.cdiv(n_keys, S), BN), MIN_TILES) * BN
    start = split * per
    stop = tl.minimum(start + per, n_keys)
    if S > 1:  # noqa: SIM102  (a compile-time branch in Triton)
        if start >= stop:
            tl.store(lse_ptr + row, tl.full((BH,), float("-inf"), tl.float32), mask=hm)
            return
    lat = tl.arange(0, BL)
    lm = lat < L
    q_lat = tl.load(
        ql_ptr + t * stride_qlt + h[:, None] * stride_qlh + lat[None, :],
        mask=hm[:, None] & lm[None, :],
        other=0.0,
    )  # [BH, BL]
    if DR:
        dr = tl.arange(0, BDR)
        q_r = tl.load(
            qr_ptr + t * stride_qrt + h[:, None] * stride_qrh + dr[None, :],
            mask=hm[:, None] & (dr[None, :] < DR),
            other=0.0,
        )  # [BH, BDR]
    m_i, l_i, acc = _start(o_ptr, h, hm, split, BH, BL, False)  # no sinks
    for j0 in range(start, stop, BN):
        j = j0 + tl.arange(0, BN)
        jm = j < stop
        if SELECT:
            key = tl.load(sel_ptr + t * stride_st + j, mask=jm, other=-1)
            ok = jm & (key >= 0) & (key <= p_t)
        else:
            key = j
            ok = jm
        blk = tl.load(table_ptr + r * stride_tr + key // block_size, mask=ok, other=-1)
        ok &= blk >= 0
        slot = blk.to(tl.int64) * block_size + key % block_size
        c = tl.load(
            c_ptr + slot[:, None] * stride_cn + lat[None, :], mask=ok[:, None] & lm[None, :], other=0.0
        )
        c = c.to(q_lat.dtype)  # [BN, BL]
        if IEEE:  # noqa: SIM108  (a compile-time branch in Triton)
            s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")  # [BH, BN]
        else:
            s = tl.dot(q_lat, tl.trans(c))
        if DR:
            kr = tl.load(
                c_ptr + slot[:, None] * stride_cn + L + dr[None, :],
                mask=ok[:, None] & (dr[None, :] < DR),
                other=0.0,
            ).to(q_r.dtype)
            if IEEE:
                s += tl.dot(q_r, tl.trans(kr), input_precision="ieee")
            else:
                s += tl.dot(q_r, tl.trans(kr))
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_i, l_i, acc = _tile(s, c, m_i, l_i, acc, IEEE)
    _finish(o_ptr, lse_ptr, row, lat, acc, m_i, l_i, hm, lm, L)


def _latent(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    w_k: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    toks: torch.Tensor,
    rows: torch.Tensor,
    select: torch.Tensor | None,
    splits: int | None,
    min_split_tiles: int,
) -> torch.Tensor:
    """The latent output sum_j softmax_j(s) c_j [n, H, L] of the tokens `toks` [n] (of the
    rows `rows` [n])."""
    n, h, lat, dr = toks.shape[0], q_nope.shape[1], w_k.shape[-1], q_rope.shape[-1]
    q_lat = torch.einsum("thd,hdl->thl", q_nope, w_k)  # [T, H, L]
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    bl = triton.next_power_of_2(lat)
    bh = max(16, min(32 if bl >= 256 else 64, triton.next_power_of_2(h)))  # [BH, BL] fp32 accumulator
    groups = triton.cdiv(h, bh)
    bn = 32 if bl >= 256 else 64
    splits = splits or _splits(n, groups, 1, q_nope.device)
    o = torch.empty(n, h, splits, lat, dtype=torch.float32, device=q_nope.device)
    lse = torch.empty(n, h, splits, dtype=torch.float32, device=q_nope.device)
    sel = select if select is not None else toks  # a dummy pointer when dense
    table = meta.block_table
    _mla_decode[(n, groups, splits)](
        q_lat, q_rope, cache, sel, o, lse, toks, rows, meta.positions, meta.kv_lens, table,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), cache.stride(0),
        sel.stride(0), table.stride(0), scale, meta.block_size, sel.shape[-1] if select is not None else 0,
        H=h, S=splits, L=lat, BL=bl, DR=dr, BDR=max(16, triton.next_power_of_2(dr or 1)), BH=bh, BN=bn,
        SELECT=select is not None, IEEE=q_nope.dtype == torch.float32,
        MIN_TILES=min_split_tiles if splits > 1 else 1, num_warps=4 if bl <= 128 else 8, num_stages=2,
    )  # fmt: skip
    return _merge(o, lse, q_nope.dtype)


def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    select: torch.Tensor | None = None,
    splits: int | None = None,
    min_split_tiles: int = MIN_SPLIT_TILES,
) -> torch.Tensor:
    """q_nope [T, H, Dn], q_rope [T, H, Dr] (Dr may be 0), cache [N, L + Dr] (a view of the
    paged pool), w_k [H, Dn, L], w_v [H, Dv, L], select [T, K] or None -> [T, H, Dv].
    `splits`: key splits per token (default: by the GPU's size), each of at least
    `min_split_tiles` key tiles."""
    t, h = q_nope.shape[:2]
    if t == 0:
        return q_nope.new_zeros(t, h, w_v.shape[1])
    args = (q_nope, q_rope, cache, w_k, meta, scale)
    decode = all(b - a <= 1 for a, b in itertools.pairwise(meta.query_start_cpu))
    if select is not None or decode:  # every token one program; [T] and their rows once a step
        o = _latent(*args, token_ids(meta, t), token_rows(meta, t), select, splits, min_split_tiles)
        return torch.einsum("thl,hvl->thv", o, w_v)
    out = q_nope.new_zeros(t, h, w_v.shape[1])
    layout = batched.dense_layout(meta)  # a dense step with prefill rows: those through SDPA
    if layout["dec"] is not None:
        toks = layout["dec"][0]
        o = _latent(*args, toks, token_rows(meta, t)[toks], None, splits, min_split_tiles)
        out[toks] = torch.einsum("thl,hvl->thv", o, w_v)
    if layout["pre"] is not None:
        tok, o = batched.expanded(q_nope, q_rope, cache, w_k, w_v, layout["pre"], scale)
        out[tok] = o
    return out
