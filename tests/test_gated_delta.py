"""The gated delta rule (Gated DeltaNet) reference op against an independent formula.

The oracle below is the recurrence written from the math, per value head and token, in float64:
    q <- l2norm(q) / sqrt(Dk), k <- l2norm(k)  (l2norm(x) = x / sqrt(|x|^2 + 1e-6))
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,   o_t = S_t^T q_t
with value head j reading query / key head j // (HV / H). The op runs in fp32; tolerance 2e-5
absolute (measured against the oracle: at most 1.0e-6 chunked, 1.2e-7 token by token). A second
check runs transformers' own torch functions (qwen3_next's torch_recurrent_gated_delta_rule and
torch_chunk_gated_delta_rule; measured at most 4.7e-7).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from dayzero.kernels.reference.linear_attention import gated_delta_rule, gdr_chunks, gdr_steps
from dayzero.sdk.engine.context import StateMeta

SEEDS = (0, 1, 2)
ATOL = 2e-5


def _inputs(seed: int, t: int, h: int = 2, hv: int = 4, dk: int = 16, dv: int = 8):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(t, h, dk, generator=gen) for _ in range(2))  # [T, H, Dk]
    v = torch.randn(t, hv, dv, generator=gen)  # [T, HV, Dv]
    # Qwen3-Next's gate: g = -exp(A_log) softplus(a + dt_bias), between about -6 and 0
    a = torch.rand(hv, generator=gen).mul(2).exp()  # exp(A_log) [HV]
    g = -a * torch.nn.functional.softplus(torch.randn(t, hv, generator=gen))  # [T, HV]
    beta = torch.sigmoid(torch.randn(t, hv, generator=gen))  # [T, HV]
    return q, k, v, g, beta


def _oracle(q, k, v, g, beta, s0):
    """One row, float64, a Python loop over tokens and value heads. s0 [HV, Dk, Dv]."""
    q, k, v, g, beta, s = (x.double() for x in (q, k, v, g, beta, s0))
    rep = v.shape[1] // q.shape[1]
    s = s.clone()
    out = torch.zeros(v.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        for j in range(v.shape[1]):
            qt, kt = q[t, j // rep], k[t, j // rep]
            qt = qt / torch.sqrt(qt @ qt + 1e-6) / q.shape[-1] ** 0.5
            kt = kt / torch.sqrt(kt @ kt + 1e-6)
            a = torch.exp(g[t, j])
            s[j] = a * s[j] + torch.outer(kt, beta[t, j] * (v[t, j] - a * (s[j].T @ kt)))
            out[t, j] = s[j].T @ qt
    return out, s


def _meta(lengths, slots, has_init) -> StateMeta:
    qs = [0]
    for n in lengths:
        qs.append(qs[-1] + n)
    return StateMeta(torch.empty(0, dtype=torch.uint8), tuple(slots), tuple(has_init), tuple(qs))


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("seed", SEEDS)
def test_op_matches_the_independent_formula(seed: int, chunked: bool) -> None:
    """A batch of rows (one decode token, a fresh 37-token prompt, a 70-token continuation over
    two chunks) in permuted state slots; an unused slot is left alone."""
    lengths, slots, has_init = (1, 37, 70), (2, 0, 3), (True, False, True)
    q, k, v, g, beta = _inputs(seed, sum(lengths))
    state = torch.randn(4, 4, 16, 8, generator=torch.Generator().manual_seed(100 + seed))
    before = state.clone()
    out = gated_delta_rule(q, k, v, g, beta, state, _meta(lengths, slots, has_init), chunked=chunked)
    a = 0
    for n, slot, init in zip(lengths, slots, has_init, strict=True):
        s0 = before[slot] if init else torch.zeros_like(before[slot])
        want_o, want_s = _oracle(q[a : a + n], k[a : a + n], v[a : a + n], g[a : a + n], beta[a : a + n], s0)
        torch.testing.assert_close(out[a : a + n].double(), want_o, atol=ATOL, rtol=0)
        torch.testing.assert_close(state[slot].double(), want_s, atol=ATOL, rtol=0)
        a += n
    assert torch.equal(state[1], before[1])


@pytest.mark.parametrize("seed", SEEDS)
def test_chunked_form_equals_the_recurrent_one(seed: int) -> None:
    """The WY chunked form (chunks of 16 over 50 tokens: three whole, one padded) and the
    token loop agree, output and final state, from a non-zero state."""
    q, k, v, g, beta = (x.transpose(0, 1) for x in _inputs(seed, 50, h=3, hv=3, dk=16, dv=12))
    q = torch.nn.functional.normalize(q, dim=-1) * 16**-0.5
    k = torch.nn.functional.normalize(k, dim=-1)
    s0 = torch.randn(3, 16, 12, generator=torch.Generator().manual_seed(seed))
    o1, s1 = gdr_steps(q, k, v, g, beta, s0)
    o2, s2 = gdr_chunks(q, k, v, g, beta, s0, chunk=16)
    torch.testing.assert_close(o2, o1, atol=ATOL, rtol=0)
    torch.testing.assert_close(s2, s1, atol=ATOL, rtol=0)


@pytest.mark.parametrize("seed", SEEDS)
def test_state_carried_across_two_calls_equals_one_call(seed: int) -> None:
    q, k, v, g, beta = _inputs(seed, 90)
    one = torch.zeros(1, 4, 16, 8)
    whole = gated_delta_rule(q, k, v, g, beta, one, _meta((90,), (0,), (False,)))
    two = torch.full((1, 4, 16, 8), float("nan"))  # a fresh row ignores what the slot held
    first = gated_delta_rule(q[:33], k[:33], v[:33], g[:33], beta[:33], two, _meta((33,), (0,), (False,)))
    rest = gated_delta_rule(q[33:], k[33:], v[33:], g[33:], beta[33:], two, _meta((57,), (0,), (True,)))
    torch.testing.assert_close(torch.cat((first, rest)), whole, atol=ATOL, rtol=0)
    torch.testing.assert_close(two, one, atol=ATOL, rtol=0)


def _transformers_fns():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    # the torch functions themselves, not whatever kernel the hub wrapper would dispatch to
    return inspect.unwrap(m.torch_recurrent_gated_delta_rule), inspect.unwrap(m.torch_chunk_gated_delta_rule)


@pytest.mark.parametrize("seed", SEEDS)
def test_op_matches_transformers_qwen3_next(seed: int) -> None:
    """Second check: transformers' Qwen3-Next torch functions ([B, T, H, D] layout, state
    [B, HV, Dk, Dv], l2norm in the kernel) on one row of 70 tokens from an initial state."""
    recurrent, chunk = _transformers_fns()
    q, k, v, g, beta = _inputs(seed, 70)
    s0 = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(seed))
    state = s0[None].clone()
    ours = gated_delta_rule(q, k, v, g, beta, state, _meta((70,), (0,), (True,)))
    for fn in (recurrent, chunk):
        o, s = fn(
            q[None], k[None], v[None], g[None], beta[None],
            initial_state=s0[None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(ours, o[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(state, s, atol=ATOL, rtol=0)


def test_mismatched_heads_are_refused_naming_the_op() -> None:
    q, k, v, g, beta = _inputs(0, 4, h=3, hv=4)
    with pytest.raises(ValueError, match="gated_delta_rule: value heads"):
        gated_delta_rule(q, k, v, g, beta, torch.zeros(1, 4, 16, 8), _meta((4,), (0,), (False,)))
