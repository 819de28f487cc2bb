"""Fused small ops in Triton: one launch where the reference takes three to fifteen (a decode step
calls each about twice a layer). The math and every rounding are the reference's
(kernels/reference/basic.py), in fp32 with the intermediates rounded to the input's dtype where
the unfused ops round them:

  add_rms_norm  y <- rmsnorm(y, w_post) (sandwich); x' = x + y, or x a + y b (depth-scaled);
                h = rmsnorm(x', w)                                       -> (x', h)  [T, D]
  norm_rope     per head vector [T, H, D] (or [T, D]): rmsnorm(w) -> a rope(p) -> * (1 + (p + 1) / base) ** e;
                `rope` is its rotation alone: angle[t, j] = p_t inv_freq[j], neox pairs channel j with
                j + R/2, else 2j with 2j + 1; (a, b) -> (a cos - b sin, b cos + a sin); channels
                past R pass through
  sigmoid_gate  o * sigmoid(g (+ b[h]))                                           [T, H, D]
  swiglu        act(min(g, limit)) * clamp(u, -limit, limit)  (fp32: rounded once)  [T, I];
                act: silu, gelu (tanh approximation), g sigmoid(alpha g) with u + 1 (clamped_swiglu),
                or SiTU (kernels/triton/act.py)
  kv_write      k_cache[slots[t]] = k[t], v_cache[slots[t]] = v[t]      [T, Hk, D] each
  qk_norm_rope_write  q' = norm_rope(q) (with its log scaling), k' = norm_rope(k), kv_write(k', v)

rmsnorm(v, w) = v / sqrt(mean(v^2) + eps) * w; weight_in_fp32: w * h rounded once, else h
rounded, then times w (rounded). Rows may be strided views (q / k / gate slices of one fused
projection are read in place); the last dim is contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dayzero.kernels.ops import DEFAULT_CONSTS, HeadPrep
from dayzero.kernels.reference import attention as ref_attention
from dayzero.kernels.reference import basic
from dayzero.kernels.triton.act import ACT_CODES, _tanh
from dayzero.kernels.triton.norm import _rows


@triton.jit
def _scaled_norm(v, w, r, dt: tl.constexpr, W_FP32: tl.constexpr):
    """w * (v * r) with the reference's rounding; fp32 out holding a dt value."""
    if W_FP32:
        return (w * (v * r)).to(dt).to(tl.float32)
    return (w * (v * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def _add_rms_norm(
    x_ptr, y_ptr, w_ptr, pw_ptr, xo_ptr, h_ptr, D, stride_x, stride_y, eps, a, b,
    BD: tl.constexpr, POST: tl.constexpr, SCALED: tl.constexpr, W_FP32: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    m = d < D
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * stride_x + d, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + t * stride_y + d, mask=m, other=0.0).to(tl.float32)
    if POST:
        pw = tl.load(pw_ptr + d, mask=m, other=0.0).to(tl.float32)
        y = _scaled_norm(y, pw, tl.rsqrt(tl.sum(y * y, 0) / D + eps), dt, W_FP32)
    if SCALED:  # noqa: SIM108  (a constexpr branch)
        s = (y * b).to(dt).to(tl.float32) + (x * a).to(dt).to(tl.float32)
    else:
        s = x + y
    s = s.to(dt).to(tl.float32)
    tl.store(xo_ptr + t * D + d, s.to(dt), mask=m)
    w = tl.load(w_ptr + d, mask=m, other=0.0).to(tl.float32)
    h = _scaled_norm(s, w, tl.rsqrt(tl.sum(s * s, 0) / D + eps), dt, W_FP32)
    tl.store(h_ptr + t * D + d, h.to(dt), mask=m)


def add_rms_norm(
    x: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_in_fp32: bool = False,
    post_weight: torch.Tensor | None = None,
    scales: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    odd = x.dim() != 2 or y.shape != x.shape or x.stride(-1) != 1 or y.stride(-1) != 1
    if odd or weight.dtype != x.dtype or y.dtype != x.dtype:  # the reference's dtype promotion
        return basic.add_rms_norm(x, y, weight, eps, weight_in_fp32, post_weight, scales)
    t, d = x.shape
    xo, h = torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(x)
    if t:
        a, b = scales or (1.0, 1.0)
        pw = weight if post_weight is None else post_weight
        _add_rms_norm[(t,)](
            x, y, weight, pw, xo, h, d, x.stride(0), y.stride(0), eps, a, b,
            BD=triton.next_power_of_2(d), POST=post_weight is not None, SCALED=scales is not None,
            W_FP32=weight_in_fp32, num_warps=8 if d > 2048 else 4,
        )  # fmt: skip
    return xo, h


@triton.jit
def _load_normed(base, w_ptr, idx, mask, r, dt: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr):
    v = tl.load(base + idx, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        v = _scaled_norm(v, tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32), r, dt, W_FP32)
    return v


@triton.jit
def _norm_rope_row(
    src, out, w_ptr, f_ptr, p, D, eps, sc, factor, dt: tl.constexpr,
    HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
    ROPE: tl.constexpr, NEOX: tl.constexpr, SCALE: tl.constexpr, FACTOR: tl.constexpr,
):  # fmt: skip
    """One head vector src [D] -> out [D]: rmsnorm, rope at position p, times sc (SCALE)."""
    d = tl.arange(0, BD)
    r = 0.0
    if NORM:
        x = tl.load(src + d, mask=d < D, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    if ROPE:
        j = tl.arange(0, BH)
        jm = j < HALF
        ang = p * tl.load(f_ptr + j, mask=jm, other=0.0).to(tl.float32)
        c, s = tl.cos(ang), tl.sin(ang)
        i1 = j if NEOX else 2 * j
        i2 = j + HALF if NEOX else 2 * j + 1
        a = _load_normed(src, w_ptr, i1, jm, r, dt, NORM, W_FP32)
        b = _load_normed(src, w_ptr, i2, jm, r, dt, NORM, W_FP32)
        ya = (a * c - b * s).to(dt).to(tl.float32)
        yb = (b * c + a * s).to(dt).to(tl.float32)
        if FACTOR:
            ya, yb = (ya * factor).to(dt).to(tl.float32), (yb * factor).to(dt).to(tl.float32)
        if SCALE:
            ya, yb = ya * sc, yb * sc
        tl.store(out + i1, ya.to(dt), mask=jm)
        tl.store(out + i2, yb.to(dt), mask=jm)
    rest = (d >= 2 * HALF) & (d < D)
    v = _load_normed(src, w_ptr, d, rest, r, dt, NORM, W_FP32)
    if SCALE:
        v = v * sc
    tl.store(out + d, v.to(dt), mask=rest)


@triton.jit
def _log_scale(p, base, exponent):
    return tl.exp(exponent * tl.log(1.0 + (p + 1.0) / base))


@triton.jit
def _norm_rope(
    x_ptr, pos_ptr, w_ptr, f_ptr, y_ptr, H, stride_t, stride_h, D, eps, base, exponent, factor,
    HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
    ROPE: tl.constexpr, NEOX: tl.constexpr, SCALE: tl.constexpr, FACTOR: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    t, h = row // H, row % H
    p = tl.load(pos_ptr + t).to(tl.float32)
    sc = _log_scale(p, base, exponent) if SCALE else 1.0
    _norm_rope_row(
        x_ptr + t.to(tl.int64) * stride_t + h * stride_h, y_ptr + row.to(tl.int64) * D, w_ptr, f_ptr, p,
        D, eps, sc, factor, y_ptr.dtype.element_ty, HALF, BH, BD, NORM, W_FP32, ROPE, NEOX, SCALE, FACTOR,
    )  # fmt: skip


@triton.jit
def _qk_norm_rope_write(
    q_ptr, k_ptr, v_ptr, pos_ptr, wq_ptr, wk_ptr, f_ptr, y_ptr, kc_ptr, vc_ptr, slots_ptr, H, Hk,
    sqt, sqh, skt, skh, svt, svh, skc, skch, svc, svch, D, eps, base, exponent, factor,
    HALF: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, NORM: tl.constexpr, W_FP32: tl.constexpr,
    ROPE: tl.constexpr, NEOX: tl.constexpr, SCALE: tl.constexpr, FACTOR: tl.constexpr,
):  # fmt: skip
    """Program (t, h) of H + Hk heads: a query head into y, or a key head into its cache slot
    with the value head beside it."""
    row = tl.program_id(0)
    t, h = (row // (H + Hk)).to(tl.int64), row % (H + Hk)
    p = tl.load(pos_ptr + t).to(tl.float32)
    dt = y_ptr.dtype.element_ty
    if h < H:
        sc = _log_scale(p, base, exponent) if SCALE else 1.0
        _norm_rope_row(
            q_ptr + t * sqt + h * sqh, y_ptr + (t * H + h) * D, wq_ptr, f_ptr, p, D, eps, sc, factor, dt,
            HALF, BH, BD, NORM, W_FP32, ROPE, NEOX, SCALE, FACTOR,
        )  # fmt: skip
    else:
        hk = h - H
        slot = tl.load(slots_ptr + t).to(tl.int64)
        _norm_rope_row(
            k_ptr + t * skt + hk * skh, kc_ptr + slot * skc + hk * skch, wk_ptr, f_ptr, p, D, eps, 1.0,
            factor, dt, HALF, BH, BD, NORM, W_FP32, ROPE, NEOX, False, FACTOR,
        )  # fmt: skip
        d = tl.arange(0, BD)
        v = tl.load(v_ptr + t * svt + hk * svh + d, mask=d < D)
        tl.store(vc_ptr + slot * svc + hk * svch + d, v.to(vc_ptr.dtype.element_ty), mask=d < D)


def norm_rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    weight_in_fp32: bool = False,
    inv_freq: torch.Tensor | None = None,
    neox: bool = True,
    log_scaling: tuple[float, float] | None = None,
    rope_factor: float = 1.0,
) -> torch.Tensor:
    if x.dim() not in (2, 3) or (weight is not None and weight.dtype != x.dtype):
        return basic.norm_rope(
            x, positions, weight, eps, weight_in_fp32, inv_freq, neox, log_scaling, rope_factor
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, h, st, sh = _rows(x)
    half = 0 if inv_freq is None else inv_freq.shape[0]
    base, exponent = log_scaling or (1.0, 0.0)
    if rows:
        _norm_rope[(rows,)](
            x, positions, x if weight is None else weight, x if inv_freq is None else inv_freq, y,
            h, st, sh, x.shape[-1], eps, base, exponent, rope_factor,
            HALF=half, BH=triton.next_power_of_2(max(half, 1)), BD=triton.next_power_of_2(x.shape[-1]),
            NORM=weight is not None, W_FP32=weight_in_fp32, ROPE=inv_freq is not None, NEOX=neox,
            SCALE=log_scaling is not None, FACTOR=inv_freq is not None and rope_factor != 1.0,
        )  # fmt: skip
    return y


def qk_norm_rope_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    prep: HeadPrep,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """norm_rope of q and k and the K/V cache write as one launch (the reference's three)."""
    p = prep
    views = (q, k, v, k_cache, v_cache)
    odd = q.dim() != 3 or any(t.stride(-1) != 1 for t in views) or k_cache.dtype != q.dtype
    if odd or any(w is not None and w.dtype != q.dtype for w in (p.q_weight, p.k_weight)):
        return ref_attention.qk_norm_rope_write(q, k, v, positions, p, k_cache, v_cache, slots)
    (t, h, d), hk = q.shape, k.shape[1]
    y = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    half = 0 if p.inv_freq is None else p.inv_freq.shape[0]
    base, exponent = p.log_scaling or (1.0, 0.0)
    if t:
        _qk_norm_rope_write[(t * (h + hk),)](
            q, k, v, positions, q if p.q_weight is None else p.q_weight,
            q if p.k_weight is None else p.k_weight, q if p.inv_freq is None else p.inv_freq, y,
            k_cache, v_cache, slots, h, hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), d, p.eps, base, exponent, p.rope_factor,
            HALF=half, BH=triton.next_power_of_2(max(half, 1)), BD=triton.next_power_of_2(d),
            NORM=p.q_weight is not None, W_FP32=p.weight_in_fp32, ROPE=p.inv_freq is not None,
            NEOX=p.neox, SCALE=p.log_scaling is not None,
            FACTOR=p.inv_freq is not None and p.rope_factor != 1.0,
        )  # fmt: skip
    return y


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, neox: bool = True) -> torch.Tensor:
    """The `rope` op: norm_rope with only its rotation (x [T, D] or [T, H, D])."""
    return norm_rope(x, positions, inv_freq=inv_freq, neox=neox)


@triton.jit
def _sigmoid_gate(
    o_ptr, g_ptr, b_ptr, y_ptr, H, stride_ot, stride_oh, stride_gt, stride_gh, D,
    BD: tl.constexpr, BIAS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    t, h = (row // H).to(tl.int64), row % H
    d = tl.arange(0, BD)
    m = d < D
    dt = y_ptr.dtype.element_ty
    g = tl.load(g_ptr + t * stride_gt + h * stride_gh + d, mask=m, other=0.0).to(tl.float32)
    if BIAS:
        g = (g + tl.load(b_ptr + h).to(tl.float32)).to(dt).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    o = tl.load(o_ptr + t * stride_ot + h * stride_oh + d, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + row.to(tl.int64) * D + d, (o * s).to(dt), mask=m)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    same = gate.dtype == o.dtype and (bias is None or bias.dtype == o.dtype)
    if o.dim() != 3 or gate.shape != o.shape or not same or o.stride(-1) != 1 or gate.stride(-1) != 1:
        return basic.sigmoid_gate(o, gate, bias)
    t, h, d = o.shape
    y = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    if t:
        _sigmoid_gate[(t * h,)](
            o, gate, o if bias is None else bias, y, h, o.stride(0), o.stride(1), gate.stride(0),
            gate.stride(1), d, BD=triton.next_power_of_2(d), BIAS=bias is not None,
        )  # fmt: skip
    return y


@triton.jit
def _swiglu(
    g_ptr, u_ptr, y_ptr, N, stride_g, stride_u, limit, c0, c1,
    BN: tl.constexpr, FP32: tl.constexpr, LIMIT: tl.constexpr, ACT: tl.constexpr,
):  # fmt: skip
    t, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    n = pid * BN + tl.arange(0, BN)
    m = n < N
    dt = y_ptr.dtype.element_ty
    g = tl.load(g_ptr + t * stride_g + n, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_u + n, mask=m, other=0.0).to(tl.float32)
    if LIMIT:
        g = tl.minimum(g, limit).to(dt).to(tl.float32)
        u = tl.minimum(tl.maximum(u, -limit), limit).to(dt).to(tl.float32)
    if ACT == 0:  # silu
        act = g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # gelu, tanh approximation
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (1.0 + _tanh(z))
    elif ACT == 2:  # clamped_swiglu: g sigmoid(c0 g) (u + 1)
        act = g / (1.0 + tl.exp(-c0 * g))
        u = u + 1.0
        if not FP32:
            u = u.to(dt).to(tl.float32)
    else:  # situ: [c0 tanh(g / c0) sigmoid(g)] [c1 tanh(u / c1)] (c1 = 0: u)
        act = c0 * _tanh(g / c0) / (1.0 + tl.exp(-g))
        u = tl.where(c1 != 0.0, c1 * _tanh(u / tl.where(c1 != 0.0, c1, 1.0)), u)
        if not FP32:
            u = u.to(dt).to(tl.float32)
    if not FP32:
        act = act.to(dt).to(tl.float32)
    tl.store(y_ptr + t * N + n, (act * u).to(dt), mask=m)


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    fp32: bool = False,
    limit: float | None = None,
    act: str = "silu",
    consts: tuple[float, float] = DEFAULT_CONSTS,
) -> torch.Tensor:
    if gate.dim() != 2 or up.shape != gate.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        return basic.swiglu(gate, up, fp32, limit, act, consts)
    t, n = gate.shape
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if t:
        bn = min(1024, triton.next_power_of_2(n))
        _swiglu[(t, triton.cdiv(n, bn))](
            gate, up, y, n, gate.stride(0), up.stride(0), limit or 0.0, *consts,
            BN=bn, FP32=fp32, LIMIT=limit is not None, ACT=ACT_CODES[act],
        )  # fmt: skip
    return y


@triton.jit
def _kv_write(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, Hk, skt, skh, svt, svh, skc, skch, svc, svch, D,
    BD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    t, h = (row // Hk).to(tl.int64), row % Hk
    slot = tl.load(slots_ptr + t).to(tl.int64)
    d = tl.arange(0, BD)
    m = d < D
    dt = kc_ptr.dtype.element_ty
    k = tl.load(k_ptr + t * skt + h * skh + d, mask=m)
    v = tl.load(v_ptr + t * svt + h * svh + d, mask=m)
    tl.store(kc_ptr + slot * skc + h * skch + d, k.to(dt), mask=m)
    tl.store(vc_ptr + slot * svc + h * svch + d, v.to(dt), mask=m)


def kv_write(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """One launch for both caches (the reference's two index writes); strided views in place."""
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return ref_attention.kv_write(k, v, k_cache, v_cache, slots)
    t, hk, d = k.shape
    if t:
        _kv_write[(t * hk,)](
            k, v, k_cache, v_cache, slots, hk, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), d,
            BD=triton.next_power_of_2(d),
        )  # fmt: skip
    return None
