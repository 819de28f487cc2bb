"""The mHC ops (kernels/reference/hyper.py): the reference against transformers' GLM-5.3-Flash
hyper-connection (bit-equal: the same torch ops in the same order), and the Triton kernels
(kernels/triton/hyper.py) against the reference in Triton's CPU interpreter, in a fresh process
(the interpreter is chosen before Triton compiles anything). fp32; tolerance 1e-5 of the output's
scale (the same numbers summed in another order)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from interpreter import main, run_checks

SEEDS = (0, 5, 11)
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _inputs(g: torch.Generator, t: int, n: int, d: int, strided: bool = False):
    m = (2 + n) * n
    x = torch.randn(t, n, d + (8 if strided else 0), generator=g)[..., :d]  # [T, N, D], rows strided
    fn = torch.randn(m, n * d, generator=g) / (n * d) ** 0.5
    base, scale = torch.randn(m, generator=g), torch.rand(3, generator=g) + 0.5
    y = torch.randn(t, d + 4, generator=g)[:, 2 : d + 2]  # [T, D], strided
    return x, fn, base, scale, y


@pytest.mark.parametrize("seed", SEEDS)
def test_reference_equals_transformers_hyper_connection(seed: int) -> None:
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    from dayzero.kernels.reference.hyper import hc_post, hc_pre

    g = torch.Generator().manual_seed(seed)
    n, d, iters = 4, 64, 20
    x, fn, base, scale, y = _inputs(g, 6, n, d)
    cfg = Glm5NextTextConfig(
        hidden_size=d, hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-5
    )
    theirs = Glm5NextTextHyperConnection(cfg)
    with torch.no_grad():
        theirs.fn.copy_(fn), theirs.base.copy_(base), theirs.scale.copy_(scale)
        post_t, comb_t, h_t = theirs(x[None])
        h, post, comb = hc_pre(x, fn, base, scale, iters, cfg.hc_eps, cfg.rms_norm_eps)
    assert torch.equal(h, h_t[0]) and torch.equal(post, post_t[0]) and torch.equal(comb, comb_t[0])
    assert torch.allclose(comb.sum(-2), torch.ones(6, n), atol=1e-4)  # doubly stochastic, columns exact
    want = torch.einsum("tij,tid->tjd", comb_t[0], x) + post_t[0][..., None] * y[:, None, :]
    assert _rel(hc_post(x, y, post, comb), want) < TOL


def check(seed: int) -> list[str]:
    from dayzero.kernels.reference import hyper as ref
    from dayzero.kernels.triton import hyper

    g, out = torch.Generator().manual_seed(seed), []
    for t, n, d, iters, strided in ((1, 4, 48, 20, False), (5, 3, 1100, 7, True), (3, 4, 64, 1, True)):
        x, fn, base, scale, y = _inputs(g, t, n, d, strided)
        want = ref.hc_pre(x, fn, base, scale, iters, 1e-6, 1e-5)
        got = hyper.hc_pre(x, fn, base, scale, iters, 1e-6, 1e-5)
        errs = [_rel(a, b) for a, b in zip(got, want, strict=True)]
        out.append(f"hc_pre t={t} n={n} d={d} iters={iters} {max(errs):.2e}")
        _, post, comb = want
        err = _rel(hyper.hc_post(x, y, post, comb), ref.hc_post(x, y, post, comb))
        out.append(f"hc_post t={t} n={n} d={d} {err:.2e}")
    return out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("seed", SEEDS)
def test_triton_hyper_kernels_in_the_interpreter(seed: int) -> None:
    lines = run_checks(__file__, seed, timeout=300)
    assert len(lines) == 6, lines
    for ln in lines:
        assert float(ln.split()[-1]) <= TOL, ln


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seed", SEEDS)
def test_triton_hyper_kernels_on_cuda_in_bf16(seed: int) -> None:
    """GLM-5.3-Flash's widths (4 streams of 4,096) in bf16 on the GPU: the weights within 1e-5,
    h and the next streams within one bf16 ulp of the output's scale (2^-7: the same roundings,
    sums in another order, so a rounding may land one ulp apart)."""
    from dayzero.kernels.reference import hyper as ref
    from dayzero.kernels.triton import hyper

    g = torch.Generator().manual_seed(seed)
    for t in (1, 7):
        x, fn, base, scale, y = (v.cuda() for v in _inputs(g, t, 4, 4096))
        x, y = x.bfloat16(), y.bfloat16()
        want = ref.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-5)
        got = hyper.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-5)
        assert _rel(got[0].float(), want[0].float()) <= 2**-7
        assert _rel(got[1], want[1]) <= TOL and _rel(got[2], want[2]) <= TOL
        post, comb = want[1], want[2]
        assert _rel(hyper.hc_post(x, y, post, comb).float(), ref.hc_post(x, y, post, comb).float()) <= 2**-7


if __name__ == "__main__":
    main(check)
