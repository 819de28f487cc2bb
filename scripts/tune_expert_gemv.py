"""Geometry sweep for the bf16 expert GEMVs (kernels/triton/moe.py, the decode path) at Reflection
Beam's widths on a CUDA GPU: each (bn_max, bn_min, bk, warps, per_sm) is checked against the
reference backend and timed (TB/s of the picked experts' weights read, do_bench median) at 1 and
8 tokens (top 8 of 64 experts: 8 and 64 pairs). Prints one line per geometry, best last.

    python3 scripts/tune_expert_gemv.py
"""

from __future__ import annotations

import itertools

import torch
from transformers import BeamConfig
from triton.testing import do_bench

from dayzero.kernels.reference.moe import moe_experts as reference
from dayzero.kernels.triton import moe


def main() -> None:
    cfg, dev = BeamConfig(), torch.device("cuda")
    e, k, dm, i = 64, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    g = torch.Generator(device=dev).manual_seed(0)
    up = (torch.randn(e, 2 * i, dm, generator=g, device=dev) / dm**0.5).bfloat16()
    down = (torch.randn(e, dm, i, generator=g, device=dev) / i**0.5).bfloat16()
    cases = []
    for t in (1, 8):
        x = torch.randn(t, dm, generator=g, device=dev).bfloat16()
        ids = torch.rand(t, e, generator=g, device=dev).topk(k, dim=-1).indices
        w = torch.rand(t, k, generator=g, device=dev)
        used = ids.unique().numel()
        cases.append(
            (t, x, ids, w, used * 3 * i * dm * 2, reference(x, up, down, w, ids, True, None).float())
        )
    rows = []
    for bn_max, bn_min, bk, warps, per_sm in itertools.product(
        (64, 32, 16), (16, 8), (64, 128, 256), (2, 4, 8), (2, 4, 8)
    ):
        if bn_min > bn_max:
            continue
        moe.GEMV.update(bn_max=bn_max, bn_min=bn_min, bk=bk, warps=warps, per_sm=per_sm)
        rates = []
        for t, x, ids, w, nbytes, want in cases:
            got = moe.moe_experts(x, up, down, w, ids, True, None).float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 2e-2, (moe.GEMV, t, err)
            ms = do_bench(lambda x=x, ids=ids, w=w: moe.moe_experts(x, up, down, w, ids, True, None), rep=60)
            rates.append(nbytes / ms / 1e9)
        rows.append((min(rates), dict(moe.GEMV), rates))
    rows.sort(key=lambda r: r[0])
    for _, geo, rates in rows[-12:]:
        print(f"{geo} TB/s t=1 {rates[0]:.2f} t=8 {rates[1]:.2f}")


if __name__ == "__main__":
    main()
