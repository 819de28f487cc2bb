"""The Gated DeltaNet block (sdk/blocks/gdn.py) against the transformers module it mirrors,
qwen3_5_moe's Qwen3_5MoeGatedDeltaNet (its torch path: the chunked / recurrent gated delta rule
and causal conv1d fallbacks, not fla), on random weights and inputs, fp32 on CPU.

Checked, 2 seeds, tolerance 1e-5 absolute (outputs are O(1)): one whole 70-token forward (more
than one 64-token chunk); the same tokens as a chunked prefill (33 + 27 tokens) followed by 10
one-token decode steps, continuing the state in the slot, equal to that one forward; and one
step mixing a decode row with a fresh prompt in other slots.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.blocks.gdn import GatedDeltaNet, GdnCfg
from dayzero.sdk.engine.context import StateMeta

TOL = 1e-5
SEEDS = (0, 1)
CFG = GdnCfg(hidden=32, heads=2, value_heads=4, head_dim=8, value_dim=6, conv_kernel=4, norm_eps=1e-6)


def _pair(seed: int) -> tuple[GatedDeltaNet, torch.nn.Module]:
    """Ours and the reference module, the same random weights (activations O(1))."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    c = CFG
    heads = {"linear_num_key_heads": c.heads, "linear_num_value_heads": c.value_heads}
    dims = {"linear_key_head_dim": c.head_dim, "linear_value_head_dim": c.value_dim}
    one = {"num_hidden_layers": 1, "layer_types": ["linear_attention"], "rms_norm_eps": c.norm_eps}
    hf = Qwen3_5MoeTextConfig(
        hidden_size=c.hidden, linear_conv_kernel_dim=c.conv_kernel, **heads, **dims, **one
    )
    ref = Qwen3_5MoeGatedDeltaNet(hf, 0).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif name == "norm.weight":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    ops = OpTable(torch.device("cpu"), torch.float32)
    for op, features, head_dim in BLOCKS.get("gated_deltanet").needs(c):
        ops.need(op, features, head_dim)
    conv_bytes = BLOCKS.get("gated_deltanet").cache(c)[0].row
    ours = GatedDeltaNet(c, ops.resolve(), ((0, 0), (0, conv_bytes)))
    with torch.no_grad():
        ours.in_proj.copy_(torch.cat((ref.in_proj_qkv.weight, ref.in_proj_z.weight)))
        ours.ba_proj.copy_(torch.cat((ref.in_proj_b.weight, ref.in_proj_a.weight)))
        ours.conv.copy_(ref.conv1d.weight)
        ours.dt_bias.copy_(ref.dt_bias)
        ours.A_log.copy_(ref.A_log)
        ours.norm.copy_(ref.norm.weight)
        ours.out_proj.copy_(ref.out_proj.weight)
    return ours, ref


def _slot_bytes() -> int:
    return sum(d.row for d in BLOCKS.get("gated_deltanet").cache(CFG))


def _step(pool: torch.Tensor, lengths, slots, has_init) -> SimpleNamespace:
    qs = [0]
    for n in lengths:
        qs.append(qs[-1] + n)
    return SimpleNamespace(state=StateMeta(pool, tuple(slots), tuple(has_init), tuple(qs)))


@pytest.mark.parametrize("seed", SEEDS)
def test_gated_deltanet_matches_the_reference(seed: int) -> None:
    ours, ref = _pair(seed)
    x = torch.randn(70, CFG.hidden, generator=torch.Generator().manual_seed(100 + seed))
    pool = torch.full((3, _slot_bytes()), 255, dtype=torch.uint8)  # garbage (NaN) in every slot
    with torch.no_grad():
        want = ref(x[None])[0]  # [T, Dm]
        whole = ours(x, _step(pool, [70], [1], [False]))
        assert (whole - want).abs().max().item() < TOL

        # chunked prefill (33 + 27 tokens), then 10 decode steps, continuing the state in slot 2
        got, cut = [], [0, 33, 60, *range(61, 71)]
        for i, (a, b) in enumerate(itertools.pairwise(cut)):
            got.append(ours(x[a:b], _step(pool, [b - a], [2], [i > 0])))
        assert (torch.cat(got) - want).abs().max().item() < TOL

        # one step: a decode row continuing slot 2 (an 8-token prompt ...) next to a fresh prompt in slot 0
        prompt = torch.randn(12, CFG.hidden, generator=torch.Generator().manual_seed(200 + seed))
        first = ours(x[:8], _step(pool, [8], [2], [False]))
        mixed = ours(torch.cat((x[8:9], prompt)), _step(pool, [1, 12], [2, 0], [True, False]))
    assert (torch.cat((first, mixed[:1])) - want[:9]).abs().max().item() < TOL
    assert (mixed[1:] - ref(prompt[None])[0]).abs().max().item() < TOL
