"""Every HF config key accounted for (default-deny): a key a spec neither reads nor checks is refused.

A config value the spec does not model would otherwise be ignored, and the model served with
other math (a Gemma checkpoint's gelu through a SwiGLU-silu spec prints garbage). So each key
of the HF config, at the top level and inside every sub-dict the spec reads from
(`text_config`, `rope_parameters.sliding_attention`, ...), must be one of:

- read by one of the spec's symbols or layer rules (`Resolver.read`; reading a mapping whole,
  e.g. `rope_parameters`, reads all of it: its keys are then checked by `ROPE_KEYS`);
- listed under the spec's `implements`, with the value(s) the blocks implement (checked);
- listed under the spec's `ignores`, with the reason it does not change the math;
- on the global list below (`NO_EFFECT`, `NO_EFFECT_PATTERNS`, `PINNED`), keys every
  transformers config has that never change a decoder's forward pass.

A null value counts as unset, as the resolver reads it. Anything else is a `SpecError` naming
the key and its value.
"""

from __future__ import annotations

from collections.abc import Iterator
from fnmatch import fnmatchcase
from typing import Any

from dayzero.sdk.blocks.rope import ROPE_TYPES
from dayzero.sdk.errors import SpecError

# The global list: keys that never change the math, wherever they appear (top level or a
# sub-config such as text_config). Reviewed: add a key here only when no checkpoint can set it to
# a value that changes the logits; anything family-specific goes in that spec's `ignores`.
NO_EFFECT: dict[str, str] = {
    # what the checkpoint is and who wrote it (family detection reads architectures / model_type)
    "architectures": "identity",
    "model_type": "identity",
    "transformers_version": "identity",
    "_name_or_path": "identity",
    "_commit_hash": "identity",
    "auto_map": "identity",
    # the dtype the weights were saved in: dayzero picks its own compute dtype
    "torch_dtype": "storage dtype",
    "dtype": "storage dtype",
    # token ids: they name tokens, the forward pass does not read them (eos is read by every spec
    # for stopping; a padding index only affects training gradients)
    "bos_token_id": "token id",
    "eos_token_id": "token id",
    "pad_token_id": "token id",
    "sep_token_id": "token id",
    "decoder_start_token_id": "token id",
    # what transformers' forward returns or caches, not what it computes
    "use_cache": "outputs",
    "output_attentions": "outputs",
    "output_hidden_states": "outputs",
    "return_dict": "outputs",
    "torchscript": "outputs",
    # training only: weight init, sequence-classification heads, the fine-tuning task
    "initializer_range": "training",
    "id2label": "training",
    "label2id": "training",
    "problem_type": "training",
    "finetuning_task": "training",
    # a memory/speed knob of transformers' feed-forward (chunks give the same result)
    "chunk_size_feed_forward": "memory",
    # generation defaults older transformers stored in config.json (generation_config's business,
    # and the request's: dayzero takes sampling from the request)
    "max_length": "generation",
    "min_length": "generation",
    "do_sample": "generation",
    "num_beams": "generation",
    "temperature": "generation",
    "top_k": "generation",
    "top_p": "generation",
    "repetition_penalty": "generation",
    "tokenizer_class": "tokenizer",
    # read by dayzero outside the spec: the quantized weight format (sdk/quant/config.py), which
    # refuses any format it does not know
    "quantization_config": "read by sdk/quant",
}
NO_EFFECT_PATTERNS = ("*dropout*",)  # training only: dropout rates (inference runs without dropout)
# generic transformers structure flags: accepted at these values only (a decoder-only forward)
PINNED: dict[str, Any] = {"is_encoder_decoder": False, "add_cross_attention": False}

# The keys sdk/blocks/rope.py's rope_table reads per RoPE type (on top of ROPE_COMMON); any other
# key inside a rope_parameters / rope_scaling mapping a spec reads whole is refused, by name.
ROPE_COMMON = ("rope_type", "type", "rope_theta")
ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": (
        "long_factor",
        "short_factor",
        "original_max_position_embeddings",
        "factor",
        "attention_factor",
    ),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "truncate",
    ),
}
assert set(ROPE_KEYS) == set(ROPE_TYPES), "ROPE_KEYS must list every type rope.py computes"
ROPE_FIELDS = ("rope_parameters", "rope_scaling")


def show_value(v: Any) -> str:
    """A config value for a message, cut to 80 characters."""
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _under(path: str, keys: Any) -> bool:
    """`path` is one of `keys`, or inside one (reading a mapping reads all of it)."""
    return any(path == k or path.startswith(k + ".") for k in keys)


def check_rope(params: dict, path: str, source: str, elsewhere: frozenset[str] = frozenset()) -> None:
    """The keys of one rope mapping are the ones rope.py reads for its type, or ones the spec
    reads, implements or ignores by their own path (`elsewhere`: Phi-3's
    `rope_parameters.partial_rotary_factor`, read into the rope's `fraction`). A per-layer-type
    mapping (`{sliding_attention: {...}, full_attention: null}`) is checked per entry."""
    if (
        params
        and all(isinstance(v, dict) or v is None for v in params.values())
        and not (set(params) & set(ROPE_COMMON))
    ):
        for k, v in params.items():
            if v is not None:
                check_rope(v, f"{path}.{k}", source, elsewhere)
        return
    kind = str(params.get("rope_type") or params.get("type") or "default")
    if kind not in ROPE_KEYS:
        raise SpecError(
            source, f"{path}.rope_type", f"rope type {kind!r} is not computed; known: {', '.join(ROPE_KEYS)}"
        )
    known = (*ROPE_COMMON, *ROPE_KEYS[kind])
    for k, v in params.items():
        if v is not None and k not in known and f"{path}.{k}" not in elsewhere:
            raise SpecError(
                source,
                f"{path}.{k}",
                f"{show_value(v)} is not read for {kind} RoPE (sdk/blocks/rope.py reads {', '.join(known)})",
            )


def unmodelled(hf: dict, read: set[str], accounted: set[str], source: str) -> Iterator[tuple[str, Any]]:
    """(path, value) of every HF config key that no field in `read` reads, that `accounted`
    (implements, ignores) does not list and that is not on the global list, in config order. A
    rope mapping read whole is checked by `check_rope` on the way (raising)."""
    # the mappings the spec reads inside (text_config, rope_parameters.sliding_attention, ...)
    parts = [p.split(".") for p in read | accounted]
    prefixes = {".".join(q[:i]) for q in parts for i in range(1, len(q))}

    def walk(d: dict, prefix: str) -> Iterator[tuple[str, Any]]:
        for k, v in d.items():
            path = f"{prefix}{k}"
            if v is None or _under(path, accounted):
                continue
            if _under(path, read):
                if isinstance(v, dict) and k in ROPE_FIELDS and path in read:
                    check_rope(v, path, source, frozenset(read | accounted))
                continue
            if k in NO_EFFECT or any(fnmatchcase(k, p) for p in NO_EFFECT_PATTERNS):
                continue
            if k in PINNED and v == PINNED[k]:
                continue
            if isinstance(v, dict) and path in prefixes:  # the spec reads inside it: each key
                yield from walk(v, f"{path}.")
                continue
            yield path, v

    yield from walk(hf, "")


def check_config_keys(
    hf: dict, read: set[str], implements: dict, ignores: dict, source: str, spec_name: str
) -> None:
    """Refuse the first HF config key that no symbol reads and that is neither implemented,
    ignored by the spec, nor on the global no-effect list: by key and value."""
    for path, v in unmodelled(hf, read, set(implements) | set(ignores), source):
        key = path.rsplit(".", 1)[-1]
        if key in PINNED:
            raise SpecError(
                source, path, f"{show_value(v)} is not served (a decoder-only model has {PINNED[key]!r})"
            )
        raise SpecError(
            source,
            path,
            f"{show_value(v)} is not modelled by {spec_name}: read it in a symbol, list it under "
            "`implements` with the value(s) the blocks implement, or under `ignores` with the "
            "reason it does not change the math",
        )
