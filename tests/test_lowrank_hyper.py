"""Hyper-connections with the low-rank dynamic mixer (sdk/blocks/norm.py LowRankHyperResidual,
residual `mixer: lowrank`) against the transformers module it mirrors, qwen4_exp's
Qwen4ExpTextGatedResidual, on random weights and inputs, fp32 on CPU.

Checked, 2 seeds, tolerance 1e-5 absolute (values are O(1)): the block input h and the
injection weights of a layer's mixer (use_combine) and the next streams X + inject f(h) for a
random branch output; the final collapse (use_combine False) that replaces the final norm.
"""

from __future__ import annotations

import pytest
import torch

from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.norm import LowRankHyperResidual
from dayzero.sdk.config.model import HyperCfg, NormCfg, ResidualCfg

TOL = 1e-5
SEEDS = (0, 1)
N, D, R, EPS = 4, 24, 10, 1e-6
CFG = ResidualCfg("hyper", NormCfg(D, EPS, True, True), 0, HyperCfg(N, 1, 0.0, EPS, "lowrank", R))


def _pair(seed: int, combine: bool) -> tuple[LowRankHyperResidual, torch.nn.Module]:
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedResidual

    hf = Qwen4ExpTextConfig(hidden_size=D, hc_count=N, hc_lowrank=R, rms_norm_eps=EPS, num_hidden_layers=1)
    ref = Qwen4ExpTextGatedResidual(hf, use_combine=combine).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            scale = 0.1 if name.startswith("hc_norm") else p.shape[-1] ** -0.5  # the norm: 1 + w
            p.copy_(scale * torch.randn(p.shape, generator=g))
    ops = OpTable(torch.device("cpu"), torch.float32)
    for op in ("hc_lowrank_norm", "hc_lowrank_mix", "linear"):
        ops.need(op)
    ours = LowRankHyperResidual(CFG, ops.resolve(), combine=combine)
    with torch.no_grad():
        ours.norm.copy_(ref.hc_norm.weight)
        ours.down.copy_(ref.input_mix_weight_down.weight)
        ours.up.copy_(ref.input_mix_weight_up.weight)
        if combine:
            ours.inject.copy_(ref.block_inject_weight.weight)
    return ours, ref


@pytest.mark.parametrize("seed", SEEDS)
def test_lowrank_mixer_and_injection_match_the_reference(seed: int) -> None:
    ours, ref = _pair(seed, combine=True)
    g = torch.Generator().manual_seed(100 + seed)
    x = 2 * torch.randn(37, N, D, generator=g)  # [T, N, D]
    y = torch.randn(37, D, generator=g)  # a branch output f(h)
    with torch.no_grad():
        mixed, hyper_input, inject = ref(x.flatten(1))
        h, carry = ours.pre(x)
        assert (h - mixed).abs().max().item() < TOL
        assert (carry[1] - inject).abs().max().item() < TOL
        want = hyper_input + (y.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
        assert (ours.post(x, y, carry).flatten(1) - want).abs().max().item() < TOL


@pytest.mark.parametrize("seed", SEEDS)
def test_lowrank_collapse_matches_the_reference(seed: int) -> None:
    ours, ref = _pair(seed, combine=False)
    assert ours.inject is None
    x = 2 * torch.randn(37, N, D, generator=torch.Generator().manual_seed(200 + seed))
    with torch.no_grad():
        assert (ours(x) - ref(x.flatten(1))).abs().max().item() < TOL
