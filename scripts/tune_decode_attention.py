"""Decode attention's key splits on a CUDA GPU at Reflection Beam's head shapes (48 query / 8 kv
heads of 128, bf16): for each context length and batch, the paged kernel (kernels/triton/
attention.py) with S splits a row and a minimum of key tiles a split, checked against one split
(the same kernel without the merge) and timed replayed from a CUDA graph (do_bench's median, as
decode steps run); GB/s of K and V read. The last lines: the default (`_splits`,
MIN_SPLIT_TILES) against the best of the sweep at each shape.

    python3 scripts/tune_decode_attention.py [contexts, default 512,8192,60000] [batches, default 1,8]
    python3 scripts/tune_decode_attention.py geometry [contexts] [batches]: at the default splits,
        keys a tile x warps x software-pipeline stages
"""

from __future__ import annotations

import sys

import torch
from triton.testing import do_bench

from dayzero.kernels.ops import PagedMeta
from dayzero.kernels.triton import attention

H, HK, D, BS = 48, 8, 128, 64


def case(ctx: int, batch: int, g: torch.Generator) -> tuple:
    """q [B, H, D] and a paged pool holding `ctx` keys for each row, its blocks shuffled."""
    nb = -(-ctx // BS)
    table = torch.randperm(nb * batch, generator=g, device="cuda").view(batch, nb)
    kc = torch.randn(nb * batch * BS, HK, D, generator=g, device="cuda").bfloat16()
    vc = torch.randn(nb * batch * BS, HK, D, generator=g, device="cuda").bfloat16()
    q = torch.randn(batch, H, D, generator=g, device="cuda").bfloat16()
    qs = tuple(range(batch + 1))
    lens = (ctx,) * batch
    slots = (table[:, (ctx - 1) // BS] * BS + (ctx - 1) % BS).contiguous()
    meta = PagedMeta(
        torch.tensor(qs, device="cuda"), torch.tensor(lens, device="cuda"),
        torch.full((batch,), ctx - 1, device="cuda"), table, slots, BS, qs, lens,
    )  # fmt: skip
    return q, kc, vc, meta, 2 * batch * ctx * HK * D * 2


def graph_us(fn) -> float:
    """Microseconds a call of fn takes replayed from a CUDA graph (as decode steps run: no host
    launch cost), do_bench's median."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=5, rep=40) * 1e3


def sweep(ctx: int, b: int, g: torch.Generator) -> str:
    q, kc, vc, meta, nbytes = case(ctx, b, g)

    def attend(splits: int | None = None, tiles: int = attention.MIN_SPLIT_TILES) -> torch.Tensor:
        return attention.gqa_attention(q, kc, vc, meta, D**-0.5, splits=splits, min_split_tiles=tiles)

    want = attend(1).float()
    rates = {}
    for splits in (1, 8, 16, 32, 64, 128):
        for tiles in (1, 4, 8) if splits > 1 else (1,):
            err = (attend(splits, tiles).float() - want).abs().max().item()
            if err > 2e-2 * want.abs().max().item():
                raise RuntimeError(f"ctx {ctx} batch {b} splits {splits} tiles {tiles}: error {err}")
            us = graph_us(lambda s=splits, t=tiles: attend(s, t))
            rates[splits, tiles] = nbytes / us / 1e3
            print(f"ctx {ctx:>6} batch {b:>2} splits {splits:>3} min tiles {tiles}: {us:8.1f} us "
                  f"{rates[splits, tiles]:7.0f} GB/s", flush=True)  # fmt: skip
    default = attention._splits(b, HK, 1, q.device), attention.MIN_SPLIT_TILES
    us = graph_us(attend)
    best = max(rates, key=rates.get)
    return (
        f"ctx {ctx} batch {b}: default {default} {nbytes / us / 1e3:.0f} GB/s ({us:.1f} us), "
        f"best {best} {rates[best]:.0f} GB/s ({nbytes / rates[best] / 1e3:.1f} us)"
    )


def geometry(ctx: int, b: int, g: torch.Generator) -> str:
    q, kc, vc, meta, nbytes = case(ctx, b, g)
    want = attention.gqa_attention(q, kc, vc, meta, D**-0.5, splits=1).float()
    rates = {}
    for tile in (32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (1, 2, 3, 4):
                kw = dict(key_tile=tile, warps=warps, stages=stages)
                try:
                    got = attention.gqa_attention(q, kc, vc, meta, D**-0.5, **kw).float()
                except Exception as e:  # out of shared memory / registers at this geometry
                    print(f"ctx {ctx:>6} batch {b:>2} {kw}: {type(e).__name__}", flush=True)
                    continue
                if (got - want).abs().max().item() > 2e-2 * want.abs().max().item():
                    raise RuntimeError(f"ctx {ctx} batch {b} {kw}: wrong")
                us = graph_us(lambda kw=kw: attention.gqa_attention(q, kc, vc, meta, D**-0.5, **kw))
                rates[tile, warps, stages] = us
                rate = nbytes / us / 1e3
                print(f"ctx {ctx:>6} batch {b:>2} {kw}: {us:8.1f} us {rate:7.0f} GB/s", flush=True)
    key = (attention.DECODE_TILE, attention.DECODE_WARPS, 2)  # the decode default
    default = rates[key]
    best = min(rates, key=rates.get)
    return (
        f"ctx {ctx} batch {b}: default {key} {default:.1f} us ({nbytes / default / 1e3:.0f} GB/s), "
        f"best (tile, warps, stages) {best} {rates[best]:.1f} us ({nbytes / rates[best] / 1e3:.0f} GB/s)"
    )


def main() -> None:
    args = sys.argv[1:]
    run = sweep
    if args and args[0] == "geometry":
        run, args = geometry, args[1:]
    ctxs = [int(c) for c in (args[0] if args else "512,8192,60000").split(",")]
    batches = [int(b) for b in (args[1] if len(args) > 1 else "1,8").split(",")]
    g = torch.Generator(device="cuda").manual_seed(0)
    summary = [run(ctx, b, g) for ctx in ctxs for b in batches]
    print("\n".join(summary))


if __name__ == "__main__":
    main()
