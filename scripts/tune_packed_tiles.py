"""Tile sweep for the Triton packed-weight GEMM (kernels/triton/packed.py, its tensor-core path)
at Reflection Beam's widths on a CUDA GPU: every (BN, BK, warps, stages) is checked against the
reference backend and timed (GB/s of packed weights read) on a dense [14336, 5120] weight at 1
and 32 rows and on 64 stacked [5120, 5120] experts at 1 and 32 tokens (top 8). The best
geometric mean goes into TILES for a `dayzero bench decode --family beam --quantization FMT` run
in the same process.

    python3 scripts/tune_packed_tiles.py nvfp4[,mxfp4,fp8_block] [extra bench flags]
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


def sweep(fmt: str, g: torch.Generator) -> tuple[int, int, int, int]:
    dense, experts = weight(fmt, (14336, HIDDEN), g), weight(fmt, (EXPERTS, HIDDEN, HIDDEN), g)
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
    formats = sys.argv[1].split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    tp.TILES.update({fmt: sweep(fmt, gen) for fmt in formats})
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
                *sys.argv[2:],
            ]
        )
