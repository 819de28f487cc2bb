"""`dayzero bench decode`'s CPU-testable parts: the reference weights under their checkpoint
names, the bytes a decode step reads (the roofline's numerator), and `--device cpu` (a
checkpoint's decode on the host)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from dayzero.sdk.bench.agentic import random_model
from dayzero.sdk.bench.decode import checkpoint_tensors
from dayzero.sdk.bench.roofline import bytes_per_step
from dayzero.sdk.bench.timing import print_drafting, profile_decode, time_drafting
from dayzero.sdk.engine.drafters import SpeculativeConfig
from dayzero.sdk.engine.engine import EngineConfig
from dayzero.sdk.families import build
from dayzero.sdk.loader import fill_dummy, open_checkpoint
from dayzero.sdk.parity.runner import Ours
from dayzero.sdk.parity.tiny import write_tiny
from dayzero.sdk.spec.reference import reference_class


@pytest.mark.parametrize("family", ["beam", "glm53", "glm53_flash"])
def test_in_memory_reference_tensors_carry_checkpoint_names(tmp_path, family: str) -> None:
    path = write_tiny(family, tmp_path / "ckpt", seed=0)
    ref = reference_class(open_checkpoint(path).family.spec.spec.reference).from_pretrained(path)
    saved = safe_open(str(path / "model.safetensors"), "pt")
    got = dict(checkpoint_tensors(ref))
    assert set(got) == set(saved.keys())
    for name in list(got)[:20]:
        assert torch.equal(got[name], saved.get_tensor(name)), name


def test_decode_bytes_count_weights_experts_and_cache(tmp_path) -> None:
    ckpt = open_checkpoint(write_tiny("glm53_flash", tmp_path / "ckpt", seed=0))
    ours = Ours(ckpt, torch.device("cpu"), torch.float32)
    one, total, active = bytes_per_step(ours.cfg, ours.model, prompt_len=100)
    assert active < total - ours.model.embed.weight.numel()  # unused experts are not read
    two = bytes_per_step(ours.cfg, ours.model, prompt_len=200)[0]
    paged = sum(g.row for g in ours.cfg.cache_groups if g.kind != "state")
    assert two - one == pytest.approx(paged * 2 * 100)  # 100 more cached positions, bf16
    many = bytes_per_step(ours.cfg, ours.model, prompt_len=100, batch=64)[0]
    assert many > one  # more experts touched, 64 requests' caches


def _flat(d: dict, pre: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{pre}{k}.") if isinstance(v, dict) else {f"{pre}{k}": v})
    return out


@pytest.mark.parametrize("family", ["beam", "glm53", "glm53_flash"])
def test_bench_config_resolves_to_eight_layers_first_dense_64_experts(family: str) -> None:
    """`dayzero bench decode --family F` with no flags: the spec's bench overrides on the reference
    config class's defaults resolve; every per-layer list is cut to 8 layers; every other field
    stays the default config's."""
    from dayzero.sdk.families import FAMILIES
    from dayzero.sdk.spec.reference import reference_config

    fam = FAMILIES.get(family)
    spec = fam.spec.spec
    assert spec.bench, f"{family}: spec has no bench config"
    hf = reference_config(spec.reference, dict(spec.bench))
    cfg = fam.config(hf)
    assert [layer.mlp_kind for layer in cfg.layers] == ["swiglu"] + ["moe"] * 7
    assert {layer.mlp.experts for layer in cfg.layers[1:]} == {64}
    got, default, over = _flat(hf), _flat(reference_config(spec.reference, {})), _flat(dict(spec.bench))
    lists = {k for k, v in got.items() if isinstance(v, list) and k != "architectures"}
    assert lists and {k: len(got[k]) for k in lists} == dict.fromkeys(lists, 8)
    kept = {k for k in got if k not in over and k not in lists}
    assert {k: got[k] for k in kept} == {k: default.get(k) for k in kept}


def test_glm53_bench_config_keeps_the_default_indexer_schedule() -> None:
    """GlmMoeDsaConfig()'s schedule (index_topk_freq 1: every layer runs its own indexer) cut to 8
    layers: eight DSA layers, none reusing another's top-k, top-k 2048."""
    from dayzero.sdk.families import FAMILIES
    from dayzero.sdk.spec.reference import reference_config

    fam = FAMILIES.get("glm53")
    hf = reference_config(fam.spec.spec.reference, dict(fam.spec.spec.bench))
    assert hf["indexer_types"] == ["full"] * 8
    cfg = fam.config(hf)
    assert [(layer.attn_kind, layer.attn.indexer.reuse, layer.attn.indexer.topk) for layer in cfg.layers] == [
        ("mla", False, 2048)
    ] * 8


def test_kimi_k3_bench_config_keeps_the_release_layer_rule() -> None:
    """Kimi K3's bench config from its own config class: 8 layers, KDA where the release's rule
    puts it (MLA on the 1-based layers 4 and 8), the first dense, 64 experts, the release's widths."""
    from dayzero.sdk.families import FAMILIES
    from dayzero.sdk.spec.reference import spec_config

    fam = FAMILIES.get("kimi_k3")
    spec = fam.spec.spec
    cfg = fam.config(spec_config(spec, dict(spec.bench)))
    assert [layer.attn_kind for layer in cfg.layers] == ["kda"] * 3 + ["mla"] + ["kda"] * 3 + ["mla"]
    assert [layer.mlp_kind for layer in cfg.layers] == ["swiglu"] + ["moe"] * 7
    assert {layer.mlp.experts for layer in cfg.layers[1:]} == {64}
    release = fam.config(spec_config(spec, {}))
    assert cfg.embedding.dim == release.embedding.dim == 7168
    assert cfg.layers[3].attn == release.layers[3].attn and cfg.layers[1].mlp.top_k == 16


TINY_BEAM = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "layer_types": None,
    "mlp_layer_types": None, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "n_group": 2,
    "topk_group": 1, "vocab_size": 256, "max_position_embeddings": 128,
}  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1])
def test_bench_model_times_the_reference_first_then_loads_its_weights(seed: int) -> None:
    """`bench decode --family beam`'s model (here on the CPU, a tiny Beam by --set): bench_model
    reports transformers' rate at each batch and its prefill time, and dayzero's copy, loaded
    from the reference after that timing, gives the reference's logits (fp32, within 1e-4 of
    max|logit|) on random prompts; the reference is rebuilt here from the bench's own seed.
    (Parking the reference on the host between the two is a move on the CPU: GPU-only.)"""
    from dayzero.sdk.bench.decode import bench_model
    from dayzero.sdk.engine.engine import Engine
    from dayzero.sdk.families import born_as
    from dayzero.sdk.spec.reference import spec_config

    args = SimpleNamespace(
        family="beam", set=json.dumps(TINY_BEAM), reference=True, quantization=None, batches="1,2",
        prompt_len=8, new_tokens=4, prefill_len=32, prefill_chunk=8192,
    )  # fmt: skip
    cpu = torch.device("cpu")
    fam, cfg, model, ops, fmt, theirs, prefill = bench_model(args, False, cpu, torch.float32)
    assert fmt is None and set(theirs) == {1, 2} and all(r > 0 for r in theirs.values())
    assert prefill > 0
    hf = spec_config(fam.spec.spec, {**dict(fam.spec.spec.bench), **TINY_BEAM})
    cls = reference_class(fam.spec.spec.reference)
    torch.manual_seed(0)  # bench_model's seed: the same random weights
    with born_as(cpu, torch.float32):
        ref = cls(cls.config_class(**hf)).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (9, 21)]
    eng = Engine(model, cfg, ops, EngineConfig(decode_graphs="off"))
    ours = eng.prompt_logits([p.tolist() for p in prompts])
    with torch.no_grad():
        want = [ref(p[None]).logits[0].float() for p in prompts]
    scale = max(w.abs().max().item() for w in want)
    err = max((a - b).abs().max().item() for a, b in zip(ours, want, strict=True))
    print(f"err {err:.2e} of {scale:.3f}")
    assert err <= 1e-4 * scale, (err, scale)


def _drafting_llama(folder, seed: int):
    """(model, config, ops) of a tiny Llama built with a random NextN head, dummy weights."""
    ckpt = open_checkpoint(write_tiny("llama", folder, seed=seed))
    hf = ckpt.hf | {"num_nextn_predict_layers": 1}
    cfg = ckpt.family.config(hf, str(ckpt.path), mtp=True)
    model, ops = build(ckpt.family, cfg, hf, torch.device("cpu"), torch.float32)
    fill_dummy(model, ckpt)
    return model, cfg, ops


def test_drafting_rows_count_kept_tokens_and_acceptance(tmp_path, capsys) -> None:
    """`--speculative-config` rows on the CPU: a tiny Llama with a random NextN head drafts 2
    tokens a step at batch 2: a rate, a step time and an acceptance length in [1, k + 1], and the
    table's last line gives the break-even (drafting's step time over a plain step's)."""
    model, cfg, ops = _drafting_llama(tmp_path / "ckpt", 0)
    spec = SpeculativeConfig("mtp", 2)
    engine_cfg = EngineConfig(max_batch_size=2, decode_graphs="off")
    args = SimpleNamespace(prompt_len=8, new_tokens=6)
    tps, ms, accept = time_drafting(model, cfg, ops, engine_cfg, spec, 2, args)
    assert tps > 0 and ms > 0 and 1.0 <= accept <= 3.0
    print_drafting("llama", spec, [(2, tps / accept, ms / 2, tps, ms, accept)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"speculative_llama b2={tps:.1f} accept_b2={accept:.2f} breakeven_b2=2.00"


def test_a_drafting_profile_names_its_phases(tmp_path, capsys) -> None:
    """`--profile` with `--speculative-config`: the drafting steps' phases (the engine's
    record_function ranges) in a table of calls and host / device ms a step, on the CPU."""
    model, cfg, ops = _drafting_llama(tmp_path / "ckpt", 1)
    spec = SpeculativeConfig("mtp", 2)
    profile_decode(model, cfg, ops, 12, cfg.embedding.vocab, 2, steps=4, speculative=spec, kv_bytes=16 << 20)
    out = capsys.readouterr().out
    assert "profile: 4 decode steps of batch 2, drafting 2 by mtp" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("dayzero.")}
    assert {"dayzero.draft", "dayzero.verify", "dayzero.observe"} <= set(rows), out[:2000]
    assert int(rows["dayzero.verify"][0]) == 4 and float(rows["dayzero.verify"][1]) > 0
    # then the GPU kernels by kind (sdk/bench/kernel_groups.py): none on the CPU, the sum says so
    assert "where a decode step's device time goes" in out
    assert re.search(r"^all +0\.000 +0\.0$", out, re.M), out[-1500:]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "dayzero.sdk.cli", "bench", "decode", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_cpu_decode_bench_times_a_checkpoint_with_and_without_drafts(tmp_path) -> None:
    """`bench decode --device cpu --model DIR`: a tiny Llama's decode at batches 1 and 2 in fp32,
    its roofline from the host's copy bandwidth, the drafting rows (prompt lookup) and the
    summary lines; the prefill is said to be timed on CUDA only, not silently skipped."""
    path = write_tiny("llama", tmp_path / "ckpt", seed=2)
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    r = _bench("--device", "cpu", "--model", str(path), "--batches", "1,2", "--new-tokens", "6",
               "--speculative-config", spec)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "weights resident on the CPU" in out and "(float32)" in out
    assert "prefill: timed on CUDA only" in out
    assert re.search(r"^batch 1 decode step: \d+\.\d\d ms wall$", out, re.M), out
    rates = re.search(r"^decode_llama b1=([\d.]+) b2=([\d.]+) roofline_b1=(\d+) roofline_b2=(\d+)", out, re.M)
    assert rates and all(float(v) > 0 for v in rates.groups()), out
    drafted = re.search(
        r"^speculative_llama b1=([\d.]+) accept_b1=([\d.]+) breakeven_b1=([\d.]+) b2=", out, re.M
    )
    assert drafted and 1.0 <= float(drafted[2]) <= 3.0 and float(drafted[3]) > 0, out
    assert out.strip().splitlines()[-1].startswith("decode_vs_roofline B1=")


def test_cpu_decode_bench_refuses_what_it_cannot_time(tmp_path) -> None:
    """A GPU-sized bench config, --profile or a weight format on the CPU are refused by name."""
    r = _bench("--device", "cpu", "--family", "beam")
    assert r.returncode == 2 and "times a checkpoint (--model PATH)" in r.stdout
    path = write_tiny("llama", tmp_path / "ckpt", seed=3)
    r = _bench("--device", "cpu", "--model", str(path), "--profile")
    assert r.returncode == 2 and "--profile and --quantization are GPU-only" in r.stdout


def test_tensor_parallel_decode_bench_on_cpu_ranks(tmp_path) -> None:
    """`bench decode --tensor-parallel-size 2 --device cpu --model DIR`: the model on two gloo
    ranks driven by rank 0's engine, a rate and a rank's roofline a batch, and the summary line;
    with --profile the collectives' time a step; what it cannot time on several ranks is refused
    by name before any rank starts."""
    path = write_tiny("llama", tmp_path / "ckpt", seed=4)
    r = _bench("--device", "cpu", "--model", str(path), "--tensor-parallel-size", "2",
               "--batches", "1,2", "--new-tokens", "6")  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 ranks (tensor parallel MoE) on CPUs, gloo" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    got = re.fullmatch(r"decode_tp2_llama b1=([\d.]+) roofline_b1=(\d+) b2=([\d.]+) roofline_b2=(\d+)", last)
    assert got and all(float(v) > 0 for v in got.groups()), r.stdout
    r = _bench("--device", "cpu", "--model", str(path), "--tensor-parallel-size", "2", "--profile",
               "--batches", "2", "--new-tokens", "4")  # fmt: skip
    share = re.search(r"^ +2 +([\d.]+) +([\d.]+) +([\d.]+)%$", r.stdout, re.M)
    assert r.returncode == 0 and share, r.stdout + r.stderr[-2000:]
    assert 0 < float(share[2]) < float(share[1])  # gloo collectives take part of a profiled step
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    r = _bench(
        "--device", "cpu", "--model", str(path), "--tensor-parallel-size", "2", "--speculative-config", spec
    )
    assert r.returncode == 2 and "--speculative-config run on one rank only" in r.stdout
    if torch.cuda.device_count() < 2:
        r = _bench("--tensor-parallel-size", "2", "--family", "llama")
        assert r.returncode == 2 and "needs 2 GPUs;" in r.stdout


def test_random_model_takes_the_bench_or_the_release_shapes(tmp_path) -> None:
    """The ranks' bench and `bench agentic --random-weights` serve a random-weight folder: the
    spec's bench config (Beam: 8 layers, 64 experts) or with release the spec's own (the release
    checkpoint's 52 layers, 256 experts); keep_vocab keeps the config's vocabulary, refused when
    the tokenizer's ids do not fit in it."""
    bench = random_model("beam", None, tmp_path / "bench", 1024, keep_vocab=True)
    release = random_model("beam", '{"num_experts_per_tok": 4}', tmp_path / "release", 1024, release=True)
    b, r = (json.loads((f / "config.json").read_text()) for f in (bench, release))
    assert (b["num_hidden_layers"], b["num_experts"], b["vocab_size"]) == (8, 64, 151936)
    assert (r["num_hidden_layers"], r["num_experts"], r["num_experts_per_tok"]) == (52, 256, 4)
    assert r["vocab_size"] == 49152 and r["max_position_embeddings"] == 1024  # the tokenizer's, as served
    with pytest.raises(ValueError, match="llama's vocabulary of 32000 does not hold the tokenizer's 49152"):
        random_model("llama", None, tmp_path / "llama", 1024, release=True, keep_vocab=True)


def test_bench_flags_that_would_be_ignored_are_refused() -> None:
    """The ranks' flags outside `bench decode`, expert parallelism without ranks and --release
    on the one-rank path: exit 2, said why. (A non-bf16 dtype on CUDA is refused after the GPU
    check: not reachable here.)"""
    for argv, said in (
        (["agentic", "--tensor-parallel-size", "2"], "are decode's (agentic: --serve-flags)"),
        (["decode", "--enable-expert-parallel"], "--enable-expert-parallel needs --tensor-parallel-size"),
    ):
        r = subprocess.run([sys.executable, "-m", "dayzero.sdk.cli", "bench", *argv], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
        assert r.returncode == 2 and said in r.stderr, (argv, r.stderr)
    r = _bench("--release", "--family", "beam")
    assert r.returncode == 2 and "--release goes with --tensor-parallel-size N" in r.stdout
