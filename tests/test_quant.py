"""Quantized checkpoints: dequantization against ModelOpt bit for bit, the config forms, the
kernels, and bad input failing loudly with the tensor's name. End-to-end parity of every format
for every family is in each family's generated test_parity.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero.kernels.packed import PackedWeight
from dayzero.kernels.reference.moe import moe_experts
from dayzero.kernels.reference.packed import fake_quant_nvfp4, linear_packed, moe_experts_packed
from dayzero.sdk.bench.quantize import quantize
from dayzero.sdk.engine.engine import Engine, EngineConfig
from dayzero.sdk.families import build
from dayzero.sdk.loader import CheckpointError, WeightError, load_weights, open_checkpoint
from dayzero.sdk.parity.quantized_tiny import write_quantized_tiny
from dayzero.sdk.parity.runner import Ours
from dayzero.sdk.quant import check_requested
from dayzero.sdk.quant.config import read_quant_config
from dayzero.sdk.quant.layout import to_rows

qt = pytest.importorskip("modelopt.torch.quantization.qtensor", reason="ModelOpt makes the reference")
SEEDS = (0, 1, 2)


def _packed(fmt: str, comps: dict[str, torch.Tensor], shape: tuple[int, ...]) -> PackedWeight:
    w = PackedWeight(fmt, shape, "input" in comps)
    for name, t in comps.items():
        getattr(w, name).copy_(t)
    return w


def _nvfp4(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """ModelOpt's NVFP4 of w [N, K]: our per-row components, and ModelOpt's own dequantization."""
    q, scale, scale_2 = qt.NVFP4QTensor.quantize(w, 16)
    ref = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    rows = w.shape[0]
    comps = {"codes": q._quantized_data, "scale": scale, "global": to_rows("nvfp4", "global", scale_2, rows)}
    return comps, ref


@pytest.mark.parametrize("seed", SEEDS)
def test_nvfp4_dequant_equals_modelopt_bitwise(seed: int) -> None:
    """A fused [q; k] weight whose parts carry different global scales, dequantized exactly."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(48, 64, generator=g) * s for s in (0.02, 3.0)]  # global scales ~150x apart
    got = [_nvfp4(p) for p in parts]
    comps = {c: torch.cat([p[0][c] for p in got]) for c in ("codes", "scale", "global")}
    w = _packed("nvfp4", comps, (96, 64))
    expected = torch.cat([p[1] for p in got])
    assert torch.equal(w.dequant(torch.float32), expected)
    assert got[0][0]["global"][0] != got[1][0]["global"][0]


@pytest.mark.parametrize("seed", SEEDS)
def test_mxfp4_dequant_equals_modelopt_bitwise(seed: int) -> None:
    w = torch.randn(40, 128, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, e8m0 = qt.MXFP4QTensor.quantize(w, 32)
    ref = q.dequantize(dtype=torch.float32, scale=e8m0, block_sizes={-1: 32})
    packed = _packed("mxfp4", {"codes": q._quantized_data, "scale": e8m0.reshape(40, 4)}, (40, 128))
    assert torch.equal(packed.dequant(torch.float32), ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_fp8_block_dequant_equals_modelopt_bitwise(seed: int) -> None:
    """200 x 300: partial 128-blocks in both dims; per-row scales from the block grid."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(seed))
    q, scale = qt.FP8QTensor.quantize(w, block_sizes={-1: 128, -2: 128})
    ref = q.dequantize(dtype=torch.float32, scale=scale, block_sizes={-1: 128, -2: 128})
    comps = {"codes": q._quantized_data, "scale": to_rows("fp8_block", "scale", scale, 200)}
    assert torch.equal(_packed("fp8_block", comps, (200, 300)).dequant(torch.float32), ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_benchmark_quantizer_equals_modelopt(seed: int) -> None:
    """sdk/bench/quantize.py (the decode benchmark's GPU quantizer) packs random weights exactly
    as ModelOpt does: codes, block scales and global scale."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))
    q, scale, scale_2 = qt.NVFP4QTensor.quantize(w, 16)
    ours = quantize(w, "nvfp4")
    assert torch.equal(ours["codes"], q._quantized_data) and torch.equal(ours["scale"].float(), scale.float())
    assert torch.equal(ours["global"], scale_2.expand(64))
    q, e8m0 = qt.MXFP4QTensor.quantize(w, 32)
    ours = quantize(w, "mxfp4")
    assert torch.equal(ours["codes"], q._quantized_data) and torch.equal(ours["scale"], e8m0.reshape(64, 8))
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(seed))
    q, scale = qt.FP8QTensor.quantize(w, block_sizes={-1: 128, -2: 128})
    ours = quantize(w, "fp8_block")
    assert torch.equal(ours["codes"].float(), q._quantized_data.float())
    assert torch.equal(ours["scale"], to_rows("fp8_block", "scale", scale, 200))


@pytest.mark.parametrize("seed", SEEDS)
def test_nvfp4_activation_quantization_matches_modelopt(seed: int) -> None:
    """fake_quant_nvfp4 with a static input scale = ModelOpt's NVFP4 quantize-dequantize."""
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(seed)) * 2
    input_scale = x.abs().amax() / (6 * 448)
    q, scale, scale_2 = qt.NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=input_scale)
    ref = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    assert torch.equal(fake_quant_nvfp4(x, input_scale), ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_packed_kernels_match_dense_ones(seed: int) -> None:
    """linear_packed / moe_experts_packed = the dense ops on the dequantized weights."""
    g = torch.Generator().manual_seed(seed)
    e, n, k = 4, 64, 32
    comps = [_nvfp4(torch.randn(n, k, generator=g)) for _ in range(e)]
    up = _packed("nvfp4", {c: torch.stack([p[0][c] for p in comps]) for c in comps[0][0]}, (e, n, k))
    comps = [_nvfp4(torch.randn(k, n // 2, generator=g)) for _ in range(e)]
    down = _packed("nvfp4", {c: torch.stack([p[0][c] for p in comps]) for c in comps[0][0]}, (e, k, n // 2))
    x = torch.randn(5, k, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:2] for _ in range(5)])
    wts = torch.rand(5, 2, generator=g)
    want = moe_experts(x, up.dequant(), down.dequant(), wts, ids, limit=1.5)
    assert torch.allclose(moe_experts_packed(x, up, down, wts, ids, limit=1.5), want, atol=1e-6, rtol=0)
    b = torch.randn(n, generator=g)
    lin = _packed("nvfp4", {c: getattr(up, c)[1] for c in ("codes", "scale", "global")}, (n, k))
    assert torch.allclose(linear_packed(x, lin, b), x @ up.dequant()[1].T + b, atol=1e-6, rtol=0)


# --- config forms -------------------------------------------------------------------------------


def test_config_forms(tmp_path: Path) -> None:
    side = {
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*.gate"]}
    }
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(side))
    c = read_quant_config(tmp_path, {})
    assert (c.convention, c.default, c.format_for("model.layers.0.mlp.gate"), c.format_for("x.q_proj")) == (
        "modelopt",
        "nvfp4",
        None,
        "nvfp4",
    )
    assert c.excluded_by("lm_head") == "lm_head"
    mixed = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "ignore": []}
    mixed["quantized_layers"] = {
        "model.layers.*.self_attn": {"quant_algo": "fp8_pb_wo"},
        "*.mlp*": {"quant_algo": "NVFP4"},
    }
    (tmp_path / "hf_quant_config.json").unlink()
    c = read_quant_config(tmp_path, {"quantization_config": mixed})
    assert c.format_for("model.layers.3.self_attn.o_proj") == "fp8_block"
    assert c.format_for("model.layers.3.mlp.experts.0.up_proj") == "nvfp4"
    assert c.format_for("lm_head") is None
    c = read_quant_config(
        tmp_path, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    )
    assert (c.convention, c.default) == ("deepseek", "fp8_block")
    c = read_quant_config(tmp_path, {"quantization_config": {"quant_method": "mxfp4"}})
    assert (c.convention, c.default) == ("gpt_oss", "mxfp4")
    assert read_quant_config(tmp_path, {}) is None


@pytest.mark.parametrize(
    ("q", "message"),
    [
        (
            {"quant_method": "modelopt", "quant_algo": "INT4_AWQ"},
            "unknown quant_algo 'INT4_AWQ'; known: NVFP4",
        ),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size 32 for NVFP4"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
        ({"quant_method": "gptq"}, "quant_method 'gptq'; known: modelopt"),
        ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "supported: mxfp4-pack"),
        ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "without quantized_layers"),
    ],
)
def test_bad_quant_configs_name_the_field(tmp_path: Path, q: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_quant_config(tmp_path, {"quantization_config": q})


# --- checkpoints made by ModelOpt, then broken ---------------------------------------------------


@pytest.fixture(scope="module")
def nvfp4_llama(tmp_path_factory) -> Path:
    return write_quantized_tiny("llama", tmp_path_factory.mktemp("q") / "nvfp4", "nvfp4", seed=3)


@pytest.fixture(scope="module")
def mxfp4_llama(tmp_path_factory) -> Path:
    return write_quantized_tiny("llama", tmp_path_factory.mktemp("q") / "mxfp4", "mxfp4", "gpt_oss", seed=3)


def _broken(src: Path, dst: Path, edit=None, config=None) -> Path:
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    if config is not None:
        for name in ("config.json", "hf_quant_config.json"):
            if (dst / name).exists():
                body = json.loads((dst / name).read_text())
                config(body.get("quantization_config") or body.get("quantization"))
                (dst / name).write_text(json.dumps(body))
    return dst


def _load(path: Path) -> Ours:
    return Ours(open_checkpoint(path), torch.device("cpu"), torch.float32)


def test_packed_weights_stay_packed(nvfp4_llama: Path) -> None:
    """Every linear weight of the layers is a PackedWeight of 4.5 bits an element (+ 8 bytes a row:
    global and input scale); nothing dense shadows it."""
    model = _load(nvfp4_llama).model
    packed = {n: m for n, m in model.named_modules() if isinstance(m, PackedWeight)}
    assert len(packed) == 4 * len(model.layers) and all(p.format.name == "nvfp4" for p in packed.values())
    for w in packed.values():
        n, k = w.shape
        assert w.nbytes() == n * k * 9 // 16 + 8 * n
    dense = {n for n, _ in model.named_parameters()}
    assert not any(n.endswith(("in_proj", "o_proj", "gate_up", "down")) for n in dense)


def _del(name: str):
    return lambda t: t.pop(name)


def _set(name: str, value: float):
    def edit(t: dict) -> None:
        t[name] = torch.full_like(t[name].float(), value).to(t[name].dtype)

    return edit


def _narrow(name: str):
    return lambda t: t.__setitem__(name, t[name][:, :-1].contiguous())


def _add(name: str, like: str):
    return lambda t: t.__setitem__(name, t[like].clone())


Q = "model.layers.1.self_attn.q_proj"
BAD = {
    "missing scale": (_del(f"{Q}.weight_scale"), None, f"{Q}.weight_scale is missing"),
    "missing global scale": (_del(f"{Q}.weight_scale_2"), None, f"{Q}.weight_scale_2 is missing"),
    "NaN global scale": (_set(f"{Q}.weight_scale_2", float("nan")), None, f"{Q}.weight_scale_2 holds NaN"),
    "inf input scale": (_set(f"{Q}.input_scale", float("inf")), None, f"{Q}.input_scale holds NaN or inf"),
    "NaN block scale": (_set(f"{Q}.weight_scale", float("nan")), None, f"{Q}.weight_scale holds NaN"),
    "scale of the wrong shape": (
        _narrow(f"{Q}.weight_scale"),
        None,
        rf"{Q}.weight_scale: shape \[64, 3\], expected",
    ),
    "codes of the wrong shape": (_narrow(f"{Q}.weight"), None, rf"{Q}.weight: shape \[64, 31\], expected"),
    "scale of an unquantized weight": (
        _add("lm_head.weight_scale", f"{Q}.weight_scale"),
        None,
        "lm_head.weight_scale scales lm_head.weight, which is stored unquantized",
    ),
    "quantized tensor of an excluded module": (
        None,
        lambda q: (q.get("ignore") if "ignore" in q else q["exclude_modules"]).append(
            "model.layers.1.self_attn"
        ),
        r"model.layers.1.self_attn.(\w+)_proj.weight is packed \(uint8\) but config.json: "
        r"quantization_config excludes module model.layers.1.self_attn.\1_proj "
        r"\(pattern 'model.layers.1.self_attn'\)",
    ),
    "unknown quant_algo": (
        None,
        lambda q: q.update(quant_algo="NVFP4_AWQ"),
        "unknown quant_algo 'NVFP4_AWQ'",
    ),
    "format the codes do not match": (
        None,
        lambda q: q.update(quant_algo="FP8_PB_WO", group_size=None),
        r"checkpoint tensor model.layers.\d+.\S+.weight has dtype uint8; fp8_block \(config.json: "
        r"quantization_config\) packs it as float8_e4m3fn",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_quantized_checkpoints_name_the_tensor(nvfp4_llama: Path, tmp_path: Path, case: str) -> None:
    edit, config, message = BAD[case]
    bad = _broken(nvfp4_llama, tmp_path / "bad", edit, config)
    with pytest.raises((WeightError, CheckpointError), match=message):
        _load(bad)


def test_e8m0_nan_scale_is_refused(mxfp4_llama: Path, tmp_path: Path) -> None:
    """E8M0 255 encodes NaN."""
    name = "model.layers.0.mlp.down_proj.weight_scales"
    bad = _broken(mxfp4_llama, tmp_path / "bad", lambda t: t[name].view(-1).__setitem__(3, 255))
    with pytest.raises(WeightError, match=f"{name} holds NaN"):
        _load(bad)


def test_one_fused_weight_cannot_mix_formats(nvfp4_llama: Path, tmp_path: Path) -> None:
    """k_proj stored in bf16 while q_proj and v_proj (the same fused in_proj) are NVFP4."""
    k = "model.layers.0.self_attn.k_proj"

    def edit(t: dict) -> None:
        for s in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
            t.pop(f"{k}.{s}")
        t[f"{k}.weight"] = torch.randn(32, 64, dtype=torch.bfloat16)

    with pytest.raises(WeightError, match=f"{k}.weight is stored unquantized \\(bfloat16\\) but other parts"):
        _load(_broken(nvfp4_llama, tmp_path / "bad", edit))


@pytest.mark.parametrize("seed", SEEDS)
def test_activation_quantization_uses_each_parts_input_scale(seed: int) -> None:
    """A fused [q; k] with different input scales: each part's rows see x quantized with its own."""
    g = torch.Generator().manual_seed(seed)
    parts = [_nvfp4(torch.randn(32, 64, generator=g)) for _ in range(2)]
    scales = (torch.tensor(0.002), torch.tensor(0.0007))
    comps = {c: torch.cat([p[0][c] for p in parts]) for c in ("codes", "scale", "global")}
    comps["input"] = torch.cat([s.expand(32) for s in scales])
    w = _packed("nvfp4", comps, (64, 64))
    w.act_quant = True
    x = torch.randn(3, 64, generator=g)
    want = torch.cat([fake_quant_nvfp4(x, s) @ p[1].T for s, p in zip(scales, parts, strict=True)], dim=-1)
    assert torch.allclose(linear_packed(x, w), want, atol=1e-6, rtol=0)


def test_activation_quantization_end_to_end(nvfp4_llama: Path, mxfp4_llama: Path) -> None:
    """--quantize-activations runs NVFP4 checkpoints with their input scales (logits move by the
    activation rounding, not more) and refuses formats without input scales."""
    ckpt = open_checkpoint(nvfp4_llama)
    cfg = ckpt.family.config(ckpt.hf)
    prompt = [[5, 17, 99, 3, 42, 7, 64, 11]]
    logits = []
    for act in (False, True):
        model, ops = build(
            ckpt.family, cfg, ckpt.hf, torch.device("cpu"), torch.float32, ckpt.packing.params, act
        )
        load_weights(model, ckpt, progress=False)
        logits.append(Engine(model, cfg, ops, EngineConfig()).prompt_logits(prompt)[0])
    diff = (logits[0] - logits[1]).abs().max().item()
    assert 1e-4 < diff < 0.5 * logits[0].abs().max().item(), diff
    mx = open_checkpoint(mxfp4_llama)
    with pytest.raises(
        WeightError, match=r"activation quantization needs NVFP4 input scales; layers\.0\.attn\.in_proj"
    ):
        build(
            mx.family,
            mx.family.config(mx.hf),
            mx.hf,
            torch.device("cpu"),
            torch.float32,
            mx.packing.params,
            True,
        )


def test_config_json_alone_serves_and_disagreeing_forms_fail(nvfp4_llama: Path, tmp_path: Path) -> None:
    """ModelOpt writes both forms; either alone is enough, and two that disagree are an error."""
    alone = _broken(nvfp4_llama, tmp_path / "alone")
    (alone / "hf_quant_config.json").unlink()
    assert open_checkpoint(alone).packing.formats == ("nvfp4",)
    bad = _broken(nvfp4_llama, tmp_path / "bad")
    side = json.loads((bad / "hf_quant_config.json").read_text())
    side["quantization"]["quant_algo"] = "FP8_PB_WO"
    (bad / "hf_quant_config.json").write_text(json.dumps(side))
    with pytest.raises(CheckpointError, match=r"quantization_config and hf_quant_config\.json disagree"):
        open_checkpoint(bad)


@pytest.mark.parametrize(
    ("requested", "formats", "error"),
    [
        ("nvfp4", ("nvfp4",), None),
        ("fp8", ("fp8_block", "nvfp4"), None),
        ("none", (), None),
        ("mxfp4", ("nvfp4",), "--quantization mxfp4: the checkpoint is nvfp4"),
        ("nvfp4", (), "the checkpoint is not quantized"),
        ("none", ("nvfp4",), "--quantization none, but the checkpoint is nvfp4"),
    ],
)
def test_requested_quantization_is_checked(requested: str, formats: tuple, error: str | None) -> None:
    if error is None:
        check_requested(formats, requested)
    else:
        with pytest.raises(CheckpointError, match=error):
            check_requested(formats, requested)


def test_activation_quantization_of_an_unquantized_checkpoint_is_refused(tmp_path: Path) -> None:
    from dayzero.sdk.parity.tiny import write_tiny

    ckpt = open_checkpoint(write_tiny("llama", tmp_path / "f", overrides={"num_hidden_layers": 1}))
    with pytest.raises(WeightError, match="activation quantization needs an NVFP4 checkpoint"):
        build(
            ckpt.family, ckpt.family.config(ckpt.hf), ckpt.hf, torch.device("cpu"), torch.float32, None, True
        )


def test_modelopt_merged_shards_are_split_back(tmp_path: Path) -> None:
    """ModelOpt's export writes a parameter stored as shards (`<m>.<p>.shard_<i>.weight`, merged by
    transformers at load) as one `<m>.shard_.weight`: split back into the float checkpoint's
    shards in index order, other tensors untouched; a merged tensor of another size names the
    shard."""
    from dayzero.sdk.parity.quantized_tiny import _reshard

    g = torch.Generator().manual_seed(4)
    a, b, other = torch.randn(3, 5, generator=g), torch.randn(4, 5, generator=g), torch.randn(2, generator=g)
    names = {"m.emb.table.shard_1.weight": (4, 5), "m.emb.table.shard_0.weight": (3, 5), "m.x": (2,)}
    save_file({"m.emb.shard_.weight": torch.cat((a, b)), "m.x": other}, str(tmp_path / "model.safetensors"))
    _reshard(tmp_path, names)
    got = load_file(str(tmp_path / "model.safetensors"))
    assert set(got) == set(names)
    assert torch.equal(got["m.emb.table.shard_0.weight"], a) and torch.equal(
        got["m.emb.table.shard_1.weight"], b
    )
    assert torch.equal(got["m.x"], other)
    save_file({"m.emb.shard_.weight": torch.randn(8, 5, generator=g)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(RuntimeError, match=r"m\.emb\.table\.shard_1\.weight"):
        _reshard(tmp_path, names)
