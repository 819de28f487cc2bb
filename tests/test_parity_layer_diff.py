"""`dayzero parity`'s layer diff (sdk/parity/layer_diff.py): the embedding is hooked, so a wrong
embedding is blamed on it; each layer is hooked at its own block's `reference_modules` path; a
per-block mapping names exactly the blocks the layer rules use. Tiny random checkpoints written
through the reference class (recorded seeds), fp32 on the CPU, tolerance TOL: the parity
runner's fp32 layer tolerance (1e-4 of the output's scale)."""

from __future__ import annotations

import pytest
import torch
from test_spec_errors import llama_raw, spec_error, write_spec

from dayzero.sdk.loader import open_checkpoint
from dayzero.sdk.parity.layer_diff import layer_diff
from dayzero.sdk.parity.runner import Ours, Reference, make_prompts
from dayzero.sdk.parity.tiny import write_tiny
from dayzero.sdk.spec.schema import ReferenceModules

CPU = torch.device("cpu")
TOL = 1e-4


def _pair(tmp_path, family: str, seed: int, overrides: dict | None = None):
    ckpt = open_checkpoint(write_tiny(family, tmp_path / "ckpt", seed=seed, overrides=overrides))
    return ckpt, Ours(ckpt, CPU, torch.float32), Reference(ckpt, ckpt.folder, CPU, torch.float32)


def _diff(ckpt, ours, ref, mods: ReferenceModules, seed: int) -> list[str]:
    prompt = make_prompts(ours.cfg.embedding.vocab, seed)[-1]
    kinds = [(layer.attn_kind, layer.mlp_kind) for layer in ours.cfg.layers]

    def run() -> None:
        ref.logits(prompt)
        ours.prefill_logits([prompt])

    return layer_diff(ours.model, ref.model, run, mods, ckpt.mapping.layers, kinds, TOL)


@pytest.mark.parametrize("seed", [3, 11])
def test_a_wrong_embedding_is_blamed_on_the_embedding(tmp_path, seed: int) -> None:
    ckpt, ours, ref = _pair(tmp_path, "llama", seed, {"num_hidden_layers": 2})
    mods = ckpt.family.spec.spec.reference_modules
    clean = _diff(ckpt, ours, ref, mods, seed)
    assert clean[0].startswith("  embedding") and clean[-1].endswith("in the final norm or head")
    assert float(clean[0].split()[-1]) == 0.0  # the same rows looked up
    bare = _diff(ckpt, ours, ref, ReferenceModules(), seed)  # no paths: the embedding alone
    assert bare[1:] == ["  (the spec names no reference_modules: the layers are not compared)"]
    with torch.no_grad():
        ours.model.embed.weight.mul_(1.01)  # every row 1% off
    lines = _diff(ckpt, ours, ref, mods, seed)
    assert lines[-1] == "  first divergence: the embedding", lines
    assert not any("layer" in line for line in lines)  # not blamed on layer 0


def test_each_layer_is_hooked_at_its_blocks_path(tmp_path) -> None:
    """GLM-5.3-Flash tiny (KDA, KDA, KDA, KPool MLA by default): a path per attention block and
    per mlp block; a 1% error in the first MLA layer's output projection is blamed on that
    layer's attention, every KDA layer before it compared and found equal."""
    seed = 5
    ckpt, ours, ref = _pair(tmp_path, "glm53_flash", seed)
    plan = ckpt.mapping.layers
    first_mla = next(i for i, (a, _) in enumerate(plan) if a != "kda")
    assert first_mla > 0
    base = "model.language_model.layers.{i}"
    mods = ReferenceModules(
        layer=base,
        attention={b: f"{base}.self_attn" for b in ("kda", "kpool", "kpool_shared")},
        mlp={"dense": f"{base}.mlp", "moe": f"{base}.mlp"},
    )
    clean = _diff(ckpt, ours, ref, mods, seed)
    assert clean[-1].endswith("in the final norm or head"), clean
    assert sum("attention (kda)" in line for line in clean) == sum(a == "kda" for a, _ in plan)
    with torch.no_grad():
        ours.model.layers[first_mla].attn.o_proj.mul_(1.01)
    lines = _diff(ckpt, ours, ref, mods, seed)
    assert lines[-1] == f"  first divergence: layer {first_mla} attention (mla block)", lines
    assert sum("attention (kda)" in line for line in lines) == first_mla


def test_layers_with_residual_streams_are_compared(tmp_path) -> None:
    """Qwen3.8-Flash-Next tiny (hyper-connection streams: a layer's output is [T, N, D] here and
    [1, T, N D] in the reference): every layer compared equal, then a 1% error in layer 2's MoE
    router blamed on that layer's mlp."""
    seed = 7
    ckpt, ours, ref = _pair(tmp_path, "qwen38_flash_next", seed)
    mods = ckpt.family.spec.spec.reference_modules
    clean = _diff(ckpt, ours, ref, mods, seed)
    assert clean[-1].endswith("in the final norm or head"), clean
    assert sum(" mlp " in line for line in clean) == len(ckpt.mapping.layers)
    with torch.no_grad():
        ours.model.layers[2].mlp.router.mul_(1.01)
    lines = _diff(ckpt, ours, ref, mods, seed)
    assert lines[-1] == "  first divergence: layer 2 mlp (moe block)", lines


def test_a_path_per_block_picks_the_layers_block() -> None:
    """A Qwen3-Next-style hybrid: Gated DeltaNet layers under linear_attn, attention layers
    under self_attn; a role given one path uses it for every block."""
    mods = ReferenceModules(
        attention={"gdn": "model.layers.{i}.linear_attn", "full": "model.layers.{i}.self_attn"},
        mlp="model.layers.{i}.mlp",
    )
    assert mods.path("attention", "gdn", 2) == "model.layers.2.linear_attn"
    assert mods.path("attention", "full", 3) == "model.layers.3.self_attn"
    assert mods.path("mlp", "moe", 3) == "model.layers.3.mlp"
    assert mods.path("layer", "", 3) is None  # not compared


def test_a_per_block_mapping_names_exactly_the_layer_rules_blocks(tmp_path) -> None:
    raw = llama_raw()
    raw["reference_modules"]["attention"] = {"attn": "model.layers.{i}.self_attn", "sliding": "x"}
    e = spec_error(write_spec(tmp_path, raw))
    assert "reference_modules.attention.sliding" in str(e)
    assert "'sliding' is not a block of the attention layer rules (they use attn)" in str(e)
    raw["reference_modules"]["mlp"] = {}
    raw["reference_modules"]["attention"] = "model.layers.{i}.self_attn"
    e = spec_error(write_spec(tmp_path, raw))
    assert "reference_modules.mlp" in str(e) and "no path for block(s) mlp of the layer rules" in str(e)


def test_parity_on_a_family_without_generated_code_is_one_clear_line(tmp_path, monkeypatch, capsys) -> None:
    """A valid spec in models/ whose codegen failed (no model.py / cache.py): `dayzero parity`
    names the family and the fix on one line, no ModuleNotFoundError traceback."""
    from dayzero.sdk.cli import main
    from dayzero.sdk.families import FAMILIES, MODELS_DIR, Family
    from dayzero.sdk.spec.read import load_spec

    raw = llama_raw() | {"family": "zz_no_codegen"}
    fam = Family("zz_no_codegen", MODELS_DIR / "zz_no_codegen" / "spec.yaml")  # never written
    fam.__dict__["spec"] = load_spec(write_spec(tmp_path, raw))  # the spec itself is valid
    monkeypatch.setitem(FAMILIES._items, fam.name, fam)
    assert main(["parity", "zz_no_codegen", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dayzero parity: family zz_no_codegen has no generated code that imports (")
    assert err.endswith("run `dayzero codegen zz_no_codegen`") and "dayzero.models.zz_no_codegen" in err
