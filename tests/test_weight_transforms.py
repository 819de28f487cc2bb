"""Weight transforms (sdk/transforms.py): each kind on seeded random tensors, composed in order,
its arguments refused by name when the spec loads, and end to end: a tiny Qwen2-MoE re-laid out
the way other checkpoints store weights (fused qkv, stacked interleaved experts, zero-centred
norms) loads through the transforms and matches transformers; Qwen3-Next's packed per-head
[q; gate] projection, split by `split_heads`, gives its gated attention."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import SEEDS
from one_row import context
from safetensors.torch import load_file, save_file
from scratch import (
    SEED,
    checkpoint,
    max_logit_error,
    scratch_family,
    shared_tiny,
    spec_raw,
)

from dayzero.kernels.registry import UnknownKeyError
from dayzero.kernels.selection import OpTable
from dayzero.sdk.blocks import BLOCKS
from dayzero.sdk.blocks.attention import GqaAttention
from dayzero.sdk.config.model import CacheGroupCfg
from dayzero.sdk.errors import SpecError, WeightError
from dayzero.sdk.loader.mapping import Mapping, Split, StrictWriter
from dayzero.sdk.spec.read import load_spec
from dayzero.sdk.spec.schema import WeightFormat
from dayzero.sdk.transforms import TRANSFORMS, bind

LOGIT_TOL = 1e-4  # fp32 on CPU, |logits| ~ 4
ATTN_TOL = 2e-5  # one fp32 attention block, outputs O(1)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_each_kind_on_random_tensors(seed: int) -> None:
    h = 6
    w = rand(1, 1, h, 1, seed=seed)
    assert torch.equal(bind("reshape", {"shape": [h]})(w), w.flatten())
    assert bind("reshape", {"shape": [2, -1]})(w).shape == (2, 3)

    e, k, n = 3, 4, 5
    w = rand(e, k, n, seed=seed)
    got = bind("transpose", {"dims": [1, 2]})(w)
    assert got.shape == (e, n, k) and all(
        got[a, c, b] == w[a, b, c] for a in range(e) for b in range(k) for c in range(n)
    )
    assert torch.equal(bind("transpose", {"dims": [-1, -2]})(w), got)

    w = rand(8, 3, seed=seed)  # rows g0 u0 g1 u1 ...
    assert torch.equal(bind("deinterleave", {})(w), torch.cat([w[0::2], w[1::2]]))
    assert torch.equal(bind("deinterleave", {"dim": -1})(w.T), torch.cat([w[0::2], w[1::2]]).T)
    w = rand(9, 2, seed=seed)
    assert torch.equal(bind("deinterleave", {"parts": 3})(w), torch.cat([w[0::3], w[1::3], w[2::3]]))

    heads, dq, dg, hidden = 3, 4, 2, 5
    w = rand(heads * (dq + dg), hidden, seed=seed)  # per head: dq query rows, then dg gate rows
    q, g = bind("split_heads", {"heads": heads, "sizes": [dq, dg]})(w)
    rows = w.view(heads, dq + dg, hidden)
    assert torch.equal(q, rows[:, :dq].reshape(-1, hidden)) and torch.equal(
        g, rows[:, dq:].reshape(-1, hidden)
    )

    w = torch.cat([rand(3, 5, seed=seed), torch.zeros(3, 2)], dim=1)  # 5 entries, 2 of zero padding
    assert torch.equal(bind("head", {"length": 5, "dim": 1})(w), w[:, :5])
    w[1, 6] = 0.5
    with pytest.raises(ValueError, match="1 non-zero entries past the first 5 along dim 1"):
        bind("head", {"length": 5, "dim": 1})(w)
    assert torch.equal(bind("head", {"length": 5, "dim": 1, "zero_padding": False})(w), w[:, :5])
    with pytest.raises(ValueError, match="fewer than 8"):
        bind("head", {"length": 8, "dim": 1})(w)

    w = rand(7, seed=seed)
    assert torch.equal(bind("add", {"value": 1})(w), w + 1)
    a, b, c = bind("split", {"sizes": [2, 3, 2]})(w)
    assert torch.equal(torch.cat([a, b, c]), w) and b.shape == (3,)


def test_a_rule_applies_its_transforms_in_order() -> None:
    w = rand(2, 4, 6, seed=SEEDS[0])  # [E, H, 2I] with gate / up interleaved along the last dim
    steps = [{"kind": "transpose", "args": {"dims": [1, 2]}}, {"kind": "deinterleave", "args": {"dim": 1}}]
    fmt = WeightFormat.model_validate(
        {"format": "safetensors", "rules": [{"from": "x", "to": "p", "transform": steps}]}
    )
    got = Mapping(fmt, lambda v: v).target("x").transform(w)
    want = torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1).transpose(1, 2)
    assert torch.equal(got, want)
    reverse = steps[::-1]  # the other order de-interleaves H, then transposes
    fmt = WeightFormat.model_validate(
        {"format": "safetensors", "rules": [{"from": "x", "to": "p", "transform": reverse}]}
    )
    assert not torch.equal(Mapping(fmt, lambda v: v).target("x").transform(w), want)


def test_every_kind_is_documented_with_its_arguments() -> None:
    from dayzero.sdk.codegen.spec_doc import render

    doc = render()
    for kind, tdef in TRANSFORMS.items():
        assert f"### `{kind}`" in doc and tdef.doc.splitlines()[0] in doc
        for arg in tdef.params.model_fields:
            assert f"| `{arg}` |" in doc
    with pytest.raises(UnknownKeyError, match="known: add, deinterleave, head, reshape"):
        TRANSFORMS.get("permute")


def _with(rule_from: str, **fields) -> dict:
    raw = spec_raw()
    rule = next(r for r in raw["weights"][0]["rules"] if r["from"] == rule_from)
    rule.update(fields)
    return raw


NORM = "model.layers.{i}.input_layernorm.weight"
Q = "model.layers.{i}.self_attn.q_proj.weight"


@pytest.mark.parametrize(
    ("raw", "path", "message"),
    [
        (
            _with(NORM, transform={"kind": "plus"}),
            "transform.kind",
            "unknown weight transform 'plus'; known: add,",
        ),
        (_with(NORM, transform={"kind": "reshape"}), "transform.args.shape", "Field required"),
        (
            _with(NORM, transform={"kind": "add", "args": {"value": 1, "by": 2}}),
            "transform.args.by",
            "Extra inputs",
        ),
        (
            _with(NORM, transform={"kind": "reshape", "args": {"shape": [-1, -1]}}),
            "transform.args",
            "at most one -1",
        ),
        (_with(NORM, transform={"kind": "reshape", "args": {"shape": [0]}}), "transform.args", "must be > 0"),
        (
            _with(NORM, transform={"kind": "transpose", "args": {"dims": [1, 1]}}),
            "transform.args",
            "two different",
        ),
        (
            _with(NORM, transform={"kind": "transpose", "args": {"dims": [0]}}),
            "transform.args.dims",
            "at least 2",
        ),
        (_with(NORM, transform={"kind": "deinterleave", "args": {"parts": 1}}), "transform.args", ">= 2"),
        (
            _with(
                NORM,
                transform=[{"kind": "add", "args": {"value": 1}}, {"kind": "add", "args": {"value": "x"}}],
            ),
            "transform.1.args.value",
            "(for add) (rule from model.layers.{i}.input_layernorm.weight)",
        ),
        (
            _with(NORM, transform={"kind": "add", "args": {"value": "= eps * nope"}}),
            "transform.args.value",
            "nope",
        ),
        (
            _with(
                Q,
                to=["layers.{i}.attn.in_proj[q]", "x"],
                transform=[
                    {"kind": "split", "args": {"sizes": [1, 2]}},
                    {"kind": "add", "args": {"value": 1}},
                ],
            ),
            "transform.0.kind",
            "must be the last",
        ),
        (
            _with(
                Q,
                to=["layers.{i}.attn.in_proj[q]", "x"],
                transform={"kind": "split", "args": {"sizes": [1, 2, 3]}},
            ),
            "to",
            "makes 3 pieces for 2 target(s)",
        ),
        (_with(Q, to=["layers.{i}.attn.in_proj[q]", "x"]), "to", "need a splitting transform"),
    ],
)
def test_bad_transforms_fail_when_the_spec_loads(tmp_path: Path, raw: dict, path: str, message: str) -> None:
    n = next(
        i for i, r in enumerate(raw["weights"][0]["rules"]) if "transform" in r or isinstance(r["to"], list)
    )
    with pytest.raises(SpecError) as e:
        load_spec(scratch_family(raw, tmp_path).spec_path)
    assert e.value.path == f"weights.0.rules.{n}.{path}", str(e.value)
    assert message in str(e.value)


# --- end to end: a tiny Qwen2-MoE stored another way ----------------------------------------


def _relayout(src: Path, dst: Path, experts: int, hidden: int) -> Path:
    """Synthetic: q/k/v fused into one `qkv_proj`; each MoE layer's experts stacked as
    `gate_up_proj` [E, H, 2I] with gate and up columns interleaved and `down_proj` [E, I, H]
    (gpt-oss's layout); RMSNorm weights stored zero-centred (w - 1); the shared-expert gate [1, 1, H, 1]."""
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    out = {}
    for k, v in sd.items():
        if k.endswith("norm.weight"):
            out[k] = v - 1
        elif ".self_attn." in k and k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            if k.endswith("q_proj.weight"):
                p = k.removesuffix("q_proj.weight")
                out[p + "qkv_proj.weight"] = torch.cat([sd[p + f"{x}_proj.weight"] for x in "qkv"])
        elif k.endswith("shared_expert_gate.weight"):
            out[k] = v.reshape(1, 1, hidden, 1)
        elif ".mlp.experts." in k:
            if k.endswith(".experts.0.gate_proj.weight"):
                p = k.removesuffix("0.gate_proj.weight")
                gate, up, down = (
                    torch.stack([sd[f"{p}{e}.{x}_proj.weight"] for e in range(experts)])
                    for x in ("gate", "up", "down")
                )
                out[p + "gate_up_proj"] = (
                    torch.stack([gate, up], dim=2).flatten(1, 2).transpose(1, 2).contiguous()
                )
                out[p + "down_proj"] = down.transpose(1, 2).contiguous()
        else:
            out[k] = v
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _relayout_rules(raw: dict) -> dict:
    rules = raw["weights"][0]["rules"]
    rules[:] = [
        r for r in rules if not any(x in r["from"] for x in ("q_proj", "k_proj", "v_proj", "experts.{e}"))
    ]
    for r in rules:
        if r["from"].endswith("norm.weight"):
            r["transform"] = {"kind": "add", "args": {"value": 1}}
        if r["from"].endswith("shared_expert_gate.weight"):
            r["transform"] = {"kind": "reshape", "args": {"shape": [1, "$hidden"]}}
    qkv = ["= heads * head_dim", "= kv_heads * head_dim", "= kv_heads * head_dim"]
    rules += [
        {
            "from": "model.layers.{i}.self_attn.qkv_proj.weight",
            "to": [f"layers.{{i}}.attn.in_proj[{x}]" for x in "qkv"],
            "transform": {"kind": "split", "args": {"sizes": qkv}},
        },
        {
            "from": "model.layers.{i}.mlp.experts.gate_up_proj",
            "to": "layers.{i}.mlp.gate_up",
            "transform": [
                {"kind": "transpose", "args": {"dims": [1, 2]}},
                {"kind": "deinterleave", "args": {"dim": 1}},
            ],
        },
        {
            "from": "model.layers.{i}.mlp.experts.down_proj",
            "to": "layers.{i}.mlp.down",
            "transform": {"kind": "transpose", "args": {"dims": [-1, -2]}},
        },
    ]
    return raw


@pytest.fixture
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny(tmp_path_factory)


def test_a_relaid_out_checkpoint_loads_through_transforms_and_matches(tiny: Path, tmp_path: Path) -> None:
    fam = scratch_family(_relayout_rules(spec_raw()), tmp_path)
    hf = checkpoint(fam, tiny).hf
    moved = _relayout(tiny, tmp_path / "moved", hf["num_experts"], hf["hidden_size"])
    mapping = checkpoint(fam, moved).mapping
    assert isinstance(mapping.target("model.layers.0.self_attn.qkv_proj.weight"), Split)
    err, scale = max_logit_error(fam, moved, tiny, SEED)
    assert err < LOGIT_TOL, (err, scale)


def test_resolved_arguments_are_checked_and_load_errors_name_the_tensor(tiny: Path, tmp_path: Path) -> None:
    gate = "model.layers.{i}.mlp.shared_expert_gate.weight"
    raw = _with(gate, transform={"kind": "reshape", "args": {"shape": ["= hidden / 3"]}})
    fam = scratch_family(raw, tmp_path / "a")
    with pytest.raises(
        SpecError, match=r"rules\.15\.transform: .*(integer|number).*rule from .*shared_expert_gate"
    ):
        _ = checkpoint(fam, tiny).mapping
    raw = _with(gate, transform={"kind": "reshape", "args": {"shape": [2, "$hidden"]}})
    fam = scratch_family(raw, tmp_path / "b")
    ckpt = checkpoint(fam, tiny)
    writer = StrictWriter(torch.nn.Module())
    name = "model.layers.1.mlp.shared_expert_gate.weight"
    with pytest.raises(
        WeightError, match=rf"{name} \(shape \[1, 32\]\): transform reshape: shape '\[2, 32\]'"
    ):
        writer._transformed(
            name, ckpt.mapping.target(name).transform, load_file(tiny / "model.safetensors")[name]
        )


# --- Qwen3-Next's gated attention: [q; gate] packed per head ----------------------------------


@pytest.mark.parametrize("seed", SEEDS[:2])
def test_split_heads_gives_qwen3_next_gated_attention(seed: int) -> None:
    """q_proj [H * 2D, K] (per head: D query rows, then D gate rows) split into in_proj[q] and
    in_proj[gate]; the zero-centred q / k norms (x * (1 + w)) through `add`: the dayzero gqa
    block with q/k norm and the sigmoid output gate matches transformers' Qwen3NextAttention."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextAttention,
        Qwen3NextRotaryEmbedding,
    )

    h, hk, d, hidden, t = 4, 2, 16, 64, 12
    hf = Qwen3NextConfig(
        hidden_size=hidden,
        num_attention_heads=h,
        num_key_value_heads=hk,
        head_dim=d,
        partial_rotary_factor=0.25,
    )
    hf._attn_implementation = "eager"
    ref = Qwen3NextAttention(hf, 3).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 4))

    opts = BLOCKS.get("gqa").options.model_validate(
        {"kind": "gqa", "heads": h, "kv_heads": hk, "head_dim": d, "qk_norm": True, "output_gate": "sigmoid",
         "rope": {"theta": hf.rope_parameters["rope_theta"], "fraction": 0.25}}
    )  # fmt: skip
    env = {
        "$hidden": hidden,
        "$norm_eps": hf.rms_norm_eps,
        "$norm_weight_in_fp32": False,
        "$max_position": None,
    }
    cfg = BLOCKS.get("gqa").resolve(opts, lambda v: env.get(v, v) if isinstance(v, str) else v)
    ops = OpTable(torch.device("cpu"), torch.float32)
    for op, feats, hd in BLOCKS.get("gqa").needs(cfg):
        ops.need(op, feats, hd)
    ours = GqaAttention(cfg, ops.resolve(), ((0, 0),))

    norm = {"kind": "add", "args": {"value": 1}}
    fmt = WeightFormat.model_validate({"format": "safetensors", "rules": [
        {"from": "q_proj.weight", "to": ["in_proj[q]", "in_proj[gate]"],
         "transform": {"kind": "split_heads", "args": {"heads": "$heads", "sizes": ["$hd", "$hd"]}}},
        {"from": "k_proj.weight", "to": "in_proj[k]"},
        {"from": "v_proj.weight", "to": "in_proj[v]"},
        {"from": "o_proj.weight", "to": "o_proj"},
        {"from": "q_norm.weight", "to": "q_norm", "transform": norm},
        {"from": "k_norm.weight", "to": "k_norm", "transform": norm},
    ]})  # fmt: skip
    mapping = Mapping(fmt, lambda v: {"$heads": h, "$hd": d}.get(v, v) if isinstance(v, str) else v)
    writer = StrictWriter(ours)
    with torch.no_grad():
        for name, w in ref.state_dict().items():
            target = mapping.target(name)
            writer.write_split(name, target, w) if isinstance(target, Split) else writer.write(
                name, target, w
            )
    writer.finish()

    x = rand(t, hidden, seed=seed)
    with torch.no_grad():
        got = ours(x, context(t, [CacheGroupCfg("kv", "paged", None, 2 * hk * d, (0,))]))
        mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
        rotary = Qwen3NextRotaryEmbedding(hf)(x[None], torch.arange(t)[None])
        want, _ = ref(x[None], rotary, mask)
    assert (got - want[0]).abs().max().item() < ATTN_TOL
