"""Qwen3.8-Flash-Next (models/qwen38/flash_next, transformers' qwen4_exp) beyond its generated
parity test: a nested config (Qwen4ExpForConditionalGeneration: text_config,
model.language_model.*) resolves and maps like the flat one; the n-gram layers (one-based
ple_layer_ids) get their state parts in the request's slot beside the Gated DeltaNet state; the
checkpoint's copies of the n-gram hash tables are checked against the ones derived from the
config (a mismatch is an error naming the tensor); what the blocks do not implement is refused
by name. Two gloo ranks give one rank's logits: tests/test_tensor_parallel.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero.sdk.blocks.ngram import NgramOpts, hash_tables, resolve_ngram
from dayzero.sdk.config.model import Parallel
from dayzero.sdk.errors import SpecError, WeightError
from dayzero.sdk.families import FAMILIES, build
from dayzero.sdk.loader import Checkpoint, load_weights, open_checkpoint
from dayzero.sdk.parity.tiny import write_tiny
from dayzero.sdk.spec.assemble import resolve
from dayzero.sdk.spec.read import load_spec
from dayzero.sdk.spec.reference import reference_config

FAMILY = "qwen38_flash_next"


def _configs() -> tuple[dict, dict]:
    """The tiny flat config (Qwen4ExpForCausalLM's) and the same text model nested in
    Qwen4ExpConfig, its indexed layers named full_attention as the release config names them."""
    fam = FAMILIES.get(FAMILY)
    tiny = dict(fam.spec.spec.tiny) | {"num_hidden_layers": 8, "ple_layer_ids": [1, 2, 5]}
    flat = reference_config(fam.spec.spec.reference, tiny)
    text = dict(tiny) | {"layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2}
    nested = reference_config("transformers.Qwen4ExpForConditionalGeneration", {"text_config": text})
    return flat, nested


def test_a_nested_config_resolves_and_maps_like_the_flat_one() -> None:
    fam = FAMILIES.get(FAMILY)
    flat, nested = _configs()
    a, b = fam.config(flat), fam.config(nested)
    kinds = [x.attn_kind for x in a.layers]
    assert kinds == (["gated_deltanet"] * 3 + ["gqa"]) * 2 == [x.attn_kind for x in b.layers]
    assert [x.attn for x in a.layers] == [x.attn for x in b.layers]
    assert a.layers[3].attn.indexer is not None and a.layers[3].attn.output_gate == "sigmoid"
    # one-based ple_layer_ids [1, 2, 5] -> layers 0, 1, 4, each its own hash tables (its index)
    with_ngram = [x.index for x in a.layers if x.ngram is not None]
    assert with_ngram == [0, 1, 4] == [x.index for x in b.layers if x.ngram is not None]
    assert [a.layers[i].ngram.index for i in with_ngram] == [0, 1, 2]
    assert a.streams == 3 and a.collapse is not None  # the low-rank collapse replaces the final norm

    # the n-gram parts live in the state group, after the layer's Gated DeltaNet parts, aligned
    (state,) = [g for g in a.cache_groups if g.kind == "state"]
    gi = a.cache_groups.index(state)
    spans = []
    for layer in a.layers:
        parts = [(g, off) for g, off in layer.caches if g == gi] + list(layer.ngram_caches)
        spans += [off for _, off in parts]
        assert all(g == gi for g, _ in layer.ngram_caches)
    assert len(set(spans)) == len(spans) and all(off % 256 == 0 for off in spans)
    assert max(spans) < state.row

    ckpt = Checkpoint(Path("."), "safetensors", nested, fam)
    m = ckpt.mapping
    p = "model.language_model.layers.4.ple."
    assert m.param_of(p + "ple_embedding.ngram_embedding.shard_1.weight") == "layers.4.attn_res.ngram.table"
    assert m.target(p + "ple_embedding.ngram_embedding.shard_1.weight").selectors == (1,)
    assert m.param_of(p + "ple_embedding.layer_multipliers") == "layers.4.attn_res.ngram.multipliers"
    assert (
        m.param_of("model.language_model.hyper_connection_mixer.input_mix_weight_up.weight") == "collapse.up"
    )
    assert m.param_of("model.language_model.layers.3.self_attn.indexer.index_qk_proj.weight") == (
        "layers.3.attn.index_proj"
    )
    assert m.param_of("model.visual.blocks.0.attn.qkv.weight") is None  # ignored: vision tower
    assert m.is_mtp("mtp.layers.0.mlp.experts.3.up_proj.weight")


def test_hash_tables_in_the_checkpoint_are_checked_against_the_config(tmp_path: Path) -> None:
    """The tiny's saved layer_multipliers / head sizes / offsets equal ours (the load passes);
    one changed (a checkpoint hashed with another seed) is refused naming the tensor."""
    ckpt = write_tiny(FAMILY, tmp_path / "ckpt", seed=3)
    opened = open_checkpoint(ckpt)
    cfg = opened.family.config(opened.hf)
    sd = load_file(ckpt / "model.safetensors")
    name = "model.layers.2.ple.ple_embedding.layer_multipliers"
    mults, *_ = hash_tables(cfg.layers[2].ngram)
    assert sd[name].tolist() == mults  # the reference's buffer, saved with the checkpoint
    model, _ = build(opened.family, cfg, opened.hf, torch.device("cpu"), torch.float32)
    load_weights(model, opened, progress=False)

    sd[name] = sd[name] + 2  # still odd multipliers, another hash
    save_file(sd, ckpt / "model.safetensors")
    opened = open_checkpoint(ckpt)
    model, _ = build(opened.family, cfg, opened.hf, torch.device("cpu"), torch.float32)
    with pytest.raises(WeightError, match=rf"checkpoint tensor {name} .* differs from layers\.2\.attn_res"):
        load_weights(model, opened, progress=False)


def test_modelopts_single_table_tensor_loads_like_the_shards(tmp_path: Path) -> None:
    """ModelOpt's export (through transformers' save) writes each layer's n-gram table as one
    `ple_embedding.shard_.weight`, its parts' rows stacked: loaded by its own rule (a reshape to
    the parts), the model's parameters equal the ones loaded from the shards, bit for bit."""
    ckpt = write_tiny(FAMILY, tmp_path / "ckpt", seed=3)
    opened = open_checkpoint(ckpt)
    cfg = opened.family.config(opened.hf)
    model, _ = build(opened.family, cfg, opened.hf, torch.device("cpu"), torch.float32)
    load_weights(model, opened, progress=False)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}

    sd = load_file(ckpt / "model.safetensors")
    for i in (0, 2):  # the PLE layers (ple_layer_ids 1, 3 counted from one)
        stem = f"model.layers.{i}.ple.ple_embedding"
        parts = [sd.pop(f"{stem}.ngram_embedding.shard_{e}.weight") for e in range(2)]
        sd[f"{stem}.shard_.weight"] = torch.cat(parts)  # [2 R, E / Hn]
    save_file(sd, ckpt / "model.safetensors")
    opened = open_checkpoint(ckpt)
    model, _ = build(opened.family, cfg, opened.hf, torch.device("cpu"), torch.float32)
    load_weights(model, opened, progress=False)
    for n, p in model.named_parameters():
        assert torch.equal(p, want[n]), n


def _ngram_opts(**kw) -> NgramOpts:
    return NgramOpts(**({"layers": [1, 3], "counted_from": 1, "dim": 8, "heads_per_order": 4} | kw))


BASE = {"vocab_base": 50, "eos": 2}


def test_ngram_layers_and_eos_are_checked() -> None:
    args = {"vocab": 64, "hidden": 16, "streams": 2, "norm_eps": 1e-6, "n_layers": 4}
    got = resolve_ngram(_ngram_opts(**BASE), lambda v: v, **args)
    assert sorted(got) == [0, 2] and [c.index for c in got.values()] == [0, 1]
    with pytest.raises(
        ValueError, match=r"ngram layers \[5\] are not layers of this model \(4, counted from 1\)"
    ):
        resolve_ngram(
            NgramOpts(layers=[1, 5], counted_from=1, dim=8, vocab_base=50, eos=2), lambda v: v, **args
        )
    with pytest.raises(ValueError, match="need the end-of-document token"):
        resolve_ngram(_ngram_opts(vocab_base=50, eos="$eos"), lambda v: None if v == "$eos" else v, **args)
    with pytest.raises(ValueError, match="residual streams must be >= 2"):
        resolve_ngram(_ngram_opts(**BASE), lambda v: v, **(args | {"streams": 1}))
    with pytest.raises(ValueError, match="n-gram dim 9 is not a multiple"):
        resolve_ngram(_ngram_opts(dim=9, **BASE), lambda v: v, **args)


def _variant(tmp_path: Path, old: str, new: str) -> Path:
    text = (Path(FAMILIES.get(FAMILY).spec.path)).read_text()
    assert old in text
    out = tmp_path / "spec.yaml"
    out.write_text(text.replace(old, new))
    return out


def test_refused_by_name(tmp_path: Path) -> None:
    fam = FAMILIES.get(FAMILY)
    flat, _ = _configs()
    # n-gram embeddings need the low-rank hyper-connection streams
    spec = load_spec(_variant(tmp_path, "mixer: lowrank, rank: $hc_rank", "sinkhorn_iters: 3"))
    with pytest.raises(SpecError, match=r"embedding\.ngram.*residual kind hyper with mixer lowrank"):
        resolve(spec, flat, fam.module("cache").CACHE_GROUPS)
    # a Gated DeltaNet output gate the block does not implement
    with pytest.raises(SpecError, match=r"output gate 'tanh' is not implemented \(known: silu, sigmoid\)"):
        fam.config(flat | {"output_gate_type": "tanh"})
    # the QSA indexer implements one key head
    with pytest.raises(SpecError, match=r"one key head \(indexer kv_heads 1\), got 2"):
        fam.config(flat | {"indexer_kv_heads": 2})
    # hidden_act is the MoE's and the short convs' activation: silu only
    with pytest.raises(SpecError, match=r"hidden_act.*'gelu' is not implemented"):
        fam.config(flat | {"hidden_act": "gelu"})
    assert fam.config(flat).layers[0].attn.gate == "silu"  # the default gate resolves (hidden_act's)
    assert fam.config(flat | {"output_gate_type": "sigmoid"}).layers[0].attn.gate == "sigmoid"
    # tensor parallel: the QSA indexer splits by its query heads
    wide = flat | {"linear_num_key_heads": 4, "linear_num_value_heads": 8}
    with pytest.raises(SpecError, match=r"qsa indexer heads \(2\) does not split over tensor-parallel size"):
        fam.config(wide, par=Parallel(4, 1))
    ix = fam.config(wide | {"indexer_n_heads": 8}, par=Parallel(4, 1)).layers[3].attn.indexer
    assert (ix.heads, ix.head_dim, ix.budget, ix.pool) == (2, 32, 512, 4)
