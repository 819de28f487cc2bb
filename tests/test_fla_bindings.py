"""The fla-core bindings (kernels/fla.py): dayzero's rows and state slots mapped onto fla's
variable-length batches, checked against the reference ops.

On CPU, fla's kernels cannot run (fla-core 0.6.0's kernels fail in Triton's interpreter, and
installing fla on CPU would make transformers' references call them), so the binding drives
`fla_like`: fla's fused recurrent kernels (fla/ops/kda/fused_recurrent.py,
fla/ops/gated_delta_rule/fused_recurrent.py) transcribed to torch, with the argument checks
of fla's entry points. What is tested is the mapping: tokens, cu_seqlens, the rows' slots,
fresh rows' zero state, the state written back, l2norm / scale flags. On a GPU with fla
installed, the last tests run fla's own kernels against the reference.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dayzero.kernels import fla
from dayzero.kernels.reference.linear_attention import gated_delta_rule, kda_recurrence
from dayzero.sdk.engine.context import StateMeta

REFERENCE = {"kda_recurrence": kda_recurrence, "gated_delta_rule": gated_delta_rule}
# rows: a decode token, an empty row, a fresh 21-token prompt, a 40-token continuation
LENGTHS, SLOTS, HAS_INIT = (1, 0, 21, 40), (3, 1, 0, 2), (True, False, False, True)


def fla_like(calls: list[str], name: str):
    """fla's entry-point contract and its recurrence, in torch: q, k [1, T, H, K], v [1, T, HV, V],
    g [1, T, HV, K] (KDA) or [1, T, HV], beta [1, T, HV], all by name (fla's fused recurrent
    gated delta rule takes gk in beta's position); per sequence of cu_seqlens, state
    h [K, V] per value head: h *= exp(g); v' = beta (v - h^T k); h += k v'^T; o = h^T q."""

    def kernel(*, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):  # fmt: skip
        calls.append(name)
        assert q.shape[0] == 1 and cu_seqlens is not None, "fla: varlen batches are [1, T, ...]"
        assert initial_state.shape[0] == len(cu_seqlens) - 1 and initial_state.dtype == torch.float32
        assert output_final_state and use_qk_l2norm_in_kernel and scale == q.shape[-1] ** -0.5
        assert cu_seqlens.dtype == torch.int64 and int(cu_seqlens[-1]) == q.shape[1]
        if cu_seqlens_cpu is not None:
            assert torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
        rep = v.shape[2] // q.shape[2]
        q, k = (x.float().repeat_interleave(rep, dim=2)[0] for x in (q, k))  # [T, HV, K]
        if use_qk_l2norm_in_kernel:
            q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        q = q * scale
        v, g, beta = v[0].float(), g[0].float(), beta[0].float()
        o, final = torch.zeros_like(v), initial_state.clone()
        for n in range(len(cu_seqlens) - 1):
            h = final[n]  # [HV, K, V]
            for t in range(int(cu_seqlens[n]), int(cu_seqlens[n + 1])):
                h = h * (g[t].exp()[..., None] if g.ndim == 3 else g[t].exp()[:, None, None])
                vt = beta[t, :, None] * (v[t] - torch.einsum("hkv,hk->hv", h, k[t]))
                h = h + k[t][..., None] * vt[:, None, :]
                o[t] = torch.einsum("hkv,hk->hv", h, q[t])
            final[n] = h
        return o[None], final

    return kernel


def _meta(lengths, slots, has_init) -> StateMeta:
    qs = [0]
    for n in lengths:
        qs.append(qs[-1] + n)
    return StateMeta(torch.empty(0, dtype=torch.uint8), tuple(slots), tuple(has_init), tuple(qs))


def _inputs(op: str, seed: int, t: int, device="cpu", dtype=torch.float32, h=2, hv=4, dk=16, dv=8):
    gen = torch.Generator().manual_seed(seed)
    if op == "kda_recurrence":
        hv = h
    q, k = (torch.randn(t, h, dk, generator=gen) for _ in range(2))  # [T, H, Dk]
    v = torch.randn(t, hv, dv, generator=gen)  # [T, HV, Dv]
    gate = (t, hv, dk) if op == "kda_recurrence" else (t, hv)
    g = -torch.nn.functional.softplus(torch.randn(gate, generator=gen))  # log decays, fp32
    beta = torch.sigmoid(torch.randn(t, hv, generator=gen))
    state = torch.randn(4, hv, dk, dv, generator=gen)  # [slots, HV, Dk, Dv] fp32
    state[0] = float("nan")  # the fresh row's slot: never read
    moved = [x.to(device, dtype) for x in (q, k, v)] + [g.to(device), beta.to(device, dtype)]
    return (*moved, state.to(device))


def test_rows_map_to_cu_seqlens_slots_and_fresh_flags() -> None:
    rows = fla.rows_of(_meta((0, *LENGTHS), (9, *SLOTS), (True, *HAS_INIT)), torch.device("cpu"))
    assert rows.cu_seqlens.tolist() == [0, 1, 22, 62] and rows.cu_seqlens_cpu.tolist() == [0, 1, 22, 62]
    assert rows.slots.tolist() == [3, 0, 2] and rows.fresh.tolist() == [False, True, False]
    assert (rows.start, rows.end, rows.decode) == (0, 62, False)
    assert fla.rows_of(_meta((0, 0), (0, 1), (True, True)), torch.device("cpu")) is None
    assert fla.rows_of(_meta((1, 0, 1), (5, 6, 7), (True,) * 3), torch.device("cpu")).decode


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("op", ["kda_recurrence", "gated_delta_rule"])
def test_binding_equals_the_reference_op(op: str, chunked: bool) -> None:
    calls: list[str] = []
    run = fla.bind(op, fla_like(calls, "chunk"), fla_like(calls, "recurrent"))
    for seed in (0, 1):
        *x, state = _inputs(op, seed, sum(LENGTHS))
        ref_state = state.clone()
        meta = _meta(LENGTHS, SLOTS, HAS_INIT)
        want = REFERENCE[op](*x, ref_state, meta, chunked=chunked)
        got = run(*x, state, meta, chunked=chunked)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        torch.testing.assert_close(state[[0, 2, 3]], ref_state[[0, 2, 3]], atol=2e-5, rtol=0)
        assert torch.equal(state[1], ref_state[1])  # the empty row's slot is left alone
    assert set(calls) == {"chunk" if chunked else "recurrent"}


@pytest.mark.parametrize("op", ["kda_recurrence", "gated_delta_rule"])
def test_decode_steps_run_the_recurrent_kernel(op: str) -> None:
    calls: list[str] = []
    run = fla.bind(op, fla_like(calls, "chunk"), fla_like(calls, "recurrent"))
    *x, state = _inputs(op, 3, 3)
    meta = _meta((1, 1, 1), (2, 3, 1), (True, True, True))
    ref_state = state.clone()
    want = REFERENCE[op](*x, ref_state, meta)
    torch.testing.assert_close(run(*x, state, meta), want, atol=2e-5, rtol=0)
    torch.testing.assert_close(state[1:], ref_state[1:], atol=2e-5, rtol=0)
    assert calls == ["recurrent"]


def test_key_heads_past_fla_limit_are_refused_by_name() -> None:
    run = fla.bind("gated_delta_rule", fla_like([], "chunk"), fla_like([], "recurrent"))
    *x, state = _inputs("gated_delta_rule", 0, 2, dk=320)
    with pytest.raises(ValueError, match=r"gated_delta_rule/fla: key head size 320 > 256"):
        run(*x, state, _meta((2,), (0,), (False,)))


HAVE_FLA_GPU = torch.cuda.is_available() and importlib.util.find_spec("fla") is not None
gpu = pytest.mark.skipif(not HAVE_FLA_GPU, reason="needs CUDA and fla-core (pyproject's gpu extra)")


def test_fla_registers_only_with_cuda_and_fla() -> None:
    import dayzero.kernels.selection  # noqa: F401  (every built-in backend registered)
    from dayzero.kernels.registry import KERNELS

    names = dict(KERNELS.items())
    assert fla.HAVE_FLA == HAVE_FLA_GPU
    assert {f"{op}/fla" in names for op in REFERENCE} == {HAVE_FLA_GPU}


@gpu
def test_fla_is_selected_on_cuda() -> None:
    from dayzero.kernels.selection import Need, select

    for op in ("kda_recurrence", "gated_delta_rule"):
        need = Need(op, frozenset({"chunked"}))
        assert select(need, torch.device("cuda"), torch.bfloat16).backend == "fla", op


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["kda_recurrence", "gated_delta_rule"])
def test_fla_kernels_match_the_reference_on_cuda(op: str, dtype: torch.dtype) -> None:
    """fla's chunked kernel (a prefill step over two chunks) and its recurrent one (decode steps
    continuing the same slots) against the reference in fp32 on the same inputs; real head size
    128. Tolerance, absolute, on outputs ~0.1 and states ~1: fp32 inputs 5e-3 (fla's dots may run
    in TF32), bf16 inputs 5e-2 (fla keeps normed q / k and its chunk products in bf16); a layout
    slip (a transposed state, a wrong slot or gate) is off by O(1)."""
    from dayzero.kernels.registry import KERNELS

    run, tol = KERNELS.get(f"{op}/fla").fn, 5e-3 if dtype == torch.float32 else 5e-2
    dev = torch.device("cuda")
    *x, state = _inputs(op, 0, sum(LENGTHS) + 3, dev, dtype, h=4, hv=8, dk=128, dv=128)
    ref_state = state.clone()
    prefill = _meta(LENGTHS, SLOTS, HAS_INIT)
    decode = _meta((1, 1, 1), (3, 0, 2), (True, True, True))
    n = sum(LENGTHS)
    for part, meta in ((slice(0, n), prefill), (slice(n, n + 3), decode)):
        xs = [t[part].contiguous() for t in x]
        want = REFERENCE[op](*(t.float() for t in xs), ref_state, meta)
        got = run(*xs, state, meta)
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)
        torch.testing.assert_close(state[[0, 2, 3]], ref_state[[0, 2, 3]], atol=tol, rtol=0)
