"""`dayzero new NAME --from-config config.json`: draft a spec from an HF config.

The draft maps the config fields it recognises to symbols, picks blocks from what the config
states (MLA from `kv_lora_rank` / `q_lora_rank`, else GQA; partial RoPE; sliding windows; MoE
routing and shared experts; softcaps; MTP layers), writes HF-style weight rules, and marks with
`# check:` what a config cannot tell (q/k norm, output gates, norm placement, the RoPE pairing,
the shared experts' form). The draft is validated before it is written.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from dayzero.sdk.spec.config_keys import unmodelled
from dayzero.sdk.spec.read import load_spec

FIELDS = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "n_layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "ffn": "intermediate_size",
    "eps": "rms_norm_eps",
}


def draft(name: str, hf: dict) -> str:
    arch = (hf.get("architectures") or [f"{name.title()}ForCausalLM"])[0]
    sym: dict = {k: v for k, v in FIELDS.items() if v in hf}
    sym["theta"] = {"field": ["rope_parameters.rope_theta", "rope_theta"], "default": 10000.0}
    sym["bias"] = {"field": "attention_bias", "default": False}
    sym["tie"] = {"field": "tie_word_embeddings", "default": False}
    sym["max_pos"] = {"field": "max_position_embeddings", "required": False}
    sym["eos"] = {"field": "eos_token_id", "required": False}
    checks = [
        "q/k norm, output gate and query scaling are not in an HF config: set them on the attention blocks"
    ]
    mla = "kv_lora_rank" in hf
    attn = _mla(hf, sym, checks) if mla else _gqa(hf, sym, checks)
    blocks: dict = {}
    if not mla and hf.get("sliding_window") and hf.get("layer_types"):
        sym["window"] = "sliding_window"
        blocks["sliding"] = attn | {"window": "$window"}
        blocks["full"] = dict(attn)
        kinds = sorted(set(hf["layer_types"]))
        attention = {
            "rule": "field",
            "field": "layer_types",
            "map": {k: "sliding" if "sliding" in k else "full" for k in kinds},
        }
    else:
        blocks["attn"] = attn
        attention = {"rule": "all", "block": "attn"}
    blocks["mlp"] = {"kind": "swiglu", "intermediate": "$ffn"}
    mlp: dict = {"rule": "all", "block": "mlp"}
    experts = next((f for f in ("num_experts", "n_routed_experts", "num_local_experts") if f in hf), None)
    shared = None
    if experts:
        sym |= {"experts": experts, "top_k": "num_experts_per_tok", "moe_ffn": "moe_intermediate_size"}
        blocks["moe"], shared = _moe(hf, sym, checks)
        if "first_k_dense_replace" in hf:
            sym["dense_layers"] = "first_k_dense_replace"
            mlp = {"rule": "first", "k": "$dense_layers", "block": "mlp", "other": "moe"}
        else:
            mlp = {"rule": "all", "block": "moe"}
    head: dict = {"tie": "$tie"}
    if hf.get("final_logit_softcapping"):
        sym["softcap"] = {"field": "final_logit_softcapping", "required": False}
        head["softcap"] = "$softcap"
    spec = {
        "family": name,
        "title": name,
        "architectures": [arch],
        "model_types": [hf.get("model_type", name)],
        "reference": f"transformers.{arch}",
        "tiny": _tiny(hf, mla, experts, shared),
        "symbols": sym,
        "layers": {"count": "$n_layers", "attention": attention, "mlp": mlp},
        "blocks": blocks,
        "residual": {"kind": "prenorm"},
        "norm": {"eps": "$eps"},
        "embedding": {"vocab": "$vocab", "dim": "$hidden"},
        "head": head,
        "max_position": "$max_pos",
        "eos_token_ids": "$eos",
        "weights": [{"format": "safetensors", "rules": _rules(mla, experts is not None, shared)}],
    }
    if hf.get("num_nextn_predict_layers"):
        sym["mtp_layers"] = "num_nextn_predict_layers"
        spec["mtp"] = {"kind": "nextn", "layers": "$mtp_layers"}
    # every config key the draft does not map is pinned to the config's value: a checkpoint that
    # sets another is refused by name, never served with math the spec does not model
    read = {f for v in sym.values() for f in _fields(v)} | (
        {"layer_types"} if "field" in attention else set()
    )
    # (a list value is one allowed value, so it is written as a list of one)
    implements = {k: [v] if isinstance(v, list) else v for k, v in unmodelled(hf, read, set(), "config.json")}
    if mla:  # fields an MLA config derives from others: checked as derived, whatever the size
        implements |= _mla_derived(hf)
    if implements:
        spec["implements"] = implements
        checks.append(
            "implements: the config's values of the fields the draft does not map; read those that "
            "vary in a symbol, move those that do not change the math to `ignores` (with the reason)"
        )
    text = yaml.safe_dump(spec, sort_keys=False, width=120)
    return (
        f"# draft spec for {arch}, from its HF config\n" + "".join(f"# check: {c}\n" for c in checks) + text
    )


def _tiny(hf: dict, mla: bool, experts: str | None, shared: str | None) -> dict:
    """The small config the parity tests build: a few layers, narrow widths, few experts (the
    first layer dense, the next MoE, where the config has first_k_dense_replace)."""
    tiny = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    tiny |= {"num_attention_heads": 4, "num_key_value_heads": 4 if mla else 2}
    if mla:
        tiny |= {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
        tiny["q_lora_rank"] = 24 if hf.get("q_lora_rank") else None  # null: q = x W_q
    if experts:
        tiny |= {experts: 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
        if "n_group" in hf:
            tiny |= {"n_group": 2, "topk_group": 1}
        if "first_k_dense_replace" in hf:
            tiny["first_k_dense_replace"] = 1
        if shared == "gated":
            tiny["shared_expert_intermediate_size"] = 48
        elif shared == "deepseek":  # two, so the count x width product is exercised
            tiny[next(f for f in ("n_shared_experts", "num_shared_experts") if f in hf)] = 2
    return tiny


def _gqa(hf: dict, sym: dict, checks: list[str]) -> dict:
    """A GQA block; partial RoPE (`partial_rotary_factor`, in `rope_parameters` since
    transformers 5) is read into `rope.fraction`."""
    sym["kv_heads"] = {"field": "num_key_value_heads", "default": "$heads"}
    sym["head_dim"] = {"field": "head_dim", "default": "= hidden // heads"}
    rope: dict = {"theta": "$theta"}
    fraction = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if fraction is not None:
        fields = ["rope_parameters.partial_rotary_factor", "partial_rotary_factor"]
        sym["rotary_fraction"] = {"field": fields, "default": 1.0}
        rope["fraction"] = "$rotary_fraction"
        checks.append(
            f"partial RoPE (partial_rotary_factor {fraction}): rope.fraction reads it; check which "
            "channels rotate and their pairing in the reference (rope.neox: rotate-half, else interleaved)"
        )
    return {
        "kind": "gqa",
        "heads": "$heads",
        "kv_heads": "$kv_heads",
        "head_dim": "$head_dim",
        "bias": "$bias",
        "rope": rope,
    }


def _mla(hf: dict, sym: dict, checks: list[str]) -> dict:
    """Multi-head latent attention, from q_lora_rank / kv_lora_rank and the split head dims."""
    sym |= {
        "q_lora": {"field": "q_lora_rank", "required": False},  # null: q = x W_q
        "kv_lora": "kv_lora_rank",
        "nope": "qk_nope_head_dim",
        "rope": {"field": "qk_rope_head_dim", "default": 0},
        "v_dim": "v_head_dim",
        "rope_parameters": {"field": "rope_parameters", "required": False},
    }
    interleaved = bool(hf.get("rope_interleave", True))
    checks.append(
        f"MLA (kv_lora_rank {hf['kv_lora_rank']}, q_lora_rank {hf.get('q_lora_rank')}): check the "
        f"RoPE pairing (drafted interleaved: {interleaved}), whether the qk_rope_head_dim channels "
        "rotate at all (`nope: true` keeps them unrotated) and any sparse indexer"
    )
    return {
        "kind": "mla",
        "heads": "$heads",
        "q_lora": "$q_lora",
        "kv_lora": "$kv_lora",
        "nope_dim": "$nope",
        "rope_dim": "$rope",
        "v_dim": "$v_dim",
        "rope": {"theta": "$theta", "interleaved": interleaved, "parameters": "$rope_parameters"},
        "latent_norm_eps": "$eps",
        "bias": "$bias",
    }


def _mla_derived(hf: dict) -> dict:
    """MLA config fields derived from others, as `implements` entries that check the derivation."""
    out: dict = {}
    if "num_key_value_heads" in hf:  # one key per query head: transformers' repeat_kv needs H
        out["num_key_value_heads"] = "$heads"
    rope = hf.get("qk_rope_head_dim") or 0
    if "head_dim" in hf and hf["head_dim"] == rope:
        out["head_dim"] = "$rope"
    if "qk_head_dim" in hf and hf["qk_head_dim"] == hf.get("qk_nope_head_dim", 0) + rope:
        out["qk_head_dim"] = "= nope + rope"
    return out


def _moe(hf: dict, sym: dict, checks: list[str]) -> tuple[dict, str | None]:
    """The MoE block and its shared expert's form: "deepseek" (n_shared_experts x the expert
    width, ungated, `shared_experts.*`), "gated" (shared_expert_intermediate_size, scaled by
    sigmoid(x w_g), Qwen2-MoE's `shared_expert.*`) or None."""
    moe = {"kind": "moe", "experts": "$experts", "top_k": "$top_k", "intermediate": "$moe_ffn"}
    if "n_group" in hf:
        sym |= {"n_group": "n_group", "topk_group": "topk_group"}
        moe |= {"groups": "$n_group", "topk_groups": "$topk_group"}
        moe |= {"score": "sigmoid", "correction_bias": True}
    if "routed_scaling_factor" in hf:
        sym["routed_scale"] = "routed_scaling_factor"
        moe["routed_scale"] = "$routed_scale"
    if "norm_topk_prob" in hf:
        sym["renorm"] = "norm_topk_prob"
        moe["renormalize"] = "$renorm"
    checks.append("MoE: check the router score function and the expert weight names")
    count = next((f for f in ("n_shared_experts", "num_shared_experts") if f in hf), None)
    shared = None
    if hf.get("shared_expert_intermediate_size"):
        sym["shared_ffn"] = "shared_expert_intermediate_size"
        moe |= {"shared_intermediate": "$shared_ffn", "shared_gate": True}
        shared = "gated"
        checks.append(
            "shared expert: drafted from shared_expert_intermediate_size, scaled by a sigmoid gate "
            "(Qwen2-MoE's shared_expert / shared_expert_gate): check the reference's"
        )
    elif count and hf[count]:
        sym["n_shared"] = {"field": count, "default": 0}
        sym["shared_ffn"] = {"default": "= moe_ffn * n_shared"}
        moe["shared_intermediate"] = "$shared_ffn"
        shared = "deepseek"
        checks.append(
            f"shared experts: drafted from {count} ({hf[count]}) x moe_intermediate_size, ungated, "
            "as one expert of that width (DeepSeek's shared_experts): check the reference's"
        )
    return moe, shared


def _fields(sym: str | dict) -> list[str]:
    """The HF fields one drafted symbol reads."""
    f = sym if isinstance(sym, str) else sym.get("field")
    return [] if f is None else [f] if isinstance(f, str) else list(f)


MLA_RULES = (  # DeepSeek's names -> the mla block's parameters (sdk/blocks/mla.py)
    ("q_a_proj.weight", "a_proj[q]"),
    ("q_proj.weight", "a_proj[q]"),  # no q_lora_rank: q = x W_q
    ("kv_a_proj_with_mqa.weight", "a_proj[kv]"),
    ("q_a_layernorm.weight", "q_norm"),
    ("q_b_proj.weight", "q_b"),
    ("kv_a_layernorm.weight", "kv_norm"),
    ("kv_b_proj.weight", "kv_b"),
    ("o_proj.weight", "o_proj"),
    ("q_a_proj.bias", "a_bias[q]"),
    ("kv_a_proj_with_mqa.bias", "a_bias[kv]"),
    ("o_proj.bias", "o_bias"),
)


def _rules(mla: bool, moe: bool, shared: str | None) -> list[dict]:
    a, m = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
    rules = [{"from": "model.embed_tokens.weight", "to": "embed.weight"}]
    if mla:
        rules += [{"from": f"{a}.{src}", "to": f"layers.{{i}}.attn.{dst}"} for src, dst in MLA_RULES]
    else:
        for p in "qkv":
            rules.append({"from": f"{a}.{p}_proj.weight", "to": f"layers.{{i}}.attn.in_proj[{p}]"})
        rules.append({"from": f"{a}.o_proj.weight", "to": "layers.{i}.attn.o_proj"})
    rules.append({"from": f"{m}.gate_proj.weight", "to": "layers.{i}.mlp.gate_up[gate]"})
    rules.append({"from": f"{m}.up_proj.weight", "to": "layers.{i}.mlp.gate_up[up]"})
    rules.append({"from": f"{m}.down_proj.weight", "to": "layers.{i}.mlp.down"})
    if moe:
        rules.append({"from": f"{m}.gate.weight", "to": "layers.{i}.mlp.router"})
        rules.append({"from": f"{m}.gate.e_score_correction_bias", "to": "layers.{i}.mlp.correction_bias"})
        for p, part in (("gate_proj", "[{e}][gate]"), ("up_proj", "[{e}][up]")):
            rules.append({"from": f"{m}.experts.{{e}}.{p}.weight", "to": f"layers.{{i}}.mlp.gate_up{part}"})
        rules.append({"from": f"{m}.experts.{{e}}.down_proj.weight", "to": "layers.{i}.mlp.down[{e}]"})
    if shared:
        src = f"{m}.shared_experts" if shared == "deepseek" else f"{m}.shared_expert"
        for p, dst in (("gate_proj", "gate_up[gate]"), ("up_proj", "gate_up[up]"), ("down_proj", "down")):
            rules.append({"from": f"{src}.{p}.weight", "to": f"layers.{{i}}.mlp.shared.{dst}"})
        if shared == "gated":
            rules.append({"from": f"{m}.shared_expert_gate.weight", "to": "layers.{i}.mlp.shared_gate"})
    rules.append({"from": "model.layers.{i}.input_layernorm.weight", "to": "layers.{i}.attn_res.norm.weight"})
    rules.append(
        {"from": "model.layers.{i}.post_attention_layernorm.weight", "to": "layers.{i}.mlp_res.norm.weight"}
    )
    rules.append({"from": "model.norm.weight", "to": "norm.weight"})
    rules.append({"from": "lm_head.weight", "to": "head.weight", "unless": "$tie"})
    return rules


def write_draft(name: str, hf: dict, out: Path) -> Path:
    path = out / "spec.yaml"
    if path.exists():
        raise FileExistsError(f"{path} exists; not overwriting it")
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".spec.yaml.draft"
    tmp.write_text(draft(name, hf))
    try:
        load_spec(tmp)  # the draft must validate before it takes the real name
    except Exception:
        tmp.unlink()
        raise
    tmp.rename(path)
    return path
