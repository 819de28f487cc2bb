"""A test backend for the sampler that replays scripted answers (loaded through
DAYZERO_KERNEL_MODULES=scripted_kernels, chosen with DAYZERO_KERNEL_SAMPLE=scripted): the file
named by DAYZERO_SCRIPT_FILE maps a request seed to token ids; a row whose generator was seeded
with one of them gets the script's next token (from its start again once the script is used
up), every other row the reference sampler's. So a tiny or random model "writes" exactly the
tool calls a test needs, through the real engine, detokenizer, parser and server."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dayzero.kernels.reference.sampling import sample
from dayzero.kernels.registry import OPS, Capabilities, register

_next: dict[int, int] = {}  # seed -> index of its next scripted token


@register("sample", "scripted", Capabilities(features=OPS.get("sample").features, priority=-1))
def scripted_sample(logits: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, _ = sample(logits, batch)
    path = os.environ.get("DAYZERO_SCRIPT_FILE")
    scripts = {int(k): v for k, v in json.loads(Path(path).read_text()).items()} if path else {}
    for row, gen in enumerate(batch.generators):
        seed = None if gen is None else gen.initial_seed()
        if seed in scripts:
            i = _next.get(seed, 0)
            tokens[row] = scripts[seed][i]
            _next[seed] = (i + 1) % len(scripts[seed])
    lp = torch.log_softmax(logits.float(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, lp
