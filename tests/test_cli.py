"""The `dayzero` command: help and the scheduler benchmark's output contract."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dayzero.sdk.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_help_lists_the_verbs():
    r = run("--help")
    assert r.returncode == 0
    assert "bench" in r.stdout


def test_bench_scheduler_prints_a_table_and_the_summary_line():
    r = run("bench", "scheduler", "--sizes", "4,8", "--steps", "30")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    rows = [ln for ln in lines if re.match(r"^\s+(4|8)\s", ln)]
    assert len(rows) == 2
    last = lines[-1]
    assert re.fullmatch(r"scheduler_vs_tokenspeed( (\d+\.\d{3}|n/a)){2}", last), last
    for value in last.split()[1:]:
        if value != "n/a":
            assert 0 < float(value) < 10


def test_bench_agentic_prints_turns_and_the_summary_line(tmp_path):
    """The agentic shape on the CPU: a tiny checkpoint served by `dayzero serve`, 2 agents of 2-3
    turns (seeded), small sizes; the output's shape and that later turns hit the prefix cache
    (whole 16-token blocks of the history: at least the first prompt's 48 tokens)."""
    from dayzero.sdk.parity.tiny import write_tiny

    ckpt = write_tiny("llama", tmp_path / "ckpt", seed=4)
    r = run(
        "bench", "agentic", "--model", str(ckpt), "--agents", "2", "--turns", "2-3", "--first-turn", "48",
        "--turn-tokens", "16", "--max-output", "6", "--device", "cpu", "--seed", "3",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    rows = [ln.split() for ln in lines if re.match(r"^\s+[01]\s+[1-3]\s", ln)]
    assert {int(x[0]) for x in rows} == {0, 1} and 4 <= len(rows) <= 6
    for _agent, turn, _prompt, cached, output, *_ in rows:
        assert int(output) == 6 and (int(cached) == 0 if turn == "1" else int(cached) >= 48), rows
    m = re.fullmatch(
        r"agentic per_user_tok_s=([\d.]+) ttft_p50=([\d.]+) ttft_p99=([\d.]+) hit_rate=([\d.]+)"
        r" total_s=([\d.]+)",
        lines[-1],
    )
    assert m and 0 < float(m[4]) <= 1 and float(m[1]) > 0, lines[-1]


def test_bench_agentic_random_weights_serves_the_bench_config():
    """--random-weights: the family's bench config (shrunk here by --set) served with random
    weights (`--load-format dummy`) and the embedded tokenizer, no checkpoint on disk; the output
    keeps its shape and later turns hit the prefix cache."""
    tiny = {
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "mlp_layer_types": ["dense", "sparse"],
    }  # fmt: skip
    r = run(
        "bench", "agentic", "--random-weights", "--family", "beam", "--set", json.dumps(tiny),
        "--agents", "1", "--turns", "2", "--first-turn", "48", "--turn-tokens", "16", "--max-output", "6",
        "--device", "cpu",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "serving the beam bench config with random weights" in r.stdout
    m = re.search(r"agentic per_user_tok_s=([\d.]+) .* hit_rate=([\d.]+)", r.stdout)
    assert m and float(m[1]) > 0 and float(m[2]) > 0.5, r.stdout[-1500:]


def test_unknown_bench_part_is_refused():
    r = run("bench", "nonsense")
    assert r.returncode == 2
    assert "invalid choice" in r.stderr


def test_help_lists_every_verb():
    r = run("--help")
    for verb in ("bench", "generate", "specs", "new", "codegen", "tiny", "parity", "kernels"):
        assert verb in r.stdout, verb


def test_specs_lists_the_families_with_their_support():
    r = run("specs")
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln for ln in r.stdout.splitlines()[1:]}
    assert set(rows) >= {"beam", "llama"}
    assert "moe" in rows["beam"] and "nextn (soon)" in rows["glm53"]
    assert "yes (batched, batched_select, reference)" in rows["llama"]


def test_kernels_shows_every_op_and_the_selection():
    r = run("kernels", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    expected = {
        "gqa_attention": "batched",
        "moe_experts": "reference",
        "moe_route": "reference",
        "rms_norm": "reference",
        "rope": "reference",
        "sample": "batched",
        "swiglu": "reference",
    }
    for op, backend in expected.items():  # grouped_mm MoE is CUDA-only: the CPU keeps the reference
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith(op + " "))
        assert line.split()[1] == backend, line


def test_kernel_override_to_an_unknown_backend_is_refused(monkeypatch):
    monkeypatch.setenv("DAYZERO_KERNEL_RMS_NORM", "nope")
    r = run("kernels", "--device", "cpu")
    assert r.returncode == 2
    assert "unknown backend for op 'rms_norm' 'nope'; known: reference" in r.stderr


def test_codegen_check_passes_on_the_committed_files():
    r = run("codegen", "--check")
    assert r.returncode == 0, r.stderr
    assert "0 stale file(s)" in r.stdout


def test_quantized_tiny_then_parity_and_generate(tmp_path):
    """`dayzero tiny --quantization fp8 --layout deepseek` (ModelOpt's numbers, DeepSeek's names),
    then parity against the dequantized reference, and `generate` serving it."""
    ckpt = str(tmp_path / "ckpt")
    r = run(
        "tiny",
        "llama",
        ckpt,
        "--quantization",
        "fp8",
        "--layout",
        "deepseek",
        "--set",
        '{"num_hidden_layers": 2}',
    )
    assert r.returncode == 0, r.stderr
    assert '"quant_method": "fp8"' in (tmp_path / "ckpt" / "config.json").read_text()
    r = run("parity", "--checkpoint", ckpt, "--device", "cpu")
    assert r.returncode == 0 and r.stdout.strip().endswith("parity PASSED"), r.stdout + r.stderr
    r = run(
        "generate", ckpt, "--prompt", "The capital", "--max-tokens", "4", "--device", "cpu", "--show-prompt"
    )
    assert r.returncode == 0 and "The capital" in r.stdout, r.stderr
    r = run("tiny", "llama", str(tmp_path / "x"), "--quantization", "nvfp4", "--layout", "gpt_oss")
    assert r.returncode == 2 and "nvfp4 is written as modelopt, not 'gpt_oss'" in r.stderr


def test_tiny_then_parity_with_the_family_found_from_the_checkpoint(tmp_path):
    r = run("tiny", "llama", str(tmp_path / "ckpt"), "--seed", "7", "--set", '{"num_hidden_layers": 2}')
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ckpt" / "config.json").exists() and (tmp_path / "ckpt" / "tokenizer.json").exists()
    r = run("parity", "--checkpoint", str(tmp_path / "ckpt"), "--seed", "7", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "parity llama on cpu/float32" in r.stdout and r.stdout.strip().endswith("parity PASSED")
    from dayzero.sdk.parity.runner import CHECKS

    assert len(CHECKS) == 6 and "retraction (recompute)" in CHECKS
    for i, check in enumerate(CHECKS, 1):
        assert re.search(rf"^{re.escape(check)}\s+ok\s", r.stdout, re.M), check
        assert f"parity [{i}/6] {check} ...\n" in r.stderr  # progress: a line as each check starts
        assert re.search(rf"^parity \[{i}/6\] {re.escape(check)}: ok in [\d.]+ s$", r.stderr, re.M)
    assert "nan" not in r.stdout  # a column a check does not measure reads "-"
    prefill = next(ln for ln in r.stdout.splitlines() if ln.startswith("prefill logits"))
    assert prefill.split()[4:6] == ["-", "-"], prefill  # no logprobs, no token agreement there


def test_generate_runs_a_checkpoint_and_prints_the_continuation(tmp_path):
    run("tiny", "beam", str(tmp_path / "ckpt"), "--seed", "1")
    r = run(
        "generate",
        str(tmp_path / "ckpt"),
        "--prompt",
        "The capital of",
        "--prompt",
        "def add",
        "--max-tokens",
        "5",
        "--device",
        "cpu",
    )
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) >= 2


def test_new_drafts_a_spec_that_validates(tmp_path):
    import json

    from dayzero.sdk.spec.reference import reference_config

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(reference_config("transformers.BeamForCausalLM", {"num_hidden_layers": 7})))
    r = run("new", "beamish", "--from-config", str(cfg), "--out", str(tmp_path / "beamish"))
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "beamish" / "spec.yaml").read_text()
    assert "# check:" in text and "kind: moe" in text and "rule: field" in text
    r = run("new", "beamish", "--from-config", str(cfg), "--out", str(tmp_path / "beamish"))
    assert r.returncode == 2 and "not overwriting" in r.stderr


def test_bad_checkpoint_is_a_clear_error_not_a_traceback(tmp_path):
    r = run("generate", str(tmp_path), "--prompt", "x", "--device", "cpu")
    assert r.returncode == 2
    assert "not a checkpoint folder" in r.stderr or "no config.json" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_refuses_flags_it_cannot_honour_before_loading():
    for flags, why in (
        (
            ["--tensor-parallel-size", "3", "--nnodes", "2"],
            "--tensor-parallel-size 3 is not a multiple of --nnodes 2",
        ),
        (["--tensor-parallel-size", "2", "--nnodes", "2"], "several hosts need --master-port"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size 0, --nnodes 1: at least 1 each"),
        (["--quantization", "nvfp4"], "--quantization nvfp4: the checkpoint is not quantized"),
        (["--kv-cache-dtype", "fp8"], "kv-cache-dtype fp8"),
    ):
        r = run("serve", "--port", "0", *flags)
        assert r.returncode == 2 and why in r.stderr, r.stderr


def test_a_hub_id_without_network_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("generate", "someorg/somemodel", "--prompt", "x", "--device", "cpu")
    assert r.returncode == 2
    assert "not a local path" in r.stderr and "without network access" in r.stderr


def test_vllm_flag_names_and_units() -> None:
    """vLLM's names parse to the same settings: --kv-cache-memory-bytes, --long-prefill-token-
    threshold (SGLang's --chunked-prefill-size), --swap-space in GiB as vLLM has it."""
    import argparse

    from dayzero.sdk.server.serve import add_arguments, engine_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(
        ["--kv-cache-memory-bytes", "64MiB", "--long-prefill-token-threshold", "256", "--swap-space", "2"]
    )
    b = p.parse_args(["--kv-cache-memory", "64MiB", "--chunked-prefill-size", "256", "--swap-space", "2GiB"])
    ca, cb = engine_config(a, "cpu"), engine_config(b, "cpu")
    assert ca == cb
    assert ca.kv_cache_bytes == 64 << 20 and ca.chunk_size == 256 and ca.host_cache_bytes == 2 << 30
    vllm = p.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])  # a vLLM tool line
    assert vllm.tool_call_parser == "hermes"


def test_vllm_api_key_variable(monkeypatch) -> None:
    import argparse

    from dayzero.sdk.server.serve import add_arguments, api_keys

    p = argparse.ArgumentParser()
    add_arguments(p)
    monkeypatch.setenv("VLLM_API_KEY", "v-one")
    monkeypatch.setenv("DAYZERO_API_KEY", "d-one, d-two")
    assert set(api_keys(p.parse_args(["--api-key", "a-one"]))) == {"a-one", "d-one", "d-two", "v-one"}


def test_agentic_roofline_counts_the_weights_and_the_kv_at_the_mean_context(tmp_path):
    """The agentic roofline (shapes only, no GPU): a step reads the weights once and, per request,
    K and V of every layer over its context, so the bytes grow by L * 2 * Hkv * D * 2 (bf16) a
    token of context and a request; the mean context weighs each turn's prompt + half its answer
    by its answer tokens."""
    from dayzero.sdk.bench.agentic import Turn, roofline
    from dayzero.sdk.loader import open_checkpoint
    from dayzero.sdk.parity.tiny import write_tiny

    ckpt = open_checkpoint(write_tiny("llama", tmp_path / "ckpt", seed=4))
    hf = ckpt.hf
    kv_row = 2 * hf["num_key_value_heads"] * (hf["hidden_size"] // hf["num_attention_heads"]) * 2  # K, V bf16
    per_token = hf["num_hidden_layers"] * kv_row
    bw = 1e12
    turns = [Turn(0, 1, 1000, 0, 100, 0.1, 1.0), Turn(0, 2, 3000, 900, 300, 0.1, 1.0)]
    ctx = int(((1000 + 50) * 100 + (3000 + 150) * 300) / 400)
    one = bw / roofline(ckpt, turns, 1, bw)  # bytes a step
    short = bw / roofline(ckpt, [Turn(0, 1, 10, 0, 2, 0.1, 1.0)], 1, bw)  # context 11
    assert one - short == (ctx - 11) * per_token
    two = bw / roofline(ckpt, turns, 2, bw)  # two requests: the weights once, the cache twice
    assert two - one == ctx * per_token
