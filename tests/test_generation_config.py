"""generation_config.json's sampling values are the defaults of requests that leave them unset
(vLLM's `--generation-config auto`); a request's own values win; do_sample false means greedy."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dayzero.sdk.api import generation_defaults
from dayzero.sdk.server.app import sampling_params
from dayzero.sdk.server.protocol import CompletionRequest


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
