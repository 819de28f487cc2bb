"""KDA (short conv + delta rule) and hyper-connections against the transformers modules, and the
chunked / stepwise / continued-state forms of the recurrence against each other."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from conftest import SEEDS
from one_row import context

from dayzero.kernels.reference.linear_attention import kda_chunks, kda_steps, short_conv
from dayzero.sdk.engine.context import StateMeta

CPU = torch.device("cpu")
TOL = 1e-5


def _inputs(seed: int, h: int = 3, n: int = 37, dk: int = 8, dv: int = 6):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(h, n, dk, generator=g), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(h, n, dk, generator=g), dim=-1)
    v = torch.randn(h, n, dv, generator=g)
    decay = -torch.rand(h, n, dk, generator=g) * 0.5  # log forget gates in (-0.5, 0]
    beta = torch.rand(h, n, generator=g)
    s0 = torch.randn(h, dk, dv, generator=g) * 0.3
    return q, k, v, decay, beta, s0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_chunked_delta_rule_equals_the_steps(seed: int, chunk: int) -> None:
    args = _inputs(seed)
    o1, s1 = kda_steps(*args)
    o2, s2 = kda_chunks(*args, chunk=chunk)
    assert (o1 - o2).abs().max().item() < TOL
    assert (s1 - s2).abs().max().item() < TOL


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("group", [1, 2, 3])
def test_chunked_delta_rule_in_groups_of_chunks_equals_the_steps(seed: int, group: int) -> None:
    """The decays D [H, C, C, Dk] of `group` chunks at a time (the memory budget), 37 tokens in
    chunks of 8: the same result as the steps and as all chunks at once."""
    args = _inputs(seed)
    o1, s1 = kda_steps(*args)
    o2, s2 = kda_chunks(*args, chunk=8, budget=group * 3 * 8 * 8 * 8 * 4)
    assert (o1 - o2).abs().max().item() < TOL
    assert (s1 - s2).abs().max().item() < TOL


@pytest.mark.parametrize("seed", SEEDS)
def test_delta_rule_continued_from_its_state_equals_one_pass(seed: int) -> None:
    q, k, v, g, b, s0 = _inputs(seed)
    whole, s_whole = kda_chunks(q, k, v, g, b, s0, chunk=8)
    cut = [0, 5, 6, 21, 37]  # uneven pieces, one of a single token
    s, parts = s0, []
    for a, z in itertools.pairwise(cut):
        o, s = (kda_steps if z - a == 1 else kda_chunks)(
            q[:, a:z], k[:, a:z], v[:, a:z], g[:, a:z], b[:, a:z], s
        )
        parts.append(o)
    assert (torch.cat(parts, dim=1) - whole).abs().max().item() < TOL
    assert (s - s_whole).abs().max().item() < TOL


def _state_meta(pool: torch.Tensor, rows: list[tuple[int, int]], has_init: list[bool]) -> StateMeta:
    qs = [0]
    for a, z in rows:
        qs.append(qs[-1] + z - a)
    return StateMeta(pool, tuple(range(len(rows))), tuple(has_init), tuple(qs))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kernel", [2, 4])
def test_short_conv_continues_its_state(seed: int, kernel: int) -> None:
    g = torch.Generator().manual_seed(seed)
    c, n = 6, 13
    x = torch.randn(n, c, generator=g)
    w = torch.randn(c, 1, kernel, generator=g)
    want = torch.nn.functional.silu(
        torch.nn.functional.conv1d(x.t()[None], w, padding=kernel - 1, groups=c)[0, :, :n]
    ).t()
    state = torch.randn(1, c, kernel - 1, generator=g)  # garbage from an earlier occupant
    got = []
    for i, (a, z) in enumerate([(0, 4), (4, 5), (5, 13)]):
        meta = _state_meta(None, [(a, z)], [i > 0])
        got.append(short_conv(x[a:z], w, state, meta))
    assert (torch.cat(got) - want).abs().max().item() < TOL


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    from dayzero.sdk.loader import open_checkpoint
    from dayzero.sdk.parity.runner import Ours, Reference
    from dayzero.sdk.parity.tiny import write_tiny

    ckpt = open_checkpoint(write_tiny("glm53_flash", tmp_path_factory.mktemp("flash") / "ckpt", seed=3))
    return Ours(ckpt, CPU, torch.float32), Reference(ckpt, ckpt.folder, CPU, torch.float32)


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_kda_layer_matches_the_reference(flash, seed: int) -> None:
    ours, ref = flash
    t = 70  # more than one 64-token chunk of the reference's chunked form
    layer, ref_attn = ours.model.layers[0].attn, ref.model.model.language_model.layers[0].self_attn
    x = torch.randn(t, ours.cfg.embedding.dim, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = layer(x, context(t, ours.cfg.cache_groups))
        want = ref_attn(x[None])
    assert (got - want[0]).abs().max().item() < TOL


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_kda_full_rank_gate_equals_the_low_rank_product(flash, seed: int) -> None:
    """KDA with the full-rank output gate (Kimi K3's g_proj [H D, Dm]) holding W_gb W_ga gives
    the low-rank layer's output (which matches transformers above) over 70 tokens (more than
    one 64-token chunk); a random full-rank gate changes it."""
    import dataclasses

    from dayzero.sdk.blocks.kda import KdaAttention

    ours, _ = flash
    low = ours.model.layers[0].attn
    caches = ((0, low.conv_off), (0, low.state_off))
    full = KdaAttention(dataclasses.replace(low.cfg, full_rank_gate=True), low.ops, caches)
    assert not hasattr(full, "g_a") and full.g_proj.shape == (low.g_b.shape[0], low.g_a.shape[1])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(70, ours.cfg.embedding.dim, generator=g)
    with torch.no_grad():
        for name, p in full.named_parameters():
            p.copy_(low.g_b @ low.g_a if name == "g_proj" else getattr(low, name))

        def run(layer) -> torch.Tensor:
            return layer(x, context(70, ours.cfg.cache_groups))

        want, got = run(low), run(full)
        assert (got - want).abs().max().item() < TOL
        full.g_proj.copy_(torch.randn(full.g_proj.shape, generator=g))
        assert (run(full) - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_hyper_connections_match_the_reference(flash, seed: int) -> None:
    ours, ref = flash
    res = ours.model.layers[1].attn_res
    ref_hc = ref.model.model.language_model.layers[1].attn_hc
    ref_norm = ref.model.model.language_model.layers[1].input_layernorm
    g = torch.Generator().manual_seed(seed)
    n, d = res.hc.streams, ours.cfg.embedding.dim
    x = torch.randn(9, n, d, generator=g)
    y = torch.randn(9, d, generator=g)
    with torch.no_grad():
        h, carry = res.pre(x)
        got = res.post(x, y, carry)
        post, comb, collapsed = ref_hc(x[None])
        want = post[0].unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb[0].transpose(-1, -2), x)
    assert (h - ref_norm(collapsed[0])).abs().max().item() < TOL
    assert (got - want).abs().max().item() < TOL
    # the mixing matrix is (nearly) doubly stochastic after Sinkhorn
    assert torch.allclose(carry[1].sum(-2), torch.ones(9, n), atol=1e-3)


def test_a_flat_text_only_config_resolves_like_the_nested_one() -> None:
    """GLM-5.3-Flash text-only checkpoints keep the text fields at the top level."""
    from dayzero.sdk.families import FAMILIES
    from dayzero.sdk.spec.reference import reference_config

    fam = FAMILIES.get("glm53_flash")
    # (a shared indexer right after an indexed layer: transformers' glm5_next runs no other)
    text = {"layer_types": ["full_attention", "full_attention", "linear_attention"], "num_hidden_layers": 3}
    text |= {"indexer_types": ["full", "shared", "full"], "mlp_layer_types": ["dense", "sparse", "sparse"]}
    nested = reference_config(
        fam.spec.spec.reference, {"text_config": dict(fam.spec.spec.tiny["text_config"]) | text}
    )
    flat = dict(nested["text_config"]) | {"architectures": nested["architectures"], "model_type": "glm5_next"}
    a, b = fam.config(nested), fam.config(flat)
    assert [(x.attn_kind, x.mlp_kind, x.attn) for x in a.layers] == [
        (x.attn_kind, x.mlp_kind, x.attn) for x in b.layers
    ]
    assert a.layers[1].attn.indexer.reuse and a.streams == b.streams == 4


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kernel", [2, 4])
def test_batched_short_conv_equals_the_reference(seed: int, kernel: int) -> None:
    """kernels/batched/linear_attention.py against the reference on one mixed step: decode rows,
    a row shorter than K - 1 continuing its state, an empty row, a fresh prompt, a long chunk;
    outputs and every row's written state within TOL (fp32), untouched slots unchanged."""
    from dayzero.kernels.batched.linear_attention import short_conv as batched_conv

    g = torch.Generator().manual_seed(seed)
    c, lens, has_init = 6, [1, 2, 0, 9, 1, 23], [True, True, False, False, True, True]
    x = torch.randn(sum(lens), c, generator=g)
    w = torch.randn(c, 1, kernel, generator=g)
    pool = torch.randn(len(lens) + 2, c, kernel - 1, generator=g)  # two slots no row uses
    slots = (3, 0, 7, 1, 6, 2)
    qs = [0, *itertools.accumulate(lens)]
    meta = StateMeta(None, slots, tuple(has_init), tuple(qs))
    ref_state, got_state = pool.clone(), pool.clone()
    want, got = short_conv(x, w, ref_state, meta), batched_conv(x, w, got_state, meta)
    assert (got - want).abs().max().item() < TOL
    assert (got_state - ref_state).abs().max().item() < TOL
    assert torch.equal(got_state[[4, 5, 7]], pool[[4, 5, 7]])  # unused, and the empty row's


def _decode_meta(pool, slots: list[int], fresh: list[bool]) -> StateMeta:
    """A decode step's state metadata as the engine builds it: host copies and their device twins."""
    n = len(slots)
    return StateMeta(
        pool,
        tuple(slots),
        tuple(not f for f in fresh),
        tuple(range(n + 1)),
        slots=torch.tensor(slots),
        fresh=torch.tensor(fresh, dtype=torch.int64),
        decode=True,
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_batched_decode_steps_equal_the_reference(seed: int) -> None:
    """The graph-safe decode step of kernels/batched/linear_attention.py (short_conv,
    kda_recurrence, gated_delta_rule: device slots and fresh flags only) against the reference's
    row loop on one decode step of 4 rows in scattered slots, one of them fresh over a slot
    holding NaN: outputs and the rows' written states within TOL (fp32), every other slot
    unchanged. Then the same step padded with 3 rows sharing one scratch slot (fresh), as a
    CUDA graph's bucket runs it: the real rows' outputs and states are the same bits."""
    from dayzero.kernels.batched import linear_attention as batched
    from dayzero.kernels.reference import linear_attention as reference

    g = torch.Generator().manual_seed(seed)
    r, h, hv, dk, dv, c, kern, n_slots = 4, 2, 4, 8, 6, 10, 4, 9
    slots, fresh = [5, 0, 7, 2], [False, True, False, False]
    pad, scratch = 3, n_slots - 1
    x = torch.randn(r + pad, c, generator=g)
    w = torch.randn(c, 1, kern, generator=g)
    q, k = torch.randn(r + pad, h, dk, generator=g), torch.randn(r + pad, h, dk, generator=g)
    qv, kv = torch.randn(r + pad, hv, dk, generator=g), torch.randn(r + pad, hv, dk, generator=g)
    v = torch.randn(r + pad, hv, dv, generator=g)
    g_kda = -torch.rand(r + pad, hv, dk, generator=g)  # log decays
    g_gdr = -torch.rand(r + pad, hv, generator=g)
    beta = torch.rand(r + pad, hv, generator=g)
    conv0 = torch.randn(n_slots, c, kern - 1, generator=g)
    rec0 = torch.randn(n_slots, hv, dk, dv, generator=g) * 0.3
    conv0[0], rec0[0] = float("nan"), float("nan")  # the fresh row's slot: not read
    cases = {
        "short_conv": (lambda f, s, m, n: f(x[:n], w, s, m), conv0),
        "kda_recurrence": (lambda f, s, m, n: f(qv[:n], kv[:n], v[:n], g_kda[:n], beta[:n], s, m), rec0),
        "gated_delta_rule": (lambda f, s, m, n: f(q[:n], k[:n], v[:n], g_gdr[:n], beta[:n], s, m), rec0),
    }
    for op, (call, state0) in cases.items():
        ref_state, got_state, pad_state = state0.clone(), state0.clone(), state0.clone()
        want = call(getattr(reference, op), ref_state, _decode_meta(None, slots, fresh), r)
        got = call(getattr(batched, op), got_state, _decode_meta(None, slots, fresh), r)
        assert (got - want).abs().max().item() < TOL, op
        assert (got_state[slots] - ref_state[slots]).abs().max().item() < TOL, op
        others = [i for i in range(n_slots) if i not in slots]
        assert torch.equal(got_state[others], state0[others]), op
        padded = _decode_meta(None, slots + [scratch] * pad, fresh + [True] * pad)
        out = call(getattr(batched, op), pad_state, padded, r + pad)
        assert torch.equal(out[:r], got) and torch.equal(pad_state[slots], got_state[slots]), op
        assert bool(pad_state[scratch].isfinite().all()), op
        assert torch.equal(pad_state[others[:-1]], state0[others[:-1]]), op  # all but the scratch slot


def verify_case(seed: int, steps: int = 3):
    """A speculative verify step's inputs: 3 rows of `steps` tokens in scattered slots (the first
    fresh over a NaN slot), each token's state to a checkpoint slot of its own; ops as
    `op(fn, state, meta, tokens)` over shared tensors, and the pool's initial states."""
    g = torch.Generator().manual_seed(seed)
    r, h, hv, dk, dv, c, kern = 3, 2, 4, 8, 6, 10, 4
    slots, fresh = [4, 0, 2], [True, False, False]
    ckpt = torch.arange(5, 5 + r * steps).view(r, steps)  # past the rows' slots
    n_slots, t = 5 + r * steps, r * steps
    x, w = torch.randn(t, c, generator=g), torch.randn(c, 1, kern, generator=g)
    q, k = torch.randn(t, h, dk, generator=g), torch.randn(t, h, dk, generator=g)
    qv, kv, v = (
        torch.randn(t, hv, dk, generator=g),
        torch.randn(t, hv, dk, generator=g),
        torch.randn(t, hv, dv, generator=g),
    )
    g_kda, g_gdr = -torch.rand(t, hv, dk, generator=g), -torch.rand(t, hv, generator=g)
    beta = torch.rand(t, hv, generator=g)
    conv0 = torch.randn(n_slots, c, kern - 1, generator=g)
    rec0 = torch.randn(n_slots, hv, dk, dv, generator=g) * 0.3
    conv0[4], rec0[4] = float("nan"), float("nan")
    ops = {
        "short_conv": (lambda f, s, m, i: f(x[i], w, s, m), conv0),
        "kda_recurrence": (lambda f, s, m, i: f(qv[i], kv[i], v[i], g_kda[i], beta[i], s, m), rec0),
        "gated_delta_rule": (lambda f, s, m, i: f(q[i], k[i], v[i], g_gdr[i], beta[i], s, m), rec0),
    }
    meta = replace(_decode_meta(None, slots, fresh), steps=steps, checkpoints=ckpt)
    return ops, meta, slots, fresh, ckpt


@pytest.mark.parametrize("seed", SEEDS)
def test_a_verify_step_keeps_the_state_after_each_token(seed: int) -> None:
    """Rows of 3 tokens in one decode step (StateMeta.steps, checkpoints), batched: each token's
    output, and the state in its checkpoint slot, equal 3 single-token decode steps run in turn
    (in place, within TOL); the rows' own slots are only read."""
    from dayzero.kernels.batched import linear_attention as batched

    steps = 3
    ops, meta, slots, fresh, ckpt = verify_case(seed, steps)
    t = len(slots) * steps
    for op, (call, state0) in ops.items():
        got_state, seq_state = state0.clone(), state0.clone()
        got = call(getattr(batched, op), got_state, meta, slice(None))
        assert torch.equal(got_state[slots].nan_to_num(), state0[slots].nan_to_num()), op
        for i in range(steps):  # token i of every row, one decode step after another
            one = _decode_meta(None, slots, fresh if i == 0 else [False] * len(slots))
            want = call(getattr(batched, op), seq_state, one, slice(i, t, steps))
            assert (got[i::steps] - want).abs().max().item() < TOL, (op, i)
            assert (got_state[ckpt[:, i]] - seq_state[slots]).abs().max().item() < TOL, (op, i)
