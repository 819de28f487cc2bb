"""Geometry sweeps for the Triton packed-weight kernels at Reflection Beam's widths on a CUDA GPU,
each geometry checked against the reference backend and timed (GB/s of packed weights read,
do_bench median): `tiles`, the tensor-core GEMM (kernels/triton/packed.py: BN, BK, warps,
stages) on a dense [14336, 5120] weight at 1 and 32 rows and on 64 stacked [5120, 5120] experts
at 1 and 32 tokens (top 8); `gemv`, the decode GEMV (kernels/triton/packed_gemv.py: BN, NB,
warps, the 4-bit decode in PTX or in Triton) on the dense weight at 1 and 2 rows and the experts
at 1 token (8 pairs). The best geometric mean goes into TILES / GEMV for a `dayzero bench
decode --family beam --quantization FMT` run in the same process.

    python3 scripts/tune_packed_tiles.py nvfp4[,mxfp4,fp8_block] [tiles,gemv] [extra bench flags]
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable

import torch
from triton.testing import do_bench

from dayzero.kernels.packed import PackedWeight
from dayzero.kernels.reference import packed as ref
from dayzero.kernels.triton import packed as tp
from dayzero.sdk.bench.quantize import quantize
from dayzero.sdk.cli import main

HIDDEN, EXPERTS, TOP_K = 5120, 64, 8
Case = tuple[str, int, Callable[[dict], None], torch.Tensor, torch.Tensor]  # name, bytes, run, want, out


def weight(fmt: str, shape: tuple[int, ...], g: torch.Generator) -> PackedWeight:
    *lead, n, k = shape
    w = PackedWeight(fmt, shape).cuda()
    parts = [
        quantize(torch.randn(n, k, generator=g, device="cuda") / 70, fmt) for _ in range(math.prod(lead))
    ]
    for name, buf in w.named_buffers():
        buf.copy_(torch.stack([p[name] for p in parts]).reshape(buf.shape))
    return w


def dense_case(w: PackedWeight, m: int, g: torch.Generator) -> Case:
    x = torch.randn(m, HIDDEN, generator=g, device="cuda").bfloat16()
    want = ref.linear_packed(x, w)
    y = torch.empty_like(want)

    def run(c: dict) -> None:
        tp._launch(x, y, w, bm=tp._rows_tile(m), config=c)

    return f"dense m{m}", w.nbytes(), run, want, y


def moe_case(w: PackedWeight, t: int, g: torch.Generator) -> Case:
    x = torch.randn(t, HIDDEN, generator=g, device="cuda").bfloat16()
    ids = torch.rand(t, EXPERTS, generator=g, device="cuda").topk(TOP_K, dim=-1).indices
    bm = tp._rows_tile(t * TOP_K // EXPERTS + 1)
    rows, blocks = tp._align(ids, EXPERTS, bm)
    y = torch.empty(t * TOP_K, HIDDEN, dtype=x.dtype, device="cuda")
    dense = w.dequant(torch.bfloat16)
    want = torch.stack([x[p // TOP_K] @ dense[e].T for p, e in enumerate(ids.reshape(-1).tolist())])
    nbytes = ids.unique().numel() * w.nbytes() // EXPERTS

    def run(c: dict) -> None:
        tp._launch(x, y, w, rows, blocks, m=t * TOP_K, x_row_div=TOP_K, bm=bm, config=c)

    return f"moe t{t}", nbytes, run, want, y


def gemv_dense_case(w: PackedWeight, m: int, g: torch.Generator) -> Case:
    x = torch.randn(m, HIDDEN, generator=g, device="cuda").bfloat16()
    want = ref.linear_packed(x, w)
    y = torch.empty_like(want)
    return f"gemv dense m{m}", w.nbytes(), lambda c: tp._gemv(x, y, w, config=c), want, y


def gemv_moe_case(w: PackedWeight, g: torch.Generator) -> Case:
    x = torch.randn(1, HIDDEN, generator=g, device="cuda").bfloat16()
    ids = torch.randperm(EXPERTS, generator=g, device="cuda")[:TOP_K]
    y = torch.empty(TOP_K, w.shape[-2], dtype=x.dtype, device="cuda")
    dense = w.dequant(torch.bfloat16)
    want = torch.stack([x[0] @ dense[e].T for e in ids.tolist()])
    run = lambda c: tp._gemv(x, y, w, ids, x_row_div=TOP_K, config=c)  # noqa: E731
    return "gemv moe t1", TOP_K * w.nbytes() // EXPERTS, run, want, y


def sweep_gemv(fmt: str, dense: PackedWeight, experts: PackedWeight, g: torch.Generator) -> tuple:
    cases = [gemv_dense_case(dense, m, g) for m in (1, 2)] + [gemv_moe_case(experts, g)]
    results = {}
    decodes = (True,) if fmt != "fp8_block" else (False,)  # 4-bit: the PTX decode (Triton's swept before)
    for geo in itertools.product(decodes, (1, 2, 4, 8, 16), (8, 16, 32, 64), (1, 2, 4)):
        c = dict(zip(("ASM", "BN", "NB", "num_warps"), geo, strict=True))
        try:
            results[geo] = score(cases, c)
        except Exception as e:  # a geometry that fails to compile or computes wrong is skipped, said
            print(fmt, "gemv", geo, "FAIL", str(e).splitlines()[0][:100], flush=True)
            continue
        print(fmt, "gemv", geo, " ".join(f"{r:7.0f}" for r in results[geo]), flush=True)
    best = max(results, key=lambda k: sum(math.log(r) for r in results[k]))
    print(f"BEST {fmt} gemv {best} GB/s {[round(r) for r in results[best]]} for {[c[0] for c in cases]}")
    return best


def score(cases: list[Case], c: dict) -> list[float]:
    """GB/s per case; raises when the result is off."""
    out = []
    for name, nbytes, run, want, y in cases:
        run(c)
        torch.cuda.synchronize()
        err = (y.float() - want.float()).abs().max().item()
        if err > 3e-2 * want.float().abs().max().item():
            raise RuntimeError(f"{name}: max error {err}")
        out.append(nbytes / do_bench(lambda run=run: run(c), warmup=5, rep=30) / 1e6)
    return out


def sweep(fmt: str, dense: PackedWeight, experts: PackedWeight, g: torch.Generator) -> tuple:
    cases = [dense_case(dense, m, g) for m in (1, 32)] + [moe_case(experts, t, g) for t in (1, 32)]
    bks = (64, 128) if fmt == "fp8_block" else (128, 256, 512)
    results = {}
    for tiles in itertools.product((32, 64, 128), bks, (4, 8), (3, 4)):
        c = dict(zip(("BN", "BK", "num_warps", "num_stages"), tiles, strict=True))
        try:
            results[tiles] = score(cases, c)
        except Exception as e:  # a tile that fails to compile or computes wrong is skipped, said
            print(fmt, tiles, "FAIL", str(e).splitlines()[0][:100], flush=True)
            continue
        print(fmt, tiles, " ".join(f"{r:7.0f}" for r in results[tiles]), flush=True)
    best = max(results, key=lambda k: sum(math.log(r) for r in results[k]))
    print(
        f"BEST {fmt} {best} GB/s {[round(r) for r in results[best]]} for {[c[0] for c in cases]}", flush=True
    )
    return best


if __name__ == "__main__":
    formats, parts = sys.argv[1].split(","), sys.argv[2].split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for fmt in formats:
        dense, experts = weight(fmt, (14336, HIDDEN), gen), weight(fmt, (EXPERTS, HIDDEN, HIDDEN), gen)
        if "tiles" in parts:
            tp.TILES[fmt] = sweep(fmt, dense, experts, gen)
        if "gemv" in parts:
            tp.GEMV[fmt] = sweep_gemv(fmt, dense, experts, gen)
        del dense, experts
        torch.cuda.empty_cache()
    for fmt in formats:
        main(
            [
                "bench",
                "decode",
                "--family",
                "beam",
                "--batches",
                "1,8,32",
                "--quantization",
                fmt,
                *sys.argv[3:],
            ]
        )
