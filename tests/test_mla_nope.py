"""MLA's `nope` option against the transformers module it mirrors: Kimi Linear's MLA
(KimiLinearAttention), whose config keeps qk_rope_head_dim > 0 while no RoPE is applied: the
rope_dim part of each query head and the shared key k_r stay unrotated. Tiny random modules built
from transformers' classes, seeded; fp32, tolerance TOL of the output's scale (the same numbers
summed in another order). Then the whole of Kimi Linear from a test-only spec
(tests/data/kimi_linear.yaml) against KimiLinearForCausalLM."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import SEEDS
from one_row import context

from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.blocks.mla import MlaAttention, MlaCfg
from dayzero.sdk.config.model import CacheGroupCfg

CPU = torch.device("cpu")
T = 11
TOL = 2e-6
DIMS = {"hidden": 64, "heads": 4, "kv_lora": 32, "nope": 16, "rope": 8, "v": 24}


def _kimi(seed: int, q_lora: int | None, bias: bool):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    cfg = KimiLinearConfig(
        hidden_size=DIMS["hidden"],
        num_attention_heads=DIMS["heads"],
        num_key_value_heads=DIMS["heads"],
        q_lora_rank=q_lora,
        kv_lora_rank=DIMS["kv_lora"],
        qk_nope_head_dim=DIMS["nope"],
        qk_rope_head_dim=DIMS["rope"],
        v_head_dim=DIMS["v"],
        attention_bias=bias,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = KimiLinearAttention(cfg, 0).eval()
    with torch.no_grad():
        for p in attn.parameters():  # norm weights near 1, matrices ~ 1 / sqrt(fan-in)
            p.copy_(torch.randn(p.shape) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 10) + (p.dim() == 1))
    return attn


def _ours(symbols: dict, opts: dict) -> tuple[MlaAttention, MlaCfg]:
    bdef = BLOCKS.get("mla")
    o = bdef.options.model_validate({"kind": "mla"} | opts)
    cfg = bdef.resolve(o, lambda v: symbols[v[1:]] if isinstance(v, str) and v.startswith("$") else v)
    ops = OpTable(CPU, torch.float32)
    for op, feats, hd in bdef.needs(cfg):
        ops.need(op, feats, hd)
    return MlaAttention(cfg, ops.resolve(), ((0, 0),)), cfg


def _copy(ours: MlaAttention, ref, q_lora: int | None, bias: bool) -> None:
    with torch.no_grad():
        q_w = ref.q_proj.weight if q_lora is None else ref.q_a_proj.weight
        ours.a_proj.copy_(torch.cat((q_w, ref.kv_a_proj_with_mqa.weight)))
        if q_lora:
            ours.q_norm.copy_(ref.q_a_layernorm.weight)
            ours.q_b.copy_(ref.q_b_proj.weight)
        if bias:
            ours.a_bias.copy_(torch.cat((ref.q_a_proj.bias, ref.kv_a_proj_with_mqa.bias)))
            ours.o_bias.copy_(ref.o_proj.bias)
        ours.kv_norm.copy_(ref.kv_a_layernorm.weight)
        ours.kv_b.copy_(ref.kv_b_proj.weight)
        ours.o_proj.copy_(ref.o_proj.weight)


class _Gated(torch.nn.Module):
    """The reference's output projection behind Kimi K3's MLA gate: o_proj(o * sigmoid(x W_g))."""

    def __init__(self, o_proj: torch.nn.Module, w_g: torch.Tensor, x: torch.Tensor) -> None:
        super().__init__()
        self.o_proj, self.w_g, self.x = o_proj, w_g, x

    def forward(self, o: torch.Tensor) -> torch.Tensor:  # o [1, T, H Dv]
        return self.o_proj(o * torch.sigmoid(self.x @ self.w_g.T))


@pytest.mark.parametrize("seed", SEEDS)
def test_gated_nope_mla_matches_kimi_linear_with_the_gate(seed: int) -> None:
    """`output_gate: true` (Kimi K3's mla_use_output_gate): KimiLinearAttention whose output
    projection reads o * sigmoid(x W_g) (W_g [H Dv, Dm], random), at every position of one
    causal prefill; the gate's weight is this layer's own tensor (g_proj)."""
    ref = _kimi(seed, 24, False)
    opts = {"heads": DIMS["heads"], "q_lora": 24, "kv_lora": DIMS["kv_lora"], "nope_dim": DIMS["nope"],
            "rope_dim": DIMS["rope"], "v_dim": DIMS["v"], "nope": True, "output_gate": True}  # fmt: skip
    ours, cfg = _ours({"hidden": DIMS["hidden"]}, opts)
    assert cfg.output_gate and ours.g_proj.shape == (DIMS["heads"] * DIMS["v"], DIMS["hidden"])
    _copy(ours, ref, 24, False)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, DIMS["hidden"], generator=g)
    w_g = torch.randn(DIMS["heads"] * DIMS["v"], DIMS["hidden"], generator=g) / DIMS["hidden"] ** 0.5
    ctx = context(T, [CacheGroupCfg("mla", "paged", None, DIMS["kv_lora"] + DIMS["rope"], (0,))])
    with torch.no_grad():
        ours.g_proj.copy_(w_g)
        got = ours(x, ctx)
        ungated = ref(x[None], torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None])[0][0]
        ref.o_proj = _Gated(ref.o_proj, w_g, x[None])
        want = ref(x[None], torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None])[0][0]
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < TOL, err
    assert ((ungated - want).abs().max() / want.abs().max()).item() > 0.1  # the gate is seen


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("q_lora,bias", [(None, False), (24, False), (24, True)])
def test_nope_mla_matches_kimi_linear_attention(seed: int, q_lora: int | None, bias: bool) -> None:
    """`nope: $use_nope` (a symbol, true) with rope_dim 8 and no `rope` section: the same output
    as KimiLinearAttention at every position of one causal prefill, and the same scale."""
    ref = _kimi(seed, q_lora, bias)
    symbols = {"hidden": DIMS["hidden"], "use_nope": True}
    opts = {
        "heads": DIMS["heads"],
        "q_lora": q_lora,
        "kv_lora": DIMS["kv_lora"],
        "nope_dim": DIMS["nope"],
        "rope_dim": DIMS["rope"],
        "v_dim": DIMS["v"],
        "bias": bias,
        "nope": "$use_nope",
    }
    ours, cfg = _ours(symbols, opts)
    assert cfg.nope and cfg.rope_dim == DIMS["rope"] and ours.inv_freq is None
    assert not any(op == "rope" for op, _, _ in BLOCKS.get("mla").needs(cfg))
    _copy(ours, ref, q_lora, bias)
    x = torch.randn(T, DIMS["hidden"], generator=torch.Generator().manual_seed(seed))
    ctx = context(T, [CacheGroupCfg("mla", "paged", None, DIMS["kv_lora"] + DIMS["rope"], (0,))])
    with torch.no_grad():
        got = ours(x, ctx)
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        want = ref(x[None], mask)[0][0]
    assert abs(cfg.scale - ref.scaling) < 1e-12
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < TOL, err
    # the cache holds the unrotated shared key: the last rope_dim channels of kv_a's output
    kv_a = ref.kv_a_proj_with_mqa
    k_r = (x @ kv_a.weight.T + (kv_a.bias if bias else 0))[:, -DIMS["rope"] :]
    assert (ctx.caches[0][:T, DIMS["kv_lora"] :] - k_r).abs().max().item() < TOL  # past T: scratch


def test_rotation_without_a_rope_section_is_refused_by_name() -> None:
    opts = {"heads": 4, "kv_lora": 32, "nope_dim": 16, "rope_dim": 8, "v_dim": 24, "nope": "$use_nope"}
    with pytest.raises(ValueError, match=r"rope_dim 8 needs a `rope` section \(or `nope: true`\)"):
        _ours({"hidden": 64, "use_nope": False}, opts)


def test_the_comparison_sees_a_rotation() -> None:
    """The same block rotating its rope_dim channels (`nope: false`, a `rope` section) is far
    from the NoPE reference past position 0: the test above would catch a rotation."""
    ref = _kimi(SEEDS[0], 24, False)
    opts = {"heads": 4, "q_lora": 24, "kv_lora": 32, "nope_dim": 16, "rope_dim": 8, "v_dim": 24}
    ours, _ = _ours({"hidden": 64}, opts | {"rope": {"theta": 10000.0}})
    _copy(ours, ref, 24, False)
    x = torch.randn(T, DIMS["hidden"], generator=torch.Generator().manual_seed(SEEDS[0]))
    ctx = context(T, [CacheGroupCfg("mla", "paged", None, 40, (0,))])
    with torch.no_grad():
        got = ours(x, ctx)
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        want = ref(x[None], mask)[0][0]
    assert (got[0] - want[0]).abs().max().item() < TOL  # position 0: rotation by angle 0
    assert ((got[1:] - want[1:]).abs().max() / want.abs().max()).item() > 100 * TOL


KIMI_SPEC = Path(__file__).parent / "data" / "kimi_linear.yaml"  # a test-only spec


@pytest.fixture(scope="module")
def kimi_family(tmp_path_factory) -> Iterator[str]:
    """tests/data/kimi_linear.yaml generated out of tree (`codegen --spec`), registered for this
    module only (the family registry and DAYZERO_SPECS restored after)."""
    from dayzero.sdk.cli import main
    from dayzero.sdk.families import FAMILIES

    spec = tmp_path_factory.mktemp("kimi") / "spec.yaml"
    shutil.copy(KIMI_SPEC, spec)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FAMILIES, "_items", dict(FAMILIES._items))
        mp.setitem(os.environ, "DAYZERO_SPECS", os.environ.get("DAYZERO_SPECS", ""))
        assert main(["codegen", "--spec", str(spec)]) == 0
        yield "kimi_linear_nope_test"


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_kimi_linear_from_a_spec_prefills_the_references_logits(
    tmp_path, kimi_family: str, seed: int
) -> None:
    """The whole model (4 KDA layers, then the NoPE MLA layer; dense then MoE): dayzero's
    prefill logits of 3 prompts (one batch) against KimiLinearForCausalLM's, within `dayzero parity`'s fp32
    logit tolerance 1e-4 (the full `dayzero parity` run on this spec passes too)."""
    from dayzero.sdk.loader import open_checkpoint
    from dayzero.sdk.parity.runner import Ours, Reference, make_prompts
    from dayzero.sdk.parity.tiny import write_tiny

    ckpt = open_checkpoint(write_tiny(kimi_family, tmp_path / "ckpt", seed=seed), kimi_family)
    ours = Ours(ckpt, CPU, torch.float32)
    assert [layer.attn_kind for layer in ours.cfg.layers] == ["kda"] * 4 + ["mla"]
    assert ours.cfg.layers[4].attn.nope and ours.cfg.layers[4].attn.rope_dim == 8
    ref = Reference(ckpt, ckpt.folder, CPU, torch.float32)
    prompts = make_prompts(ours.cfg.embedding.vocab, seed, n=3)
    got = ours.prefill_logits(prompts)
    err = max((a - ref.logits(p)).abs().max().item() for a, p in zip(got, prompts, strict=True))
    assert err < 1e-4, err
