"""`dayzero new NAME --from-config config.json`: draft a spec from an HF config.

The draft maps the config fields it recognises to symbols, picks blocks from what the config
states (sliding windows, MoE routing, softcaps, MTP layers), writes HF-style weight rules, and
marks with `# check:` what a config cannot tell (q/k norm, output gates, norm placement).
The draft is validated before it is written.
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
    sym["kv_heads"] = {"field": "num_key_value_heads", "default": "$heads"}
    sym["head_dim"] = {"field": "head_dim", "default": "= hidden // heads"}
    sym["theta"] = {"field": ["rope_parameters.rope_theta", "rope_theta"], "default": 10000.0}
    sym["bias"] = {"field": "attention_bias", "default": False}
    sym["tie"] = {"field": "tie_word_embeddings", "default": False}
    sym["max_pos"] = {"field": "max_position_embeddings", "required": False}
    sym["eos"] = {"field": "eos_token_id", "required": False}
    attn = {
        "kind": "gqa",
        "heads": "$heads",
        "kv_heads": "$kv_heads",
        "head_dim": "$head_dim",
        "bias": "$bias",
        "rope": {"theta": "$theta"},
    }
    blocks: dict = {}
    checks = [
        "q/k norm, output gate and query scaling are not in an HF config: set them on the attention blocks"
    ]
    if hf.get("sliding_window") and hf.get("layer_types"):
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
    if experts:
        sym |= {"experts": experts, "top_k": "num_experts_per_tok", "moe_ffn": "moe_intermediate_size"}
        moe = {"kind": "moe", "experts": "$experts", "top_k": "$top_k", "intermediate": "$moe_ffn"}
        if "n_group" in hf:
            sym |= {"n_group": "n_group", "topk_group": "topk_group"}
            moe |= {
                "groups": "$n_group",
                "topk_groups": "$topk_group",
                "score": "sigmoid",
                "correction_bias": True,
            }
        if "routed_scaling_factor" in hf:
            sym["routed_scale"] = "routed_scaling_factor"
            moe["routed_scale"] = "$routed_scale"
        if "norm_topk_prob" in hf:
            sym["renorm"] = "norm_topk_prob"
            moe["renormalize"] = "$renorm"
        blocks["moe"] = moe
        if "first_k_dense_replace" in hf:
            sym["dense_layers"] = "first_k_dense_replace"
            mlp = {"rule": "first", "k": "$dense_layers", "block": "mlp", "other": "moe"}
        else:
            mlp = {"rule": "all", "block": "moe"}
        checks.append("MoE: check the router score function, shared experts and the expert weight names")
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
        "tiny": {
            "vocab_size": 512,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "symbols": sym,
        "layers": {"count": "$n_layers", "attention": attention, "mlp": mlp},
        "blocks": blocks,
        "residual": {"kind": "prenorm"},
        "norm": {"eps": "$eps"},
        "embedding": {"vocab": "$vocab", "dim": "$hidden"},
        "head": head,
        "max_position": "$max_pos",
        "eos_token_ids": "$eos",
        "weights": [{"format": "safetensors", "rules": _rules(experts is not None)}],
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


def _fields(sym: str | dict) -> list[str]:
    """The HF fields one drafted symbol reads."""
    f = sym if isinstance(sym, str) else sym.get("field")
    return [] if f is None else [f] if isinstance(f, str) else list(f)


def _rules(moe: bool) -> list[dict]:
    a, m = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
    rules = [{"from": "model.embed_tokens.weight", "to": "embed.weight"}]
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
