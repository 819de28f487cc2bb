"""`dayzero tiny FAMILY OUT`: a small random HF-format checkpoint written by the reference class.

Weights are drawn so that activations stay O(1) (std 1/sqrt(fan_in) for matrices; norm weights
1 + N(0, 0.1^2) as applied: N(0, 0.1^2) for a zero-centred norm computing x (1 + w), one the
reference class initialises to zeros; biases, gate biases and router correction biases
N(0, 0.1^2)), which makes
parity meaningful: logits spread over several units, no near-ties from a near-zero init.
A byte-level BPE tokenizer is trained in-process on a fixed text, so nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dayzero.sdk.families import FAMILIES
from dayzero.sdk.spec.reference import merge, reference_class

CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. Water boils at one hundred degrees. "
    "A day-zero release serves a new model on the day it ships. The scheduler plans each step; "
    "the engine runs the model and samples the next token. Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12. "
    "def add(a, b):\n    return a + b\n"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif name.endswith("norm.weight") or "layernorm" in name or name.endswith("norm"):
                one = 0.0 if bool((p == 0).all()) else 1.0  # a zero-centred norm applies 1 + w
                p.copy_(one + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def write_tokenizer(out: Path, vocab: int) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(out)
    return {"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id}


def write_tiny(family: str, out: str | Path, seed: int = 0, overrides: dict | None = None) -> Path:
    fam = FAMILIES.get(family)
    spec = fam.spec.spec
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fields = merge(dict(spec.tiny), dict(overrides or {}))
    special = write_tokenizer(out, int(fields.get("vocab_size", 512)))
    cls = reference_class(spec.reference)
    torch.manual_seed(seed)
    model = cls(cls.config_class(**(fields | special)))
    _randomize(model, seed)
    model.save_pretrained(out)
    (out / "dayzero-tiny.json").write_text(json.dumps({"family": family, "seed": seed, "overrides": fields}))
    return out
