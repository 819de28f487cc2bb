"""Triton packed-weight GEMMs (kernels/triton/packed.py) against the reference backend, on CUDA.

Runs on the GPU machine (scripts/gpu_bringup.sh, TESTS=...); CI has no GPU and skips it (it runs
the same kernels in Triton's interpreter: tests/test_triton_interpreter.py). Shapes cover both
paths: one row a program (m <= 2, few pairs an expert) and tensor-core tiles. Weights: random
normal ones quantized by sdk/bench/quantize.py. Tolerance: both sides use the same bf16 weights
and accumulate in fp32; they differ by summation order and the final bf16 rounding, so
|diff| <= 2e-2 * max|y| (a few bf16 ulps of the output scale).
"""

from __future__ import annotations

import pytest
import torch

from dayzero.kernels.packed import PackedWeight
from dayzero.kernels.reference import packed as ref
from dayzero.sdk.bench.quantize import quantize

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
triton_packed = pytest.importorskip("dayzero.kernels.triton.packed")

FORMATS = ("nvfp4", "mxfp4", "fp8_block")
SEEDS = (0, 1)


def _weight(fmt: str, shape: tuple[int, ...], g: torch.Generator) -> PackedWeight:
    n, k = shape[-2:]
    dense = torch.randn(*shape, generator=g, device="cuda") / k**0.5
    parts = [quantize(w, fmt) for w in dense.reshape(-1, n, k)]
    w = PackedWeight(fmt, shape).cuda()
    for name, buf in w.named_buffers():
        buf.copy_(torch.stack([p[name] for p in parts]).reshape(buf.shape))
    return w


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 2e-2 * want.float().abs().max().item(), err


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 2048), (5, 300, 512), (40, 1000, 256), (300, 256, 1024)])
def test_linear_matches_reference(fmt: str, seed: int, m: int, n: int, k: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = _weight(fmt, (n, k), g)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    b = torch.randn(n, generator=g, device="cuda").bfloat16()
    _close(triton_packed.linear_packed(x, w, b), ref.linear_packed(x, w, b))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fmt", ("nvfp4", "mxfp4"))
@pytest.mark.parametrize("asm", (True, False))
@pytest.mark.parametrize(("m", "n", "k"), [(1, 300, 512), (2, 4096, 2048), (1, 1000, 32 * 17)])
def test_gemv_decodes_match_reference(fmt: str, asm: bool, seed: int, m: int, n: int, k: int) -> None:
    """Both 4-bit decodes of the decode GEMV (PTX, Triton's), at geometries whose tiles end inside
    the weight (n % BN, K / 16 % NB != 0: 34 sub-blocks), on rows of very different scales (1e-3, 3e3: the
    per-row power of two keeps fp16 sums in range)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = _weight(fmt, (n, k), g)
    x = (
        torch.randn(m, k, generator=g, device="cuda") * torch.tensor([1e-3, 3e3], device="cuda")[:m, None]
    ).bfloat16()
    want = ref.linear_packed(x, w)
    for bn, nb, warps in ((8, 16, 1), (16, 8, 2), (4, 4, 4)):
        y = torch.empty_like(want)
        triton_packed._gemv(x, y, w, config={"ASM": asm, "BN": bn, "NB": nb, "num_warps": warps})
        for r in range(m):  # each row against its own scale
            _close(y[r], want[r])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
def test_moe_experts_match_reference(fmt: str, seed: int, tokens: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    e, k, hidden, inter = 16, 4, 512, 256
    gate_up, down = _weight(fmt, (e, 2 * inter, hidden), g), _weight(fmt, (e, hidden, inter), g)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
    ids = torch.rand(tokens, e, generator=g, device="cuda").topk(k, dim=-1).indices
    wts = torch.rand(tokens, k, generator=g, device="cuda")
    got = triton_packed.moe_experts_packed(x, gate_up, down, wts, ids, True, 7.0)
    _close(got, ref.moe_experts_packed(x, gate_up, down, wts, ids, True, 7.0))


def test_expert_alignment_covers_every_pair_once() -> None:
    ids = torch.tensor([[3, 1], [3, 0], [1, 3], [2, 3]], device="cuda")
    rows, blocks = triton_packed._align(ids, experts=5, bm=4)
    real = rows[rows < ids.numel()]
    assert sorted(real.tolist()) == list(range(ids.numel()))
    for b, e in enumerate(blocks.tolist()):
        block = rows[b * 4 : (b + 1) * 4]
        block = block[block < ids.numel()]
        assert e >= 0 or block.numel() == 0
        assert all(ids.reshape(-1)[block] == e)
