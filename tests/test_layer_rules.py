"""Layer rules from an index list and a sparse step (`indices` + `every`), list values and len()
in symbol expressions, and block-scoped weight rules: the layer plan agrees with transformers'
Qwen2-MoE, the same checkpoint name maps per layer kind, and a tiny Qwen2-MoE loads and matches."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from scratch import (
    QWEN2_MOE,
    SEED,
    checkpoint,
    max_logit_error,
    scratch_family,
    shared_tiny,
    spec_raw,
)

from dayzero.sdk.errors import SpecError, WeightError
from dayzero.sdk.families import build
from dayzero.sdk.loader import load_weights
from dayzero.sdk.loader.mapping import Mapping
from dayzero.sdk.spec.assemble import layer_plan
from dayzero.sdk.spec.expr import evaluate, names
from dayzero.sdk.spec.read import LoadedSpec, load_spec
from dayzero.sdk.spec.resolver import Resolver
from dayzero.sdk.spec.schema import WeightFormat

LOGIT_TOL = 1e-4  # fp32 on CPU, |logits| ~ 4


def plan(loaded: LoadedSpec, hf: dict) -> list[str]:
    return [m for _, m in layer_plan(loaded.spec, Resolver(loaded, hf, "config.json"))]


def transformers_plan(fields: dict) -> list[str]:
    """Each layer's mlp as transformers' Qwen2MoeDecoderLayer builds it (dense / moe)."""
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(**fields)
    kinds = []
    for i in range(cfg.num_hidden_layers):
        mlp = Qwen2MoeDecoderLayer(cfg, i).mlp
        kinds.append("moe" if isinstance(mlp, Qwen2MoeSparseMoeBlock) else "dense")
    return kinds


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"mlp_only_layers": [], "decoder_sparse_step": 1},
        {"mlp_only_layers": [0, 5], "decoder_sparse_step": 1},
        {"mlp_only_layers": [1, 2, 9], "decoder_sparse_step": 3, "num_hidden_layers": 7},  # 9: no layer
        {"mlp_only_layers": None, "decoder_sparse_step": 2},
    ],
)
def test_index_list_and_sparse_step_give_transformers_layer_plan(overrides: dict) -> None:
    loaded = load_spec(QWEN2_MOE)
    fields = dict(loaded.spec.tiny) | overrides
    assert plan(loaded, fields) == transformers_plan(fields)


def test_indices_rule_takes_literals_expressions_and_plain_other(tmp_path: Path) -> None:
    raw = spec_raw()
    raw["symbols"]["last"] = {"default": "= [n_layers - 1]"}
    raw["layers"]["mlp"] = {"rule": "indices", "layers": "$last", "block": "moe", "other": "dense"}
    loaded = load_spec(scratch_family(raw, tmp_path).spec_path)
    assert plan(loaded, {"num_hidden_layers": 4}) == ["dense", "dense", "dense", "moe"]
    raw["layers"]["mlp"]["layers"] = [0, 2]
    loaded = load_spec(scratch_family(raw, tmp_path).spec_path)
    assert plan(loaded, {"num_hidden_layers": 4}) == ["moe", "dense", "moe", "dense"]


@pytest.mark.parametrize(
    ("value", "shown"),
    [([0, -1], "[0, -1]"), ([0.5], "[0.5]"), (3, "3"), ([True], "[True]"), (["a"], "'a'")],
)
def test_bad_index_lists_are_refused_naming_the_config_key(value: object, shown: str) -> None:
    loaded = load_spec(QWEN2_MOE)
    with pytest.raises(SpecError) as e:
        plan(loaded, dict(loaded.spec.tiny) | {"mlp_only_layers": value})
    assert e.value.path == "mlp_only_layers"
    assert "layer indices" in str(e.value) and shown in str(e.value)


def test_indices_rule_blocks_are_checked_when_the_spec_loads(tmp_path: Path) -> None:
    raw = spec_raw()
    raw["layers"]["mlp"]["other"]["block"] = "mo"
    with pytest.raises(SpecError) as e:
        load_spec(scratch_family(raw, tmp_path).spec_path)
    assert e.value.path == "layers.mlp.other.block" and "unknown block 'mo'" in str(e.value)
    raw = spec_raw()
    raw["layers"]["mlp"]["layers"] = "= [n_layers - 1, nope]"
    with pytest.raises(SpecError) as e:
        load_spec(scratch_family(raw, tmp_path).spec_path)
    assert e.value.path == "layers.mlp.layers" and "unknown symbol(s) nope" in str(e.value)


def test_list_values_and_len_in_expressions() -> None:
    env = {"xs": [3, 1, 4], "n": 6}
    for expr, want in [
        ("len(xs)", 3),
        ("xs[0] + xs[-1]", 7),
        ("n - len(xs)", 3),
        ("max(xs)", 4),
        ("[n, n // 2]", [6, 3]),
        ("len([1, 2]) * n", 12),
    ]:
        assert evaluate(expr, env.__getitem__) == want, expr
    assert names("len(xs) + xs[n - 5]") == {"xs", "n"}
    for bad in ("xs[0:2]", "len(xs, xs)", "xs.index(1)", "[x for x in xs]"):
        with pytest.raises(ValueError, match="only numbers"):
            names(bad)
    with pytest.raises(TypeError, match="len\\(\\) takes a list"):
        evaluate("len(n)", env.__getitem__)
    with pytest.raises(ValueError, match="out of range"):
        evaluate("xs[3]", env.__getitem__)


def test_len_of_a_config_list_in_a_symbol() -> None:
    loaded = load_spec(QWEN2_MOE)
    r = Resolver(loaded, {"mlp_only_layers": [1, 4, 5]}, "config.json")
    assert r.symbol("n_dense") == 3
    assert Resolver(loaded, {}, "config.json").symbol("n_dense") == 0  # the default []


# --- block-scoped weight rules -------------------------------------------------------------

HYBRID = {  # the case of a hybrid whose two attention kinds both store a q_proj
    "format": "safetensors",
    "rules": [
        {"from": "layers.{i}.q_proj.weight", "to": "layers.{i}.attn.in_proj[q]", "block": "kda"},
        {
            "from": "layers.{i}.q_proj.weight",
            "to": "layers.{i}.attn.a_proj[q]",
            "block": ["mla", "mla_shared"],
        },
        {"from": "layers.{i}.mlp.w", "to": "layers.{i}.mlp.gate_up", "block": "dense"},
        {"from": "embed", "to": "embed.weight"},
    ],
}


def _hybrid_mapping(layers: list[tuple[str, str]]) -> Mapping:
    return Mapping(WeightFormat.model_validate(HYBRID), lambda v: v, layers=layers)


def test_one_checkpoint_name_maps_per_layer_kind() -> None:
    m = _hybrid_mapping([("kda", "dense"), ("mla", "moe"), ("mla_shared", "moe")])
    assert m.target("layers.0.q_proj.weight").param == "layers.0.attn.in_proj"
    assert m.target("layers.1.q_proj.weight").param == "layers.1.attn.a_proj"
    assert m.target("layers.2.q_proj.weight").selectors == ("q",)
    assert m.target("embed").param == "embed.weight"  # an unscoped rule: every layer, no layer
    assert m.target("layers.0.mlp.w").param == "layers.0.mlp.gate_up"
    with pytest.raises(WeightError) as e:
        m.target("layers.1.mlp.w")
    assert "layers.1.mlp.w" in str(e.value) and "layer 1 is mla + moe" in str(e.value)
    assert "blocks dense" in str(e.value)
    with pytest.raises(WeightError, match=r"layers\.7\.q_proj\.weight .* not a layer of this config"):
        m.target("layers.7.q_proj.weight")


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (
            {"from": "model.layers.{i}.mlp.x", "to": "layers.{i}.mlp.x", "block": "sparse"},
            "'sparse' is no block",
        ),
        ({"from": "model.norm.weight", "to": "norm.weight", "block": "dense"}, "has no {i}"),
    ],
)
def test_bad_block_scopes_fail_when_the_spec_loads(tmp_path: Path, rule: dict, message: str) -> None:
    raw = spec_raw()
    raw["weights"][0]["rules"].append(rule)
    with pytest.raises(SpecError) as e:
        load_spec(scratch_family(raw, tmp_path).spec_path)
    n = len(raw["weights"][0]["rules"]) - 1
    assert e.value.path == f"weights.0.rules.{n}.block" and message in str(e.value)


def _shared_as_dense_names(folder: Path) -> None:
    """Synthetic: the MoE layers' shared expert stored under the dense MLP's names
    (`mlp.gate_proj` ...), so one name means a dense MLP in some layers, a shared expert in others."""
    f = folder / "model.safetensors"
    sd = load_file(f)
    for k in [k for k in sd if ".mlp.shared_expert." in k]:
        sd[k.replace(".mlp.shared_expert.", ".mlp.")] = sd.pop(k)
    save_file(sd, f, metadata={"format": "pt"})


def _scoped(raw: dict, with_dense: bool = True) -> dict:
    rules = raw["weights"][0]["rules"]
    for r in rules:
        if ".mlp.gate_proj." in r["from"] or ".mlp.up_proj." in r["from"] or ".mlp.down_proj." in r["from"]:
            r["block"] = "dense"
    if not with_dense:
        rules[:] = [r for r in rules if r.get("block") != "dense"]
    for part, to in (("gate", "gate_up[gate]"), ("up", "gate_up[up]"), ("down", "down")):
        rules.append(
            {
                "from": f"model.layers.{{i}}.mlp.{part}_proj.weight",
                "to": f"layers.{{i}}.mlp.shared.{to}",
                "block": "moe",
            }
        )
    return raw


@pytest.fixture
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_tiny(tmp_path_factory)


def test_qwen2_moe_loads_and_matches_transformers(tiny: Path, tmp_path: Path) -> None:
    """mlp_only_layers [3] and decoder_sparse_step 2 over 6 layers: dense, moe, dense, dense, dense, moe."""
    fam = scratch_family(spec_raw(), tmp_path)
    assert [layer.mlp_kind for layer in fam.config(checkpoint(fam, tiny).hf).layers] == [
        "swiglu",
        "moe",
        "swiglu",
        "swiglu",
        "swiglu",
        "moe",
    ]
    err, scale = max_logit_error(fam, tiny, tiny, SEED)
    assert err < LOGIT_TOL, (err, scale)


def test_block_scoped_rules_load_a_checkpoint_reusing_a_name(tiny: Path, tmp_path: Path) -> None:
    renamed = Path(shutil.copytree(tiny, tmp_path / "renamed"))
    _shared_as_dense_names(renamed)
    fam = scratch_family(_scoped(spec_raw()), tmp_path / "scoped")
    err, scale = max_logit_error(fam, renamed, tiny, SEED)
    assert err < LOGIT_TOL, (err, scale)

    strict = scratch_family(_scoped(spec_raw(), with_dense=False), tmp_path / "strict")
    ckpt = checkpoint(strict, renamed)
    model, _ = build(strict, strict.config(ckpt.hf), ckpt.hf, torch.device("cpu"), torch.float32)
    with pytest.raises(
        WeightError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight .*layer 0 is attn \+ dense"
    ):
        load_weights(model, ckpt, progress=False)
