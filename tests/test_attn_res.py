"""Attention residuals (Kimi K3, sdk/blocks/norm.py `AttnResidual`) against the fact sheet's
algorithm written out with a snapshot list and a partial sum in fp64 (../shared/families/
kimi_k3.md, section 2.1), through the residual protocol the decoder drives (pre, post_pre,
post, the output mix), with random sublayers: 5 layers in blocks of 2 (snapshots at layers 0,
2, 4; the final mix over 3 snapshots and the partial sum), and in blocks of 1 and 8."""

from __future__ import annotations

import pytest
import torch
from conftest import SEEDS

from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks.norm import AttnResidual
from dayzero.sdk.config.model import AttnResCfg, NormCfg, ResidualCfg

D, T, LAYERS, EPS = 16, 5, 5, 1e-5
TOL = 1e-5  # fp32 against fp64, relative to the output's scale


def _ops() -> OpTable:
    ops = OpTable(torch.device("cpu"), torch.float32)
    ops.need("rms_norm", frozenset())
    return ops.resolve()


def _res(ops: OpTable, append: bool, g: torch.Generator) -> AttnResidual:
    res = AttnResidual(ResidualCfg("attn_res", NormCfg(D, EPS, False), attn_res=AttnResCfg(2, append)), ops)
    with torch.no_grad():
        res.norm.weight.copy_(1 + 0.3 * torch.randn(D, generator=g))
        res.res_norm.copy_(1 + 0.3 * torch.randn(D, generator=g))
        res.res_proj.copy_(torch.randn(1, D, generator=g))
    return res


def _rms(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return v / torch.sqrt(v.square().mean(-1, keepdim=True) + EPS) * w


def _mix(cands: list[torch.Tensor], res: AttnResidual) -> torch.Tensor:
    """The fact sheet's Mix(c_0 .. c_m; u), u = res_norm.weight * res_proj.weight[0], in fp64."""
    u = res.res_norm.double() * res.res_proj[0].double()
    c = torch.stack(cands, dim=1)  # [T, m + 1, D]
    s = (c * u).sum(-1) / torch.sqrt(c.square().mean(-1) + EPS)
    return (torch.softmax(s, dim=-1)[..., None] * c).sum(1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("block", [2, 1, 8])
def test_attn_res_stack_follows_the_snapshot_algorithm(seed: int, block: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ops = _ops()
    attn = [_res(ops, layer % block == 0, g) for layer in range(LAYERS)]
    mlp = [_res(ops, False, g) for _ in range(LAYERS)]
    out = _res(ops, False, g)
    fa = [torch.randn(D, D, generator=g) / D**0.5 for _ in range(LAYERS)]
    fm = [torch.randn(D, D, generator=g) / D**0.5 for _ in range(LAYERS)]
    e = torch.randn(T, D, generator=g)

    with torch.no_grad():  # ours: the decoder's order of calls
        x, (h, carry) = e, attn[0].pre(e)
        for layer in range(LAYERS):
            x, h, carry = attn[layer].post_pre(x, torch.tanh(h @ fa[layer]), carry, mlp[layer])
            y = torch.tanh(h @ fm[layer])
            if layer + 1 < LAYERS:
                x, h, carry = mlp[layer].post_pre(x, y, carry, attn[layer + 1])
            else:
                x = mlp[layer].post(x, y, carry)
        got = out(x)

        snaps, p = [], e.double()  # the fact sheet's algorithm
        for layer in range(LAYERS):
            xa = _rms(_mix([*snaps, p], attn[layer]), attn[layer].norm.weight.double())
            if layer % block == 0:
                snaps, p = [*snaps, p], torch.zeros_like(p)
            p = p + torch.tanh(xa @ fa[layer].double())
            xm = _rms(_mix([*snaps, p], mlp[layer]), mlp[layer].norm.weight.double())
            p = p + torch.tanh(xm @ fm[layer].double())
        want = _rms(_mix([*snaps, p], out), out.norm.weight.double())
    assert x.shape == (T, len(snaps) + 1, D) and len(snaps) == -(-LAYERS // block)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < TOL


def test_one_slot_is_the_identity_mix() -> None:
    """With no snapshot yet (the first layer's input) the mix is the partial sum itself."""
    g = torch.Generator().manual_seed(SEEDS[0])
    res = _res(_ops(), True, g)
    x = torch.randn(T, D, generator=g)
    with torch.no_grad():
        assert torch.allclose(res.mix(x[:, None]), x)
        assert torch.allclose(res(x), _rms(x.double(), res.norm.weight.double()).float(), atol=1e-6)
