"""The Triton packed-weight kernels (kernels/triton/packed.py) run in Triton's CPU interpreter
against the reference backend, so CI checks their indexing and decoding without a GPU: both
paths (one row a program; tensor-core tiles with experts sorted and padded), every format, fp32
activations (the interpreter emulates bf16 wrongly). Tolerance 1e-5 of the output scale: the
same fp32 weights, summed in another order. The interpreter must be chosen before Triton compiles
anything, so the check runs in a fresh process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

SEEDS = (0, 3)


def check(seed: int) -> list[str]:
    from dayzero.kernels.packed import PackedWeight
    from dayzero.kernels.reference import packed as ref
    from dayzero.kernels.triton import packed as tp
    from dayzero.sdk.bench.quantize import quantize

    tp._sms = lambda _device: 4  # no GPU to ask; small, so partial column tiles are exercised
    tp.torch.cuda.current_device = lambda: 0
    g = torch.Generator().manual_seed(seed)

    def weight(fmt: str, shape: tuple[int, ...]) -> PackedWeight:
        *_, n, k = shape
        w = PackedWeight(fmt, shape)
        parts = [quantize(d, fmt) for d in (torch.randn(*shape, generator=g) / k**0.5).reshape(-1, n, k)]
        for name, buf in w.named_buffers():
            buf.copy_(torch.stack([p[name] for p in parts]).reshape(buf.shape))
        return w

    out = []
    for fmt in ("nvfp4", "mxfp4", "fp8_block"):
        w = weight(fmt, (200, 384))
        for m in (1, 2, 5, 40):  # 1-2: one row a program; then 16- and 32-row tiles
            x = torch.randn(m, 384, generator=g)
            want = ref.linear_packed(x, w)
            err = (tp.linear_packed(x, w) - want).abs().max() / want.abs().max()
            out.append(f"{fmt} linear m={m} {err.item():.2e}")
        up, down = weight(fmt, (8, 128, 384)), weight(fmt, (8, 384, 64))
        for t in (1, 3, 40):  # pairs <= 2 per expert: one a program; else sorted by expert
            x = torch.randn(t, 384, generator=g)
            ids = torch.rand(t, 8, generator=g).topk(2, dim=-1).indices
            wts = torch.rand(t, 2, generator=g)
            want = ref.moe_experts_packed(x, up, down, wts, ids, True, 3.0)
            err = (
                tp.moe_experts_packed(x, up, down, wts, ids, True, 3.0) - want
            ).abs().max() / want.abs().max()
            out.append(f"{fmt} moe t={t} {err.item():.2e}")
    return out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("seed", SEEDS)
def test_triton_kernels_in_the_interpreter(seed: int) -> None:
    env = os.environ | {"TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, __file__, str(seed)], capture_output=True, text=True, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 3 * 7, r.stdout
    for ln in lines:
        assert float(ln.split()[-1]) <= 1e-5, ln


if __name__ == "__main__":
    print("\n".join(check(int(sys.argv[1]))))
