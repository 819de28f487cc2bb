"""Expert id -1 (no expert): an expert-parallel rank passes its picks of the other ranks' experts
as -1, and the moe_experts op skips them (kernels/ops.py, feature `skip`).

Rank r of 3 holds 4 of 12 experts; its result with the others' picks -1 must equal the
reference over all 12 experts with those picks weighed 0 (the full result restricted to rank
r's experts), and the three ranks' results must add up to the full one: fp32 within 1e-5 of
the output's scale (the same products summed in another order), bf16 experts within 2e-2 of the
fp32 result (a few bf16 ulps: the grouped kernel rounds each product to bf16). Backends: the
reference loop, the batched kernel's gathered (9 pairs) and grouped-GEMM (111 pairs) paths, with
and without expert biases; the packed reference. The Triton kernels run the same check in
Triton's interpreter (tests/test_triton_interpreter.py, `check_moe_skip` and the packed skip
rows). Also: the sorted-pair alignment leaves skipped pairs out of every block, and an
expert-parallel MoE asks for `skip` (a kernel without it is refused by name). (The data-parallel
attention's reduce-scatter of rows is checked on its gloo ranks: tests/test_dp_attention.py.)
"""

from __future__ import annotations

import pytest
import torch

# (the kernels are imported by the tests that use them: the gloo ranks import this module alone)

SEEDS = (0, 1, 2)
E, P, K, DM, INTER = 12, 3, 3, 64, 32  # experts, ranks, picks a token, hidden, expert intermediate


def _experts(gen: torch.Generator, bias: bool) -> tuple:
    gate_up = torch.randn(E, 2 * INTER, DM, generator=gen) / DM**0.5  # [E, 2I, Dm]
    down = torch.randn(E, DM, INTER, generator=gen) / INTER**0.5  # [E, Dm, I]
    if not bias:
        return gate_up, down, None, None
    return gate_up, down, torch.randn(E, 2 * INTER, generator=gen), torch.randn(E, DM, generator=gen)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "biases"])
@pytest.mark.parametrize("tokens", [3, 37], ids=["gathered", "grouped_gemm"])
@pytest.mark.parametrize("seed", SEEDS)
def test_each_rank_gives_the_full_result_restricted_to_its_experts(seed: int, tokens: int, bias: bool):
    from dayzero.kernels.batched.moe import moe_experts as batched
    from dayzero.kernels.reference.moe import moe_experts as reference
    from dayzero.kernels.reference.moe import moe_route

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, DM, generator=gen)
    gate_up, down, gub, db = _experts(gen, bias)
    w, ids = moe_route(torch.randn(tokens, E, generator=gen), K, "sigmoid")  # [T, k]
    ids[0] = torch.tensor([0, 5, 11])  # a pick on every rank
    full = reference(x, gate_up, down, w, ids, False, None, "silu", (1.702, 0.0), gub, db)  # [T, Dm]
    n = E // P
    summed = {"reference": torch.zeros_like(full), "batched": torch.zeros_like(full)}
    for r in range(P):
        mine = ids // n == r  # [T, k]
        kept = torch.where(mine, w, 0.0)  # [T, k]: the others' picks weigh 0
        want = reference(x, gate_up, down, kept, ids, False, None, "silu", (1.702, 0.0), gub, db)
        local = torch.where(mine, ids - r * n, -1)  # [T, k] this rank's expert ids, -1: another rank's
        part = slice(r * n, (r + 1) * n)
        biases = (None, None) if gub is None else (gub[part], db[part])
        for name, fn in (("reference", reference), ("batched", batched)):
            got = fn(x, gate_up[part], down[part], w, local, False, None, "silu", (1.702, 0.0), *biases)
            err = _rel(got, want)
            print(f"{name} rank={r} {err:.1e}", end="; ")
            assert err <= 1e-5, (name, r, err)
            summed[name] += got
        if gub is None:  # bf16 experts through the grouped kernel
            got16 = batched(x.bfloat16(), gate_up[part].bfloat16(), down[part].bfloat16(), w, local)
            assert got16.dtype == torch.bfloat16
            assert _rel(got16, want) <= 2e-2, _rel(got16, want)
    for name, total in summed.items():  # the ranks' results add up to every expert's
        assert _rel(total, full) <= 1e-5, (name, _rel(total, full))


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_the_packed_reference_skips_what_weighs_nothing(seed: int):
    """moe_experts_packed's reference (fp8_block experts): ids -1 give the result of those picks
    weighed 0, within 1e-6 of its scale (the same sums; -1 only leaves products out)."""
    from dayzero.kernels.packed import PackedWeight
    from dayzero.kernels.reference import packed as ref_packed
    from dayzero.sdk.bench.quantize import quantize

    gen = torch.Generator().manual_seed(seed)

    def weight(shape: tuple[int, int, int]) -> PackedWeight:
        w = PackedWeight("fp8_block", shape)
        parts = [quantize(d, "fp8_block") for d in torch.randn(*shape, generator=gen) / shape[-1] ** 0.5]
        for name, buf in w.named_buffers():
            buf.copy_(torch.stack([p[name] for p in parts]).reshape(buf.shape))
        return w

    gate_up, down = weight((4, 256, 128)), weight((4, 128, 128))
    x = torch.randn(5, 128, generator=gen)
    ids = torch.rand(5, 4, generator=gen).topk(2, dim=-1).indices  # [T, 2]
    w = torch.rand(5, 2, generator=gen)
    skip = torch.rand(5, 2, generator=gen) < 0.5
    skip[0, 0] = False
    want = ref_packed.moe_experts_packed(x, gate_up, down, torch.where(skip, 0.0, w), ids, True, 7.0)
    got = ref_packed.moe_experts_packed(x, gate_up, down, w, torch.where(skip, -1, ids), True, 7.0)
    assert _rel(got, want) <= 1e-6, _rel(got, want)


def test_sorted_pairs_leave_skipped_ones_out_of_every_block():
    """kernels/triton/packed.py `_align` (the Triton grouped paths' sort, plain torch): each pair
    with an expert in exactly one block of its expert, no skipped pair in any."""
    tp = pytest.importorskip("dayzero.kernels.triton.packed")
    ids = torch.tensor([[3, -1], [-1, 0], [1, 3], [-1, -1], [2, 3]])
    rows, blocks = tp._align(ids, experts=5, bm=4)
    flat = ids.reshape(-1)
    real = rows[rows < flat.numel()]
    assert sorted(real.tolist()) == [p for p in range(flat.numel()) if flat[p] >= 0]
    for b, e in enumerate(blocks.tolist()):
        block = rows[b * 4 : (b + 1) * 4]
        block = block[block < flat.numel()]
        assert (e >= 0 and (flat[block] == e).all()) or (e < 0 and block.numel() == 0)


def test_an_expert_parallel_moe_needs_kernels_that_skip():
    from dayzero.kernels.batched.moe import moe_experts as batched
    from dayzero.kernels.registry import KERNELS, Capabilities, Kernel
    from dayzero.kernels.selection import Need, _missing
    from dayzero.sdk.blocks.base import BLOCKS
    from dayzero.sdk.blocks.mlp import MoeCfg
    from dayzero.sdk.config.model import Parallel

    moe = BLOCKS.get("moe")
    cfg = MoeCfg(64, 8, 2, 32, "softmax", False, 1, 1, True, 1.0, 0, False, False)

    def features(par: Parallel) -> frozenset[str]:
        c = moe.shard(cfg, par) if par.size > 1 else cfg
        return next(f for op, f, _ in moe.needs(c) if op == "moe_experts")

    assert "skip" in features(Parallel(2, 1, experts=True))
    assert "skip" not in features(Parallel(2, 1)) and "skip" not in features(Parallel())
    for key in ("moe_experts/reference", "moe_experts_packed/reference"):
        assert "skip" in KERNELS.get(key).caps.features
    # a kernel that does not state `skip` is refused for the expert-parallel need, naming it
    lacking = Kernel("moe_experts", "noskip", batched, Capabilities(features=frozenset({"fp32"})))
    need = Need("moe_experts", features(Parallel(2, 1, experts=True)))
    assert _missing(lacking, need, torch.device("cpu"), torch.float32) == ["features skip"]
