"""Dense decode linears on a CUDA GPU at Reflection Beam's bench shapes (bf16; the router in fp32):
the Triton GEMV (kernels/triton/linear.py) at several geometries against F.linear (cuBLAS), each
checked against an fp32 product and timed replayed from a CUDA graph (do_bench's median, as
decode steps run); GB/s of the weight read. The last lines: per shape, cuBLAS against the
default geometry and the best of the sweep.

    python3 scripts/tune_dense_gemv.py [rows, default 1,2]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from dayzero.kernels.triton import linear

# (name, N, K, dtype): in-projection (q, gate, k, v), output projection, the dense MLP's gate/up and
# down, the router, the LM head
SHAPES = (
    ("in_proj", 14336, 5120, torch.bfloat16),
    ("o_proj", 5120, 6144, torch.bfloat16),
    ("mlp_gate_up", 2 * 20480, 5120, torch.bfloat16),
    ("mlp_down", 5120, 20480, torch.bfloat16),
    ("router", 64, 5120, torch.float32),
    ("lm_head", 151936, 5120, torch.bfloat16),
)


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=5, rep=40) * 1e3


def sweep(name: str, n: int, k: int, dtype: torch.dtype, m: int, g: torch.Generator) -> str:
    w = (torch.randn(n, k, generator=g, device="cuda") * k**-0.5).to(dtype)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    want = x.float() @ w.float().T
    nbytes = w.numel() * w.element_size()
    cublas = graph_us(lambda: F.linear(x, w))
    rates = {}
    for bn in (1, 4, 8, 16, 32) if m == 1 else ():  # two rows: the default against cuBLAS only
        for tile in (2048, 4096):
            bk = min(max(tile // bn, 16), 1 << (k - 1).bit_length())
            for warps in (4, 8):
                y = linear.linear(x, w, tiles=(bn, bk), warps=warps)
                err = (y.float() - want).abs().max().item()
                if err > 2e-2 * want.abs().max().item():
                    raise RuntimeError(f"{name} m={m} ({bn}, {bk}, {warps}): error {err}")
                us = graph_us(lambda bn=bn, bk=bk, wp=warps: linear.linear(x, w, tiles=(bn, bk), warps=wp))
                rates[bn, bk, warps] = us
    y = linear.linear(x, w)
    if (y.float() - want).abs().max().item() > 2e-2 * want.abs().max().item():
        raise RuntimeError(f"{name} m={m} default geometry: wrong")
    default = graph_us(lambda: linear.linear(x, w))
    rates.setdefault((*linear.geometry(n, k, x.device), linear.DENSE["warps"]), default)
    best = min(rates, key=rates.get)
    bw = nbytes / 1e3
    return (
        f"{name:<12} m={m} [{n}, {k}] cuBLAS {cublas:7.1f} us ({bw / cublas:5.0f} GB/s)  "
        f"default {linear.geometry(n, k, x.device)} {default:7.1f} us ({bw / default:5.0f})  "
        f"best {best} {rates[best]:7.1f} us ({bw / rates[best]:5.0f})"
    )


def main() -> None:
    rows = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,2").split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    for line in (sweep(*shape, m, g) for m in rows for shape in SHAPES):
        print(line, flush=True)


if __name__ == "__main__":
    main()
