"""The small fused ops of the linear-attention and hyper-connection blocks in Triton against the
reference ops (kernels/reference): Gated DeltaNet's and KDA's gates (`gdn_gates`, `kda_gates`
with Kimi K3's bounded decay and without), the linear attentions' gated output norm (`rms_norm_gated`,
silu and sigmoid, the norm rounded to the model dtype or kept in fp32) and the low-rank
hyper-connections' stream norm with the previous block's output spread in (`hc_lowrank_norm`,
zero-centred or not) and their block input and inject weights (`hc_lowrank_mix`, with and
without inject: the final collapse). In Triton's CPU interpreter (a fresh process), fp32, on
strided views as the blocks pass them (splits of a fused projection): within 1e-5 of the
output's scale (the same numbers, summed in another order); the decay g also elementwise within
1e-5 over a in [-30, 30] (softplus of a very negative a keeps its relative precision). On the GPU
in bf16 at Qwen3.8-Flash-Next's widths: within one bf16 ulp of the output's scale (2^-7: the same
roundings, sums in another order)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from interpreter import main, run_checks

SEEDS = (0, 6, 13)
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _gdn_inputs(g: torch.Generator, t: int, hv: int, device: str = "cpu", dtype=torch.float32):
    ba = (torch.randn(t, 2 * hv + 3, generator=g, device=device) * 4).to(dtype)  # [b; a; pad]: strided
    a_log = torch.randn(hv, generator=g, device=device) * 0.5
    dt_bias = torch.randn(hv, generator=g, device=device)
    return ba[:, :hv], ba[:, hv : 2 * hv], a_log, dt_bias


def _norm_inputs(g: torch.Generator, t: int, h: int, d: int, device: str = "cpu", dtype=torch.float32):
    x = (torch.randn(t, h, d, generator=g, device=device) * 3).to(dtype)
    zz = torch.randn(t, h * d + 5, generator=g, device=device).to(dtype)  # z: a split of a projection
    w = (torch.rand(d, generator=g, device=device) + 0.5).to(dtype)
    return x, w, zz[:, 5:].view(t, h, d)


def _hc_inputs(g: torch.Generator, t: int, n: int, d: int, device: str = "cpu", dtype=torch.float32):
    x = torch.randn(t, n, d + 8, generator=g, device=device).to(dtype)[..., :d]  # rows strided
    w = (torch.randn(n * d, generator=g, device=device) * 0.2).to(dtype)
    y = torch.randn(t, d, generator=g, device=device).to(dtype)
    inject = 2 * torch.rand(t, n, generator=g, device=device).to(dtype)
    u = (torch.randn(t, n * d, generator=g, device=device) * 2).to(dtype)
    i = torch.randn(t, n + 2, generator=g, device=device).to(dtype)[:, :n]  # strided
    return x, w, y, inject, u, i


def _compare(backend, ref, g: torch.Generator, device: str, dtype) -> list[str]:
    out = []
    for t, hv in ((1, 32), (5, 12)):
        b, a, a_log, dt_bias = _gdn_inputs(g, t, hv, device, dtype)
        (gw, bw), (gg, bg) = ref.gdn_gates(b, a, a_log, dt_bias), backend.gdn_gates(b, a, a_log, dt_bias)
        out.append(f"gdn_gates t={t} hv={hv} {max(_rel(gg, gw), _rel(bg, bw)):.2e}")
    for t, h, d, lb in ((1, 4, 32, -5.0), (3, 3, 24, None)):  # K3's bounded decay; Kimi Linear's
        f = (torch.randn(t, h * d + 6, generator=g, device=device) * 3).to(dtype)[:, : h * d]  # strided
        b = torch.randn(t, h, generator=g, device=device).to(dtype)
        a_log, dt_bias = (
            torch.randn(h, generator=g, device=device),
            torch.randn(h * d, generator=g, device=device),
        )
        want, got = ref.kda_gates(f, b, a_log, dt_bias, lb), backend.kda_gates(f, b, a_log, dt_bias, lb)
        out.append(f"kda_gates t={t} h={h} d={d} bound={lb} {max(map(_rel, got, want)):.2e}")
    for (t, h, d), act, w32, wdt in (
        ((1, 4, 128), "silu", False, dtype),
        ((3, 5, 48), "sigmoid", False, dtype),
        ((2, 3, 64), "sigmoid", True, torch.bfloat16),  # KDA: fp32 x, the weight as stored, fp32 products
    ):
        x, w, z = _norm_inputs(g, t, h, d, device, dtype)
        xin = x.float() if w32 else x
        want = ref.rms_norm_gated(xin, w.to(wdt), z, 1e-6, act, w32, dtype)
        got = backend.rms_norm_gated(xin, w.to(wdt), z, 1e-6, act, w32, dtype)
        out.append(f"rms_norm_gated t={t} h={h} d={d} {act} fp32={w32} {_rel(got, want):.2e}")
    for t, n, d, zc, spread in ((1, 4, 256, True, True), (3, 3, 40, False, True), (2, 4, 64, True, False)):
        x, w, y, inject, u, i = _hc_inputs(g, t, n, d, device, dtype)
        yy, ii = (y, inject) if spread else (None, None)
        want = ref.hc_lowrank_norm(x, w, 1e-6, zc, True, yy, ii)
        got = backend.hc_lowrank_norm(x, w, 1e-6, zc, True, yy, ii)
        out.append(
            f"hc_lowrank_norm t={t} n={n} d={d} zc={zc} spread={spread} {max(map(_rel, got, want)):.2e}"
        )
        xn = want[1]
        for inj in (i, None):
            (hw, iw), (hg, ig) = ref.hc_lowrank_mix(u, xn, inj, n), backend.hc_lowrank_mix(u, xn, inj, n)
            err = _rel(hg, hw) if inj is None else max(_rel(hg, hw), _rel(ig, iw))
            out.append(f"hc_lowrank_mix t={t} n={n} d={d} inject={inj is not None} {err:.2e}")
    return out


OPS = ("gdn_gates", "kda_gates", "rms_norm_gated", "hc_lowrank_norm", "hc_lowrank_mix")


def _backend(name: str) -> SimpleNamespace:
    """The ops as the kernel registry holds them for one backend (reference, triton)."""
    import dayzero.kernels.selection  # noqa: F401 (registers the built-in backends)
    from dayzero.kernels.registry import KERNELS

    return SimpleNamespace(**{op: KERNELS.get(f"{op}/{name}").fn for op in OPS})


def check(seed: int) -> list[str]:
    from dayzero.kernels.reference import linear_attention
    from dayzero.kernels.triton import linear_attention as tla

    g = torch.Generator().manual_seed(seed)
    out = _compare(_backend("triton"), _backend("reference"), g, "cpu", torch.float32)
    a = torch.linspace(-30, 30, 121)[None, :]  # softplus over its range, elementwise
    b, a_log, dt_bias = torch.randn(1, 121, generator=g), torch.zeros(121), torch.zeros(121)
    want, got = linear_attention.gdn_gates(b, a, a_log, dt_bias)[0], tla.gdn_gates(b, a, a_log, dt_bias)[0]
    out.append(f"gdn_gates elementwise {((got - want).abs() / want.abs()).max().item():.2e}")
    return out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("seed", SEEDS)
def test_triton_gate_ops_in_the_interpreter(seed: int) -> None:
    lines = run_checks(__file__, seed, timeout=300)
    assert len(lines) == 17, lines
    for ln in lines:
        assert float(ln.split()[-1]) <= TOL, ln


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seed", SEEDS)
def test_triton_gate_ops_on_cuda_in_bf16(seed: int) -> None:
    from dayzero.kernels.reference import basic, hyper, linear_attention
    from dayzero.kernels.triton import hyper as thyper
    from dayzero.kernels.triton import linear_attention as tla
    from dayzero.kernels.triton import norm as tnorm

    g = torch.Generator(device="cuda").manual_seed(seed)
    for t in (1, 32):  # Flash-Next: 32 value heads of 128, 4 streams of 2,560
        b, a, a_log, dt_bias = _gdn_inputs(g, t, 32, "cuda", torch.bfloat16)
        (gw, bw), (gg, bg) = (
            linear_attention.gdn_gates(b, a, a_log, dt_bias),
            tla.gdn_gates(b, a, a_log, dt_bias),
        )
        assert _rel(gg, gw) <= TOL and _rel(bg, bw) <= 2**-7
        f = torch.randn(t, 64 * 128, generator=g, device="cuda").bfloat16()  # K3: 64 heads of 128
        b = torch.randn(t, 64, generator=g, device="cuda").bfloat16()
        a_log, dt_bias = (
            torch.randn(64, generator=g, device="cuda"),
            torch.randn(64 * 128, generator=g, device="cuda"),
        )
        for lb in (-5.0, None):
            want, got = (
                linear_attention.kda_gates(f, b, a_log, dt_bias, lb),
                tla.kda_gates(f, b, a_log, dt_bias, lb),
            )
            assert _rel(got[0], want[0]) <= TOL and _rel(got[1], want[1]) <= 2**-7
        x, w, z = _norm_inputs(g, t, 32, 128, "cuda", torch.bfloat16)
        for act in ("silu", "sigmoid"):
            want = basic.rms_norm_gated(x, w, z, 1e-6, act, False, torch.bfloat16)
            assert _rel(tnorm.rms_norm_gated(x, w, z, 1e-6, act, False, torch.bfloat16), want) <= 2**-7
        kda = (x.float(), w, z, 1e-6, "sigmoid", True, torch.bfloat16)  # KDA's form
        assert _rel(tnorm.rms_norm_gated(*kda), basic.rms_norm_gated(*kda)) <= 2**-7
        x, w, y, inject, u, i = _hc_inputs(g, t, 4, 2560, "cuda", torch.bfloat16)
        want = hyper.hc_lowrank_norm(x, w, 1e-6, True, True, y, inject)
        got = thyper.hc_lowrank_norm(x, w, 1e-6, True, True, y, inject)
        assert max(map(_rel, got, want)) <= 2**-7
        (hw, iw), (hg, ig) = hyper.hc_lowrank_mix(u, want[1], i, 4), thyper.hc_lowrank_mix(u, want[1], i, 4)
        assert _rel(hg, hw) <= 2**-7 and _rel(ig, iw) <= 2**-7


if __name__ == "__main__":
    main(check)
