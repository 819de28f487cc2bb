"""generation_config.json's sampling values are the defaults of requests that leave them unset
(vLLM's `--generation-config auto`); a request's own values win; do_sample false means greedy."""

from __future__ import annotations

import fnmatch
import json
from types import SimpleNamespace

import pytest

from dayzero.sdk.api import generation_defaults
from dayzero.sdk.server.protocol import CompletionRequest
from dayzero.sdk.server.validate import sampling_params


@pytest.mark.parametrize(
    ("gen", "want"),
    [
        (
            {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2},
            {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
        ),
        ({"do_sample": False, "temperature": 0.6}, {"temperature": 0.0}),
        ({"max_new_tokens": 10}, {}),
    ],
)
def test_generation_defaults_read(tmp_path, gen: dict, want: dict) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    assert generation_defaults(tmp_path) == want
    assert generation_defaults(tmp_path / "nowhere") == {}


def test_unset_fields_take_the_checkpoint_defaults() -> None:
    state = SimpleNamespace(
        max_model_len=512, sampling_defaults={"temperature": 0.6, "top_k": 20, "min_p": 0.1}
    )
    unset = sampling_params(state, CompletionRequest(prompt="x", max_tokens=4), 3, 0, 0)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.min_p) == (0.6, 20, 1.0, 0.1)
    own = sampling_params(
        state, CompletionRequest(prompt="x", max_tokens=4, temperature=1.0, top_k=5), 3, 0, 0
    )
    assert (own.temperature, own.top_k, own.min_p) == (1.0, 5, 0.1)


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    from dayzero.sdk.api import LLM
    from dayzero.sdk.parity.tiny import write_tiny

    path = write_tiny("llama", tmp_path_factory.mktemp("gen") / "ckpt", seed=5)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.8, "top_k": 1}))
    return LLM(str(path), device="cpu", progress=False)


def test_offline_generate_takes_the_checkpoints_defaults(tiny_llm) -> None:
    """LLM.generate with no SamplingParams samples with generation_config.json's values (here
    top_k 1: the greedy tokens at any temperature); given SamplingParams are used as they are."""
    from dayzero.sdk.engine.sampling import SamplingParams

    prompt = "the quick brown fox"
    greedy = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    assert tiny_llm.default_sampling_params().top_k == 1
    for attempt in range(3):  # unseeded draws: top_k 1 leaves one token each step
        with_defaults = tiny_llm.generate(prompt)[0].outputs[0]
        assert with_defaults.token_ids == greedy.token_ids, attempt
    own = [
        tiny_llm.generate(prompt, SamplingParams(temperature=0.8, max_tokens=16, seed=s))[0]
        .outputs[0]
        .token_ids
        for s in (0, 1, 7)
    ]
    assert any(toks != greedy.token_ids for toks in own)  # no top_k 1 there: sampled


def test_token_id_prompts_as_vllm(tiny_llm) -> None:
    from dayzero.sdk.engine.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    text = tiny_llm.generate("hello there", greedy)[0]
    ids = tiny_llm.generate({"prompt_token_ids": text.prompt_token_ids}, greedy)[0]
    assert ids.prompt is None and ids.outputs[0].token_ids == text.outputs[0].token_ids
    assert (
        tiny_llm.generate({"prompt": "hello there"}, greedy)[0].outputs[0].token_ids
        == text.outputs[0].token_ids
    )
    with pytest.raises(ValueError, match="prompt_token_ids must be a non-empty list of ids"):
        tiny_llm.generate({"prompt_token_ids": [1, 10**9]}, greedy)
    with pytest.raises(TypeError, match="a prompt is a str"):
        tiny_llm.generate({"prompt_ids": [1]}, greedy)


def test_a_hub_id_fetches_the_template_files_too(monkeypatch, tmp_path) -> None:
    """A hub id is fetched with the chat template files (`chat_template.jinja`) beside the
    weights, config and tokenizer (huggingface_hub replaced: nothing is downloaded)."""
    import huggingface_hub

    from dayzero.sdk.api import resolve_model

    seen = {}

    def fake(repo_id: str, allow_patterns: list[str]) -> str:
        seen["repo"], seen["patterns"] = repo_id, allow_patterns
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model("someone/some-model") == tmp_path
    assert seen["repo"] == "someone/some-model"
    for name in ("chat_template.jinja", "config.json", "model-00001-of-00002.safetensors", "tokenizer.json"):
        assert any(fnmatch.fnmatch(name, p) for p in seen["patterns"]), name


def test_the_server_takes_the_checkpoints_defaults(tmp_path) -> None:
    """Through `dayzero serve`: a request that leaves the sampling fields unset gets the
    checkpoint's generation_config.json values (top_k 1 here: the greedy answer at temperature
    0.8), one that sets them gets its own."""
    import httpx
    from server_fixture import Server

    from dayzero.sdk.parity.tiny import write_tiny

    path = write_tiny("llama", tmp_path / "ckpt", seed=5)
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.8, "top_k": 1}))
    s = Server(str(path))
    try:
        url = f"{s.url}/v1/completions"

        def ids(**kw) -> list[int]:
            body = {"prompt": "the quick brown fox", "max_tokens": 12, "return_token_ids": True, **kw}
            return httpx.post(url, json=body, timeout=60).json()["choices"][0]["token_ids"]

        greedy = ids(temperature=0)
        assert all(ids() == greedy for _ in range(3))  # unset: top_k 1 from the checkpoint
        own = [ids(top_k=0, seed=seed) for seed in (0, 1, 7)]  # top_k set: sampled at 0.8
        assert any(o != greedy for o in own)
    finally:
        s.stop()
