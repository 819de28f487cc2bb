"""The decode step of Kimi delta attention and the gated delta rule in Triton, and of the short
convolution before them (`short_conv`, a program a (row, block of channels)): one launch a layer
where the batched torch step (kernels/batched/linear_attention.py) takes about a dozen, each
reading or writing every row's [H, Dk, Dv] fp32 state.

A program takes one row r, one value head j and a block of BV value columns (a column of the
state evolves alone), with q / k head j // rep (rep = HV / H):

    q, k <- l2norm(q), l2norm(k) (x / sqrt(sum x^2 + 1e-6)); q <- q / sqrt(Dk)
    S <- decay S       decay [Dk] = exp(g[r, j]) (KDA: per key channel) or exp(g[r, j]) (one a head)
    S <- S + k (beta (v - S^T k))^T;   o = S^T q                              (fp32)

S [Dk, BV] comes from the row's slot (zeros where the row is fresh) and goes back there (a
verify step's rows of `steps` tokens: each token in turn, S after it to its checkpoint slot). The
grid depends only on the shapes and every index is read on the device: graph-safe (a graph's
padding rows read and write the pool's scratch slot, fresh). Any other step (a prompt's chunk)
goes to fla-core's kernels where they are registered (CUDA), else to the reference's chunked
form: the decode step is captured, prefill runs the chunked kernels eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from dayzero.kernels.batched import linear_attention as batched
from dayzero.kernels.reference import linear_attention as ref
from dayzero.kernels.registry import KERNELS


@triton.jit
def _delta_step(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, slot_ptr, fresh_ptr, ckpt_ptr, HV, REP, DV, STEPS,
    stride_qr, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_gr, stride_gh,
    stride_br, stride_ss, stride_sh, scale,
    DK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PER_CHANNEL: tl.constexpr, CKPT: tl.constexpr,
):  # fmt: skip
    r, j, pid = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    h = j // REP
    kk = tl.arange(0, BK)
    k_ok = kk < DK
    vv = pid * BV + tl.arange(0, BV)
    v_ok = vv < DV
    slot = tl.load(slot_ptr + r)
    m = k_ok[:, None] & v_ok[None, :]
    cell = j * stride_sh + kk[:, None] * DV + vv[None, :]
    s = tl.load(s_ptr + slot * stride_ss + cell, mask=m, other=0.0)  # [BK, BV]
    s = tl.where(tl.load(fresh_ptr + r) != 0, 0.0, s)  # a fresh row's slot is not read
    for t in range(STEPS):  # the row's tokens in order, S in registers between them
        tok = r * STEPS + t
        q = tl.load(q_ptr + tok * stride_qr + h * stride_qh + kk, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tok * stride_kr + h * stride_kh + kk, mask=k_ok, other=0.0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        if PER_CHANNEL:
            g = tl.load(g_ptr + tok * stride_gr + j * stride_gh + kk, mask=k_ok, other=0.0).to(tl.float32)
        else:
            g = tl.load(g_ptr + tok * stride_gr + j * stride_gh).to(tl.float32) + tl.zeros((BK,), tl.float32)
        beta = tl.load(b_ptr + tok * stride_br + j).to(tl.float32)
        v = tl.load(v_ptr + tok * stride_vr + j * stride_vh + vv, mask=v_ok, other=0.0).to(tl.float32)
        s = s * tl.exp(g)[:, None]
        delta = (v - tl.sum(k[:, None] * s, 0)) * beta  # [BV]
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(q[:, None] * s, 0)
        dst = tl.load(ckpt_ptr + tok) if CKPT else slot  # the state after this token
        tl.store(s_ptr + dst * stride_ss + cell, s, mask=m)
        tl.store(o_ptr + (tok * HV + j) * DV + vv, o.to(o_ptr.dtype.element_ty), mask=v_ok)


def _step(q, k, v, g, beta, state, meta, per_channel: bool) -> torch.Tensor:
    t, hv, dv = v.shape
    dk = q.shape[-1]
    o = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)
    r = t // meta.steps
    if r == 0:
        return o
    bk = triton.next_power_of_2(dk)
    bv = min(triton.next_power_of_2(dv), max(16, 4096 // bk))  # S's block within 4,096 fp32
    ckpt = meta.checkpoints
    _delta_step[(r, hv, triton.cdiv(dv, bv))](
        q, k, v, g, beta, state, o, meta.slots, meta.fresh, meta.slots if ckpt is None else ckpt, hv,
        hv // q.shape[1], dv, meta.steps, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), g.stride(0), g.stride(1), beta.stride(0), state.stride(0), state.stride(1), dk**-0.5,
        DK=dk, BK=bk, BV=bv, PER_CHANNEL=per_channel, CKPT=ckpt is not None,
    )  # fmt: skip
    return o


@triton.jit
def _conv_step(
    x_ptr, w_ptr, s_ptr, y_ptr, slot_ptr, fresh_ptr, ckpt_ptr, C, STEPS, stride_x, stride_ss, stride_sc,
    K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr, CKPT: tl.constexpr,
):  # fmt: skip
    r, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    c = pid * BC + tl.arange(0, BC)
    c_ok = c < C
    i = tl.arange(0, KP)
    dt = y_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + r)
    keep = tl.load(fresh_ptr + r) == 0
    taps = c[:, None] * stride_sc + i[None, :]  # [BC, KP]: taps 0 .. K - 2 of a slot
    hist = c_ok[:, None] & (i < K - 1)[None, :]
    u = tl.load(s_ptr + slot * stride_ss + taps, mask=hist & keep, other=0.0).to(dt).to(tl.float32)
    w = tl.load(w_ptr + c[:, None] * K + i[None, :], mask=c_ok[:, None] & (i < K)[None, :], other=0.0)
    down = (i[None, :] == i[:, None] + 1).to(tl.float32)  # [KP, KP]: tap a takes tap a + 1
    for t in range(STEPS):  # the row's tokens in order
        tok = r * STEPS + t
        x = tl.load(x_ptr + tok * stride_x + c, mask=c_ok, other=0.0).to(tl.float32)
        u = tl.where((i == K - 1)[None, :], x[:, None], u)  # tap K - 1: this token
        y = tl.sum(u * w.to(tl.float32), 1)  # [BC]
        tl.store(y_ptr + tok * C + c, (y / (1.0 + tl.exp(-y))).to(dt), mask=c_ok)
        u = tl.sum(u[:, None, :] * down[None, :, :], 2)  # the slot keeps the last K - 1 inputs (exact)
        dst = tl.load(ckpt_ptr + tok) if CKPT else slot
        tl.store(s_ptr + dst * stride_ss + taps, u.to(dt).to(s_ptr.dtype.element_ty), mask=hist)


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, meta) -> torch.Tensor:
    """The short convolution (kernels/batched: `short_conv`): a decode step here, one program a
    (row, block of channels) over the row's `steps` tokens: u = [the slot's K - 1 inputs ; this
    token], y = silu(sum_i w_i u_i) (fp32 sums of the inputs in x's dtype), u shifted by one and
    written after each token to the slot (or its checkpoint); other steps batched."""
    t, c = x.shape
    k = weight.shape[-1]
    usable = x.stride(-1) == 1 and weight.is_contiguous() and state.stride(-1) == 1 and k >= 2
    if not (meta.decode and meta.slots is not None and usable):
        return batched.short_conv(x, weight, state, meta)
    y = torch.empty(t, c, dtype=x.dtype, device=x.device)
    r, ckpt = t // meta.steps, meta.checkpoints
    if r:
        bc = min(256, triton.next_power_of_2(c))
        _conv_step[(r, triton.cdiv(c, bc))](
            x, weight, state, y, meta.slots, meta.fresh, meta.slots if ckpt is None else ckpt, c, meta.steps,
            x.stride(0), state.stride(0), state.stride(1),
            K=k, KP=triton.next_power_of_2(k), BC=bc, CKPT=ckpt is not None,
        )  # fmt: skip
    return y


@triton.jit
def _softplus(a):
    """log1p(exp(a)) in fp32, linear past 20; log1p(e) as log(u) e / (u - 1), u = 1 + e (exact where
    1 + e rounds: Goldberg), so a very negative a keeps its relative precision."""
    e = tl.exp(tl.minimum(a, 20.0))
    u = 1.0 + e
    sp = tl.where(u == 1.0, e, tl.log(u) * e / tl.where(u == 1.0, 1.0, u - 1.0))
    return tl.where(a > 20.0, a, sp)


@triton.jit
def _kda_gates(
    f_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, H, D, stride_f, stride_b, lower_bound,
    BD: tl.constexpr, BOUNDED: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    t, h = (r // H).to(tl.int64), r % H
    d = tl.arange(0, BD)
    m = d < D
    f = tl.load(f_ptr + t * stride_f + h * D + d, mask=m, other=0.0).to(tl.float32)
    f = f + tl.load(dtb_ptr + h * D + d, mask=m, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    g = lower_bound * (1.0 / (1.0 + tl.exp(-(a * f)))) if BOUNDED else -a * _softplus(f)
    tl.store(g_ptr + r.to(tl.int64) * D + d, g, mask=m)
    b = tl.load(b_ptr + t * stride_b + h).to(tl.float32)
    tl.store(beta_ptr + r, (1.0 / (1.0 + tl.exp(-b))).to(beta_ptr.dtype.element_ty))


def kda_gates(
    f: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA's gates (kernels/reference: `kda_gates`) in one launch: a program a (token, head)."""
    if f.stride(-1) != 1 or b.stride(-1) != 1:
        return ref.kda_gates(f, b, a_log, dt_bias, lower_bound)
    t, h = b.shape
    d = f.shape[1] // h
    g = torch.empty(t, h, d, dtype=torch.float32, device=f.device)
    beta = torch.empty(t, h, dtype=b.dtype, device=b.device)
    if t:
        _kda_gates[(t * h,)](
            f, b, a_log.contiguous(), dt_bias.contiguous(), g, beta, h, d, f.stride(0), b.stride(0),
            0.0 if lower_bound is None else lower_bound, BD=triton.next_power_of_2(d),
            BOUNDED=lower_bound is not None,
        )  # fmt: skip
    return g, beta


@triton.jit
def _gdn_gates(
    b_ptr, a_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, HV, stride_b, stride_a, BH: tl.constexpr
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BH)
    m = j < HV
    a = tl.load(a_ptr + t * stride_a + j, mask=m, other=0.0).to(tl.float32)
    a = a + tl.load(dtb_ptr + j, mask=m, other=0.0).to(tl.float32)
    g = -tl.exp(tl.load(alog_ptr + j, mask=m, other=0.0).to(tl.float32)) * _softplus(a)
    tl.store(g_ptr + t * HV + j, g, mask=m)
    b = tl.load(b_ptr + t * stride_b + j, mask=m, other=0.0).to(tl.float32)
    tl.store(beta_ptr + t * HV + j, (1.0 / (1.0 + tl.exp(-b))).to(beta_ptr.dtype.element_ty), mask=m)


def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's gates (kernels/reference: `gdn_gates`) in one launch: a program a token."""
    if b.stride(-1) != 1 or a.stride(-1) != 1:
        return ref.gdn_gates(b, a, a_log, dt_bias)
    t, hv = b.shape
    g = torch.empty(t, hv, dtype=torch.float32, device=b.device)
    beta = torch.empty(t, hv, dtype=b.dtype, device=b.device)
    if t:
        _gdn_gates[(t,)](
            b, a, a_log.contiguous(), dt_bias.contiguous(), g, beta, hv, b.stride(0), a.stride(0),
            BH=triton.next_power_of_2(hv),
        )  # fmt: skip
    return g, beta


def _bind(op: str, per_channel: bool) -> Callable:
    """`op` (kda_recurrence or gated_delta_rule): the decode step here, any other step through
    fla-core's kernel where registered, else the batched backend (the reference's chunked form)."""
    fallback = batched.kda_recurrence if op == "kda_recurrence" else batched.gated_delta_rule

    def run(q, k, v, g, beta, state, meta, chunked: bool = True) -> torch.Tensor:
        last = (q, k, v, g, beta)
        dk, dv = state.shape[-2:]  # a slot's rows may sit apart in the pool; within one, dense
        dense = state.stride(3) == 1 and state.stride(2) == dv and state.stride(1) == dk * dv
        usable = dense and all(x.stride(-1) == 1 for x in last) and beta.dim() == 2
        if not (meta.decode and meta.slots is not None and usable):
            other = KERNELS.get(f"{op}/fla").fn if f"{op}/fla" in KERNELS else fallback
            return other(q, k, v, g, beta, state, meta, chunked)
        return _step(q, k, v, g, beta, state, meta, per_channel)

    run.__name__ = run.__qualname__ = f"{op}_triton"
    run.__doc__ = f"{op}: the decode step in Triton, other steps chunked (fla-core or the reference)."
    return run


kda_recurrence = _bind("kda_recurrence", per_channel=True)
gated_delta_rule = _bind("gated_delta_rule", per_channel=False)
