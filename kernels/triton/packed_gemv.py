"""Weight-only GEMV on packed weights for decode shapes (a few rows a weight), on the CUDA cores:
one program a (row, BN output rows) tile streams its weights' bytes once and never widens a
weight to fp32. The math (kernels/packed.py):

  y[n] = sum_b s[n, b] * sum_{k in b} v(codes[n, k]) x[k]          b: sub-blocks of 16 elements
  s[n, b] = scale[n, 16 b // G] (* global[n])    G = 16 (nvfp4), 32 (mxfp4), 128 (fp8_block)

The inner sum runs in fp16 over 16 elements: x is taken to fp16 times a power of two 2^c chosen
per row so that max|x| 2^c <= 2^XE (nothing of a bf16 x is lost above 2^-28 of its max), a 4-bit
code is its value times 2^-14 as fp16 bits (three bit operations, `_e2m1`), an fp8 code widens
to fp16 exactly. With XE = 14 (4-bit: |v 2^-14| <= 6 2^-14) or 2 (fp8: |v| <= 448) a product is
at most 6 / 1,792 and a sub-block's sum at most 96 / 28,672, inside fp16's range; each sub-block
sum then leaves fp16 for good: times its scale in fp32, and y = acc 2^(14 or 0) / 2^c.
Rounding differs from the reference (weights rounded to bf16, fp32 products) by the fp16 sums'
about 2^-11 relative error. An fp32 x (an fp32 model) keeps fp32 products and sums.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1(c):
    """4-bit codes -> value * 2^-14 as fp16: the sign to bit 15, the 3 magnitude bits to bits 9-11
    (fp16's exponent bias 15 against E2M1's 1 makes every code exact, the subnormal 0.5 too)."""
    bits = ((c & 7).to(tl.uint16) << 9) | ((c & 8).to(tl.uint16) << 12)
    return bits.to(tl.float16, bitcast=True)


@triton.jit
def _fp16_row(xrow, K: tl.constexpr, XE: tl.constexpr, XB: tl.constexpr):
    """2^c with max|x| 2^c <= 2^XE (1 for a zero row)."""
    amax = tl.zeros((XB,), tl.float32)
    for k0 in range(0, K, XB):
        o = k0 + tl.arange(0, XB)
        amax = tl.maximum(amax, tl.abs(tl.load(xrow + o, mask=o < K, other=0.0).to(tl.float32)))
    m = tl.max(amax, 0)
    return tl.where(m > 0, tl.exp2(XE - tl.ceil(tl.log2(tl.maximum(m, 1e-30)))), 1.0)


@triton.jit
def packed_gemv(
    x_ptr, y_ptr, codes_ptr, scale_ptr, glob_ptr, ids_ptr, N, K: tl.constexpr,
    stride_xm, stride_ym, stride_ce, stride_cn, stride_se, stride_sn, stride_ge, x_row_div,
    FMT: tl.constexpr, INDIRECT: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr, F16: tl.constexpr,
):  # fmt: skip
    """y[r, n-tile] = W_e x[r // x_row_div]; e = ids_ptr[r] when INDIRECT (a (token, slot) pair
    reads its expert in place; -1: no expert, nothing read or written), else 0. FMT: 0 nvfp4,
    1 mxfp4, 2 fp8_block; NB sub-blocks of 16 elements a loop step; F16 False (fp32 x): the sums
    in fp32, x as it is."""
    r, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + r).to(tl.int64) if INDIRECT else 0
    if e < 0:  # no expert (INDIRECT, id -1): nothing read or written
        return
    xrow = x_ptr + (r // x_row_div).to(tl.int64) * stride_xm
    XE: tl.constexpr = 14 if FMT < 2 else 2
    G: tl.constexpr = 16 if FMT == 0 else (32 if FMT == 1 else 128)
    SB: tl.constexpr = 8 if FMT < 2 else 16  # bytes of a 16-element sub-block
    dt: tl.constexpr = tl.float16 if F16 else tl.float32
    xs = _fp16_row(xrow, K, XE, 1024) if F16 else 1.0
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    wbase = codes_ptr + e * stride_ce + offs_n.to(tl.int64) * stride_cn  # [BN]
    sbase = scale_ptr + e * stride_se + offs_n.to(tl.int64) * stride_sn
    glob = tl.full((BN,), 1.0, tl.float32)
    if FMT == 0:
        glob = tl.load(glob_ptr + e * stride_ge + offs_n, mask=n_ok, other=0.0)
    j, b = tl.arange(0, NB), tl.arange(0, SB)
    acc = tl.zeros((BN,), tl.float32)
    for s0 in range(0, tl.cdiv(K, 16), NB):
        sub = s0 + j  # [NB]
        byte = sub[:, None] * SB + b[None, :]  # [NB, SB]
        lim = K // 2 if FMT < 2 else K
        b_ok = byte < lim
        cm = n_ok[:, None, None] & b_ok[None]
        c = tl.load(wbase[:, None, None] + byte[None, :, :], mask=cm)  # no `other`: e4m3 takes none
        if FMT < 2:
            c = tl.where(cm, c, 0)  # two codes a byte, the low nibble the even element
            xe = (tl.load(xrow + 2 * byte, mask=b_ok, other=0.0).to(tl.float32) * xs).to(dt)
            xo = (tl.load(xrow + 2 * byte + 1, mask=b_ok, other=0.0).to(tl.float32) * xs).to(dt)
            part = tl.sum(_e2m1(c & 15).to(dt) * xe[None] + _e2m1(c >> 4).to(dt) * xo[None], axis=2)
        else:
            xv = (tl.load(xrow + byte, mask=b_ok, other=0.0).to(tl.float32) * xs).to(dt)
            part = tl.sum(tl.where(cm, c.to(dt), 0.0) * xv[None], axis=2)  # [BN, NB]
        s_ok = n_ok[:, None] & (sub < tl.cdiv(K, 16))[None, :]
        s = tl.load(sbase[:, None] + (sub * 16 // G)[None, :], mask=s_ok)  # e4m3 / e8m0 / fp32 [BN, NB]
        if FMT == 0:
            s = s.to(tl.float32) * glob[:, None]
        elif FMT == 1:
            s = tl.exp2(s.to(tl.float32) - 127.0)
        s = tl.where(s_ok, s, 0.0)  # masked e4m3 loads take no `other`
        acc += tl.sum(part.to(tl.float32) * s, axis=1)
    out = acc * ((16384.0 if FMT < 2 else 1.0) / xs)
    tl.store(y_ptr + r.to(tl.int64) * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_ok)


# One 16-element sub-block of 4-bit codes (two 32-bit words; element i of a word in bits
# 4i..4i+3) against its x, eight fp16 pairs read from the address given (two 16-byte loads, the
# pair order of `pack_x_fp16`) -> the 16 products summed, as fp32. A pair of codes (i, i + 4) is
# decoded in three integer operations into two fp16 lanes of value * 2^-14 (the nibbles brought
# to bits 12-15 / 28-31 by a shift: the sign stays, the magnitude goes to bits 9-11, as `_e2m1`),
# then one fp16x2 FMA; each lane sums 8 products in fp16, the two lanes are added in fp32.
def _fp4x16_ptx() -> str:
    """The PTX of `_fp4x16_dot`: per word (w0 with x0..x3, w1 with x4..x7) its four code pairs,
    the one already at bits 12-15 / 28-31 first, then those a left shift of 4, 8, 12 brings there."""
    lines = [
        "{",
        ".reg .b32 w0, w1, q, m, h, acc, x0, x1, x2, x3, x4, x5, x6, x7;",
        ".reg .b16 lo, hi;",
        ".reg .f32 flo, fhi;",
        "mov.b64 {w0, w1}, $1;",
        "ld.global.nc.v4.b32 {x0, x1, x2, x3}, [$2];",
        "ld.global.nc.v4.b32 {x4, x5, x6, x7}, [$2+16];",
    ]
    for word, xs in (("w0", (3, 2, 1, 0)), ("w1", (7, 6, 5, 4))):
        for shift, x in zip((0, 4, 8, 12), xs, strict=True):
            src = word if shift == 0 else "q"
            if shift:
                lines.append(f"shl.b32 q, {word}, {shift};")
            lines += [
                f"and.b32 m, {src}, 0x70007000;",  # the magnitudes, to bits 9-11 / 25-27
                "shr.b32 m, m, 3;",
                f"lop3.b32 h, {src}, 0x80008000, m, 0xEA;",  # (src & signs) | m
                "mul.rn.f16x2 acc, h, x3;" if x == 3 else f"fma.rn.f16x2 acc, h, x{x}, acc;",
            ]
    lines += [
        "mov.b32 {lo, hi}, acc;",
        "cvt.f32.f16 flo, lo;",
        "cvt.f32.f16 fhi, hi;",
        "add.f32 $0, flo, fhi;",
    ]
    return "\n" + "\n".join([*lines, "}"]) + "\n"


_FP4X16_DOT = tl.constexpr(_fp4x16_ptx())


@triton.jit
def _fp4x16_dot(w, xaddr):
    return tl.inline_asm_elementwise(
        _FP4X16_DOT, "=f,l,l", [w, xaddr], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _f16x2(lo, hi):
    """Two fp32 -> one word of two fp16 (lo in the low half), rounded to nearest."""
    return tl.inline_asm_elementwise(
        "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def pack_x_fp16(x_ptr, xq_ptr, xs_ptr, K: tl.constexpr, stride_xm, BK: tl.constexpr):
    """Row r of x -> xs[r] = 2^c (max|x| 2^c <= 2^14, as `_fp16_row`) and xq[r] [K / 2] words:
    word 4w + i holds fp16(x[8w + i] 2^c) low, fp16(x[8w + i + 4] 2^c) high, the pair order of
    `_fp4x16_dot`."""
    r = tl.program_id(0).to(tl.int64)
    xrow = x_ptr + r * stride_xm
    xs = _fp16_row(xrow, K, 14, BK)
    tl.store(xs_ptr + r, xs)
    for k0 in range(0, K // 2, BK):
        o = k0 + tl.arange(0, BK)  # word index: elements 8 (o // 4) + o % 4 and that + 4
        e = 8 * (o // 4) + o % 4
        ok = o < K // 2
        lo = tl.load(xrow + e, mask=ok, other=0.0).to(tl.float32) * xs
        hi = tl.load(xrow + e + 4, mask=ok, other=0.0).to(tl.float32) * xs
        tl.store(xq_ptr + r * (K // 2) + o, _f16x2(lo, hi), mask=ok)


@triton.jit
def packed_gemv_fp4(
    xq_ptr, xs_ptr, y_ptr, codes_ptr, scale_ptr, glob_ptr, ids_ptr, N, K: tl.constexpr,
    stride_ym, stride_ce, stride_cn, stride_se, stride_sn, stride_ge, x_row_div,
    FMT: tl.constexpr, INDIRECT: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """`packed_gemv` for 4-bit codes on CUDA (PTX decode, K % 16 == 0): codes_ptr is the codes
    as int64 sub-blocks of 16 (strides in sub-blocks), x comes packed by `pack_x_fp16` (xq, xs).
    Each program keeps a [BN, NB] fp32 sum (sub-block sums times their scales) and reduces it
    once at the end. An INDIRECT pair of id -1 (no expert) reads and writes nothing."""
    r, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + r).to(tl.int64) if INDIRECT else 0
    if e < 0:  # no expert (INDIRECT, id -1): nothing read or written
        return
    xr = (r // x_row_div).to(tl.int64)
    G: tl.constexpr = 16 if FMT == 0 else 32
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    wbase = codes_ptr + e * stride_ce + offs_n.to(tl.int64) * stride_cn  # [BN] sub-blocks
    sbase = scale_ptr + e * stride_se + offs_n.to(tl.int64) * stride_sn
    glob = tl.full((BN,), 1.0, tl.float32)
    if FMT == 0:
        glob = tl.load(glob_ptr + e * stride_ge + offs_n, mask=n_ok, other=0.0)
    j = tl.arange(0, NB)
    zero = tl.zeros((BN, NB), tl.int64)
    acc = tl.zeros((BN, NB), tl.float32)
    sub = j  # [NB]
    m = n_ok[:, None] & (sub < K // 16)[None, :]
    w = tl.load(wbase[:, None] + sub[None, :], mask=m, other=0)  # [BN, NB] int64
    s = tl.load(sbase[:, None] + (sub * 16 // G)[None, :], mask=m)  # e4m3 / e8m0
    for s0 in range(0, K // 16, NB):
        # the next step's codes and scales are loaded before this step's math (two in flight)
        w_now, s_now, m_now, sub_now = w, s, m, sub
        sub = s0 + NB + j
        m = n_ok[:, None] & (sub < K // 16)[None, :]
        w = tl.load(wbase[:, None] + sub[None, :], mask=m, other=0)
        s = tl.load(sbase[:, None] + (sub * 16 // G)[None, :], mask=m)
        # the sub-block's 8 x words (32 bytes) start at xq[xr, 8 sub]; a masked column reads xq[xr, 0]
        xaddr = (xq_ptr + xr * (K // 2) + 8 * tl.where(sub_now < K // 16, sub_now, 0)).to(tl.int64)
        part = _fp4x16_dot(w_now, zero + xaddr[None, :])  # [BN, NB]
        sf = s_now.to(tl.float32) * glob[:, None] if FMT == 0 else tl.exp2(s_now.to(tl.float32) - 127.0)
        acc += part * tl.where(m_now, sf, 0.0)
    out = tl.sum(acc, axis=1) * (16384.0 / tl.load(xs_ptr + xr))
    tl.store(y_ptr + r.to(tl.int64) * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_ok)
