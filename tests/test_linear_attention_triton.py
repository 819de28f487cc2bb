"""The delta rules' and the short conv's decode steps in Triton (kernels/triton/linear_attention.py)
against the batched
torch step it replaces (itself checked against the reference: tests/test_linear_attention.py),
in Triton's CPU interpreter in a fresh process: KDA (a decay per key channel, 3 heads of 16 x 24)
and the gated delta rule (a decay per value head, 2 query / key heads read by 4 value heads of
32 columns, past one block of BV), 5 rows in scattered slots of a pool view whose slots sit apart
(as in the engine's byte pool), one row fresh over a slot holding NaN; the short conv with 300
channels (two blocks) and kernel 4, and 24 with kernel 3, on a strided input; outputs and the
rows' states within 1e-5 of their scale (fp32, sums in another order), other slots untouched;
and a verify step (rows of 3 tokens, the state after each token to a checkpoint slot, the rows'
own slots only read) of all three. A step that is not a decode step goes to the chunked form
(the batched backend's, here)."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import replace

import pytest
import torch
from interpreter import main, run_checks

SEEDS = (0, 4, 9)
TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _view(pool: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The states [slots, ...] at the start of each slot's row of the pool."""
    return pool[:, : math.prod(shape[1:])].view(shape)


def check(seed: int) -> list[str]:
    from test_linear_attention import _decode_meta, verify_case

    from dayzero.kernels.batched import linear_attention as batched
    from dayzero.kernels.triton import linear_attention as tla

    g, out = torch.Generator().manual_seed(seed), []
    r, n_slots, slots, fresh = 5, 9, [6, 0, 3, 8, 1], [False, True, False, False, False]
    for op, h, hv, dk, dv in (("kda_recurrence", 3, 3, 16, 24), ("gated_delta_rule", 2, 4, 16, 32)):
        q, k = torch.randn(r, h, dk + 4, generator=g)[..., :dk], torch.randn(r, h, dk, generator=g)
        v = torch.randn(r, hv, dv, generator=g)
        gate = -torch.rand(*((r, hv, dk) if op == "kda_recurrence" else (r, hv)), generator=g)
        beta = torch.rand(r, hv, generator=g)
        pool = torch.randn(n_slots, hv * dk * dv + 7, generator=g) * 0.3  # slots sit apart
        pool[0] = float("nan")  # the fresh row's slot: not read
        shape = (n_slots, hv, dk, dv)
        want_pool, got_pool = pool.clone(), pool.clone()
        want = getattr(batched, op)(
            q, k, v, gate, beta, _view(want_pool, shape), _decode_meta(None, slots, fresh)
        )
        got = getattr(tla, op)(q, k, v, gate, beta, _view(got_pool, shape), _decode_meta(None, slots, fresh))
        err = max(_rel(got, want), _rel(_view(got_pool, shape)[slots], _view(want_pool, shape)[slots]))
        others = [i for i in range(n_slots) if i not in slots]
        same = torch.equal(got_pool[others].nan_to_num(), pool[others].nan_to_num())
        out.append(f"{op} decode untouched={same} {err:.2e}")
    for c, kern in ((300, 4), (24, 3)):  # the short conv: channels past one block; another width
        x = torch.randn(r, c + 6, generator=g)[:, :c]  # a strided view, like a fused projection's
        w = torch.randn(c, 1, kern, generator=g)
        pool = torch.randn(n_slots, c * (kern - 1) + 5, generator=g)
        pool[0] = float("nan")
        shape = (n_slots, c, kern - 1)
        want_pool, got_pool = pool.clone(), pool.clone()
        want = batched.short_conv(x, w, _view(want_pool, shape), _decode_meta(None, slots, fresh))
        got = tla.short_conv(x, w, _view(got_pool, shape), _decode_meta(None, slots, fresh))
        err = max(_rel(got, want), _rel(_view(got_pool, shape)[slots], _view(want_pool, shape)[slots]))
        others = [i for i in range(n_slots) if i not in slots]
        same = torch.equal(got_pool[others].nan_to_num(), pool[others].nan_to_num())
        out.append(f"short_conv c={c} k={kern} decode untouched={same} {err:.2e}")
    ops, meta, slots, _, ckpt = verify_case(seed)  # rows of 3 tokens, a checkpoint after each
    for op, (call, state0) in ops.items():
        want_state, got_state = state0.clone(), state0.clone()
        want = call(getattr(batched, op), want_state, meta, slice(None))
        got = call(getattr(tla, op), got_state, meta, slice(None))
        flat = ckpt.reshape(-1)
        err = max(_rel(got, want), _rel(got_state[flat], want_state[flat]))
        same = torch.equal(got_state[slots].nan_to_num(), state0[slots].nan_to_num())
        out.append(f"{op} verify untouched={same} {err:.2e}")
    return out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("seed", SEEDS)
def test_triton_delta_rule_decode_step_in_the_interpreter(seed: int) -> None:
    lines = run_checks(__file__, seed, timeout=300)
    assert len(lines) == 7, lines
    for ln in lines:
        assert "untouched=True" in ln and float(ln.split()[-1]) <= TOL, ln


def test_a_prompt_chunk_goes_to_the_chunked_form() -> None:
    """Not a decode step (a row of 5 tokens): the Triton op gives the reference's chunked result."""
    pytest.importorskip("triton")
    from dayzero.kernels.reference import linear_attention as reference
    from dayzero.kernels.triton import linear_attention as tla
    from dayzero.sdk.engine.context import StateMeta

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(5, 2, 8, generator=g) for _ in range(3))
    gate, beta = -torch.rand(5, 2, 8, generator=g), torch.rand(5, 2, generator=g)
    meta = StateMeta(None, (1,), (True,), (0, 5))
    s0 = torch.randn(2, 2, 8, 8, generator=g)
    a, b = s0.clone(), s0.clone()
    want = reference.kda_recurrence(q, k, v, gate, beta, a, meta)
    got = tla.kda_recurrence(q, k, v, gate, beta, b, meta)
    assert _rel(got, want) <= TOL and _rel(b, a) <= TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seed", SEEDS)
def test_triton_delta_rule_decode_step_on_cuda(seed: int) -> None:
    """At release widths on the GPU (KDA 64 heads of 128 x 128; the gated delta rule 16 query /
    key heads read by 32 value heads of 128), bf16 inputs, fp32 states in an engine-like pool:
    within 1e-5 of the batched step's scale (both fp32 inside); the short conv over K3's 36,864
    channels: outputs within one bf16 ulp, the slots' inputs bit-equal."""
    from test_linear_attention import _decode_meta

    from dayzero.kernels.batched import linear_attention as batched
    from dayzero.kernels.triton import linear_attention as tla

    g = torch.Generator(device="cuda").manual_seed(seed)
    r, slots, fresh = 8, [3, 9, 0, 4, 7, 1, 8, 2], [False] * 7 + [True]
    for op, h, hv in (("kda_recurrence", 64, 64), ("gated_delta_rule", 16, 32)):
        dk = dv = 128
        q, k = (torch.randn(r, h, dk, generator=g, device="cuda").bfloat16() for _ in range(2))
        v = torch.randn(r, hv, dv, generator=g, device="cuda").bfloat16()
        shape = (r, hv, dk) if op == "kda_recurrence" else (r, hv)
        gate = -torch.rand(*shape, generator=g, device="cuda")
        beta = torch.rand(r, hv, generator=g, device="cuda").bfloat16()
        pool = torch.randn(10, hv * dk * dv + 64, generator=g, device="cuda") * 0.1
        want_pool, got_pool = pool.clone(), pool.clone()
        view = (10, hv, dk, dv)
        meta = _decode_meta(None, slots, fresh)
        meta = replace(meta, slots=meta.slots.cuda(), fresh=meta.fresh.cuda())
        want = getattr(batched, op)(q, k, v, gate, beta, _view(want_pool, view), meta)
        got = getattr(tla, op)(q, k, v, gate, beta, _view(got_pool, view), meta)
        assert _rel(got.float(), want.float()) <= 2**-7, op  # one bf16 ulp of the output's scale
        assert _rel(_view(got_pool, view)[slots], _view(want_pool, view)[slots]) <= TOL, op
        # a verify step: the 8 tokens as 2 rows of 4, each token's state to slots 4..11 of a
        # wider pool (the rows' own slots, 3 and 9 of 12 here, only read)
        wide = torch.randn(14, hv * dk * dv + 64, generator=g, device="cuda") * 0.1
        want_pool, got_pool, view = wide.clone(), wide.clone(), (14, hv, dk, dv)
        ckpt = torch.arange(4, 12, device="cuda").view(2, 4)
        meta = _decode_meta(None, [3, 12], [False, True])
        meta = replace(meta, slots=meta.slots.cuda(), fresh=meta.fresh.cuda(), steps=4, checkpoints=ckpt)
        want = getattr(batched, op)(q, k, v, gate, beta, _view(want_pool, view), meta)
        got = getattr(tla, op)(q, k, v, gate, beta, _view(got_pool, view), meta)
        assert _rel(got.float(), want.float()) <= 2**-7, op
        flat = ckpt.reshape(-1)
        assert _rel(_view(got_pool, view)[flat], _view(want_pool, view)[flat]) <= TOL, op
        assert torch.equal(got_pool[[3, 12]], wide[[3, 12]]), op
    c = 3 * 12288  # Kimi K3's q, k and v convolutions in one call
    x = torch.randn(r, c, generator=g, device="cuda").bfloat16()
    w = torch.randn(c, 1, 4, generator=g, device="cuda")
    pool = torch.randn(10, c * 3 + 64, generator=g, device="cuda")
    want_pool, got_pool = pool.clone(), pool.clone()
    meta = _decode_meta(None, slots, fresh)
    meta = replace(meta, slots=meta.slots.cuda(), fresh=meta.fresh.cuda())
    want = batched.short_conv(x, w, _view(want_pool, (10, c, 3)), meta)
    got = tla.short_conv(x, w, _view(got_pool, (10, c, 3)), meta)
    assert _rel(got.float(), want.float()) <= 2**-7
    assert torch.equal(_view(got_pool, (10, c, 3))[slots], _view(want_pool, (10, c, 3))[slots])


if __name__ == "__main__":
    main(check)
