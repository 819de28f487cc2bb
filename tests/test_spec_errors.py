"""Bad specs and HF configs fail with a SpecError naming the file, the field path and what was expected."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dayzero.sdk.errors import SpecError
from dayzero.sdk.families import FAMILIES, Family
from dayzero.sdk.spec.read import load_spec
from dayzero.sdk.spec.reference import reference_config

LLAMA_SPEC = FAMILIES.get("llama").spec_path
REF = r"^\$[A-Za-z_][A-Za-z0-9_]*$"  # the `$symbol` pattern of schema.Ref


def llama_raw() -> dict[str, Any]:
    """A fresh, mutable copy of the llama spec as parsed YAML."""
    return yaml.safe_load(LLAMA_SPEC.read_text())


def write_spec(tmp_path: Path, raw: dict[str, Any], name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def spec_error(path: Path) -> SpecError:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return info.value


def set_in(*keys: str | int, value: Any) -> Callable[[dict], None]:
    """A mutation setting raw[k0][k1]...[kn] = value."""

    def mutate(raw: dict) -> None:
        cur = raw
        for k in keys[:-1]:
            cur = cur[k]
        cur[keys[-1]] = value

    return mutate


def _mutated(mutate: Callable[[dict], None]) -> dict[str, Any]:
    """The llama spec with one mutation applied."""
    raw = llama_raw()
    mutate(raw)
    return raw


def _unless_rule() -> int:
    """Index of the safetensors rule with `unless:` (lm_head, skipped when tied)."""
    rules = yaml.safe_load(LLAMA_SPEC.read_text())["weights"][0]["rules"]
    return next(i for i, r in enumerate(rules) if "unless" in r)


UNLESS = _unless_rule()


def dup_weights(raw: dict) -> None:
    raw["weights"].append(copy.deepcopy(raw["weights"][0]))


# (id, mutation, field path in the message, fragments of what was expected)
CASES: list[tuple[str, Callable[[dict], None], str, tuple[str, ...]]] = [
    ("unknown_block_kind", set_in("blocks", "attn", "kind", value="nsa"), "blocks.attn.kind",
     ("unknown block kind 'nsa'", "gqa", "kda", "mla", "moe", "swiglu")),
    ("unknown_block_option", set_in("blocks", "attn", "flash", value=True), "blocks.attn.flash",
     ("Extra inputs are not permitted",)),
    ("wrong_type", set_in("blocks", "attn", "heads", value="many"), "blocks.attn.heads",
     ("expected int or a `$symbol` reference", "'many'")),
    ("bad_ref_syntax", set_in("eos_token_ids", value="$9eos"), "eos_token_ids",
     ("should match pattern", REF)),
    ("bad_ref_in_rule", set_in("weights", 0, "rules", UNLESS, "unless", value="tie"),
     f"weights.0.rules.{UNLESS}.unless",
     ("should match pattern", REF)),
    ("undefined_symbol", set_in("blocks", "attn", "heads", value="$nheads"), "blocks.attn.heads",
     ("unknown symbol $nheads", "known:", "heads", "kv_heads")),
    ("layer_rule_missing_block", set_in("layers", "mlp", "block", value="ffn"), "layers.mlp.block",
     ("unknown block 'ffn'", "blocks: attn, mlp")),
    ("attention_rule_on_mlp_block", set_in("layers", "attention", "block", value="mlp"),
     "layers.attention.block", ("block 'mlp' is a mlp block", "kind swiglu")),
    ("unknown_layer_rule", set_in("layers", "attention", value={"rule": "odd", "block": "attn"}),
     "layers.attention", ("'odd'", "'all'", "'field'", "'every'", "'first'")),
    ("unknown_weights_format", set_in("weights", 1, "format", value="pytorch"), "weights.1.format",
     ("'safetensors'", "'gguf'")),
    ("duplicate_weights_format", dup_weights, "weights",
     ("each format may appear once", "['safetensors', 'gguf', 'safetensors']")),
    ("uppercase_family", set_in("family", value="Llama"), "family", ("should match pattern", "[a-z]")),
    ("unknown_release_format", set_in("release", value={"checkpoint": "a/b", "format": "int4"}),
     "release.format", ("'bf16'", "'fp8_block'", "'mxfp4'", "'nvfp4'")),
    ("bad_mtp_kind", set_in("mtp", value={"kind": "medusa"}), "mtp.kind", ("'nextn'", "'qwen_mtp'")),
    ("block_not_a_mapping", set_in("blocks", "attn", value="gqa"), "blocks.attn",
     ("expected a mapping with a `kind`",)),
    ("undefined_symbol_in_layer_count", set_in("layers", "count", value="$layers"), "layers.count",
     ("unknown symbol $layers",)),
]  # fmt: skip


@pytest.mark.parametrize(("mutate", "field", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_spec_names_file_field_and_expectation(
    tmp_path: Path, mutate: Callable[[dict], None], field: str, expected: tuple[str, ...]
) -> None:
    """One mutation of the llama spec -> SpecError '<file>: <field>: <what was expected>'."""
    raw = llama_raw()
    mutate(raw)
    path = write_spec(tmp_path, raw)
    err = spec_error(path)
    msg = str(err)
    assert msg.startswith(f"{path}: {field}"), msg
    assert err.source == str(path)
    for frag in expected:
        assert frag in msg, (frag, msg)


def test_the_unmutated_copy_loads(tmp_path: Path) -> None:
    """The mutation harness itself is sound: a plain round trip of the llama spec is accepted."""
    loaded = load_spec(write_spec(tmp_path, llama_raw()))
    assert loaded.spec.family == "llama"
    assert set(loaded.blocks) == {"attn", "mlp"}


def test_invalid_yaml(tmp_path: Path) -> None:
    """Unparsable YAML names the file, the top level and the line of the problem."""
    path = tmp_path / "spec.yaml"
    path.write_text("family: llama\nblocks: [unclosed\n  - x: {\n")
    msg = str(spec_error(path))
    assert msg.startswith(f"{path}: (top level): not valid YAML")
    assert "line 3" in msg


@pytest.mark.parametrize(
    ("text", "kind"), [("- a\n- b\n", "list"), ("just a string\n", "str"), ("", "NoneType")]
)
def test_top_level_not_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    """A list, scalar or empty document at the top level is refused, naming what it got."""
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    msg = str(spec_error(path))
    assert msg == f"{path}: (top level): expected a mapping at the top level, got {kind}"


def test_bad_ref_in_numeric_field_mentions_the_ref_pattern(tmp_path: Path) -> None:
    """`heads: $9heads` is a malformed reference; the message should say what a reference looks like."""
    path = write_spec(tmp_path, _mutated(set_in("blocks", "attn", "heads", value="$9heads")))
    msg = str(spec_error(path))
    assert "blocks.attn.heads" in msg
    assert REF in msg or "$symbol" in msg, msg


# ---- resolution against an HF config ----------------------------------------------------------


def llama_hf(**overrides: Any) -> dict[str, Any]:
    """The full HF config dict of the tiny llama, via the reference config class."""
    return reference_config(
        "transformers.LlamaForCausalLM", dict(FAMILIES.get("llama").spec.spec.tiny) | overrides
    )


def beam_hf(**overrides: Any) -> dict[str, Any]:
    return reference_config(
        "transformers.BeamForCausalLM", dict(FAMILIES.get("beam").spec.spec.tiny) | overrides
    )


@pytest.mark.parametrize(
    ("field", "symbol"),
    [
        ("hidden_size", "$hidden"),
        ("num_attention_heads", "$heads"),
        ("rms_norm_eps", "$eps"),
        ("vocab_size", "$vocab"),
    ],
)
def test_missing_hf_field_is_named(field: str, symbol: str) -> None:
    """A required HF field that is absent -> 'config.json: <field>: missing (needed by symbol $x ...)'."""
    hf = llama_hf()
    del hf[field]
    with pytest.raises(SpecError) as info:
        FAMILIES.get("llama").config(hf)
    assert str(info.value) == f"config.json: {field}: missing (needed by symbol {symbol} of spec.yaml)"


def test_optional_hf_field_falls_back_to_its_default() -> None:
    """Deleting fields that have spec defaults (head_dim, num_key_value_heads) is not an error."""
    hf = llama_hf()
    del hf["head_dim"], hf["num_key_value_heads"]
    attn = FAMILIES.get("llama").config(hf).layers[0].attn
    assert (attn.head_dim, attn.kv_heads) == (64 // 4, 4)


def test_beam_unknown_layer_kind() -> None:
    """A `layer_types` entry outside the spec's map names the list index and the known kinds."""
    hf = beam_hf()
    hf["layer_types"] = list(hf["layer_types"])
    hf["layer_types"][2] = "linear_attention"
    with pytest.raises(SpecError) as info:
        FAMILIES.get("beam").config(hf)
    assert str(info.value) == (
        "config.json: layer_types.2: unknown layer kind 'linear_attention'; "
        "known: sliding_attention, full_attention"
    )


def test_beam_layer_types_too_short() -> None:
    """A `layer_types` list shorter than num_hidden_layers is refused, naming the field and the count."""
    hf = beam_hf()
    hf["layer_types"] = hf["layer_types"][:3]
    with pytest.raises(
        SpecError, match=r"^config\.json: layer_types: expected a list of at least 7 layer kinds"
    ):
        FAMILIES.get("beam").config(hf)


def test_beam_groups_must_divide_experts() -> None:
    """num_experts=10 with n_group=4: the moe block's resolution fails naming the spec, block and numbers."""
    fam = FAMILIES.get("beam")
    with pytest.raises(SpecError) as info:
        fam.config(beam_hf(num_experts=10, n_group=4))
    err = info.value
    assert err.source == str(fam.spec_path)
    assert err.path == "blocks.moe"
    assert "10 experts do not split into 4 groups" in str(err)
    assert "(with config.json)" in str(err)


def test_beam_top_k_beyond_experts() -> None:
    """num_experts_per_tok larger than num_experts names the allowed range."""
    with pytest.raises(SpecError, match=r"blocks\.moe: top_k 40 must be in 1\.\.16"):
        FAMILIES.get("beam").config(beam_hf(num_experts_per_tok=40))


def test_null_hf_field_is_named() -> None:
    """`num_attention_heads: null` should fail like an absent field, naming num_attention_heads."""
    with pytest.raises(SpecError, match="num_attention_heads"):
        FAMILIES.get("llama").config(llama_hf() | {"num_attention_heads": None})


def test_non_numeric_hf_field_is_a_spec_error() -> None:
    """`hidden_size: "big"` should be a SpecError naming the field, not `invalid literal for int()`."""
    with pytest.raises(SpecError, match="hidden_size"):
        FAMILIES.get("llama").config(llama_hf() | {"hidden_size": "big"})


def test_malformed_symbol_expression_is_a_spec_error(tmp_path: Path) -> None:
    """A default expression that does not parse should fail as a SpecError naming the symbol."""
    raw = llama_raw()
    raw["symbols"]["head_dim"] = {"field": "no_such_field", "default": "= hidden //"}
    path = write_spec(tmp_path, raw)
    fam = Family("llama", path)
    with pytest.raises(SpecError, match=r"symbols\.head_dim"):
        load_spec(path)
        fam.config(llama_hf())


# ---- refused at build time ---------------------------------------------------------------------


def test_mtp_section_validates_with_its_defaults(tmp_path: Path) -> None:
    """`mtp: {kind: nextn}` validates (one layer, one draft token by default). A family with an
    MTP head builds and loads, its MTP tensors set aside: test_loader (GLM-5.3)."""
    raw = llama_raw()
    raw["mtp"] = {"kind": "nextn"}
    mtp = Family("llama", write_spec(tmp_path, raw)).spec.spec.mtp
    assert mtp is not None and (mtp.kind, mtp.layers, mtp.draft_tokens) == ("nextn", 1, 1)


@pytest.mark.parametrize(
    ("field", "value", "implements"),
    [("hidden_act", "gelu_pytorch_tanh", "'silu'"), ("mlp_bias", True, "False"), ("pretraining_tp", 2, "1")],
)
def test_a_config_value_the_blocks_do_not_implement_is_refused(field: str, value, implements: str) -> None:
    """Spec.implements: a math-changing HF field set to a value the blocks do not implement is
    refused by field and value, never silently ignored (Gemma's gelu through the llama spec)."""
    hf = llama_hf()
    hf[field] = value
    with pytest.raises(SpecError) as info:
        FAMILIES.get("llama").config(hf)
    assert str(info.value) == (
        f"config.json: {field}: {value!r} is not implemented by spec.yaml (it implements {implements})"
    )


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"rope_type": "su"}, r"blocks\.attn: rope kind 'su' is not supported yet; known: default, linear"),
        ({"rope_type": "llama3", "factor": 8.0}, "blocks.attn: llama3 rope_parameters need low_freq_factor"),
        ({"rope_type": "linear"}, "blocks.attn: linear rope_parameters need factor"),
    ],
)
def test_bad_rope_parameters_are_named(params: dict, message: str) -> None:
    """An unknown rope type, or a known one missing its parameters, fails at config time."""
    hf = llama_hf()
    hf["rope_parameters"] = {"rope_theta": 10000.0, **params}
    with pytest.raises(SpecError, match=message):
        FAMILIES.get("llama").config(hf)


# ---- every HF config key accounted for (default-deny, sdk/spec/config_keys.py) -------------------


UNMODELLED = (
    "is not modelled by spec.yaml: read it in a symbol, list it under `implements` with the value(s) "
    "the blocks implement, or under `ignores` with the reason it does not change the math"
)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("foo_scale", 2.0),
        ("partial_rotary_factor", 0.5),
        ("embedding_multiplier", 12.0),
        ("norm_type", "layer"),
    ],
)
def test_a_config_key_no_symbol_reads_is_refused(field: str, value: Any) -> None:
    """A key the spec neither reads, implements nor ignores is refused by name and value (before:
    silently ignored, the model served with other math)."""
    with pytest.raises(SpecError) as info:
        FAMILIES.get("llama").config(llama_hf() | {field: value})
    assert str(info.value) == f"config.json: {field}: {value!r} {UNMODELLED}"


def test_an_activation_the_spec_does_not_list_is_refused_through_implements() -> None:
    """Gemma's gelu through the llama spec: hidden_act is in llama's implements, so it is checked."""
    with pytest.raises(SpecError, match=r"hidden_act: 'gelu_pytorch_tanh' is not implemented by spec.yaml"):
        FAMILIES.get("llama").config(llama_hf(hidden_act="gelu_pytorch_tanh"))


@pytest.mark.parametrize(
    "extra",
    [
        {"attention_dropout": 0.1, "hidden_dropout": 0.2, "embd_pdrop_dropout": 0.3},
        {"initializer_range": 0.5, "torch_dtype": "bfloat16", "use_cache": False, "pad_token_id": 0},
        {"id2label": {"0": "a"}, "transformers_version": "4.40.0", "output_attentions": True},
        {"is_encoder_decoder": False, "quantization_config": None, "foo_scale": None},
    ],
)
def test_keys_on_the_no_effect_list_and_null_keys_are_accepted(extra: dict) -> None:
    FAMILIES.get("llama").config(llama_hf() | extra)


def test_a_pinned_structure_flag_is_refused_at_another_value() -> None:
    with pytest.raises(SpecError, match=r"config.json: is_encoder_decoder: True is not served"):
        FAMILIES.get("llama").config(llama_hf(is_encoder_decoder=True))


@pytest.mark.parametrize("family", ["llama", "beam", "glm53", "glm53_flash"])
def test_each_family_accounts_for_every_key_of_its_reference_config(family: str) -> None:
    """The tiny config, each parity shape and the reference class's defaults resolve: each spec
    accounts for every key `config.to_dict()` writes."""
    from dayzero.sdk.spec.reference import merge

    fam = FAMILIES.get(family)
    spec = fam.spec.spec
    for over in [dict(spec.tiny), {}, *(merge(dict(spec.tiny), s) for s in spec.shapes)]:
        fam.config(reference_config(spec.reference, over))


def test_a_nested_text_config_key_is_refused_by_its_path() -> None:
    fam = FAMILIES.get("glm53_flash")
    hf = reference_config(fam.spec.spec.reference, dict(fam.spec.spec.tiny))
    hf["text_config"]["attn_logit_scale"] = 0.5
    with pytest.raises(SpecError) as info:
        fam.config(hf)
    assert str(info.value) == f"config.json: text_config.attn_logit_scale: 0.5 {UNMODELLED}"


def test_a_derived_field_is_checked_against_its_symbol() -> None:
    """`implements: {num_key_value_heads: $heads}` (MLA): another value is refused."""
    fam = FAMILIES.get("glm53")
    hf = reference_config(fam.spec.spec.reference, dict(fam.spec.spec.tiny) | {"num_key_value_heads": 2})
    with pytest.raises(SpecError) as info:
        fam.config(hf)
    assert (
        str(info.value)
        == "config.json: num_key_value_heads: 2 is not implemented by spec.yaml (it implements 4)"
    )


def test_a_family_key_needs_its_spec_ignores_entry(tmp_path: Path) -> None:
    """`ignores` accepts a key with its reason; without the entry the same key is refused."""
    hf = llama_hf(router_aux_loss_coef=0.01)
    with pytest.raises(SpecError, match=r"router_aux_loss_coef: 0.01 is not modelled"):
        FAMILIES.get("llama").config(hf)
    raw = llama_raw()
    raw["ignores"] = dict(raw.get("ignores") or {}) | {"router_aux_loss_coef": "training only"}
    from dayzero.sdk.spec.assemble import resolve

    llama = FAMILIES.get("llama")
    resolve(load_spec(write_spec(tmp_path, raw)), hf, llama.module("cache").CACHE_GROUPS)


def test_a_gguf_style_config_with_only_mapped_keys_resolves() -> None:
    """A GGUF-derived config holds only the keys the spec's gguf mapping produced."""
    hf = {
        "model_type": "llama",
        "architectures": [],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 512,
        "eos_token_id": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "linear", "factor": 2.0},
    }
    assert FAMILIES.get("llama").config(hf).head.tie


@pytest.mark.parametrize(
    ("params", "where", "message"),
    [
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 32}},
         "rope_parameters.beta_fast", "32 is not read for linear RoPE"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "rope_parameters.partial_rotary_factor", "0.5 is not read for default RoPE"),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0, "alpha": 1.0}},
         "rope_scaling.alpha", "1.0 is not read for dynamic RoPE"),
    ],
)  # fmt: skip
def test_an_unknown_key_inside_rope_parameters_is_named(params: dict, where: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        FAMILIES.get("llama").config(llama_hf() | params)
    assert str(info.value).startswith(f"config.json: {where}: {message} (sdk/blocks/rope.py reads rope_type")


def test_a_rope_key_inside_a_per_layer_type_mapping_is_refused() -> None:
    """Beam reads rope_parameters.sliding_attention's theta and type only."""
    hf = beam_hf()
    hf["rope_parameters"]["sliding_attention"]["mscale"] = 1.0
    with pytest.raises(SpecError) as info:
        FAMILIES.get("beam").config(hf)
    assert str(info.value) == f"config.json: rope_parameters.sliding_attention.mscale: 1.0 {UNMODELLED}"


def test_rope_keys_cover_every_type_rope_py_computes() -> None:
    from dayzero.sdk.blocks.rope import ROPE_TYPES
    from dayzero.sdk.spec.config_keys import ROPE_KEYS

    assert set(ROPE_KEYS) == set(ROPE_TYPES)


def test_a_drafted_spec_implements_the_keys_it_does_not_map(tmp_path: Path) -> None:
    """`dayzero new`: the config's unmapped keys go to `implements` with their values, so the draft
    accepts its own config and refuses another value of any of them by name."""
    from dayzero.sdk.spec.assemble import check_implemented
    from dayzero.sdk.spec.config_keys import check_config_keys
    from dayzero.sdk.spec.draft import write_draft
    from dayzero.sdk.spec.resolver import Resolver

    hf = beam_hf()
    loaded = load_spec(write_draft("beamish", hf, tmp_path / "beamish"))
    impl = loaded.spec.implements
    assert impl["hidden_act"] == "silu" and impl["output_router_logits"] is False
    assert impl["mlp_layer_types"] == [hf["mlp_layer_types"]]  # a list value: one allowed value
    assert "hidden_size" not in impl and "attention_dropout" not in impl  # mapped / no effect

    def check(cfg: dict) -> None:
        r = Resolver(loaded, cfg, "config.json")
        for name in loaded.spec.symbols:
            r.symbol(name)
        r.field("layer_types")
        check_implemented(loaded.spec.implements, r, "spec.yaml")
        check_config_keys(
            cfg, r.read, loaded.spec.implements, loaded.spec.ignores, "config.json", "spec.yaml"
        )

    check(hf)
    with pytest.raises(SpecError, match=r"config.json: hidden_act: 'gelu' is not implemented by spec.yaml"):
        check(hf | {"hidden_act": "gelu"})
    with pytest.raises(SpecError, match=r"config.json: foo_scale: 2.0 is not modelled"):
        check(hf | {"foo_scale": 2.0})


def test_real_llama_configs_resolve() -> None:
    """config.json as Llama 3.1 and SmolLM2 ship it (transformers 4.x keys, rope_scaling, the
    SmolLM2 extras its spec ignores or implements)."""
    llama31 = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 160,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0",
        "use_cache": True,
        "vocab_size": 512,
    }
    llama = FAMILIES.get("llama")
    assert llama.config(llama31).eos_token_ids == (128001, 128008, 128009)
    smollm2 = llama31 | {
        "rope_scaling": None,
        "rope_theta": 100000,
        "is_llama_config": True,
        "rope_interleaved": False,
        "pad_token_id": 2,
        "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
    }
    llama.config(smollm2)
    with pytest.raises(SpecError, match=r"rope_interleaved: True is not implemented by spec.yaml"):
        llama.config(smollm2 | {"rope_interleaved": True})


def test_a_residual_branch_scale_is_refused_with_hyper_connections(tmp_path: Path) -> None:
    """branch_scale (Granite's residual_multiplier) scales a plain residual's branch; the
    hyper-connection mixer has no such term, so asking for one is refused by field."""
    from dayzero.sdk.spec.assemble import resolve

    flash = FAMILIES.get("glm53_flash")
    raw = yaml.safe_load(flash.spec_path.read_text())
    raw["residual"]["branch_scale"] = 0.5
    hf = reference_config(flash.spec.spec.reference, dict(flash.spec.spec.tiny))
    with pytest.raises(SpecError, match=r"residual.branch_scale: is not implemented with hyper-connections"):
        resolve(load_spec(write_spec(tmp_path, raw)), hf, flash.module("cache").CACHE_GROUPS)


def test_attention_residuals_resolve_their_blocks_and_refuse_what_they_lack(tmp_path: Path) -> None:
    """residual kind attn_res with block 2 on llama's tiny config: every layer's attention
    residual starts a block at layers 0, 2, ... and the model ends in the output mix; no block,
    a block on another kind, or depth scaling are refused by field."""
    from dayzero.sdk.spec.assemble import resolve

    llama = FAMILIES.get("llama")
    raw = yaml.safe_load(llama.spec_path.read_text())
    hf = reference_config(llama.spec.spec.reference, dict(llama.spec.spec.tiny))
    groups = llama.module("cache").CACHE_GROUPS

    def with_residual(res: dict, name: str):
        (tmp_path / name).mkdir()
        return resolve(load_spec(write_spec(tmp_path / name, raw | {"residual": res})), hf, groups)

    cfg = with_residual({"kind": "attn_res", "block": 2}, "ok")
    starts = [layer.attn_res.attn_res.append for layer in cfg.layers]
    assert starts == [i % 2 == 0 for i in range(len(cfg.layers))]
    assert not any(layer.mlp_res.attn_res.append for layer in cfg.layers)
    assert cfg.collapse.kind == "attn_res" and cfg.collapse.attn_res.block == 2
    for res, said in (
        ({"kind": "attn_res"}, r"residual.block: attn_res needs its block size"),
        ({"kind": "prenorm", "block": 2}, r"residual.block: is read by kind attn_res only, not prenorm"),
        ({"kind": "attn_res", "block": 2, "depth_scaled": True}, r"residual: attn_res needs block >= 1"),
    ):
        with pytest.raises(SpecError, match=said):
            with_residual(res, f"bad{len(list(tmp_path.iterdir()))}")
