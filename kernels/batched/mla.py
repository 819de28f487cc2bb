"""Paged multi-head latent attention (MLA) for a whole step, vectorised over rows: the reference's
math (kernels/reference/mla.py `mla_attention`) in two forms, each one batched pass.

cache [N, L + Dr] rows are [c_j ; k_r[j]] (normed latent, roped shared key); w_k [H, Dn, L] and
w_v [H, Dv, L] are kv_b split per head. For query t at position p_t and an allowed key j:

absorbed (decode rows, and every token of a sparse step): W_k folded into the query, W_v applied
to the output, so K and V are never expanded:
    q_lat[t, h] = w_k[h]^T q_n[t, h]                                    [T, H, L]
    s[t, h, j]  = scale (<q_lat[t, h], c_j> + <q_r[t, h], k_r[j]>)       [T, H, K] fp32
    o[t, h]     = w_v[h] sum_j softmax_j(s)[j] c_j                       [T, H, Dv]
  over K keys per token: a decode row's cached positions, or the indexer's selection (only those
  latent rows are gathered: memory O(T K (L + H)), never O(T K context)), in token chunks of at
  most CHUNK_BYTES of intermediates.
expanded (prefill rows of a dense step): k[j, h] = [w_k[h] c_j ; k_r[j]], v[j, h] = w_v[h] c_j
  for the rows' cached positions, then one SDPA call, softmax(q k^T scale) v, over the rows
  padded to [R, H, Q, Dn + Dr], causal through a boolean [R, 1, Q, L] mask shared by the heads
  (none for a lone fresh prompt: is_causal).
Allowed: j <= p_t, j cached, and j in the selection when there is one; a query with no allowed
key gives 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.registry import Capabilities, register

CHUNK_BYTES = 64 << 20  # the absorbed form's intermediates per token chunk, at most (about)


def token_chunk(keys: int, width: int, heads: int) -> int:
    """Tokens per absorbed chunk: each costs K gathered rows of `width` (and their fp32 copy)
    plus fp32 scores and probabilities [H, K], ~4 K (2 width + 3 H) bytes."""
    per_token = 4 * max(keys, 1) * (2 * width + 3 * heads)
    return max(1, CHUNK_BYTES // per_token)


def _slots(meta: PagedMeta, row: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """row [..] (broadcast against) pos [.., K] -> (cache slots, held: pos >= 0 in a held block)."""
    bs, table = meta.block_size, meta.block_table
    blk = table[row, (pos.clamp(min=0) // bs).clamp(max=table.shape[1] - 1)]
    held = (pos >= 0) & (blk >= 0)
    return blk.clamp(min=0) * bs + pos.clamp(min=0) % bs, held


def dense_layout(meta: PagedMeta) -> dict:
    """Per step, memoised (the group's layers share it): "dec", the decode rows' tokens, slots
    [Rd, L] and allowed [Rd, L]; "pre", the prefill rows' padded queries tok [Rp, Q], their real
    tokens `sel`, key slots and held [Rp, L], allowed [Rp, Q, L] (None when a lone fresh prompt
    can use is_causal). Either is None when the step has no such row."""
    if ("mla", "dense") in meta.memo:
        return meta.memo[("mla", "dense")]
    dev, qs, lens = meta.query_start.device, meta.query_start_cpu, meta.kv_lens_cpu
    rows = [(r, qs[r], qs[r + 1] - qs[r], lens[r]) for r in range(len(qs) - 1) if qs[r + 1] > qs[r]]
    dec = [x for x in rows if x[2] == 1]
    pre = [x for x in rows if x[2] > 1]
    out: dict = {"dec": None, "pre": None}
    if dec:
        r = torch.tensor([x[0] for x in dec], device=dev)
        j = torch.arange(max(x[3] for x in dec), device=dev)
        slots, held = _slots(meta, r[:, None], j[None, :].expand(len(dec), -1))
        held &= j[None, :] < meta.kv_lens[r][:, None]  # [Rd, L]; j < kv_len: j <= p_t
        out["dec"] = (torch.tensor([x[1] for x in dec], device=dev), slots, held)
    if pre:
        r = torch.tensor([x[0] for x in pre], device=dev)
        q_max, l_max = max(x[2] for x in pre), max(x[3] for x in pre)
        j = torch.arange(l_max, device=dev)
        slots, held = _slots(meta, r[:, None], j[None, :].expand(len(pre), -1))  # [Rp, L]
        i = torch.arange(q_max, device=dev)
        n_q = torch.tensor([x[2] for x in pre], device=dev)
        tok = (meta.query_start[r][:, None] + i[None, :]).clamp(max=meta.positions.shape[0] - 1)  # [Rp, Q]
        pos_q = meta.kv_lens[r][:, None] - n_q[:, None] + i[None, :]  # [Rp, Q]
        allowed = None
        if not (len(pre) == 1 and pre[0][2] == pre[0][3]):
            allowed = (j[None, None, :] <= pos_q[:, :, None]) & held[:, None, :]  # [Rp, Q, L]
            allowed &= (i[None, :] < n_q[:, None])[:, :, None]
            allowed[:, :, 0] |= ~allowed.any(-1)  # padded queries see one key: no NaN rows
        sel = torch.tensor([k * q_max + i for k, x in enumerate(pre) for i in range(x[2])], device=dev)
        out["pre"] = (tok, sel, slots, held, allowed)
    meta.memo[("mla", "dense")] = out
    return out


def _select_layout(meta: PagedMeta, select: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """select [T, K] distinct positions (-1 unused) -> (slots [T, K], allowed [T, K]): j <= p_t
    and cached."""
    tokens = torch.arange(select.shape[0], device=select.device)
    row = torch.searchsorted(meta.query_start, tokens, right=True) - 1  # [T] each token's row
    slots, held = _slots(meta, row[:, None], select)
    return slots, held & (select <= meta.positions[:, None])


def _absorbed(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    slots: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_nope [n, H, Dn], q_rope [n, H, Dr], slots / allowed [n, K] -> [n, H, Dv] (the absorbed
    form above), in token chunks of token_chunk() tokens."""
    n, h, lat = q_nope.shape[0], q_nope.shape[1], w_k.shape[-1]
    dt = q_nope.dtype
    out = q_nope.new_empty(n, h, w_v.shape[1])
    step = token_chunk(slots.shape[1], cache.shape[1], h)
    for a in range(0, n, step):
        b = min(n, a + step)
        rows = cache[slots[a:b]].to(dt)  # [n, K, L + Dr]
        c = rows[..., :lat]
        q_lat = torch.einsum("thd,hdl->thl", q_nope[a:b], w_k)  # [n, H, L]
        s = torch.bmm(q_lat.float(), c.float().transpose(1, 2))  # [n, H, K]
        if rows.shape[-1] > lat:
            s += torch.bmm(q_rope[a:b].float(), rows[..., lat:].float().transpose(1, 2))
        ok = allowed[a:b, None, :]
        p = torch.softmax((s * scale).masked_fill(~ok, float("-inf")), dim=-1)
        p = p.masked_fill(~ok.any(-1, keepdim=True), 0.0)  # none allowed: 0, not NaN
        o_lat = torch.bmm(p.to(dt), c)  # [n, H, L]
        out[a:b] = torch.einsum("thl,hvl->thv", o_lat, w_v)
    return out


def expanded(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    layout: tuple,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill rows (expanded form above) -> (their tokens [n], outputs [n, H, Dv])."""
    tok, sel, slots, held, allowed = layout
    dt, lat = q_nope.dtype, w_k.shape[-1]
    rows = cache[slots].to(dt).masked_fill(~held[..., None], 0)  # [R, L, L + Dr]; unread: zeros
    c, k_r = rows[..., :lat], rows[..., lat:]
    k_nope = torch.einsum("rjl,hdl->rhjd", c, w_k)  # [R, H, L, Dn]
    v = torch.einsum("rjl,hvl->rhjv", c, w_v)  # [R, H, L, Dv]
    h = k_nope.shape[1]
    k = torch.cat((k_nope, k_r[:, None].expand(-1, h, -1, -1)), dim=-1)  # [R, H, L, Dn + Dr]
    q = torch.cat((q_nope, q_rope), dim=-1)[tok].transpose(1, 2)  # [R, H, Q, Dn + Dr]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        if allowed is None:  # one fresh prompt: its queries are its keys
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], scale=scale)
    o = o.transpose(1, 2).reshape(-1, h, v.shape[-1])  # [R * Q, H, Dv]
    return tok.reshape(-1)[sel], o[sel]


@register(
    "mla_attention",
    "batched",
    Capabilities(features=frozenset({"causal", "select"}), priority=5),
)
def mla_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    meta: PagedMeta,
    scale: float,
    select: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_nope [T, H, Dn], q_rope [T, H, Dr] (Dr may be 0), cache [N, L + Dr] (a view of the
    paged pool), w_k [H, Dn, L], w_v [H, Dv, L], select [T, K] positions or None -> [T, H, Dv]."""
    if select is not None:
        memo = meta.memo.get(("mla", "select"))
        if memo is None or memo[0] is not select:  # a reuse layer shares its indexer's layout
            memo = (select, *_select_layout(meta, select))
            meta.memo[("mla", "select")] = memo
        return _absorbed(q_nope, q_rope, cache, w_k, w_v, memo[1], memo[2], scale)
    layout = dense_layout(meta)
    out = q_nope.new_zeros(q_nope.shape[0], q_nope.shape[1], w_v.shape[1])
    if layout["dec"] is not None:
        tok, slots, allowed = layout["dec"]
        out[tok] = _absorbed(q_nope[tok], q_rope[tok], cache, w_k, w_v, slots, allowed, scale)
    if layout["pre"] is not None:
        tok, o = expanded(q_nope, q_rope, cache, w_k, w_v, layout["pre"], scale)
        out[tok] = o
    return out
