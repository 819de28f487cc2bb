"""Weight-only GEMMs on packed weights in Triton (CUDA): 4-bit (nvfp4, mxfp4) or fp8-block
weights, bf16/fp16 activations, fp32 accumulation. For GPUs without FP4 math (Hopper): each
weight tile is decoded in registers right after it is loaded, so a step reads the packed bytes
only. The math is kernels/packed.py's: W[n, k] = value(codes[n, k]) * (scale[n, k // G] * global[n]),
rounded to the activation dtype before the product on the tensor cores, as the reference does.

Two kernels, each for dense linears and stacked experts: `packed_gemv` (decode, packed_gemv.py:
one row a program on the CUDA cores, fp16 sums of 16 elements; a pair reads its expert by id)
and `_packed_gemm` (tensor-core tiles;
the (token, slot) pairs sorted by expert and padded to whole row blocks by `_align`, on the
device, no host sync; a program takes one block of one expert and one tile of output columns).
Expert id -1 (no expert): the GEMV's program exits before any load, `_align` puts the pair in no
block, and `combine` leaves it out of the token's sum.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from dayzero.kernels.ops import DEFAULT_CONSTS
from dayzero.kernels.packed import PackedWeight
from dayzero.kernels.triton.fused import swiglu  # one launch (the reference's is two to five)
from dayzero.kernels.triton.packed_gemv import _e2m1, pack_x_fp16, packed_gemv, packed_gemv_fp4

FMT = {"nvfp4": 0, "mxfp4": 1, "fp8_block": 2}


@triton.jit
def _fp4_tile(
    wbase, sbase, glob, k0, n_ok, FMT: tl.constexpr, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
):
    """The weights of BK columns from byte column k0, as (even, odd) columns fp32 [BN, BK/2]."""
    G: tl.constexpr = 16 if FMT == 0 else 32
    offs_b = k0 + tl.arange(0, BK // 2)
    c = tl.load(wbase + offs_b[None, :], mask=n_ok[:, None] & (offs_b < K // 2)[None, :], other=0)
    offs_s = (2 * k0) // G + tl.arange(0, BK // G)
    sm = n_ok[:, None] & (offs_s < K // G)[None, :]
    s = tl.load(sbase + offs_s[None, :], mask=sm)  # [BN, BK/G]; no `other`: e4m3 takes none
    if FMT == 0:  # noqa: SIM108  (a compile-time branch in Triton)
        s = s.to(tl.float32) * glob[:, None]
    else:
        s = tl.exp2(s.to(tl.float32) - 127.0)
    s = tl.where(sm, s * 16384.0, 0.0)  # 2^14 undoes _e2m1's; exact (a power of 2)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, BK // G, G // 2)), (BN, BK // 2))
    return _e2m1(c & 15).to(tl.float32) * s, _e2m1(c >> 4).to(tl.float32) * s


@triton.jit
def _fp8_tile(wbase, sbase, k0, n_ok, K: tl.constexpr, BK: tl.constexpr):
    """The weights of BK columns from column k0 (BK divides 128), fp32 [BN, BK]."""
    offs_k = k0 + tl.arange(0, BK)
    m = n_ok[:, None] & (offs_k < K)[None, :]
    w = tl.load(wbase + offs_k[None, :], mask=m).to(tl.float32)
    s = tl.load(sbase + k0 // 128, mask=n_ok[:, None], other=0.0)  # [BN, 1]
    return tl.where(m, w * s, 0.0)


@triton.jit
def _packed_gemm(
    x_ptr,
    y_ptr,
    codes_ptr,
    scale_ptr,
    glob_ptr,
    rows_ptr,
    expert_ptr,
    M,
    N,
    K: tl.constexpr,  # a handful of widths a model: one compile each, loops of known length
    stride_xm,
    stride_ym,
    stride_ce,
    stride_cn,
    stride_se,
    stride_sn,
    stride_ge,
    x_row_div,
    FMT: tl.constexpr,
    INDIRECT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """y[rows, n-tile] = x[rows // x_row_div] @ W_e^T on tensor cores; e = expert_ptr[block]
    when INDIRECT (rows from rows_ptr), else 0."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if INDIRECT:
        e = tl.load(expert_ptr + pid_m)
        if e < 0:
            return
        rows = tl.load(rows_ptr + pid_m * BM + tl.arange(0, BM))  # pair ids; M marks padding
    else:
        e = 0
        rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    xrows = (rows // x_row_div).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    n_ok = offs_n < N
    wbase = codes_ptr + e.to(tl.int64) * stride_ce + offs_n[:, None].to(tl.int64) * stride_cn
    sbase = scale_ptr + e.to(tl.int64) * stride_se + offs_n[:, None].to(tl.int64) * stride_sn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if FMT == 2:  # fp8 codes [N, K]
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            xm = row_ok[:, None] & (offs_k < K)[None, :]
            x = tl.load(x_ptr + xrows[:, None] * stride_xm + offs_k[None, :], mask=xm, other=0.0)
            acc += tl.dot(x, tl.trans(_fp8_tile(wbase, sbase, k0, n_ok, K, BK).to(x.dtype)))
    else:  # two 4-bit codes a byte [N, K/2], the low nibble the even column
        glob = tl.zeros((BN,), dtype=tl.float32)
        if FMT == 0:
            glob = tl.load(glob_ptr + e.to(tl.int64) * stride_ge + offs_n, mask=n_ok, other=0.0)
        for k0 in range(0, K // 2, BK // 2):
            lo, hi = _fp4_tile(wbase, sbase, glob, k0, n_ok, FMT, K, BN, BK)
            offs_b = k0 + tl.arange(0, BK // 2)
            xm = row_ok[:, None] & (offs_b < K // 2)[None, :]
            xe = tl.load(x_ptr + xrows[:, None] * stride_xm + 2 * offs_b[None, :], mask=xm, other=0.0)
            xo = tl.load(x_ptr + xrows[:, None] * stride_xm + 2 * offs_b[None, :] + 1, mask=xm, other=0.0)
            acc += tl.dot(xe, tl.trans(lo.to(xe.dtype)))
            acc += tl.dot(xo, tl.trans(hi.to(xo.dtype)))
    out = y_ptr + rows[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# Row tiles stay at 16 / 32: with Triton 3.6 on the H200, 64-row tiles (its wgmma path) with
# weights decoded in registers gave an illegal address at 16 output columns and wrong sums at 32
# (measured 2026-11-29 with this kernel's first version); every tile shape used here is checked
# against the reference (tests/test_triton_packed.py).
def _rows_tile(m: int) -> int:
    return 16 if m <= 16 else 32


@functools.cache
def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# (BN, BK, num_warps, num_stages) by format; BN drops when too few programs fill the GPU
# (the 4-bit ones: the best geometric mean of a tile sweep at Beam's widths on the H200)
TILES = {"nvfp4": (128, 128, 4, 3), "mxfp4": (128, 128, 4, 3), "fp8_block": (64, 128, 4, 3)}


def _config(fmt: str, m_blocks: int, n: int) -> dict:
    bn, bk, warps, stages = TILES[fmt]
    while bn > 16 and m_blocks * triton.cdiv(n, bn) < 2 * _sms(torch.cuda.current_device()):
        bn //= 2
    return {"BN": bn, "BK": bk, "num_warps": warps, "num_stages": stages}


def _strides(w: PackedWeight) -> tuple:
    """(codes, scale, global) arguments and their expert / row strides."""
    glob = getattr(w, "global", None)
    stacked = len(w.shape) == 3
    return (
        w.codes,
        w.scale,
        glob if glob is not None else w.scale,  # mxfp4 / fp8_block: never read
        w.codes.stride(0) if stacked else 0,
        w.codes.stride(-2),
        w.scale.stride(0) if stacked else 0,
        w.scale.stride(-2),
        glob.stride(0) if glob is not None and stacked else 0,
    )


GEMV_ROWS = 2  # up to this many rows a weight (on average), one program a row on the CUDA cores
# (PTX decode, BN output rows, NB sub-blocks of 16 elements a loop step, num_warps) by format:
# the best geometric mean of the nvfp4 sweep (scripts/tune_packed_tiles.py nvfp4 gemv, H200);
# mxfp4 takes nvfp4's, fp8_block (Triton's decode) was not swept
GEMV = {"nvfp4": (True, 8, 64, 1), "mxfp4": (True, 8, 64, 1), "fp8_block": (False, 8, 16, 1)}


def _gemv(x, y, w: PackedWeight, ids=None, x_row_div=1, config: dict | None = None) -> None:
    codes, scale, glob, sce, scn, sse, ssn, sge = _strides(w)
    asm, bn, nb, warps = GEMV[w.format.name]
    cfg = dict(config or {"ASM": asm, "BN": bn, "NB": nb, "num_warps": warps})
    if cfg.pop("ASM", True) and _asm_ok(x, w):  # PTX decode on CUDA; Triton's elsewhere
        k = w.shape[-1]
        xq = torch.empty(x.shape[0], k // 2, dtype=torch.int32, device=x.device)
        xs = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        pack_x_fp16[(x.shape[0],)](x, xq, xs, k, x.stride(0), BK=min(1024, triton.next_power_of_2(k // 2)))
        subs = codes.view(torch.int64)  # 16 codes a sub-block
        packed_gemv_fp4[(y.shape[0], triton.cdiv(w.shape[-2], cfg["BN"]))](
            xq, xs, y, subs, scale, glob, ids if ids is not None else xs, w.shape[-2], k,
            y.stride(0), sce // 8, scn // 8, sse, ssn, sge, x_row_div,
            FMT=FMT[w.format.name], INDIRECT=ids is not None, **cfg,
        )  # fmt: skip
        return
    packed_gemv[(y.shape[0], triton.cdiv(w.shape[-2], cfg["BN"]))](
        x, y, codes, scale, glob, ids if ids is not None else x, w.shape[-2], w.shape[-1],
        x.stride(0), y.stride(0), sce, scn, sse, ssn, sge, x_row_div,
        FMT=FMT[w.format.name], INDIRECT=ids is not None, F16=x.dtype != torch.float32, **cfg,
    )  # fmt: skip


def _asm_ok(x: torch.Tensor, w: PackedWeight) -> bool:
    """The PTX GEMV applies: 4-bit codes in whole 16-element sub-blocks, rows of whole words
    (8-byte aligned), a 16-bit x on an NVIDIA GPU (not Triton's interpreter, not ROCm)."""
    c = w.codes
    return (
        x.is_cuda
        and torch.version.hip is None
        and not _interpreting()
        and x.dtype != torch.float32
        and w.format.name in ("nvfp4", "mxfp4")
        and w.shape[-1] % 16 == 0
        and c.stride(-1) == 1
        and all(st % 8 == 0 for st in c.stride()[:-1])
        and c.storage_offset() % 8 == 0
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _launch(x, y, w: PackedWeight, rows=None, experts=None, m=None, x_row_div=1, bm=16, config=None) -> None:
    *_, n, k = w.shape
    m = x.shape[0] if m is None else m
    m_blocks = experts.shape[0] if experts is not None else triton.cdiv(m, bm)
    cfg = config or _config(w.format.name, m_blocks, n)
    codes, scale, glob, sce, scn, sse, ssn, sge = _strides(w)
    _packed_gemm[(m_blocks, triton.cdiv(n, cfg["BN"]))](
        x, y, codes, scale, glob, rows if rows is not None else x, experts if experts is not None else x,
        m, n, k, x.stride(0), y.stride(0), sce, scn, sse, ssn, sge, x_row_div,
        FMT=FMT[w.format.name], INDIRECT=experts is not None, BM=bm, **cfg,
    )  # fmt: skip


def linear_packed(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [.., K] @ dequant(w)^T (+ b) -> [.., N]."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty(x2.shape[0], w.shape[-2], dtype=x.dtype, device=x.device)
    if x2.shape[0] <= GEMV_ROWS:
        _gemv(x2, y, w)
    else:
        _launch(x2, y, w, bm=_rows_tile(x2.shape[0]))
    y = y.view(*lead, -1)
    return y if bias is None else y + bias


@triton.jit
def _combine(y_ptr, w_ptr, ids_ptr, out_ptr, N, K: tl.constexpr, BN: tl.constexpr):
    """out[t] = sum_j w[t, j] y[t K + j] over the pairs with ids[t, j] >= 0 (-1: no expert, its
    row of y unset and unread), in fp32, rounded once to out's dtype (the reference's weighted
    sum of a token's k expert outputs)."""
    t, pid = tl.program_id(0).to(tl.int64), tl.program_id(1)
    n = pid * BN + tl.arange(0, BN)
    m = n < N
    acc = tl.zeros((BN,), tl.float32)
    for j in tl.static_range(K):
        w = tl.load(w_ptr + t * K + j)
        live = tl.load(ids_ptr + t * K + j) >= 0
        y = tl.load(y_ptr + (t * K + j) * N + n, mask=m & live, other=0.0).to(tl.float32)
        acc += tl.where(live, w * y, 0.0)
    tl.store(out_ptr + t * N + n, acc.to(out_ptr.dtype.element_ty), mask=m)


def combine(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [T k, N] (each pair's expert output), weights / ids [T, k] -> [T, N] in dtype."""
    t, k = weights.shape
    n = y.shape[1]
    out = torch.empty(t, n, dtype=dtype, device=y.device)
    if t:
        bn = min(1024, triton.next_power_of_2(n))
        _combine[(t, triton.cdiv(n, bn))](
            y.contiguous(), weights.float().contiguous(), ids.contiguous(), out, n, K=k, BN=bn
        )
    return out


def _align(ids: torch.Tensor, experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [S], block experts [B]): the pairs of flat ids [P] sorted by expert, each expert's
    run padded to a multiple of bm with P (a row no program writes); block b of bm rows belongs
    to expert block_experts[b], -1 past the last run. A pair of id -1 (no expert) is in no run.
    S, B are bounds from the shapes alone."""
    p = ids.numel()
    flat = ids.reshape(-1)
    key = torch.where(flat >= 0, flat, experts)  # [P]: the skipped pairs after every expert's
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, key, torch.ones_like(key)
    )
    # (not bincount: on CUDA it reads the largest id back to size its output, a host sync)
    # the skipped pairs' bin gets no run and no block (padded on the device: an item assignment
    # copies its value from the host, which a CUDA graph cannot capture)
    padded = torch.nn.functional.pad((counts[:experts] + bm - 1) // bm * bm, (0, 1))
    ends = padded.cumsum(0)
    sorted_e = key[order]
    rank = torch.arange(p, device=ids.device) - (counts.cumsum(0) - counts)[sorted_e]
    slots = p + min(experts, p) * (bm - 1)
    rows = torch.full((triton.cdiv(slots, bm) * bm + 1,), p, dtype=torch.int64, device=ids.device)
    # a skipped pair's slot is the one past the bound (the last row, cut off below)
    rows[torch.where(sorted_e < experts, (ends - padded)[sorted_e] + rank, rows.numel() - 1)] = order
    rows = rows[:-1]
    starts = torch.arange(rows.numel() // bm, device=ids.device) * bm
    block_experts = torch.searchsorted(ends[:experts], starts, right=True)
    return rows, torch.where(starts < ends[-1], block_experts, -1).to(torch.int32)


def moe_experts_packed(
    x: torch.Tensor,
    gate_up: PackedWeight,
    down: PackedWeight,
    weights: torch.Tensor,
    ids: torch.Tensor,
    fp32: bool = False,
    limit: float | None = None,
    act: str = "silu",
    consts: tuple[float, float] = DEFAULT_CONSTS,
) -> torch.Tensor:
    """moe_experts (kernels/reference/moe.py) on packed experts; the k outputs of a token are
    weighted and summed in fp32; a pair of id -1 (no expert) reads no expert and adds nothing."""
    t, k = ids.shape
    x = x.contiguous()
    h = torch.empty(t * k, gate_up.shape[-2], dtype=x.dtype, device=x.device)  # [P, 2I]
    y = torch.empty(t * k, down.shape[-2], dtype=x.dtype, device=x.device)  # [P, Dm]
    if t * k <= GEMV_ROWS * gate_up.shape[0]:  # decode: a pair a program, no sorting
        flat = ids.reshape(-1)
        _gemv(x, h, gate_up, flat, x_row_div=k)
        g, u = h.chunk(2, dim=-1)
        _gemv(swiglu(g, u, fp32, limit, act, consts).contiguous(), y, down, flat)
    else:
        bm = _rows_tile(t * k // gate_up.shape[0] + 1)  # rows an expert gets on average
        rows, blocks = _align(ids, gate_up.shape[0], bm)
        _launch(x, h, gate_up, rows, blocks, m=t * k, x_row_div=k, bm=bm)
        g, u = h.chunk(2, dim=-1)
        _launch(swiglu(g, u, fp32, limit, act, consts).contiguous(), y, down, rows, blocks, m=t * k, bm=bm)
    return combine(y, weights, ids, x.dtype)
